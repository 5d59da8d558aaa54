#!/usr/bin/env python3
"""bart_pretrain end to end, against independent oracles.

Usage: check_pretrain.py BUILD_DIR WORK_DIR CHECK
  equal_ranks  4-rank ZeRO-3 and 1-rank runs agree over the first 10 steps:
               every step's loss (rel. 1e-5) and the parameters after step 10;
               4-rank ZeRO-0/1/2, hybrid, and ZeRO-2/3 with activation checkpointing take the same steps too,
               the latter sending the bytes of the runs without it (per step up to one step's difference,
               which must not add up: ZeRO-3's next gather may land in either step)
  resume       4 ranks, SIGTERM through zeroshard-run half-way, restart, resume:
               final parameters and AdamW moments equal an uninterrupted run's, bit for bit; and rank 0
               killed between a checkpoint's commit and its step's metrics line: the line is restored
  bf16         --precision bf16 at ZeRO-2 and ZeRO-3 (2 ranks): every step's loss within bf16
               rounding of fp32's, both stages agree, and the loss falls
  pipeline     --pp: pp x dp runs (every schedule, ZeRO-1/2/3, uniform, balanced, timed partitions) take the
               unpipelined run's steps at the same dp, losses and validation losses within 1e-6
               relative; a SIGTERM stops every stage after the same step and the restart resumes
               bit-exact; the pipelined checkpoint resumes without a pipeline; metrics carry the bubble,
               traces each stage's passes and sends
  bad_input    wrong flags and data: one clear line naming the thing and the fix, exit 1, no backtrace
  durable      --ckpt-dir s3://... (under tests/checkpoint/s3_store.py): saves committed in the store; the local
               checkpoints deleted (a host lost with its disk), the next launch resumes from the store alone with
               the uninterrupted run's losses; a pipeline's (pp 2, ZeRO-1) durable step resumed by one process
               without a pipeline, its newest commit taken away (the step before it is loaded); a kill storm;
               a preemption with the store stalled, then trickling: every rank ends within the grace period
  replica_groups  --replica-group: two groups of one rank meet through a real etcd member; group b joins a
               running, heals from it, is killed (its launcher, SIGKILL), and a later b heals again (in the
               same run directory: its metrics keep the first b's steps, each once); the surviving group
               never restarts; then every group is lost at once (each rank SIGKILLed), their launchers
               start them again, and both fall back to their checkpoint of step 200, saying so. Every
               step's loss of both equals an uninterrupted 2-rank run's (rel. 1e-5): every sample trained
               once; loss.png marks each change; then a group with no state, alone in the finished job,
               refuses to start over (--replica-alone exit)
  straggler    2 ranks, rank 1's process held to 30% of a core (a cgroup v1 CPU quota) from its start: the
               straggler rule (--straggler-window 20) names rank 1 and this host within two windows, once,
               and never rank 0; the same run unthrottled names no one (nor does its log); every step's
               agreement is its one all-reduce, the ranks' figures in it
  safetensors  export of a trained model (zeroshard-ckpt export --safetensors),
               re-imported (zeroshard-ckpt import): identical logits; Hugging Face names
"""
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "checkpoint"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from check_cli import read_safetensors  # noqa: E402  (a plain JSON + numpy reader)
from check_tensorboard import compare as tensorboard_matches  # noqa: E402  (TensorBoard's reader against the lines)
from pycheck import skip  # noqa: E402
from pycheck import check  # noqa: E402  (an assert that python -O keeps)

DATA = "/usr/share/common-licenses"


def run(cmd, expect=0, env=None):
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    print(f"{time.monotonic() - start:5.1f} s  {' '.join(os.path.basename(c) if os.sep in c else c for c in cmd)}", flush=True)
    if p.returncode != expect:
        sys.exit(f"FAIL: {' '.join(cmd)}: exit {p.returncode}, expected {expect}\n{p.stdout[-6000:]}{p.stderr[-6000:]}")
    return p.stdout + p.stderr


def pretrain(build, run_dir, nproc, *args, launcher_args=(), expect=0, env_extra=None):
    exe = os.path.join(build, "examples", "bart_pretrain")
    data = [] if "--data" in args else ["--data", DATA]
    progress = [] if "--progress-interval" in args else ["--progress-interval", "1000"]
    base = [exe, *data, "--run-dir", run_dir, "--no-plot", *progress, *args]
    env = dict(os.environ, ZS_LOG_LEVEL="warn", **(env_extra or {}))
    if nproc == 0:  # alone, without the launcher
        return run(base, expect, env)
    return run([os.path.join(build, "zeroshard-run"), "--nproc-per-node", str(nproc), *launcher_args, "--", *base],
               expect, env)


