#!/usr/bin/env bash
# Runs bench/ckpt_bench (zeroshard's sharded HDF5 checkpoints) and its PyTorch
# peer bench/ckpt_peer.py (torch.distributed.checkpoint: save, async_save, load)
# on the same state at the same world size, one after another, each beside its
# own dd anchor, and prints one table.
# Usage: bench/ckpt_bench.sh [BUILD_DIR] [NPROC] [extra args for both]
set -euo pipefail
build=${1:-build}
nproc=${2:-4}
shift $(( $# > 2 ? 2 : $# ))
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:?set PYTHON to the Python of the project environment (make bench does)}
run="$build/zeroshard-run --nproc-per-node $nproc --"

echo "| operation | time | throughput | relative |"
echo "|---|---:|---:|---:|"
$run "$build/bench/ckpt_bench" --dir "$build/ckpt_bench" "$@" 2>&1 | sed -n 's/^\[rank0\]: ROW //p'
$run "$python" "$here/ckpt_peer.py" --dir "$build/ckpt_peer" "$@" 2>&1 | sed -n 's/^\[rank0\]: ROW //p'
