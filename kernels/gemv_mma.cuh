// Tensor-core variant of plan_gemv (gemv.cuh) for bf16 weights at batch >= 2. x is
// rounded to bf16 on the way in (fp32 accumulation), so fp32-weight engines never use it.
#pragma once

#include "kernels/gemv.cuh"

namespace m3::kernels {

bool gemv_mma_applies(const GemvArgs& args);
KernelLaunch plan_gemv_mma(const GemvArgs& args);

}  // namespace m3::kernels
