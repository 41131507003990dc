#!/usr/bin/env bash
# The same decode step, two builds: OLD (a commit before a change, by default 5d91b22, the
# base of the typed-policy restructure) and NEW (this tree), measured in one device call
# with the two alternating, so that machine-to-machine and call-to-call drift hit both.
#   here:           scripts/device_ab_check.sh pack        -> .device/ab/{old,new}/*.gz, .device/golden/
#   on the machine: scripts/device_ab_check.sh run [ROUNDS]  (device run, carry .device)
#                   scripts/device_ab_check.sh variants      (a second call: each fits in 10 minutes)
# pack builds m3bench and m3check for sm_90 without the server (OLD from OLD_REF's tree
# under build-ab-old, NEW under build-ab-new; ccache makes rebuilds cheap) and
# gzips them into .device/ab/ (the carried tree is limited to 64 MiB).
# run, ROUNDS times (default 4), OLD then NEW (NEW first in even rounds): m3bench decode at
# batches 1-64 (s2s-14l, bf16); then m3check on each golden case, fp32 and bf16, side by
# side and one at a time, and bf16 with the CUDA-core recurrence, for both builds. Prints
# per batch the median us/step of each build, new/old and whether the kernels a step
# match, then each check's line side by side; exits 1 when a batch is more than 2% slower,
# a step's kernel count differs, or a check fails or errs differently (with out_proj fused
# the last bits of bf16 runs vary from run to run: compare such a difference by size).
# variants: the policy variants that replaced OLD's environment switches, each pair run
# once (OLD with the switch, NEW with the flags): the kernels a step must match, the
# us/step come side by side.
set -u -o pipefail
MODE=${1:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OLD_REF=${OLD_REF:-5d91b22}
BATCHES=1,2,4,8,16,32,64
CONFIG=configs/models/s2s-14l.json

# OLD's environment switch and NEW's flags for the same variant, one pair a line.
VARIANTS="M3_CUDA_CHAINS=1|--cuda-chains 1
M3_CUDA_CHAINS=2|--cuda-chains 2
M3_PDL_FIRST=0|--cuda-gemv-trigger after_wait
M3_PDL_EARLY=0|--cuda-recurrence-trigger at_end
M3_PDL_REC_POINT=1|--cuda-recurrence-trigger after_wait
M3_CUDA_FUSED_OUT_PROJ=0|--cuda-step-variants-out-proj-fused off
M3_CUDA_FUSED_EMBEDDING=0|--cuda-step-variants-embedding-gathered off
M3_MIMO_TC_FUSED_CLUSTER=4|--cuda-step-variants-fused-cluster 4
M3_GEMV_SMALL_RPW=4|--cuda-step-variants-batch1-gemv-rows-per-warp 4 --cuda-step-variants-batch2-gemv cuda_cores --cuda-gemv-batch1-rows-per-warp 4
M3_MIMO_TC_MIN_BATCH=0|--cuda-recurrence-tensor-core-min-batch never
M3_GEMV_MMA_ROWS_MIN_BATCH=4|--cuda-gemv-row-block-min-batch 4
M3_MIMO_TC_SPLIT=1|--cuda-recurrence-tc-column-split 1
M3_CUDA_PDL=0|--cuda-pdl false
M3_CUDA_NEXT_STEP_PREFETCH=0|--cuda-next-step-prefetch false
M3_STATE_LOAD=plain|--cuda-recurrence-state-load plain"

build() {  # SOURCE_DIR BUILD_DIR
  CCACHE_BASEDIR=${CCACHE_BASEDIR:-/work} cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DM3_BUILD_SERVER=OFF -DM3_BUILD_TESTS=OFF \
      -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache >/dev/null &&
    ninja -C "$2" -j"${JOBS:-2}" m3bench m3check
}

# The us/step (column 4) and kernels (column 3) of m3bench decode's table rows, as
# "batch us kernels" lines.
rows() { awk 'NF == 11 && $1 ~ /^[0-9]+$/ && $4 ~ /^[0-9.]+$/ {print $1, $4, $3}' "$@"; }

case $MODE in
pack)
  # OLD's sources as a plain tree (no worktree registered in the repository).
  old_src=$ROOT/build-ab-old/src
  rm -rf "$old_src" && mkdir -p "$old_src" || exit 1
  git -C "$ROOT" archive "$OLD_REF" | tar -x -C "$old_src" || exit 1
  build "$old_src" "$ROOT/build-ab-old/build" || exit 1
  build "$ROOT" "$ROOT/build-ab-new" || exit 1
  for side in old new; do
    dir=$ROOT/build-ab-$side
    [[ $side == old ]] && dir=$ROOT/build-ab-old/build
    mkdir -p "$ROOT/.device/ab/$side"
    for b in "$dir/server/m3bench" "$dir/model/m3check"; do
      gzip -1 -c "$b" >"$ROOT/.device/ab/$side/$(basename "$b").gz"
    done
  done
  mkdir -p "$ROOT/.device/golden"
  cp -r "$ROOT/../shared/golden/tiny" "$ROOT/../shared/golden/small_norm_mlp" "$ROOT/.device/golden/"
  echo "OLD $OLD_REF, NEW $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet || echo ' (+ uncommitted)')" |
    tee "$ROOT/.device/ab/versions.txt"
  du -sh "$ROOT/.device"
  ;;
