#!/usr/bin/env bash
# Installs every Debian package zeroshard needs to build, test and run.
# Idempotent: when all packages are present it changes nothing and exits 0.
# Uses sudo when not run as root. Usage: scripts/install-deps.sh
set -euo pipefail

packages=(
  # toolchain
  g++ make cmake ccache pkg-config git
  # LibTorch (CPU, with c10d) and a fast BLAS for it: Debian's LibTorch calls the
  # system BLAS, and the default reference BLAS makes every matmul ~17x slower.
  libtorch-dev libopenblas0-openmp
  # communication, checkpoints, runtime
  libgloo-dev libhdf5-dev libboost-dev libspdlog-dev libfmt-dev
  libcli11-dev nlohmann-json3-dev libxxhash-dev
  # tests and benchmarks (xxhash's CLI and h5py are independent oracles)
  libgtest-dev libgmock-dev libbenchmark-dev xxhash python3 python3-h5py python3-numpy
  # the anchor of bench/zero_vs_ddp: PyTorch's own DDP + ZeroRedundancyOptimizer
  python3-torch
  # loss-curve PNGs of training runs (zeroshard::plot_metrics)
  gnuplot-nox
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: not root and no sudo; install as root: apt-get install ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
