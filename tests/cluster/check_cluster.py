#!/usr/bin/env python3
"""Multi-host runs on a cluster of network-namespace hosts (scripts/cluster.sh; tests/cluster/cluster.py).
Every host runs its own launcher; no address setting is given: each rank listens on the address its host
reaches the master from, so a run that finishes proves no rank listened on loopback (another host's
loopback is not this host's). Each host resolves its own name to 127.0.1.1, as Debian does: where the
master is named by host name, host 0 must take its default route's address instead.

Usage: check_cluster.py BUILD_DIR CHECK
  zero    ZeRO-1/2 and ZeRO-3 against single-process torch::optim::AdamW (the gtest oracle tests) on
          2 hosts x 2 ranks (zeroshard-run, the master by host name) and on 3 hosts x 1 rank (by IPv6
          address); then examples/zs_minimal on 2 hosts x 2 ranks under torchrun's c10d rendezvous
          (one torchrun per host): its final loss and parameters equal a one-host zeroshard-run run at
          4 ranks bit for bit
  bart    bart_pretrain across 2 hosts x 2 ranks, ZeRO-3 and --pp 2 (the pipeline's stages on different
          hosts): the per-step losses equal the same run's on one host (4 ranks) within 1e-6 relative

Exits 77 (skipped, with the reason printed) where the cluster cannot be made (not root, no namespaces).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
from cluster import Cluster  # noqa: E402
from pycheck import check  # noqa: E402  (an assert that python -O keeps)

TIMEOUT = 180  # seconds for any one multi-host run
PORT = 29611
ORACLE = "*ShardedAdamW*:*ShardedOptimizer*:FullyShard*:-FullyShardMemory*"
# At 3 ranks, the oracle tests alone and the collectives (their sizes uneven at 3).
ORACLE3 = "*MatchesAdamW*:Collectives.*"
# The hosts share this machine's 2 cores: one thread per rank, as the one-host tests get at 2+ ranks.
ENV = dict(os.environ, ZS_LOG_LEVEL="warn", OMP_NUM_THREADS="1")


def launch(c, build, hosts, nproc, master, cmd, env=None):
    """zeroshard-run on every host (host i is node i); returns every host's output, failing on any exit != 0."""
    jobs = [c.start(i, [os.path.join(build, "zeroshard-run"), "--nnodes", hosts, "--node-rank", i,
                        "--nproc-per-node", nproc, "--master-addr", master, "--master-port", PORT,
                        "--grace-period", 5, "--", *cmd], env=env)
            for i in range(hosts)]
    results = c.wait(jobs, TIMEOUT)
    check(all(code == 0 for code, _ in results), lambda: "a host's launcher failed:\n" + c.outputs(jobs))
    return [out for _, out in results]


def passed_tests(out):
    """The gtest names a rank's output reports as passed, once each."""
    return set(re.findall(r"\[       OK \] (\S+)", out))


