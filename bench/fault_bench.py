#!/usr/bin/env python3
"""What a fault costs: zeroshard's restart path, zeroshard's replica groups and
torchft, under one schedule of SIGKILLs, in one run.

Usage: fault_bench.py BUILD_DIR [--steps N] [--config tiny|base] [--faults-every 10-20]
                      [--liveness 2] [--heartbeat 1] [--save-every 50] [--seed 0]
                      [--modes restart,groups,torchft] [--work DIR] [--json FILE]

The same training job (the trainer's tiny BART, or --config base; global batch 8,
no dropout, a checkpoint every --save-every steps) runs in each mode twice: fault-free,
then under the schedule (a SIGKILL every U(a, b) seconds from the seeded schedule,
counted from the run's first step, alternating between two targets; the launcher
restarts what was killed). Each replica group (ours and the peer's) is pinned to a
core of its own, as if it had a host of its own: a group left alone trains on one
core, as it would on its host.

  restart  bart_pretrain on 2 ranks under one `zeroshard-run --max-restarts`: a rank
           killed (alternately rank 0 and 1) stops the world; every rank starts again
           and resumes from the last checkpoint, taking the steps since it again.
  groups   2 replica groups of 1 rank (`--replica-group a|b --coordinator etcd://`,
           a real etcd member on 127.0.0.1), each under its own `zeroshard-run
           --max-restarts`: the killed group's rank (alternately a's and b's) is
           started again by its launcher and heals from the live group; the survivor
           takes the lost step again with the whole global batch.
  torchft  the peer (bench/fault_peer.py): torchft's Manager and DDP over 2 groups of
           1 process under torchrun, Hugging Face's BART of the same shape, on Gloo.

Figures per mode, from the runs' own records (the "time" of each metrics line):
  goodput   fault-free wall time / faulted wall time for the same samples (the first
            step to the last: the start-up, the same with faults or without, is left
            out). zeroshard's modes train the global batch every step; the peer's steps
            with a group missing train half of it, and its run lasts until it has
            trained as many samples.
  pause     the survivors' pause per fault (groups: the meeting after the loss and the
            one that heals the returning group, as the survivor reported them).
  back      from the kill to the killed process's group training again (its first
            step after the kill).
  retaken   steps trained again (the restart path: the steps since the checkpoint;
            groups: the lost step in flight).
  heal      bytes and seconds of the state a returning group received.
  exact     zeroshard: steps whose loss differs from the fault-free run's by more than
            1e-5 (relative); every step 1..N taken, by some group, with the whole batch.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# A core each for the two groups, as if each had a host of its own (this box has 2): a group alone
# trains the whole batch on its own core, as it would on its host.
CORES = [{0}, {1 % (os.cpu_count() or 1)}]
sys.path.insert(0, os.path.join(HERE, "..", "tests", "bart"))
sys.path.insert(0, HERE)
from check_pretrain import DATA, metrics, start_etcd  # noqa: E402  (the tests' etcd member and readers)
from fault_peer import children, fault_schedule  # noqa: E402  (the peer's schedule, so both see the same)


def prepare(exe, work, max_tokens):
    """The tokenizer and dataset every run shares, prepared once under `work` (its "prepared" run
    directory, whose tokenizer/ a run directory copies and whose dataset/ every run reads)."""
    ref = os.path.join(work, "prepared")
    if not os.path.isdir(os.path.join(ref, "dataset")):
        shutil.rmtree(ref, ignore_errors=True)
        subprocess.run([exe, "--data", DATA, "--run-dir", ref, "--max-steps", "1", "--ckpt-dir", "none",
                        "--max-tokens", str(max_tokens), "--no-plot", "--eval-every", "0"],
                       check=True, capture_output=True)
    return ref


def last_step(run_dir):
    """The last step line's step in a run's metrics file as it is now (0: none yet)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line being written
        if "event" not in r:
            return r["step"]
    return 0


