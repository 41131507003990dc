#!/usr/bin/env bash
# Runs on the lent GPU machine (device tool), from the repository root, with binaries
# built elsewhere and carried in .device/:
#   .device/bin/{m3_kernel_tests,m3_cuda_engine_tests,m3_cuda_no_allocation_test,m3_cuda_capacity_tests,m3check,m3bench}[.gz]
#   .device/golden/{tiny,small_norm_mlp}/   (copy of ../shared/golden)
#   .device/lib/{libm3_kernel_trace.so,libcupti.so.13}[.gz]   (trace mode only)
# Writes logs under $OUT (or ./device-out) and prints a short summary last; exits 1 when
# any test, check, bench or trace run failed (the summary says which), 0 otherwise.
# Usage: scripts/device_check.sh [all|tests|check|bench|trace] [extra m3bench args...]
# trace: m3bench decode at batch 1, 16 and 64 under the CUPTI injection library, one
# kernel_trace_b<batch>.csv.gz each (scripts/kernel_trace_summary.py reads them).
set -u -o pipefail
MODE=${1:-all}
shift || true
case $MODE in
  all | tests | check | bench | trace) ;;
  *) echo "usage: scripts/device_check.sh [all|tests|check|bench|trace] [extra m3bench args...]" >&2; exit 2 ;;
