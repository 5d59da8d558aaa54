#!/usr/bin/env python3
"""torchft's peer of bench/fault_bench.py: what a SIGKILL costs a job that
torchft keeps going, measured on the same BART training step.

The job: Hugging Face's BartForConditionalGeneration of bart_peer's shapes with
the vocabulary of zeroshard's BART trainer (its tokenizer's 2048 tokens, so the
tiny model has the trainer's 1.25M parameters), no dropout, trained as 2 torchft
replica groups of 1 CPU process each (torch.set_num_threads(1)): torchft's
Manager over its ProcessGroupGloo (min_replica_size=1, async quorum, the weights
seeded alike in both groups so no step-0 sync), its DistributedDataParallel and
its Optimizer wrapper around torch.optim.AdamW (lr 1e-3); healing sends the model
and the optimizer state (and torchft's step and batch counts) over torchft's
HTTP checkpoint transport. Each group trains global_batch / 2 synthetic
sequences a step (src_len source and tgt_len label tokens, drawn from (seed,
step, the group's rank among the step's participants)). Each group runs under
its own `torchrun --max-restarts 100`, which starts its process again when it is
killed; torchft's lighthouse (torchft_lighthouse, min_replicas 1, heartbeat
timeout heartbeat_s, a 50 ms quorum tick) runs beside them; everything talks
over 127.0.0.1. The first processes of the two groups wait for each other before
their first quorum, so both start at step 0 together. Every save_every committed
steps each group also saves the healing state to WORK/ckpt<g>.pt (what torchft
leaves to its user, for when every group is down at once): a process starting
loads the newest one; a live group then heals it past it at its first quorum,
and when none is alive (the other group was killed before this one came back)
training resumes from it.

The job ends when the committed steps have trained `samples` samples: torchft's
own count of the batches its committed steps took (num_participants() per
commit, kept in the state a healed group receives) times the per-group batch.

run(work_dir, samples, global_batch=8, schedule=(), heartbeat_s=1.0,
config="tiny", src_len=64, tgt_len=64, seed=0, save_every=50, cores=None, cap_s=None) clears WORK =
work_dir, launches the job, applies the schedule's SIGKILLs ([(seconds after
the first commit, group 0 or 1)]) to the training process (torchrun's child) of that
group, each at its time unless the job has ended by then, ends every process it
started (also on an error), and reads the per-process JSON lines of each group's
log (WORK/group<g>.jsonl: a start line per process, a line per step with time,
step, participants, committed and loss, a line per heal and per checkpoint
loaded, an end line with the parameter checksum) into these figures (also in
WORK/figures.json, with the launch's unix time):

  wall_s            launch to the commit of the step that reached `samples`
  first_s           launch to the first commit (the start-up: imports, the
                    first quorum)
  stopped_s         launch to the stop of a run stopped at cap_s (None: it
                    finished); samples are then the samples it reached
  steps, samples    committed steps (each once), and the samples they trained
  faults            kills applied
  pauses_s          per fault, the survivor's pause: the gap before its first
                    commit after the kill without the killed group (the step
                    that waited for the lighthouse to drop it), less the run's
                    median gap between commits (step_s, a step's time); None
                    where the survivor has no commit before or after it
  back_s            per fault, the kill to the killed group's first commit after it
                    (torchrun's restart, imports, joining the quorum, healing)
  heal_bytes/heal_s per heal, the tensor bytes of the state received and the
                    seconds the transport took to fetch and load it
  discarded_steps   steps some process took whose should_commit() was false
  repeated_or_lost  committed step numbers 0..last missing from both groups'
                    logs, or committed twice (the processes committing one step
                    disagree on its participants, or two of them took the same
                    participant rank), other than retaken ones: 0 when every
                    step was taken once
  retaken_steps     steps committed again after a process resumed from a
                    checkpoint with every group down (the commits since it)
  resumes           checkpoints loaded by starting processes
  checksums_equal   both groups end on the same sum (float64) of the parameters
                    (None when one was down at the end)
  step_s, kills     the median gap between commits; the kills as (s, group)
  torchft, patched  torchft's version; what this script overrides in it to run

Patched: torchft 0.2.0's DDP comm hook returns the inner future of the
allreduce's managed work and asserts it is set, but a failed allreduce (the Gloo
peer died) leaves none, so the survivor died on `assert fut._fut` instead of
discarding the step. The override hands DDP the zeroed bucket in that case; the
manager has recorded the error, so should_commit() is false and the step is
taken again, as torchft intends.

Usage (a fault-free run, then one with a kill every U(a, b) seconds from a
seeded schedule alternating the groups; prints goodput = fault-free wall_s /
faulted wall_s and both runs' figures as JSON):

  .venv/bin/python bench/fault_peer.py --work /tmp/fault_peer --samples 4000 \\
      --faults-every 10-20 --heartbeat 1 --seed 0
"""
import argparse
import json
import logging
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path

