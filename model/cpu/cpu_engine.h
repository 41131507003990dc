// The reference decode engine: float32 on the host, exactly the arithmetic of
// ../shared/docs/MAMBA3_MIMO_DECODE.md. Weights are widened to fp32 once at load; every
// buffer a step touches is allocated at load, so step() allocates nothing. The matrix
// work and the per-head recurrence are split over a persistent thread pool.
#pragma once

#include <memory>

#include "model/engine.h"

namespace m3 {

// options.weight_dtype is ignored (always fp32); options.cpu_threads picks the pool size.
// Throws std::invalid_argument for max_slots < 1.
std::unique_ptr<Engine> make_cpu_engine(const ModelWeights& weights, const EngineOptions& options);

}  // namespace m3
