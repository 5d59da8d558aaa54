#!/usr/bin/env bash
# Runs bench/zero3_bench (C++: dp, zero2, zero3 without and with prefetch) and
# its PyTorch peer bench/zero3_bench.py (FSDP2 fully_shard, reshard after
# forward, without and with explicit prefetch) on the same model and batch, one
# after another, and prints two tables: the modes side by side at NPROC ranks,
# then ZeRO-3's and FSDP2's peak RSS at 1, 2 and NPROC ranks (how it falls with
# the model-state part).
# Usage: bench/zero3_bench.sh [BUILD_DIR] [NPROC] [extra args for both]
set -euo pipefail
build=${1:-build}
nproc=${2:-4}
shift $(( $# > 2 ? 2 : $# ))
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:?set PYTHON to the Python of the project environment (make bench does)}
ours() {  # ours NPROC ARGS...
  local n=$1
  shift
  "$build/zeroshard-run" --nproc-per-node "$n" -- "$build/bench/zero3_bench" "$@" 2>&1 | sed -n 's/^\[rank0\]: ROW //p'
}
peer() {  # peer NPROC ARGS...
  local n=$1
  shift
  "$build/zeroshard-run" --nproc-per-node "$n" -- "$python" "$here/zero3_bench.py" "$@" 2>&1 | sed -n 's/^\[rank0\]: ROW //p'
}
header() {
  echo "| stack and mode | ranks | parameters | step ms (median, slowest rank) | exposed comm ms (share of step; of it gathers) | peak RSS per rank (MiB) | model states per rank (MiB) | MiB sent per rank per step |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|"
}
header
for mode in dp zero2 zero3-nopf zero3; do
  ours "$nproc" --mode "$mode" "$@"
done
ours "$nproc" --mode zero3 --head-unit "$@"
for mode in fsdp2 fsdp2-prefetch; do
  peer "$nproc" --mode "$mode" "$@"
done
peer "$nproc" --mode fsdp2-prefetch --head-unit "$@"
echo
header
for n in 1 2 "$nproc"; do
  ours "$n" --mode zero3 "$@"
  peer "$n" --mode fsdp2-prefetch "$@"
done
