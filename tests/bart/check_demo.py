#!/usr/bin/env python3
"""scripts/demo.sh (what `make demo` runs), shortened to 40 steps: it must
interrupt the run half-way through the launcher, restart and resume it, and end
with a summary a person can read (the denoising accuracies among it), plus the
files it promises.

Usage: check_demo.py SOURCE_DIR BUILD_DIR
"""
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pycheck import check  # noqa: E402  (an assert that python -O keeps)

src, build = sys.argv[1], os.path.abspath(sys.argv[2])
run_dir = os.path.join(build, "demo_script_run")
shutil.rmtree(run_dir, ignore_errors=True)
env = dict(os.environ, STEPS="40", RUN_DIR=run_dir)
p = subprocess.run([os.path.join(src, "scripts", "demo.sh"), build], capture_output=True, text=True, env=env, cwd=src)
out = p.stdout + p.stderr
check(p.returncode == 0, f"demo.sh exited {p.returncode}\n{out[-5000:]}")
for needle in ("simulating a spot preemption: rank 0 reached step 20", "restarting all ranks (restart 1 of 1)",
               "BART pretraining summary", "2 ranks, ZeRO stage 3", "interrupted  at step", "resumed      from the step-",
               "denoising    64 held-out sentences, greedy decoding:", "unmasked tokens reproduced",
               "masked ones recovered", "masked input:", "reconstruction:", "original:",
               "unsharded (one process, 16 bytes/parameter)", "efficiency   gradient noise scale"):
    check(needle in out, f"'{needle}' missing from the demo's output:\n{out[-5000:]}")
for f in ("metrics.jsonl", "loss.png", "trace-rank-0.json", "trace-rank-1.json", "trace-rank-0.restart-1.json",
          "checkpoints/latest"):
    check(os.path.exists(os.path.join(run_dir, f)), f"the demo promised {f}")
with open(os.path.join(run_dir, "trace-rank-0.restart-1.json")) as f:
    names = {e["args"]["name"] for e in json.load(f)["traceEvents"] if e["name"] == "thread_name"}
check("training" in names and any(n.startswith("communicator") for n in names), names)
steps = [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"event"' not in line]
check(steps == list(range(1, 41)), steps)
# Reconstruction, as 40 steps can show it: the validation loss (the denoising loss on held-out text) falls at
# every evaluation, across the preemption at step 20 too, to below 0.9x the untrained model's (measured 7.66 ->
# 6.94, 6.54, 6.38, 6.34). An untrained or broken model stays at about ln(vocab), and a resume that lost the
# trained state would rise after step 20. (The greedy-decoding accuracies below need far more steps: 0.0% and
# 0.0% after 40 steps, 4.9% and 5.5% after 300, about 94% and 12% after the demo's 2000; they are checked for
# consistency only.)
val = [(r["step"], r["val_loss"]) for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
       if r.get("event") == "validation"]
check([s for s, _ in val] == [0, 10, 20, 30, 40], val)
check(all(b < a for (_, a), (_, b) in zip(val, val[1:])), f"the validation loss does not fall at every evaluation: {val}")
check(val[-1][1] < 0.9 * val[0][1], f"the validation loss {val[0][1]:.3f} -> {val[-1][1]:.3f} fell less than 10%")
summary = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"summary"' in line][-1]
d = summary["denoising"]
check(d["sentences"] == 64 and d["unmasked_tokens"] > 10 * 64 and d["masked_tokens"] > 64, d)
for kind, right in (("unmasked", "unmasked_reproduced"), ("masked", "masked_recovered")):
    check(0 <= d[right] <= d[kind + "_tokens"], d)
    check(abs(d[kind + "_accuracy"] - d[right] / d[kind + "_tokens"]) < 1e-12, d)
# The masked share is the noise's: 30% of the tokens in spans (the last span trimmed to land on it).
share = d["masked_tokens"] / (d["masked_tokens"] + d["unmasked_tokens"])
check(0.25 < share < 0.35, share)
check(summary["sample"]["original"] and summary["sample"]["masked"].count("<mask>") >= 1, summary["sample"])
# The sample is a whole sentence: it starts at a word and ends one (a long sentence's later pieces start inside a word).
o = summary["sample"]["original"]
check(o[:1] in " \"'" or o[:1].isupper() or o[:1].isdigit(), f"the sample starts inside a word: {o!r}")
check(o.rstrip(" \"')")[-1:] in (".", "!", "?"), f"the sample does not end a sentence: {o!r}")
print(f"demo: validation loss {val[0][1]:.3f} -> {val[-1][1]:.3f}, falling at every evaluation across the resume; "
      "interrupted at step 20 through the launcher, restarted, resumed, summary and files present; "
      f"after 40 steps {100 * d['unmasked_accuracy']:.1f}% of {d['unmasked_tokens']} unmasked tokens reproduced, "
      f"{100 * d['masked_accuracy']:.1f}% of {d['masked_tokens']} masked recovered")
print("OK")
