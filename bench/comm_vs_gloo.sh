#!/usr/bin/env bash
# comm_bench (ours and its raw-TCP ring anchor) and bench/comm_peer.py (PyTorch's
# Gloo) on one host, one after the other, ROUNDS times (on shared cores the
# loopback rate drifts between runs: each round's table is printed, the peer's
# row beside the comm_bench run just before it).
# Usage: bench/comm_vs_gloo.sh [BUILD_DIR] [NPROC] [ROUNDS] [MIN_KIB]   (env: PYTHON)
set -euo pipefail
build=${1:-build}
nproc=${2:-4}
rounds=${3:-2}
min_kib=${4:-16384}
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:?set PYTHON to the Python of the project environment (make bench does)}
ours=$(mktemp)
trap 'rm -f "$ours"' EXIT
for round in $(seq "$rounds"); do
  OMP_NUM_THREADS=1 "$build/zeroshard-run" --nproc-per-node "$nproc" -- "$build/bench/comm_bench" \
    --min-kib "$min_kib" > "$ours" 2>&1
  echo "round $round of $rounds: $(sed -n 's/^\[rank0\]: comm_bench: //p' "$ours")"
  OMP_NUM_THREADS=1 "$build/zeroshard-run" --nproc-per-node "$nproc" -- "$python" "$here/comm_peer.py" \
    --min-kib "$min_kib" --beside "$ours" 2>&1 | sed -n 's/^\[rank0\]: //p'
done
