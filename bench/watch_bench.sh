#!/usr/bin/env bash
# What watching a run costs per step, against the demo's step: bench/watch_bench (the step's
# agreement with every rank's figures in it, beside the same without them; a metrics line with its
# TensorBoard record, beside the line alone), then 200 steps of the demo's training (make demo's
# configuration, its TensorBoard files and rank figures on) for its median step time; the share is
# the first's added time over the second.
#
#   bench/watch_bench.sh BUILD_DIR [NPROC=2]
set -euo pipefail
build=${1:-build}
nproc=${2:-2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data=/usr/share/games/fortunes
[[ -d $data ]] || data=/usr/share/common-licenses

out=$("$build/zeroshard-run" --nproc-per-node "$nproc" -- "$build/bench/watch_bench" --steps 2000 --blocks 10 2>&1)
echo "$out" | sed -n 's/^\[rank0\]: \(watch_bench: \)/\1/p'
echo "| per step | time |"
echo "|---|---:|"
echo "$out" | sed -n 's/^\[rank0\]: ROW //p'
added=$(echo "$out" | sed -n 's/^\[rank0\]: ADDED_S //p')

"$build/zeroshard-run" --nproc-per-node "$nproc" -- "$build/examples/bart_pretrain" --config tiny --data "$data" \
  --run-dir "$work/run" --stage 3 --max-steps 200 --global-batch 32 --max-tokens 32 --lr 1e-3 --mask-ratio 0.3 \
  --no-permute --dropout 0 --eval-every 0 --ckpt-dir none --no-sample --no-plot --progress-interval 1000 > /dev/null 2>&1
step=$(python3 -c '
import json, statistics, sys
s = [r["step_s"] for r in map(json.loads, open(sys.argv[1])) if "event" not in r and r["step"] > 10]
print(statistics.median(s))' "$work/run/metrics.jsonl")
python3 -c '
import sys
added, step = float(sys.argv[1]), float(sys.argv[2])
print(f"| the demo'"'"'s step (median of steps 11-200) | {step * 1e3:.1f} ms |")
print(f"| added by watching it (the two differences above) | {added * 1e6:.1f} us: {100 * added / step:.3f}% of the step |")' \
  "$added" "$step"
