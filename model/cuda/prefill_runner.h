// The CUDA engine's chunked prefill (cuda.prefill: chunked): each run's tokens read as
// GEMMs over the run (kernels/gemm_lt.cuh), per-token row kernels (kernels/prefill_rows.cuh)
// and the chunked scan (kernels/prefill_scan.cuh), in the order prefill_scan.cuh gives;
// then norm_f + lm_head and sampling for each run's last token only, with the decode step's
// own gemv and sampling kernels (planned here at load for every batch up to max_runs).
// Everything (workspace, row buffers, cuBLASLt plans, the pinned run table) is sized at load
// for max_tokens; a call allocates, chooses and plans nothing. A call of one run of at most
// CudaPolicy::prefill_graph_max_tokens tokens replays a graph captured at load for its
// length: the kernels read the run table from the device, so only the length is baked in.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kernels/gemm_lt.cuh"
#include "kernels/launch.cuh"
#include "kernels/mimo_step.cuh"
#include "kernels/prefill_rows.cuh"
#include "kernels/prefill_scan.cuh"
#include "model/config.h"
#include "model/cuda/cuda_handle.h"
#include "model/cuda/device_buffer.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/step_plan.h"
#include "model/cuda_policy.h"
#include "model/engine.h"

namespace m3::cuda {

class PrefillRunner {
 public:
  // Throws std::invalid_argument naming the reason when the scan cannot run the model's
  // head shape. `weights` must outlive the runner; `buffers` (the decode step's state,
  // logits, sampling parameters, counters and last tokens) are used in place. The graphs
  // are captured on `stream` (nothing else may be queued on it meanwhile).
  PrefillRunner(const ModelConfig& config, const DeviceWeights& weights, const StepBuffers& buffers,
                const kernels::MimoStateLayout& layout, const CudaPolicy& policy, int max_runs, int max_tokens,
                cudaStream_t stream);
  ~PrefillRunner();
  PrefillRunner(const PrefillRunner&) = delete;
  PrefillRunner& operator=(const PrefillRunner&) = delete;

  // Why the chunked prefill cannot run this model (empty: it can).
  static std::string refusal(const ModelConfig& config, WeightDType type);

  // Feeds runs[i] to its slot, whose state parity (steps it took since its reset, & 1) is
  // parities[i]; on `stream`, and returns when sampled (and logits, when not empty) are on
  // the host. Arguments checked by the caller (Engine::validate_prefill): at most max_runs
  // runs, max_tokens tokens together, distinct slots. The sampling parameters on the device
  // must be current.
  // True when the call replayed a captured graph.
  bool run(std::span<const PrefillRun> runs, std::span<const int32_t> parities, std::span<int32_t> sampled,
           std::span<float> logits, cudaStream_t stream);

  // Run lengths with a captured graph: 1 to graph_max_tokens() (0: none).
  int graph_max_tokens() const { return static_cast<int>(graphs_.size()); }

 private:
  // Every kernel of a call of n runs, `tokens` tokens and `chunks` chunks together (the
  // longest run max_run_tokens), whose run table is on the device: what a graph captures.
  void enqueue(int n, int tokens, int chunks, int max_run_tokens, cudaStream_t stream);

  // Offsets (in int32) of the run table's parts, host and device alike.
  size_t slot_at() const { return 0; }
  size_t parity_at() const { return static_cast<size_t>(max_runs_); }
  size_t token_begin_at() const { return 2 * static_cast<size_t>(max_runs_); }
  size_t chunk_begin_at() const { return 3 * static_cast<size_t>(max_runs_) + 1; }
  // Each run's last token: the sampling kernel's input token (a sample after an input
  // token is drawn at a mask's frame position 0, as a step would draw it).
  size_t last_token_at() const { return 4 * static_cast<size_t>(max_runs_) + 2; }
  size_t tokens_at() const { return 5 * static_cast<size_t>(max_runs_) + 2; }

  const ModelConfig& config_;
  const DeviceWeights& weights_;
  StepBuffers buffers_;
  kernels::MimoStateLayout layout_;
  int max_runs_ = 0, max_tokens_ = 0;
  kernels::PrefillScanDims dims_;
  kernels::PrefillScanPlan scan_plan_;  // prepare_prefill_scan(dims_)
  bool pdl_;  // CudaPolicy::pdl: the scan's kernels by programmatic dependent launch
  int chunk_tokens_ = 0;
  WeightDType act_ = WeightDType::BF16;

  DeviceBuffer scan_workspace_;
  DeviceBuffer rows_storage_;
  kernels::PrefillRowBuffers rows_;
  DeviceBuffer table_;      // int32 run table (layout above)
  PinnedBuffer table_host_;
  PinnedBuffer sampled_host_;          // int32 [max_runs]
  int32_t* sampled_mapped_ = nullptr;  // as the device addresses it
  std::vector<int32_t> lengths_;       // [max_runs], filled per call

  std::unique_ptr<kernels::LtContext> lt_;
  std::unique_ptr<kernels::LtGemm> in_proj_, out_proj_, fc1_, fc2_;
  // lm_head (norm_f fused) and sampling at batch b: index b - 1.
  std::vector<kernels::KernelLaunch> lm_head_, sampling_;
  // One run of t tokens: index t - 1.
  std::vector<CudaGraphExec> graphs_;
};

}  // namespace m3::cuda
