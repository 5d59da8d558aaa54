#!/usr/bin/env python3
"""zeroshard-ckpt against independent readers: h5py for consolidate, a plain
JSON + numpy safetensors reader for export, and deliberately damaged copies
for verify.

Usage: check_cli.py BUILD_DIR RUN_DIR...   (each RUN_DIR: a checkpoint run with expected.json)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pycheck import check  # noqa: E402  (an assert that python -O keeps)


def ckpt(build, *args, expect=0):
    p = subprocess.run([os.path.join(build, "zeroshard-ckpt"), *args], capture_output=True, text=True)
    check(p.returncode == expect,
          lambda: f"zeroshard-ckpt {' '.join(args)}: exit {p.returncode}, expected {expect}\n{p.stdout}{p.stderr}")
    return p.stdout + p.stderr


def read_safetensors(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    kinds = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "BF16": np.uint16, "F16": np.float16}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        a = np.frombuffer(data[b:end], dtype=kinds[e["dtype"]]).reshape(e["shape"])
        if e["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = (e["dtype"], a)
    return header, out


def bf16_round(x):  # float32 -> bfloat16 (as float32), round to nearest even
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def main(build, run_dir):
    expected = json.load(open(os.path.join(run_dir, "expected.json")))
    work = tempfile.mkdtemp(prefix="zs-cli-")
    out = ckpt(build, "inspect", run_dir, "--params")
    with open(os.path.join(run_dir, "latest")) as f:
        step_dir = os.path.join(run_dir, f.read().strip())
    manifest = json.load(open(os.path.join(step_dir, "manifest.json")))
    check(f"saved by {manifest['world_size']} ranks" in out and "embed.weight" in out, out)
    out = ckpt(build, "verify", run_dir)
    check("OK" in out, f"zeroshard-ckpt verify {run_dir}: no OK in its output:\n{out}")

    # verify: damaged copies are named, with the reason, and exit 1
    rank0 = manifest["files"][0]["name"]
    for what, damage, reason in [
        ("truncated", lambda d: os.truncate(os.path.join(d, rank0), os.path.getsize(os.path.join(d, rank0)) // 2), "truncated"),
        ("flipped", lambda d: flip(os.path.join(d, rank0)), "corrupt"),
        ("missing", lambda d: os.remove(os.path.join(d, rank0)), "missing"),
    ]:
        d = os.path.join(work, what)
        shutil.copytree(step_dir, d)
        damage(d)
        out = ckpt(build, "verify", d, expect=1)
        check("BAD" in out and rank0 in out and reason in out, (what, out))
    # a hand-edited manifest (the first piece one element longer): its checksum fails; without
    # manifest.xxh3 (older checkpoints) the pieces no longer cover the parameter exactly once
    for what, drop_sum, reason in [("edited", False, "fails its checksum"), ("edited-nosum", True, "do not cover")]:
        d = os.path.join(work, what)
        shutil.copytree(step_dir, d)
        with open(os.path.join(d, "manifest.json")) as f:
            m = json.load(f)
        m["params"][0]["pieces"][0][2] += 1
        with open(os.path.join(d, "manifest.json"), "w") as f:
            json.dump(m, f, indent=1)
        if drop_sum:
            os.remove(os.path.join(d, "manifest.xxh3"))
        out = ckpt(build, "verify", d, expect=1)
        check("BAD" in out and reason in out, (what, out))

    # consolidate: every full parameter (and moment), read back by h5py
    cons = os.path.join(work, "full.h5")
    ckpt(build, "consolidate", run_dir, cons, "--moments")
    with h5py.File(cons, "r") as f:
        for p in manifest["params"]:
            check(list(f[p["name"]].shape) == p["shape"], p["name"])
            check(np.array_equal(f[p["name"]][:].reshape(-1).astype(np.float64), np.asarray(expected[p["name"]])), p["name"])
            check(f["optimizer/exp_avg_sq/" + p["name"]].shape == f[p["name"]].shape,
                  lambda: f"{cons}: optimizer/exp_avg_sq/{p['name']} has shape "
                          f"{f['optimizer/exp_avg_sq/' + p['name']].shape}, the parameter {f[p['name']].shape}")
        for r in manifest["replicated"]:
            check(f[r["name"]].attrs["dtype"] in (r["dtype"], r["dtype"].encode()), r["name"])

    # export: fp32 exactly, bf16 rounded to nearest even; names mapped; buffers only on request
    names = {p["name"]: "model." + p["name"] for p in manifest["params"]}
    with open(os.path.join(work, "map.json"), "w") as f:
        json.dump(names, f)
    for dtype in ("float32", "bfloat16"):
        path = os.path.join(work, f"w_{dtype}.safetensors")
        ckpt(build, "export", run_dir, path, "--safetensors", "--dtype", dtype, "--name-map", os.path.join(work, "map.json"))
        header, tensors = read_safetensors(path)
        check((8 + int.from_bytes(open(path, "rb").read(8), "little")) % 8 == 0, "header padded to 8 bytes")
        for p in manifest["params"]:
            kind, a = tensors["model." + p["name"]]
            want = np.asarray(expected[p["name"]], dtype=np.float32).reshape(p["shape"])
            if dtype == "bfloat16":
                check(kind == "BF16" and np.array_equal(a, bf16_round(want)), p["name"])
            else:
                check(kind == "F32" and np.array_equal(a, want), p["name"])
        buffers = [r["name"] for r in manifest["replicated"] if r["kind"] == "buffer"]
        check(not any(b in tensors for b in buffers), "buffers are exported only with --buffers")
    path = os.path.join(work, "with_buffers.safetensors")
    ckpt(build, "export", run_dir, path, "--safetensors", "--buffers")
    _, tensors = read_safetensors(path)
    for r in manifest["replicated"]:
        kind, a = tensors[r["name"]]
        check(np.array_equal(a.reshape(-1).astype(np.float64), np.asarray(expected[r["name"]])), r["name"])
    print(f"check_cli: inspect, verify (3 damages), consolidate and export (fp32, bf16, name map, buffers) of {step_dir} match")
    shutil.rmtree(work)


def flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes([b[0] ^ 0x5A]))


if __name__ == "__main__":
    for run in sys.argv[2:]:
        main(sys.argv[1], run)
