#!/usr/bin/env bash
# The GPU run (DESIGN.md section 11): builds zeroshard against the LibTorch of a
# machine with an NVIDIA GPU and no network, then runs the GPU tests and
# benchmarks as rows, each under its own time limit, printed as it finishes,
# with one table (markdown) for docs/performance.md at the end.
#
#   scripts/gpu-check.sh fetch [DIR]     on a Debian 12 machine with network: the Debian packages
#                                        the build needs (and the libraries they load) into
#                                        DIR/debs; prints the command lines for the GPU machine
#   scripts/gpu-check.sh build [DIR]     on the GPU machine: unpacks DIR/debs into build-gpu/deps,
#                                        configures and builds build-gpu/ against $PYTHON's torch
#                                        (the programs find the Debian libraries through their
#                                        RPATH), records the versions; incremental when built
#   scripts/gpu-check.sh check [ROW...]  on the GPU machine: runs the rows named (ROW=SECONDS sets
#                                        a row's time limit), every row when none is named,
#                                        'remaining' for those without a result on this machine
#   scripts/gpu-check.sh rows            lists the rows
#
# DIR defaults to .gpu-deps (git-ignored; the device tool carries it). The GPU
# machine needs an NVIDIA GPU and driver, Python with a CUDA torch (2.7+) and its
# nvidia-nccl wheel, nvcc, g++, CMake and ninja; compute-sanitizer for the
# sanitizer rows. Nothing there is changed outside this checkout (the GPU's
# compute mode is read, never set).
#
# Time: each invocation ends within GPU_CHECK_BUDGET_S (default 570) seconds of
# its start, or by GPU_CHECK_DEADLINE (seconds since the epoch) when that comes
# first, so that `build && check` in one 600-second command share one budget.
# A row runs under `timeout`: its own limit (120-300 s, `scripts/gpu-check.sh rows`;
# ROW=SECONDS overrides) cut to what is left of the budget; a row that would get
# less than a minute is reported "not run: time budget", and the command line that
# runs the rows left is printed after the table. The tests' communicators time out
# after ZS_TEST_TIMEOUT_S (default 60) seconds, so a hang costs a minute.
# Rehearsal: GPU_CHECK_REHEARSE=1 GPU_CHECK_BUILD=build PYTHON=.venv/bin/python
# scripts/gpu-check.sh check step-base step-large step-fit step-2ranks runs the step's
# rows on this machine's CPU with a tiny model (their detail says so), against a build
# made here; results go to BUILD/gpu-check-rehearsal.
# Other settings: PYTHON (default python3), JOBS (default: every core),
# GPU_CHECK_TARGETS (what `build` builds; default zs_tests zs_bench zeroshard-run
# bart_pretrain).
#
# Results: build-gpu/gpu-check/ holds every row's log, results.tsv (the latest
# result of each row on this machine) and info.txt (versions). When $OUT is set
# (the device tool's folder of files that come back), it receives
# gpu-check-table.md and gpu-check-logs.tgz (all of build-gpu/gpu-check), after
# every row and at exit. Exit status: 0 when every row that ran passed, 1 when
# one failed, 2 when the phase could not start.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here" || exit 2

# Runtime libraries of the packages below, beyond what every Linux has (libc,
# libstdc++, libgcc, zlib): HDF5 loads libcurl, which loads the rest.
packages=(
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libboost1.74-dev libcli11-dev nlohmann-json3-dev
  libhdf5-dev libhdf5-103-1 libsz2 libaec0 libxxhash-dev libxxhash0 libgtest-dev libprotobuf-dev libprotobuf32
  libcurl4 libnghttp2-14 librtmp1 libssh2-1 libpsl5 libldap-2.5-0 libsasl2-2 libsasl2-modules-db libdb5.3
  libbrotli1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libidn2-0
  libunistring2 libgnutls30 libhogweed6 libnettle8 libgmp10 libp11-kit0 libtasn1-6 libffi8 libssl3 libzstd1
)