def children(pid):
    """A launcher's processes: its ranks (none once it has ended)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def exported(build, run_dir, out, *extra):
    run([os.path.join(build, "zeroshard-ckpt"), "export", os.path.join(run_dir, "checkpoints"), out, "--safetensors", *extra])
    return read_safetensors(out)


def check_equal_ranks(build, work):
    common = ["--max-steps", "10", "--save-every", "10", "--eval-every", "0", "--dropout", "0", "--no-sample",
              "--global-batch", "16", "--micro-batches", "2", "--max-tokens", "32"]
    dirs = {}
    for nproc in (0, 4):
        d = dirs[nproc] = os.path.join(work, f"equal_np{nproc}")
        shutil.rmtree(d, ignore_errors=True)
        if nproc:  # one tokenizer for both (training it is deterministic, but the test should not depend on it)
            shutil.copytree(os.path.join(dirs[0], "tokenizer"), os.path.join(d, "tokenizer"))
        pretrain(build, d, nproc, *common)
    # ZeRO-0/1/2 over the 4 ranks, and hybrid sharding (2 shard groups of 2 ranks) at stages 2 and 3.
    labels = {4: "ZeRO-3"}
    # And ZeRO-3 recomputing every layer in backward (activation checkpointing).
    for stage, shard, extra in ((0, "0", ()), (1, "0", ()), (2, "0", ()), (2, "2", ()), (3, "2", ()),
                                (2, "0", ("--activation-checkpointing",)), (3, "0", ("--activation-checkpointing",))):
        name = f"stage{stage}" + ("" if shard == "0" else f"_shard{shard}") + ("_recompute" if extra else "")
        labels[name] = (f"ZeRO-{stage}" + ("" if shard == "0" else f", hybrid 2 x {shard}") +
                        (", activation checkpointing" if extra else ""))
        d = dirs[name] = os.path.join(work, f"equal_np4_{name}")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(os.path.join(dirs[0], "tokenizer"), os.path.join(d, "tokenizer"))
        pretrain(build, d, 4, *common, "--stage", str(stage), "--shard-size", shard, "--ckpt-dir", "none", *extra)
    losses = {n: [r["loss"] for r in metrics(d) if "event" not in r] for n, d in dirs.items()}
    # Recomputing every layer in backward moves exactly the bytes of the run that does not (each backward is one
    # reduction of every bucket, not one per checkpointed layer): ZeRO-2 and ZeRO-3, every step, rank 0. A step's
    # count is what completed by its end: ZeRO-3's gather of the next step's first unit, issued as a step ends, may
    # land in either step. So the runs' counts up to each step may differ by one step's difference at most; a
    # difference that repeats (recomputing sends more every step) adds up and fails.
    for stage in (2, 3):
        plain, recompute = ([r["bytes_sent"] for r in metrics(dirs[n]) if "event" not in r]
                            for n in ((f"stage{stage}" if stage == 2 else 4), f"stage{stage}_recompute"))
        check(len(plain) == len(recompute) == 10, f"ZeRO-{stage}: {len(plain)} and {len(recompute)} steps")
        shift = max(abs(a - b) for a, b in zip(plain, recompute))
        apart = [abs(sum(plain[:k]) - sum(recompute[:k])) for k in range(1, len(plain) + 1)]
        check(max(apart) <= shift and shift < min(plain) / 10,
              f"ZeRO-{stage}: bytes per step {plain} without activation checkpointing, {recompute} with it")
        print(f"equal_ranks: ZeRO-{stage} sends {plain[0] / 1e6:.2f} MB per step (rank 0) with activation "
              f"checkpointing and without")
    # Goodput in every run: 1 rank reduces each of its 2 micro-batches (ZeRO-3), 4 ranks reduce theirs.
    for n, d in dirs.items():
        steps = [r for r in metrics(d) if "event" not in r]
        for r in steps:
            check((r["noise_scale"] is None or r["noise_scale"] >= 0) and 0 < r["efficiency"] <= 1, (n, r))  # None: inf
            check(abs(r["goodput"] - r["efficiency"] * r["tokens_per_s"]) <= 1e-6 * r["goodput"] + 1e-9, (n, r))
        summary = [r for r in metrics(d) if r.get("event") == "summary"][-1]
        check(0 < summary["efficiency"] <= 1 and summary["goodput"] <= summary["tokens_per_s"], (n, summary))
    for n in dirs:
        check(len(losses[n]) == 10, (n, losses[n]))
        worst = max(abs(a - b) / abs(a) for a, b in zip(losses[0], losses[n]))
        what = labels.get(n)
        if what:
            print(f"equal_ranks: per-step loss, 1 rank vs 4 ranks {what}, max relative difference {worst:.2e}")
        check(worst < 1e-5, (n, losses[0], losses[n]))
    _, p1 = exported(build, dirs[0], os.path.join(work, "equal_np0.safetensors"))
    _, p4 = exported(build, dirs[4], os.path.join(work, "equal_np4.safetensors"))
    check(p1.keys() == p4.keys(),
          lambda: f"the 1- and 4-rank exports' names differ: {sorted(p1.keys() ^ p4.keys())[:10]}")
    worst = 0.0
    for k in p1:
        a, b = p1[k][1], p4[k][1]
        worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
        # Adam normalises updates: float rounding moves a parameter by well under lr (1e-3 peak, 3.3e-4 at step 10).
        check(np.allclose(a, b, rtol=1e-4, atol=2e-5), lambda: f"{k}: max |diff| {np.max(np.abs(a - b))}")
    print(f"equal_ranks: parameters after 10 steps, max |difference| {worst:.2e} over {len(p1)} tensors")
    # The batches built by the loader's threads ahead of the step are the ones the training thread builds itself.
    d = os.path.join(work, "equal_np0_no_loader")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(os.path.join(dirs[0], "tokenizer"), os.path.join(d, "tokenizer"))
    pretrain(build, d, 0, *common, "--loader-threads", "0", "--ckpt-dir", "none")
    same = [r["loss"] for r in metrics(d) if "event" not in r]
    check(same == losses[0], f"1 rank: losses {losses[0]} with the loader's threads, {same} without")
    # The time a step waited for its batch is part of that step's time.
    steps = [r for r in metrics(dirs[0]) if "event" not in r]
    check(len(steps) == 10 and all(0 <= r["data_wait_s"] <= r["step_s"] for r in steps),
          [(r["data_wait_s"], r["step_s"]) for r in steps])
    print("equal_ranks: 1 rank with batches built on the training thread: the same losses, bit for bit")


def check_resume(build, work):
    common = ["--max-steps", "20", "--save-every", "100", "--eval-every", "10", "--max-tokens", "32", "--no-sample"]
    ref, cut = os.path.join(work, "resume_ref"), os.path.join(work, "resume_cut")
    for d in (ref, cut):
        shutil.rmtree(d, ignore_errors=True)
    pretrain(build, ref, 4, *common)
    shutil.copytree(os.path.join(ref, "tokenizer"), os.path.join(cut, "tokenizer"))
    out = pretrain(build, cut, 4, *common, launcher_args=["--max-restarts", "1", "--simulate-preemption-at-step", "10"])
    check("simulating a spot preemption" in out and "restarting all ranks" in out, out[-3000:])
    summary = [r for r in metrics(cut) if r.get("event") == "summary"][-1]
    stop = summary["interruptions"][0]["step"]
    check(10 <= stop < 20 and summary["resumed"]["step"] == stop, summary)
    # The resumed run's metrics file reads as one run: steps 1..20, once each.
    steps = [r["step"] for r in metrics(cut) if "event" not in r]
    check(steps == list(range(1, 21)), steps)
    a_header, a = exported(build, ref, os.path.join(work, "resume_ref.safetensors"), "--buffers")
    b_header, b = exported(build, cut, os.path.join(work, "resume_cut.safetensors"), "--buffers")
    check(a.keys() == b.keys(),
          lambda: f"the interrupted and uninterrupted exports' names differ: {sorted(a.keys() ^ b.keys())[:10]}")
    for k in a:
        check(np.array_equal(a[k][1], b[k][1]), f"{k} differs after the interruption at step {stop}")
    # The AdamW moments too: the consolidated HDF5 files, read with h5py.
    import h5py
    files = []
    for d in (ref, cut):
        out_h5 = d + ".h5"
        run([os.path.join(build, "zeroshard-ckpt"), "consolidate", os.path.join(d, "checkpoints"), out_h5, "--moments"])
        files.append(h5py.File(out_h5, "r"))
    names = []
    files[0].visit(lambda n: names.append(n) if isinstance(files[0][n], h5py.Dataset) else None)
    check(any(n.startswith("optimizer/") for n in names), names[:10])
    for n in names:
        check(np.array_equal(files[0][n][()], files[1][n][()]), f"{n} differs after the interruption")
    # The gradient noise scale's averages travel in the checkpoint: the resumed run goes on from them.
    noise = [[(r["step"], r.get("noise_scale"), r.get("efficiency")) for r in metrics(d) if "event" not in r]
             for d in (ref, cut)]
    check(all(e is not None for _, _, e in noise[0]), noise[0][:3])
    check(noise[0] == noise[1], lambda: [(a, b) for a, b in zip(*noise) if a != b][:3])
    # TensorBoard (RUN_DIR/tensorboard, one file per launch) shows one curve, equal to the lines.
    tb = tensorboard_matches(cut, "the resumed run's TensorBoard files")
    check([s for s, _, _ in tb["loss"]] == list(range(1, 21)), tb["loss"])
    check(len(os.listdir(os.path.join(cut, "tensorboard"))) == 2, os.listdir(os.path.join(cut, "tensorboard")))
    print(f"resume: SIGTERM at step {stop} of 20 through zeroshard-run, restart, resume: {len(a)} parameters and "
          f"{len(names)} datasets (with AdamW moments) bit-identical to the uninterrupted run; TensorBoard's "
          f"reader finds {len(tb)} scalars, one curve of steps 1-20, each equal to metrics.jsonl")

    # A crash at the worst instant for the record: rank 0 killed (SIGKILL) right after step 10's checkpoint
    # committed, before step 10's metrics line. The restart resumes from step 10 and writes that line from the
    # checkpoint, which carried it: every step has its line once, with the uninterrupted run's loss.
    crash = os.path.join(work, "resume_crash")
    shutil.rmtree(crash, ignore_errors=True)
    shutil.copytree(os.path.join(ref, "tokenizer"), os.path.join(crash, "tokenizer"))
    out = pretrain(build, crash, 4, "--max-steps", "20", "--save-every", "10", "--eval-every", "10", "--max-tokens",
                   "32", "--no-sample", "--crash-after-save", "10", launcher_args=["--max-restarts", "1"])
    check("restarting all ranks" in out, out[-3000:])
    summary = [r for r in metrics(crash) if r.get("event") == "summary"][-1]
    check(summary["resumed"]["step"] == 10, summary)
    lines = [r for r in metrics(crash) if "event" not in r]
    check([r["step"] for r in lines] == list(range(1, 21)), [r["step"] for r in lines])
    restored = [r["step"] for r in lines if r.get("restored")]
    check(restored == [10], f"restored lines {restored}, expected step 10's alone")
    want = [r["loss"] for r in metrics(ref) if "event" not in r]
    check([r["loss"] for r in lines] == want, lambda: [(a["step"], a["loss"], b) for a, b in zip(lines, want)
                                                      if a["loss"] != b][:3])
    tb = tensorboard_matches(crash, "TensorBoard after the crash")
    check([s for s, _, _ in tb["loss"]] == list(range(1, 21)), tb["loss"])
    print("resume: rank 0 killed between step 10's checkpoint commit and its metrics line: the restart wrote "
          "step 10's line from the checkpoint; steps 1-20 once each, every loss equal to the uninterrupted run's, "
          "in TensorBoard too")


def check_durable(build, work):
    """--ckpt-dir s3://... (under tests/checkpoint/s3_store.py): every save is committed in the store; the
    host's disk lost (its checkpoints gone), the next launch resumes from the store alone and takes the
    uninterrupted run's steps."""
    bucket = os.environ.get("ZS_TEST_S3_BUCKET")
    check(bucket, "run under tests/checkpoint/s3_store.py (ctest's bart_pretrain_durable does)")
    uri = f"s3://{bucket}/bart-durable-{os.getpid()}"
    # One document held out (the 17 licenses' former default): the runs' timing, which the storm's kills are paced
    # by, is the one these checks were measured at.
    common = ["--save-every", "4", "--eval-every", "100", "--max-tokens", "32", "--no-sample", "--validation-docs", "1"]
    ref, cut = os.path.join(work, "durable_ref"), os.path.join(work, "durable_cut")
    for d in (ref, cut):
        shutil.rmtree(d, ignore_errors=True)
    pretrain(build, ref, 2, "--max-steps", "12", *common)
    shutil.copytree(os.path.join(ref, "tokenizer"), os.path.join(cut, "tokenizer"))
    pretrain(build, cut, 2, "--max-steps", "8", *common, "--ckpt-dir", uri)
    durable = [r["step"] for r in metrics(cut) if r.get("event") == "durable"]
    check(durable and durable[-1] <= 8 and set(durable) <= {4, 8}, f"durable events at steps {durable}")
    summary = [r for r in metrics(cut) if r.get("event") == "summary"][-1]
    check(summary["durable"]["uri"] == uri and summary["durable"]["abandoned"] == 0, summary.get("durable"))
    lines = [r for r in metrics(cut) if "event" not in r]
    check(all("durable_step" in r for r in lines), "a step line without durable_step")
    # The host is lost with its disk: nothing of the checkpoints is left on it.
    shutil.rmtree(os.path.join(cut, "checkpoints"))
    out = pretrain(build, cut, 2, "--max-steps", "12", *common, "--ckpt-dir", uri)
    check("from the durable tier" in out, f"the resume did not copy from the durable tier:\n{out[-3000:]}")
    summary = [r for r in metrics(cut) if r.get("event") == "summary"][-1]
    check(summary["resumed"]["step"] == 8, summary.get("resumed"))
    got = {r["step"]: r["loss"] for r in metrics(cut) if "event" not in r}
    want = {r["step"]: r["loss"] for r in metrics(ref) if "event" not in r}
    check(all(got[s] == want[s] for s in range(9, 13)), lambda: [(s, got.get(s), want[s]) for s in range(9, 13)])
    check(summary["durable"]["step"] == 12, summary["durable"])
    print(f"durable: saves committed in {uri} (steps {durable}); the local checkpoints deleted, the next launch "
          "resumed from the store at step 8 and steps 9-12 took the uninterrupted run's losses exactly")
    # A pipeline's checkpoints through the store, resumed at another layout: pp 2 with ZeRO-1 commits steps 4, 8
    # and 12; step 12's commit is taken away (as if its upload had never finished: a step without its manifest
    # does not exist) and the disk is lost; one process without a pipeline resumes from step 8 in the store and
    # takes the pipelined run's steps 9-12 (within 1e-6 relative: the stages sum in another order).
    import s3fs
    pipe = ["--global-batch", "8", "--micro-batches", "4", "--save-every", "4", "--eval-every", "100",
            "--max-tokens", "32", "--no-sample", "--validation-docs", "1", "--stage", "1", "--max-steps", "12",
            "--ckpt-dir", uri + "-pp"]
    pp, flat = os.path.join(work, "durable_pp"), os.path.join(work, "durable_pp_resumed")
    for d in (pp, flat):
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(os.path.join(ref, "tokenizer"), os.path.join(d, "tokenizer"))
    pretrain(build, pp, 2, *pipe, "--pp", "2")
    check([r["step"] for r in metrics(pp) if r.get("event") == "durable"][-1] == 12, "the pipelined run's step 12")
    store = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"],
                                             "region_name": os.environ["AWS_REGION"]})
    # Step 8's upload is skipped when step 4's is still in flight on some rank as step 8 is saved (a matter of
    # timing): the resume takes the newest commit left, whichever it is.
    found = store.glob(f"{bucket}/bart-durable-{os.getpid()}-pp/step-*/commit-*.json")
    commits = sorted(int(m.split("/")[-2][5:]) for m in found)
    check(commits[-1] == 12 and len(commits) >= 2, commits)
    store.rm([m for m in found if "/step-00000012/" in m])
    shutil.rmtree(os.path.join(pp, "checkpoints"))
    out = pretrain(build, flat, 0, *pipe)
    check("from the durable tier" in out, f"the resume did not copy from the durable tier:\n{out[-3000:]}")
    summary = [r for r in metrics(flat) if r.get("event") == "summary"][-1]
    back = commits[-2]
    check(summary["resumed"]["step"] == back and summary["pp"] == 1, (back, summary.get("resumed"), summary.get("pp")))
    got = {r["step"]: r["loss"] for r in metrics(flat) if "event" not in r and r["step"] > back}
    want = {r["step"]: r["loss"] for r in metrics(pp) if "event" not in r}
    check(sorted(got) == list(range(back + 1, 13)), got)
    worst = max(abs(got[s] - want[s]) / want[s] for s in got)
    check(worst < 1e-6, lambda: [(s, got[s], want[s]) for s in got])
    print(f"durable: pp 2 (ZeRO-1) committed steps {commits}; step 12's commit taken away and the disk lost, one "
          f"process without a pipeline resumed from step {back} in the store: steps {back + 1}-12 within {worst:.1e} "
          "of the pipelined run's")
    durable_kill_storm(build, work, ref, uri + "-storm")
    durable_exit_with_the_store_stalled(build, work, ref, uri + "-stalled")


