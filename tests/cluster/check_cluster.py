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
          hosts): the per-step losses equal the same run's on one host (4 ranks) within 1e-6 relative.
          Then ZeRO-3 with a disk per host (no shared filesystem) and checkpoints: host 1 killed, both
          launchers started again, the run resumes from local files with the uninterrupted run's losses
  failures  soak_train (ZeRO-3) on 3 hosts x 1 rank with a liveness window of 3 s, one failure per run:
          host 2 killed (link down, then SIGKILL: no FIN or RST), host 2 cut off (link down), host 2's
          launcher killed; every surviving launcher exits non-zero, its rank's error names rank 2,
          within the window + 10 s. Then every link shaped to 10 Mbit/s: the run finishes, slower,
          with no false failure. Prints the detection times (docs/cluster.md's table). Then bart_pretrain with
          host 1's link alone shaped to 100 Mbit/s: the straggler rule names rank 1 on host 1 for its links, at
          about the shaped rate; unshaped, it names no one
  elastic torchrun --nnodes 2:3 on 3 hosts x 1 rank, each with its own disk, bart_pretrain ZeRO-3 with
          checkpoints committed in an S3 store on a fourth host: host 2 killed at a random step and its disk
          wiped; the agents restart the ranks at 2 hosts, the run resumes from its last checkpoint (host 2's
          file from the store; the redone step's loss as at 3 ranks); host 2 returns empty with a new agent,
          the run resumes at 3 ranks and finishes, the store's newest commit verifies. Prints the times from the kill to the first step without the
          host, and from the new agent's start to the first step with it

  durable bart_pretrain ZeRO-3 on 2 hosts x 2 ranks, a disk each, checkpoints committed in an S3 store
          (SeaweedFS) on a third host: host 1 killed and its disk wiped, a replacement with an empty disk: the
          run resumes from the store by itself with the uninterrupted run's losses; then host 1 cut off (link
          down) while it uploads: both launchers end within the liveness window + 2 s, naming the lost ranks
  replica bart_pretrain in 3 replica groups x 2 ranks (ZeRO-2; replica3: the same at ZeRO-3, whose ranks
          gather and free each unit's parameters inside the group), one group per host, meeting through 3 etcd
          members, one per host: host 2 killed (its group and its etcd member), then back with a new group;
          host 1 cut off (its group stops, its lease gone), then back with a new group; then one rank of
          the new c SIGKILLed (its launcher starts the group again, which heals from a live group). Group
          a (host 0) never restarts (its ranks the same processes), and every step's loss of every group
          equals an uninterrupted 2-rank run's (1e-5 relative): every sample trained once; so do the final
          parameters (exported from each group's end checkpoint): every group's the same bit for bit, within 1e-5
          of the uninterrupted run's norm, each tensor within 1e-4 of its own (but the attention's key biases,
          whose gradient is rounding). Prints each pause and heal

Exits 77 (skipped, with the reason printed) where the cluster cannot be made (not root, no namespaces).
"""
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, os.path.join(HERE, "..", "checkpoint"))
from check_cli import read_safetensors  # noqa: E402  (a plain JSON + numpy reader)
from cluster import Cluster, cluster_sh  # noqa: E402
from pycheck import check  # noqa: E402  (an assert that python -O keeps)

TIMEOUT = 180  # seconds for any one multi-host run
PORT = 29611
# The ZeRO-1/2 and ZeRO-3 tests against torch::optim::AdamW; at 3 ranks the collectives too (their sizes
# uneven at 3). The one-host suite runs the rest of the sharding tests at 2-4 ranks.
ORACLE = "*MatchesAdamW*"
ORACLE3 = "*MatchesAdamW*:Collectives.*"
# The hosts share this machine's 2 cores: one thread per rank, as the one-host tests get at 2+ ranks.
ENV = dict(os.environ, ZS_LOG_LEVEL="warn", OMP_NUM_THREADS="1")


def launch(c, build, hosts, nproc, master, cmd, env=None, disks=lambda i: ()):
    """zeroshard-run on every host (host i is node i, with `disks(i)` mounted); returns every host's output,
    failing on any exit != 0."""
    jobs = [c.start(i, [os.path.join(build, "zeroshard-run"), "--nnodes", hosts, "--node-rank", i,
                        "--nproc-per-node", nproc, "--master-addr", master, "--master-port", PORT,
                        "--grace-period", 5, "--", *cmd], env=env, disks=disks(i))
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
              "--progress-interval", "1000", "--max-tokens", "32"]
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
            if name != "zero3":
                continue
            check_own_disks(c, build, work, exe, [*common, *extra], tokenizer, got)


def check_own_disks(c, build, work, exe, args, tokenizer, want):
    """No shared filesystem: each host has a disk of its own at the run directory's path, and only host 0's holds
    the tokenizer (rank 0 sends it to the others). Checkpoints every 2 steps: each disk gets its ranks' files, the
    manifest and `latest`. Host 1 is killed (link down, SIGKILL) once its disk holds a checkpoint; host 0's launcher
    fails naming the lost ranks; both launchers start again and the run resumes from the last step both disks hold,
    reading only local files. The 8 losses are the uninterrupted run's."""
    run_path = os.path.join(work, "run_on_own_disk")
    disks = [os.path.join(work, f"disk{i}") for i in range(2)]
    for dd in disks:
        shutil.rmtree(dd, ignore_errors=True)
        os.makedirs(dd)
    shutil.copytree(tokenizer, os.path.join(disks[0], "tokenizer"))
    args = [a if a != "none" else os.path.join(run_path, "checkpoints") for a in args]
    cmd = [exe, *args, "--run-dir", run_path, "--save-every", "2", "--liveness", str(LIVENESS_S)]
    mounts = lambda i: [(disks[i], run_path)]  # noqa: E731
    latest = os.path.join(disks[1], "checkpoints", "latest")
    jobs = [c.start(i, [os.path.join(build, "zeroshard-run"), "--nnodes", 2, "--node-rank", i, "--nproc-per-node", 2,
                        "--master-addr", c.addr(0), "--master-port", PORT + 8, "--grace-period", 5, "--", *cmd],
                    env=ENV, disks=mounts(i))
            for i in range(2)]
    deadline = time.monotonic() + TIMEOUT
    while not (os.path.exists(latest) and open(latest).read().strip() >= "step-00000002"):
        check(time.monotonic() < deadline and all(j.proc.poll() is None for j in jobs),
              lambda: "host 1's disk never got a checkpoint:\n" + c.outputs(jobs))
        time.sleep(0.01)
    killed_after = open(latest).read().strip()
    # Rank 0 writes a step's metrics line after the step's save commits: the kill waits for it, or the resumed
    # run's metrics would lack the line of the step it resumes from (that race is bart_pretrain's, not the disks').
    def steps_logged():
        try:
            return len(losses(disks[0]))
        except (OSError, ValueError):  # not there yet, or a line being written
            return 0
    while steps_logged() < int(killed_after.split("-")[1]):
        check(time.monotonic() < deadline and all(j.proc.poll() is None for j in jobs),
              lambda: f"rank 0 never wrote the metrics of {killed_after}:\n" + c.outputs(jobs))
        time.sleep(0.01)
    start = time.monotonic()
    cluster_kill(c, 1)
    try:
        jobs[0].proc.wait(LIVENESS_S + 10)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"host 0's launcher still runs {LIVENESS_S + 10} s after host 1 was killed:\n" +
                             c.outputs(jobs))
    detected = time.monotonic() - start
    cluster_heal(c, 1)
    c.wait(jobs[1:], 60)
    out = jobs[0].output()
    check(jobs[0].proc.returncode != 0 and re.search(r"the connection to rank\(s\) \[[23](, [23])?\] broke", out),
          lambda: f"host 0's launcher did not fail naming host 1's ranks (2, 3):\n{out[-3000:]}")
    committed = [sorted(os.listdir(os.path.join(d, "checkpoints"))) for d in disks]
    # Again on both hosts, as a scheduler restarts a job: it resumes from the step both disks hold.
    outs = launch(c, build, 2, 2, c.addr(0), cmd, env=dict(ENV, ZS_LOG_LEVEL="info"), disks=mounts)
    resumed = re.search(r"checkpoint: loaded step (\d+) from (\S+)", outs[0])
    check(resumed and int(resumed.group(1)) >= 2, lambda: "the restarted run did not resume:\n" + outs[0][-3000:])
    check("is a different directory on host" in outs[0], lambda: "rank 0 did not find two disks:\n" + outs[0][-3000:])
    got = losses(disks[0])
    check(got == want, lambda: f"zero3 with a disk per host, killed and resumed: losses {got}, uninterrupted {want}")
    for i, d in enumerate(disks):
        step = os.path.join(d, "checkpoints", "step-00000008")
        files = sorted(f for f in os.listdir(step) if f.startswith("rank-"))
        check(files == [f"rank-{r:05d}-of-00004.h5" for r in (2 * i, 2 * i + 1)],
              f"host {i}'s disk holds {files} of step 8")
        check(open(os.path.join(d, "checkpoints", "latest")).read().strip() == "step-00000008",
              f"host {i}'s latest is not step 8")
        check(os.path.exists(os.path.join(step, "manifest.json")), f"host {i}'s disk has no manifest")
    check(not os.path.exists(os.path.join(disks[1], "tokenizer")) and
          not os.path.exists(os.path.join(run_path, "tokenizer")),
          "host 1 read or wrote a tokenizer of its own")
    print(f"bart: zero3 on 2 hosts, each with its own disk at the run directory (the tokenizer on host 0's alone), "
          f"checkpoints every 2 steps: host 1 killed once its disk held {killed_after}; host 0's launcher failed "
          f"naming ranks 2-3 after {detected:.1f} s (liveness {LIVENESS_S} s); the disks then held {committed[0]} and "
          f"{committed[1]}; restarted on both hosts, resumed step {resumed.group(1)} from local files: the same 8 "
          "losses as the uninterrupted run; each disk ends with its own 2 rank files, the manifest and latest = "
          "step 8", flush=True)


S3_STORE = os.path.join(HERE, "..", "checkpoint", "s3_store.py")


def durable_steps(run_dir):
    """The steps the metrics' "durable" events name, so far."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [r["step"] for r in map(json.loads, filter(str.strip, f)) if r.get("event") == "durable"]
    except (OSError, ValueError):  # not there yet, or a line being written
        return []


def start_store(c, i):
    """An S3 store (SeaweedFS, tests/checkpoint/s3_store.py) on host i of `c`, on its own; returns the
    environment that points the AWS settings at it (bucket "ckpt")."""
    ip = c.addr(i)
    store = c.start(i, [sys.executable, S3_STORE, "--ip", ip, "--s3-port", 8333, "--", "sleep", 3600], env=ENV)
    deadline = time.monotonic() + 60
    while "ready in" not in store.output():
        check(time.monotonic() < deadline and store.proc.poll() is None,
              lambda: f"the store on host {i} did not start:\n" + store.output()[-3000:])
        time.sleep(0.1)
    return dict(ENV, AWS_ENDPOINT_URL=f"http://{ip}:8333", AWS_ACCESS_KEY_ID="testkey",
                AWS_SECRET_ACCESS_KEY="testsecret", AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")


def check_durable(build, work):
    """The spot loss the durable tier is for: bart_pretrain ZeRO-3 on 2 hosts x 2 ranks, each host with a disk of
    its own, checkpoints every 2 steps committed in an S3 store on a third host (SeaweedFS, with
    tests/checkpoint/s3_store.py). Once a step is durable, host 1 is killed and its disk wiped; host 0 and a
    replacement host 1 with an empty disk start again, with the same command: the run resumes from the store by
    itself (host 1 copies the step) and takes the uninterrupted run's losses (the one-host run's, within check_bart's
    1e-6 relative)."""
    exe = os.path.join(build, "examples", "bart_pretrain")
    common = ["--data", "/usr/share/common-licenses", "--max-steps", "8", "--eval-every", "0", "--no-sample",
              "--no-plot", "--global-batch", "16", "--micro-batches", "2", "--progress-interval", "1000",
              "--max-tokens", "32", "--stage", "3"]
    ref = os.path.join(work, "durable_ref")
    shutil.rmtree(ref, ignore_errors=True)
    p = subprocess.run([os.path.join(build, "zeroshard-run"), "--nproc-per-node", "4", "--", exe, *common,
                        "--ckpt-dir", "none", "--run-dir", ref], capture_output=True, text=True, timeout=TIMEOUT, env=ENV)
    check(p.returncode == 0, lambda: f"the uninterrupted run failed:\n{p.stdout[-4000:]}{p.stderr[-4000:]}")
    want = losses(ref)
    run_path = os.path.join(work, "run_durable")
    disks = [os.path.join(work, f"durable_disk{i}") for i in range(2)]
    for dd in disks:
        shutil.rmtree(dd, ignore_errors=True)
        os.makedirs(dd)
    shutil.copytree(os.path.join(ref, "tokenizer"), os.path.join(disks[0], "tokenizer"))
    mounts = lambda i: [(disks[i], run_path)]  # noqa: E731
    with Cluster(15, 3) as c:
        env = start_store(c, 2)
        uri = "s3://ckpt/cluster-run"
        cmd = [exe, *common, "--run-dir", run_path, "--save-every", "2", "--ckpt-dir", uri, "--liveness", str(LIVENESS_S)]
        jobs = [c.start(i, [os.path.join(build, "zeroshard-run"), "--nnodes", 2, "--node-rank", i, "--nproc-per-node",
                            2, "--master-addr", c.addr(0), "--master-port", PORT + 9, "--grace-period", 5, "--", *cmd],
                        env=env, disks=mounts(i))
                for i in range(2)]
        deadline = time.monotonic() + TIMEOUT
        while not durable_steps(disks[0]):
            check(time.monotonic() < deadline and all(j.proc.poll() is None for j in jobs),
                  lambda: "no checkpoint became durable:\n" + c.outputs(jobs))
            time.sleep(0.01)
        durable_at_kill = durable_steps(disks[0])[-1]
        cluster_kill(c, 1)
        try:
            jobs[0].proc.wait(LIVENESS_S + 10)
        except subprocess.TimeoutExpired:
            raise AssertionError("host 0's launcher still runs after host 1 was killed:\n" + c.outputs(jobs))
        cluster_heal(c, 1)
        c.wait(jobs[1:], 60)
        # The instance is gone, and its disk with it: the replacement starts empty.
        shutil.rmtree(disks[1])
        os.makedirs(disks[1])
        local = sorted(os.listdir(os.path.join(disks[0], "checkpoints")))
        start = time.monotonic()
        outs = launch(c, build, 2, 2, c.addr(0), cmd, env=dict(env, ZS_LOG_LEVEL="info"), disks=mounts)
        took = time.monotonic() - start
        resumed = re.search(r"checkpoint: loaded step (\d+)", outs[0])
        check(resumed and int(resumed.group(1)) >= durable_at_kill,
              lambda: "the restarted run did not resume from a durable step:\n" + outs[0][-3000:])
        copied = re.findall(r"copied ([0-9.]+) MB of (step-\d+)/(\S+) from the durable tier in ([0-9.]+) s", outs[1])
        # At the topology that saved it, host 1's ranks read their own files alone.
        check(sorted(f for _, _, f, _ in copied) == ["rank-00002-of-00004.h5", "rank-00003-of-00004.h5"],
              lambda: f"host 1 copied {copied} from the store, not its two rank files:\n" + outs[1][-3000:])
        check(not re.search(r"copied .* from the durable tier", outs[0]), "host 0 copied files it holds")
        got = losses(disks[0])
        # Within the two-host runs' tolerance of the one-host run (check_bart: the reductions' order differs).
        worst = max(abs(a - b) / abs(a) for a, b in zip(want, got)) if len(got) == len(want) else float("inf")
        check(worst <= 1e-6, lambda: f"killed, disk wiped, resumed from the store: losses {got}, uninterrupted {want}")
        # (the last save's upload is skipped when the one before is still in flight: the newest durable step
        # is the resumed one or later)
        check(durable_steps(disks[0])[-1] >= int(resumed.group(1)), f"durable events {durable_steps(disks[0])}")
        files = sorted(os.listdir(os.path.join(disks[1], "checkpoints", "step-00000008")))
        check([f for f in files if f.endswith(".h5")] == ["rank-00002-of-00004.h5", "rank-00003-of-00004.h5"],
              f"the replacement's disk holds {files} of step 8")
        partition = durable_partition(c, build, exe, common, env, disks, mounts, run_path)
    print(f"durable: zero3 on 2 hosts x 2 ranks, each with its own disk, checkpoints every 2 steps committed in "
          f"SeaweedFS on a third host; host 1 killed once step {durable_at_kill} was durable (host 0's disk held "
          f"{local}), its disk wiped; restarted with the same command: host 1 copied its 2 rank files of "
          f"{copied[0][1]} ({sum(float(mb) for mb, _, _, _ in copied):.1f} MB, "
          f"{max(float(s) for _, _, _, s in copied):.2f} s each at most) from the store, the run resumed step {resumed.group(1)} and "
          f"finished in {took:.1f} s with the uninterrupted run's 8 losses (within {worst:.1e} relative)", flush=True)
    print(f"durable: host 1 cut off (link down) while the run uploaded to the store on host 2: host 0's launcher "
          f"exited after {partition[0]:.1f} s, host 1's after {partition[1]:.1f} s (liveness {LIVENESS_S} s), each "
          "naming the lost ranks", flush=True)


def durable_partition(c, build, exe, common, env, disks, mounts, run_path):
    """Host 1 cut off (link down) while the run saves every step and uploads to the store on host 2: host 0 loses
    ranks 2-3 and host 1 loses ranks 0-1 and the store; both launchers end within the liveness window + 2 s (no
    wait on the store outlasts the communicator's failure), each naming the lost ranks. Returns their times."""
    # A run of its own: fresh disks (the tokenizer from the last run's).
    fresh = [d + "_partition" for d in disks]
    for d in fresh:
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(os.path.join(disks[0], "tokenizer"), os.path.join(d, "tokenizer"))
    disks, mounts = fresh, lambda i: [(fresh[i], run_path)]  # noqa: E731
    cmd = [exe, *common[:common.index("--max-steps")], *common[common.index("--max-steps") + 2:], "--max-steps",
           "100000", "--run-dir", run_path, "--save-every", "1", "--ckpt-dir", "s3://ckpt/partition",
           "--liveness", str(LIVENESS_S)]
    jobs = [c.start(i, [os.path.join(build, "zeroshard-run"), "--nnodes", 2, "--node-rank", i, "--nproc-per-node", 2,
                        "--master-addr", c.addr(0), "--master-port", PORT + 10, "--grace-period", 5, "--", *cmd],
                    env=env, disks=mounts(i))
            for i in range(2)]
    deadline = time.monotonic() + TIMEOUT
    while len(durable_steps(disks[0])) < 2:  # uploads under way
        check(time.monotonic() < deadline and all(j.proc.poll() is None for j in jobs),
              lambda: "no checkpoint became durable:\n" + c.outputs(jobs))
        time.sleep(0.01)
    start = time.monotonic()
    cluster_cut(c, 1)
    ended = []
    for j in jobs:
        try:
            j.proc.wait(LIVENESS_S + 30)
        except subprocess.TimeoutExpired:
            cluster_heal(c, 1)
            raise AssertionError(f"host {j.host}'s launcher still runs {LIVENESS_S + 30} s after the cut:\n" +
                                 c.outputs(jobs))
        ended.append(time.monotonic() - start)
    cluster_heal(c, 1)
    for j, lost in zip(jobs, ("23", "01")):
        out = j.output()
        check(j.proc.returncode != 0, lambda: f"host {j.host}'s launcher exited 0 after the cut:\n{out[-3000:]}")
        check(re.search(r"the connection to rank\(s\) \[[^\]]*[" + lost + r"][^\]]*\] broke", out),
              lambda: f"host {j.host}'s error does not blame ranks {lost[0]}-{lost[1]}:\n{out[-3000:]}")
    check(max(ended) <= LIVENESS_S + 2, lambda: f"after the cut the launchers ended after {ended} s (liveness "
          f"{LIVENESS_S} s):\n" + c.outputs(jobs))
    return ended


SOAK_ARGS = ["--stage", "3", "--liveness", "3", "--save-every", "1000"]
LIVENESS_S = 3


def wait_first_step(c, job, timeout=60):
    """Waits until rank 0 (host 0) reports its first step."""
    deadline = time.monotonic() + timeout
    while "first step of this run done" not in job.output():
        check(time.monotonic() < deadline and job.proc.poll() is None,
              lambda: "rank 0 never reported its first step:\n" + c.outputs(c.jobs))
        time.sleep(0.05)


def check_failures(build, work):
    train = [os.path.join(build, "tests", "zs_tests"), "--helper", "soak_train", *SOAK_ARGS]
    env = dict(ENV, ZS_LOG_LEVEL="info")
    rows = []
    with Cluster(13, 3) as c:
        for name, inflict, heal in (
                ("host killed (link down, then SIGKILL)", lambda: cluster_kill(c, 2), lambda: cluster_heal(c, 2)),
                ("host cut off (link down)", lambda: cluster_cut(c, 2), lambda: cluster_heal(c, 2)),
                ("launcher killed (SIGKILL)", None, None)):
            d = os.path.join(work, f"failure{len(rows)}")
            jobs = [c.start(i, [os.path.join(build, "zeroshard-run"), "--nnodes", 3, "--node-rank", i,
                                "--nproc-per-node", 1, "--master-addr", c.addr(0), "--master-port", PORT + 2 + len(rows),
                                "--grace-period", 2, "--", *train, "--steps", 100000, "--slow-ms", 20, "--width", 64,
                                "--dir", d, "--out", os.path.join(d, "out")], env=env)
                    for i in range(3)]
            wait_first_step(c, jobs[0])
            time.sleep(1.0)
            start = time.monotonic()
            if inflict:
                inflict()
            else:
                jobs[2].proc.kill()  # the launcher itself (the exec chain ends in it); its ranks die with it
            survivors = jobs[:2]
            limit = LIVENESS_S + 10
            ended = []
            for j in survivors:
                try:
                    j.proc.wait(max(0.1, start + limit + 20 - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{name}: host {j.host}'s launcher still runs {limit + 20} s later:\n" +
                                         c.outputs(jobs))
                ended.append(time.monotonic() - start)
            if heal:
                heal()
            for j in survivors:
                out = j.output()
                check(j.proc.returncode != 0, lambda: f"{name}: host {j.host}'s launcher exited 0:\n{out[-3000:]}")
                # The rank the error blames (not only a rank its text mentions) is the lost one.
                check(re.search(r"the connection to rank\(s\) \[2\] broke", out),
                      lambda: f"{name}: host {j.host}'s error does not blame rank 2:\n{out[-3000:]}")
            worst = max(ended)
            check(worst <= limit, lambda: f"{name}: a surviving launcher took {worst:.1f} s (limit {limit} s):\n" +
                  c.outputs(jobs))
            c.wait(jobs[2:], 60)  # host 2's launcher (cut off: its ranks fail alone too; killed: gone)
            cause = re.search(r"(no sign of life[^\n]*?cut|End of file|Connection reset by peer)", survivors[0].output())
            rows.append((name, worst, cause.group(1) if cause else "?"))
            print(f"failures: {name}: both surviving launchers exited non-zero naming rank 2 within "
                  f"{worst:.1f} s (window {LIVENESS_S} s)", flush=True)
            for j in survivors:
                first = next((line for line in j.output().splitlines() if "]: error: " in line or "] failed" in line), "")
                print(f"  host {j.host}: {first[:400]}", flush=True)

        # 10 Mbit/s everywhere: slower, no false failure.
        times = {}
        for rate in ("off", "10mbit"):
            for i in range(3):
                cluster_shape(c, i, rate)
            d = os.path.join(work, f"slow_{rate}")
            start = time.monotonic()
            launch(c, build, 3, 1, c.addr(0), [*train, "--steps", 20, "--width", 64, "--dir", d,
                                                "--out", os.path.join(d, "out")], env=ENV)
            times[rate] = time.monotonic() - start
        check(times["10mbit"] > times["off"], f"the shaped run was not slower: {times}")
        print(f"failures: 20 steps on 3 hosts: {times['off']:.1f} s unshaped, {times['10mbit']:.1f} s at 10 Mbit/s, "
              "no false failure", flush=True)
        check_slow_link(c, build, work)
    print("failures: detection table (docs/cluster.md)")
    print("| failure | liveness window | every surviving launcher exited after |")
    print("|---|---|---|")
    for name, seconds, _ in rows:
        print(f"| {name} | {LIVENESS_S} s | {seconds:.1f} s |")


def check_slow_link(c, build, work):
    """bart_pretrain (ZeRO-2) on the 3 hosts x 1 rank, host 1's link shaped to 100 Mbit/s, the others' not: the
    straggler rule (a window of 10 steps, threshold 2) names rank 1 on host 1 for its links (kind "link") once, at a rate
    near the shaped one (tbf's rate, about 0.96 of it TCP payload under 1500-byte frames); the same run with
    no link shaped names no straggler of any kind. Shaped, the time to the step's agreement that is neither compute
    nor data wait is at least half exposed communication (the reductions ZeRO-2 drains for the gradient norm are
    counted, RankTimes::count_waits)."""
    exe = os.path.join(build, "examples", "bart_pretrain")
    # A threshold of 2: the 3 ranks share 2 cores, and over 10 steps one rank's compute can be 1.3x the others'
    # (the default threshold's one-host noise is bart_pretrain_straggler's unthrottled run); the link is 100x.
    rate_mbit, steps, window, threshold = 100, 30, 10, 2
    tokenizer = None
    found, exposed, rest = {}, 0.0, 0.0
    for rate in ("off", f"{rate_mbit}mbit"):
        for i in range(3):
            cluster_shape(c, i, rate if i == 1 else "off")
        d = os.path.join(work, f"link_{rate}")
        if tokenizer:  # one tokenizer for both runs (the first trains it)
            shutil.copytree(tokenizer, os.path.join(d, "tokenizer"))
        launch(c, build, 3, 1, c.addr(0), [exe, "--data", "/usr/share/common-licenses", "--run-dir", d, "--max-steps",
                                            steps, "--eval-every", "0", "--no-sample", "--no-plot", "--ckpt-dir", "none",
                                            "--global-batch", "6", "--max-tokens", "32", "--progress-interval", "1000",
                                            "--stage", "2", "--straggler-window", window,
                                            "--straggler-threshold", threshold], env=ENV)
        tokenizer = tokenizer or os.path.join(d, "tokenizer")
        found[rate] = events(d, "straggler")
        rows = events(d)
        check(len(rows) == steps, lambda: f"{rate}: {len(rows)} steps recorded, not {steps}")
        if rate != "off":  # the time to the agreement is the reductions' over the slow link: exposed, not compute
            med = lambda f: statistics.median(r["ranks"][f]["median"] for r in rows[1:])  # noqa: E731
            exposed, rest = med("exposed_comm_s"), med("arrive_s") - med("compute_s") - med("data_wait_s")
            check(exposed >= 0.5 * rest, lambda: f"exposed communication {exposed:.3f} s of the {rest:.3f} s to the "
                  "agreement that is neither compute nor data wait (medians)")
    cluster_shape(c, 1, "off")
    check(found["off"] == [], lambda: f"stragglers named with no link shaped: {found['off']}")
    named = found[f"{rate_mbit}mbit"]
    check(len(named) == 1 and named[0]["kind"] == "link" and named[0]["rank"] == 1 and
          named[0]["host"] == c.name(1), lambda: f"not one link episode naming rank 1 on {c.name(1)}: {named}")
    e = named[0]
    payload = rate_mbit * 1e6 / 8 / 1e6 * 0.96  # MB/s
    check(0.7 * payload <= e["mb_s"] <= 1.15 * payload and e["median_mb_s"] >= 5 * e["mb_s"],
          lambda: f"named at {e['mb_s']:.1f} MB/s (the link carries about {payload:.1f}), the others' median "
          f"{e['median_mb_s']:.1f}: {e}")
    check(e["step"] <= 2 * window, lambda: f"named at step {e['step']}, not within two windows of {window}: {e}")
    print(f"failures: host 1's link at {rate_mbit} Mbit/s: rank 1 on {e['host']} named at step {e['step']} for its "
          f"links, {e['mb_s']:.1f} MB/s (the link carries about {payload:.1f}) against the others' "
          f"{e['median_mb_s']:.0f} MB/s; unshaped, no straggler named; shaped, {exposed:.3f} s of exposed communication "
          f"in the {rest:.3f} s to the agreement that is neither compute nor data wait (medians)", flush=True)


def check_elastic(build, work):
    """An elastic run under torchrun (--nnodes 2:3, c10d rendezvous, one agent per host): bart_pretrain, ZeRO-3,
    on 3 hosts x 1 rank, each host with a disk of its own (no shared filesystem), checkpoints every 2 steps
    committed in an S3 store on a fourth host (SeaweedFS, tests/checkpoint/s3_store.py).
    - Shrink: host 2 is killed (link down, SIGKILL) once a random odd step (5-13) is logged and a step is
      durable, and its disk is wiped (a spot instance reclaimed). The other ranks fail naming it within the
      liveness window, their agents restart them at 2 hosts, and the run resumes from its last checkpoint
      at the smaller world size (the checkpoint reshards, the sampler continues the epoch): host 2's rank
      file of that step comes from the store.
    - Grow: once a step ran at 2 hosts, host 2 comes back (link up) with its empty disk and a new agent
      starts there. The running agents see it waiting, stop their ranks (which save a checkpoint, as on a
      preemption), and the rendezvous takes it in: the run resumes at 3 hosts (host 2 copying what it reads
      from the store) and finishes at the planned step.
    Every step is logged, a step taken twice (redone after the shrink) has the loss it had the first time,
    the summary says 3 ranks, and `zeroshard-ckpt verify` passes on the store's newest commit. Prints the time
    from the kill to the first step without the host, and from the new agent's start to the first step with it."""
    exe = os.path.join(build, "examples", "bart_pretrain")
    run = os.path.join(work, "run")  # where every host's own disk is mounted
    disks = [os.path.join(work, f"elastic_disk{i}") for i in range(3)]
    for d in disks:
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    uri = "s3://ckpt/elastic-run"
    steps = 150  # the run must outlast a new agent's start (torchrun imports torch: seconds) at 2 ranks
    kill_at = random.randrange(5, 15, 2)  # odd: checkpoints are every 2 steps, so at least one step is redone
    # Rank 0 is host 0's in every round (the rendezvous ranks its agents by host name) and writes the log there.
    metrics = os.path.join(disks[0], "metrics.jsonl")

    def rows():
        if not os.path.exists(metrics):
            return []
        with open(metrics) as f:
            return [json.loads(line) for line in f if line.strip()]

    def resumes_seen():
        return [r for r in rows() if r.get("event") == "resume"]

    def stepped_after_resume(ranks):
        """Whether the log has a resume at `ranks` ranks and a step after it. (A resume rewrites the log from
        the step it resumes from, so rows counted before it say nothing; the run resumes at 2 ranks only
        after the shrink, at 3 only after the grow.)"""
        every = rows()
        at = next((k for k, r in enumerate(every) if r.get("event") == "resume" and r["ranks"] == ranks), None)
        return at is not None and any("event" not in r for r in every[at + 1:])

    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the rendezvous store shared with the workers (torchrun's default),
    # an agent that joins a later round waits forever for the MASTER_ADDR key of that round, which rank 0's
    # agent wrote only in the first (torch 2.15, dynamic_rendezvous.py: the bootstrap info is kept across
    # rounds). Unshared, each round's rank 0 writes it, and the ranks rendezvous at their own MASTER_PORT.
    def agent(c, i):
        # ZS_LOG_LEVEL=info: the ranks say what they copy from the store.
        env = dict(store_env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", ZS_LOG_LEVEL="info")
        return c.start(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", 1,
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{c.name(0)}:{PORT + 20}",
                           "--rdzv-id", "zs-elastic", "--max-restarts", 3,
                           # A silent agent leaves the rendezvous after 4 missed keep-alives of 1 s (default 3 x 5 s:
                           # 18 s from the kill to the first step). 2 missed drop live agents too: a keep-alive is
                           # written only when the last is a whole interval old, so the next can come 2 s later.
                           "--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=4",
                           "--monitor-interval", "0.5", "--no-python", exe, "--data", "/usr/share/common-licenses",
                           "--max-steps", steps, "--eval-every", 0, "--no-sample", "--no-plot", "--global-batch", 12,
                           "--micro-batches", 1, "--max-tokens", 32, "--save-every", 2, "--liveness", LIVENESS_S,
                           # Without dropout a step's loss does not depend on the world size (its masks do).
                           "--dropout", 0, "--run-dir", run, "--progress-interval", 1000, "--ckpt-dir", uri],
                       env=env, disks=[(disks[i], run)])

    with Cluster(14, 4) as c:  # 11-13 are the other checks': ctest runs two at a time
        store_env = start_store(c, 3)
        jobs = [agent(c, i) for i in range(3)]
        deadline = time.monotonic() + TIMEOUT
        # Host 2's file of a step the survivors can resume from is then in the store alone: wait for one.
        while not (any("event" not in r and r["step"] >= kill_at for r in rows()) and durable_steps(disks[0])):
            check(time.monotonic() < deadline and all(j.proc.poll() is None for j in jobs),
                  lambda: f"the 3-host run never reached step {kill_at} with a durable step:\n" + c.outputs(jobs))
            time.sleep(0.02)
        killed = time.monotonic()
        cluster_kill(c, 2)
        # The spot instance is gone with its disk: its rank file of every step too.
        jobs[2].proc.wait()
        shutil.rmtree(disks[2])
        os.makedirs(disks[2])
        # The log as the 3 hosts left it (rank 0 rewrites it from the step it resumes from).
        first_losses = {r["step"]: r["loss"] for r in rows() if "event" not in r}
        while not stepped_after_resume(2):
            check(time.monotonic() < deadline, lambda: "no step at 2 hosts after host 2 was killed:\n" +
                  c.outputs(jobs[:2]))
            time.sleep(0.02)
        shrink_gap = time.monotonic() - killed
        check(not any(r.get("event") == "summary" for r in rows()), "the run ended before host 2 could return")
        cluster_heal(c, 2)
        returned = time.monotonic()
        jobs.append(agent(c, 2))
        while not stepped_after_resume(3):
            check(time.monotonic() < deadline and jobs[0].proc.poll() is None,
                  lambda: "no step at 3 hosts after host 2 returned:\n" + c.outputs(jobs[:2] + jobs[3:]))
            time.sleep(0.02)
        grow_gap = time.monotonic() - returned
        results = c.wait(jobs[:2] + jobs[3:], TIMEOUT)
        check(all(code == 0 for code, _ in results), lambda: "an agent failed:\n" + c.outputs(jobs[:2] + jobs[3:]))
        # The shrink: the step the survivors resumed from was saved at 3 ranks, and host 2's file of it is on no
        # disk left: it came from the store (the losses below say it came right). Rank 0, which logs what it
        # reads, read another host's file of that step from the store, dataset by dataset (ranged GETs).
        shrunk = f"step-{resumes_seen()[0]['step']:08d}"
        # (under the line of checkpoints that saved it: step-N/LINE/rank-...)
        check(re.search(rf"read [0-9.]+ MB of {shrunk}/[0-9a-f]{{16}}/rank-0000[12]-of-00003\.h5 \([0-9.]+ MB\) from the "
                        "durable tier",
                        jobs[0].output()),
              lambda: f"rank 0 did not read another host's file of {shrunk} from the store:\n" + c.outputs(jobs[:1]))
        # The grow: host 2, back with an empty disk, took the step's manifest (and what it read) from the store.
        grown = re.findall(r"(step-\d+) is not on this disk \(host [^)]*\): its manifest copied from the durable tier",
                           jobs[3].output())
        check(grown, lambda: "host 2 came back with an empty disk and took nothing from the store:\n" +
              c.outputs(jobs[3:]))
        # The store's newest commit verifies (every file's size and xxh3), read from host 0.
        verify = c.start(0, [os.path.join(build, "zeroshard-ckpt"), "verify", uri], env=store_env)
        (code, out), = c.wait([verify], TIMEOUT)
        check(code == 0, lambda: f"zeroshard-ckpt verify {uri}: {out[-3000:]}")
    every = rows()
    resumes = [r for r in every if r.get("event") == "resume"]
    check([r["ranks"] for r in resumes] == [2, 3], resumes)
    # The agents stopped the ranks with SIGTERM: a checkpoint at that step, as on a preemption notice.
    check(resumes[1]["after"] in ("SIGTERM", "another rank's notice") and "to_first_step_s" in resumes[1], resumes)
    summary = [r for r in every if r.get("event") == "summary"][-1]
    check(summary["ranks"] == 3 and summary["step"] == steps and summary["resumed"], summary)
    losses, redone = {}, 0
    for r in every:
        if "event" in r:
            continue
        check(r["loss"] == r["loss"] and 0 < r["loss"] < 20, r)  # finite: no jump from a bad resume
        losses[r["step"]] = r["loss"]
        # A step redone after the shrink (3 ranks, then 2) trained on the same 12 samples from the same state.
        if r["step"] > resumes[0]["step"] and r["step"] in first_losses:
            check(abs(r["loss"] - first_losses[r["step"]]) <= 1e-4 * r["loss"],
                  lambda: f"step {r['step']} redone at 2 ranks: loss {r['loss']}, at 3 {first_losses[r['step']]}")
            redone += 1
    # None to redo when the survivors' own checkpoint (the agents' SIGTERM) came after every step the
    # log held when host 2 died: on a loaded machine they can finish a step more before they stop.
    check(redone > 0 or resumes[0]["step"] >= max(first_losses),
          lambda: f"no step was redone after the shrink: killed after step {kill_at}, resumed from "
          f"{resumes[0]['step']}, {sorted(first_losses)} logged before")
    check(set(losses) == set(range(1, steps + 1)), sorted(losses))
    print(f"elastic: 3 hosts -> 2 -> 3, each with its own disk, checkpoints committed in an S3 store on a fourth host: "
          f"host 2 killed after step {kill_at} and its disk wiped, resumed from step {resumes[0]['step']} at 2 ranks "
          f"{shrink_gap:.1f} s after the kill (to the first step; liveness {LIVENESS_S} s, rendezvous last call 3 s, "
          f"keep-alive 4 x 1 s), host 2's rank file read from the store; host 2 back with an empty disk and a new "
          f"agent started: resumed from step {resumes[1]['step']} at 3 ranks {grow_gap:.1f} s after its start, having "
          f"taken {', '.join(grown)} from the store; finished {steps} steps; the {redone} steps redone at 2 ranks had "
          "their losses at 3; the store's newest commit verifies", flush=True)


def start_etcd_member(c, i, hosts, work, state="new"):
    """etcd member m<i> on host i of `c` (a cluster of one member per host), its data in `work`; waits until it
    serves."""
    a = c.addr(i)
    peers = ",".join(f"m{k}=http://{c.addr(k)}:2380" for k in range(hosts))
    job = c.start(i, ["etcd", "--name", f"m{i}", "--data-dir", os.path.join(work, f"etcd-m{i}"),
                      "--listen-client-urls", f"http://{a}:2379", "--advertise-client-urls", f"http://{a}:2379",
                      "--listen-peer-urls", f"http://{a}:2380", "--initial-advertise-peer-urls", f"http://{a}:2380",
                      "--initial-cluster", peers, "--initial-cluster-state", state,
                      "--heartbeat-interval", "50", "--election-timeout", "500"])
    return job


def wait_etcd(c, jobs, timeout=60):
    deadline = time.monotonic() + timeout
    for job in jobs:
        while "ready to serve client requests" not in job.output():
            check(time.monotonic() < deadline and job.proc.poll() is None,
                  lambda: f"etcd on host {job.host} did not start:\n" + job.output()[-3000:])
            time.sleep(0.1)


def events(run_dir, kind=None):
    """The metrics' lines so far (steps, or the events of one kind)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):  # not there yet, or a line being written
        return []
    return [r for r in rows if (r.get("event") == kind if kind else "event" not in r)]


def check_replica(build, work, stage=2):
    exe = os.path.join(build, "examples", "bart_pretrain")
    run = os.path.join(build, "zeroshard-run")
    # Within the data's first epoch (about 4,300 examples): at an epoch's end the sampler pads the last
    # batch by the ranks' count (as PyTorch's DistributedSampler does), which differs between 2 and 6 ranks.
    steps, liveness = 340, 3
    # A checkpoint at the end only (RUN_DIR/checkpoints): the final parameters, exported and compared.
    common = ["--max-steps", steps, "--eval-every", "0", "--dropout", "0", "--no-sample", "--no-plot", "--save-every",
              "100000", "--global-batch", "12", "--max-tokens", "16", "--progress-interval", "1000", "--stage", stage,
              "--liveness", liveness]
    ref = os.path.join(work, "ref")
    p = subprocess.run([run, "--nproc-per-node", "2", "--", exe, "--data", "/usr/share/common-licenses", "--run-dir",
                        ref, *map(str, common)], capture_output=True, text=True, timeout=TIMEOUT, env=ENV)
    check(p.returncode == 0, lambda: f"the uninterrupted run failed:\n{p.stdout[-4000:]}{p.stderr[-4000:]}")
    want = {r["step"]: r["loss"] for r in events(ref)}
    with Cluster(45 + stage, 3) as c:  # 47 and 48: ctest may run both stages at once
        members = [start_etcd_member(c, i, 3, work) for i in range(3)]
        wait_etcd(c, members)
        coordinator = "etcd://" + ",".join(f"{c.addr(i)}:2379" for i in range(3))
        env = dict(ENV, ZS_LOG_LEVEL="info")

        def group(i, name, run_dir, restarts=0):
            shutil.copytree(os.path.join(ref, "tokenizer"), os.path.join(run_dir, "tokenizer"))
            return c.start(i, [run, "--nproc-per-node", 2, "--max-restarts", restarts, "--", exe, "--dataset", os.path.join(ref, "dataset"),
                               "--run-dir", run_dir, *common, "--replica-group", name, "--coordinator", coordinator,
                               "--replica-listen", c.addr(i)], env=env)

        def wait_for(what, ok, alive, timeout=120):
            deadline = time.monotonic() + timeout
            while not ok():
                for j in alive:
                    check(j.proc.poll() is None, lambda: f"{what}: host {j.host}'s group ended:\n" + c.outputs(c.jobs))
                check(time.monotonic() < deadline, lambda: f"{what}: not within {timeout} s:\n" + c.outputs(c.jobs))
                time.sleep(0.1)

        def changes(run_dir):
            return events(run_dir, "replica_groups")

        dirs = {n: os.path.join(work, n) for n in ("a", "b", "c", "c_again", "b_again")}
        a = group(0, "a", dirs["a"])  # first: a trains every step
        wait_for("a trains", lambda: len(events(dirs["a"])) >= 1, [a])
        b, g = group(1, "b", dirs["b"]), group(2, "c", dirs["c"])
        wait_for("3 groups train", lambda: any(x["groups"] == 3 for x in changes(dirs["a"])) and
                 len(events(dirs["c"])) >= 3, [a, b, g])
        # 1. Host 2 killed: its group and its etcd member (the coordinator goes on with 2 of 3).
        cluster_kill(c, 2)
        lost_at = time.monotonic()
        wait_for("a and b go on without host 2", lambda: changes(dirs["a"])[-1]["groups"] == 2, [a, b])
        first_pause = changes(dirs["a"])[-1]["pause_s"]
        # Host 2 back: its link, its etcd member (same data: it rejoins), a new group c.
        cluster_heal(c, 2)
        wait_etcd(c, [start_etcd_member(c, 2, 3, work, "existing")])
        g2 = group(2, "c", dirs["c_again"], restarts=1)  # its launcher starts it again once (step 3)
        wait_for("c heals from a live group", lambda: changes(dirs["c_again"]) and
                 changes(dirs["c_again"])[0]["heal_bytes"] > 0, [a, b, g2])
        wait_for("a trains with c again", lambda: changes(dirs["a"])[-1]["groups"] == 3, [a, b, g2])
        seen = len(changes(dirs["a"]))
        # 2. Host 1 cut off: its group stops (no coordinator, no peers); a and c go on.
        cluster_cut(c, 1)
        wait_for("a and c go on without host 1",
                 lambda: [x["groups"] for x in changes(dirs["a"])[seen:]] == [2], [a, g2])
        second_pause = changes(dirs["a"])[-1]["pause_s"]
        cluster_heal(c, 1)  # b finds its lease gone (a and c count it lost) and stops
        b.proc.wait(timeout=60)
        check(b.proc.returncode != 0, lambda: "group b, cut off, should stop:\n" + c.outputs([b]))
        b2 = group(1, "b", dirs["b_again"])
        wait_for("b heals from a live group", lambda: changes(dirs["b_again"]) and
                 changes(dirs["b_again"])[0]["heal_bytes"] > 0, [a, g2, b2])
        wait_for("a trains with b again", lambda: [x["groups"] for x in changes(dirs["a"])[seen:]] == [2, 3],
                 [a, g2, b2])
        # 3. One rank of c killed (SIGKILL): c's other rank fails with it, c's launcher starts the group
        # again, and it heals from a live group; a and b go on, a's ranks the same processes throughout.
        seen = len(changes(dirs["a"]))
        a_ranks = ranks_of(a)
        victim = ranks_of(g2)[1]
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        wait_for("c, started again by its launcher, heals", lambda: [
            x for x in changes(dirs["c_again"]) if x["heal_bytes"] > 0 and x["time"] > killed_at], [a, g2, b2])
        wait_for("a trains with c again", lambda: changes(dirs["a"])[seen:] and
                 changes(dirs["a"])[-1]["groups"] == 3, [a, g2, b2])
        third = changes(dirs["a"])[seen:]
        # [2, 3]; or [3] alone when c, started again, had registered (revoking its gone lease) before a met.
        check([x["groups"] for x in third] in ([2, 3], [3]), lambda: f"a's changes after c's rank was killed: {third}")
        third_pause = third[0]["pause_s"]
        check(ranks_of(a) == a_ranks, lambda: f"a's ranks were {a_ranks} and are {ranks_of(a)}")
        results = c.wait([a, g2, b2], TIMEOUT * 2)
        check(all(code == 0 for code, _ in results), lambda: c.outputs([a, g2, b2]))
    worst = 0.0
    for n in ("a", "c_again", "b_again"):
        got = {r["step"]: r["loss"] for r in events(dirs[n])}
        check(got and max(got) == steps, lambda: f"{n}: steps {sorted(got)[:5]}...{sorted(got)[-5:]}")
        if n == "a":  # each step once, in order (a step another group took while a lost it comes with a's heal)
            taken = [r["step"] for r in events(dirs[n])]
            check(taken == sorted(set(taken)), f"a's steps: {taken}")
        # A step whose update was applied but whose loss could not be summed across the groups (a group
        # lost right after it) reports none (null), never a partial sum: at most one per fault.
        unsummed = [s for s, loss in got.items() if loss is None]
        check(len(unsummed) <= 3, f"group {n}: steps without a loss {unsummed}")
        got = {s: loss for s, loss in got.items() if loss is not None}
        off = [(s, loss, want[s]) for s, loss in sorted(got.items()) if abs(loss - want[s]) > 1e-5 * abs(want[s])]
        check(not off, lambda: f"group {n}: losses (step, loss, uninterrupted) {off[:8]}; changes "
                               f"{changes(dirs[n])}")
        worst = max([worst] + [abs(loss - want[s]) / abs(want[s]) for s, loss in got.items()])
    # Every step was taken by some group (a group that lost a step the others took heals past it).
    covered = {r["step"] for n in dirs for r in events(dirs[n])}
    check(covered == set(range(1, steps + 1)), lambda: f"steps no group took: {set(range(1, steps + 1)) - covered}")
    def final(run_dir):
        out = run_dir + ".safetensors"
        p = subprocess.run([os.path.join(build, "zeroshard-ckpt"), "export", os.path.join(run_dir, "checkpoints"), out,
                            "--safetensors"], capture_output=True, text=True, timeout=TIMEOUT)
        check(p.returncode == 0, lambda: f"export {run_dir}: {p.stdout[-2000:]}{p.stderr[-2000:]}")
        return read_safetensors(out)[1]  # {name: (dtype, array)}

    # The final parameters: every group's equal bit for bit (the groups apply one sum), and the model against
    # the uninterrupted run's within 1e-5 of its norm, each tensor within 1e-4 of its own (340 steps of sums
    # in other orders, 2 ranks against 3 groups of 2, move the smallest-gradient tensors by about 1e-5; a
    # tensor healed or trained wrong is off by far more). Not the attention's key biases: softmax is
    # invariant to a constant added to a row's logits, so their gradient is zero but for rounding, which
    # AdamW scales to whole steps of either sign; their values depend on the order of every sum.
    ref_params = final(ref)
    noise = {k for k in ref_params if k.endswith("k_proj.bias")}
    got = {n: final(dirs[n]) for n in ("a", "c_again", "b_again")}
    for n in ("c_again", "b_again"):
        check(got[n].keys() == got["a"].keys(), lambda: f"{n}: tensors {sorted(got[n].keys() ^ got['a'].keys())[:5]}")
        differ = [k for k in got["a"] if got[n][k][1].tobytes() != got["a"][k][1].tobytes()]
        check(not differ, lambda: f"{n}'s final parameters differ from a's: {differ[:8]}")
    check(got["a"].keys() == ref_params.keys(), lambda: f"tensors {sorted(got['a'].keys() ^ ref_params.keys())[:5]}")
    off, diff2, norm2 = {}, 0.0, 0.0
    for k, (_, want_t) in ref_params.items():
        if k in noise:
            continue
        want64 = want_t.astype("float64")
        d = float(np.linalg.norm(got["a"][k][1].astype("float64") - want64))
        w = float(np.linalg.norm(want64))
        off[k] = d / max(w, 1e-30)
        diff2, norm2 = diff2 + d * d, norm2 + w * w
    params_off = (diff2 / norm2) ** 0.5
    worst_tensor = max(off.items(), key=lambda kv: kv[1])
    check(params_off <= 1e-5 and worst_tensor[1] <= 1e-4,
          lambda: f"the final parameters differ from the uninterrupted run's by {params_off:.2e} of their norm; "
          f"the worst tensors: {sorted(off.items(), key=lambda kv: -kv[1])[:8]}")
    heals = [changes(dirs[n])[0] for n in ("c_again", "b_again")]
    check(all(h["heal_bytes"] > 0 for h in heals), heals)
    restarted = [x for x in changes(dirs["c_again"]) if x["heal_bytes"] > 0 and x["time"] > killed_at][0]
    print(f"replica: ZeRO-{stage}, 3 groups x 2 ranks on 3 hosts, etcd on each; host 2 killed: a and b paused {first_pause:.2f} s "
          f"(liveness {liveness} s); a new c healed {heals[0]['heal_bytes'] / 1e6:.1f} MB in {heals[0]['heal_s']:.3f} "
          f"s at step {heals[0]['step']}; host 1 cut off: a and c paused {second_pause:.2f} s; a new b healed at step "
          f"{heals[1]['step']}; a rank of c killed: a and b paused {third_pause:.2f} s, c started again by its "
          f"launcher and healed at step {restarted['step']}; a's ranks never restarted; {steps} steps, every loss "
          f"within {worst:.1e} of the uninterrupted run's, every group's final parameters the same bit for bit and within {params_off:.1e} of the "
          f"uninterrupted run's (norm; the worst tensor {worst_tensor[1]:.1e}, {worst_tensor[0]}; the {len(noise)} "
          "attention key biases, whose gradient is rounding, not compared)",
          flush=True)


def ranks_of(job):
    """The pids of a job's ranks (its launcher's bart_pretrain children, inside the host's namespace)."""
    found, todo = [], [job.proc.pid]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(k) for k in f.read().split()]
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name == "bart_pretrain":
            found.append(pid)
        todo += kids
    return sorted(found)


def cluster_kill(c, i):
    cluster_sh("kill", c.number, i)


def cluster_cut(c, i):
    cluster_sh("cut", c.number, i)


def cluster_heal(c, i):
    cluster_sh("heal", c.number, i)


def cluster_shape(c, i, rate):
    cluster_sh("shape", c.number, i, rate)


def main():
    build, which = os.path.abspath(sys.argv[1]), sys.argv[2]
    work = tempfile.mkdtemp(prefix=f"zs-cluster-{which}-")
    try:
        {"zero": check_zero, "bart": check_bart, "failures": check_failures, "elastic": check_elastic,
         "durable": check_durable, "replica": check_replica,
         "replica3": lambda build, work: check_replica(build, work, 3)}[which](
            build, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
