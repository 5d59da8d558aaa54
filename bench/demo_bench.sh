#!/usr/bin/env bash
# make demo as it ships: scripts/demo.sh at its full 2000 steps on 2 ranks, checked end to end by
# tests/bart/check_demo.py (the preemption, restart and resume, the summary, loss.png) with the
# README's denoising accuracies as floors (85% of the unmasked tokens reproduced, 6% of the masked
# ones recovered; an untrained or half-trained model reaches neither). `make test` runs the same
# check at 200 steps, without the floors. Prints the run's numbers and its wall time.
# Usage: bench/demo_bench.sh [BUILD_DIR]
set -euo pipefail
build=${1:-build}
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:?set PYTHON to the Python of the project environment (make bench does)}
start=$(date +%s.%N)
"$python" "$here/../tests/bart/check_demo.py" "$here/.." "$build" 2000 | tail -2
"$python" -c "import sys; print(f'demo: 2000 steps checked in {float(sys.argv[2]) - float(sys.argv[1]):.0f} s')" \
  "$start" "$(date +%s.%N)"
