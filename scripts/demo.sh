#!/usr/bin/env bash
# make demo: tiny BART pretrained on 4 local ranks with ZeRO-3, on text every
# Debian machine has (or DATA=dir), with a simulated spot interruption half-way:
# zeroshard-run sends every rank SIGTERM, they save a checkpoint and exit 75,
# the launcher restarts them, they resume from the checkpoint and finish.
# Usage: scripts/demo.sh BUILD_DIR   (env: DATA, STEPS, RANKS, RUN_DIR)
set -euo pipefail
build=${1:-build}
data=${DATA:-/usr/share/common-licenses}
steps=${STEPS:-800}
ranks=${RANKS:-4}
run_dir=${RUN_DIR:-$build/demo-run}
warmup=$(( steps * 3 / 40 > 1 ? steps * 3 / 40 : 1 ))  # 60 of the default 800 steps

if [ ! -d "$data" ]; then
  echo "demo: the corpus directory '$data' does not exist; give one with DATA=/path/to/text" >&2
  exit 2
fi
rm -rf "$run_dir"  # a fresh run each time (a run directory that exists would be resumed)
echo "demo: tiny BART, $ranks ranks, ZeRO-3, $steps steps on the text under $data"
echo "demo: a simulated spot preemption (SIGTERM through zeroshard-run) comes at step $((steps / 2)); the run saves,"
echo "demo: is restarted, resumes from its checkpoint and finishes. Run directory: $run_dir"
echo
"$build/zeroshard-run" --nproc-per-node "$ranks" --max-restarts 1 --simulate-preemption-at-step $((steps / 2)) -- \
  "$build/examples/bart_pretrain" --config tiny --data "$data" --run-dir "$run_dir" --stage 3 \
  --max-steps "$steps" --global-batch 16 --lr 3e-3 --schedule cosine --warmup-steps "$warmup" \
  --eval-every 100 --save-every 200 --progress-interval 15 --trace
echo
echo "demo: per-step metrics: $run_dir/metrics.jsonl    loss curve: $run_dir/loss.png"
echo "demo: timelines (open in https://ui.perfetto.dev): $run_dir/trace-rank-*.json"
echo "demo: inspect the checkpoints: $build/zeroshard-ckpt inspect $run_dir/checkpoints"
