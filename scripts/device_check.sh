#!/usr/bin/env bash
# Every GPU check in one or two device calls. The lent machine has the NVIDIA driver, nvcc
# and cmake but no gRPC, spdlog or prometheus-cpp, and the carried tree is limited to
# 64 MiB, so the binaries are built here and travel as one zstd archive with the shared
# libraries they need (glibc, libstdc++ and CUDA's excepted: the machine's own are newer). The
# binaries are nearly alike (the kernels are linked into each), so a long-window zstd
# keeps the archive small.
#   here:           scripts/device_check.sh pack [BUILD_DIR]    -> .device/ (carry .device)
#   on the machine: scripts/device_check.sh MODE...  (modes run in the order given)
# Modes:
#   tests    every GPU gtest binary whole, then each m3check command ctest labels gpu
#   ab       decode A/B of OLD (device_ab_check.sh's OLD_REF build, when packed) and this tree
#   prefill  m3bench prefill, chunked and stepped, s2s-14l bf16 (PREFILL_LENS, PREFILL_BATCHES;
#            PREFILL_FLAG_SETS: ';'-separated sets of flags, a chunked run each)
#   prefill_trace  each kernel's time in a chunked prefill (CUPTI), 2048 tokens at batch 1, 8
#                  (PREFILL_TRACE_RUNS: other LENxBATCH pairs; PREFILL_TRACE_FLAGS: more m3bench
#                  flags, such as --cuda-pdl false for each kernel's time without overlap;
#                  PREFILL_TRACE_VARIANTS=1: each packed m3bench_VARIANT's too)
#   prefill_ncu    Nsight Compute on one launch of each chunked-prefill kernel
#   prefill_sass   Nsight Compute source counters of the chunk kernels: per-SASS-instruction
#                  stall samples as CSV (prefill_sass_*.csv.gz) for scripts/sass_hotspots.py
#   decode_ncu     Nsight Compute on the decode step's recurrence (mimo_step_*) at
#                  NCU_BATCHES (default 64 512), once for each ';'-separated set of m3bench
#                  flags in NCU_FLAG_SETS (kernels matching NCU_REGEX, after NCU_SKIP
#                  launches), with per-SASS-instruction stall samples
#                  (decode_sass_b*_set*.csv.gz for scripts/sass_hotspots.py)
#   decode_flags   m3bench decode at DECODE_BATCHES (default 16,32,64,256,1024) once for each
#                  ';'-separated set of flags in DECODE_FLAG_SETS (default: the defaults),
#                  the sets taking turns twice, so that drift shows
#   bench    m3bench decode at batch 1-64 (per kernel) and 64-4096
#   state_bf16  the same with bf16 state, and m3drift: bf16 against fp32 state over 2,000 tokens
#   trace    each kernel's place in the decode graph (CUPTI) at batch 1, 16 and 64 (TRACE_BATCHES)
#   serve    scripts/device_serve_check.sh run with 2048-token prompts, once a line of
#            SERVE_FLAG_SETS (m3serve flags; default: the defaults, then each prefill path)
#   realtime scripts/device_serve_check.sh realtime (REALTIME_FLAGS: more m3serve flags)
#   swap     scripts/device_serve_check.sh swap: idle sessions out of 8 slots and back
#   snapshot scripts/device_serve_check.sh snapshot: Generate from a stored prefix
#   prefix   scripts/device_serve_check.sh prefix: time to first token with and without prefix_cache
#   variant_tests  only the packed variants' test binaries (VARIANT_BINS)
# Logs go under $OUT (or ./device-out); a summary is printed last; exit 1 when anything
# failed.
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEV=$ROOT/.device
CONFIG=configs/models/s2s-14l.json
# The GPU gtest binaries, by their build paths.
GTESTS="tests/kernels/m3_kernel_tests tests/kernels/m3_cuda_engine_tests
tests/kernels/m3_cuda_no_allocation_test tests/kernels/m3_cuda_capacity_tests
tests/kernels/m3_slot_state_copy_test tests/kernels/m3_cuda_slot_state_test
tests/engine/m3_engine_gpu_prefill_tests"
TOOLS="model/m3check model/m3make model/m3drift server/m3bench server/m3serve server/m3cli"

