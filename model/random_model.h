// Model directories with random weights of a given config: for tests, benchmarks and
// the demo model the server serves when none is given. The values are drawn so that a
// forward pass stays in a healthy range (no blow-up over hundreds of tokens) and no
// parameter is an identity by accident.
#pragma once

#include <cstdint>
#include <filesystem>

#include "model/config.h"
#include "model/tensor.h"

namespace m3 {

// Writes `dir`/config.json and `dir`/model.safetensors (dtype F32, BF16 or F16), creating
// `dir` if needed. Same (config, seed, dtype) -> byte-identical files.
void write_random_model(const ModelConfig& config, uint64_t seed, DType dtype,
                        const std::filesystem::path& dir);

}  // namespace m3
