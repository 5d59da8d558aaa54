#!/usr/bin/env bash
# Configures zeroshard against the torch wheel (ZS_TORCH=venv, a CUDA build) as a machine
# without the CUDA toolkit would, and as one with the toolkit at /usr/local/cuda but no nvcc
# on PATH (the README's fresh Debian 12 machine; cmake/find_nvcc.cmake):
#   1. toolkit present, nvcc off PATH: configure succeeds, CUDA/NCCL ON, and the CUDA
#      compiler is /usr/local/cuda/bin/nvcc;
#   2. toolkit hidden: configure succeeds, its line says CUDA/NCCL OFF, no CUDA toolkit,
#      CPU-only, and the build has no GPU path (no zeroshard_cuda, no ZS_WITH_CUDA=1);
#      with -DZS_WITH_CUDA=ON it fails, naming nvcc and the fix;
#   3. the tree of 1 reconfigured with the toolkit hidden: CPU-only (no cached CUDA compiler
#      or architectures hold it), then with the toolkit back: CUDA/NCCL ON again.
# Case 1 and 3 need a toolkit at /usr/local/cuda; without one only case 2 runs.
#
# Hiding: the script runs itself again in a private mount namespace (unshare --mount),
# where it binds an empty directory over the directory /usr/local/cuda resolves to. Every
# PATH entry holding an nvcc is dropped, an nvcc outside the toolkit in a directory CMake
# searches anyway (/usr/local/bin, /usr/bin: a wrapper script, say) is removed from an
# overlay mounted on that directory (the directory itself is not touched), and CUDACXX,
# CUDA_HOME, CUDA_PATH and CUDAToolkit_ROOT are unset. The mounts end with the namespace.
# Exit 77 (skipped) when no mount namespace can be made (unshare needs root or
# CAP_SYS_ADMIN; an unprivileged container has neither); exit 1 then under ZS_NO_SKIP=1.
#
# Usage: check_configure.sh CMAKE SOURCE_DIR PYTHON [GENERATOR]
set -u -o pipefail
if [ $# -lt 3 ]; then
  echo "usage: check_configure.sh CMAKE SOURCE_DIR PYTHON [GENERATOR]" >&2
  exit 2
fi
cmake=$1 src=$2 python=$3 generator=${4:-Ninja}

if [ "${ZS_CHECK_CONFIGURE_NS:-}" != 1 ]; then
  if ! unshare --mount --propagation private true 2>/dev/null; then
    why="cannot create a private mount namespace to hide /usr/local/cuda (unshare --mount needs root or CAP_SYS_ADMIN)"
    if [ "${ZS_NO_SKIP:-}" = 1 ]; then  # where every test must run (.ci/run)
      echo "FAIL: this test would be skipped ($why), and ZS_NO_SKIP=1 says this machine must run it"
      exit 1
    fi
    echo "SKIP: $why"
    exit 77
  fi
  ZS_CHECK_CONFIGURE_NS=1 exec unshare --mount --propagation private "$0" "$@"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/zs-check-configure.XXXXXX") || exit 1
toolkit=""
[ -e /usr/local/cuda ] && toolkit=$(readlink -f /usr/local/cuda)
hidden=0
overlays=()
cleanup() {
  [ $hidden -eq 1 ] && umount "$toolkit"
  for dir in "${overlays[@]}"; do umount "$dir"; done
  mountpoint -q "$work/overlay" && umount "$work/overlay"
  rm -rf "$work"
}
trap cleanup EXIT
mkdir "$work/empty" "$work/overlay"

# No nvcc reachable but through /usr/local/cuda. PATH without any directory that holds one;
# and none outside the toolkit where CMake looks beyond PATH (its system prefixes).
path=""
IFS=: read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do
  [ -n "$d" ] && [ ! -e "$d/nvcc" ] && path="${path:+$path:}$d"
done
for d in $(readlink -f "${dirs[@]}" /usr/local/bin /usr/bin /bin 2>/dev/null | sort -u); do
  [ -e "$d/nvcc" ] || continue
  [ -n "$toolkit" ] && case "$d/" in "$toolkit"/*) continue ;; esac
  if [ ${#overlays[@]} -eq 0 ]; then
    mount -t tmpfs zs-check-configure "$work/overlay" || { echo "check_configure: cannot mount a tmpfs"; exit 1; }
  fi
  n=${#overlays[@]}
  mkdir "$work/overlay/upper$n" "$work/overlay/work$n"
  mount -t overlay zs-check-configure -o "lowerdir=$d,upperdir=$work/overlay/upper$n,workdir=$work/overlay/work$n" "$d" ||
    { echo "check_configure: cannot mount an overlay on $d to hide $d/nvcc"; exit 1; }
  overlays=("$d" "${overlays[@]}")
  rm -f "$d/nvcc"
  echo "check_configure: $d/nvcc hidden (overlay)"
done
unset CUDACXX CUDA_HOME CUDA_PATH CUDAToolkit_ROOT
export PATH="$path"

status=0
fail() { echo "check_configure: FAIL: $*"; status=1; }

hide() {
  mount --bind "$work/empty" "$toolkit" || { echo "check_configure: cannot bind over $toolkit"; exit 1; }
  hidden=1
}
unhide() {
  umount "$toolkit" || { echo "check_configure: cannot unmount $toolkit"; exit 1; }
  hidden=0
}

# configure NAME BUILD_DIR [ARGS...]: runs cmake, keeps its log in $work/NAME.log, prints its
# zeroshard lines and returns cmake's exit status.
configure() {
  local name=$1 dir=$2
  shift 2
  local start=$SECONDS
  if [ -f "$dir/CMakeCache.txt" ]; then
    "$cmake" -S "$src" -B "$dir" "$@" >"$work/$name.log" 2>&1
  else
    "$cmake" -S "$src" -B "$dir" -G "$generator" -DCMAKE_BUILD_TYPE=Release -DZS_TORCH=venv \
      -DZS_PYTHON="$python" "$@" >"$work/$name.log" 2>&1
  fi
  local rc=$?
  echo "check_configure: $name: exit $rc after $((SECONDS - start)) s"
  grep "^-- zeroshard: LibTorch" "$work/$name.log" | sed 's/^/    /'
  if [ $rc -ne 0 ]; then
    grep -A8 "CMake Error" "$work/$name.log" | head -20 | sed 's/^/    /'
  fi
  return $rc
}

# expect_cpu_only NAME BUILD_DIR: the configure of NAME chose the CPU-only build for want of nvcc.
expect_cpu_only() {
  local name=$1 dir=$2
  grep -qE "^-- zeroshard: LibTorch .*CUDA/NCCL OFF: no CUDA toolkit \(no nvcc .*\): CPU-only build" "$work/$name.log" ||
    fail "$name: no '-- zeroshard: ... CUDA/NCCL OFF: no CUDA toolkit (...): CPU-only build' line"
  if grep -q "zeroshard_cuda\|ZS_WITH_CUDA=1" "$dir/build.ninja" "$dir"/Makefile 2>/dev/null; then
    fail "$name: the generated build still has the GPU path (zeroshard_cuda or ZS_WITH_CUDA=1)"
  fi
}

# expect_cuda NAME BUILD_DIR: the configure of NAME chose the GPU path with the toolkit's nvcc.
expect_cuda() {
  local name=$1 dir=$2
  grep -qE "^-- zeroshard: LibTorch .*CUDA/NCCL ON: nvcc " "$work/$name.log" ||
    fail "$name: no '-- zeroshard: ... CUDA/NCCL ON: nvcc ...' line"
  local compiler
  compiler=$(sed -n 's/^CMAKE_CUDA_COMPILER:[A-Z]*=//p' "$dir/CMakeCache.txt")
  [ "$(readlink -f "$compiler")" = "$(readlink -f /usr/local/cuda/bin/nvcc)" ] ||
    fail "$name: CMAKE_CUDA_COMPILER is '$compiler', expected /usr/local/cuda/bin/nvcc"
  grep -q "zeroshard_cuda" "$dir/build.ninja" "$dir"/Makefile 2>/dev/null ||
    fail "$name: the generated build has no zeroshard_cuda target"
}

have_toolkit=0
[ -n "$toolkit" ] && [ -x /usr/local/cuda/bin/nvcc ] && have_toolkit=1

if [ $have_toolkit -eq 1 ]; then
  echo "check_configure: 1. CUDA toolkit at /usr/local/cuda ($toolkit), no nvcc on PATH"
  if configure nopath "$work/gpu"; then expect_cuda nopath "$work/gpu"; else fail "nopath: configure failed"; fi
else
  echo "check_configure: no CUDA toolkit at /usr/local/cuda: only the configure without one runs"
fi

[ -n "$toolkit" ] && hide
echo "check_configure: 2. no CUDA toolkit${toolkit:+ ($toolkit hidden)}, no nvcc on PATH"
if configure hidden "$work/cpu"; then expect_cpu_only hidden "$work/cpu"; else fail "hidden: configure failed"; fi
if configure hidden_on "$work/cpu" -DZS_WITH_CUDA=ON; then
  fail "hidden_on: -DZS_WITH_CUDA=ON without a CUDA toolkit configured"
else
  grep -q "ZS_WITH_CUDA=ON asks for the GPU path, but no CUDA toolkit" "$work/hidden_on.log" &&
    grep -q "install the CUDA toolkit" "$work/hidden_on.log" ||
    fail "hidden_on: the error does not say that nvcc is missing and how to fix it"
fi

if [ $have_toolkit -eq 1 ]; then
  echo "check_configure: 3. the tree of 1 reconfigured, toolkit hidden, then back"
  if configure reconf_hidden "$work/gpu"; then
    expect_cpu_only reconf_hidden "$work/gpu"
  else
    fail "reconf_hidden: reconfigure without the toolkit failed"
  fi
  unhide
  if configure reconf_back "$work/gpu"; then
    expect_cuda reconf_back "$work/gpu"
  else
    fail "reconf_back: reconfigure with the toolkit back failed"
  fi
fi

[ $status -eq 0 ] && echo "check_configure: pass"
exit $status
