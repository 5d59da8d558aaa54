#!/usr/bin/env bash
# make demo: tiny BART pretrained on 2 local ranks with ZeRO-3 on the fortune
# cookies of Debian's `fortunes` package (scripts/install-deps.sh installs it;
# or DATA=, a directory or file of text or of JSON lines, plain or .gz/.zst).
# The text is prepared once, as a large corpus would be: a vocabulary learned
# from it, then `bart_pretrain prepare` writes the token store the run maps
# (RUN_DIR/dataset), a document per fortune (they are separated by lines of
# '%'; SEPARATOR= another line for a DATA= of text, none by default). The
# validation set is about 1% of the tokens (at least 20,000 or 5%), whole
# documents spread over the corpus. A simulated spot interruption half-way: zeroshard-run
# sends every rank SIGTERM, they save a checkpoint and exit 75, the launcher
# restarts them, they resume from the checkpoint and finish. The run ends by
# decoding held-out sentences: the summary gives the share of unmasked tokens
# reproduced and of masked ones recovered, and one example.
# The recipe: sequences of at most 32 tokens, text infilling (30% in spans of
# mean 3) without sentence permutation, no dropout, AdamW at 1e-3 with cosine
# decay for 2000 steps of 32 sequences. A higher peak learning rate (2e-3 and
# up) leaves this model a language model that never learns to copy its input.
# Usage: scripts/demo.sh BUILD_DIR   (env: DATA, SEPARATOR, STEPS, RANKS, RUN_DIR)
set -euo pipefail
build=${1:-build}
data=${DATA:-/usr/share/games/fortunes}
default_separator=""
[ -n "${DATA:-}" ] || default_separator=%  # fortunes are cut by lines of '%'
separator=${SEPARATOR-$default_separator}
sep=()
[ -z "$separator" ] || sep=(--document-separator "$separator")
steps=${STEPS:-2000}
ranks=${RANKS:-2}
run_dir=${RUN_DIR:-$build/demo-run}
warmup=$(( steps / 20 > 1 ? steps / 20 : 1 ))  # 100 of the default 2000 steps
every=$(( steps / 4 > 1 ? steps / 4 : 1 ))

if [ ! -e "$data" ]; then
  echo "demo: the corpus '$data' does not exist; install Debian's fortunes package (scripts/install-deps.sh" \
       "does) or give your corpus with DATA=/path: a directory or file of text or JSON lines, plain or .gz/.zst" >&2
  exit 2
fi
rm -rf "$run_dir"  # a fresh run each time (a run directory that exists would be resumed)
echo "demo: tiny BART, $ranks ranks, ZeRO-3, $steps steps on the text under $data"
echo "demo: a simulated spot preemption (SIGTERM through zeroshard-run) comes at step $((steps / 2)); the run saves,"
echo "demo: is restarted, resumes from its checkpoint and finishes. Run directory: $run_dir"
echo
mkdir -p "$run_dir"
"$build/examples/bart_pretrain" train-tokenizer --data "$data" "${sep[@]}" --vocab-size 2048 \
  --out "$run_dir/tokenizer"
"$build/examples/bart_pretrain" prepare --data "$data" "${sep[@]}" --tokenizer "$run_dir/tokenizer" \
  --out "$run_dir/dataset"
echo
"$build/zeroshard-run" --nproc-per-node "$ranks" --max-restarts 1 --simulate-preemption-at-step $((steps / 2)) -- \
  "$build/examples/bart_pretrain" --config tiny --dataset "$run_dir/dataset" --run-dir "$run_dir" --stage 3 \
  --max-steps "$steps" --global-batch 32 --max-tokens 32 --lr 1e-3 --schedule cosine --warmup-steps "$warmup" \
  --mask-ratio 0.3 --no-permute --dropout 0 --eval-every "$every" --save-every "$every" --progress-interval 15 --trace
echo
echo "demo: per-step metrics: $run_dir/metrics.jsonl    loss curve: $run_dir/loss.png"
echo "demo: timelines (open in https://ui.perfetto.dev): $run_dir/trace-rank-*.json"
echo "demo: inspect the checkpoints: $build/zeroshard-ckpt inspect $run_dir/checkpoints"