pack() {
  local build=${1:-$ROOT/build} stage
  stage=$(mktemp -d)
  mkdir -p "$stage/bin" "$stage/lib" "$stage/golden"
  for b in $GTESTS $TOOLS; do
    cp "$build/$b" "$stage/bin/" || { echo "missing $build/$b (build with CUDA first)"; return 1; }
  done
  cp "$build/server/libm3_spm.so" "$build/server/libm3_kernel_trace.so" "$stage/lib/"
  for b in "$stage"/bin/*; do ldd "$b"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
    grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libcu[A-Za-z]*|libnv[A-Za-z]*)\.so' | while read -r lib; do cp -L "$lib" "$stage/lib/"; done
  cp -r "$ROOT/../shared/golden/tiny" "$ROOT/../shared/golden/small_norm_mlp" "$stage/golden/"
  # VARIANT_BINS: binaries of other builds named NAME_VARIANT (m3bench_before,
  # m3_engine_gpu_prefill_tests_split, ...): the prefill mode times each m3bench_VARIANT
  # beside this tree's, the tests mode runs each test binary's variant after its own.
  for b in ${VARIANT_BINS:-}; do cp "$b" "$stage/bin/" || return 1; done
  # OLD's decode binaries for the A/B, where device_ab_check.sh pack built them.
  local old=${AB_OLD_BUILD:-$ROOT/build-ab-old/build}
  if [[ -x $old/server/m3bench ]]; then
    mkdir -p "$stage/ab/old"
    cp "$old/server/m3bench" "$old/model/m3check" "$stage/ab/old/"
  fi
  # ctest's m3check commands labelled gpu: name, the output that passes (if any), arguments
  # with the checkout and ../shared/golden made relative to the carried tree.
  (cd "$build" && ctest --show-only=json-v1 -L gpu) | python3 -c '
import json, sys
root, golden = sys.argv[1], sys.argv[2]
for t in json.load(sys.stdin)["tests"]:
    if not t["command"][0].endswith("/m3check"):
        continue
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    args = " ".join(a.replace(root + "/../shared/golden", ".device/golden").replace(golden, ".device/golden")
                    .replace(root + "/", "") for a in t["command"][1:])
    print(t["name"], (props.get("PASS_REGULAR_EXPRESSION") or [""])[0], args, sep="|")
' "$ROOT" "$(realpath "$ROOT/../shared/golden")" >"$stage/m3check_commands.txt" || return 1
  mkdir -p "$DEV/tools"
  cp /usr/bin/zstd "$DEV/tools/"
  tar cf - -C "$stage" . | zstd -q -f -T2 -10 --long=30 -o "$DEV/bundle.tar.zst" || return 1
  rm -rf "$stage"
  echo "$(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet || echo ' (+ uncommitted)')" >"$DEV/version.txt"
  du -sh "$DEV"/*
}

summary=()
failures=0
note() { summary+=("$1"); }
fail() { failures=$((failures + 1)); note "FAIL: $1"; }

unpack() {
  [[ -d $DEV/bin ]] && return 0
  "$DEV/tools/zstd" -q -d --long=30 -c "$DEV/bundle.tar.zst" | tar xf - -C "$DEV" || return 1
  export LD_LIBRARY_PATH=$DEV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

run_tests() {
  local t log
  local all=""
  for t in $GTESTS; do
    [[ -n ${VARIANTS_ONLY:-} ]] || all+=" $(basename "$t")"
    for v in "$DEV/bin/$(basename "$t")"_*; do [[ -x $v ]] && all+=" ${v##*/}"; done
  done
  for t in $all; do
    log=$OUT/$t.log
    if timeout 300 "$DEV/bin/$t" --gtest_brief=1 >"$log" 2>&1; then
      note "$t: PASS ($(grep -cE '^\[  (SKIPPED) ' "$log") skipped; $(grep -E '^\[  PASSED' "$log"))"
    else
      fail "$t: $(grep -E '^\[  FAILED  \] [A-Za-z]' "$log" | head -20 | tr '\n' ' ')"
      grep -B2 -A8 -E 'Failure$' "$log" | head -60
    fi
  done
  [[ -n ${VARIANTS_ONLY:-} ]] && return
  local name pass args out rc
  while IFS='|' read -r name pass args; do
    # shellcheck disable=SC2086  # the arguments are words
    out=$(timeout 120 "$DEV/bin/m3check" $args 2>&1)
    rc=$?
    echo "$out" >"$OUT/$name.log"
    if [[ -n $pass ]]; then
      grep -qE "$pass" <<<"$out" || { fail "$name (no '$pass' in its output)"; continue; }
    elif [[ $rc -ne 0 ]]; then
      fail "$name: exit $rc: $(tail -2 <<<"$out" | tr '\n' ' ')"
      continue
    fi
    note "$name: ok $(grep -E '^max_rel_err' <<<"$out" | tr '\n' ' ')"
  done <"$DEV/m3check_commands.txt"
}

