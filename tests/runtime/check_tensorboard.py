#!/usr/bin/env python3
"""MetricsLog's TensorBoard event files, read by TensorBoard's own reader (the `tensorboard`
package's EventAccumulator, and its TFRecord reader for the records one by one) against the
metrics.jsonl written beside them (zs_tests --helper tensorboard_run):

  1. every number of every line is a scalar at the line's step and time: a step's fields under
     their names, an object's members under NAME/MEMBER, an event's under EVENT/FIELD (to float32,
     TensorBoard's scalars); nothing else is; the configuration is in the text tab.
  2. a run resumed after step 20 (different numbers from there): one curve, steps strictly
     increasing, the earlier file's steps after 20 replaced by the resumed run's.
  3. a run SIGKILLed while it writes: the file reads to its last whole record, and holds every
     step the JSON lines hold (the line goes first: at most the last is missing); every record's
     checksums hold.
  4. the file cut inside its last record: read to the record before, every other record whole.

Usage: check_tensorboard.py BUILD_DIR
"""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pycheck import check  # noqa: E402

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow  # noqa: E402


def f32(v):
    return struct.unpack("<f", struct.pack("<f", v))[0]


def lines(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def expected(run):
    """{tag: [(step, value, time)]} from the JSON lines, flattened as the docs say."""
    want = {}

    def walk(obj, prefix, top, step, t):
        for k, v in obj.items():
            if top and k in ("step", "time", "event"):
                continue
            if isinstance(v, bool) or v is None or isinstance(v, str):
                continue
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}/", False, step, t)
            elif isinstance(v, (int, float)):
                want.setdefault(prefix + k, []).append((step, f32(float(v)), t))
    for line in lines(run):
        walk(line, line["event"] + "/" if "event" in line else "", True, line["step"], line["time"])
    return want


def read(run):
    acc = EventAccumulator(os.path.join(run, "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def got_scalars(acc):
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def compare(run, what):
    want, got = expected(run), got_scalars(read(run))
    check(set(got) == set(want), lambda: f"{what}: tags only in TensorBoard {sorted(set(got) - set(want))}, only in "
                                         f"metrics.jsonl {sorted(set(want) - set(got))}")
    for tag in want:
        check(got[tag] == want[tag], lambda: f"{what}: '{tag}': TensorBoard {got[tag][:6]}..., metrics.jsonl "
                                             f"{want[tag][:6]}...")
    steps = [s for s, _, _ in got["loss"]]
    check(steps == sorted(set(steps)), lambda: f"{what}: loss's steps not strictly increasing: {steps}")
    return got


def records(path):
    """Every whole record of a file through TensorBoard's TFRecord reader (its checksums checked),
    and how it ended: 'end' (a clean end) or 'truncated'."""
    reader = pywrap_tensorflow.PyRecordReader_New(path.encode(), 0, b"", None)
    n = 0
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return n, "end"
        except errors.DataLossError as e:
            check("truncated" in str(e), lambda: f"{path}: record {n}: {e}")  # a checksum failure is not
            return n, "truncated"
        n += 1


def helper(build, run, resume, last, seed, sleep_us=0, wait=True):
    cmd = [os.path.join(build, "tests", "zs_tests"), "--helper", "tensorboard_run", run, str(resume), str(last),
           str(seed), str(sleep_us)]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    check(p.returncode == 0, lambda: f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout}{p.stderr}")
    return p.stdout.split()[-1]


def main():
    build = sys.argv[1]
    work = tempfile.mkdtemp(prefix="zs-tensorboard-")
    try:
        # 1. A run of 30 steps.
        run = os.path.join(work, "run")
        first = helper(build, run, 0, 30, 1)
        got = compare(run, "30 steps")
        check([s for s, _, _ in got["loss"]] == list(range(1, 31)), got["loss"])
        check("val_loss/wiki" in got and "checkpoint/seconds" in got and "goodput" in got, sorted(got))
        acc = read(run)
        texts = acc.Tensors("config")
        check(len(texts) == 1 and texts[0].tensor_proto.string_val[0].decode().startswith("# the run\nseed 1"),
              lambda: f"the text tab's config: {texts}")
        check(records(first) == (2 + 30 + 3 + 1, "end"), lambda: f"{first}: {records(first)}")
        # 2. Resumed after step 20 (other numbers from there): one curve.
        before = {s: v for s, v, _ in got["loss"]}
        time.sleep(0.01)
        helper(build, run, 20, 45, 2)
        got = compare(run, "resumed after step 20")
        loss = dict((s, v) for s, v, _ in got["loss"])
        check(sorted(loss) == list(range(1, 46)), sorted(loss))
        check(all(loss[s] == before[s] for s in range(1, 21)), "steps 1-20 are the first run's")
        check(sum(loss[s] != before[s] for s in range(21, 31)) >= 9, "steps 21-30 are the resumed run's")
        check(len(os.listdir(os.path.join(run, "tensorboard"))) == 2, os.listdir(os.path.join(run, "tensorboard")))
        # 3. SIGKILLed while writing.
        killed = os.path.join(work, "killed")
        p = helper(build, killed, 0, -1, 3, sleep_us=200, wait=False)
        path = p.stdout.readline().strip()
        time.sleep(0.5)
        p.send_signal(signal.SIGKILL)
        p.wait()
        n, how = records(path)
        steps = [line["step"] for line in lines(killed) if "event" not in line]
        got = got_scalars(read(killed))
        tb = [s for s, _, _ in got["loss"]]
        check(len(steps) > 20 and tb in (steps, steps[:-1]),
              lambda: f"after SIGKILL: metrics.jsonl steps 1..{steps[-1]}, TensorBoard {tb[:3]}...{tb[-3:]}")
        # 4. Cut inside its last record.
        cut = os.path.join(work, "cut")
        os.makedirs(os.path.join(cut, "tensorboard"))
        shutil.copy(os.path.join(killed, "metrics.jsonl"), cut)
        copy = os.path.join(cut, "tensorboard", os.path.basename(path))
        with open(path, "rb") as src, open(copy, "wb") as dst:
            data = src.read()
            whole = 0
            for _ in range(n):  # the offset after the last whole record
                whole += 12 + struct.unpack("<Q", data[whole:whole + 8])[0] + 4
            dst.write(data[:whole - 7])
        check(records(copy) == (n - 1, "truncated"), lambda: f"cut: {records(copy)} of {n}")
        cut_tb = [s for s, _, _ in got_scalars(read(cut))["loss"]]
        check(cut_tb == tb[:-1] or cut_tb == tb, lambda: f"cut: {cut_tb[-3:]} against {tb[-3:]}")
        print(f"tensorboard: 30 steps and a resume after step 20 read back through TensorBoard's EventAccumulator "
              f"equal to metrics.jsonl ({len(expected(run))} tags, one curve of 45 steps); SIGKILLed after "
              f"{len(steps)} steps: {n} whole records ({how}), {len(tb)} steps of loss; cut inside its last record: "
              "read to the one before", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