def check_zero(build, work):
    tests = os.path.join(build, "tests", "zs_tests")
    with Cluster(11, 3) as c:
        # The master by host name, which host 0 resolves to 127.0.1.1 (as Debian does), and by IPv6 address.
        for hosts, nproc, master, tests_filter in ((2, 2, c.name(0), ORACLE), (3, 1, c.addr(0, v6=True), ORACLE3)):
            outs = launch(c, build, hosts, nproc, master, [tests, f"--gtest_filter={tests_filter}"],
                          env=dict(ENV, ZS_LOG_LEVEL="info"))
            passed = [passed_tests(o) for o in outs]
            check(all(p == passed[0] for p in passed) and len(passed[0]) >= 10,
                  lambda: f"the hosts report different or too few passing tests: {[len(p) for p in passed]}\n" +
                  "\n".join(o[-3000:] for o in outs))
            oracle = sorted(t for t in passed[0] if "MatchesAdamW" in t)
            check(oracle, f"no oracle test (MatchesAdamW) among {sorted(passed[0])}")
            if master == c.name(0):
                check("is loopback on this host but the job spans hosts" in outs[0],
                      lambda: "host 0 did not say it left loopback for its default route's address:\n" + outs[0][-3000:])
            print(f"zero: {hosts} hosts x {nproc} rank(s), master {master}: {len(passed[0])} tests pass on every "
                  f"host, {len(oracle)} of them against torch::optim::AdamW", flush=True)

        minimal = [os.path.join(build, "examples", "zs_minimal"), "--steps", "40", "--global-batch", "128"]
        ref = subprocess.run([os.path.join(build, "zeroshard-run"), "--nproc-per-node", "4", "--", *minimal,
                              "--save-params", os.path.join(work, "one_host.pt")],
                             capture_output=True, text=True, timeout=TIMEOUT)
        check(ref.returncode == 0, lambda: f"the one-host run failed:\n{ref.stdout}{ref.stderr}")
        endpoint = f"{c.name(0)}:{PORT + 1}"
        jobs = [c.start(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes", 2, "--nproc-per-node", 2,
                            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "zs-cluster",
                            "--monitor-interval", "0.1", "--no-python", *minimal,
                            "--save-params", os.path.join(work, f"torchrun{i}.pt")], env=ENV)
                for i in range(2)]
        results = c.wait(jobs, TIMEOUT)
        check(all(code == 0 for code, _ in results), lambda: "torchrun failed on a host:\n" + c.outputs(jobs))
        want = re.search(r"final loss ([0-9.]+)", ref.stdout + ref.stderr)
        got = [re.search(r"final loss ([0-9.]+)", out) for _, out in results]
        got = [m.group(1) for m in got if m]
        check(want and len(got) == 1 and got[0] == want.group(1),
              lambda: f"final loss: one host {want and want.group(1)}, torchrun across hosts {got}\n" +
              c.outputs(jobs))
        from check_torchrun import saved_tensor_bytes
        saved = [f for f in (os.path.join(work, f"torchrun{i}.pt") for i in range(2)) if os.path.exists(f)]
        check(len(saved) == 1, f"expected rank 0 alone to save its parameters, found {saved}")
        check(saved_tensor_bytes(saved[0]) == saved_tensor_bytes(os.path.join(work, "one_host.pt")),
              "the parameters after torchrun across 2 hosts differ from the one-host run's")
        print(f"zero: torchrun (c10d rendezvous at {endpoint}) on 2 hosts x 2 ranks: final loss {got[0]} and "
              "parameters equal the one-host run's bit for bit")


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, filter(str.strip, f)) if "event" not in r]


def check_bart(build, work):
    exe = os.path.join(build, "examples", "bart_pretrain")
    common = ["--data", "/usr/share/common-licenses", "--max-steps", "8", "--eval-every", "0", "--no-sample",
              "--no-plot", "--ckpt-dir", "none", "--global-batch", "16", "--micro-batches", "2",
              "--progress-interval", "1000"]
    env = ENV
    tokenizer = None
    with Cluster(12, 2) as c:
        for name, extra in (("zero3", ["--stage", "3"]), ("pp2", ["--pp", "2", "--stage", "1"])):
            dirs = {where: os.path.join(work, f"{name}_{where}") for where in ("one_host", "two_hosts")}
            for where, d in dirs.items():
                if tokenizer:  # one tokenizer for every run (the first run trains it)
                    shutil.copytree(tokenizer, os.path.join(d, "tokenizer"))
                cmd = [exe, *common, *extra, "--run-dir", d]
                if where == "one_host":
                    p = subprocess.run([os.path.join(build, "zeroshard-run"), "--nproc-per-node", "4", "--", *cmd],
                                       capture_output=True, text=True, timeout=TIMEOUT, env=env)
                    check(p.returncode == 0, lambda: f"{name} on one host failed:\n{p.stdout[-4000:]}{p.stderr[-4000:]}")
                else:
                    launch(c, build, 2, 2, c.addr(0), cmd, env=env)
                tokenizer = tokenizer or os.path.join(d, "tokenizer")
            want, got = losses(dirs["one_host"]), losses(dirs["two_hosts"])
            check(len(want) == 8 and len(got) == 8, (name, want, got))
            worst = max(abs(a - b) / abs(a) for a, b in zip(want, got))
            check(worst <= 1e-6, lambda: f"{name}: losses on one host {want}, on two hosts {got}")
            print(f"bart: {name} on 2 hosts x 2 ranks: 8 losses equal the one-host run's within {worst:.1e} "
                  f"relative (last {got[-1]:.4f})", flush=True)


def main():
    build, which = os.path.abspath(sys.argv[1]), sys.argv[2]
    work = tempfile.mkdtemp(prefix=f"zs-cluster-{which}-")
    try:
        {"zero": check_zero, "bart": check_bart}[which](build, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