# The rows, cheapest and most informative first: name|ranks|time limit (s)|what it checks.
catalogue=(
  "step-base|1|200|BART-base bf16 step, batch 8 x 512: zeroshard zero2/zero3 beside HF + DDP / FSDP2 (MFU against the spec and the measured peak, peak memory) and a Kineto trace of zero3's step"
  "step-large|1|200|the same for a BART-large-shaped model (12 + 12 layers, width 1024)"
  "step-fit|1|200|BART-large-shaped: the largest batch of 512 + 512 tokens that fits zero3 (64, 32, 16 tried), zero3 beside HF + DDP there"
  "step-2ranks|2|150|BART-base 8 x 512 on 2 ranks sharing the GPU (NCCL): zero2/zero3, their exposed communication"
  "kernel|1|180|CUDA AdamW kernel: bits equal the CPU kernel's, matches torch AdamW on the device"
  "nccl1|1|120|NCCL communicator, 1 rank: every op in 3 dtypes, block(), split/dup (NCCL_DEBUG=INFO)"
  "nccl2|2|180|NCCL collective tests, 2 ranks on one GPU (a host each: socket transport on lo)"
  "pingpong|2|180|NCCL send/recv ping-pong, 2 ranks, 1,000 messages of mixed sizes"
  "skip|2|180|NCCL watchdog names a rank that skips an operation, 2 ranks"
  "nccl3|3|240|NCCL collective tests, 3 ranks on one GPU"
  "oracle-nccl1|1|300|ZeRO-1/2/3 vs torch AdamW + CPU<->GPU checkpoints on cuda, NCCL, 1 rank (no collectives at 1 rank)"
  "oracle-nccl2|2|300|the same, 2 ranks on one GPU over NCCL"
  "staged2|2|300|the same, 2 ranks on one GPU, stage_through_host"
  "bart-pp2|2|240|bart_pretrain --pp 2 --device cuda --device-comm nccl, 20 steps, 2 ranks"
  "memcheck|1|300|compute-sanitizer memcheck: AdamW kernel tests (caching allocator off)"
  "racecheck|1|300|compute-sanitizer racecheck: AdamW kernel tests"
  "synccheck|1|300|compute-sanitizer synccheck: AdamW kernel tests"
  "staged3|3|300|the oracle tests, 3 ranks on one GPU, stage_through_host"
  "staged4|4|300|the oracle tests, 4 ranks on one GPU, stage_through_host"
  "sanitize-nccl|2|300|compute-sanitizer memcheck: NCCL collective and send/recv tests, 2 ranks (caching allocator off)"
  "sanitize-staged|2|300|compute-sanitizer memcheck: oracle tests, 2 ranks, stage_through_host (caching allocator off)"
  "multirank230|2|300|oracle and NCCL collective tests, 2 ranks on one host with NCCL_MULTI_RANK_GPU_ENABLE (NCCL 2.30+)"
  "optim|1|180|AdamW kernel GB/s vs a device copy and at::_fused_adamw_ (optim_bench --device cuda)"
  "bart60|1|300|bart_pretrain --device cuda, tiny, ZeRO-3, 60 steps with checkpoints, 1 rank"
)
# Rows whose purpose is NCCL traffic: they fail when their processes report no NCCL operation.
nccl_rows=" nccl1 nccl2 pingpong skip nccl3 oracle-nccl2 sanitize-nccl multirank230 "
# The commands that split the rows (docs/performance.md, "The GPU run"): the step's
# rows first (they need only zs_bench and zeroshard-run built), then the rest.
step_rows="step-base step-large step-fit step-2ranks"
first_rows="kernel nccl1 nccl2 pingpong skip nccl3 oracle-nccl1 oracle-nccl2 staged2 bart-pp2"
second_rows="memcheck racecheck synccheck staged3 staged4 sanitize-nccl sanitize-staged multirank230 optim bart60"

oracles='*ShardedAdamWStage*:*ShardedAdamWHybrid*:FullyShardHybrid.*:FullyShardDeferred*:FullyShard.MatchesAdamW*:FullyShardMixed.*:CheckpointDevice.*'
collectives='NcclCommunicator.*:NcclUniqueId.*'
kernels='AdamWCuda*'

python=${PYTHON:-python3}
build=${GPU_CHECK_BUILD:-build-gpu}
state=$build/gpu-check
rehearsal=""  # the step rows' detail starts with it
[ -z "${GPU_CHECK_REHEARSE:-}" ] || { state=$build/gpu-check-rehearsal; rehearsal="no GPU: a rehearsal on the CPU, tiny shapes; "; }
logs=$state/logs
arch=x86_64-linux-gnu
cores=$(nproc)
reserve=25  # seconds kept back at the end: a row's kill grace, the table and the archive
start=$(date +%s)
deadline=$((start + ${GPU_CHECK_BUDGET_S:-570}))
if [ -n "${GPU_CHECK_DEADLINE:-}" ] && [ "$GPU_CHECK_DEADLINE" -lt "$deadline" ]; then deadline=$GPU_CHECK_DEADLINE; fi

die() { echo "gpu-check: $*" >&2; exit 2; }
say() { echo "gpu-check: $*"; }
seconds_left() { echo $((deadline - reserve - $(date +%s))); }