esac
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
BIN=.device/bin
GOLDEN=.device/golden
# Binaries may travel gzipped (the carried tree is limited to 64 MiB).
for z in "$BIN"/*.gz .device/lib/*.gz; do
  [[ -e $z ]] && gunzip -f "$z"
done
chmod +x "$BIN"/* 2>/dev/null
summary=()
failures=0
# Records a failed step: the summary line of each step says which.
fail() { failures=$((failures + 1)); }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

if [[ $MODE == all || $MODE == tests ]]; then
  for t in m3_kernel_tests m3_cuda_engine_tests m3_cuda_no_allocation_test m3_cuda_capacity_tests; do
    if "$BIN/$t" --gtest_brief=1 >"$OUT/$t.log" 2>&1; then r=PASS; else r=FAIL; fail; fi
    summary+=("$t: $r ($(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$t.log" | tr '\n' ' '))")
    [[ $r == FAIL ]] && grep -E "Failure|error|FAILED|Expected|Which is|actual" "$OUT/$t.log" | head -40
  done
  # The weights' loads really precede the PDL wait in the built kernels (SASS).
  if scripts/check_pdl_sass.sh "$BIN/m3bench" >"$OUT/pdl_sass.log" 2>&1; then r=PASS; else r=FAIL; fail; fi
  summary+=("pdl wait placement (SASS): $r ($(tail -1 "$OUT/pdl_sass.log"))")
fi

if [[ $MODE == all || $MODE == check ]]; then
  for c in tiny small_norm_mlp; do
    for d in fp32 bf16; do
      "$BIN/m3check" "$GOLDEN/$c" "$GOLDEN/$c/trajectory.safetensors" --backend cuda --dtype $d \
          >"$OUT/m3check_${c}_$d.log" 2>&1
      rc=$?
      [[ $rc -eq 0 ]] || fail
      summary+=("m3check cuda $c $d: exit $rc: $(tail -2 "$OUT/m3check_${c}_$d.log" | tr '\n' ' ')")
    done
    # Each sequence alone: the batch-1 plan (out_proj fused into the recurrence).
    for d in fp32 bf16; do
      "$BIN/m3check" "$GOLDEN/$c" "$GOLDEN/$c/trajectory.safetensors" --backend cuda --dtype $d --one-at-a-time \
          >"$OUT/m3check_${c}_${d}_alone.log" 2>&1
      rc=$?
      [[ $rc -eq 0 ]] || fail
      summary+=("m3check cuda $c $d, one at a time: exit $rc: $(tail -2 "$OUT/m3check_${c}_${d}_alone.log" | tr '\n' ' ')")
    done
    # bf16 engines run the recurrence on tensor cores; check the CUDA-core kernel with
    # bf16 weights too (the policy's recurrence_tensor_core_min_batch: never).
    "$BIN/m3check" "$GOLDEN/$c" "$GOLDEN/$c/trajectory.safetensors" --backend cuda \
        --dtype bf16 --cuda-recurrence-tensor-core-min-batch never >"$OUT/m3check_${c}_bf16_cudacore.log" 2>&1
    rc=$?
    [[ $rc -eq 0 ]] || fail
    summary+=("m3check cuda $c bf16 (CUDA-core recurrence): exit $rc: $(tail -2 "$OUT/m3check_${c}_bf16_cudacore.log" | tr '\n' ' ')")
  done
fi

if [[ $MODE == all || $MODE == bench ]]; then
  "$BIN/m3bench" decode --config configs/models/s2s-14l.json --batch 1,2,4,8,16,32,64 \
      --json "$OUT/bench_bf16.json" --per-kernel "$@" 2>&1 | tee "$OUT/bench_bf16.txt"
  rc=$?
  [[ $rc -eq 0 ]] || fail
  summary+=("m3bench decode bf16: exit $rc")
  # Capacity: every bucket from 64 to 4096 (4,096 fp32 states are 56 GB).
  "$BIN/m3bench" decode --config configs/models/s2s-14l.json --batch 64,128,256,512,1024,2048,4096 \
      --iters 30 --json "$OUT/bench_bf16_capacity.json" 2>&1 | tee "$OUT/bench_bf16_capacity.txt"
  rc=$?
  [[ $rc -eq 0 ]] || fail
  summary+=("m3bench decode bf16, batch 64 to 4096: exit $rc")
  # Policy variants (configs/server.yaml's cuda: section, as flags), one at a time, in the
  # same run; M3_AB_RUNS (one run's flags a line) replaces the list.
  ab_runs=${M3_AB_RUNS:-"--cuda-chains 1
--cuda-chains 2
--cuda-gemv-trigger after_wait
--cuda-recurrence-trigger at_end
--cuda-recurrence-trigger after_wait
--cuda-step-variants-out-proj-fused off
--cuda-step-variants-out-proj-fused on
--cuda-step-variants-embedding-gathered off
--cuda-step-variants-fused-cluster 4
--cuda-recurrence-tensor-core-min-batch never
--cuda-gemv-row-block-min-batch 4
--cuda-recurrence-tc-column-split 1
--cuda-pdl false
--cuda-next-step-prefetch false
--cuda-recurrence-state-load plain"}
  while IFS= read -r flags; do
    [[ -z $flags ]] && continue
    name=$(echo "$flags" | tr -s ' ' '_' | sed 's/^--cuda-//')
    # shellcheck disable=SC2086  # the line is the run's flags
    "$BIN/m3bench" decode --config configs/models/s2s-14l.json --batch 1,2,4,16,64 \
        --iters 100 $flags 2>&1 | tee "$OUT/bench_bf16_$name.txt" | sed "s/^/[$flags] /"
    rc=$?
    if [[ $rc -ne 0 ]]; then
      fail
      summary+=("m3bench decode bf16, $flags: exit $rc")
    fi
  done <<<"$ab_runs"
fi

if [[ $MODE == trace ]]; then
  for b in 1 16 64; do
    M3_TRACE_OUT="$OUT/kernel_trace_b$b.csv" CUDA_INJECTION64_PATH="$PWD/.device/lib/libm3_kernel_trace.so" \
        LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/extras/CUPTI/lib64:${LD_LIBRARY_PATH:-}" \
        "$BIN/m3bench" decode --config configs/models/s2s-14l.json --batch $b --iters 10 "$@" >"$OUT/trace_bench_b$b.txt" 2>&1
    rc=$?
    if [[ $rc -ne 0 || ! -s $OUT/kernel_trace_b$b.csv ]]; then
      fail
      summary+=("trace batch $b: FAIL (m3bench exit $rc; see trace_bench_b$b.txt)")
      continue
    fi
    summary+=("trace batch $b: $(($(wc -l <"$OUT/kernel_trace_b$b.csv") - 1)) kernel records")
    gzip -f "$OUT/kernel_trace_b$b.csv"
  done
fi

printf '%s\n' "==== summary" "${summary[@]}"
if [[ $failures -gt 0 ]]; then
  echo "==== $failures failed"
  exit 1
fi