def durable_exit_with_the_store_stalled(build, work, ref, uri):
    """A preemption (SIGTERM to the launcher, grace period 10 s) while an upload is in flight to a store that has
    stalled, then to one that trickles (4 KiB/s, above the stall limit; the fault proxy of s3_store.py): both ranks
    end by themselves within the grace period with the preemption's exit code (75), no process of the run is left,
    the preemption's local checkpoint verifies, and each rank still uploading says in one line that the job ended
    during an upload to the store, naming it."""
    import signal
    import urllib.request

    def faults(spec):
        urllib.request.urlopen(os.environ["ZS_TEST_FAKE_AWS"] + "/control/faults", data=spec.encode(), timeout=10)

    grace = 10
    for fault in ("stall-all", "trickle-all"):
        d = os.path.join(work, f"durable_{fault}")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(os.path.join(ref, "tokenizer"), os.path.join(d, "tokenizer"))
        args = [os.path.join(build, "examples", "bart_pretrain"), "--data", DATA, "--run-dir", d, "--no-plot",
                "--progress-interval", "1000", "--max-steps", "100000", "--save-every", "4", "--eval-every", "0",
                "--max-tokens", "32", "--no-sample", "--validation-docs", "1", "--ckpt-dir", f"{uri}-{fault}"]
        cmd = [os.path.join(build, "zeroshard-run"), "--nproc-per-node", "2", "--grace-period", str(grace), "--", *args]
        env = dict(os.environ, ZS_LOG_LEVEL="warn", AWS_ENDPOINT_URL=os.environ["ZS_TEST_S3_PROXY"])
        log = open(os.path.join(work, f"durable_{fault}.log"), "w+")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and p.poll() is None:  # a step durable: the store answered
                if os.path.exists(os.path.join(d, "metrics.jsonl")) and any(
                        r.get("event") == "durable" for r in metrics(d)):
                    break
                time.sleep(0.2)
            check(p.poll() is None, "the run ended before a step was durable")
            faults(fault)
            time.sleep(3)  # the next save's upload starts and meets the fault; later saves skip theirs
            start = time.monotonic()
            p.send_signal(signal.SIGTERM)
            code = p.wait(timeout=120)
            took = time.monotonic() - start
        finally:
            faults("pass")
            if p.poll() is None:
                p.kill()
        log.seek(0)
        out = log.read()
        log.close()
        left = subprocess.run(["pgrep", "-f", d], capture_output=True, text=True).stdout.split()
        check(code == 75 and took < grace and not left,
              lambda: f"{fault}: exit {code} {took:.1f} s after SIGTERM (grace {grace} s), processes left {left}:\n"
                      f"{out[-4000:]}")
        # Each rank whose upload was still in flight (a rank may have finished its part before the fault): one line.
        said = [line for line in out.splitlines() if "the job ended while step" in line]
        check(1 <= len(said) <= 2 and len({line[:8] for line in said}) == len(said) and
              all(f"{uri}-{fault}" in line for line in said), lambda: f"{fault}:\n{out[-4000:]}")
        run([os.path.join(build, "zeroshard-ckpt"), "verify", os.path.join(d, "checkpoints")])
        print(f"durable: SIGTERM with the store {fault[:-4]} during an upload: both ranks exited 75 in {took:.1f} s "
              f"(grace {grace} s), the local checkpoint verifies; {said[0].strip()[:200]}")


