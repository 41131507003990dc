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
# `swap`: idle Converse sessions swapped out of 8 slots and back (needs M3_SERVE_BIN).
# `snapshot`: Generate from a stored prefix against the whole prompt (needs M3_SERVE_BIN).
# `prefix`: time to first token of prompts sharing a 2048-token prefix, with and without
# prefix_cache (needs M3_SERVE_BIN; M3_SERVE_BACKEND=cpu M3_SERVE_MODEL=configs/models/tiny.json
# M3_PREFIX_LEN=256 try it on the CPU).
# `realtime` serves the same model with max_batch auto and runs `m3bench realtime` (Generate,
# then --duplex) at M3_RT_STREAMS / M3_RT_DUPLEX_STREAMS streams of 100 tokens/s, JSON under
# $OUT (scripts/plot_bench.py realtime plots them).
set -u -o pipefail
MODE=${1:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# For the modes that take M3_SERVE_BIN: $OUT, a scratch folder $D with the binaries linked
# in, and the random bf16 s2s-14l model written to $D/s2s.
prepare_model() {
  OUT=${OUT:-$PWD/device-out}
  mkdir -p "$OUT"
  D=$(mktemp -d)
  for b in m3make m3serve m3cli m3bench; do ln -s "$M3_SERVE_BIN/$b" "$D/$b"; done
  "$D/m3make" --config "$ROOT/${M3_SERVE_MODEL:-configs/models/s2s-14l.json}" --seed 1 --dtype bf16 --out "$D/s2s" \
      >"$OUT/make.log" 2>&1 || { cat "$OUT/make.log"; exit 1; }
}

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
  # Result files of a run with M3_SERVE_FLAGS carry a tag, so that two runs can share $OUT.
  TAG=$(echo "${M3_SERVE_FLAGS:-}" | tr -cs 'A-Za-z0-9' '_' | sed 's/^_*//; s/_*$//')
  TAG=${TAG:+_$TAG}
  D=$(mktemp -d)
  # M3_SERVE_BIN: a folder already holding the binaries (device_check.sh's bundle), whose
  # libraries are on LD_LIBRARY_PATH; otherwise srv.tgz is unpacked.
  if [[ -n ${M3_SERVE_BIN:-} ]]; then
    for b in m3make m3serve m3cli m3bench; do ln -s "$M3_SERVE_BIN/$b" "$D/$b"; done
  else
    tar xzf "$ROOT/.device/srv.tgz" -C "$D"
    export LD_LIBRARY_PATH=$D/lib
  fi
  "$D/m3make" --config "$ROOT/${M3_SERVE_MODEL:-configs/models/s2s-14l.json}" --seed 1 --dtype bf16 --out "$D/s2s" \
      >"$OUT/make.log" 2>&1 || { cat "$OUT/make.log"; exit 1; }
  # M3_SERVE_FLAGS: more m3serve flags (e.g. "--pipelined-steps false" for an A/B run).
  # shellcheck disable=SC2086
  BATCH=64
  [[ $MODE == realtime ]] && BATCH=auto
  "$D/m3serve" --backend "${M3_SERVE_BACKEND:-cuda}" --model "$D/s2s" --max-batch $BATCH --listen 127.0.0.1:50051 ${M3_SERVE_FLAGS:-} \
      --metrics-listen 127.0.0.1:9464 >"$OUT/serve$TAG.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do "$D/m3cli" health >/dev/null 2>&1 && break; sleep 0.5; done
  "$D/m3cli" health && "$D/m3cli" info
  "$D/m3cli" generate --ids 1,2,3 --max-new-tokens 24 --print ids
  grep -F "max_batch auto" "$OUT/serve$TAG.log"
  if [[ $MODE == realtime ]]; then
    "$D/m3bench" realtime --streams "${M3_RT_STREAMS:-256,512,1024,1280,1536,2048}" --rate 100 \
        --json "$OUT/realtime.json"
    "$D/m3bench" realtime --duplex --streams "${M3_RT_DUPLEX_STREAMS:-64,256,512,1024}" --rate 100 \
        --reply-tokens 200 --json "$OUT/realtime_duplex.json"
  else
  "$D/m3bench" serve --concurrency 64 --requests 256 --max-new-tokens 128 --json "$OUT/serve64$TAG.json"
  "$D/m3bench" serve --concurrency 16 --requests 64 --max-new-tokens 128 --json "$OUT/serve16$TAG.json"
  "$D/m3bench" serve --concurrency 1 --requests 4 --max-new-tokens 128 --json "$OUT/serve1$TAG.json"
  # M3_SERVE_PROMPT_LEN: long prompts too, alone and 16 at once (time to first token).
  if [[ -n ${M3_SERVE_PROMPT_LEN:-} ]]; then
    for c in 1 16; do
      "$D/m3bench" serve --concurrency $c --requests $((c * 4)) --prompt-len "$M3_SERVE_PROMPT_LEN" \
          --max-new-tokens 200 --json "$OUT/serve${c}_prompt$M3_SERVE_PROMPT_LEN$TAG.json"
    done
    # Mixed: 16 streams decoding, alone and while 8 prompts of that length arrive one after
    # another; their inter-token latency (p50, p99) side by side.
    "$D/m3bench" serve --concurrency 16 --requests 16 --max-new-tokens 3000 --json "$OUT/mixed_alone$TAG.json" >/dev/null
    "$D/m3bench" serve --concurrency 16 --requests 16 --max-new-tokens 3000 --json "$OUT/mixed_decoding$TAG.json" >/dev/null &
    decoding=$!
    sleep 0.3
    "$D/m3bench" serve --concurrency 1 --requests 8 --prompt-len "$M3_SERVE_PROMPT_LEN" --max-new-tokens 1 \
        --json "$OUT/mixed_prompts$TAG.json" >/dev/null
    wait $decoding
    python3 - "$OUT/mixed_alone$TAG.json" "$OUT/mixed_decoding$TAG.json" "$OUT/mixed_prompts$TAG.json" <<'PY'
import json, sys
alone, mixed, prompts = (json.load(open(p)) for p in sys.argv[1:])
itl = lambda d: d["inter_token_latency"]
print("mixed: 16 streams' inter-token latency p50/p99 ms: alone %.3f/%.3f, while prompts are read %.3f/%.3f"
      " (p99 ratio %.2f); the prompts' time to first token p50/p99 ms %.2f/%.2f" %
      (itl(alone)["p50_ms"], itl(alone)["p99_ms"], itl(mixed)["p50_ms"], itl(mixed)["p99_ms"],
       itl(mixed)["p99_ms"] / itl(alone)["p99_ms"], prompts["time_to_first_token"]["p50_ms"],
       prompts["time_to_first_token"]["p99_ms"]))
PY
  fi
  fi
  # Every series into the log folder (the histograms' buckets too); their sums and counts here.
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9464/metrics').read().decode())" \
    >"$OUT/metrics$TAG.txt"
  grep -E '^m3serve' "$OUT/metrics$TAG.txt" | grep -v _bucket
  kill -TERM "$server"
  wait "$server"
  echo "m3serve exit status: $?"
  tail -3 "$OUT/serve$TAG.log"
  ;;
swap)
  # Idle Converse sessions off the GPU: 100 sessions on 8 slots, each three turns 1.5 s
  # apart (each waits longer than session_swap_after_s between turns, so its state leaves
  # its slot and comes back), the sessions' starts 50 ms apart; then again with a slot for
  # every session and no swapping. Reports the swap-in histogram and whether every
  # session's replies are the same in both runs.
  prepare_model
  for mode in swap noswap; do
    if [[ $mode == swap ]]; then flags="--max-batch 8 --session-swap-after-s 0.2 --max-sessions 128 --queue-capacity 128"
    else flags="--max-batch 128 --session-swap-after-s 0"; fi
    # shellcheck disable=SC2086
    "$D/m3serve" --backend "${M3_SERVE_BACKEND:-cuda}" --model "$D/s2s" $flags ${M3_SERVE_FLAGS:-} --listen 127.0.0.1:50051 \
        --metrics-listen 127.0.0.1:9464 >"$OUT/serve_$mode.log" 2>&1 &
    server=$!
    for _ in $(seq 120); do "$D/m3cli" health >/dev/null 2>&1 && break; sleep 0.5; done
    mkdir -p "$D/$mode"
    for k in $(seq 100); do
      (
        sleep "$(awk -v k="$k" 'BEGIN {print k * 0.05}')"
        { echo "$k,2,3"; sleep 1.5; echo "4,$k,6"; sleep 1.5; echo "7,8,$k"; sleep 0.5; } |
          "$D/m3cli" converse --max-new-tokens 16 --print ids >"$D/$mode/$k.txt" 2>"$D/$mode/$k.err"
        echo $? >"$D/$mode/$k.rc"
      ) &
    done
    wait $(jobs -p | grep -v "^$server$") 2>/dev/null
    echo "$mode: sessions ok $(grep -lx 0 "$D/$mode"/*.rc | wc -l) of 100"
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9464/metrics').read().decode())" \
        >"$OUT/metrics_$mode.txt"
    kill -TERM "$server"
    wait "$server"
  done
  python3 - "$OUT/metrics_swap.txt" <<'PY'