import torch
import torchft
from torchft.checkpointing import HTTPTransport
from transformers import BartForConditionalGeneration

from bart_peer import hf_config

GROUPS = 2
TRAINER_VOCAB = 2048  # examples/bart/train/run.h: the tokenizer's vocabulary, and so the model's
PATCHED = ("torchft.ddp.DistributedDataParallel._comm_hook: a failed allreduce (dead Gloo peer) returns the zeroed "
           "bucket instead of failing `assert fut._fut`, so the survivor discards the step instead of crashing")
STALL_S = 180  # run() gives up when no process has logged anything for this long
END_GRACE_S = 30  # how long run() waits for both groups to exit once the job has ended


def model_config(name):
    config = hf_config(name)
    config.vocab_size = TRAINER_VOCAB
    return config


class FaultTolerantDDP(torchft.DistributedDataParallel):
    """torchft's DDP with the comm hook that survives a dead peer (see PATCHED)."""

    @staticmethod
    def _comm_hook(state, bucket):
        work = state.allreduce(bucket.buffer())
        work.wait()
        fut = getattr(work.get_future(), "_fut", None)
        if fut is not None:
            return fut
        done = torch.futures.Future()
        done.set_result(bucket.buffer().zero_())
        return done


class TimedTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport, advertised on 127.0.0.1, logging each checkpoint it receives."""

    def __init__(self, emit, timeout):
        super().__init__(timeout=timeout, num_chunks=0)
        self._emit = emit

    def address(self):
        return f"http://127.0.0.1:{self._server.socket.getsockname()[1]}/checkpoint/"

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        t = time.time()
        state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self._emit(event="heal", t=t, seconds=time.time() - t, bytes=tensor_bytes(state), step=step)
        return state


def tensor_bytes(obj, seen=None):
    """Bytes of the distinct tensor storages in a nested dict/list/tuple."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def batch(seed, step, index, size, src_len, tgt_len):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * GROUPS + index)
    src = torch.randint(3, TRAINER_VOCAB, (size, src_len), generator=g)
    return src, torch.randint(3, TRAINER_VOCAB, (size, tgt_len), generator=g)


def worker(args):
    """One group's training process, started (and started again) by torchrun."""
    group = int(os.environ["REPLICA_GROUP_ID"])
    work = Path(args.work)
    log, lock = open(work / f"group{group}.jsonl", "a"), threading.Lock()

    def emit(**record):
        with lock:
            log.write(json.dumps(dict(record, pid=os.getpid(), group=group)) + "\n")
            log.flush()

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    emit(event="start", t=time.time(), restart=restart)
    if (work / "done").exists():
        return
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = BartForConditionalGeneration(model_config(args.config))

    def state_dict():
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"fault_peer_{group}",
        timeout=timedelta(seconds=10), hostname="127.0.0.1", init_sync=False,
        checkpoint_transport=TimedTransport(emit, timeout=timedelta(seconds=10)))
    model = FaultTolerantDDP(manager, model)
    optimizer = torchft.Optimizer(manager, torch.optim.AdamW(model.parameters(), lr=1e-3))
    saved = [torch.load(f) for f in work.glob("ckpt*.pt")]
    if saved:  # a live group heals this process past it at its first quorum; if none is alive, training resumes here
        checkpoint = max(saved, key=lambda c: c["torchft"]["step"])
        load_state_dict(checkpoint["user"])
        manager.load_state_dict(checkpoint["torchft"])
        emit(event="resume", t=time.time(), step=manager.current_step())

    (work / f"ready{group}").touch()
    if restart == 0:
        deadline = time.time() + STALL_S
        while not all((work / f"ready{g}").exists() for g in range(GROUPS)) and time.time() < deadline:
            time.sleep(0.02)

    while not (work / "done").exists():
        optimizer.zero_grad()
        rank = manager.participating_rank()
        if (work / "done").exists():
            break
        step, participants = manager.current_step(), manager.num_participants()
        src, labels = batch(args.seed, step, rank or 0, args.batch, args.src_len, args.tgt_len)
        loss = model(input_ids=src, labels=labels).loss
        loss.backward()
        optimizer.step()
        committed = manager.current_step() > step
        samples = manager.batches_committed() * args.batch
        emit(t=time.time(), step=step, participants=participants, rank=rank, committed=committed,
             loss=loss.item(), samples=samples)
        if committed and args.save_every and manager.current_step() % args.save_every == 0:
            torch.save({"user": state_dict(), "torchft": manager.state_dict()}, work / f"ckpt{group}.tmp")
            os.replace(work / f"ckpt{group}.tmp", work / f"ckpt{group}.pt")
        if committed and samples >= args.samples:
            checksum = sum(p.detach().double().sum().item() for p in model.parameters())
            emit(event="end", t=time.time(), step=step, samples=samples, checksum=checksum)
            (work / "done").touch()
    manager.shutdown()


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def children(pid):
    kids = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return kids


