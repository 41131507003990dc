// Per-token row operations around the prefill GEMMs (kernels/gemm_lt.cuh), one block a row:
// the embedding gather into the fp32 residual stream, the RMSNorm of the residual before
// in_proj and fc1 (written in the GEMM's input type), the gated SiLU between fc1 and fc2,
// and the packing of each run's last row for lm_head.
// The residual adds are the GEMMs' own (out_proj and fc2 accumulate into the residual).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/weight_dtype.h"  // also the element type of row outputs

namespace m3::kernels {

// out[t, :] = table[ids[t], :] (fp32), ids clamped into [0, vocab_rows).
void gather_rows(const void* table, WeightDType table_type, int vocab_rows, int cols, const int32_t* ids, int rows,
                 float* out, int out_stride, cudaStream_t stream);

// out[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * weight, written as out_type.
void rmsnorm_rows(const float* x, int x_stride, const float* weight, int cols, float eps, void* out,
                  WeightDType out_type, int out_stride, int rows, cudaStream_t stream);

// out[t, i] = in[t, i] * silu(in[t, F + i]) for i < F (fc1's output [a | g]), written as out_type.
void gated_silu_rows(const float* in, int in_stride, int F, void* out, WeightDType out_type, int out_stride, int rows,
                     cudaStream_t stream);

// out[i, :] = x[token_begin[i + 1] - 1, :] (fp32) for i < runs: each run's last token row,
// packed for norm_f and lm_head (the decode gemv at batch `runs`).
void last_rows_of_runs(const float* x, int x_stride, const int32_t* token_begin, int runs, int cols, float* out,
                       int out_stride, cudaStream_t stream);

// counters[slot[i]] += (run i's length) - 1 for i < runs: the random-draw counters as the
// run's steps before its last would leave them (the sampling after the run adds the last one).
void advance_run_counters(uint64_t* counters, const int32_t* slot, const int32_t* token_begin, int runs,
                          cudaStream_t stream);

// The token-row buffers of one prefill layer, sized once for a token budget: rows are
// lt_gemm_padded_rows(max_tokens) (the GEMMs compute whole row buckets) and every row
// stride is its width rounded up to 8 elements (16-byte rows for the GEMMs). `act` is the
// GEMMs' input type (bf16 for bf16 weights): the normed residual (u, d_model wide), the
// mixer output o (d_inner) and the MLP activation (mlp_width); the rest is fp32.
struct PrefillRowSizes {
  int d_model = 0, in_proj_rows = 0, d_inner = 0, mlp_width = 0;  // mlp_width 0: no MLP
  WeightDType act = WeightDType::BF16;
  int max_tokens = 0;
};
struct PrefillRowBuffers {
  int rows = 0;                      // rows each buffer holds
  float* res = nullptr;              // [rows][res_stride] residual stream
  void* u = nullptr;                 // [rows][u_stride] rmsnorm(res) * weight, GEMM input
  float* w = nullptr;                // [rows][w_stride] in_proj output
  void* o = nullptr;                 // [rows][o_stride] mixer output, out_proj input
  float* fc1_out = nullptr;          // [rows][fc1_stride] (MLP only)
  void* mlp_act = nullptr;           // [rows][mlp_act_stride] a * silu(g) (MLP only)
  float* last = nullptr;             // [rows][res_stride] runs' last rows for lm_head
  int res_stride = 0, u_stride = 0, w_stride = 0, o_stride = 0, fc1_stride = 0, mlp_act_stride = 0;
};
size_t prefill_row_buffer_bytes(const PrefillRowSizes& sizes);
// Carves `base` (prefill_row_buffer_bytes of it, 256-byte aligned) into the buffers.
PrefillRowBuffers prefill_row_buffers(const PrefillRowSizes& sizes, void* base);

}  // namespace m3::kernels
