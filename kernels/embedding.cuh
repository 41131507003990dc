// Embedding gather for one decode step: row b of `out` (fp32) = table[token of entry b].
// The token of entry b is tokens[b], or, when tokens[b] < 0 (continue), the token last
// sampled for slot slots[b] (last_token[slots[b]]), so generation never leaves the device.
#pragma once

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/launch.cuh"
#include "kernels/weight_dtype.h"

namespace m3::kernels {

struct EmbeddingArgs {
  const void* table = nullptr;  // [vocab_rows, dim], WeightDType
  WeightDType type = WeightDType::BF16;
  int vocab_rows = 0;
  int dim = 0;
  const int32_t* slots = nullptr;       // [batch]
  const int32_t* tokens = nullptr;      // [batch], < 0: continue
  const int32_t* last_token = nullptr;  // [n_slots]
  float* out = nullptr;                 // [batch, dim]
  int batch = 0;
  L2Prefetch prefetch[2];  // weights of the first layer, pulled into L2 meanwhile
};

KernelLaunch plan_embedding(const EmbeddingArgs& args);

#if defined(__CUDACC__)
// The token of entry b as above, clamped into the table's vocab_rows: ids are validated on
// the host, and the clamp keeps a corrupted table from ever reading out of range. Shared by
// the embedding kernel and the gemvs that gather their input rows (GemvGather).
__device__ __forceinline__ int step_input_token(const int32_t* tokens, const int32_t* last_token,
                                                const int32_t* slots, int b, int vocab_rows) {
  int token = tokens[b];
  if (token < 0) token = last_token[slots[b]];
  return min(max(token, 0), vocab_rows - 1);
}
#endif

}  // namespace m3::kernels