run_ab() {
  if [[ ! -x $DEV/ab/old/m3bench ]]; then
    note "ab: no OLD build packed"
    return
  fi
  mkdir -p "$DEV/ab/new"
  ln -sf "$DEV/bin/m3bench" "$DEV/ab/new/m3bench"
  ln -sf "$DEV/bin/m3check" "$DEV/ab/new/m3check"
  if "$ROOT/scripts/device_ab_check.sh" run "${AB_ROUNDS:-3}" | tee "$OUT/ab.txt"; then
    note "ab: $(grep -A8 '^==== decode' "$OUT/ab.txt" | tail -7 | awk '{printf "b%s %s %s; ", $1, $4, $5}')"
  else
    fail "ab: $(tail -1 "$OUT/ab.txt")"
  fi
}

# Chunked and stepped with this tree's m3bench, then chunked with each packed variant's
# (VARIANT_BINS), then this tree's again, so that drift shows.
run_prefill() {
  local run bin mode flags i=0 sets
  local runs=${PREFILL_RUNS:-chunked steps}
  for bin in "$DEV"/bin/m3bench_*; do [[ -x $bin ]] && runs+=" chunked_${bin##*/m3bench_}"; done
  # PREFILL_FLAG_SETS: ';'-separated sets of more m3bench flags, each a chunked run of its own
  # (prefill_set<i>), between the runs above and chunked_again.
  IFS=';' read -r -a sets <<<"${PREFILL_FLAG_SETS:-}"
  for flags in "${sets[@]}"; do i=$((i + 1)); runs+=" set$i"; done
  for run in $runs chunked_again; do
    bin=$DEV/bin/m3bench
    mode=${run%%_*}
    flags=""
    [[ $run == chunked_* && $run != chunked_again ]] && bin=$DEV/bin/m3bench_${run#chunked_}
    if [[ $run == set* ]]; then mode=chunked flags=${sets[$((${run#set} - 1))]}; fi
    # shellcheck disable=SC2086  # the flags are words
    if timeout 240 "$bin" prefill --config $CONFIG --len "${PREFILL_LENS:-128,512,2048,8192}" \
        --batch "${PREFILL_BATCHES:-1,8}" --iters 5 --cuda-prefill "$mode" $flags --json "$OUT/prefill_$run.json" 2>&1 |
        tee "$OUT/prefill_$run.txt"; then
      note "m3bench prefill $run${flags:+ [$flags]}: $(awk '$1 == 128 || $1 == 2048 {printf "%sx%s %s ms; ", $1, $2, $3}' "$OUT/prefill_$run.txt")"
    else
      fail "m3bench prefill $run"
    fi
  done
}

# m3bench prefill (chunked) under the CUPTI kernel trace: each kernel's time, 2048 tokens
# at batch 1 and 8 (scripts/kernel_trace_totals.py sums it by kernel).
# PREFILL_TRACE_RUNS: LENxBATCH pairs (default 2048x1 2048x8).
# PREFILL_TRACE_VARIANTS=1: each packed m3bench_VARIANT too (files named _VARIANT).
run_prefill_trace() {
  local run len b bin name bins=$DEV/bin/m3bench
  [[ -n ${PREFILL_TRACE_VARIANTS:-} ]] && for bin in "$DEV"/bin/m3bench_*; do [[ -x $bin ]] && bins+=" $bin"; done
  for run in ${PREFILL_TRACE_RUNS:-2048x1 2048x8}; do
    len=${run%x*} b=${run#*x}
    for bin in $bins; do
      name=prefill_trace_${len}_b$b${bin##*/m3bench}
      echo "==== $name"
      # shellcheck disable=SC2086  # the flags are words
      M3_TRACE_OUT="$OUT/$name.csv" CUDA_INJECTION64_PATH="$DEV/lib/libm3_kernel_trace.so" \
          LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/usr/local/cuda/extras/CUPTI/lib64" \
          timeout 120 "$bin" prefill --config $CONFIG --len "$len" --batch "$b" --iters 3 \
          --cuda-prefill chunked ${PREFILL_TRACE_FLAGS:-} >"$OUT/$name.txt" 2>&1 || fail "prefill trace $run ${bin##*/}"
      [[ -s $OUT/$name.csv ]] && python3 "$ROOT/scripts/kernel_trace_totals.py" "$OUT/$name.csv" 2>&1 | head -40
    done
  done
}

# Nsight Compute on one launch of each chunked-prefill kernel (2048 tokens, batch 1).
run_prefill_ncu() {
  local ncu
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout 300 "$ncu" --kernel-name regex:"prefill_chunk_output|prefill_chunk_state|prefill_angles|prefill_state_pass|cutlass_80|prefill_token_params" \
      --launch-count 6 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis \
      "$DEV/bin/m3bench" prefill --config $CONFIG --len 2048 --batch 1 --iters 1 --cuda-prefill chunked \
      >"$OUT/prefill_ncu.txt" 2>&1 || fail "prefill ncu"
  grep -E "prefill_|cutlass|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Dynamic Shared|Stall|Issued Ipc|L1/TEX Hit|L2 Hit|Block Limit" \
      "$OUT/prefill_ncu.txt" | head -150
}

# Where the chunk kernels' warps wait, instruction by instruction, at 2048 tokens, batch 1.
run_prefill_sass() {
  local ncu k
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for k in prefill_chunk_output prefill_chunk_state; do
    timeout 240 "$ncu" --kernel-name regex:"$k" --launch-count 1 --section SourceCounters \
        --section WarpStateStats --section Occupancy -o "$OUT/sass_$k" \
        "$DEV/bin/m3bench" prefill --config $CONFIG --len 2048 --batch 1 --iters 1 --cuda-prefill chunked \
        >"$OUT/sass_$k.log" 2>&1 || { fail "ncu source counters $k"; continue; }
    "$ncu" -i "$OUT/sass_$k.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/prefill_sass_$k.csv.gz"
    "$ncu" -i "$OUT/sass_$k.ncu-rep" --page details 2>&1 | grep -E "Duration|Registers|Stall|Warp Cycles|Occupancy" | head -30
    rm -f "$OUT/sass_$k.ncu-rep"
  done
}

run_decode_flags() {
  local sets round i flags
  IFS=';' read -r -a sets <<<"${DECODE_FLAG_SETS:- }"
  for round in 1 2; do
    for i in "${!sets[@]}"; do
      flags=${sets[$i]}
      # shellcheck disable=SC2086  # the flags are words
      if timeout 200 "$DEV/bin/m3bench" decode --config $CONFIG --batch "${DECODE_BATCHES:-16,32,64,256,1024}" \
          --iters 20 $flags >"$OUT/decode_flags_${i}_$round.txt" 2>&1; then
        note "decode [${flags# }] round $round: $(awk '$1 ~ /^[0-9]+$/ && NF >= 11 {printf "b%s %s (%sx); ", $1, $4, $7}' "$OUT/decode_flags_${i}_$round.txt")"
      else
        fail "decode [$flags] round $round: $(tail -2 "$OUT/decode_flags_${i}_$round.txt" | tr '\n' ' ')"
      fi
    done
  done
}

# The recurrence of one decode step under Nsight Compute, one launch a batch (past the
# load-time launches, inside the replayed graph).
run_decode_ncu() {
  local ncu b flags tag i=0 sets
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  IFS=';' read -r -a sets <<<"${NCU_FLAG_SETS:- }"
  for flags in "${sets[@]}"; do
    i=$((i + 1))
    for b in ${NCU_BATCHES:-64 512}; do
      tag=b${b}_set$i
      echo "==== decode ncu batch $b, flags [$flags]"
      # shellcheck disable=SC2086  # the flags are words
      timeout 240 "$ncu" --kernel-name regex:"${NCU_REGEX:-mimo_step}" --launch-skip "${NCU_SKIP:-20}" --launch-count 1 \
          --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
          --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters \
          -o "$OUT/decode_ncu_$tag" "$DEV/bin/m3bench" decode --config $CONFIG --batch "$b" --iters 10 $flags \
          >"$OUT/decode_ncu_$tag.log" 2>&1 || { fail "decode ncu batch $b [$flags]"; continue; }
      "$ncu" -i "$OUT/decode_ncu_$tag.ncu-rep" --page details 2>&1 |
        grep -E "mimo_step|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Dynamic Shared|Stall|Issued Ipc|Warp Cycles|L2 Hit|Block Limit|Eligible|Mem Busy|Max Bandwidth|SM Frequency|Executed Instructions " | head -60
      "$ncu" -i "$OUT/decode_ncu_$tag.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/decode_sass_$tag.csv.gz"
      rm -f "$OUT/decode_ncu_$tag.ncu-rep"
    done
  done
}

# m3bench decode at batch 1, 16 and 64 under the CUPTI kernel trace, one
# kernel_trace_b<batch>.csv each (scripts/kernel_trace_summary.py reads them).
run_trace() {
  local b
  for b in ${TRACE_BATCHES:-1 16 64}; do
    M3_TRACE_OUT="$OUT/kernel_trace_b$b.csv" CUDA_INJECTION64_PATH="$DEV/lib/libm3_kernel_trace.so" \
        LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/usr/local/cuda/extras/CUPTI/lib64" \
        timeout 120 "$DEV/bin/m3bench" decode --config $CONFIG --batch $b --iters 10 >"$OUT/trace_bench_b$b.txt" 2>&1 ||
      fail "decode trace batch $b"
  done
}

run_bench() {
  timeout 200 "$DEV/bin/m3bench" decode --config $CONFIG --batch 1,2,4,8,16,32,64 \
      --json "$OUT/bench_bf16.json" --per-kernel --slot-copies 2>&1 | tee "$OUT/bench_bf16.txt" >/dev/null ||
    fail "m3bench decode bf16"
  # Capacity: every bucket from 64 to 4096 (4,096 fp32 states are 56 GB).
  timeout 300 "$DEV/bin/m3bench" decode --config $CONFIG --batch 64,128,256,512,1024,2048,4096 \
      --iters 30 --json "$OUT/bench_bf16_capacity.json" 2>&1 | tee "$OUT/bench_bf16_capacity.txt" ||
    fail "m3bench decode bf16, batch 64 to 4096"
  note "m3bench decode: see bench_bf16*.txt"
}

# bf16 state (state_dtype bf16): the decode step from batch 1 to 4096, and its drift from
# fp32 state over 2,000 greedy tokens on a random s2s-14l (bf16 weights on both sides).
run_state_bf16() {
  timeout 300 "$DEV/bin/m3bench" decode --config $CONFIG --state-dtype bf16 --batch 1,2,4,8,16,32,64,128,256,512,1024,2048,4096 \
      --iters 30 --json "$OUT/bench_bf16_state.json" 2>&1 | tee "$OUT/bench_bf16_state.txt" ||
    fail "m3bench decode, bf16 state"
  timeout 120 "$DEV/bin/m3bench" decode --config $CONFIG --state-dtype bf16 --batch 16,64 --per-kernel \
      >"$OUT/bench_bf16_state_kernels.txt" 2>&1 || fail "m3bench decode --per-kernel, bf16 state"
  grep -A3 '^kernels timed alone' "$OUT/bench_bf16_state_kernels.txt"
  local model
  model=$(mktemp -d)
  if "$DEV/bin/m3make" --config $CONFIG --out "$model" --seed 1 --dtype bf16 >/dev/null 2>&1 &&
      timeout 120 "$DEV/bin/m3drift" "$model" --backend cuda --tokens 2000 --sequences 4 2>&1 | tee "$OUT/drift_cuda.txt"; then
    note "drift (cuda, bf16 state against fp32): $(tail -1 "$OUT/drift_cuda.txt")"
  else
    fail "m3drift --backend cuda"
  fi
  rm -rf "$model"
}

run_serve() {
  # device_serve_check.sh unpacks srv.tgz; here the bundle holds the same binaries.
  local flags tag
  while IFS= read -r flags; do
    tag=$(echo "$flags" | tr -cs 'A-Za-z0-9' '_' | sed 's/^_*//; s/_*$//')
    if M3_SERVE_FLAGS=$flags M3_SERVE_PROMPT_LEN=2048 M3_SERVE_BIN=$DEV/bin \
        timeout 280 "$ROOT/scripts/device_serve_check.sh" run 2>&1 | tee "$OUT/serve${tag:+_$tag}.txt"; then
      note "serve ${flags:-(defaults)}: $(grep -E '^mixed|exit status' "$OUT/serve${tag:+_$tag}.txt" | tr '\n' ' ')"
    else
      fail "serve ${flags:-(defaults)}"
    fi
  done <<<"${SERVE_FLAG_SETS:-
--cuda-prefill chunked
--cuda-prefill chunked --prefill-chunk-tokens 256
--cuda-prefill chunked --prefill-chunk-tokens 2048}"
}

# REALTIME_FLAGS: more m3serve flags (e.g. --cuda-prefill chunked).
run_realtime() {
  if M3_SERVE_BIN=$DEV/bin M3_SERVE_FLAGS=${REALTIME_FLAGS:-} timeout 500 "$ROOT/scripts/device_serve_check.sh" realtime 2>&1 |
      tee "$OUT/realtime.txt"; then
    note "realtime ${REALTIME_FLAGS:-}: ok"
  else
    fail "realtime ${REALTIME_FLAGS:-}"
  fi
}

# One device_serve_check.sh mode (needs the bundle's binaries); the lines of its output
# that match PATTERN go into the summary.
run_serve_mode() {
  local mode=$1 pattern=$2
  if M3_SERVE_BIN=$DEV/bin timeout 200 "$ROOT/scripts/device_serve_check.sh" "$mode" 2>&1 | tee "$OUT/$mode.txt"; then
    note "$mode: $(grep -E "$pattern" "$OUT/$mode.txt" | tr '\n' ' ')"
  else
    fail "$mode"
  fi
}

if [[ ${1:-} == pack ]]; then
  shift
  pack "$@"
  exit
fi
[[ $# -gt 0 ]] || { echo "usage: $0 pack [BUILD_DIR] | {tests|ab|prefill|prefill_trace|prefill_ncu|prefill_sass|decode_ncu|decode_flags|bench|state_bf16|trace|serve|realtime|swap|snapshot|prefix|variant_tests}..." >&2; exit 2; }
OUT=${OUT:-$ROOT/device-out}
export OUT
mkdir -p "$OUT"
cd "$ROOT" || exit 1
unpack || { echo "could not unpack $DEV/bundle.tar.zst"; exit 1; }
export LD_LIBRARY_PATH=$DEV/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "tree $(cat "$DEV/version.txt" 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
for mode in "$@"; do
  start=$SECONDS
  case $mode in
    tests) run_tests ;;
    ab) run_ab ;;
    prefill) run_prefill ;;
    prefill_trace) run_prefill_trace ;;
    prefill_ncu) run_prefill_ncu ;;
    prefill_sass) run_prefill_sass ;;
    decode_ncu) run_decode_ncu ;;
    decode_flags) run_decode_flags ;;
    bench) run_bench ;;
    state_bf16) run_state_bf16 ;;
    trace) run_trace ;;
    serve) run_serve ;;
    realtime) run_realtime ;;
    swap) run_serve_mode swap '^swap-ins|same with' ;;
    snapshot) run_serve_mode snapshot '^snapshot' ;;
    prefix) run_serve_mode prefix '^prefix_cache' ;;
    variant_tests) VARIANTS_ONLY=1 run_tests ;;
    *) fail "unknown mode $mode" ;;
  esac
  note "($mode took $((SECONDS - start)) s)"
done
printf '%s\n' "==== summary" "${summary[@]}" | tee "$OUT/summary.txt"
# At most a few files come back from the machine: the logs travel as one archive.
logs=$(mktemp)
(cd "$OUT" && tar czf "$logs" --exclude=summary.txt . && find . -mindepth 1 ! -name summary.txt -delete &&
  mv "$logs" logs.tar.gz)
[[ $failures -eq 0 ]] || { echo "==== $failures failed"; exit 1; }
