#!/usr/bin/env bash
# Installs what zeroshard needs to build, test and run:
#   1. Debian packages (the compiler, CMake, the libraries, Debian's LibTorch 1.13);
#   2. the project's Python environment at VENV_DIR, from PyPI with the exact pins of
#      scripts/requirements.txt: LibTorch 2.x (the torch wheel) and the tests' oracles.
# Idempotent: when everything is present it changes nothing and exits 0.
# Uses sudo when not root.
# Usage: scripts/install-deps.sh VENV_DIR [venv|system]
#   With `system` (a build against Debian's LibTorch), a Python environment that
#   cannot be installed is a warning instead of an error.
set -euo pipefail

venv=${1:?usage: scripts/install-deps.sh VENV_DIR [venv|system]}
torch=${2:-venv}
here=$(cd "$(dirname "$0")" && pwd)
requirements="$here/requirements.txt"

packages=(
  # toolchain
  g++ make cmake ninja-build ccache pkg-config git
  # Debian's LibTorch 1.13 (CPU, with c10d; `make test TORCH=system`) and a fast BLAS
  # for it: it calls the system BLAS, and the reference BLAS makes every matmul ~17x slower.
  libtorch-dev libopenblas0-openmp
  # communication, checkpoints, runtime
  libhdf5-dev libboost-dev libspdlog-dev libfmt-dev
  libcli11-dev nlohmann-json3-dev libxxhash-dev
  # TensorBoard's event files: protobuf messages (libprotobuf's wire format)
  libprotobuf-dev
  # the BART trainer's corpus inputs: JSON lines, gzip and zstd shards (zstd's CLI makes the tests' shards)
  libsimdjson-dev zlib1g-dev libzstd-dev zstd
  # the durable checkpoint tier: S3 over libcurl (SigV4), its XML answers, HTTPS's CA certificates,
  # uploads' Content-MD5 (OpenSSL's libcrypto)
  libcurl4-openssl-dev libpugixml-dev ca-certificates libssl-dev
  # the S3 store of the tests: curl signs its readiness probe (tests/checkpoint/s3_store.py)
  curl
  # tests and benchmarks (xxhash's CLI is an independent oracle; binutils' nm checks symbols)
  libgtest-dev libgmock-dev libbenchmark-dev xxhash binutils
  # the multi-host tests' cluster of network namespaces (scripts/cluster.sh: ip, tc; unshare, nsenter)
  iproute2 util-linux
  # the replica groups' coordinator: etcd 3.4, spoken to over its v3 HTTP/JSON gateway (the tests
  # start their own members on 127.0.0.1 or on the cluster's hosts)
  etcd-server
  # the Python environment, and h5py/numpy for the tests' Python oracles when it cannot be made
  python3 python3-venv python3-h5py python3-numpy
  # loss-curve PNGs of training runs (zeroshard::plot_metrics)
  gnuplot-nox
  # make demo's corpus: 2.6 MB of short, varied English text (/usr/share/games/fortunes)
  fortunes
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install-deps: not root and no sudo; install as root: apt-get install ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The Python environment: a copy of the requirements it was made from marks it complete.
stamp="$venv/.zeroshard-requirements"
if [ -x "$venv/bin/python" ] && cmp -s "$requirements" "$stamp"; then
  exit 0
fi
echo "install-deps: installing the Python environment in $venv (torch and the test oracles, from PyPI)"
log="$venv.install.log"
if ! { /usr/bin/python3 -m venv "$venv" &&
       "$venv/bin/python" -m pip install --disable-pip-version-check -q --progress-bar off \
         -r "$requirements"; } >"$log" 2>&1; then
  cause=$(grep -m1 -E "Could not find|NewConnectionError|Temporary failure|Network is unreachable|ERROR" "$log" || tail -n1 "$log")
  if [ "$torch" = system ]; then
    echo "install-deps: warning: the Python environment could not be installed from PyPI ($cause; see $log);" \
         "the build uses Debian's LibTorch and the tests that need the environment are not registered" >&2
    exit 0
  fi
  echo "install-deps: the Python environment could not be installed from PyPI ($cause; see $log)." \
       "Without PyPI, build against Debian's LibTorch 1.13: make test TORCH=system" >&2
  exit 1
fi
cp "$requirements" "$stamp"
rm -f "$log"
