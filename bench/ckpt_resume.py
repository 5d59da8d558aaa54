#!/usr/bin/env python3
"""Resume time after a preemption: SIGTERM to zeroshard-run -> every rank
saves and exits (stop), then a new zeroshard-run -> load -> first step done
(start). Uses tests/soak/soak_train (zs_tests --helper soak_train) at --width (2048: 50M parameters).

With --durable s3://BUCKET/PREFIX (the store's settings in the environment, e.g. under
tests/checkpoint/s3_store.py; bench/durable_bench.sh runs it so): the stop also makes the step
durable, and the disk is then lost (the run directory removed): the start is a replaced host's,
its ranks copying their own files from the store. Each row then also gives the slowest rank's
copy of its own file (the "copied ... in S s" line it logs) and the start beyond that copy.

Usage: bench/ckpt_resume.py BUILD_DIR [--nproc 4] [--width 2048] [--repeats 3] [--durable URI]
Prints one "ROW |...|" line per measurement and the medians.
"""
import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--durable", default="")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="zs-resume-", dir=args.build)
    cmd = [os.path.join(args.build, "zeroshard-run"), "--nproc-per-node", str(args.nproc), "--grace-period", "60", "--",
           os.path.join(args.build, "tests", "zs_tests"), "--helper", "soak_train", "--dir", os.path.join(work, "ckpt"), "--out",
           os.path.join(work, "out"), "--steps", "100000", "--save-every", "1000000", "--width", str(args.width)]
    if args.durable:
        cmd += ["--durable", args.durable]

    def start():
        """The run started; the time to its first step, and the slowest rank's copy of its own file."""
        t0 = time.time()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        copies = []
        for line in p.stderr:
            m = re.search(r"copied [0-9.]+ MB of step-\d+/rank-\S+ from the durable tier in ([0-9.]+) s", line)
            if m:
                copies.append(float(m.group(1)))
            if "first step of this run done" in line:
                return p, time.time() - t0, max(copies, default=0.0)
        raise SystemExit("soak_train ended before its first step")

    stops, starts, copies = [], [], []
    p, _, _ = start()  # a fresh run (nothing to resume yet)
    for i in range(args.repeats):
        time.sleep(2)
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        p.stderr.read()
        rc = p.wait()
        stops.append(time.time() - t0)
        assert rc == 75, f"expected exit 75 after a preemption, got {rc}"
        if args.durable:
            shutil.rmtree(os.path.join(work, "ckpt"))  # the host's disk is lost with it
        p, s, c = start()
        starts.append(s)
        copies.append(c)
        if args.durable:
            assert c > 0, "the start copied nothing from the store"
            print(f"ROW | {i + 1} | {stops[-1]:.2f} | {starts[-1]:.2f} | {c:.2f} | {starts[-1] - c:.2f} |")
        else:
            print(f"ROW | {i + 1} | {stops[-1]:.2f} | {starts[-1]:.2f} | {stops[-1] + starts[-1]:.2f} |")
    p.send_signal(signal.SIGTERM)
    p.wait()
    if args.durable:
        print(f"median: stop (SIGTERM -> saved, durable, exited) {statistics.median(stops):.2f} s, "
              f"start on an empty disk (launch -> copied, loaded -> first step) {statistics.median(starts):.2f} s, "
              f"of which the slowest rank's copy of its own file {statistics.median(copies):.2f} s: "
              f"{statistics.median([s - c for s, c in zip(starts, copies)]):.2f} s beyond it")
    else:
        print(f"median: stop (SIGTERM -> saved and exited) {statistics.median(stops):.2f} s, "
              f"start (launch -> loaded -> first step) {statistics.median(starts):.2f} s, "
              f"resume {statistics.median(stops) + statistics.median(starts):.2f} s")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