def durable_kill_storm(build, work, ref, uri):
    """Ranks killed (SIGKILL) at random moments of a run that saves and uploads every second step, and twice the
    whole host killed and its disk wiped once the store holds a newer commit than at the last wipe (so the next
    launch must resume from the store), until the run ends: the launch after the last wipe resumes from the store,
    every step takes the uninterrupted run's loss exactly (so no partial checkpoint was ever loaded: a rank file
    from another step or half a file would change it or fail its checksum), the final parameters are bit-identical
    to it, and every step the store calls committed verifies."""
    import random
    import signal
    import s3fs
    rng = random.Random(5)
    store = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"],
                                             "region_name": os.environ["AWS_REGION"]})

    def commits():  # (step directory, line) of every commit, by step
        store.invalidate_cache()
        return sorted((os.path.basename(os.path.dirname(m)), os.path.basename(m)[7:-5])
                      for m in store.glob(uri[5:] + "/step-*/commit-*.json"))

    def committed():
        return sorted({step for step, _ in commits()})

    storm = os.path.join(work, "durable_storm")
    shutil.rmtree(storm, ignore_errors=True)
    shutil.copytree(os.path.join(ref, "tokenizer"), os.path.join(storm, "tokenizer"))
    exe = os.path.join(build, "examples", "bart_pretrain")
    args = [exe, "--data", DATA, "--run-dir", storm, "--no-plot", "--progress-interval", "1000", "--max-steps", "12",
            "--save-every", "2", "--keep", "2", "--eval-every", "100", "--max-tokens", "32", "--no-sample", "--validation-docs",
            "1", "--ckpt-dir", uri]
    cmd = [os.path.join(build, "zeroshard-run"), "--nproc-per-node", "2", "--max-restarts", "20", "--grace-period", "2",
           "--", *args]
    env = dict(os.environ, ZS_LOG_LEVEL="warn")
    kills, wipes, launches, out, wiped_at = 0, 0, 0, "", ""
    start = time.monotonic()
    metrics_file, grown_to = os.path.join(storm, "metrics.jsonl"), -1

    def trained_since_last_kill():  # a step line written since the last kill (not the time: runs differ in speed)
        return os.path.exists(metrics_file) and os.path.getsize(metrics_file) != grown_to

    while True:
        launches += 1
        log = open(os.path.join(work, f"durable_storm_{launches}.log"), "w+")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while p.poll() is None and kills < 6 and time.monotonic() - start < 400:
            time.sleep(0.05)
            ranks = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
            if p.poll() is not None or len(ranks) < 2 or not trained_since_last_kill():
                continue
            time.sleep(rng.uniform(0, 0.4))  # a random moment of the steps after it: a save, an upload, a step
            grown_to = os.path.getsize(metrics_file) if os.path.exists(metrics_file) else -1
            if kills + 1 in (3, 5):  # the host is lost: the launcher and its ranks (PR_SET_PDEATHSIG), and its disk
                newest = committed()
                if not newest or newest[-1] <= wiped_at:
                    continue  # not before the store holds a newer step than at the last wipe
                kills, wipes, wiped_at = kills + 1, wipes + 1, newest[-1]
                p.kill()
                p.wait()
                shutil.rmtree(os.path.join(storm, "checkpoints"), ignore_errors=True)
                break
            try:
                os.kill(int(rng.choice(ranks)), signal.SIGKILL)
            except ProcessLookupError:  # it ended in the moment before (the launcher restarts its group)
                continue
            kills += 1
        p.wait(timeout=max(1, 400 - (time.monotonic() - start)))
        log.seek(0)
        out += log.read()
        log.close()
        if p.returncode == 0:
            break
        check(p.returncode == -signal.SIGKILL and launches < 6, f"launch {launches} ended with {p.returncode}:\n{out[-4000:]}")
    # The run can end before the sixth kill: the kills wait for the ranks to start, the wipes for a commit.
    check(kills >= 4 and wipes >= 1, f"the storm killed {kills} times and wiped the disk {wipes} times")
    want = {r["step"]: r["loss"] for r in metrics(ref) if "event" not in r}
    rows = [r for r in metrics(storm) if "event" not in r]
    check({r["step"] for r in rows} >= set(range(1, 13)), sorted({r["step"] for r in rows}))
    wrong = [(r["step"], r["loss"], want[r["step"]]) for r in rows if r["loss"] != want[r["step"]]]
    check(not wrong, f"steps after a resume that differ from the uninterrupted run: {wrong[:5]}")
    # The launch after the last wipe resumed from the store, from a step at least as new as the store held then
    # (its resume is the log's last: a resume rewrites the log from the step it resumes from).
    resumed = [r for r in metrics(storm) if r.get("event") == "resume"]
    check(resumed and f"step-{resumed[-1]['step']:08d}" >= wiped_at,
          f"resumes {resumed}; the store held {wiped_at} at the last wipe")
    _, a = exported(build, ref, os.path.join(work, "storm_ref.safetensors"), "--buffers")
    # The store's step 12 (the last launch may have found it committed there and had nothing left to train).
    run([os.path.join(build, "zeroshard-ckpt"), "export", uri + "/step-00000012", os.path.join(work, "storm_got.safetensors"),
         "--safetensors", "--buffers"])
    _, b = read_safetensors(os.path.join(work, "storm_got.safetensors"))
    check(a.keys() == b.keys() and all(np.array_equal(a[k][1], b[k][1]) for k in a),
          "the storm's final parameters differ from the uninterrupted run's")
    steps = committed()
    check(steps and steps[-1] == "step-00000012", f"committed in the store: {steps}")
    for step, line in commits():  # exit 0: every file's size and xxh3 as its manifest says
        run([os.path.join(build, "zeroshard-ckpt"), "verify", f"{uri}/{step}", "--line", line])
    print(f"durable: kill storm: {kills} kills in {launches} launches ({wipes} with the host's disk wiped, the last "
          f"when the store held {wiped_at}), the last launch resumed from step {resumed[-1]['step']}; the "
          f"{len(rows)} step lines (each from the last launch that ran it) equal to the uninterrupted run's; final "
          f"parameters bit-identical; the store's commits ({', '.join(steps)}) verify")


def check_safetensors(build, work):
    d, d2 = os.path.join(work, "st_trained"), os.path.join(work, "st_imported")
    for x in (d, d2):
        shutil.rmtree(x, ignore_errors=True)
    pretrain(build, d, 2, "--max-steps", "30", "--save-every", "30", "--eval-every", "0", "--no-sample",
             "--max-tokens", "32")
    st = os.path.join(work, "st_trained.safetensors")
    header, tensors = exported(build, d, st, "--buffers")
    # Hugging Face BartForConditionalGeneration's names.
    for name in ("model.shared.weight", "model.encoder.embed_positions.weight", "model.encoder.layernorm_embedding.weight",
                 "model.encoder.layers.0.self_attn.q_proj.weight", "model.encoder.layers.1.fc2.bias",
                 "model.decoder.layers.0.encoder_attn.out_proj.weight", "model.decoder.layers.1.final_layer_norm.weight",
                 "final_logits_bias"):
        check(name in tensors, lambda: f"{name} missing from the export: {sorted(tensors)[:8]}...")
    check(tensors["model.encoder.embed_positions.weight"][1].shape[0] == 256 + 2, "BART's position offset of 2")
    run([os.path.join(build, "zeroshard-ckpt"), "import", st, os.path.join(d2, "checkpoints"), "--safetensors",
         "--step", "30"])
    l1, l2 = os.path.join(work, "logits_trained.f32"), os.path.join(work, "logits_imported.f32")
    pretrain(build, d, 2, "--max-steps", "30", "--save-logits", l1, "--no-sample", "--max-tokens", "32")
    pretrain(build, d2, 2, "--max-steps", "30", "--save-logits", l2, "--no-sample", "--max-tokens", "32",
             "--tokenizer", os.path.join(d, "tokenizer"))
    a, b = np.fromfile(l1, dtype=np.float32), np.fromfile(l2, dtype=np.float32)
    check(a.size > 0 and a.size == b.size and np.isfinite(a).all(),
          lambda: f"logits: {a.size} from the trained model, {b.size} from the re-imported one; "
                  f"{int((~np.isfinite(a)).sum())} of the trained model's not finite")
    check(np.array_equal(a, b), lambda: f"logits differ: max |diff| {np.max(np.abs(a - b))}")
    print(f"safetensors: {len(tensors)} tensors exported with Hugging Face names, re-imported: {a.size} logits identical")


def check_bf16(build, work):
    # Sequences of at most 64 tokens: the claims are about precision and sharding, not length. bf16 matmuls are
    # slow on a CPU without bf16 instructions (1.3 s a step here): 16 steps of ZeRO-3, 6 of ZeRO-2.
    common = ["--eval-every", "0", "--ckpt-dir", "none", "--no-sample", "--dropout", "0", "--max-tokens", "32"]
    losses = {}
    # ZeRO-2 against ZeRO-3 in bf16 over the first 6 steps only: the sharding's equality, not convergence.
    for name, extra in (("fp32", ["--stage", "3", "--max-steps", "16"]),
                        ("bf16_stage3", ["--stage", "3", "--precision", "bf16", "--max-steps", "16"]),
                        ("bf16_stage2", ["--stage", "2", "--precision", "bf16", "--max-steps", "6"])):
        d = os.path.join(work, name)
        shutil.rmtree(d, ignore_errors=True)
        if name != "fp32":
            shutil.copytree(os.path.join(work, "fp32", "tokenizer"), os.path.join(d, "tokenizer"))
        pretrain(build, d, 2, *common, *extra)
        losses[name] = [r["loss"] for r in metrics(d) if "event" not in r]
    f, b3, b2 = losses["fp32"], losses["bf16_stage3"], losses["bf16_stage2"]
    check(len(b2) == 6 and len(b3) == 16, (len(b2), len(b3)))
    first = abs(b3[0] - f[0]) / f[0]
    track = max(abs(x - y) / y for x, y in zip(b3, f))
    stages = max(abs(x - y) / x for x, y in zip(b3, b2))
    print(f"bf16: first loss {b3[0]:.4f} vs fp32 {f[0]:.4f} (rel. {first:.1e}), every step within {track:.1e} of fp32's; "
          f"ZeRO-2 vs ZeRO-3 max rel. {stages:.1e}; loss {b3[0]:.3f} -> {b3[-1]:.3f} (fp32 {f[0]:.3f} -> {f[-1]:.3f})")
    check(first < 1e-2, (b3[0], f[0]))
    check(stages < 1e-2, (b3, b2))
    # The loss falls (7.65 -> 7.36 over 16 steps of warmup here) and stays with fp32's at every step.
    check(b3[-1] < 0.97 * b3[0] and track < 1e-2, (b3, f))