# The device tool's command lines (docs/performance.md prints the same).
run_lines() {  # dir
  # shellcheck disable=SC2016  # expanded on the GPU machine
  local begin='export GPU_CHECK_DEADLINE=$(($(date +%s)+570)); scripts/gpu-check.sh build'
  [ "$1" = .gpu-deps ] || begin+=" $1"
  echo "Next, on the GPU machine (the device tool's run; each call carry: [\"$1\"], timeout_s: 600):"
  local step_begin="export GPU_CHECK_TARGETS='zs_bench zeroshard-run' ${begin#export }"
  echo "  1. $step_begin && scripts/gpu-check.sh check $step_rows"
  echo "  2. $begin && scripts/gpu-check.sh check $first_rows"
  echo "  3. $begin && scripts/gpu-check.sh check $second_rows"
  echo "  4. (rows reported \"not run: time budget\") the line the previous call printed after its table"
}

# ---------------------------------------------------------------------------------------------
# fetch

fetch_phase() {  # [dir]
  local dir=${1:-.gpu-deps}
  mkdir -p "$dir/debs" && rm -f "$dir"/debs/*.deb
  (cd "$dir/debs" && apt-get download "${packages[@]}") ||
    die "fetch: apt-get download failed (run it on Debian 12 with network)"
  say "fetch: $(find "$dir/debs" -name '*.deb' | wc -l) packages, $(du -sh "$dir/debs" | cut -f1), in $dir/debs"
  run_lines "$dir"
}

# ---------------------------------------------------------------------------------------------
# build

# The packages unpacked into one prefix (dpkg-deb where present; else Python reads
# the ar archive and its data.tar.*). Done again only when the set of packages changed.
unpack() {  # dir root
  local dir=$1 root=$2 list deb
  list=$(cd "$dir/debs" && ls ./*.deb)
  [ -f "$root/.unpacked" ] && [ "$(cat "$root/.unpacked")" = "$list" ] && return 0
  rm -rf "$root" && mkdir -p "$root"
  for deb in "$dir"/debs/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$root" || die "build: cannot unpack $deb"
    else
      "$python" - "$deb" "$root" <<'PY' || die "build: cannot unpack $deb"
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
        tarfile.open(fileobj=io.BytesIO(body)).extractall(root, **trusted)  # packages hold symlinks
    pos += 60 + size + (size & 1)
PY
    fi
  done
  echo "$list" >"$root/.unpacked"
}

# An absolute path to the Python without resolving its symlinks (a venv's python is one).
absolute_python() {
  local p
  p=$(command -v "$python") || die "no Python '$python' (set PYTHON)"
  case $p in /*) echo "$p" ;; *) echo "$(cd "$(dirname "$p")" && pwd)/$(basename "$p")" ;; esac
}

# RPATH, not RUNPATH (--disable-new-dtags): the loader applies an executable's
# RPATH to the libraries its libraries load too (libhdf5 -> libcurl -> libssh2 ...),
# which RUNPATH does not; nothing is added to LD_LIBRARY_PATH.
configure() {  # root libs
  local root=$1 libs=$2
  [ -f "$build/build.ninja" ] && return 0
  say "build: configuring $build"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZS_TORCH=venv -DZS_PYTHON="$(absolute_python)" \
    -DZS_WITH_CUDA=ON -DCMAKE_PREFIX_PATH="$root/usr" \
    -DHDF5_C_COMPILER_EXECUTABLE=HDF5_C_COMPILER_EXECUTABLE-NOTFOUND -DHDF5_C_INCLUDE_DIR="$root/usr/include/hdf5/serial" \
    -DHDF5_C_LIBRARY_hdf5="$root/usr/lib/$arch/hdf5/serial/libhdf5.so" \
    -DCMAKE_EXE_LINKER_FLAGS="-Wl,--disable-new-dtags -Wl,-rpath,$libs -Wl,-rpath-link,$libs" \
    >"$logs/configure.log" 2>&1 || { rm -f "$build/build.ninja"; tail -30 "$logs/configure.log"; die "build: configure failed (log: $logs/configure.log)"; }
}

compile() {  # targets...
  local limit t0 rc
  limit=$(seconds_left)
  [ "$limit" -ge 30 ] || die "build: not started, $limit s left of the time budget"
  say "build: $* (-j${JOBS:-$cores}, at most $limit s)"
  t0=$(date +%s)
  timeout -k 10 "$limit" cmake --build "$build" -j "${JOBS:-$cores}" --target "$@" >"$logs/build.log" 2>&1
  rc=$?
  echo "build: $(($(date +%s) - t0)) s, exit status $rc, targets $*" >>"$logs/build-times.txt"
  case $rc in
    0) say "build: done in $(($(date +%s) - t0)) s" ;;
    124 | 137) die "build: stopped by the time budget after $(($(date +%s) - t0)) s; call again (a warm machine keeps what was built)" ;;
    *) grep -m5 -B2 -A5 "error" "$logs/build.log"; die "build: failed (log: $logs/build.log)" ;;
  esac
}

# Every library of every program resolves, and the Debian ones come from the unpacked prefix.
check_libraries() {  # root programs...
  local root=$1 prog missing from
  shift
  for prog in "$@"; do
    [ -x "$prog" ] || continue
    ldd "$prog" >"$logs/ldd-$(basename "$prog").txt" 2>&1
    missing=$(grep "not found" "$logs/ldd-$(basename "$prog").txt" | awk '{print $1}' | tr '\n' ' ')
    [ -z "$missing" ] || die "build: $prog cannot load: $missing(RPATH: $(readelf -d "$prog" 2>/dev/null | grep -o 'R.*PATH.*'))"
    from=$(grep -c "=> $root/" "$logs/ldd-$(basename "$prog").txt")
    say "build: $prog loads $from libraries from $root through its RPATH"
  done
}

# Versions: torch, NCCL's headers, the libnccl.so.2 the programs load (its ncclGetVersion),
# torch's own NCCL, the compilers, the GPU and its compute mode.
nccl_version_of() {  # libnccl.so.2
  "$python" - "$1" <<'PY' 2>&1 | tail -1
import ctypes, sys
v = ctypes.c_int()
ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v))
print(f"{v.value // 10000}.{v.value // 100 % 100}.{v.value % 100}")
PY
}

record_versions() {
  local lib runtime=""
  lib=$(sed -n 's/^\s*libnccl\.so\.2 => \(\S*\).*/\1/p' "$logs/ldd-zs_tests.txt" 2>/dev/null | head -1)
  [ -z "$lib" ] || runtime=$(nccl_version_of "$lib")
  {
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "torch: $("$python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>&1)"
    echo "nccl-headers: $(sed -n 's/.*zeroshard: NCCL \([0-9.]*\).*/\1/p' "$logs/configure.log")"
    echo "nccl-runtime: ${runtime:-unknown} (${lib:-no libnccl.so.2 in ldd of zs_tests})"
    echo "nccl-torch: $("$python" -c 'import torch; print(".".join(map(str, torch.cuda.nccl.version())))' 2>&1 | tail -1)"
    echo "compilers: $(g++ --version | head -1); $("$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")" --version | tail -1); $(cmake --version | head -1)"
    echo "gpu: $(gpu_name)"
    echo "compute-mode: $(compute_mode)"
  } >"$state/info.txt"
  sed 's/^/gpu-check: build: /' "$state/info.txt"
}

