// The CUDA backend's entry points, for make_engine() only; the server never sees them.
#pragma once

#include <memory>

#include "model/engine.h"

namespace m3 {

std::unique_ptr<Engine> make_cuda_engine(const ModelWeights& weights, const EngineOptions& options);
int cuda_device_count();  // 0 when no driver or no device

}  // namespace m3
