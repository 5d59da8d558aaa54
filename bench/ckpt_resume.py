#!/usr/bin/env python3
"""Resume time after a preemption: SIGTERM to zeroshard-run -> every rank
saves and exits (stop), then a new zeroshard-run -> load -> first step done
(start). Uses tests/soak/soak_train (zs_tests --helper soak_train) at --width (2048: 50M parameters).

Usage: bench/ckpt_resume.py BUILD_DIR [--nproc 4] [--width 2048] [--repeats 3]
Prints one "ROW |...|" line per measurement and the medians.
"""
import argparse
import os
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
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="zs-resume-", dir=args.build)
    cmd = [os.path.join(args.build, "zeroshard-run"), "--nproc-per-node", str(args.nproc), "--grace-period", "60", "--",
           os.path.join(args.build, "tests", "zs_tests"), "--helper", "soak_train", "--dir", os.path.join(work, "ckpt"), "--out",
           os.path.join(work, "out"), "--steps", "100000", "--save-every", "1000000", "--width", str(args.width)]

    def start():
        t0 = time.time()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in p.stderr:
            if "first step of this run done" in line:
                return p, time.time() - t0
        raise SystemExit("soak_train ended before its first step")

    stops, starts = [], []
    p, _ = start()  # a fresh run (nothing to resume yet)
    for i in range(args.repeats):
        time.sleep(2)
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        p.stderr.read()
        rc = p.wait()
        stops.append(time.time() - t0)
        assert rc == 75, f"expected exit 75 after a preemption, got {rc}"
        p, s = start()
        starts.append(s)
        print(f"ROW | {i + 1} | {stops[-1]:.2f} | {starts[-1]:.2f} | {stops[-1] + starts[-1]:.2f} |")
    p.send_signal(signal.SIGTERM)
    p.wait()
    print(f"median: stop (SIGTERM -> saved and exited) {statistics.median(stops):.2f} s, "
          f"start (launch -> loaded -> first step) {statistics.median(starts):.2f} s, "
          f"resume {statistics.median(stops) + statistics.median(starts):.2f} s")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