gpu_name() {
  command -v nvidia-smi >/dev/null || { echo "none (no nvidia-smi)"; return; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1
}

compute_mode() {
  command -v nvidia-smi >/dev/null || { echo "unknown (no nvidia-smi)"; return; }
  nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>&1 | head -1
}

build_phase() {  # [dir]
  local dir=${1:-.gpu-deps} tool root libs targets
  [ -d "$dir/debs" ] || die "build: no packages in $dir/debs; run 'scripts/gpu-check.sh fetch $dir' on a Debian machine with network first"
  for tool in g++ cmake ninja; do command -v "$tool" >/dev/null || die "build: $tool is not on PATH"; done
  command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] ||
    die "build: no nvcc on PATH or in ${CUDA_HOME:-/usr/local/cuda}/bin"
  "$python" -c 'import torch' 2>/dev/null || die "build: $python cannot import torch (set PYTHON)"
  mkdir -p "$logs"
  trap pack EXIT
  root="$here/$build/deps"
  libs="$root/usr/lib/$arch:$root/lib/$arch:$root/usr/lib/$arch/hdf5/serial"
  unpack "$dir" "$root"
  configure "$root" "$libs"
  grep "^-- zeroshard" "$logs/configure.log"
  read -r -a targets <<<"${GPU_CHECK_TARGETS:-zs_tests zs_bench zeroshard-run bart_pretrain}"
  compile "${targets[@]}"
  check_libraries "$root" "$build/tests/zs_tests" "$build/bench/zs_bench" "$build/zeroshard-run" \
    "$build/examples/bart_pretrain" "$build/checkpoint/zeroshard-ckpt"
  record_versions
  say "build: ready; next: scripts/gpu-check.sh check [ROW...]"
}