def read_log(path):
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a kill
                pass
    return records


def kill_workers(pids):
    """SIGKILL those of `pids` that are still this script's workers."""
    for pid in set(pids):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if Path(__file__).name.encode() in cmdline and b"--worker" in cmdline:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run(work_dir, samples, global_batch=8, schedule=(), heartbeat_s=1.0, config="tiny", src_len=64, tgt_len=64,
        seed=0, save_every=50, cores=None, cap_s=None):
    """Train until `samples` samples are committed under the SIGKILLs of `schedule` ([(s after the first commit,
    group)]); return the figures of the module's docstring. `cores`: the CPUs of each group (a set per group),
    as if each group had a host of its own; None: any. `cap_s`: a run still going this long after its first
    commit is stopped there (its figures then count the samples it reached)."""
    model_config(config)  # an unknown name fails here, not in each of torchrun's restarts
    work = Path(work_dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    bin_dir = Path(sys.executable).parent
    lighthouse_port, *rdzv_ports = free_ports(1 + GROUPS)
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{lighthouse_port}", NUM_REPLICA_GROUPS=str(GROUPS),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs, torchruns, kills = [], [], []
    t0 = time.time()
    try:
        with open(work / "lighthouse.log", "w") as out:
            procs.append(subprocess.Popen(
                [bin_dir / "torchft_lighthouse", "--bind", f"127.0.0.1:{lighthouse_port}", "--min_replicas", "1",
                 "--heartbeat_timeout_ms", str(int(heartbeat_s * 1000)), "--quorum_tick_ms", "50",
                 "--join_timeout_ms", "2000"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=dict(env, RUST_LOG="info")))
        for g in range(GROUPS):
            with open(work / f"group{g}.out", "w") as out:
                torchruns.append(subprocess.Popen(
                    [bin_dir / "torchrun", "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "100",
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_ports[g]}",
                     Path(__file__).resolve(), "--worker", "--work", work, "--samples", str(samples),
                     "--batch", str(global_batch // GROUPS), "--config", config, "--src-len", str(src_len),
                     "--tgt-len", str(tgt_len), "--seed", str(seed), "--save-every", str(save_every)],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env=dict(env, REPLICA_GROUP_ID=str(g)),
                    preexec_fn=(lambda c=cores[g]: os.sched_setaffinity(0, c)) if cores else None))
        procs += torchruns
        pending, first, stopped = sorted(schedule), None, None
        while not (work / "done").exists():
            if cap_s and first is not None and time.time() - first > cap_s:
                stopped = time.time()
                break
            if first is None:  # the schedule counts from the first commit (the start-up is not the faults')
                commits = [r["t"] for g in range(GROUPS) for r in read_log(work / f"group{g}.jsonl")
                           if r.get("committed")]
                first = min(commits) if commits else None
            for p in torchruns:
                if p.poll() is not None and not (work / "done").exists():
                    raise RuntimeError(f"torchrun exited ({p.returncode}) before the job ended; see {work}")
            if pending and first is not None and time.time() - first >= pending[0][0]:
                target = children(torchruns[pending[0][1]].pid)
                if target:  # else torchrun is between two workers: kill the next one
                    kill_workers(target)
                    kills.append((time.time() - t0, pending.pop(0)[1]))
            last = max(f.stat().st_mtime for f in work.glob("group*"))
            if time.time() - last > STALL_S:
                raise RuntimeError(f"no progress for {STALL_S} s; see {work}")
            time.sleep(0.05)
        deadline = time.time() + END_GRACE_S
        while any(p.poll() is None for p in torchruns) and time.time() < deadline:
            time.sleep(0.1)
    finally:
        workers = [c for p in torchruns for c in children(p.pid)]
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()
        kill_workers(workers + [r["pid"] for g in range(GROUPS) for r in read_log(work / f"group{g}.jsonl")])
    stats = figures([read_log(work / f"group{g}.jsonl") for g in range(GROUPS)], t0, samples, kills)
    stats["stopped_s"] = stopped - t0 if stopped else None
    (work / "figures.json").write_text(json.dumps(dict(stats, launch_t=t0), indent=1))
    return stats


def inconsistent(records):
    """Whether the commits of one step disagree on its participants or repeat a participant rank."""
    ranks = [r["rank"] for r in records if r["rank"] is not None]
    return len({r["participants"] for r in records}) > 1 or len(ranks) != len(set(ranks))


def figures(logs, t0, samples, kills):
    """The docstring's figures from the groups' log records, the launch time and the kills applied."""
    steps = [[r for r in log if "event" not in r] for log in logs]
    commits = [sorted(r["t"] for r in s if r["committed"]) for s in steps]
    gaps = [b - a for c in commits for a, b in zip(c, c[1:])]
    step_s = statistics.median(gaps) if gaps else 0.0
    # The commits of each step in time order; a process that resumed from a checkpoint and commits that step
    # first while the steps from it on were committed before it started took the job back (every group was down):
    # those steps count as retaken, and the new commits replace them.
    resumes = {r["pid"]: r for log in logs for r in log if r.get("event") == "resume"}
    by_step, seen, bad, retaken = {}, set(), 0, 0
    for r in sorted((r for s in steps for r in s if r["committed"]), key=lambda r: r["t"]):
        resume = resumes.get(r["pid"])
        if resume and r["pid"] not in seen and r["step"] == resume["step"]:
            if any(k >= r["step"] and rs[0]["t"] < resume["t"] for k, rs in by_step.items()):
                retaken += max(by_step) + 1 - r["step"]
                bad += sum(inconsistent(by_step.pop(k)) for k in [k for k in by_step if k >= r["step"]])
        seen.add(r["pid"])
        by_step.setdefault(r["step"], []).append(r)
    bad += sum(inconsistent(rs) for rs in by_step.values())
    lost = sum(1 for k in range(max(by_step, default=-1) + 1) if k not in by_step)
    ends = [[r for r in log if r.get("event") == "end"] for log in logs]
    heals = sorted((r for log in logs for r in log if r.get("event") == "heal"), key=lambda r: r["t"])
    reached = [r["t"] for s in steps for r in s if r["committed"] and r["samples"] >= samples]
    pauses, back = [], []
    for t, g in kills:
        kill_t = t0 + t
        survivor = sorted(((r["t"], r["participants"]) for r in steps[1 - g] if r["committed"]))
        alone = [i for i, (c, n) in enumerate(survivor) if c > kill_t and n == 1]
        pauses.append(survivor[alone[0]][0] - survivor[alone[0] - 1][0] - step_s if alone and alone[0] else None)
        returned = [c for c in commits[g] if c > kill_t]
        back.append(returned[0] - kill_t if returned else None)
    return {
        "wall_s": min(reached) - t0 if reached else None,
        "first_s": min((c for cs in commits for c in cs), default=t0) - t0,
        "steps": len(by_step),
        "samples": max((r["samples"] for rs in by_step.values() for r in rs), default=0),
        "faults": len(kills),
        "pauses_s": pauses,
        "back_s": back,
        "heal_bytes": [r["bytes"] for r in heals],
        "heal_s": [r["seconds"] for r in heals],
        "discarded_steps": sum(1 for s in steps for r in s if not r["committed"]),
        "repeated_or_lost": bad + lost,
        "retaken_steps": retaken,
        "resumes": sum(1 for log in logs for r in log if r.get("event") == "resume"),
        "checksums_equal": len({e[-1]["checksum"] for e in ends}) == 1 if all(ends) else None,
        "step_s": step_s,
        "kills": kills,
        "torchft": version("torchft"),
        "patched": PATCHED,
    }


def fault_schedule(seed, every, horizon):
    """[(s after the first step, group)]: gaps drawn uniformly from `every`, groups alternating, up to `horizon`
    s."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.uniform(*every)
        if t > horizon:
            return out
        out.append((t, len(out) % GROUPS))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--faults-every", default="10-20", help="a-b: seconds between kills, uniform")
    ap.add_argument("--heartbeat", type=float, default=1.0, help="the lighthouse's heartbeat timeout, s")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--src-len", type=int, default=64)
    ap.add_argument("--tgt-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (0: none)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    kw = dict(samples=args.samples, global_batch=args.global_batch, heartbeat_s=args.heartbeat, config=args.config,
              src_len=args.src_len, tgt_len=args.tgt_len, seed=args.seed, save_every=args.save_every)
    free = run(os.path.join(args.work, "fault-free"), schedule=[], **kw)
    every = tuple(float(x) for x in args.faults_every.split("-"))
    schedule = fault_schedule(args.seed, every, 3 * free["wall_s"])
    faulted = run(os.path.join(args.work, "faulted"), schedule=schedule, **kw)
    print(f"goodput {free['wall_s'] / faulted['wall_s']:.3f} (fault-free {free['wall_s']:.1f} s, "
          f"faulted {faulted['wall_s']:.1f} s, {faulted['faults']} faults)")
    print(json.dumps({"goodput": free["wall_s"] / faulted["wall_s"], "schedule": schedule,
                      "fault_free": free, "faulted": faulted}, indent=1))


if __name__ == "__main__":
    main()
