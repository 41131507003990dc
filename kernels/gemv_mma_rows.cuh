// The row-block tensor-core gemv: a block owns 128 weight rows and a batch tile of up to
// 64 columns; the columns split over a thread-block cluster whose partial tiles are summed
// in a fixed order through distributed shared memory. plan_gemv_mma (gemv_mma.cuh) picks
// it where gemv_mma_rows_applies.
#pragma once

#include "kernels/gemv.cuh"

namespace m3::kernels {

// For bf16 arguments gemv_mma_applies accepts: batch >= GemvPolicy::row_block_min_batch
// (0: never), and below batch 8 only for matrices of 16 or more row blocks, on devices that
// launch thread-block clusters.
bool gemv_mma_rows_applies(const GemvArgs& args);
KernelLaunch plan_gemv_mma_rows(const GemvArgs& args);

}  // namespace m3::kernels
