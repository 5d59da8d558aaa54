#!/usr/bin/env bash
# BART as pipeline stages (pp x dp; GPipe, 1F1B, interleaved 1F1B) beside the
# whole model under ZeRO-3 over every rank, at NPROC ranks with the same global
# batch and microbatch size, one table: tokens/s, the bubble as it ran (from the
# passes' timings) beside the schedule's formula, microbatches in flight and what
# they held per stage. Stages are partitioned by timing each kind of block
# (--partition timed), and by parameters for comparison. The model: BART with 6 + 6 layers of width 256 and a
# vocabulary of 8192 (13M parameters), 64 + 64 tokens per sequence.
# Usage: bench/bart_pipe_bench.sh [BUILD_DIR] [NPROC] [extra bart_pipe_bench args]
set -euo pipefail
build=${1:-build}
nproc=${2:-4}
shift $(( $# > 2 ? 2 : $# ))
config=$(mktemp --suffix .json)
trap 'rm -f "$config"' EXIT
cat > "$config" <<'JSON'
{"vocab_size": 8192, "d_model": 256, "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 4,
 "decoder_attention_heads": 4, "encoder_ffn_dim": 1024, "decoder_ffn_dim": 1024, "max_position_embeddings": 128}
JSON
row() {
  "$build/zeroshard-run" --nproc-per-node "$nproc" -- "$build/bench/bart_pipe_bench" --config "$config" --steps 6 "$@" 2>&1 |
    sed -n 's/^\[rank0\]: ROW //p'
}
echo "| model | pp x dp | schedule | microbatches per dp rank | parameters | step s (median, slowest rank) | target tokens/s | MB sent per step (busiest rank) | F + B s per stage | bubble as it ran | formula | formula with the stages' F + B | in flight per stage | MiB they held per stage |"
echo "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|"
row --pp 1 "$@"
for pp in 2 4; do
  (( nproc % pp == 0 )) || continue
  row --pp "$pp" --schedule gpipe "$@"
  row --pp "$pp" --schedule 1f1b "$@"
  row --pp "$pp" --schedule 1f1b --partition balanced "$@"
done
(( nproc % 2 == 0 )) && row --pp 2 --schedule interleaved-1f1b --chunks 2 "$@"
if (( nproc >= 4 && nproc % 2 == 0 )); then  # ZeRO-3 inside the stages: gathered once per step, or per pass
  row --pp 2 --schedule 1f1b --zero 3 --gather step "$@"
  row --pp 2 --schedule 1f1b --zero 3 --gather pass "$@"
fi