# ---------------------------------------------------------------------------------------------
# check: running and judging rows

# How a row's processes start (the array 'via'): one process; n ranks under zeroshard-run;
# or n ranks each with its own NCCL_HOSTID, so that NCCL sees one host per rank and lets
# them share the GPU (before 2.30 it refuses two ranks with one bus id on one host), over
# its socket transport on lo.
# shellcheck disable=SC2016  # $RANK is the child's, set by zeroshard-run
launcher() {  # one|ranks|hosts ranks
  case $1 in
    one) via=() ;;
    ranks) via=("$build/zeroshard-run" --nproc-per-node "$2" --grace-period 5 --) ;;
    hosts) via=("$build/zeroshard-run" --nproc-per-node "$2" --grace-period 5 -- bash -c 'NCCL_HOSTID=zs-host-$RANK exec "$@"' _) ;;
  esac
}
shared_gpu_env=(ZS_TEST_NCCL_SHARED_GPU=1 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo
                NCCL_IB_DISABLE=1 NCCL_MAX_CTAS=2 NCCL_NVLS_ENABLE=0)

# Runs a command under the row's limit ($limit), output into the row's log ($log); returns its status.
timed() { timeout -k 15 "$limit" "$@" >"$log" 2>&1; }
timed_out() { [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; }

verdict() { status=$1; detail=$2; }

# gtest: FAIL on a failed test, a timeout, a non-zero exit, a test skipped (on a GPU a skip
# means the GPU path did not run), or no test at all.
judge_gtest() {  # rc ranks
  local rc=$1 ranks=$2 ok ran failed skipped why
  ok=$(grep -c '\[       OK \]' "$log")
  ran=$(sed -n 's/.*\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "$log" | awk '{s += $1} END {print s + 0}')
  failed=$(grep -o '\[  FAILED  \] [A-Za-z0-9_/]*\.[A-Za-z0-9_./]*' "$log" | cut -c14- | sort -u | head -4 | paste -sd ' ')
  skipped=$(grep -o '\[  SKIPPED \] [A-Za-z0-9_/]*\.[A-Za-z0-9_./]*' "$log" | cut -c14- | sort -u | head -4 | paste -sd ' ')
  if timed_out "$rc"; then
    verdict FAIL "timed out after $limit s ($ok test runs had passed${failed:+; failed: $failed})"
  elif [ -n "$failed" ] || [ "$rc" -ne 0 ]; then
    verdict FAIL "exit status $rc; failed: ${failed:-none named (the end of the log says why)}"
  elif [ -n "$skipped" ]; then
    why=$(grep -m1 -A1 'Skipped$' "$log" | tail -1 | sed 's/^\[rank[0-9]*\]: //')
    verdict FAIL "skipped on a GPU: $skipped ($why)"
  elif [ "$ran" -eq 0 ]; then
    verdict FAIL "no test matched the filter"
  else
    verdict pass "$ok test runs passed ($ranks rank$([ "$ranks" -gt 1 ] && echo s))"
  fi
}

# The NCCL operations the row's processes issued, from each zs_tests process's line at exit:
# "zs-test: NCCL operations issued: N (collectives C, point-to-point P)". A row meant to
# exercise NCCL fails with "0 NCCL ops" when the sum is 0 or a rank did not report.
count_nccl_ops() {  # row ranks
  local row=$1 ranks=$2 n c p k
  read -r n c p k < <(sed -n 's/.*zs-test: NCCL operations issued: \([0-9]*\) (collectives \([0-9]*\), point-to-point \([0-9]*\)).*/\1 \2 \3/p' "$log" |
                      awk '{n += $1; c += $2; p += $3; k++} END {print n + 0, c + 0, p + 0, k + 0}')
  detail+="; NCCL ops $n (collectives $c, point-to-point $p; reported by $k of $ranks ranks)"
  case $nccl_rows in *" $row "*) ;; *) return 0 ;; esac
  [ "$status" = pass ] || return 0
  if [ "$n" -eq 0 ]; then verdict FAIL "0 NCCL ops; $detail"; elif [ "$k" -lt "$ranks" ]; then
    verdict FAIL "a rank did not report its NCCL ops; $detail"; fi
}

# The oracle tests' measured error, always printed (pass or fail).
oracle_error() {
  local max mean
  max=$(grep -o 'difference from torch::optim::AdamW: \(max \)\{0,1\}[0-9.e+-]*' "$log" | grep -o '[0-9.e+-]*$' | sort -g | tail -1)
  mean=$(grep -o 'difference from torch::optim::AdamW: max [0-9.e+-]*, mean [0-9.e+-]*' "$log" | grep -o '[0-9.e+-]*$' | sort -g | tail -1)
  detail+="; relative difference from torch AdamW: max ${max:-not printed}, fully_shard mean ${mean:-not printed}"
}

