#!/usr/bin/env bash
# Sets up, builds and serves. With no --model, m3serve generates and serves a small demo
# model. Extra arguments go to m3serve (m3serve --help lists them).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
m3_install_packages
m3_build
exec "$M3_BUILD_DIR/server/m3serve" --config "$M3_ROOT/configs/server.yaml" "$@"
