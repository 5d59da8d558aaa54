#!/usr/bin/env python3
"""torchrun runs zeroshard programs as zeroshard-run does.

Usage: check_torchrun.py BUILD_DIR CHECK
  minimal     torchrun --standalone --nproc-per-node 2 --no-python examples/zs_minimal trains, and its final
              loss and parameters equal zeroshard-run's at 2 ranks bit for bit (same world size, same order of
              every sum), so the ranks found each other through torchrun's agent store
  preemption  soak_train (zs_tests --helper soak_train; ZeRO-3, checkpoints every 10 steps) under torchrun --max-restarts 1: one rank gets
              SIGUSR1 (a preemption notice) after its first step; every rank saves, exits 75, torchrun restarts
              the group, which resumes from the checkpoint (not from step 0) and finishes; every rank's final
              parameters and optimizer state equal an uninterrupted zeroshard-run run's byte for byte

The Python running this is the project environment's (ctest passes ZS_PYTHON): its torch provides torchrun.
Without torch (Debian's python3) it prints SKIP and exits 77.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "soak"))
from pycheck import check, skip  # noqa: E402  (check: an assert that python -O keeps)
try:
    import torch  # noqa: F401
except ImportError as e:
    skip(f"{sys.executable} has no torch ({e}), so no torchrun; run `make test` (the project environment)")
from soak import children  # noqa: E402

TIMEOUT = 240  # seconds for any one run


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--monitor-interval", "0.1", *args, "--no-python"]


def run(cmd, what):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    if p.returncode != 0:
        raise SystemExit(f"{what} failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p.stdout + p.stderr


def same_bytes(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def saved_tensor_bytes(path):
    """The raw storage of the one tensor torch::save wrote to `path` (a zip archive whose other
    records carry the file's name and a random serialization id)."""
    with zipfile.ZipFile(path) as z:
        data = [n for n in z.namelist() if n.endswith("/data/0")]
        check(len(data) == 1, f"{path}: expected one tensor record, found {z.namelist()}")
        return z.read(data[0])


def check_minimal(build, work):
    bin_ = [os.path.join(build, "examples", "zs_minimal"), "--steps", "60", "--global-batch", "128"]
    ref = run([os.path.join(build, "zeroshard-run"), "--nproc-per-node", "2", "--", *bin_,
               "--save-params", os.path.join(work, "ref.pt")], "zeroshard-run")
    got = run(torchrun() + [*bin_, "--save-params", os.path.join(work, "torchrun.pt")], "torchrun")
    loss = {k: re.search(r"final loss ([0-9.]+)", v) for k, v in (("zeroshard-run", ref), ("torchrun", got))}
    for k, m in loss.items():
        check(m, lambda: f"{k}: no 'final loss' line in its output:\n{ref if k == 'zeroshard-run' else got}")
    print(f"final loss: zeroshard-run {loss['zeroshard-run'].group(1)}, torchrun {loss['torchrun'].group(1)}")
    check(loss["torchrun"].group(1) == loss["zeroshard-run"].group(1), "the final losses differ")
    check(float(loss["torchrun"].group(1)) < 0.2, "torchrun's run did not train")
    ref_params, got_params = (saved_tensor_bytes(os.path.join(work, f)) for f in ("ref.pt", "torchrun.pt"))
    check(len(ref_params) > 0, f"{os.path.join(work, 'ref.pt')}: zeroshard-run saved no parameter bytes")
    if ref_params != got_params:
        import numpy as np
        a, b = np.frombuffer(ref_params, np.float32), np.frombuffer(got_params, np.float32)
        diff = np.flatnonzero(a != b) if a.shape == b.shape else []
        raise AssertionError(f"the final parameters differ between torchrun and zeroshard-run: {len(diff)} of {a.size} "
                             f"floats, max |difference| {np.abs(a - b).max() if len(diff) else 'n/a'}, first at "
                             f"{diff[:8].tolist() if len(diff) else 'n/a'}")
    print("minimal: torchrun's run equals zeroshard-run's bit for bit")


def check_preemption(build, work):
    train = [os.path.join(build, "tests", "zs_tests"), "--helper", "soak_train", "--steps", "60", "--save-every", "10", "--stage", "3",
             "--slow-ms", "20"]
    run([os.path.join(build, "zeroshard-run"), "--nproc-per-node", "2", "--", *train,
         "--dir", os.path.join(work, "ref_ckpt"), "--out", os.path.join(work, "ref")], "the uninterrupted run")

    cmd = torchrun("--max-restarts", "1") + [*train, "--dir", os.path.join(work, "ckpt"),
                                             "--out", os.path.join(work, "tr")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, first_step = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "first step of this run done" in line:
                first_step.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        check(first_step.wait(TIMEOUT), lambda: "no rank reported its first step:\n" + "".join(lines)[-4000:])
        time.sleep(0.3)  # a few steps in, past the first checkpoint or not: either must resume
        workers = children(proc.pid)
        check(len(workers) == 2, f"torchrun (pid {proc.pid}) has {len(workers)} worker processes, not 2")
        os.kill(workers[1], signal.SIGUSR1)
        proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
    out = "".join(lines)
    check(proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{out[-6000:]}")
    stops = re.findall(r"stopped after step (\d+) for a preemption", out)
    firsts = [int(s) for s in re.findall(r"first step of this run done \(step (\d+)\)", out)]
    check(stops, "no rank stopped for the preemption:\n" + out[-6000:])
    resumed = [s for s in firsts if s > 1]
    check(resumed, f"the restarted group did not resume from a checkpoint (first steps {firsts}):\n{out[-6000:]}")
    print(f"preemption: stopped after step {stops[0]}, torchrun restarted the group, which resumed at step "
          f"{min(resumed)} and finished")
    for r in range(2):
        a, b = os.path.join(work, f"ref.rank{r}.bin"), os.path.join(work, f"tr.rank{r}.bin")
        check(same_bytes(a, b), f"rank {r}'s final state differs from the uninterrupted run's")
    print("preemption: every rank's final state equals the uninterrupted run's byte for byte")


def main():
    build, which = sys.argv[1], sys.argv[2]
    work = tempfile.mkdtemp(prefix="zs-torchrun-")
    try:
        {"minimal": check_minimal, "preemption": check_preemption}[which](os.path.abspath(build), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