# compute-sanitizer's summaries (one per process).
sanitizer_summary() {
  local lines
  lines=$(grep -o '\(ERROR\|RACECHECK\|SYNCCHECK\) SUMMARY: .*' "$log" | sort | uniq -c |
          awk '{n = $1; $1 = ""; printf "%s%s%s", sep, substr($0, 2), (n > 1 ? " (" n " processes)" : ""); sep = "; "}')
  detail+="; ${lines:-no compute-sanitizer summary}"
  [ -n "$lines" ] || verdict FAIL "$detail"
}

gtest_row() {  # row ranks filter one|ranks|hosts [env...]: the tests of the filter
  local row=$1 ranks=$2 filter=$3 via
  launcher "$4" "$ranks"
  shift 4
  timed env "$@" "${via[@]}" "$build/tests/zs_tests" --gtest_filter="$filter"
  judge_gtest $? "$ranks"
  count_nccl_ops "$row" "$ranks"
}

sanitizer_row() {  # row ranks tool filter one|ranks|hosts [env...]: the same under compute-sanitizer
  local row=$1 ranks=$2 tool=$3 filter=$4 via
  command -v compute-sanitizer >/dev/null || { verdict "not run" "no compute-sanitizer on PATH"; return; }
  launcher "$5" "$ranks"
  shift 5
  # API errors are not reported: NCCL's init asks for the attributes of each of its kernels,
  # and those without code for this GPU answer cudaErrorNoKernelImageForDevice (32 per process
  # in the first sanitize-nccl run, every test passing); zeroshard checks every CUDA call's
  # result itself, so a failed call of its own fails the test.
  timed env "$@" "${via[@]}" compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 3 \
    "$build/tests/zs_tests" --gtest_filter="$filter"
  judge_gtest $? "$ranks"
  sanitizer_summary
  count_nccl_ops "$row" "$ranks"
}

omp() { echo "OMP_NUM_THREADS=$((cores / $1 > 0 ? cores / $1 : 1))"; }

# ---------------------------------------------------------------------------------------------
# check: the rows (row_<name with - as _>; each sets status and detail)

row_kernel() { gtest_row kernel 1 "$kernels:AdamWDeviceMath*" one; }

row_nccl1() {
  gtest_row nccl1 1 'NcclCommunicator.*:NcclUniqueId.ExchangedThroughTheStoreToEveryRank' ranks \
    ZS_TEST_DEVICE=cuda NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV
}
row_nccl2() {
  gtest_row nccl2 2 "$collectives" hosts "${shared_gpu_env[@]}" "$(omp 2)" ZS_TEST_DEVICE=cuda \
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
}
row_nccl3() { gtest_row nccl3 3 "$collectives" hosts "${shared_gpu_env[@]}" "$(omp 3)" ZS_TEST_DEVICE=cuda; }
row_pingpong() { gtest_row pingpong 2 'NcclPointToPoint.*' hosts "${shared_gpu_env[@]}" "$(omp 2)" ZS_TEST_DEVICE=cuda; }
row_skip() { gtest_row skip 2 'NcclWatchdog.*' hosts "${shared_gpu_env[@]}" "$(omp 2)" ZS_TEST_DEVICE=cuda; }

row_oracle_nccl1() {
  gtest_row oracle-nccl1 1 "$oracles" ranks ZS_TEST_DEVICE=cuda ZS_TEST_COMM=nccl
  oracle_error
}
row_oracle_nccl2() {
  gtest_row oracle-nccl2 2 "$oracles" hosts "${shared_gpu_env[@]}" "$(omp 2)" ZS_TEST_DEVICE=cuda ZS_TEST_COMM=nccl
  oracle_error
}
staged_row() {  # ranks
  gtest_row "staged$1" "$1" "$oracles" ranks "$(omp "$1")" ZS_TEST_DEVICE=cuda ZS_TEST_COMM=staged
  oracle_error
}
row_staged2() { staged_row 2; }
row_staged3() { staged_row 3; }
row_staged4() { staged_row 4; }

