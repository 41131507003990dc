// What one engine slot costs, and the max_batch `auto` chooses from it: on CUDA from the
// device's free memory and the per-slot state, on the CPU from its cores. Pure functions
// of their arguments, so the sizing is tested without a device.
#pragma once

#include <cstdint>
#include <string>

#include "model/config.h"
#include "model/engine.h"

namespace m3 {

inline constexpr int kMaxBatchLimit = 4096;  // the most slots an engine is configured with

// Bytes of recurrent state one sequence holds (every layer's angle, ssm, k_prev, x_prev);
// with bf16 state the ssm part (the bulk) takes 2 bytes an element, the rest stays fp32.
int64_t slot_state_bytes(const ModelConfig& config, StateDType state_dtype);
// Bytes the CUDA engine's step buffers take per slot of its largest bucket (residual,
// in_proj output, mixer output, MLP activation, logits, the GEMMs' normed rows and fc1
// output, tables): fp32 throughout.
int64_t slot_step_buffer_bytes(const ModelConfig& config);
// Bytes the weights take on the device.
int64_t weight_bytes(const ModelConfig& config, WeightDType weight_dtype);

struct MaxBatchChoice {
  int max_batch = 1;
  std::string reason;  // for the start log: "cuda: 120.3 GiB free, 27.6 MB a slot, ..."
};

// Slots that fit in `free_bytes` of device memory once the weights and a headroom (for the
// CUDA context's growth, the captured graphs and kernel workspaces: 10% of what is free,
// at least 2 GiB) are set aside; at most kMaxBatchLimit, a multiple of 64 from 64 on.
// Throws std::runtime_error when not one slot fits.
MaxBatchChoice cuda_auto_max_batch(uint64_t free_bytes, const ModelConfig& config,
                                   WeightDType weight_dtype, StateDType state_dtype);

// One slot per core, at least 8: a CPU step reads every weight once for the whole batch,
// so a few more sequences than cores cost little, and fewer than 8 would queue clients on
// a small machine.
MaxBatchChoice cpu_auto_max_batch(int cores);

}  // namespace m3
