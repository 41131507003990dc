// The reference decode engine: float32 on the host, exactly the arithmetic of
// ../shared/docs/MAMBA3_MIMO_DECODE.md. Weights are widened to fp32 once at load; every
// buffer a step touches is allocated at load, so step() allocates nothing. The matrix
// work and the per-head recurrence are split over a persistent thread pool.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "model/engine.h"

namespace m3 {

// options.weight_dtype is ignored (always fp32); options.cpu_threads picks the pool size.
// Throws std::invalid_argument for max_slots < 1.
std::unique_ptr<Engine> make_cpu_engine(const ModelWeights& weights, const EngineOptions& options);

// A slot's whole state as the CPU engine holds it, for tests that compare two ways of
// reaching it: every layer's recurrent state (angles, ssm, k_prev, x_prev), the
// random-draw counter and the token kContinueToken would feed (-1: none since reset).
struct CpuSlotSnapshot {
  std::vector<float> state;  // with bf16 state: the fp32 part, then the ssm part widened
  uint64_t counter = 0;
  int32_t next_input = -1;
};
// Throws std::invalid_argument when `engine` is not a CPU engine or the slot is out of range.
CpuSlotSnapshot cpu_slot_snapshot(const Engine& engine, int slot);

}  // namespace m3
