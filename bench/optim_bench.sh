#!/usr/bin/env bash
# Runs bench/optim_bench (the ceiling, zeroshard's fused AdamW, torch::optim::AdamW,
# STREAM triad) and its PyTorch peer bench/optim_peer.py (AdamW fused=True and
# foreach=True) at each thread count, one after another, and prints one table;
# "of the ceiling" divides each row's bandwidth by the ceiling's at the same
# threads and size.
# Usage: bench/optim_bench.sh [BUILD_DIR] [THREADS, e.g. "1 2"] [extra args for both]
set -euo pipefail
build=${1:-build}
threads=${2:-1 2}
shift $(( $# > 2 ? 2 : $# ))
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:?set PYTHON to the Python of the project environment (make bench does)}

echo "| threads | elements | stack | ms | GB/s | of the ceiling |"
echo "|---:|---:|---|---:|---:|---:|"
for t in $threads; do
  "$build/bench/optim_bench" --threads "$t" "$@"
  "$python" "$here/optim_peer.py" --threads "$t" "$@"
done | awk -F' [|] ' '
  /^ROW/ {
    key = $2 "," $3
    if ($4 ~ /^ceiling/) ceiling[key] = $6
    ratio = ($6 + 0 > 0 && ceiling[key] + 0 > 0 && $4 !~ /triad/) ? sprintf("%.2f", $6 / ceiling[key]) : "-"
    sub(/ [|]$/, "", $6)
    printf "| %s | %s | %s | %s | %s | %s |\n", $2, $3, $4, $5, $6, ratio
  }'
