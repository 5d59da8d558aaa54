#!/usr/bin/env bash
# Runs bench/zero3_bench in every mode, one after another, and prints two
# tables: the modes side by side at NPROC ranks, then ZeRO-3's peak RSS at 1, 2
# and NPROC ranks (how it falls with the model-state part).
# Usage: bench/zero3_bench.sh [BUILD_DIR] [NPROC] [extra args]
set -euo pipefail
build=${1:-build}
nproc=${2:-4}
shift $(( $# > 2 ? 2 : $# ))
row() {  # row NPROC ARGS...
  local n=$1
  shift
  "$build/zeroshard-run" --nproc-per-node "$n" -- "$build/bench/zero3_bench" "$@" 2>&1 | sed -n 's/^\[rank0\]: ROW //p'
}
header="| mode | ranks | parameters | step ms (median, slowest rank) | exposed comm ms (share of step; of it gathers) | peak RSS per rank (MiB) | model states per rank (MiB) |"
echo "$header"
echo "|---|---:|---:|---:|---:|---:|---:|"
for mode in dp zero2 zero3-nopf zero3; do
  row "$nproc" --mode "$mode" "$@"
done
row "$nproc" --mode zero3 --head-unit "$@"
echo
echo "$header"
echo "|---|---:|---:|---:|---:|---:|---:|"
for n in 1 2 "$nproc"; do
  row "$n" --mode zero3 "$@"
done