row_memcheck() { sanitizer_row memcheck 1 memcheck "$kernels" one PYTORCH_NO_CUDA_MEMORY_CACHING=1; }
row_racecheck() { sanitizer_row racecheck 1 racecheck "$kernels" one; }
row_synccheck() { sanitizer_row synccheck 1 synccheck "$kernels" one; }
row_sanitize_staged() {
  sanitizer_row sanitize-staged 2 memcheck "$oracles" ranks PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$(omp 2)" \
    ZS_TEST_DEVICE=cuda ZS_TEST_COMM=staged
  oracle_error
}
row_sanitize_nccl() {
  sanitizer_row sanitize-nccl 2 memcheck 'NcclCommunicator.*:NcclPointToPoint.*' hosts PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "${shared_gpu_env[@]}" "$(omp 2)" ZS_TEST_DEVICE=cuda
}

# NCCL 2.30's own way to put several ranks of one host on one GPU (experimental in NCCL):
# no NCCL_HOSTID, so NCCL's P2P/SHM transports run.
row_multirank230() {
  local version
  version=$(sed -n 's/^nccl-runtime: \([0-9.]*\).*/\1/p' "$state/info.txt")
  if [ "$(printf '%s\n2.30\n' "${version:-0}" | sort -V | head -1)" != 2.30 ]; then
    verdict "not run" "NCCL ${version:-unknown} is loaded; several ranks per GPU on one host need 2.30+"
    return
  fi
  gtest_row multirank230 2 "NcclCommunicator.*:$oracles" ranks NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=2 \
    NCCL_NVLS_ENABLE=0 ZS_TEST_NCCL_SHARED_GPU=1 "$(omp 2)" ZS_TEST_DEVICE=cuda ZS_TEST_COMM=nccl
  oracle_error
}

# The rows that measure or train (optim_bench, the BART step, bart_pretrain):
# scripts/gpu-check-bench-rows.sh, read here so that they see the helpers above.
# shellcheck source=scripts/gpu-check-bench-rows.sh
. "$here/scripts/gpu-check-bench-rows.sh"

# ---------------------------------------------------------------------------------------------
# check: the loop, the results and the table

declare -A row_ranks row_limit row_what
row_names=()
read_catalogue() {
  local entry name ranks limit what
  for entry in "${catalogue[@]}"; do
    IFS='|' read -r name ranks limit what <<<"$entry"
    row_names+=("$name")
    row_ranks[$name]=$ranks
    row_limit[$name]=$limit
    row_what[$name]=$what
  done
}
read_catalogue