class Faults(threading.Thread):
    """Kills, at each scheduled time after the job's first step, the rank `target_pid(target)` names (a
    launcher's child); a target with no rank alive at that moment (its launcher starting it again) is tried
    every 0.2 s. Records (unix time of the kill, target, the step `reached()` says the job had taken)."""

    def __init__(self, schedule, target_pid, reached):
        super().__init__(daemon=True)
        self.schedule, self.target_pid, self.reached = schedule, target_pid, reached
        self.done, self.kills = threading.Event(), []

    def run(self):
        while self.reached() == 0:  # the start-up is not the faults'
            if self.done.wait(0.05):
                return
        self.start_time = time.time()
        for at, target in self.schedule:
            while not self.done.wait(max(0.0, self.start_time + at - time.time())):
                pid = self.target_pid(target)
                if pid:
                    try:
                        step = self.reached()
                        os.kill(pid, signal.SIGKILL)
                        self.kills.append((time.time(), target, step))
                        break
                    except ProcessLookupError:
                        pass
                at = time.time() - self.start_time + 0.2
            if self.done.is_set():
                return


def steps_of(run_dir):
    return [r for r in metrics(run_dir) if "event" not in r]


def spread(values, unit="s", digits=2):
    if not values:
        return "-"
    v = sorted(values)
    return f"{v[0]:.{digits}f} / {statistics.median(v):.{digits}f} / {v[-1]:.{digits}f} {unit}"


