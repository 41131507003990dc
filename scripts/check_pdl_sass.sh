#!/usr/bin/env bash
# Checks in the SASS of a binary (cuobjdump; sm_90 code, or $ARCH) that every gemv and tensor-core
# recurrence kernel issues global loads before its programmatic-dependent-launch wait
# (ACQBULK). ptxas hoists a plain griddepcontrol.wait to the top of a kernel, which turns
# the weights' pre-wait loads into post-wait ones (kernels/common.cuh,
# wait_for_previous_kernel); this catches a regression of that work-around.
# Usage: scripts/check_pdl_sass.sh BINARY   (exit 1 when a kernel has no load before its wait)
set -u -o pipefail
bin=${1:?usage: check_pdl_sass.sh BINARY}
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}
"$cuobjdump" -sass -arch "${ARCH:-sm_90}" "$bin" | awk '
  /Function :/ { if (name != "") report(); name = $3; seen_wait = 0; loads = 0; next }
  /ACQBULK/ { seen_wait = 1 }
  /LDG|LDGSTS/ { if (!seen_wait) loads++ }
  function report() {
    if (name ~ /gemv|mimo_step_tc/) {
      checked++
      if (loads == 0) { bad++; print "no load before the PDL wait: " name }
    }
  }
  END {
    if (name != "") report()
    printf "pdl wait placement: %d kernels checked, %d with no load before the wait\n", checked, bad
    exit (checked == 0 || bad > 0) ? 1 : 0
  }'