import sys
lines = open(sys.argv[1]).read().splitlines()
def value(name):
    return next((float(l.split()[-1]) for l in lines if l.startswith(name + " ")), 0.0)
buckets = [(float(l.split('le="')[1].split('"')[0].replace("+Inf", "inf")), float(l.split()[-1]))
           for l in lines if l.startswith("m3serve_session_swap_in_seconds_bucket")]
n = value("m3serve_session_swap_in_seconds_count")
def quantile(q):
    return next((le for le, c in buckets if c >= q * n), float("nan"))
print("swap-ins %d, mean %.3f ms, p50 <= %.3f ms, p99 <= %.3f ms (histogram bounds)" %
      (n, 1e3 * value("m3serve_session_swap_in_seconds_sum") / max(n, 1), 1e3 * quantile(0.5), 1e3 * quantile(0.99)))
PY
  same=0
  for k in $(seq 100); do cmp -s "$D/swap/$k.txt" "$D/noswap/$k.txt" && same=$((same + 1)); done
  echo "replies the same with and without swapping: $same of 100 sessions"
  # A session's first turn is read before its state ever leaves its slot, so the first
  # turns' differences are the batch's own (steps of 8 rows against steps of up to 128
  # round differently in bf16), the yardstick for the later turns' differences.
  for turn in 1 2 3; do
    same=0
    for k in $(seq 100); do
      [[ "$(sed -n "${turn}p" "$D/swap/$k.txt")" == "$(sed -n "${turn}p" "$D/noswap/$k.txt")" ]] && same=$((same + 1))
    done
    echo "turn $turn replies the same with and without swapping: $same of 100"
  done
  ;;
