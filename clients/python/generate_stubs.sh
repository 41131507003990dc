#!/usr/bin/env bash
# Generates m3serve's Python gRPC stubs (package m3serve_proto) from proto/m3serve.proto.
#   clients/python/generate_stubs.sh [OUT_DIR]    (default: beside this script, for pip install)
# Uses Debian's protoc (3.21) with grpc_python_plugin (package protobuf-compiler-grpc)
# where present, else grpcio-tools' protoc from the current Python. Not Debian's
# python3-grpc-tools: it bundles protoc 3.5, which cannot read proto3 `optional`.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
proto_dir=$(cd "$here/../../proto" && pwd)
out=${1:-$here}
mkdir -p "$out/m3serve_proto"
# The virtual path makes the stubs import each other as m3serve_proto.*.
args=(--proto_path="m3serve_proto=$proto_dir" --python_out="$out" --grpc_python_out="$out" m3serve_proto/m3serve.proto)
if command -v protoc >/dev/null && command -v grpc_python_plugin >/dev/null; then
  protoc --plugin=protoc-gen-grpc_python="$(command -v grpc_python_plugin)" "${args[@]}"
else
  python3 -m grpc_tools.protoc "${args[@]}"
fi
: >"$out/m3serve_proto/__init__.py"
echo "generated $out/m3serve_proto from $proto_dir/m3serve.proto"
