#!/usr/bin/env python3
"""The strategies table and plot, from the run directories bench/strategies.sh made.

Usage: strategies.py --cores C --ranks N [--plot PNG] NAME=RUN_DIR[,RUN_DIR...] ...

Several run directories of one strategy are rounds of the same training: the
row is the round of median runtime, and the runtime column adds the range.

Columns, per strategy (every figure from the run's metrics.jsonl, except
utilisation):
  runtime        seconds of training steps (rank 0's step_s summed; start-up and validation excluded)
  tokens/s       target tokens over that time
  val loss       after the last step
  val @ T        validation loss at T, the shortest runtime of all rows,
                 interpolated linearly in training time between validations
  cores busy     CPU seconds of every rank (user + system, the whole process
                 life: start-up and validation included) over wall seconds x cores
  exposed comm   share of step time rank 0 was blocked on collectives
  bubble         pipelines: share of step time rank 0's executor spent outside
                 its forward and backward passes
  peak RSS       the largest rank's peak resident memory
  efficiency     statistical efficiency of the batch at the end (noise_scale.h)
  goodput        tokens/s x efficiency, over the run (the summary's)
"""
import argparse
import json
import os
import shutil
import subprocess
import sys


def read(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "event" not in r]
    summary = [r for r in rows if r.get("event") == "summary"][-1]
    clock, elapsed = {0: 0.0}, 0.0  # training seconds after each step
    for r in steps:
        elapsed += r["step_s"]
        clock[r["step"]] = elapsed
    val = [(clock[r["step"]], r["val_loss"]) for r in rows if r.get("event") == "validation"]
    return steps, summary, val


def at_time(val, t):
    for (t0, v0), (t1, v1) in zip(val, val[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return val[-1][1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cores", type=int, required=True)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--plot", default="")
    ap.add_argument("runs", nargs="+", help="NAME=RUN_DIR[,RUN_DIR...]")
    a = ap.parse_args()
    runs = []
    for spec in a.runs:
        name, run_dirs = spec.split("=", 1)
        rounds = []
        for run_dir in run_dirs.split(","):
            steps, summary, val = read(run_dir)
            with open(run_dir + ".time") as f:
                wall, user, system = map(float, f.read().split()[-3:])
            rounds.append(dict(name=name, dir=run_dir, steps=steps, summary=summary, val=val,
                               busy=(user + system) / (wall * a.cores)))
        rounds.sort(key=lambda r: r["summary"]["train_seconds"])
        median = dict(rounds[(len(rounds) - 1) // 2])
        median["range"] = (rounds[0]["summary"]["train_seconds"], rounds[-1]["summary"]["train_seconds"])
        median["rounds"] = len(rounds)
        runs.append(median)
    t_equal = min(r["val"][-1][0] for r in runs)
    tokens = {r["summary"]["tokens"] for r in runs}
    n_rounds = runs[0]["rounds"]
    print(f"{len(runs[0]['steps'])} steps of the same global batches ({'/'.join(map(str, sorted(tokens)))} target "
          f"tokens), {a.ranks} ranks on {a.cores} cores; val @ T: at T = {t_equal:.1f} s of training, the shortest "
          f"runtime" + (f"; each row the median of {n_rounds} rounds (runtime: its range)" if n_rounds > 1 else "") +
          "\n")
    print("| strategy | runtime s | tokens/s | val loss | val @ T | cores busy | exposed comm | bubble | "
          "peak RSS MiB | efficiency | goodput tokens/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        s, st = r["summary"], r["steps"]
        step_s = sum(x["step_s"] for x in st)
        comm = sum(x["exposed_comm_s"] for x in st) / step_s
        bubble = (f"{sum(x['bubble_s'] for x in st) / step_s:.1%}" if "bubble_s" in st[0] else "—")
        eff = "—" if s.get("efficiency") is None else f"{s['efficiency']:.2f}"
        goodput = "—" if s.get("goodput") is None else f"{s['goodput']:,.0f}"
        lo, hi = r["range"]
        runtime = f"{s['train_seconds']:.1f}" + (f" ({lo:.1f}–{hi:.1f})" if r["rounds"] > 1 else "")
        print(f"| {r['name']} | {runtime} | {s['tokens_per_s']:,.0f} | {s['last_val_loss']:.3f} | "
              f"{at_time(r['val'], t_equal):.3f} | {r['busy']:.0%} | {comm:.1%} | {bubble} | "
              f"{max(s['peak_rss_bytes']) / 2**20:.0f} | {eff} | {goodput} |")
    if a.plot:
        plot(runs, a.plot)


def plot(runs, png):
    if shutil.which("gnuplot") is None:
        print("strategies: no gnuplot on PATH; no plot", file=sys.stderr)
        return
    data = png + ".dat"
    with open(data, "w") as f:
        for r in runs:
            f.write(f'"{r["name"]}"\n')
            for t, v in r["val"]:
                f.write(f"{t} {v}\n")
            f.write("\n\n")
    script = (f"set terminal pngcairo size 900,560; set output '{png}'; set key top right; "
              "set xlabel 'training time (s)'; set ylabel 'validation loss (nats/token)'; set grid; "
              f"plot for [i=0:{len(runs) - 1}] '{data}' index i with linespoints title columnheader(1)")
    p = subprocess.run(["gnuplot", "-e", script], capture_output=True, text=True)
    if p.returncode != 0:
        print(f"strategies: gnuplot failed: {p.stderr}", file=sys.stderr)
    else:
        print(f"\nplot: {png}")


if __name__ == "__main__":
    main()
