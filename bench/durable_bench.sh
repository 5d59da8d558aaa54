#!/usr/bin/env bash
# The durable tier against its peer, through the same local S3 store in one run:
# tests/checkpoint/s3_store.py starts SeaweedFS (on 127.0.0.1), then
# bench/ckpt_bench --durable (zeroshard: a save until committed in the store, the
# async stall, a load on an empty disk, and the client's raw ceiling) and
# bench/ckpt_peer.py --fsspec (PyTorch DCP through FsspecWriter/FsspecReader and
# s3fs) run on the same state at the same world size; one table.
# Then a replaced host's start (bench/ckpt_resume.py --durable), in a second table.
# Usage: bench/durable_bench.sh [BUILD_DIR] [NPROC] [extra args for both, e.g. --layers 12 --repeats 3]
set -euo pipefail
build=${1:-build}
nproc=${2:-2}
shift $(( $# > 2 ? 2 : $# ))
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:?set PYTHON to the Python of the project environment (make bench does)}
run="$build/zeroshard-run --nproc-per-node $nproc --"
rows='s/^\[rank0\]: \(ROW \|ckpt\)/\1/p'

echo "| operation | time | throughput | relative |"
echo "|---|---:|---:|---:|"
"$python" "$here/../tests/checkpoint/s3_store.py" -- \
  $run "$build/bench/ckpt_bench" --dir "$build/durable_bench" --durable "s3://ckpt/bench" "$@" \
  --then $run "$python" "$here/ckpt_peer.py" --dir "$build/durable_peer" --fsspec "s3://ckpt/bench-peer" "$@" \
  2>&1 | sed -n "$rows" | sed 's/^ROW //'

# A replaced host: bench/ckpt_resume.py --durable (a preemption made durable, the disk then lost,
# the run started again on the empty disk), 50M parameters at the same world size.
echo
echo "| run | stop: saved, durable, exited (s) | start on an empty disk: launch to first step (s) | slowest rank's copy of its own file (s) | start beyond the copy (s) |"
echo "|---|---:|---:|---:|---:|"
"$python" "$here/../tests/checkpoint/s3_store.py" -- \
  "$python" "$here/ckpt_resume.py" "$build" --nproc "$nproc" --durable "s3://ckpt/resume" --repeats 3 2>&1 |
  sed -n 's/^ROW //p; /^median: /p'
