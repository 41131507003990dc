#!/usr/bin/env bash
# Sets up, builds and runs every test. GPU tests skip (and say so) where no GPU is present.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
m3_install_packages
m3_build "$@"
cd "$M3_BUILD_DIR"
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "m3serve: no GPU visible: the GPU tests (ctest label 'gpu') will report Skipped"
fi
ctest --output-on-failure -j "$(nproc)" --timeout 600
