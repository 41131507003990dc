#include "model/slot_budget.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

namespace m3 {
namespace {

std::string gib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f GiB", bytes / double(1ull << 30));
  return text;
}

std::string mb(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MB", bytes / 1e6);
  return text;
}

}  // namespace

std::string_view state_dtype_name(StateDType dtype) {
  return dtype == StateDType::BF16 ? "bf16" : "fp32";
}

bool parse_state_dtype(std::string_view name, StateDType* out) {
  if (name == "fp32") {
    *out = StateDType::F32;
  } else if (name == "bf16") {
    *out = StateDType::BF16;
  } else {
    return false;
  }
  return true;
}

int64_t slot_state_bytes(const ModelConfig& config, StateDType state_dtype) {
  const int64_t ssm = int64_t{config.n_heads()} * config.ssm.headdim * config.ssm.d_state;
  const int64_t rest = config.state_floats_per_layer() - ssm;  // angles, k_prev, x_prev: fp32
  return (4 * rest + (state_dtype == StateDType::BF16 ? 2 : 4) * ssm) * config.n_layer;
}

int64_t slot_step_buffer_bytes(const ModelConfig& config) {
  // The step's GEMMs (cuda.projection_gemm_min_batch) add the normed rows and fc1's output.
  const int64_t floats = int64_t{config.d_model} + config.padded_in_proj_rows() + config.d_inner() + config.mlp_width() +
                         config.padded_vocab() + config.d_model + 2 * int64_t{config.mlp_width()};
  // + the sampling parameters, counters, last tokens and step tables (under 128 bytes).
  return 4 * floats + 128;
}

int64_t weight_bytes(const ModelConfig& config, WeightDType weight_dtype) {
  return (weight_dtype == WeightDType::BF16 ? 2 : 4) * config.parameter_count();
}

MaxBatchChoice cuda_auto_max_batch(uint64_t free_bytes, const ModelConfig& config,
                                   WeightDType weight_dtype, StateDType state_dtype) {
  const double free = static_cast<double>(free_bytes);
  const double headroom = std::max(0.10 * free, double(2ull << 30));
  const double weights = static_cast<double>(weight_bytes(config, weight_dtype));
  const double state = static_cast<double>(slot_state_bytes(config, state_dtype));
  const double per_slot = state + static_cast<double>(slot_step_buffer_bytes(config));
  const double usable = free - headroom - weights;
  const std::string terms = "cuda: " + gib(free) + " free, " + mb(per_slot) + " a slot (" +
                            mb(state) + " " + std::string(state_dtype_name(state_dtype)) +
                            " state), " + gib(weights) + " of weights, " + gib(headroom) +
                            " headroom";
  const double fits = usable > 0 ? usable / per_slot : 0.0;
  if (fits < 1.0) {
    throw std::runtime_error("max_batch auto: not one slot fits on the cuda device (" + terms +
                             "); set max_batch, or free device memory");
  }
  MaxBatchChoice choice;
  if (fits >= kMaxBatchLimit) {
    choice.max_batch = kMaxBatchLimit;
    choice.reason = terms + "; capped at " + std::to_string(kMaxBatchLimit);
  } else {
    const int n = static_cast<int>(fits);
    choice.max_batch = n >= 64 ? n / 64 * 64 : n;
    choice.reason = terms + (n >= 64 ? "; a multiple of 64" : "");
  }
  return choice;
}

MaxBatchChoice cpu_auto_max_batch(int cores) {
  MaxBatchChoice choice;
  choice.max_batch = std::clamp(cores, 8, kMaxBatchLimit);
  choice.reason = "cpu engine, " + std::to_string(cores) + (cores == 1 ? " core" : " cores") +
                  (cores < 8 ? "; at least 8" : "");
  return choice;
}

}  // namespace m3
