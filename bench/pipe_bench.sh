#!/usr/bin/env bash
# Runs bench/pipe_bench over schedules, pipeline depths and microbatch counts
# and prints one table: measured bubble and peak in-flight microbatches per
# rank beside the schedules' formulas. Passes of 100 ms forward (200 ms backward)
# per rank keep the p2p latency on the critical path small beside them.
# Usage: bench/pipe_bench.sh [BUILD_DIR] [extra args]
set -euo pipefail
build=${1:-build}
shift $(( $# > 1 ? 1 : $# ))
row() {  # row NPROC ARGS...
  local n=$1
  shift
  "$build/zeroshard-run" --nproc-per-node "$n" -- "$build/bench/pipe_bench" --forward-ms 100 "$@" 2>&1 | sed -n 's/^\[rank0\]: ROW //p'
}
echo "| schedule | p | m | v | bubble measured | formula | difference | peak in flight per rank | formula | |"
echo "|---|---:|---:|---:|---:|---:|---:|---|---|---|"
for p in 2 4; do
  for m in 4 8 16; do
    row "$p" --schedule gpipe --microbatches "$m" "$@"
    row "$p" --schedule 1f1b --microbatches "$m" "$@"
    row "$p" --schedule interleaved-1f1b --microbatches "$m" --chunks 2 "$@"
  done
done