def check_pipeline(build, work):
    common = ["--max-steps", "12", "--global-batch", "8", "--micro-batches", "4", "--save-every", "6",
              "--eval-every", "6", "--no-sample", "--max-tokens", "32"]
    dirs = {}

    def train(name, nproc, *extra, launcher_args=(), fresh=True, steps=common, env_extra=None):
        d = dirs[name] = os.path.join(work, "pipe_" + name)
        if fresh:
            shutil.rmtree(d, ignore_errors=True)
            if len(dirs) > 1:
                shutil.copytree(os.path.join(dirs["flat2"], "tokenizer"), os.path.join(d, "tokenizer"))
        return pretrain(build, d, nproc, *steps, *extra, launcher_args=launcher_args, env_extra=env_extra)

    def losses(name, kind="loss"):
        rows = metrics(dirs[name])
        if kind in ("loss", "grad_norm"):
            return {r["step"]: r[kind] for r in rows if "event" not in r}
        return {r["step"]: r["val_loss"] for r in rows if r.get("event") == "validation"}

    # The same data parallelism, so the same microbatches and dropout keys: dp 2, then dp 1.
    # flat2 at ZeRO-0: its bucket all-reduces go on the sharding's data plane, not the world's control one.
    train("flat2", 2, "--stage", "0")
    train("pp2_1f1b", 4, "--pp", "2", "--stage", "3", "--trace")
    train("pp2_1f1b_gather_per_pass", 4, "--pp", "2", "--stage", "3", "--pp-gather", "pass", "--ckpt-dir", "none")
    train("pp2_1f1b_replicated", 4, "--pp", "2", "--stage", "0", "--ckpt-dir", "none")
    train("pp2_1f1b_hybrid", 4, "--pp", "2", "--stage", "3", "--shard-size", "1", "--ckpt-dir", "none")
    train("pp2_gpipe", 4, "--pp", "2", "--schedule-pp", "gpipe", "--stage", "1", "--partition", "balanced",
          "--ckpt-dir", "none")
    train("pp2_interleaved", 4, "--pp", "2", "--schedule-pp", "interleaved-1f1b", "--chunks", "2", "--stage", "2",
          "--partition", "timed")
    train("flat1", 0, "--stage", "2", "--ckpt-dir", "none")
    train("pp4", 4, "--pp", "4", "--stage", "2", "--partition", "E e | e | d | d L", "--ckpt-dir", "none")
    # One blocking world collective per step, with a pipeline and without: the step's agreement (the loss, the
    # norms and flags, the preemption vote). The first step also checks the token count (and lays out the stages).
    for name in dirs:
        rows = [r for r in metrics(dirs[name]) if "event" not in r]
        counts = [r["world_all_reduces"] for r in rows]
        check(len(rows) == 12 and counts[0] >= 2 and all(c == 1 for c in counts[1:]),
              f"{name}: world all-reduces per step {counts}; want one per step after the first")
    print(f"pipeline: one world all-reduce per step after the first in {', '.join(dirs)}")
    for base, runs in (("flat2", ("pp2_1f1b", "pp2_1f1b_gather_per_pass", "pp2_1f1b_replicated", "pp2_1f1b_hybrid",
                                  "pp2_gpipe", "pp2_interleaved")),
                       ("flat1", ("pp4",))):
        # The global gradient norm too: the tied embedding's gradient counted once, however it is split.
        for kind in ("loss", "val_loss", "grad_norm"):
            want = losses(base, kind)
            check(len(want) == (3 if kind == "val_loss" else 12), (base, kind, want))
            for name in runs:
                got = losses(name, kind)
                check(got.keys() == want.keys(), (name, kind, got, want))
                worst = max(abs(got[k] - want[k]) / want[k] for k in want)
                print(f"pipeline: {name} vs {base}: {kind} of {len(want)} steps within {worst:.1e} relative")
                check(worst < 1e-6, (name, kind, got, want))
    # Metrics: this rank's bubble beside the formula (p-1)/(v*m+p-1).
    for name, formula in (("pp2_1f1b", 1 / 5), ("pp2_interleaved", 1 / 9), ("pp4", 3 / 7)):
        rows = [r for r in metrics(dirs[name]) if "event" not in r]
        check(all(r["bubble_s"] >= 0 and abs(r["bubble_formula"] - formula) < 1e-12 for r in rows),
              lambda: (name, rows[0]))
    summary = [r for r in metrics(dirs["pp2_1f1b"]) if r.get("event") == "summary"][-1]
    check(summary["pp"] == 2 and summary["ranks"] == 4, summary)
    # Goodput through the stages: every pipelined run measures the noise sample (pp4: dp 1, so each
    # microbatch's reduction is a small batch, as in the 1-rank run with 4 micro-batches it is set beside).
    for name in ("pp2_1f1b", "pp2_1f1b_gather_per_pass", "pp2_1f1b_replicated", "pp2_gpipe", "pp2_interleaved", "pp4"):
        rows = [r for r in metrics(dirs[name]) if "event" not in r]
        check(all(0 < r["efficiency"] <= 1 and r["goodput"] > 0 for r in rows), lambda: (name, rows[0]))
    phi = {n: [r for r in metrics(dirs[n]) if "event" not in r][-1]["noise_scale"] for n in ("flat1", "pp4")}
    phi = {n: "inf" if v is None else f"{v:,.0f}" for n, v in phi.items()}
    print(f"pipeline: noise scale after 12 steps, pp4 {phi['pp4']} vs 1 rank {phi['flat1']} target tokens "
          f"(the tied embedding's parts enter pp4's small-batch norm separately)")
    # Traces: each rank its stage's passes and sends ("1F3", "1SEND_B3 to pipeline rank 0").
    for rank, stage in ((0, 0), (3, 1)):
        with open(os.path.join(dirs["pp2_1f1b"], f"trace-rank-{rank}.json")) as f:
            names = {e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"}
        send = "SEND_F" if stage == 0 else "SEND_B"
        for want in (f"{stage}F3", f"{stage}B3", f"{stage}{send}3 to pipeline rank {1 - stage}"):
            check(want in names, lambda: (rank, want, sorted(names)[:40]))
    # A preemption: every stage stops after the same step; the restart resumes bit-exact.
    out = train("pp2_cut", 4, "--pp", "2", "--stage", "3",
                launcher_args=["--max-restarts", "1", "--simulate-preemption-at-step", "4"])
    check("simulating a spot preemption" in out and "restarting all ranks" in out, out[-3000:])
    summary = [r for r in metrics(dirs["pp2_cut"]) if r.get("event") == "summary"][-1]
    stop = summary["interruptions"][0]["step"]
    check(4 <= stop < 12 and summary["resumed"]["step"] == stop, summary)
    check(losses("pp2_cut") == losses("pp2_1f1b"), lambda: (losses("pp2_cut"), losses("pp2_1f1b")))
    _, a = exported(build, dirs["pp2_1f1b"], os.path.join(work, "pipe_ref.safetensors"), "--buffers")
    _, b = exported(build, dirs["pp2_cut"], os.path.join(work, "pipe_cut.safetensors"), "--buffers")
    check(a.keys() == b.keys() and "lm_head.weight" not in a, lambda: sorted(a)[:5])
    for k in a:
        check(np.array_equal(a[k][1], b[k][1]), f"{k} differs after the interruption at step {stop}")
    # Step 6's checkpoint resumed elsewhere at the same dp: losses of steps 7-12 as the run that went on.
    def resume_elsewhere(src, name, nproc, *extra):
        d = dirs[name] = os.path.join(work, "pipe_" + name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(dirs[src], d)
        shutil.rmtree(os.path.join(d, "checkpoints", "step-00000012"))
        with open(os.path.join(d, "checkpoints", "latest"), "w") as f:
            f.write("step-00000006\n")
        train(name, nproc, *extra, fresh=False)
        got, want = losses(name), losses(src)
        check(sorted(got) == list(range(1, 13)), got)
        worst = max(abs(got[k] - want[k]) / want[k] for k in range(7, 13))
        print(f"pipeline: {src}'s checkpoint of step 6 resumed as {name}: losses of steps 7-12 within {worst:.1e}")
        check(worst < 1e-6, (name, got, want))
    resume_elsewhere("pp2_1f1b", "pp2_to_unpipelined_zero1", 2, "--stage", "1")
    resume_elsewhere("pp2_interleaved", "interleaved_to_unpipelined_zero3", 2, "--stage", "3")
    resume_elsewhere("flat2", "unpipelined_to_interleaved_zero1", 4, "--pp", "2", "--schedule-pp", "interleaved-1f1b",
                     "--chunks", "2", "--stage", "1")
    print(f"pipeline: SIGTERM at step {stop}, every stage stopped there and resumed: losses and {len(a)} tensors "
          f"bit-identical to the uninterrupted run")
    # One step without clipping, one thread per rank (GEMMs sum alike): every untied tensor bit-identical to
    # the unpipelined run's. The tied embedding's three gradients (source, target, head) add in another
    # order: autograd's in the whole model, the tie group's across the first and last stage.
    one = ["--max-steps", "1", "--global-batch", "8", "--micro-batches", "4", "--eval-every", "0", "--no-sample",
           "--max-grad-norm", "0"]
    threads = {"OMP_NUM_THREADS": "1"}
    train("one_flat", 0, "--stage", "1", steps=one, env_extra=threads)
    train("one_pp2_gpipe_zero1", 2, "--pp", "2", "--schedule-pp", "gpipe", "--stage", "1", steps=one, env_extra=threads)
    train("one_pp3_1f1b_zero2", 3, "--pp", "3", "--stage", "2", steps=one, env_extra=threads)
    train("one_pp2_interleaved_zero3", 2, "--pp", "2", "--schedule-pp", "interleaved-1f1b", "--chunks", "2",
          "--stage", "3", steps=one, env_extra=threads)
    _, want = exported(build, dirs["one_flat"], os.path.join(work, "pipe_one_flat.safetensors"))
    for name in ("one_pp2_gpipe_zero1", "one_pp3_1f1b_zero2", "one_pp2_interleaved_zero3"):
        _, got = exported(build, dirs[name], os.path.join(work, f"pipe_{name}.safetensors"))
        check(got.keys() == want.keys(),
              lambda: f"{name}: the export's names differ from one_flat's: {sorted(got.keys() ^ want.keys())[:10]}")
        differ = [k for k in want if not np.array_equal(want[k][1], got[k][1])]
        check(differ == ["model.shared.weight"], (name, differ[:10]))
        print(f"pipeline: {name[4:]} after one step: {len(want) - 1} of {len(want)} tensors bit-identical to the "
              f"unpipelined run's, all but the tied embedding")


def check_bad_input(build, work):
    d = os.path.join(work, "bad")
    shutil.rmtree(d, ignore_errors=True)
    cases = [
        (["--data", "/nonexistent"], ["'/nonexistent'", "--data"]),
        (["--config", "huge"], ["'huge'", "tiny, base nor large"]),
        (["--tokenizer", work], ["no vocab.json", "--tokenizer"]),
        (["--micro-batches", "3"], ["--micro-batches 3", "per-rank batch 16"]),
        (["--schedule", "linear-ish"], ["'linear-ish'", "inverse-sqrt or cosine"]),
        (["--replica-group", "a"], ["--replica-group 'a' with --coordinator ''", "both given"]),
        (["--replica-group", "a", "--coordinator", "etcd://127.0.0.1:1"],
         ["no member of etcd at http://127.0.0.1:1 served it", "start etcd there"]),
    ]
    # Files given on the command line that do not parse: the option, the file and the position.
    files = os.path.join(work, "bad_files")
    shutil.rmtree(files, ignore_errors=True)
    for name, text in {"not_json.json": "d_model: 768\n", "list.json": "[768]", "wide.json": '{"d_model": "wide"}',
                       "tok_json/vocab.json": '{"<s>": 0,', "tok_json/merges.txt": "#version: 0.2\n",
                       "tok_ids/vocab.json": '{"<s>": "zero"}', "tok_ids/merges.txt": "#version: 0.2\n",
                       "tok_merges/vocab.json": '{"<s>": 0}', "tok_merges/merges.txt": "#version: 0.2\nab\n"}.items():
        os.makedirs(os.path.dirname(os.path.join(files, name)), exist_ok=True)
        with open(os.path.join(files, name), "w") as f:
            f.write(text)
    f = lambda name: os.path.join(files, name)  # noqa: E731
    cases += [
        (["--config", f("not_json.json")], ["--config: BART config '" + f("not_json.json") + "' is not JSON",
                                            "at line 1, column 1"]),
        (["--config", f("list.json")], ["--config: BART config", "is not a JSON object"]),
        (["--config", f("wide.json")], ["--config: BART config", '"d_model" is "wide", not an integer']),
        (["--tokenizer", f("tok_json")], ["--tokenizer: tokenizer: '" + f("tok_json/vocab.json") + "' is not JSON",
                                          "at line 1, column"]),
        (["--tokenizer", f("tok_ids")], ["--tokenizer:", 'the id of "<s>" is "zero"']),
        (["--tokenizer", f("tok_merges")], ["--tokenizer: tokenizer: '" + f("tok_merges/merges.txt") +
                                            "' line 2 is not a merge 'a b': ab"]),
    ]
    # Every option out of range, named with its value and range before any work (no tokenizer trained).
    cases += [
        (["--lr", "-1"], ["--lr -1: must be a positive number"]),
        (["--global-batch", "0"], ["--global-batch 0: must be at least 1"]),
        (["--max-steps", "-5"], ["--max-steps -5: must be at least 1"]),
        (["--vocab-size", "100"], ["--vocab-size 100: must be at least 262"]),
        (["--max-tokens", "4"], ["--max-tokens 4: must be at least 8"]),
        (["--validation-docs", "-1"], ["--validation-docs -1: must be 0"]),
        (["--micro-batches", "0"], ["--micro-batches 0: must be at least 1"]),
        (["--warmup-steps", "-1"], ["--warmup-steps -1: must be 0 or more"]),
        (["--min-lr-ratio", "2"], ["--min-lr-ratio 2: must be between 0 and 1"]),
        (["--weight-decay", "-0.1"], ["--weight-decay -0.1: must be 0 or more"]),
        (["--beta2", "1"], ["--beta2 1: must be between 0 and 1"]),
        (["--max-grad-norm", "-1"], ["--max-grad-norm -1: must be 0"]),
        (["--dropout", "1.5"], ["--dropout 1.5: must be in [0, 1)"]),
        (["--save-every", "0"], ["--save-every 0: must be at least 1"]),
        (["--keep", "1"], ["--keep 1: must be at least 2"]),
        (["--eval-every", "-1"], ["--eval-every -1: must be 0"]),
        (["--eval-batch", "0"], ["--eval-batch 0: must be at least 1"]),
        (["--mask-ratio", "1"], ["--mask-ratio 1: must be in [0, 1)"]),
        (["--poisson-lambda", "0"], ["--poisson-lambda 0: must be a positive number"]),
        (["--progress-interval", "0"], ["--progress-interval 0: must be a positive number"]),
        (["--chunks", "0"], ["--chunks 0: must be at least 1"]),
        (["--reference-batch", "0"], ["--reference-batch 0: must be a positive number of sequences"]),
        (["--noise-smoothing", "1"], ["--noise-smoothing 1: must be in [0, 1)"]),
        (["--sample-sentences", "0"], ["--sample-sentences 0: must be at least 1"]),
        (["--stage", "4"], ["--stage 4: must be 0, 1, 2 or 3"]),
        (["--device-comm", "gloo"], ["--device-comm 'gloo': must be auto, nccl or staged"]),
        (["--shard-size", "two"], ["--shard-size 'two': must be 0 (every data-parallel rank), host, or a number"]),
        (["--stage", "0", "--shard-size", "2"], ["--shard-size 2: must be 0 at --stage 0"]),
        (["--shard-size", "2"], ["--shard-size 2 must divide the 1 data-parallel ranks"]),
    ]

    def one_process(i):  # each case in a run directory of its own, two at a time (one process each)
        args, needles = cases[i]
        case_dir = f"{d}_{i}"
        shutil.rmtree(case_dir, ignore_errors=True)
        steps = [] if "--max-steps" in args else ["--max-steps", "1"]
        out = pretrain(build, case_dir, 0, *steps, *args, expect=1)
        for n in needles:
            check(n in out, lambda: f"{args}: '{n}' not in the error:\n{out}")
        check("frame #" not in out, lambda: f"{args}: a C++ backtrace instead of a message:\n{out}")
        check(not os.path.exists(os.path.join(case_dir, "tokenizer")), f"{args}: a tokenizer was trained before the error")

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for done in pool.map(one_process, range(len(cases))):  # re-raises a case's failure here
            pass
    out = pretrain(build, d, 3, "--global-batch", "16", expect=1)
    check("--global-batch 16 must divide by the 3 data-parallel ranks" in out, out)
    pipeline_cases = [
        (["--pp", "3"], ["--pp 3 must divide the 2 ranks"]),
        (["--pp", "2", "--partition", "E e | d*2 L"], ["model.encoder.layers.1", "'E e | d*2 L'"]),
        (["--pp", "2", "--partition", "E e*2 | d | d L"], ["3 stages", "--pp x chunks"]),
        (["--pp", "2", "--schedule-pp", "interleaved-1f1b"], ["interleaved-1f1b takes 2 or more (--chunks)"]),
        (["--pp", "2", "--save-logits", os.path.join(work, "x.f32")], ["--save-logits", "--pp 1"]),
    ]
    for args, needles in pipeline_cases:
        out = pretrain(build, d, 2, "--max-steps", "1", "--global-batch", "4", "--micro-batches", "2", *args,
                       expect=1)
        for n in needles:
            check(n in out, f"{args}: '{n}' not in the error:\n{out[-3000:]}")
        check("frame #" not in out, lambda: f"{args}: a C++ backtrace instead of a message:\n{out}")
    # A resume that cuts the data into examples differently from the run that saved it.
    saved = os.path.join(work, "bad_resume")
    shutil.rmtree(saved, ignore_errors=True)
    pretrain(build, saved, 0, "--max-steps", "1", "--save-every", "1", "--eval-every", "0", "--no-sample",
             "--max-tokens", "32", "--global-batch", "4")
    out = pretrain(build, saved, 0, "--max-steps", "2", "--eval-every", "0", "--no-sample", "--max-tokens", "64",
                   "--global-batch", "4", expect=1)
    check("cannot resume from step 1 of" in out and
          "; resume with the dataset (--dataset or --data), --max-tokens, --validation-docs or --validation-tokens "
          "and tokenizer it was saved with" in out and "frame #" not in out,
          lambda: f"a resume at another --max-tokens: {out[-3000:]}")
    # Data that does not fit the run: RUN_DIR/dataset prepared from other text, a dataset prepared with another
    # tokenizer than --tokenizer, a dataset that is not there.
    other = os.path.join(work, "bad_other_text")
    shutil.rmtree(other, ignore_errors=True)
    os.makedirs(other)
    shutil.copy(os.path.join(DATA, "GPL-3"), other)
    out = pretrain(build, saved, 0, "--data", other, "--max-steps", "2", "--max-tokens", "32", expect=1)
    check(f"'{saved}/dataset' was prepared from other text than --data '{other}' holds now; delete it" in out,
          lambda: f"a run directory's dataset from other text: {out[-3000:]}")
    exe = os.path.join(build, "examples", "bart_pretrain")
    small_tok = os.path.join(work, "bad_small_tok")
    shutil.rmtree(small_tok, ignore_errors=True)
    run([exe, "train-tokenizer", "--data", other, "--vocab-size", "300", "--out", small_tok])
    out = pretrain(build, os.path.join(work, "bad_tok_run"), 0, "--dataset", os.path.join(saved, "dataset"),
                   "--tokenizer", small_tok, "--max-steps", "1", expect=1)
    check(f"dataset '{saved}/dataset' was prepared with another tokenizer" in out and
          "prepare the dataset again with this one" in out, lambda: f"a dataset of another tokenizer: {out[-3000:]}")
    out = pretrain(build, os.path.join(work, "bad_no_dataset"), 0, "--dataset", "/nonexistent", expect=1)
    check("--dataset '/nonexistent': must be a dataset directory" in out, lambda: out[-3000:])
    print(f"bad_input: {len(cases) + 5 + len(pipeline_cases)} wrong inputs, each one named with its fix")


def start_etcd(work):
    """One etcd member on 127.0.0.1 (Debian's etcd-server): (process, its client URL)."""
    import socket
    import urllib.request

    def free_port():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    data = os.path.join(work, "etcd")
    shutil.rmtree(data, ignore_errors=True)
    proc = subprocess.Popen(["etcd", "--name", "m0", "--data-dir", data, "--listen-client-urls", client,
                             "--advertise-client-urls", client, "--listen-peer-urls", peer,
                             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"m0={peer}",
                             "--heartbeat-interval", "50", "--election-timeout", "500"],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "etcd.log"), "w"))
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(client + "/health", timeout=1) as r:
                if json.loads(r.read()).get("health") == "true":
                    return proc, client
        except OSError:
            pass
        check(proc.poll() is None and time.monotonic() < deadline, "etcd did not start (etcd.log)")
        time.sleep(0.1)


