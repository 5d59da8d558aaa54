#!/usr/bin/env bash
# Does a run slow down as it trains? The demo's recipe (tiny BART, ZeRO-3,
# sequences of 32 tokens, no dropout, AdamW 1e-3 cosine) for STEPS steps on
# one rank, twice: denormal floats flushed to zero (bart_pretrain's default)
# and kept (--keep-denormals). Prints, for each, the mean compute and
# optimizer time per step over the first and the last fifth of the steps
# (metrics.jsonl), and late / early. Trained attention puts many softmax
# probabilities below 1.2e-38, where x86 cores take 10-100x per operation.
# Usage: bench/denormal_bench.sh [BUILD_DIR] [STEPS]   (env: DATA, THREADS, MODES="flush keep")
set -euo pipefail
build=${1:-build}
steps=${2:-1500}
data=${DATA:-/usr/share/games/fortunes}
threads=${THREADS:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "| denormals | steps | compute ms/step, first fifth | last fifth | late/early | optimizer ms/step, first | last |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for mode in ${MODES:-flush keep}; do
  flag=()
  [ "$mode" = keep ] && flag=(--keep-denormals)
  OMP_NUM_THREADS=$threads ZS_LOG_LEVEL=warn "$build/examples/bart_pretrain" --config tiny --data "$data" \
    --run-dir "$work/$mode" --ckpt-dir none --stage 3 --max-steps "$steps" --global-batch 32 --max-tokens 32 \
    --lr 1e-3 --schedule cosine --warmup-steps $((steps / 20)) --mask-ratio 0.3 --no-permute --dropout 0 \
    --eval-every 0 --no-sample --no-plot --progress-interval 100000 "${flag[@]}" >/dev/null
  python3 - "$work/$mode/metrics.jsonl" "$mode" "$steps" <<'PY'
import json, sys
path, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [r for r in map(json.loads, open(path)) if "compute_s" in r and r.get("step", 0) > 0]
fifth = max(1, len(rows) // 5)
def mean(rs, key): return 1e3 * sum(r[key] for r in rs) / len(rs)
early, late = rows[1:fifth + 1], rows[-fifth:]  # the first step warms up
c0, c1 = mean(early, "compute_s"), mean(late, "compute_s")
o0, o1 = mean(early, "optimizer_s"), mean(late, "optimizer_s")
print(f"| {mode} | {steps} | {c0:.1f} | {c1:.1f} | {c1 / c0:.2f} | {o0:.2f} | {o1:.2f} |")
PY
done
