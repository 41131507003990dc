// Embedding gather for one decode step: row b of `out` (fp32) = table[token of entry b].
// The token of entry b is tokens[b], or, when tokens[b] < 0 (continue), the token last
// sampled for slot slots[b] (last_token[slots[b]]), so generation never leaves the device.
#pragma once

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/launch.cuh"

namespace m3::kernels {

enum class WeightType { F32, BF16 };

struct EmbeddingArgs {
  const void* table = nullptr;  // [vocab_rows, dim], WeightType
  WeightType type = WeightType::BF16;
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

}  // namespace m3::kernels
