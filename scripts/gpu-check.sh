#!/usr/bin/env bash
# The GPU run (DESIGN.md section 10): builds zeroshard against the LibTorch of a
# machine with an NVIDIA GPU and no network, runs the GPU tests and benchmarks,
# and prints one table (markdown) for docs/performance.md.
#
#   scripts/gpu-check.sh fetch [DIR]   on a Debian 12 machine with network: the Debian
#                                      packages the build needs, with the libraries they
#                                      load, downloaded into DIR/debs (~20 MB)
#   scripts/gpu-check.sh [DIR]         on the GPU machine: unpacks DIR/debs into DIR/root,
#                                      builds the GPU targets in build-gpu/ against the torch
#                                      of $PYTHON (default python3), runs the checks
#
# DIR defaults to .gpu-deps (git-ignored). The GPU machine needs: an NVIDIA GPU and
# driver, Python with a CUDA torch (2.7+, C++ headers and cmake config inside) and
# its nvidia-nccl wheel, nvcc, g++, CMake and ninja; compute-sanitizer for the
# memcheck row (skipped without it). Exit status: 0 when every check passed.
# Environment: PYTHON, JOBS (default: every core), CHECK_RANKS (default "2 3 4":
# world sizes of the staged multi-rank oracle tests on one GPU).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here" || exit 2

# Runtime libraries of the packages below, beyond what every Linux has (libc,
# libstdc++, libgcc, zlib): HDF5 loads libcurl, which loads the rest.
packages=(
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libboost1.74-dev libcli11-dev nlohmann-json3-dev
  libhdf5-dev libhdf5-103-1 libsz2 libaec0 libxxhash-dev libxxhash0 libgtest-dev
  libcurl4 libnghttp2-14 librtmp1 libssh2-1 libpsl5 libldap-2.5-0 libsasl2-2 libsasl2-modules-db libdb5.3
  libbrotli1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libidn2-0
  libunistring2 libgnutls30 libhogweed6 libnettle8 libgmp10 libp11-kit0 libtasn1-6 libffi8 libssl3 libzstd1
)

if [ "${1:-}" = fetch ]; then
  dir=${2:-.gpu-deps}
  mkdir -p "$dir/debs"
  (cd "$dir/debs" && apt-get download "${packages[@]}") || {
    echo "gpu-check fetch: apt-get download failed (run on Debian 12 with network)" >&2
    exit 1
  }
  echo "gpu-check fetch: $(ls "$dir/debs" | wc -l) packages, $(du -sh "$dir/debs" | cut -f1), in $dir/debs"
  exit 0
fi

dir=${1:-.gpu-deps}
python=${PYTHON:-python3}
jobs=${JOBS:-$(nproc)}
ranks=${CHECK_RANKS:-2 3 4}
build="build-gpu"
logs=$build/gpu-check-logs
arch=x86_64-linux-gnu

die() { echo "gpu-check: $*" >&2; exit 2; }
[ -d "$dir/debs" ] || die "no packages in $dir/debs; run 'scripts/gpu-check.sh fetch $dir' on a Debian machine with network first"
root="$(cd "$dir" && pwd)/root"
"$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null ||
  die "$python has no torch that sees a GPU (set PYTHON)"
for tool in nvcc g++ cmake ninja; do command -v "$tool" >/dev/null || die "$tool is not on PATH"; done

# 1. Unpack the packages into a prefix (dpkg-deb where present; else Python reads
#    the ar archive and its data.tar.*).
if [ ! -f "$root/.unpacked" ]; then
  rm -rf "$root" && mkdir -p "$root"
  for deb in "$dir"/debs/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$root" || die "cannot unpack $deb"
    else
      "$python" - "$deb" "$root" <<'PY' || die "cannot unpack $deb"
