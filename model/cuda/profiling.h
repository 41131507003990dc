// The CUDA engine's profiling interface, for m3bench and the tests: the plan it built for
// each batch bucket, what it measured at load to choose it, and timing hooks the Engine
// interface does not carry. Plain C++: its users need no CUDA headers.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "model/cuda_policy.h"

namespace m3 {
class Engine;
}

namespace m3::cuda {

// How a bucket's step is built where there is more than one way (small buckets, whose
// step is a chain of short dependent kernels: which way is faster differs from GPU to
// GPU, so the engine measures them at load; step_tuner.cu).
struct StepVariant {
  bool out_proj_fused = false;      // out_proj inside the recurrence, added by atomics
  bool embedding_gathered = false;  // the first in_proj reads the embedding rows itself
  int gemv_rows_per_warp = 0;       // CUDA-core gemvs' rows a warp (batch 1; batch 2: 0 = tensor cores)
  int fused_cluster = 0;            // out_proj fused on tensor cores: blocks a cluster sums (0: n/a)
  bool operator==(const StepVariant&) const = default;
};
std::string to_string(const StepVariant& v);

// One kernel launch of a planned step, as the planners chose it.
struct PlannedKernel {
  std::string name;     // "in_proj", "mimo_step_tc", "out_proj", ...
  std::string variant;  // the planner's choices: "tensor cores, 128-row blocks, batch tile 16, cluster 4, ..."
  unsigned grid[3] = {0, 0, 0};
  unsigned block[3] = {0, 0, 0};
  size_t dynamic_smem = 0;
};

// A bucket's step as planned: its chains (side by side, each the whole step for its share
// of the rows), each its kernels in launch order, and the variants measured to choose it.
struct StepPlanReport {
  int bucket = 0;
  StepVariant variant;
  std::vector<std::vector<PlannedKernel>> chains;
  std::vector<std::pair<StepVariant, float>> measured;  // us per step; empty where one variant applied
};
// "bucket 4: 1 chain, out_proj separate, embedding gathered\n  chain 0: in_proj [tensor
// cores, ...] x14, ...": consecutive launches of one kernel and variant counted once.
std::string to_string(const StepPlanReport& report);

class CudaProfiling {
 public:
  virtual ~CudaProfiling() = default;
  virtual const std::vector<int>& bucket_sizes() const = 0;
  virtual int bucket_for(int batch) const = 0;  // the bucket that serves `batch` sequences
  virtual bool graphs_enabled() const = 0;
  // The policy the engine planned by (with `deterministic`, out_proj never fused).
  virtual const CudaPolicy& policy() const = 0;
  // The variant that serves `batch` sequences, and what was measured to choose it.
  virtual StepVariant step_variant(int batch) const = 0;
  virtual const std::vector<std::pair<StepVariant, float>>& step_variant_timings(int batch) const = 0;
  virtual int kernels_per_step(int batch) const = 0;
  virtual StepPlanReport step_plan(int batch) const = 0;
  // Replays the step of the bucket that serves `batch` sequences about `iters` times on
  // device table 0 as the last step submitted at queue position 0 left it (graph or
  // direct launches), back to back in groups of 10 between CUDA events; returns each
  // group's mean microseconds per step. The replays bypass step()'s bookkeeping: reset
  // the slots before real use.
  virtual std::vector<float> time_replays(int batch, int iters, bool use_graph) = 0;
  // Each kernel of the step run alone `reps` times back to back (no graph, no overlap):
  // the mean device time of one run, per launch in step order. Leaves the state of the
  // batch's slots scrambled: reset them afterwards.
  struct KernelTime {
    std::string name;
    float us;
  };
  virtual std::vector<KernelTime> time_kernels(int batch, int reps) = 0;
  // Bytes a step of `batch` sequences must move at least: weights read, state read and
  // written, embedding rows, logits written.
  virtual double floor_bytes(int batch) const = 0;
  // Chunked prefill: lone runs of 1 to this many tokens replay a graph captured at load
  // (0: none, or no chunked prefill).
  virtual int prefill_graph_max_tokens() const = 0;
};

// `engine`'s profiling interface, or nullptr when it is not the CUDA engine.
CudaProfiling* cuda_profiling(Engine& engine);

}  // namespace m3::cuda
