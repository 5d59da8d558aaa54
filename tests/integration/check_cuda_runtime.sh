#!/usr/bin/env bash
# Fails unless each binary we link uses the one CUDA runtime LibTorch uses.
#
# LibTorch's CUDA build loads the torch wheel's libcudart.so.N (nvidia-cuda-runtime,
# found through libtorch_cuda's RUNPATH). A binary of ours must neither carry a static
# copy of the runtime (CMake links cudart_static by default; cmake/cuda.cmake asks for the
# shared one) nor make the process load another libcudart.so.N first, such as the CUDA
# toolkit's, whose version differs from the one LibTorch was built against.
# For each binary:
#   - it defines no CUDA runtime API function (cuda*, __cuda*: a static libcudart);
#   - it loads at most one libcudart, and when it links libtorch_cuda, the same file
#     that libtorch_cuda.so loads on its own (ldd of both).
# Usage: check_cuda_runtime.sh BINARY...
set -u -o pipefail
status=0
fail() { echo "check_cuda_runtime: $*"; status=1; }

for bin in "$@"; do
  [ -f "$bin" ] || { fail "$bin does not exist"; continue; }
  symbols=$(nm --defined-only "$bin") || { fail "nm failed on $bin"; continue; }
  defined=$(grep -E ' [A-Za-z] (cuda[A-Z][A-Za-z0-9_]*|__cuda[A-Za-z0-9_]+)$' <<< "$symbols")
  if [ -n "$defined" ]; then
    fail "$bin defines $(wc -l <<< "$defined") CUDA runtime symbols (a static libcudart), e.g.:"
    head -3 <<< "$defined"
  fi

  libs=$(ldd "$bin") || { fail "ldd failed on $bin"; continue; }
  cudart=$(grep -E '^\s*libcudart\.so' <<< "$libs" | awk '{print $3}')
  [ "$(grep -c . <<< "$cudart")" -le 1 ] || fail "$bin loads $(grep -c . <<< "$cudart") CUDA runtimes: $(echo $cudart)"
  torch_cuda=$(awk '$1 == "libtorch_cuda.so" {print $3}' <<< "$libs")
  [ -n "$torch_cuda" ] || continue
  [ -n "$cudart" ] || { fail "$bin links $torch_cuda but ldd shows no libcudart"; continue; }
  torch_cudart=$(ldd "$torch_cuda" | grep -E '^\s*libcudart\.so' | awk '{print $3}') ||
    { fail "ldd failed on $torch_cuda"; continue; }
  if [ "$(readlink -f "$cudart")" != "$(readlink -f "$torch_cudart")" ]; then
    fail "$bin loads $cudart, but $torch_cuda on its own loads $torch_cudart: LibTorch would run on" \
         "a CUDA runtime other than its wheel's"
  fi
done
[ $status -eq 0 ] && echo "check_cuda_runtime: $# binaries, no static CUDA runtime, one libcudart: LibTorch's"
exit $status