def check_replica_groups(build, work):
    # Long enough that the lone group cannot finish before the killed one is back (its start takes a few
    # seconds on a loaded machine; a lone group takes about 0.035 s a step on a fast one), and inside the
    # data's first epoch (4,205 examples, 525 batches of 8: an epoch's last batch is padded by the count of
    # ranks, which differs between 1 and 2).
    steps = 500
    common = ["--max-steps", str(steps), "--eval-every", "0", "--dropout", "0", "--no-sample", "--global-batch", "8",
              "--max-tokens", "16", "--ckpt-dir", "none", "--liveness", "2"]
    ref = os.path.join(work, "groups_ref")
    shutil.rmtree(ref, ignore_errors=True)
    pretrain(build, ref, 2, *common)  # uninterrupted: 2 ranks, no groups
    want = {r["step"]: r["loss"] for r in metrics(ref) if "event" not in r}
    etcd, client = start_etcd(work)
    procs = []
    try:
        def group(name, run_dir, plot=False, again=False):
            if not again:
                shutil.rmtree(run_dir, ignore_errors=True)
                shutil.copytree(os.path.join(ref, "tokenizer"), os.path.join(run_dir, "tokenizer"))
            # Its launcher starts it again once (the last fault); a checkpoint every 100 steps.
            cmd = [os.path.join(build, "zeroshard-run"), "--nproc-per-node", "1", "--max-restarts", "1", "--",
                   os.path.join(build, "examples", "bart_pretrain"), "--dataset", os.path.join(ref, "dataset"),
                   "--run-dir", run_dir, *([] if plot else ["--no-plot"]), "--progress-interval", "1000",
                   *[a for a in common if a != "--ckpt-dir" and a != "none"], "--save-every", "100",
                   "--replica-group", name, "--coordinator", "etcd://" + client[len("http://"):]]
            log = open(run_dir + ".log", "a" if again else "w")
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, ZS_LOG_LEVEL="info"))
            procs.append(p)
            return p

        def steps_of(run_dir):
            try:
                return [r for r in metrics(run_dir) if "event" not in r]
            except (OSError, ValueError):
                return []

        def wait(what, ok, p_alive):
            deadline = time.monotonic() + 120
            while not ok():
                for p in p_alive:
                    check(p.poll() is None, lambda: f"{what}: a group ended (exit {p.poll()}): " + tail(p))
                check(time.monotonic() < deadline, f"{what}: not within 120 s")
                time.sleep(0.05)

        def tail(p):
            log = p.args[p.args.index("--run-dir") + 1] + ".log"
            return open(log).read()[-4000:]

        a_dir, b_dir = (os.path.join(work, n) for n in ("group_a", "group_b"))
        a = group("a", a_dir, plot=True)
        wait("a trains alone", lambda: len(steps_of(a_dir)) >= 5, [a])
        b = group("b", b_dir)
        wait("b joins and trains beside a", lambda: len(steps_of(b_dir)) >= 5, [a, b])
        b.send_signal(9)  # the whole group: its launcher, and its rank with it
        b.wait()
        killed_at = steps_of(a_dir)[-1]["step"]
        b_before = [r["step"] for r in steps_of(b_dir)]

        def alone():
            # A change to one group after the change to two: whether a took the lost step again or had
            # applied it before the loss showed (its loss could not be summed: reported as null).
            try:
                groups = [r["groups"] for r in metrics(a_dir) if r.get("event") == "replica_groups"]
            except (OSError, ValueError):
                return False
            return 2 in groups and 1 in groups[groups.index(2):]
        wait("a goes on alone", alone, [a])
        # b again, in the same run directory: its file keeps the steps the first b took.
        b2 = group("b", b_dir, again=True)
        # Every group lost at once (each rank SIGKILLed) past the checkpoint at step 200: the launchers
        # start them again, both resume from that checkpoint, meet, and say that the job falls back to it.
        # (Well past it: the coordinator's record of the job's progress is written about once a second.)
        wait("a and b train together past step 260", lambda: min(
            (steps_of(d) or [{"step": 0}])[-1]["step"] for d in (a_dir, b_dir)) >= 260, [a, b2])
        for p in (a, b2):
            for rank in children(p.pid):
                os.kill(rank, 9)
        check(a.wait(timeout=300) == 0, lambda: "group a: " + tail(a))
        check(b2.wait(timeout=300) == 0, lambda: "group b, again: " + tail(b2))
        # Every group gone, the job at its last step: a group with no state does not start over.
        lone = os.path.join(work, "group_c")
        shutil.rmtree(lone, ignore_errors=True)
        shutil.copytree(os.path.join(ref, "tokenizer"), os.path.join(lone, "tokenizer"))
        out = pretrain(build, lone, 1, "--dataset", os.path.join(ref, "dataset"), *common, "--replica-group", "c",
                       "--coordinator", "etcd://" + client[len("http://"):], "--replica-alone", "exit", expect=1)
        # (The job's record is the groups' last step boundary: the step before the last.)
        check(f"group 'c' is alone in job 'bart' with no state (step 0), but the job reached step {steps - 1}" in out,
              lambda: out[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        etcd.kill()
        etcd.wait()
    got_a = {r["step"]: r["loss"] for r in steps_of(a_dir)}
    got_b = {r["step"]: r["loss"] for r in steps_of(b_dir)}
    check(sorted(got_a) == list(range(1, steps + 1)), lambda: f"group a's steps: {sorted(got_a)}")
    logs = [open(d + ".log").read() for d in (a_dir, b_dir)]
    check(all(log.count("restarting all ranks") == 1 for log in logs), "each group's launcher starts it again once")
    # (Said by the group that meets first: one that comes later may find the other already past step 200.)
    check(any("falls back to that checkpoint and takes steps 201 to" in log for log in logs),
          lambda: "every group lost at step 260 or later: the job should say it falls back to step 200:\n" +
          "\n".join(log[-2000:] for log in logs))
    check(all(r["samples"] == 8 and r["replica_groups"] in (1, 2) for r in steps_of(a_dir)),
          "every step of a trains the global batch of 8 samples, over 1 or 2 groups")
    b_steps = [r["step"] for r in steps_of(b_dir)]
    b_after = [k for k in b_steps if k > max(b_before)]
    check(b_steps[:len(b_before)] == b_before and b_steps == sorted(set(b_steps)) and b_after and
          b_after[0] > killed_at and b_after[-1] == steps,
          lambda: f"group b's steps: {b_before} before it was killed (at a's step {killed_at}); then {b_steps}")
    worst = 0.0
    for got in (got_a, got_b):
        # A step whose update was applied but whose loss could not be summed across the groups (a group
        # lost right after it) reports none (null), never a partial sum: at most one per fault.
        check(sum(loss is None for loss in got.values()) <= 1, lambda: f"steps without a loss: {got}")
        for step, loss in got.items():
            if loss is not None:
                worst = max(worst, abs(loss - want[step]) / abs(want[step]))
    check(worst < 1e-5, lambda: f"losses differ from the uninterrupted run's by up to {worst:.2e} (relative)")
    changes = [r for r in metrics(a_dir) if r.get("event") == "replica_groups"]
    shape = [(c["groups"], c["step_retaken"]) for c in changes]
    check(shape[0] == (1, False) and (2, False) in shape and (2, False) == shape[-1] and
          any(g == 1 and i > 0 for i, (g, _) in enumerate(shape)), lambda: f"group a's membership changes: {changes}")
    healed = [r for r in metrics(b_dir) if r.get("event") == "replica_groups" and r["step"] > max(b_before)]
    check(healed and healed[0]["heal_bytes"] > 0 and healed[0]["groups"] == 2, lambda: f"group b's: {healed}")
    # loss.png marks each change after the first meeting with a brown line at its step.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from png_marks import frame, read_png, vertical_lines
    img = read_png(os.path.join(a_dir, "loss.png"))
    box = frame(img)
    x_of = lambda step: box[0] + step / steps * (box[1] - box[0])  # noqa: E731 (from the validation at step 0)
    lines = vertical_lines(img, (0x8C, 0x56, 0x4B), box)
    # Every line at a change, every change on a line (changes a few steps apart, as the meetings after
    # the fallback, may share one).
    marks = [x_of(c["step"]) for c in changes[1:]]
    check(all(any(abs(x - m) <= 3 for m in marks) for x in lines) and
          all(any(abs(x - m) <= 3 for x in lines) for m in marks),
          lambda: f"loss.png: brown lines at {lines}, changes at x = {marks}")
    lost = [c for c in changes if c["groups"] == 1][1:]
    summary = [r for r in metrics(a_dir) if r.get("event") == "summary"][-1]
    print(f"replica_groups: {steps} steps; b killed at step {killed_at}: a paused {lost[0]['pause_s']:.2f} s "
          f"(--liveness 2), took {summary['steps_retaken']} step(s) again and went on alone; b healed from a "
          f"({healed[0]['heal_bytes'] / 1e6:.2f} MB in {healed[0]['heal_s']:.3f} s) at step {healed[0]['step']}; "
          f"every step's loss of both within {worst:.1e} of the uninterrupted run's")


def check_straggler(build, work):
    import socket
    cpu = "/sys/fs/cgroup/cpu"
    if os.geteuid() != 0 or not os.path.exists(os.path.join(cpu, "cpu.cfs_quota_us")):
        skip("a cgroup v1 CPU quota needs root and /sys/fs/cgroup/cpu")
    window, steps = 20, 70
    common = ["--max-steps", str(steps), "--eval-every", "0", "--no-sample", "--max-tokens", "32", "--ckpt-dir",
              "none", "--straggler-window", str(window)]

    def launch(run_dir, throttle):
        shutil.rmtree(run_dir, ignore_errors=True)
        exe = os.path.join(build, "examples", "bart_pretrain")
        cmd = [os.path.join(build, "zeroshard-run"), "--nproc-per-node", "2", "--", exe, "--data", DATA, "--run-dir",
               run_dir, "--no-plot", "--progress-interval", "1000", *common]
        env = dict(os.environ, ZS_LOG_LEVEL="info", OMP_NUM_THREADS="1")
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        if throttle:  # rank 1's process into the group, as soon as it runs (before its first step)
            deadline = time.monotonic() + 60
            while True:
                ranks = {}
                for pid in children(p.pid):
                    try:
                        with open(f"/proc/{pid}/environ", "rb") as f:
                            env_of = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
                        ranks[int(env_of[b"RANK"])] = pid
                    except (OSError, KeyError, ValueError):
                        continue
                if 1 in ranks:
                    break
                check(time.monotonic() < deadline and p.poll() is None, "rank 1 never started")
                time.sleep(0.01)
            with open(os.path.join(throttle, "cgroup.procs"), "w") as f:
                f.write(str(ranks[1]))
        out, _ = p.communicate(timeout=600)
        check(p.returncode == 0, lambda: f"{' '.join(cmd)}: exit {p.returncode}\n{out[-6000:]}")
        return out

    group = os.path.join(cpu, f"zs-straggler-{os.getpid()}")
    os.makedirs(group, exist_ok=True)
    try:
        with open(os.path.join(group, "cpu.cfs_period_us"), "w") as f:
            f.write("100000")
        with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as f:
            f.write("30000")  # 30% of one core
        slow = os.path.join(work, "straggler_throttled")
        out = launch(slow, group)
    finally:
        os.rmdir(group)
    named = [r for r in metrics(slow) if r.get("event") == "straggler"]
    host = socket.gethostname()
    check(len(named) == 1 and named[0]["rank"] == 1 and named[0]["host"] == host and named[0]["ratio"] >= 2,
          lambda: f"rank 1 held to 30% of a core: straggler events {named}\n{out[-3000:]}")
    check(window <= named[0]["step"] <= 2 * window, lambda: f"named at step {named[0]['step']}, window {window}")
    lines = [line for line in out.splitlines() if "straggler: rank" in line and "computed" in line]
    check(len(lines) == 1 and "rank 1 on host " + host in lines[0], lines)
    summary = [r for r in metrics(slow) if r.get("event") == "summary"][-1]
    check([e["rank"] for e in summary["stragglers"]] == [1], summary["stragglers"])
    spread = [r["ranks"]["compute_s"] for r in metrics(slow) if "event" not in r and r["step"] > window]
    slowest = sum(1 for c in spread if c["slowest"] == 1)
    check(slowest >= 0.75 * len(spread), f"rank 1 the slowest in {slowest} of {len(spread)} steps")
    fast = os.path.join(work, "straggler_unthrottled")
    out = launch(fast, None)
    check(not [r for r in metrics(fast) if r.get("event") == "straggler"] and "straggler: rank" not in out,
          lambda: f"a straggler named in the unthrottled run:\n{out[-3000:]}")
    check([e for r in metrics(fast) if r.get("event") == "summary" for e in r["stragglers"]] == [], "summary")
    reduces = [r["world_all_reduces"] for r in metrics(fast) if "event" not in r and r["step"] > 1]
    check(set(reduces) == {1}, f"all-reduces per step: {sorted(set(reduces))}")
    ratio = [r["ranks"]["compute_s"] for r in metrics(fast) if "event" not in r]
    print(f"straggler: rank 1 held to 30% of a core named at step {named[0]['step']} (window {window}) at "
          f"{named[0]['ratio']:.2f}x the other rank's compute, on host {host}, once; the slowest rank in {slowest} of "
          f"{len(spread)} steps; unthrottled: no straggler over {len(ratio)} steps; one all-reduce per step")


if __name__ == "__main__":
    build, work, which = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(work, exist_ok=True)
    {"equal_ranks": check_equal_ranks, "resume": check_resume,
     "safetensors": check_safetensors, "bad_input": check_bad_input, "pipeline": check_pipeline,
     "bf16": check_bf16, "durable": check_durable, "replica_groups": check_replica_groups,
     "straggler": check_straggler}[which](build, work)
    print("OK")