run)
  ROUNDS=${2:-4}
  OUT=${OUT:-$PWD/device-out}
  mkdir -p "$OUT"
  cd "$ROOT" || exit 1
  for z in .device/ab/*/*.gz; do [[ -e $z ]] && gunzip -f "$z"; done
  chmod +x .device/ab/*/m3* 2>/dev/null
  cat .device/ab/versions.txt 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
  failures=0
  for ((r = 1; r <= ROUNDS; r++)); do
    order="old new"
    ((r % 2 == 0)) && order="new old"
    for side in $order; do
      ".device/ab/$side/m3bench" decode --config $CONFIG --batch $BATCHES --iters 300 \
          >"$OUT/bench_${side}_$r.txt" 2>&1 || { echo "m3bench $side round $r failed"; failures=$((failures + 1)); }
      echo "round $r $side: $(rows "$OUT/bench_${side}_$r.txt" | awk '{printf "b%s %s  ", $1, $2}')"
    done
  done
  echo "==== decode us/step, median of $ROUNDS rounds each"
  printf '%6s %10s %10s %9s %s\n' batch old new new/old kernels
  for b in ${BATCHES//,/ }; do
    med() { rows "$OUT"/bench_"$1"_*.txt | awk -v b="$b" '$1 == b {print $2}' | sort -g |
      awk '{v[NR] = $1} END {if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
    kern() { rows "$OUT"/bench_"$1"_*.txt | awk -v b="$b" '$1 == b {print $3}' | sort -u | tr '\n' ' '; }
    o=$(med old) n=$(med new) ko=$(kern old) kn=$(kern new)
    verdict=$(awk -v o="$o" -v n="$n" 'BEGIN {r = n / o; printf "%.4f %s", r, (r > 1.02 ? "SLOWER" : "ok")}')
    same=$([[ $ko == "$kn" ]] && echo "same ($ko)" || echo "DIFFER (old $ko, new $kn)")
    printf '%6s %10s %10s %s kernels %s\n' "$b" "$o" "$n" "$verdict" "$same"
    [[ $verdict == *SLOWER* || $same == DIFFER* ]] && failures=$((failures + 1))
  done

  echo "==== m3check, old | new"
  check() {  # SIDE NAME ARGS...: one m3check run, its stdout line and exit status
    local side=$1 name=$2
    shift 2
    "$@" >"$OUT/m3check_${name}_$side.log" 2>&1
    local rc=$?
    echo "$(grep -E '^max_rel_err' "$OUT/m3check_${name}_$side.log") exit $rc"
  }
  for c in tiny small_norm_mlp; do
    g=(".device/golden/$c" ".device/golden/$c/trajectory.safetensors" --backend cuda)
    for d in fp32 bf16; do
      for alone in "" --one-at-a-time; do
        name=${c}_$d${alone:+_alone}
        o=$(check old "$name" .device/ab/old/m3check "${g[@]}" --dtype $d $alone)
        n=$(check new "$name" .device/ab/new/m3check "${g[@]}" --dtype $d $alone)
        echo "$name: $o | $n"
        [[ $o == "$n" && $o == *"exit 0" ]] || failures=$((failures + 1))
      done
    done
    name=${c}_bf16_cudacore
    o=$(check old "$name" env M3_MIMO_TC_MIN_BATCH=0 .device/ab/old/m3check "${g[@]}" --dtype bf16)
    n=$(check new "$name" .device/ab/new/m3check "${g[@]}" --dtype bf16 --cuda-recurrence-tensor-core-min-batch never)
    echo "$name: $o | $n"
    [[ $o == "$n" && $o == *"exit 0" ]] || failures=$((failures + 1))
  done

  echo "==== $failures failed"
  [[ $failures -eq 0 ]]
  ;;
variants)
  OUT=${OUT:-$PWD/device-out}
  mkdir -p "$OUT"
  cd "$ROOT" || exit 1
  for z in .device/ab/*/*.gz; do [[ -e $z ]] && gunzip -f "$z"; done
  chmod +x .device/ab/*/m3* 2>/dev/null
  failures=0
  echo "==== policy variants: old's switch | new's flags (us/step at batches 1 2 4 16 64; kernels)"
  while IFS='|' read -r sw flags; do
    [[ -z $sw ]] && continue
    tag=${sw//=/_}
    env "$sw" .device/ab/old/m3bench decode --config $CONFIG --batch 1,2,4,16,64 --iters 100 \
        >"$OUT/variant_old_$tag.txt" 2>&1
    # shellcheck disable=SC2086  # the flags are words
    .device/ab/new/m3bench decode --config $CONFIG --batch 1,2,4,16,64 --iters 100 $flags \
        >"$OUT/variant_new_$tag.txt" 2>&1
    o=$(rows "$OUT/variant_old_$tag.txt" | awk '{printf "%s ", $2} END {printf "|"}')
    n=$(rows "$OUT/variant_new_$tag.txt" | awk '{printf "%s ", $2}')
    ko=$(rows "$OUT/variant_old_$tag.txt" | awk '{printf "%s ", $3}')
    kn=$(rows "$OUT/variant_new_$tag.txt" | awk '{printf "%s ", $3}')
    same=$([[ $ko == "$kn" ]] && echo "kernels same" || echo "kernels DIFFER ($ko | $kn)")
    echo "$sw | $flags: $o $n; $same"
    [[ $same == *DIFFER* ]] && failures=$((failures + 1))
  done <<<"$VARIANTS"

  echo "==== $failures failed"
  [[ $failures -eq 0 ]]
  ;;
*)
  echo "usage: $0 pack | run [ROUNDS] | variants" >&2
  exit 2
  ;;
esac
