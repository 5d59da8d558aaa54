#!/usr/bin/env bash
# Runs bench/zero_vs_ddp (C++: dp, zero1, zero2) and bench/zero_vs_ddp.py
# (PyTorch: ddp, ddp_zero) on the same model and batch, one after another, and
# prints one table. Usage: bench/zero_vs_ddp.sh [BUILD_DIR] [NPROC] [extra args for both]
set -euo pipefail
build=${1:-build}
nproc=${2:-4}
shift $(( $# > 2 ? 2 : $# ))
here=$(cd "$(dirname "$0")" && pwd)
run="$build/zeroshard-run --nproc-per-node $nproc --"
python=${PYTHON:?set PYTHON to the Python of the project environment (make bench does)}

echo "| stack | mode | ranks | parameters | step ms (median, slowest rank) | tokens/s | peak RSS per rank (MiB) | model states per rank (MiB) | MiB sent per rank per step |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|"
for mode in dp zero1 zero2; do
  $run "$build/bench/zero_vs_ddp" --mode "$mode" "$@" 2>&1 | sed -n 's/^\[rank0\]: ROW //p'
done
for mode in ddp ddp_zero fsdp2_noreshard; do
  $run "$python" "$here/zero_vs_ddp.py" --mode "$mode" "$@" 2>&1 | sed -n 's/^\[rank0\]: ROW //p'
done
