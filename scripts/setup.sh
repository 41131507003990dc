#!/usr/bin/env bash
# Installs what the build needs (Debian 12 packages) when run as root, then configures
# and builds a Release tree in ${M3_BUILD_DIR:-build}. Sourced by serve.sh and test.sh.
set -euo pipefail

M3_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
M3_BUILD_DIR="${M3_BUILD_DIR:-$M3_ROOT/build}"

M3_PACKAGES=(
  build-essential cmake ninja-build pkg-config git python3 python3-venv python3-matplotlib
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libsentencepiece-dev sentencepiece
  libspdlog-dev prometheus-cpp-dev libyaml-cpp-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev
  python3-grpcio python3-protobuf openssl libssl-dev
  libxxhash-dev libhiredis-dev redis-server
)

m3_install_packages() {
  local missing=()
  for p in "${M3_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "m3serve: missing Debian packages: ${missing[*]}" >&2
    echo "m3serve: run as root, or: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "m3serve: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

m3_build() {
  # The CUDA toolkit is not a Debian package (Debian 12 ships CUDA 11); use it where installed.
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  if command -v nvcc >/dev/null 2>&1; then
    echo "m3serve: building with CUDA ($(nvcc --version | tail -n1))"
  else
    echo "m3serve: no nvcc found: building the CPU engine only"
  fi
  cmake -S "$M3_ROOT" -B "$M3_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
  cmake --build "$M3_BUILD_DIR" -j "$(nproc)"
}
