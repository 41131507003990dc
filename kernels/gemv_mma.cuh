// Tensor-core variant of plan_gemv (gemv.cuh) for bf16 weights at batch >= 2. x is
// rounded to bf16 on the way in (fp32 accumulation), so fp32-weight engines never use it.
#pragma once

#include "kernels/gemv.cuh"

namespace m3::kernels {

// Whether plan_gemv takes this path for `args` (bf16, batch >= 2, cols % 32 == 0, the
// staged tile fitting in shared memory, and not CUDA cores asked for by rows_per_warp).
bool gemv_mma_applies(const GemvArgs& args);
KernelLaunch plan_gemv_mma(const GemvArgs& args);

}  // namespace m3::kernels
