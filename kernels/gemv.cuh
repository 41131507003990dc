// Matrix times a small batch of vectors, y[b] = W x[b], for decode: W is [rows, cols]
// row-major (bf16 or fp32), x and y fp32. Weights are read once per batch tile of up to
// 8 vectors with 16-byte loads; each warp owns a few rows.
//
// Fusions, chosen by the arguments:
// - norm_weight != nullptr: x[b] is RMS-normalised and scaled by norm_weight first
//   (every block re-normalises its tile, so no separate norm kernel is needed);
// - epilogue Store: y = W x;  Accumulate: y += W x (residual add);
//   GatedSilu: W has 2*out_rows rows [a; g], y[j] = a_j * silu(g_j) (gated MLP);
// - gather.table != nullptr: x[b] is the embedding row of batch entry b's token (the
//   step's first projection), which the kernel also writes, in fp32, to gather.rows_out.
#pragma once

#include <string>

#include "kernels/launch.cuh"
#include "kernels/plan_policy.h"
#include "kernels/weight_dtype.h"

namespace m3::kernels {

enum class GemvEpilogue { Store, Accumulate, GatedSilu };

// The input rows gathered from an embedding table instead of read from x: row b is
// table[token], token = tokens[b] when >= 0, else last_token[slots[b]] (the slot's last
// sampled id), clamped to the table. Saves the step an embedding kernel ahead of its first
// projection, and with it a kernel boundary before the first weights are loaded.
struct GemvGather {
  const void* table = nullptr;  // [vocab_rows, cols], the weights' type
  int vocab_rows = 0;
  const int32_t* slots = nullptr;       // [batch]
  const int32_t* tokens = nullptr;      // [batch]
  const int32_t* last_token = nullptr;  // [slots]
  float* rows_out = nullptr;            // [batch, x_stride]: the gathered rows (the residual stream)
};

struct GemvArgs {
  const void* weight = nullptr;  // [rows, cols]; rows = out_rows (2*out_rows for GatedSilu)
  WeightDType type = WeightDType::BF16;
  int out_rows = 0;
  int cols = 0;                  // multiple of 8
  const float* x = nullptr;      // [batch, x_stride]; unused when gathering
  int x_stride = 0;
  const float* norm_weight = nullptr;  // [cols] or nullptr
  float norm_eps = 1e-5f;
  float* y = nullptr;            // [batch, y_stride]
  int y_stride = 0;
  int batch = 0;
  GemvEpilogue epilogue = GemvEpilogue::Store;
  // These rows run beside another chain's (the engine's split buckets): the row-block
  // kernel then takes the whole batch in one tile (fewer blocks; the other chain fills
  // the GPU).
  bool beside_other_chains = false;
  GemvGather gather;
  // Output rows a warp computes on CUDA cores: at batch 1, 2 or 4 (0: the policy's
  // batch1_rows_per_warp); at batch 2, 4 asks for the CUDA-core kernel with four rows a
  // warp instead of tensor cores (other values: the planner's choice).
  int rows_per_warp = 0;
  GemvPolicy policy;
};

// Why plan_gemv cannot take weight rows of `cols` columns at any batch, or empty. The
// planner refuses by this same rule, and an engine checks a model's projections by it
// before it uploads anything.
std::string gemv_cols_refusal(int cols);

// Picks the batch tile and rows per warp for `batch`, checks sizes and shared memory.
KernelLaunch plan_gemv(const GemvArgs& args);

}  // namespace m3::kernels