record() {  # row status seconds detail
  local clean=${4//$'\t'/ }
  clean=${clean//$'\n'/ }
  { grep -v "^$1	" "$state/results.tsv" 2>/dev/null; printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$clean"; } >"$state/results.tmp"
  mv "$state/results.tmp" "$state/results.tsv"
}

table() {
  local name status secs detail nccl gpu
  nccl=$(grep -m1 -o 'NCCL [0-9]*\.[0-9]*\.[0-9]* (compiled against [0-9.]*' "$logs/nccl1.log" 2>/dev/null)
  gpu=$(sed -n 's/^gpu: //p' "$state/info.txt")
  echo "GPU check, $(date -u +%Y-%m-%d), ${gpu:-GPU unknown}; compute mode ${mode:-$(sed -n 's/^compute-mode: //p' "$state/info.txt")};" \
       "torch $(sed -n 's/^torch: //p' "$state/info.txt"); NCCL headers $(sed -n 's/^nccl-headers: //p' "$state/info.txt")," \
       "runtime $(sed -n 's/^nccl-runtime: //p' "$state/info.txt")${nccl:+; the communicator logged: ${nccl})}"
  echo
  echo "| row | check | result | detail | s |"
  echo "|---|---|---|---|---:|"
  for name in "${row_names[@]}"; do
    IFS=$'\t' read -r _ status secs detail < <(grep "^$name	" "$state/results.tsv" 2>/dev/null) ||
      { status="never run"; secs=""; detail=""; }
    echo "| $name | ${row_what[$name]} | $status | ${detail//|/\\|} | $secs |"
  done
}

# The table and the logs into $OUT: after every row, and at exit.
pack() {
  [ -d "$state" ] || return 0
  table >"$state/table.md" 2>/dev/null
  [ -n "${OUT:-}" ] && [ -d "$OUT" ] || return 0
  cp "$state/table.md" "$OUT/gpu-check-table.md"
  tar czf "$OUT/gpu-check-logs.tgz.tmp" -C "$build" "${state##*/}" && mv "$OUT/gpu-check-logs.tgz.tmp" "$OUT/gpu-check-logs.tgz"
}

# Runs one row: its limit cut to the budget, or "not run" for the budget or the compute mode.
run_row() {  # name [limit]
  local name=$1 log=$logs/$1.log limit=${2:-${row_limit[$1]}} status detail t0
  local left
  left=$(seconds_left)
  [ "$left" -lt "$limit" ] && limit=$left
  t0=$(date +%s)
  if [ "$limit" -lt 60 ] && [ "$limit" -lt "${2:-${row_limit[$1]}}" ]; then
    verdict "not run" "time budget ($left s left)"
    not_run+=("$name")
  elif [ "${row_ranks[$name]}" -gt 1 ] && [ "${mode,,}" = exclusive_process ]; then
    verdict "not run" "compute mode ${mode}: one process per GPU (left as it is)"
  else
    say "$name: running (at most $limit s)"
    "row_${name//-/_}"
  fi
  [ "$status" = pass ] || [ "$status" = measured ] || [ "$status" = "not run" ] || failed=1
  # A row skipped for time keeps the result an earlier call recorded, if any.
  if [ "${#not_run[@]}" -eq 0 ] || [ "${not_run[-1]}" != "$name" ] || ! grep -q "^$name	\(pass\|FAIL\|measured\)	" "$state/results.tsv" 2>/dev/null; then
    record "$name" "$status" "$(($(date +%s) - t0))" "$detail"
  fi
  printf 'gpu-check: %-15s %-8s %4d s  %s\n' "$name" "$status" "$(($(date +%s) - t0))" "$detail"
  pack
}

gpu_present() {
  local why=""
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || why="nvidia-smi sees no GPU (or is not on PATH); "
  "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null ||
    why+="$("$python" -c 'import torch' 2>/dev/null && echo "torch.cuda.is_available() is False" ||
            echo "cannot import torch") for $python"
  [ -z "$why" ] || die "check: no GPU here: ${why%; }. 'check' runs on the GPU machine, after 'build'"
}

check_phase() {  # [row[=seconds]...]
  local arg name limit selected=() limits=()
  if [ -n "${GPU_CHECK_REHEARSE:-}" ]; then
    [ -x "$build/bench/zs_bench" ] || die "check: GPU_CHECK_REHEARSE: no $build/bench/zs_bench (set GPU_CHECK_BUILD)"
    mkdir -p "$state"
    echo "gpu: none (a rehearsal on the CPU)" >"$state/info.txt"
  else
    gpu_present
    { [ -x "$build/bench/zs_bench" ] && [ -f "$state/info.txt" ]; } ||
      die "check: no build in $build (a machine that went cold lost it); run 'scripts/gpu-check.sh build' first"
  fi
  for arg in "$@"; do
    name=${arg%%=*}
    limit=""
    [ "$name" = "$arg" ] || limit=${arg#*=}
    if [ "$name" = remaining ]; then
      for name in "${row_names[@]}"; do
        grep -q "^$name	\(pass\|FAIL\|measured\)	" "$state/results.tsv" 2>/dev/null || { selected+=("$name"); limits+=(""); }
      done
      continue
    fi
    [ -n "${row_limit[$name]:-}" ] || die "check: no row '$name'; the rows: ${row_names[*]}"
    [ -z "$limit" ] || [[ $limit =~ ^[1-9][0-9]*$ ]] || die "check: '$arg': a row's limit is whole seconds (ROW=SECONDS)"
    selected+=("$name")
    limits+=("$limit")
  done
  if [ $# -eq 0 ]; then selected=("${row_names[@]}"); fi
  mkdir -p "$logs"
  trap pack EXIT
  export ZS_TEST_TIMEOUT_S=${ZS_TEST_TIMEOUT_S:-60} NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  mode=$(compute_mode)
  sed 's/^/gpu-check: /' "$state/info.txt"
  say "compute mode now: $mode; ${#selected[@]} rows, $(seconds_left) s of the time budget"
  failed=0
  not_run=()
  local i
  for i in "${!selected[@]}"; do run_row "${selected[$i]}" "${limits[$i]:-}"; done
  echo
  table
  if [ ${#not_run[@]} -gt 0 ]; then
    echo
    echo "Not run for the time budget; next (carry the package folder again in case the machine went cold):"
    echo "  export GPU_CHECK_DEADLINE=\$((\$(date +%s)+570)); scripts/gpu-check.sh build && scripts/gpu-check.sh check ${not_run[*]}"
  fi
  return $failed
}

case ${1:-} in
  fetch) fetch_phase "${@:2}" ;;
  build) build_phase "${@:2}" ;;
  check) check_phase "${@:2}"; exit ;;
  rows) for name in "${row_names[@]}"; do printf '%-15s %s rank(s), %4s s  %s\n' "$name" "${row_ranks[$name]}" \
          "${row_limit[$name]}" "${row_what[$name]}"; done ;;
  *) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac
