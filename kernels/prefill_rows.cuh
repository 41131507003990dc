// Per-token row operations around the prefill GEMMs (kernels/gemm_lt.cuh), one block a row:
// the embedding gather into the fp32 residual stream, the RMSNorm of the residual before
// in_proj and fc1 (written in the GEMM's input type), the gated SiLU between fc1 and fc2,
// and the packing of each run's last row for lm_head.
// The residual adds are the GEMMs' own (out_proj and fc2 accumulate into the residual).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/embedding.cuh"  // WeightType, also the element type of row outputs

namespace m3::kernels {

// out[t, :] = table[ids[t], :] (fp32), ids clamped into [0, vocab_rows).
void gather_rows(const void* table, WeightType table_type, int vocab_rows, int cols, const int32_t* ids, int rows,
                 float* out, int out_stride, cudaStream_t stream);

// out[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * weight, written as out_type.
void rmsnorm_rows(const float* x, int x_stride, const float* weight, int cols, float eps, void* out,
                  WeightType out_type, int out_stride, int rows, cudaStream_t stream);

// out[t, i] = in[t, i] * silu(in[t, F + i]) for i < F (fc1's output [a | g]), written as out_type.
void gated_silu_rows(const float* in, int in_stride, int F, void* out, WeightType out_type, int out_stride, int rows,
                     cudaStream_t stream);

// out[i, :] = x[token_begin[i + 1] - 1, :] (fp32) for i < runs: each run's last token row,
// packed for norm_f and lm_head (the decode gemv at batch `runs`).
void last_rows_of_runs(const float* x, int x_stride, const int32_t* token_begin, int runs, int cols, float* out,
                       int out_stride, cudaStream_t stream);

}  // namespace m3::kernels
