#!/usr/bin/env bash
# Sets up, builds and runs every test. GPU tests skip (and say so) where no GPU is present;
# without the CUDA toolkit they are not built (and it says that instead). The checkpoint
# exporter's tests (scripts.export.*) first make a virtual environment in the build tree with
# pip and scripts/requirements-export.txt (PyPI; no torch), kept while the pins stay the same.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
m3_install_packages
m3_build "$@"
cd "$M3_BUILD_DIR"
gpu_tests=$(ctest -N -L gpu | sed -n 's/^Total Tests: //p')
if [[ ${gpu_tests:-0} -eq 0 ]]; then
  echo "m3serve: built without CUDA (no nvcc found): the GPU tests are not built, so none run"
elif ! nvidia-smi -L >/dev/null 2>&1; then
  echo "m3serve: no GPU visible: the ${gpu_tests} GPU tests (ctest label 'gpu') will report Skipped"
fi
ctest --output-on-failure -j "$(nproc)" --timeout 600
