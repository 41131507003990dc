// The decode step of one batch bucket as a list of kernel launches with their arguments,
// and the planner that builds it from the model, the device buffers and the policy: one
// function a layer kind (the embedding, a mixer layer, an MLP, the head and sampling), the
// recurrent state's layout computed once by the engine and handed down.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/gemv.cuh"
#include "kernels/launch.cuh"
#include "kernels/mimo_step.cuh"
#include "kernels/sampling.cuh"
#include "kernels/token_mask.h"
#include "model/config.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/profiling.h"
#include "model/cuda/step_gemms.h"
#include "model/cuda_policy.h"
#include "model/step_shape.h"

namespace m3::cuda {

struct StepPlan {
  int batch = 0;
  StepVariant variant;  // as planned (out_proj fused only where the shape allows)
  // The step's kernels, chain after chain: chain c is launches[chain_begin[c] ..
  // chain_end(c)) and serves its own share of the batch rows (one chain unless the
  // bucket is split, see StepPlanner::chains_for_batch).
  std::vector<kernels::KernelLaunch> launches;
  std::vector<size_t> chain_begin;
  size_t chain_end(size_t c) const { return c + 1 < chain_begin.size() ? chain_begin[c + 1] : launches.size(); }
  StepPlanReport report() const;  // (measured left empty)
};

// The device memory a step reads and writes, all of it allocated by the engine at load.
struct StepBuffers {
  float* state = nullptr;  // [slots + 1][n_layer][layout.floats]
  int64_t slot_state_floats = 0;
  float* residual = nullptr;  // [max_bucket, d_model]
  float* in_proj_out = nullptr;  // [max_bucket, padded_in_proj_rows]: the in_proj GEMM's rows
  // [max_bucket, d_inner]: fp32, or the weights' type where out_proj is a GEMM.
  float* mixer_out = nullptr;
  // [max_bucket, mlp_width] or null: fp32, or the weights' type where fc2 is a GEMM.
  float* mlp_act = nullptr;
  // Where the projections are GEMMs (StepGemms), else null: the RMS-normed rows of the
  // residual in the weights' type [max_bucket, d_model], and fc1's output (MLP only) fp32
  // [max_bucket, 2 * mlp_width].
  void* gemm_u = nullptr;
  float* gemm_fc1_out = nullptr;
  float* logits = nullptr;     // [max_bucket, padded_vocab]
  // Step tables, each int32 [3 * max_bucket]: slots, tokens, state parities.
  int32_t* tables = nullptr;
  int32_t* sampled = nullptr;  // per table, max_bucket ids (pinned host memory as the device sees it)
  kernels::SlotSampling* sampling = nullptr;  // [slots + 1]
  uint64_t* counters = nullptr;               // [slots + 1]
  int32_t* last_token = nullptr;              // [slots + 1]
  // Constrained sampling: the masks (n_masks 0: none) and each slot's frame position.
  TokenMaskView masks;
  int32_t* frame_positions = nullptr;  // [slots + 1]
  int max_bucket = 0;
  size_t table_ints() const { return 3 * static_cast<size_t>(max_bucket); }
};

class StepPlanner {
 public:
  // Keeps references to all of them: they outlive the planner (the engine's members).
  // `gemms`: the GEMM plans of the buckets that use them (null where none does).
  StepPlanner(const ModelConfig& config, const DeviceWeights& weights, const StepBuffers& buffers,
              const kernels::MimoStateLayout& layout, const CudaPolicy& policy, const StepGemms* gemms);

  // The step of the `batch`-row bucket built the `variant` way, reading device table
  // `table` (one per place in the engine's step queue) and writing its ids into that
  // place's part of the sampled ids.
  StepPlan plan(int batch, const StepVariant& variant, int table) const;

  int chains_for_batch(int batch) const { return step_chains(policy_, layout_.ssm_bf16, batch); }

 private:
  // One chain's share of the step: its rows and where they live.
  struct Chain {
    int row0 = 0, rows = 0;
    bool split = false;  // other chains run beside it
    const int32_t* slots = nullptr;
    const int32_t* tokens = nullptr;
    const int32_t* parities = nullptr;
    int32_t* sampled = nullptr;
    float *residual = nullptr, *in_proj_out = nullptr, *mixer_out = nullptr, *mlp_act = nullptr, *logits = nullptr;
    const StepVariant* variant = nullptr;
    // The projections as GEMMs (null: gemvs), with the chain's rows of their buffers.
    const ChainGemms* gemm = nullptr;
    void* u = nullptr;
    float* fc1_out = nullptr;
  };
  // What a chain's planning found out (for the plan's variant).
  struct Outcome {
    bool out_proj_fused = false;
    int fused_cluster = 0;
  };

  void plan_chain(const Chain& chain, int batch, std::vector<kernels::KernelLaunch>& out, Outcome& outcome) const;
  // The embedding rows: an embedding kernel, or the gather the first in_proj does itself.
  kernels::GemvGather plan_embedding(const Chain& chain, std::vector<kernels::KernelLaunch>& out) const;
  // A mixer layer: in_proj (RMSNorm fused), the recurrence, out_proj (residual add fused,
  // or inside the recurrence).
  void plan_mixer(int layer, const Chain& chain, const kernels::GemvGather& gather,
                  std::vector<kernels::KernelLaunch>& out, Outcome& outcome) const;
  // The layer's gated MLP: fc1 (RMSNorm and gate fused) and fc2 (residual add fused).
  void plan_mlp(int layer, const Chain& chain, std::vector<kernels::KernelLaunch>& out) const;
  // lm_head (final RMSNorm fused) and sampling, which also pulls the next step's first
  // weights into L2.
  void plan_head(const Chain& chain, int batch, std::vector<kernels::KernelLaunch>& out) const;

  // Every projection of the step: y (+)= W . x, x RMS-normalised first when `norm` is
  // given; x rows are `cols` wide and y rows `out_rows` wide.
  kernels::GemvArgs projection(const Chain& chain, const void* weight, int out_rows, int cols, const float* x,
                               const float* norm, float* y, kernels::GemvEpilogue epilogue) const;
  size_t matrix_element_bytes() const;
  // The GEMM path's launches: x's rows RMS-normed by `norm` into the chain's u, and
  // y (+)= x W^T by `gemm` (both on the chain's rows).
  kernels::KernelLaunch norm_rows(const Chain& chain, const float* x, const float* norm, const char* name) const;
  kernels::KernelLaunch gemm_call(const Chain& chain, const kernels::LtGemm& gemm, const void* weight, const void* x,
                                  float* y, const char* name) const;

  const ModelConfig& config_;
  const DeviceWeights& weights_;
  const StepBuffers& buffers_;
  const kernels::MimoStateLayout& layout_;
  const CudaPolicy& policy_;
  const StepGemms* gemms_;
};

}  // namespace m3::cuda
