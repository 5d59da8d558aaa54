#!/usr/bin/env bash
# BART training step under plain data parallelism, ZeRO-2 and ZeRO-3 on NPROC
# ranks, beside this machine's measured matmul peak, in one run. Extra
# arguments go to every bart_bench (the peak too): --device cuda --precision bf16
# measures the GPU against its bf16 GEMM peak.
# MFU = 6 * parameters * target tokens/s / peak (with source length = target
# length, 6N per target token counts the encoder and decoder work of the pair).
# With PEER_PYTHON set (the Python of an environment with torch and transformers),
# PyTorch's peer runs the same step after them (bench/bart_peer.py: Hugging Face's
# BartForConditionalGeneration under DDP and under FSDP2), with the same arguments
# (a --config of tiny, base or large). The peer's rows leave exposed communication
# and model states unmeasured ("-").
# Usage: bench/bart_bench.sh [BUILD_DIR] [NPROC] [extra bart_bench args]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
nproc=${2:-4}
shift $(( $# > 2 ? 2 : $# ))
peak=$("$build/bench/bart_bench" --mode peak "$@" | sed -n 's/^ROW peak //p')
echo "matmul peak (GEMM of the run's precision on its device; every core on the CPU; measured now): $peak GFLOP/s"
echo
echo "| mode | ranks | parameters | step s (median, slowest rank) | target tokens/s | MFU | exposed comm s (share) | peak memory per rank (MiB; RSS on CPU, allocated on GPU) | model states per rank (MiB) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
for mode in dp zero2 zero3; do
  "$build/zeroshard-run" --nproc-per-node "$nproc" -- "$build/bench/bart_bench" --mode "$mode" "$@" 2>&1 |
    sed -n 's/^\[rank0\]: ROW //p' |
    awk -v peak="$peak" '{ printf "| %s | %d | %.1fM | %.3f | %.0f | %.1f%% | %.3f (%.0f%%) | %d | %d |\n",
                           $1, $2, $3 / 1e6, $4, $5, 100 * $6 * 1000 / peak, $7, 100 * $7 / $4, $8, $9 }'
done
if [ -n "${PEER_PYTHON:-}" ]; then
  for mode in ddp fsdp2; do
    # A peer that fails is a row that says so (its output on stderr); zeroshard's rows stand.
    if ! out=$("$build/zeroshard-run" --nproc-per-node "$nproc" -- "$PEER_PYTHON" "$here/bart_peer.py" --mode "$mode" \
               "$@" 2>&1); then
      echo "| peer-$mode | $nproc | failed (its output went to stderr) | | | | | | |"
      printf '%s\n' "$out" | tail -20 >&2
      continue
    fi
    printf '%s\n' "$out" | sed -n 's/^\[rank0\]: ROW //p' |
      awk -v peak="$peak" '{ printf "| %s | %d | %.1fM | %.3f | %.0f | %.1f%% | - | %d | - |\n",
                             $1, $2, $3 / 1e6, $4, $5, 100 * $6 * 1000 / peak, $7 }'
  done
fi
