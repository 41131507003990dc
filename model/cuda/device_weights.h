// A model's weights on the device, uploaded once at load into one allocation: the
// matrices (embedding, in/out projections, MLP, lm_head) in bf16 or fp32, every small
// vector (norms, biases, MIMO scalings) in fp32.
#pragma once

#include <cstddef>
#include <vector>

#include "kernels/weight_dtype.h"
#include "model/config.h"
#include "model/cuda/device_buffer.h"

namespace m3 {
class ModelWeights;
}

namespace m3::cuda {

struct DeviceLayer {
  const void* in_proj = nullptr;   // [padded_in_proj_rows(), d_model], the padding zeros
  const void* out_proj = nullptr;  // [d_model, d_inner]
  const void* fc1 = nullptr;       // [2F, d_model] or null
  const void* fc2 = nullptr;       // [d_model, F] or null
  const float* norm = nullptr;
  const float* norm2 = nullptr;
  const float* dt_bias = nullptr;
  const float* D = nullptr;
  const float* B_bias = nullptr;
  const float* C_bias = nullptr;
  const float* B_norm = nullptr;
  const float* C_norm = nullptr;
  const float* mimo_x = nullptr;
  const float* mimo_z = nullptr;
  const float* mimo_o = nullptr;
  const float* out_norm = nullptr;  // null unless is_outproj_norm
};

struct DeviceWeights {
  WeightDType type = WeightDType::BF16;
  const void* embedding = nullptr;  // [V, d_model]
  const void* lm_head = nullptr;    // [V, d_model] (the embedding when tied)
  const float* norm_f = nullptr;
  std::vector<DeviceLayer> layers;
  size_t matrix_bytes = 0;  // bytes of the matrices one step reads (lm_head, projections, MLP)
  size_t vector_bytes = 0;  // bytes of the fp32 vectors one step reads
  DeviceBuffer storage;
};

DeviceWeights upload_weights(const ModelWeights& weights, WeightDType type);

}  // namespace m3::cuda