import io, sys, tarfile
deb, root = sys.argv[1], sys.argv[2]
data = open(deb, "rb").read()
assert data[:8] == b"!<arch>\n", "not an ar archive"
pos = 8
while pos < len(data):
    name = data[pos:pos + 16].decode().strip().rstrip("/")
    size = int(data[pos + 48:pos + 58].decode().strip())
    body = data[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
        tarfile.open(fileobj=io.BytesIO(body)).extractall(root, **trusted)  # packages hold absolute symlinks
    pos += 60 + size + (size & 1)
PY
    fi
  done
  touch "$root/.unpacked"
fi
libs="$root/usr/lib/$arch:$root/lib/$arch:$root/usr/lib/$arch/hdf5/serial"

# 2. Configure and build only what the checks run.
mkdir -p "$logs"
echo "gpu-check: configuring $build against $("$python" -c 'import torch; print("torch", torch.__version__)')"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZS_TORCH=venv -DZS_PYTHON="$(command -v "$python")" \
  -DZS_WITH_CUDA=ON -DCMAKE_PREFIX_PATH="$root/usr" \
  -DHDF5_C_COMPILER_EXECUTABLE=HDF5_C_COMPILER_EXECUTABLE-NOTFOUND -DHDF5_C_INCLUDE_DIR="$root/usr/include/hdf5/serial" -DHDF5_C_LIBRARY_hdf5="$root/usr/lib/$arch/hdf5/serial/libhdf5.so" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$libs" >"$logs/configure.log" 2>&1 ||
  { tail -30 "$logs/configure.log"; die "configure failed (log: $logs/configure.log)"; }
grep "^-- zeroshard" "$logs/configure.log"
echo "gpu-check: building (-j$jobs)"
cmake --build "$build" -j "$jobs" --target zs_tests zs_bench zeroshard-run bart_pretrain >"$logs/build.log" 2>&1 ||
  { grep -m5 -B2 -A5 "error" "$logs/build.log"; die "build failed (log: $logs/build.log)"; }
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# 3. The checks: each appends a row; a failure is recorded, the rest still run.
rows=()
failed=0
row() { rows+=("| $1 | $2 | $3 |"); [ "$2" = pass ] || [ "$2" = measured ] || [ "$2" = skipped ] || failed=1; }
tests="$build/tests/zs_tests"
launch() { "$build/zeroshard-run" --nproc-per-node "$1" --grace-period 5 -- "${@:2}"; }
# The largest "difference from torch::optim::AdamW" a test log printed.
worst() { grep -o "difference from torch::optim::AdamW: max [0-9.e+-]*\|difference from torch::optim::AdamW: [0-9.e+-]*" "$1" |
          grep -o "[0-9.e+-]*$" | sort -g | tail -1; }
gtest_row() {  # name log status
  local passed
  passed=$(grep -c "\[       OK \]" "$2")
  if [ "$3" -eq 0 ]; then row "$1" pass "$passed tests${4:+; $4}"; else
    row "$1" FAIL "$(grep -m3 -o "\[  FAILED  \] [A-Za-z0-9_./]*" "$2" | sort -u | tr '\n' ' ')(log: $2)"; fi
}

echo "gpu-check: CUDA AdamW kernel tests"
"$tests" --gtest_filter='AdamWCuda*:AdamWDeviceMath*' >"$logs/kernel.log" 2>&1
gtest_row "CUDA AdamW kernel: bits equal the CPU kernel's, matches torch AdamW" "$logs/kernel.log" $?

if command -v compute-sanitizer >/dev/null; then
  echo "gpu-check: compute-sanitizer memcheck"
  compute-sanitizer --tool memcheck --error-exitcode 3 "$tests" --gtest_filter='AdamWCuda*' >"$logs/memcheck.log" 2>&1
  status=$?
  summary=$(grep -m1 "ERROR SUMMARY" "$logs/memcheck.log")
  if [ $status -eq 0 ]; then row "compute-sanitizer memcheck, AdamW kernels" pass "$summary"; else
    row "compute-sanitizer memcheck, AdamW kernels" FAIL "$summary (log: $logs/memcheck.log)"; fi
else
  row "compute-sanitizer memcheck, AdamW kernels" skipped "no compute-sanitizer on PATH"
fi

echo "gpu-check: NCCL communicator at world size 1"
launch 1 "$tests" --gtest_filter='Nccl*' >"$logs/nccl.log" 2>&1
gtest_row "NCCL communicator, world size 1: every op, block(), split/dup, bytes" "$logs/nccl.log" $?

oracles='*ShardedAdamWStage*:FullyShard.MatchesAdamW*:FullyShardMixed.*:CheckpointDevice.*'
echo "gpu-check: ZeRO-1/2/3 and checkpoints on cuda with NCCL, 1 rank"
ZS_TEST_DEVICE=cuda ZS_TEST_COMM=nccl launch 1 "$tests" --gtest_filter="$oracles" >"$logs/oracle-nccl-1.log" 2>&1
gtest_row "ZeRO-1/2/3 vs torch AdamW + CPU<->GPU checkpoints, NCCL, 1 rank" "$logs/oracle-nccl-1.log" $? \
  "max relative difference $(worst "$logs/oracle-nccl-1.log")"
for n in $ranks; do
  echo "gpu-check: the same at $n ranks on one GPU, staged through host memory"
  ZS_TEST_DEVICE=cuda ZS_TEST_COMM=staged launch "$n" "$tests" --gtest_filter="$oracles" >"$logs/oracle-staged-$n.log" 2>&1
  gtest_row "the same, $n ranks on one GPU (stage_through_host)" "$logs/oracle-staged-$n.log" $? \
    "max relative difference $(worst "$logs/oracle-staged-$n.log")"
done
nccl_version=$(sed -n 's/.*zeroshard: NCCL \([0-9.]*\).*/\1/p' "$logs/configure.log")
if [ "$(printf '%s\n2.30\n' "$nccl_version" | sort -V | head -1)" = 2.30 ]; then
  echo "gpu-check: the same at 2 ranks on one GPU with NCCL_MULTI_RANK_GPU_ENABLE (NCCL $nccl_version)"
  NCCL_MULTI_RANK_GPU_ENABLE=1 ZS_TEST_DEVICE=cuda ZS_TEST_COMM=nccl launch 2 "$tests" --gtest_filter="$oracles" \
    >"$logs/oracle-nccl-2.log" 2>&1
  gtest_row "the same, 2 ranks on one GPU, NCCL $nccl_version multi-rank" "$logs/oracle-nccl-2.log" $? \
    "max relative difference $(worst "$logs/oracle-nccl-2.log")"
else
  row "the same, 2 ranks on one GPU through NCCL" skipped "NCCL $nccl_version; several ranks per GPU need 2.30+"
fi

echo "gpu-check: optim_bench --device cuda"
if "$build/bench/optim_bench" --device cuda >"$logs/optim_bench.log" 2>&1; then
  while IFS= read -r line; do
    row "AdamW GB/s vs device copy: $(echo "$line" | cut -d'|' -f3,4 | sed 's/ *| */ /g')" measured \
        "$(echo "$line" | cut -d'|' -f5-7 | sed 's/^ *//; s/ *| */ ms, /; s/ *| */ GB\/s, /; s/ *$//')"
  done < <(grep "^ROW | cuda" "$logs/optim_bench.log")
else
  row "AdamW GB/s vs device copy" FAIL "optim_bench failed (log: $logs/optim_bench.log)"
fi

echo "gpu-check: BART-base training step, bf16 weights, 1 GPU"
if bench/bart_bench.sh "$build" 1 --device cuda --precision bf16 --config base --batch 8 --src-len 512 --tgt-len 512 \
     --steps 5 --warmup 2 >"$logs/bart_bench.log" 2>&1; then
  echo "$(grep -m1 "matmul peak" "$logs/bart_bench.log")" >"$logs/bart_peak.txt"
  while IFS= read -r line; do
    mode=$(echo "$line" | cut -d'|' -f2 | tr -d ' ')
    row "BART-base step, $mode, batch 8 x 512 tokens" measured \
        "$(echo "$line" | awk -F'|' '{printf "%s s/step, %s target tokens/s, MFU %s, peak memory %s MiB", $5, $6, $7, $9}' | tr -s ' ')"
  done < <(grep "^| \(dp\|zero2\|zero3\) " "$logs/bart_bench.log")
else
  row "BART-base step" FAIL "bart_bench failed (log: $logs/bart_bench.log)"
fi

echo "gpu-check: bart_pretrain --device cuda (tiny, 60 steps, this repository's docs as text)"
rm -rf "$build/gpu-bart-run"
if launch 1 "$build/examples/bart_pretrain" --device cuda --config tiny --data docs --run-dir "$build/gpu-bart-run" \
     --max-steps 60 --global-batch 16 --lr 3e-3 --warmup-steps 6 --eval-every 30 --save-every 30 --no-plot \
     >"$logs/bart_pretrain.log" 2>&1; then
  row "bart_pretrain --device cuda, ZeRO-3, 60 steps" pass "$(grep -m1 "val loss" "$logs/bart_pretrain.log" | sed 's/^\[rank0\]: //')"
else
  row "bart_pretrain --device cuda" FAIL "exit status $? (log: $logs/bart_pretrain.log)"
fi

# 4. The table.
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
echo
echo "GPU check, $(date -u +%Y-%m-%d), $gpu; $("$python" -c 'import torch; print("torch", torch.__version__)'), NCCL $nccl_version"
[ -f "$logs/bart_peak.txt" ] && cat "$logs/bart_peak.txt"
echo
echo "| check | result | detail |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $failed
