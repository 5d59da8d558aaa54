#!/usr/bin/env python3
"""Reads zeroshard checkpoints with h5py alone (an independent reader) and checks
every dataset against the values the C++ side held when it saved them.

Usage: check_h5.py DIR...   (each DIR holds `latest`, a step directory and expected.json)
"""
import json
import os
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pycheck import check  # noqa: E402  (an assert that python -O keeps)


def check_run(run_dir):
    with open(os.path.join(run_dir, "latest")) as f:
        step_dir = os.path.join(run_dir, f.read().strip())
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(run_dir, "expected.json")) as f:
        expected = json.load(f)
    files = [h5py.File(os.path.join(step_dir, e["name"]), "r") for e in manifest["files"]]
    check(manifest["format"] == "zeroshard-checkpoint" and manifest["format_version"] == 1,
          f"{step_dir}/manifest.json: format {manifest['format']!r} version {manifest.get('format_version')}, "
          f"expected 'zeroshard-checkpoint' version 1")
    for r, f in enumerate(files):
        check(f.attrs["rank"] == r and f.attrs["world_size"] == manifest["world_size"], f.filename)
        entry = manifest["files"][r]
        check((f.attrs["pp_stage"], f.attrs["dp_rank"]) == (entry["pp_stage"], entry["dp_rank"]), f.filename)
        check(f["rng/cpu"].dtype == np.uint8 and f["rng/cpu"].shape[0] > 0, f.filename)
    checked = 0
    for p in manifest["params"]:
        name, numel = p["name"], int(np.prod(p["shape"], dtype=np.int64))
        check(sum(e - b for _, b, e in p["pieces"]) == numel, f"{name}: pieces do not add up")
        full = np.full(numel, np.nan, dtype=np.float32)
        for rank, begin, end in p["pieces"]:
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                ds = files[rank][kind + "/" + name]
                check(ds.dtype == np.float32 and ds.shape == (end - begin,), (name, kind, ds.shape))
                check(ds.attrs["begin"] == begin, (name, kind))
            full[begin:end] = files[rank]["master/" + name][:]
        want = np.asarray(expected[name], dtype=np.float64)
        check(not np.isnan(full).any(), f"{name}: pieces do not cover the parameter")
        check(np.array_equal(full.astype(np.float64), want), f"{name}: master differs from the saved parameter")
        checked += 1
    for rep in manifest["replicated"]:
        name = rep["name"]
        ds = files[rep.get("rank", 0)]["replicated/" + name]  # the first rank of the stage holding it
        dtype = ds.attrs["dtype"].decode() if isinstance(ds.attrs["dtype"], bytes) else ds.attrs["dtype"]
        check(dtype == rep["dtype"], (name, dtype))
        raw = ds[:].reshape(-1)
        if dtype == "BFloat16":  # stored as its 16 bits in uint16
            check(ds.dtype == np.uint16, name)
            values = (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        elif dtype == "Half":
            check(ds.dtype == np.uint16, name)
            values = raw.view(np.float16).astype(np.float64)
        else:
            values = raw.astype(np.float64)
        check(np.array_equal(values, np.asarray(expected[name], dtype=np.float64)), f"{name}: replicated value differs")
        checked += 1
    # model.h5: virtual datasets over the rank files, opened from another directory.
    view = h5py.File(os.path.abspath(os.path.join(step_dir, "model.h5")), "r")
    for p in manifest["params"]:
        name = p["name"]
        full = view[name][:]
        check(list(full.shape) == p["shape"], (name, full.shape, p["shape"]))
        check(np.array_equal(full.reshape(-1).astype(np.float64), np.asarray(expected[name])), f"model.h5 {name}")
        for kind in ("exp_avg", "exp_avg_sq"):
            pieces = [files[r][kind + "/" + name][:] for r, b, e in p["pieces"]]
            check(np.array_equal(view["optimizer/" + kind + "/" + name][:].reshape(-1), np.concatenate(pieces)),
                  f"model.h5 optimizer/{kind}/{name}")
        checked += 1
    for rep in manifest["replicated"]:
        check(np.array_equal(view[rep["name"]][:].reshape(-1),
                             files[rep.get("rank", 0)]["replicated/" + rep["name"]][:].reshape(-1)),
              f"model.h5 {rep['name']} differs from replicated/{rep['name']} of rank {rep.get('rank', 0)}")
        checked += 1
    print(f"check_h5: {step_dir}: {checked} tensors over {len(files)} rank files and model.h5 match")


if __name__ == "__main__":
    for d in sys.argv[1:]:
        check_run(d)
