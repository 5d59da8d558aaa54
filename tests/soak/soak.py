#!/usr/bin/env python3
"""Kill-and-resume soak for zeroshard checkpoints.

Runs tests/soak/soak_train (zs_tests --helper soak_train) under zeroshard-run once without interruption, then
again while killing it at random moments, each time resuming, until it
finishes. Kills rotate through:
  term      SIGTERM to the launcher (a preemption notice: ranks save, exit 75)
  kill-one  SIGKILL to one rank (the launcher restarts the group: --max-restarts)
  kill-all  SIGKILL to every rank and the launcher while a checkpoint is being written
After every kill, `latest` must name a committed checkpoint whose files match
the manifest (sizes, and xxh3 as `xxhsum -H3` computes it). At the end every
rank's parameters and optimizer state must equal the uninterrupted run's, byte
for byte.

Usage: soak.py BUILD_DIR [--kills 20] [--nproc 3] [--stage 3] [--seed 1] [--async]
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pycheck import check  # noqa: E402  (an assert that python -O keeps)


def children(pid):
    """Child processes of pid, from /proc (no procps needed)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its ')'
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def verify_latest(run_dir):
    """`latest` names a committed step directory whose files match its manifest."""
    latest = os.path.join(run_dir, "latest")
    if not os.path.exists(latest):
        return None  # nothing committed yet
    with open(latest) as f:
        step_dir = os.path.join(run_dir, f.read().strip())
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(step_dir, "manifest.xxh3")) as f:
        want = f.read().strip()
    got = xxh3(os.path.join(step_dir, "manifest.json"))
    check(got == want, f"{step_dir}/manifest.json: xxh3 {got}, manifest.xxh3 says {want}")
    for e in manifest["files"]:
        path = os.path.join(step_dir, e["name"])
        size = os.path.getsize(path)
        check(size == e["bytes"], f"{path}: {size} bytes, manifest says {e['bytes']}")
        digest = xxh3(path)
        check(digest == e["xxh3"], f"{path}: xxh3 {digest}, manifest says {e['xxh3']}")
    return manifest["step"]


def unexplained_failures(launcher_err):
    """The launcher's attempts (its stderr between "restarting all ranks" lines) in which a rank failed
    although nothing of ours hit it: no rank killed by SIGKILL, no SIGTERM forwarded. A rank that crashes on
    its own (in resume, say) is restarted by --max-restarts, and only this shows it."""
    bad = []
    for attempt in launcher_err.split("zeroshard-run: restarting all ranks"):
        failures = re.findall(r"zeroshard-run: rank (\d+) \(pid \d+\) ([^;\n]+)", attempt)
        explained = "SIGKILL" in attempt or "received SIGTERM" in attempt
        if failures and not explained:
            bad.append("; ".join(f"rank {r} {what}" for r, what in failures))
    return bad


def xxh3(path):
    """xxhsum's XXH3-64 of a file, as hex: "XXH3 (path) = <hex>" (BSD style) or "XXH3_<hex>  path"
    (GNU style), by xxhsum version."""
    out = subprocess.run(["xxhsum", "-H3", path], capture_output=True, text=True, check=True).stdout.strip()
    return out.split("=")[-1].strip() if "=" in out else out.split()[0].split("_")[-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--async", dest="use_async", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    run = os.path.join(args.build, "zeroshard-run")
    train = [os.path.join(args.build, "tests", "zs_tests"), "--helper", "soak_train"]
    work = tempfile.mkdtemp(prefix="zs-soak-")
    common = ["--steps", str(args.steps), "--save-every", "10", "--stage", str(args.stage), "--slow-ms", "3"]
    if args.use_async:
        common.append("--async")

    def launch(tag, restarts):
        cmd = [run, "--nproc-per-node", str(args.nproc), "--max-restarts", str(restarts), "--grace-period", "5", "--",
               *train, "--dir", os.path.join(work, tag + "_ckpt"), "--out", os.path.join(work, tag)] + common
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    t0 = time.time()
    ref = launch("ref", 0)
    _, err = ref.communicate()
    check(ref.returncode == 0, f"uninterrupted run failed ({ref.returncode}):\n{err[-3000:]}")
    ref_seconds = time.time() - t0
    print(f"soak: uninterrupted run of {args.steps} steps on {args.nproc} ranks: {ref_seconds:.1f} s")

    kinds = ["term", "kill-one", "kill-all"]
    done_kills = {k: 0 for k in kinds}
    kills = 0
    launches = 0
    ckpt = os.path.join(work, "run_ckpt")
    while True:
        proc = launch("run", 1000)
        launches += 1
        finished = False
        while kills < args.kills:
            kind = kinds[kills % len(kinds)]
            time.sleep(rng.uniform(0.2, max(0.3, ref_seconds * 0.6)))
            if proc.poll() is not None:
                break
            if kind == "term":
                proc.send_signal(signal.SIGTERM)
            elif kind == "kill-one":
                ranks = children(proc.pid)
                if not ranks:
                    continue
                os.kill(rng.choice(ranks), signal.SIGKILL)
            else:  # kill-all, in the middle of a checkpoint write
                deadline = time.time() + 5
                while time.time() < deadline and proc.poll() is None:
                    if any(n.endswith(".tmp") for n in os.listdir(ckpt)) if os.path.isdir(ckpt) else False:
                        break
                    time.sleep(0.002)
                if proc.poll() is not None:
                    break
                for pid in children(proc.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.kill()
            kills += 1
            done_kills[kind] += 1
            if kind != "kill-one":
                break  # the launcher is gone: resume with a new one
            time.sleep(0.3)
            step = verify_latest(ckpt)
        _, err = proc.communicate()
        step = verify_latest(ckpt)
        crashes = unexplained_failures(err)
        if crashes:
            print(err[-3000:], file=sys.stderr)
            raise SystemExit(f"soak: ranks failed with nothing killing them: {crashes}")
        if proc.returncode == 0:
            finished = True
        # The kill's own outcomes only: a preempted group's 75, a killed launcher, ranks that died of the
        # signal. Exit 1 is a rank's error (a crash in resume, a failed collective) and fails the soak:
        # the launcher's --max-restarts would otherwise retry it until the bytes happened to agree.
        elif proc.returncode not in (75, -signal.SIGKILL, 128 + signal.SIGKILL, 128 + signal.SIGTERM, -signal.SIGTERM):
            print(err[-3000:], file=sys.stderr)
            raise SystemExit(f"soak: unexpected exit status {proc.returncode}")
        print(f"soak: launch {launches}: exit {proc.returncode}, latest step {step}, kills so far {kills}")
        if finished and kills >= args.kills:
            break
        if finished:  # finished before enough kills: start over from scratch with the same reference
            shutil.rmtree(ckpt, ignore_errors=True)
    for r in range(args.nproc):
        a = open(os.path.join(work, f"ref.rank{r}.bin"), "rb").read()
        b = open(os.path.join(work, f"run.rank{r}.bin"), "rb").read()
        check(len(a) > 0 and a == b, f"rank {r}: final state differs from the uninterrupted run")
    print(f"soak: {kills} kills ({done_kills}) over {launches} launches; final parameters and optimizer state "
          f"of all {args.nproc} ranks are bit-identical to the uninterrupted run")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