snapshot)
  # A stored prefix on the GPU: Generate from a snapshot of the first 30 prompt ids plus
  # the last 10 against the whole 40-id prompt read from scratch (greedy, 32 new tokens),
  # with prompts read by decode steps, by the defaults, and every input by chunked prefill.
  prepare_model
  whole=$(seq -s, 1 40) prefix=$(seq -s, 1 30) rest=$(seq -s, 31 40)
  while IFS= read -r flags; do
    # shellcheck disable=SC2086
    "$D/m3serve" --backend cuda --model "$D/s2s" --max-batch 8 $flags --listen 127.0.0.1:50051 \
        --metrics-listen "" >"$OUT/serve_snapshot.log" 2>&1 &
    server=$!
    for _ in $(seq 120); do "$D/m3cli" health >/dev/null 2>&1 && break; sleep 0.5; done
    from_scratch=$("$D/m3cli" generate --ids "$whole" --max-new-tokens 32 --print ids 2>/dev/null)
    id=$("$D/m3cli" create-snapshot --ids "$prefix" | awk '{print $2}')
    from_snapshot=$("$D/m3cli" generate --prefix-snapshot-id "$id" --ids "$rest" --max-new-tokens 32 --print ids 2>/dev/null)
    verdict=DIFFERENT
    [[ -n $from_scratch && $from_scratch == "$from_snapshot" ]] && verdict=same
    echo "snapshot (${flags:-defaults}): prefix + rest gives the ${verdict} 32 tokens as the whole prompt"
    [[ $verdict == same ]] || echo "  scratch: $from_scratch"$'\n'"  from snapshot $id: $from_snapshot"
    kill -TERM "$server"
    wait "$server"
  done <<<"--cuda-prefill steps

--prefill-min-tokens 1"
  ;;
prefix)
  # The prefix cache on a shared prefix: 8 requests one after another, each the same
  # M3_PREFIX_LEN (2048) ids and then 64 of its own, one new token; the first reads the
  # whole prompt either way, the others only their own 64 ids with the cache.
  prepare_model
  for cache in false true; do
    "$D/m3serve" --backend "${M3_SERVE_BACKEND:-cuda}" --model "$D/s2s" --max-batch 8 --prefix-cache "$cache" \
        --listen 127.0.0.1:50051 --metrics-listen "" >"$OUT/serve_prefix_$cache.log" 2>&1 &
    server=$!
    for _ in $(seq 120); do "$D/m3cli" health >/dev/null 2>&1 && break; sleep 0.5; done
    "$D/m3bench" serve --concurrency 1 --requests 8 --prompt-len 64 --shared-prefix "${M3_PREFIX_LEN:-2048}" \
        --max-new-tokens 1 >"$OUT/bench_prefix_$cache.txt" 2>&1
    echo "prefix_cache $cache: $(grep -E '^(ok|time to first token)' "$OUT/bench_prefix_$cache.txt" | tr '\n' ' ')"
    kill -TERM "$server"
    wait "$server"
  done
  ;;
*)
  echo "usage: $0 pack [BUILD_DIR] | run | realtime | swap | snapshot | prefix" >&2
  exit 2
  ;;
esac