class Bench:
    def __init__(self, args):
        self.args, self.build = args, os.path.abspath(args.build)
        self.exe = os.path.join(self.build, "examples", "bart_pretrain")
        self.launcher = os.path.join(self.build, "zeroshard-run")
        self.work = args.work
        self.common = ["--config", args.config, "--max-steps", str(args.steps), "--eval-every", "0", "--dropout", "0",
                       "--no-sample", "--global-batch", "8", "--max-tokens", str(args.max_tokens), "--save-every",
                       str(args.save_every), "--liveness", str(args.liveness), "--no-plot", "--progress-interval",
                       "1000"]

    def prepare(self):
        return prepare(self.exe, self.work, self.args.max_tokens)

    def run_dir(self, name):
        d = os.path.join(self.work, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(os.path.join(self.prepared, "tokenizer"), os.path.join(d, "tokenizer"))
        return d

    def launch(self, run_dir, nproc, extra, cores=None):
        cmd = [self.launcher, "--nproc-per-node", str(nproc), "--max-restarts", "1000", "--", self.exe,
               "--dataset", os.path.join(self.prepared, "dataset"), "--run-dir", run_dir, *self.common, *extra]
        log = open(run_dir + ".log", "w")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, ZS_LOG_LEVEL="info",
                                         **({"OMP_NUM_THREADS": str(len(cores))} if cores else {})),
                                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)

    def supervise(self, procs, dirs, schedule, target_pid):
        """Waits for the run's launchers, applying the schedule; a faulted run still going `--cap` times its
        fault-free run's span after its first step is stopped there. Returns (kills, the stop's unix time or
        None)."""
        faults = Faults(schedule, target_pid, lambda: max(last_step(d) for d in dirs))
        faults.start()
        stopped = None
        try:
            for p in procs:
                while p.poll() is None:
                    if schedule and self.cap_s and faults.is_alive() and hasattr(faults, "start_time") and \
                            time.time() > faults.start_time + self.cap_s:
                        stopped = time.time()
                        break
                    time.sleep(0.1)
                if stopped:
                    break
                if p.returncode != 0:
                    raise SystemExit(f"fault_bench: {' '.join(p.args[:6])}... exited {p.returncode} (see its log)")
        finally:
            faults.done.set()
            faults.join()
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        return faults.kills, stopped

    def restart(self, schedule, tag):
        d = self.run_dir(f"restart-{tag}")
        p = self.launch(d, 2, [])

        def rank(target):
            ranks = sorted(children(p.pid))
            return ranks[target] if len(ranks) == 2 else None
        kills, stopped = self.supervise([p], [d], schedule, rank)
        return {"dirs": [d], "kills": kills, "stopped": stopped}

    def groups(self, schedule, tag):
        etcd, client = start_etcd(self.work)
        try:
            dirs = [self.run_dir(f"groups-{tag}-{g}") for g in "ab"]
            procs = [self.launch(d, 1, ["--replica-group", g, "--coordinator", "etcd://" + client[len("http://"):],
                                        "--replica-job", "bench"], cores) for d, g, cores in zip(dirs, "ab", CORES)]

            def rank(target):
                ranks = children(procs[target].pid)
                return ranks[0] if ranks else None
            kills, stopped = self.supervise(procs, dirs, schedule, rank)
        finally:
            etcd.kill()
            etcd.wait()
        return {"dirs": dirs, "kills": kills, "stopped": stopped}

    def figures(self, mode, free, faulted):
        """The table's row of `mode` from its fault-free and faulted runs."""
        def span(r):  # the first step's end to the last's (or to the stop of a run stopped at the cap)
            times = [s["time"] for d in r["dirs"] for s in steps_of(d)]
            return (r.get("stopped") or max(times)) - min(times)
        wall_free, wall = span(free), span(faulted)
        want = {s["step"]: s["loss"] for s in steps_of(free["dirs"][0])}
        taken = {}
        for d in faulted["dirs"]:
            for s in steps_of(d):
                taken.setdefault(s["step"], []).append(s)
        # A run stopped at the cap counts the steps it had reached (its files' last lines): goodput is then
        # its rate of steps against the fault-free run's.
        reached = max(last_step(d) for d in faulted["dirs"])
        missing = [k for k in range(1, reached + 1) if k not in taken]
        partial = [k for k, ss in taken.items() if any(s.get("samples", 8) != 8 for s in ss)]
        differ = [k for k, ss in taken.items()
                  if any(s["loss"] is not None and abs(s["loss"] - want[k]) > 1e-5 * abs(want[k]) for s in ss)]
        row = {"mode": mode, "faults": len(faulted["kills"]), "wall_free_s": wall_free, "wall_s": wall,
               "goodput": (reached / wall) / (self.args.steps / wall_free), "steps": reached,
               "stopped_at_cap": bool(faulted.get("stopped")), "missing_steps": missing,
               "partial_steps": partial, "loss_differs_steps": differ}
        back, retaken, pauses_lost, pauses_heal, heal_mb, heal_s = [], [], [], [], [], []
        for t_kill, target, _ in faulted["kills"]:
            d = faulted["dirs"][0 if mode == "restart" else target]
            after = [s for s in steps_of(d) if s["time"] > t_kill]
            if after:
                back.append(after[0]["time"] - t_kill)
        if mode == "restart":
            resumes = [r for r in metrics(faulted["dirs"][0]) if r.get("event") == "resume"]
            for t_kill, _, reached in faulted["kills"]:
                nxt = [r for r in resumes if r["time"] > t_kill]
                if nxt:
                    retaken.append(max(0, reached - nxt[0]["step"]))
        else:
            # Per fault, the survivor's meetings from the kill to the next kill: the first is the fault's
            # pause (whether the killed group was seen lost, or already back: its launcher started it again
            # and it revoked its old registration); the later ones, meeting the returning group. (The
            # meeting after the last step, when the first group done leaves, is none.)
            kills = faulted["kills"]
            for k, (t_kill, target, _) in enumerate(kills):
                until = kills[k + 1][0] if k + 1 < len(kills) else float("inf")
                met = [e for e in metrics(faulted["dirs"][1 - target]) if e.get("event") == "replica_groups" and
                       t_kill < e["time"] < until and e["heal_bytes"] == 0 and e["step"] < self.args.steps]
                if met:
                    pauses_lost.append(met[0]["pause_s"])
                    retaken.append(1 if met[0]["step_retaken"] else 0)
                    pauses_heal += [e["pause_s"] for e in met[1:]]
            for d in faulted["dirs"]:
                for e in metrics(d):
                    if e.get("event") == "replica_groups" and e["heal_bytes"] > 0 and kills and e["time"] > kills[0][0]:
                        heal_mb.append(e["heal_bytes"] / 1e6)
                        heal_s.append(e["heal_s"])
        row.update(back_s=back, retaken=retaken, pause_lost_s=pauses_lost, pause_heal_s=pauses_heal,
                   heal_mb=heal_mb, heal_s=heal_s)
        return row

    def peer(self, schedule):
        import fault_peer
        kw = dict(samples=8 * self.args.steps, global_batch=8, heartbeat_s=self.args.heartbeat,
                  config=self.args.config, src_len=self.args.max_tokens, tgt_len=self.args.max_tokens,
                  seed=self.args.seed, save_every=self.args.save_every, cores=CORES)
        free = fault_peer.run(os.path.join(self.work, "torchft-free"), schedule=[], **kw)
        wall_free = free["wall_s"] - free["first_s"]
        hit = fault_peer.run(os.path.join(self.work, "torchft-faulted"), schedule=schedule,
                             cap_s=self.args.cap * wall_free, **kw)
        wall = (hit["stopped_s"] or hit["wall_s"]) - hit["first_s"]
        known = lambda v: [x for x in v if x is not None]  # noqa: E731 (None: no commit to measure from)
        return {"mode": "torchft", "faults": hit["faults"], "wall_free_s": wall_free, "wall_s": wall,
                "goodput": (hit["samples"] / wall) / (kw["samples"] / wall_free), "steps": hit["steps"],
                "samples": hit["samples"], "stopped_at_cap": hit["stopped_s"] is not None,
                "back_s": known(hit["back_s"]), "pause_lost_s": known(hit["pauses_s"]),
                "heal_mb": [b / 1e6 for b in hit["heal_bytes"]], "retaken": hit["retaken_steps"],
                "heal_s": hit["heal_s"], "discarded_steps": hit["discarded_steps"],
                "repeated_or_lost": hit["repeated_or_lost"], "checksums_equal": hit["checksums_equal"],
                "version": hit["torchft"], "patched": hit["patched"]}

    def main(self):
        os.makedirs(self.work, exist_ok=True)
        self.prepared = self.prepare()
        a, b = (float(x) for x in self.args.faults_every.split("-"))
        rows = []
        # One schedule for every mode, counted from each run's first step.
        schedule = fault_schedule(self.args.seed, (a, b), 3600)
        for mode in self.args.modes.split(","):
            if mode == "torchft":
                rows.append(self.peer(schedule))
            else:
                run = getattr(self, mode)
                self.cap_s = None
                free = run([], "free")
                self.cap_s = self.args.cap * (max(s["time"] for d in free["dirs"] for s in steps_of(d)) -
                                              min(s["time"] for d in free["dirs"] for s in steps_of(d)))
                rows.append(self.figures(mode, free, run(schedule, "faulted")))
            print(json.dumps(rows[-1]), flush=True)
        self.table(rows)
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump({"config": self.args.config, "steps": self.args.steps, "liveness_s": self.args.liveness,
                           "heartbeat_s": self.args.heartbeat, "save_every": self.args.save_every,
                           "faults_every": self.args.faults_every, "rows": rows}, f, indent=1)

    def table(self, rows):
        print(f"\nfaults every {self.args.faults_every} s; {self.args.config} BART, {self.args.steps} steps of 8 "
              f"samples, a checkpoint every {self.args.save_every} steps; zeroshard --liveness {self.args.liveness} "
              f"s, torchft heartbeat timeout {self.args.heartbeat} s")
        print("| mode | faults | fault-free s | faulted s | goodput | survivor pause per fault (min/med/max) "
              "| kill -> training again | steps taken again | heal | lost or repeated samples |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            pause = spread(r.get("pause_lost_s", []))
            if r.get("pause_heal_s"):
                pause += f"; healing the returning group {spread(r['pause_heal_s'])}"
            heal = (f"{statistics.median(r['heal_mb']):.1f} MB in {spread(r['heal_s'], digits=3)}"
                    if r.get("heal_mb") else "-")
            if r["mode"] == "torchft":
                half = (8 * r["steps"] - r["samples"]) // 4
                lost = (f"{half} of {r['steps']} steps trained half the batch; {r['repeated_or_lost']} committed "
                        "steps lost or repeated")
                retaken = f"{r['discarded_steps']} discarded, {r['retaken']} after resuming from a checkpoint"
            else:
                lost = (f"{len(r['missing_steps'])} steps missing, {len(r['partial_steps'])} short of the batch; "
                        f"{len(r['loss_differs_steps'])} losses differ")
                retaken = str(sum(r["retaken"]))
            faulted = f"{r['wall_s']:.1f}" + (" (stopped at the cap)" if r["stopped_at_cap"] else "")
            print(f"| {r['mode']} | {r['faults']} | {r['wall_free_s']:.1f} | {faulted} | {r['goodput']:.2f} "
                  f"| {pause} | {spread(r['back_s'])} | {retaken} | {heal} | {lost} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--faults-every", default="10-20")
    ap.add_argument("--liveness", type=int, default=2)
    ap.add_argument("--heartbeat", type=float, default=1.0)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="restart,groups,torchft")
    ap.add_argument("--cap", type=float, default=4.0, help="a faulted run still going this many times its "
                    "fault-free run's span after its first step is stopped there (goodput from the steps reached)")
    ap.add_argument("--work", default="/tmp/zs-fault-bench")
    ap.add_argument("--json")
    Bench(ap.parse_args()).main()


if __name__ == "__main__":
    main()
