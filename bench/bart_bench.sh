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
# MFU is given twice: against the GPU's dense bf16 peak from its data sheet (the
# figure the field cites: 989 TF/s for H100 and H200 SXM; SPEC_TFLOPS overrides,
# "-" where the device is not in the list below or is a CPU) and against the
# matmul peak measured now.
# MODES (default "dp zero2 zero3") and PEER_MODES (default "ddp fsdp2") choose the rows
# (empty: none). With PROFILE_DIR, each mode's rank 0 traces one more step after the
# timed ones into PROFILE_DIR/MODE-trace.json (LibTorch's profiler for zeroshard,
# torch.profiler for the peers) and prints its top kernels and device busy time
# (PROFILE lines, on stderr). NCCL_HOST_PER_RANK=1 gives each rank an NCCL_HOSTID of
# its own, so that NCCL lets ranks share one GPU.
# Usage: bench/bart_bench.sh [BUILD_DIR] [NPROC] [extra bart_bench args]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
nproc=${2:-4}
shift $(( $# > 2 ? 2 : $# ))
peak=$("$build/bench/bart_bench" --mode peak "$@" | sed -n 's/^ROW peak //p')
echo "matmul peak (GEMM of the run's precision on its device; every core on the CPU; measured now): $peak GFLOP/s"
spec=${SPEC_TFLOPS:-}
if [ -z "$spec" ] && [[ " $* " == *" --device cuda "* ]] && command -v nvidia-smi >/dev/null; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null || true)
  case $gpu in  # dense bf16 tensor-core TF/s, from the vendor's data sheets
    *H200*|*GH200*|*"H100 SXM"*|*"H100 80GB HBM3"*) spec=989 ;;
    *"H100 NVL"*) spec=835 ;;
    *H100*) spec=756 ;;
    *B200*) spec=2250 ;;
    *A100*) spec=312 ;;
    *L40S*) spec=362 ;;
  esac
  echo "device: ${gpu:-unknown}; its dense bf16 peak: ${spec:-not in the list} TF/s"
fi
echo
echo "| mode | ranks | parameters | step s (median, slowest rank) | target tokens/s | MFU (spec peak) | MFU (measured peak) | exposed comm s (share) | peak memory per rank (MiB; RSS on CPU, allocated on GPU) | model states per rank (MiB) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
# $6 of a ROW: model TFLOP/s (6 x parameters x tokens/s)
mfu='function mfu(tf) { return spec == "" ? "-" : sprintf("%.1f%%", 100 * tf / spec) }'
profile() { [ -z "${PROFILE_DIR:-}" ] || echo "--profile $PROFILE_DIR/$1-trace.json"; }
# shellcheck disable=SC2016  # $RANK is the rank's, set by zeroshard-run
each=(); [ -z "${NCCL_HOST_PER_RANK:-}" ] || each=(bash -c 'NCCL_HOSTID=zs-host-$RANK exec "$@"' _)
for mode in ${MODES-dp zero2 zero3}; do
  # shellcheck disable=SC2046  # profile's words
  "$build/zeroshard-run" --nproc-per-node "$nproc" -- "${each[@]}" "$build/bench/bart_bench" --mode "$mode" "$@" $(profile "$mode") 2>&1 |
    sed -n 's/^\[rank0\]: ROW //p; s/^\[rank0\]: PROFILE /PROFILE '"$mode"' /p' |
    awk -v peak="$peak" -v spec="$spec" "$mfu"'
         /^PROFILE/ { print > "/dev/stderr"; next }
         { printf "| %s | %d | %.1fM | %.4f | %.0f | %s | %.1f%% | %.3f (%.0f%%) | %d | %d |\n",
           $1, $2, $3 / 1e6, $4, $5, mfu($6), 100 * $6 * 1000 / peak, $7, 100 * $7 / $4, $8, $9 }'
done
if [ -n "${PEER_PYTHON:-}" ]; then
  for mode in ${PEER_MODES-ddp fsdp2}; do
    # A peer that fails is a row that says so (its output on stderr); zeroshard's rows stand.
    # shellcheck disable=SC2046  # profile's words
    if ! out=$("$build/zeroshard-run" --nproc-per-node "$nproc" -- "${each[@]}" "$PEER_PYTHON" "$here/bart_peer.py" --mode "$mode" \
               "$@" $(profile "peer-$mode") 2>&1); then
      echo "| peer-$mode | $nproc | failed (its output went to stderr) | | | | | | | |"
      printf '%s\n' "$out" | tail -20 >&2
      continue
    fi
    printf '%s\n' "$out" | sed -n 's/^\[rank0\]: PEER //p' | sed 's/^/peer-'"$mode"': /' >&2
    printf '%s\n' "$out" | sed -n 's/^\[rank0\]: PROFILE /PROFILE peer-'"$mode"' /p' >&2
    printf '%s\n' "$out" | sed -n 's/^\[rank0\]: ROW //p' |
      awk -v peak="$peak" -v spec="$spec" "$mfu"'
           { printf "| %s | %d | %.1fM | %.4f | %.0f | %s | %.1f%% | - | %d | - |\n",
             $1, $2, $3 / 1e6, $4, $5, mfu($6), 100 * $6 * 1000 / peak, $7 }'
  done
fi
