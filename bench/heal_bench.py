#!/usr/bin/env python3
"""A returning replica group's heal against the link it crosses.

Usage (root: it makes network-namespace hosts): heal_bench.py BUILD_DIR
          [--rates 20mbit,100mbit,1gbit] [--config tiny] [--nproc 1] [--repeats 3]
          [--work DIR] [--json FILE]

Two hosts of the test cluster (scripts/cluster.sh), each host's link shaped to RATE in
each direction (tc tbf), an etcd member on host 0. Replica group a (bart_pretrain
--replica-group a, NPROC ranks, no checkpoints) trains on host 0; group b starts on
host 1 with no state and heals from a: each of b's ranks receives its shard position's
state (parameters, AdamW moments, step counts, the generators, the trainer's position)
over the groups' communicator, verified by checksums on both groups. Then host 1 is
killed (link down, every process SIGKILLed), a goes on alone, and host 1 comes back for
the next repeat with a new b.

Figures per heal, from b's ranks' own lines ("took its state ... N bytes on this rank
in S s"): the bytes that crossed host 1's link (every rank's, summed) over the slowest
rank's seconds. The seconds are the heal's whole collective: the layouts compared, the
state broadcast, the checksums gathered; the generators and the trainer's position
(bytes counted) go after them. "heal / link" is the heal's rate of payload against the
shaped rate (tbf counts whole frames: TCP's payload under 1500-byte frames is about 0.96
of it).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "cluster"))
sys.path.insert(0, HERE)
from check_cluster import (ENV, Cluster, cluster_heal, cluster_kill, cluster_shape, events,  # noqa: E402
                           start_etcd_member, wait_etcd)
from fault_bench import prepare  # noqa: E402  (the tokenizer and dataset, prepared once)

HEALED = re.compile(r"\[rank(\d+)\]: .*took its state from group 'a' at step (\d+) \((\d+) bytes on this rank "
                    r"in ([0-9.]+) s")
def rate_bytes(rate):
    m = re.fullmatch(r"(\d+)(kbit|mbit|gbit)", rate)
    if not m:
        raise SystemExit(f"heal_bench: rate '{rate}' must read like 500kbit, 20mbit or 1gbit")
    return int(m.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)] / 8


def wait_for(what, ok, jobs, c, timeout=300):
    deadline = time.monotonic() + timeout
    while not ok():
        for j in jobs:
            if j.proc.poll() is not None:
                raise SystemExit(f"heal_bench: {what}: host {j.host}'s job ended:\n" + c.outputs(c.jobs)[-6000:])
        if time.monotonic() > deadline:
            raise SystemExit(f"heal_bench: {what}: not within {timeout} s:\n" + c.outputs(c.jobs)[-6000:])
        time.sleep(0.1)


def bench_rate(args, rate, prepared, work):
    exe = os.path.join(args.build, "examples", "bart_pretrain")
    run = os.path.join(args.build, "zeroshard-run")
    common = ["--config", args.config, "--max-steps", "1000000", "--eval-every", "0", "--dropout", "0",
              "--no-sample", "--no-plot", "--ckpt-dir", "none", "--global-batch", "8", "--max-tokens",
              args.max_tokens, "--progress-interval", "1000", "--liveness", "2"]
    rows = []
    shutil.rmtree(work, ignore_errors=True)  # the coordinator's data of an earlier run too
    os.makedirs(work)
    with Cluster(61, 2) as c:
        for i in range(2):
            cluster_shape(c, i, rate)
        wait_etcd(c, [start_etcd_member(c, 0, 1, work)])
        coordinator = f"etcd://{c.addr(0)}:2379"
        # Every rank's heal line: info is rank 0's alone, debug every rank's.
        env = dict(ENV, ZS_LOG_LEVEL="info" if args.nproc == 1 else "debug")

        def group(i, name, run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.copytree(os.path.join(prepared, "tokenizer"), os.path.join(run_dir, "tokenizer"))
            return c.start(i, [run, "--nproc-per-node", args.nproc, "--", exe, "--dataset",
                               os.path.join(prepared, "dataset"), "--run-dir", run_dir, *common, "--replica-group", name,
                               "--coordinator", coordinator, "--replica-listen", c.addr(i)], env=env)

        a_dir = os.path.join(work, f"a-{rate}")
        a = group(0, "a", a_dir)
        wait_for("a trains", lambda: len(events(a_dir)) >= 1, [a], c)
        for k in range(args.repeats):
            b = group(1, "b", os.path.join(work, f"b-{rate}-{k}"))
            healed = {}

            def heals():
                for m in HEALED.finditer(b.output()):
                    healed[int(m.group(1))] = (int(m.group(2)), int(m.group(3)), float(m.group(4)))
                return len(healed) == args.nproc
            wait_for(f"b heals from a at {rate}", heals, [a, b], c)
            nbytes = sum(v[1] for v in healed.values())
            seconds = max(v[2] for v in healed.values())
            row = {"rate": rate, "config": args.config, "ranks": args.nproc, "step": min(v[0] for v in healed.values()),
                   "bytes": nbytes, "heal_s": seconds, "link_Bps": rate_bytes(rate)}
            row["heal_vs_link"] = nbytes / seconds / row["link_Bps"]
            print(f"{rate}: heal {k + 1}: {nbytes / 1e6:.1f} MB in {seconds:.3f} s ({nbytes / seconds / 1e6:.1f} MB/s, "
                  f"{row['heal_vs_link']:.2f} of the link) at step {row['step']}", flush=True)
            rows.append(row)
            seen = len(events(a_dir, "replica_groups"))
            cluster_kill(c, 1)
            wait_for("a goes on alone", lambda: [x["groups"] for x in events(a_dir, "replica_groups")[seen:]][-1:] == [1],
                     [a], c)
            cluster_heal(c, 1)
            cluster_shape(c, 1, rate)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("--rates", default="20mbit,100mbit,1gbit")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--max-tokens", default="64")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.build = os.path.abspath(args.build)
    work = args.work or tempfile.mkdtemp(prefix="zs-heal-bench-")
    os.makedirs(work, exist_ok=True)
    prepared = prepare(os.path.join(args.build, "examples", "bart_pretrain"), work, args.max_tokens)
    rows = []
    for rate in args.rates.split(","):
        rows += bench_rate(args, rate, prepared, os.path.join(work, rate))
    print()
    print("| link (each direction) | model, ranks per group | state healed per group | heal (median of "
          f"{args.repeats}) | heal rate | heal / link |")
    print("|---|---|---:|---:|---:|---:|")
    for rate in args.rates.split(","):
        rs = [r for r in rows if r["rate"] == rate]
        h = statistics.median(r["heal_s"] for r in rs)
        nbytes = statistics.median(r["bytes"] for r in rs)
        print(f"| {rate} | {args.config}, {args.nproc} | {nbytes / 1e6:.1f} MB | {h:.3f} s "
              f"({min(r['heal_s'] for r in rs):.3f}–{max(r['heal_s'] for r in rs):.3f}) | {nbytes / h / 1e6:.1f} MB/s | "
              f"{statistics.median(r['heal_vs_link'] for r in rs):.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
