// How the kernel planners choose among their variants, where a choice is not fixed by the
// arguments: passed to plan_gemv (GemvArgs::policy) and plan_mimo_step as an argument, set
// by the engine from its CudaPolicy (model/cuda_policy.h). Every default here is the plan
// the engine runs unless configured otherwise; kernels/README.md says why each is what it
// is. Plain C++, so code built without CUDA includes it.
#pragma once

#include <string>

namespace m3::kernels {

// Where a kernel lets the next kernel in its stream launch (programmatic dependent
// launch), so that the next kernel's blocks issue their weight loads while this one runs.
// The values are the kernels' trigger codes (pdl_trigger in common.cuh).
enum class PdlTrigger { AtEnd = 0, AfterWait = 1, BeforeWait = 2 };

struct GemvPolicy {
  PdlTrigger trigger = PdlTrigger::BeforeWait;
  // CUDA-core rows a warp at batch 1 where GemvArgs::rows_per_warp is 0 (2 or 4): fewer
  // blocks than one row a warp, so they become resident beside the running kernel sooner.
  int batch1_rows_per_warp = 2;
  // bf16 weights take the tensor-core kernels from this batch (batch 1 is faster on CUDA
  // cores), and among those the row-block kernel (128 rows a block, a cluster summing its
  // columns) from row_block_min_batch (0: never; below batch 8 only for matrices of 16 or
  // more row blocks).
  int tensor_core_min_batch = 2;
  int row_block_min_batch = 2;
  // The row-block kernel's cluster size (2, 4 or 8) and batch tile (8, 16, 32 or 64);
  // 0: chosen by its cost model.
  int row_block_cluster = 0;
  int row_block_batch_tile = 0;
};

// Where the recurrence lets the next kernel launch: chosen by batch (Planned), or one
// point at every batch; after its first barrier (in_proj's outputs in) or its second (the
// norms done) are its own points beside the three every kernel has.
enum class RecurrenceTrigger { Planned = -1, AtEnd = 0, AfterWait = 1, BeforeWait = 2, AfterInputs = 3, AfterNorms = 4 };

// How the tensor-core recurrence loads its state: streamed (no L1 allocation, 256-byte
// L2 fetches) or by plain loads; Planned: streamed in single-chain buckets up to batch 16.
enum class StateLoad { Planned, Plain, Streamed };

struct MimoStepPolicy {
  RecurrenceTrigger trigger = RecurrenceTrigger::Planned;
  StateLoad state_load = StateLoad::Planned;
  // Tensor-core kernel: warps a 16-row tile (1, 2 or 4); 0: two unless one-warp tiles
  // take fewer waves of blocks.
  int tc_column_split = 0;
  // CUDA-core kernel: state rows a block below batch 8 (16 or 8), and the batch from which
  // a block takes a whole 64-row head.
  int small_batch_rows = 16;
  int whole_head_min_batch = 4;
  // Tensor-core recurrence: the streaming kernel (persistent blocks, each stepping one
  // head of many sequences with the next ones' state already on its way into shared
  // memory; mimo_step_stream.cu) from this batch, where its shape applies; 0: never.
  int streaming_min_batch = 0;
};

// Why a policy cannot be planned by ("row_block_cluster must be 0 (planned), 2, 4 or 8,
// got 3"), naming its field, or empty. The planners refuse by these, and the engine's
// configuration checks its values by them before anything loads.
std::string gemv_policy_refusal(const GemvPolicy& policy);
std::string mimo_step_policy_refusal(const MimoStepPolicy& policy);

}  // namespace m3::kernels
