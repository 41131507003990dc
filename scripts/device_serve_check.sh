#!/usr/bin/env bash
# m3serve end to end on the lent GPU machine (device tool), which has the NVIDIA driver but
# no gRPC, spdlog or prometheus-cpp: the server binaries travel with the shared libraries
# they need (glibc and libstdc++ excepted: the machine's own are newer).
#   here:           scripts/device_serve_check.sh pack [BUILD_DIR]   -> .device/srv.tgz
#   on the machine: scripts/device_serve_check.sh run                (device run, carry .device)
# `run` writes a random bf16 s2s-14l model, serves it on the CUDA backend, checks health,
# info and one Generate with m3cli, runs `m3bench serve` at concurrency 64, 16 and 1 (64:
# the engine's split two-chain step), scrapes
# /metrics, then stops the server with SIGTERM and reports its exit status.
# M3_SERVE_BACKEND=cpu runs the same on the CPU engine (to try the script without a GPU).
# `realtime` serves the same model with max_batch auto and runs `m3bench realtime` (Generate,
# then --duplex) at M3_RT_STREAMS / M3_RT_DUPLEX_STREAMS streams of 100 tokens/s, JSON under
# $OUT (scripts/plot_bench.py realtime plots them).
set -u -o pipefail
MODE=${1:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

case $MODE in
pack)
  BUILD=${2:-$ROOT/build}
  STAGE=$(mktemp -d)
  mkdir -p "$STAGE/lib"
  for b in server/m3serve server/m3cli server/m3bench model/m3make; do
    cp "$BUILD/$b" "$STAGE/" || { echo "missing $BUILD/$b (build the server with CUDA first)"; exit 1; }
  done
  cp "$BUILD/server/libm3_spm.so" "$STAGE/lib/"
  for b in "$STAGE"/m3*; do ldd "$b"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
    grep -vE '/(libc|libm|libstdc\+\+|libgcc_s)\.so' | while read -r lib; do cp -L "$lib" "$STAGE/lib/"; done
  mkdir -p "$ROOT/.device"
  tar czf "$ROOT/.device/srv.tgz" -C "$STAGE" .
  rm -rf "$STAGE"
  ls -la "$ROOT/.device/srv.tgz"
  ;;
run | realtime)
  OUT=${OUT:-$PWD/device-out}
  mkdir -p "$OUT"
  D=$(mktemp -d)
  tar xzf "$ROOT/.device/srv.tgz" -C "$D"
  export LD_LIBRARY_PATH=$D/lib
  "$D/m3make" --config "$ROOT/configs/models/s2s-14l.json" --seed 1 --dtype bf16 --out "$D/s2s" \
      >"$OUT/make.log" 2>&1 || { cat "$OUT/make.log"; exit 1; }
  # M3_SERVE_FLAGS: more m3serve flags (e.g. "--pipelined-steps false" for an A/B run).
  # shellcheck disable=SC2086
  BATCH=64
  [[ $MODE == realtime ]] && BATCH=auto
  "$D/m3serve" --backend "${M3_SERVE_BACKEND:-cuda}" --model "$D/s2s" --max-batch $BATCH --listen 127.0.0.1:50051 ${M3_SERVE_FLAGS:-} \
      --metrics-listen 127.0.0.1:9464 >"$OUT/serve.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do "$D/m3cli" health >/dev/null 2>&1 && break; sleep 0.5; done
  "$D/m3cli" health && "$D/m3cli" info
  "$D/m3cli" generate --ids 1,2,3 --max-new-tokens 24 --print ids
  grep -F "max_batch auto" "$OUT/serve.log"
  if [[ $MODE == realtime ]]; then
    "$D/m3bench" realtime --streams "${M3_RT_STREAMS:-256,512,1024,1280,1536,2048}" --rate 100 \
        --json "$OUT/realtime.json"
    "$D/m3bench" realtime --duplex --streams "${M3_RT_DUPLEX_STREAMS:-64,256,512,1024}" --rate 100 \
        --reply-tokens 200 --json "$OUT/realtime_duplex.json"
  else
  "$D/m3bench" serve --concurrency 64 --requests 256 --max-new-tokens 128 --json "$OUT/serve64.json"
  "$D/m3bench" serve --concurrency 16 --requests 64 --max-new-tokens 128 --json "$OUT/serve16.json"
  "$D/m3bench" serve --concurrency 1 --requests 4 --max-new-tokens 128 --json "$OUT/serve1.json"
  fi
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9464/metrics').read().decode())" |
    grep -E '^m3serve' | grep -v _bucket
  kill -TERM "$server"
  wait "$server"
  echo "m3serve exit status: $?"
  tail -3 "$OUT/serve.log"
  ;;
*)
  echo "usage: $0 pack [BUILD_DIR] | run | realtime" >&2
  exit 2
  ;;
esac
