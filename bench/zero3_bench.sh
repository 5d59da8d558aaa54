#!/usr/bin/env bash
# Runs bench/zero3_bench in every mode, one after another, and prints one table.
# Usage: bench/zero3_bench.sh [BUILD_DIR] [NPROC] [extra args]
set -euo pipefail
build=${1:-build}
nproc=${2:-4}
shift $(( $# > 2 ? 2 : $# ))
echo "| mode | ranks | parameters | step ms (median, slowest rank) | exposed comm ms (share of step) | peak RSS per rank (MiB) | model states per rank (MiB) |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for mode in dp zero2 zero3-nopf zero3; do
  "$build/zeroshard-run" --nproc-per-node "$nproc" -- "$build/bench/zero3_bench" --mode "$mode" "$@" 2>&1 |
    sed -n 's/^\[rank0\]: ROW //p'
done
