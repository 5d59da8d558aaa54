#!/usr/bin/env bash
# The same BART, batch, data and seed trained for the same number of steps
# (so the same tokens) under each way of splitting it over NPROC ranks: DDP-style
# replication (ZeRO stage 0), ZeRO-1, ZeRO-2 and ZeRO-3 over every rank,
# pipeline stages (1F1B) with ZeRO-2 inside, and pipeline stages with ZeRO-3
# inside. One markdown table (bench/strategies.py
# explains each column) and one plot of validation loss against training time.
# Usage: bench/strategies.sh [BUILD_DIR] [OUT_DIR]
#   env: NPROC (4), STEPS (300), BATCH (global batch, 16), MICRO (microbatches
#        per data-parallel rank for the pipelines, 4), EVAL (validate every
#        EVAL steps, 25), DATA (a directory of text; default the trainer's),
#        REPEAT (rounds, default 1; each round runs every strategy once, in
#        turn, and the table gives each strategy's median round and the range)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
out=${2:-$build/strategies}
nproc=${NPROC:-4}
steps=${STEPS:-300}
batch=${BATCH:-16}
micro=${MICRO:-4}
every=${EVAL:-25}
repeat=${REPEAT:-1}
data=()
[ -n "${DATA:-}" ] && data=(--data "$DATA")
python=${PYTHON:-$here/../.venv/bin/python}
[ -x "$python" ] || python=python3

rm -rf "$out"
mkdir -p "$out"
# One tokenizer for every run, trained once.
"$build/examples/bart_pretrain" train-tokenizer "${data[@]}" --out "$out/tokenizer" > /dev/null

common=(--config tiny "${data[@]}" --tokenizer "$out/tokenizer" --max-steps "$steps" --global-batch "$batch"
        --eval-every "$every" --ckpt-dir none --no-sample --no-plot --progress-interval 1000 --seed 1)
# name | bart_pretrain arguments
strategies=(
  "DDP-style (replicated)|--stage 0"
  "ZeRO-1|--stage 1"
  "ZeRO-2|--stage 2"
  "ZeRO-3|--stage 3"
)
for pp in 2 4; do
  (( nproc % pp == 0 && nproc > 1 )) || continue
  strategies+=("pp $pp x dp $((nproc / pp)), 1F1B, ZeRO-2|--pp $pp --schedule-pp 1f1b --stage 2 --micro-batches $micro")
done
(( nproc % 2 == 0 && nproc >= 4 )) &&
  strategies+=("pp 2 x dp $((nproc / 2)), 1F1B, ZeRO-3|--pp 2 --schedule-pp 1f1b --stage 3 --micro-batches $micro")

# Rounds of every strategy in turn, so that a slow spell of the machine falls
# on several strategies rather than on all runs of one.
declare -A dirs
for (( round = 1; round <= repeat; round++ )); do
  for i in "${!strategies[@]}"; do
    s=${strategies[$i]}
    name=${s%%|*}
    read -r -a args <<< "${s#*|}"
    dir="$out/run$(( i + 1 ))_round$round"
    # CPU seconds of every rank (the launcher's children) over the run's wall time: core utilisation.
    TIMEFORMAT="%R %U %S"
    { time "$build/zeroshard-run" --nproc-per-node "$nproc" -- "$build/examples/bart_pretrain" "${common[@]}" \
        --run-dir "$dir" "${args[@]}" > "$dir.log" 2>&1; } 2> "$dir.time" ||
      { echo "strategies: '$name' failed; its log: $dir.log" >&2; tail -20 "$dir.log" >&2; exit 1; }
    dirs[$i]="${dirs[$i]:+${dirs[$i]},}$dir"
  done
done
runs=()
for i in "${!strategies[@]}"; do
  runs+=("${strategies[$i]%%|*}=${dirs[$i]}")
done
"$python" "$here/strategies.py" --cores "$(nproc)" --ranks "$nproc" --plot "$out/strategies.png" "${runs[@]}"
