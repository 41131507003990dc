// The CUDA decode engine. make_cuda_engine() (model/cuda_engine.h) returns one; m3bench
// and the tests include this header for the timing and accounting hooks the Engine
// interface does not carry.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/launch.cuh"
#include "kernels/mimo_step.cuh"
#include "kernels/sampling.cuh"
#include "model/cuda/cuda_handle.h"
#include "model/cuda/device_buffer.h"
#include "model/cuda/device_weights.h"
#include "model/engine.h"

namespace m3::cuda {

// How a bucket's step is built where there is more than one way (small buckets, whose
// step is a chain of short dependent kernels: which way is faster differs from GPU to
// GPU, so the engine measures them at load; cuda_engine_tuning.cu).
struct StepVariant {
  bool out_proj_fused = false;      // out_proj inside the recurrence, added by atomics
  bool embedding_gathered = false;  // the first in_proj reads the embedding rows itself
  int gemv_rows_per_warp = 0;       // CUDA-core gemvs' rows a warp (batch 1; batch 2: 0 = tensor cores)
  int fused_cluster = 0;            // out_proj fused on tensor cores: blocks a cluster sums (0: n/a)
  bool operator==(const StepVariant&) const = default;
};
std::string to_string(const StepVariant& v);

// The launches of one decode step for one batch bucket, and its captured graph.
struct DecodeGraph {
  int batch = 0;
  StepVariant variant;  // as planned (out_proj fused only where the shape allows)
  // The step's kernels, chain after chain: chain c is launches[chain_begin[c] ..
  // chain_begin[c + 1]) and serves its own share of the batch rows (one chain unless the
  // bucket is split, see chains_for_batch).
  std::vector<kernels::KernelLaunch> launches;
  std::vector<size_t> chain_begin;
  CudaGraph graph;
  CudaGraphExec exec;
  // Every candidate measured at load, us per step (empty where there was one).
  std::vector<std::pair<StepVariant, float>> measured;
};

class CudaEngine final : public Engine {
 public:
  CudaEngine(const ModelWeights& weights, const EngineOptions& options);
  ~CudaEngine() override;
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  std::string_view backend() const override { return "cuda"; }
  std::string load_report() const override;
  std::string failure() const override { return failure_; }
  const ModelConfig& config() const override { return config_; }
  int max_slots() const override { return max_slots_; }
  void reset(int slot) override;
  void set_sampling(int slot, const SamplingParams& params) override;
  void step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
            std::span<int32_t> sampled, std::span<float> logits = {}) override;
  void submit_step(std::span<const int32_t> slots, std::span<const int32_t> tokens) override;
  void collect_step(std::span<int32_t> sampled) override;
  EngineStats stats() const override { return stats_; }

  // --- for m3bench and tests ---
  const std::vector<int>& bucket_sizes() const { return bucket_sizes_; }
  bool graphs_enabled() const { return use_graphs_; }
  bool pdl_enabled() const { return pdl_; }
  bool l2_prefetch_enabled() const { return l2_prefetch_; }
  // The variant that serves `batch` sequences, and what was measured to choose it.
  StepVariant step_variant(int batch) const { return graph_for_batch(batch).variant; }
  const std::vector<std::pair<StepVariant, float>>& step_variant_timings(int batch) const {
    return graph_for_batch(batch).measured;
  }
  int kernels_per_step(int batch) const;
  int bucket_for(int batch) const { return graph_for_batch(batch).batch; }
  // Replays the step of the bucket that serves `batch` sequences about `iters` times on
  // device table 0 as the last step submitted at queue position 0 left it (graph or
  // direct launches), back to back in groups of 10 between CUDA events; returns each
  // group's mean microseconds per step. The replays bypass step()'s bookkeeping: reset
  // the slots before real use.
  std::vector<float> time_replays(int batch, int iters, bool use_graph);
  // Each kernel of the step run alone `reps` times back to back (no graph, no overlap):
  // the mean device time of one run, per launch in step order. Leaves the state of the
  // batch's slots scrambled: reset them afterwards.
  struct KernelTime {
    std::string name;
    float us;
  };
  std::vector<KernelTime> time_kernels(int batch, int reps);
  // Bytes a step of `batch` sequences must move at least: weights read, state read and
  // written, embedding rows, logits written.
  double floor_bytes(int batch) const;

 private:
  // Makes this engine's device the calling thread's current one: a server's scheduler
  // thread steps an engine another thread built, and the runtime's rule is that a call
  // acts on the current device (0 unless set). With CUDA 13 the step's stream-ordered
  // calls went to their stream's device even without this (PERFORMANCE_NOTES.md run 227);
  // it keeps every call of a step, stream-ordered or not, on the engine's device.
  void use_device() const;
  // Refuses the call once a CUDA error has left the engine unusable (see failure_).
  void check_usable(const char* fn) const;
  // Runs `work` (the CUDA part of a call, after its checks) on the engine's device; if it
  // throws, the engine is unusable from then on (failure_) and the error goes on.
  template <typename Work>
  void or_unusable(Work&& work);
  void build_plans();
  // The step reads the device table `table` (0 or 1: see table_) and writes its ids into
  // that position's part of sampled_host_.
  DecodeGraph plan_step(int batch, StepVariant variant, int table = 0) const;
  std::vector<StepVariant> step_variant_candidates(int batch) const;
  DecodeGraph choose_step_variant(std::vector<DecodeGraph> candidates);
  float replay_group_us(const DecodeGraph& g, bool use_graph, int group);
  void capture(DecodeGraph& g);
  void capture_graphs();
  void run_plan(const DecodeGraph& g, bool use_graph);
  void launch_chains(const DecodeGraph& g);
  void zero_slot(int slot);
  // submit_step, and the copy of the step's logits into `logits` (when not empty) before
  // the step counts as done.
  void submit(std::span<const int32_t> slots, std::span<const int32_t> tokens, std::span<float> logits);
  // submit's part after validation, at queue position q (inside or_unusable): the copies,
  // the replay, the bookkeeping.
  void enqueue_step(std::span<const int32_t> slots, std::span<const int32_t> tokens, std::span<float> logits,
                    int q);
  int chains_for_batch(int batch) const;
  const DecodeGraph& graph_for_batch(int batch, int table = 0) const;

  ModelConfig config_;
  int max_slots_ = 0;
  int scratch_slot_ = 0;  // padding entries of a bucket point here
  int max_bucket_ = 0;
  bool use_graphs_ = true;
  bool pdl_ = true;
  // Small buckets' step variants: -1 measured at load, 0 never, 1 where the shape allows
  // (M3_CUDA_FUSED_OUT_PROJ / M3_CUDA_FUSED_EMBEDDING; `deterministic` keeps out_proj out).
  int out_proj_fusion_ = -1;
  int embedding_gather_ = -1;
  // CUDA-core gemv rows a warp at batch 1 (2 or 4) and 2 (0: tensor cores, or 4): 0
  // measured, else fixed (M3_GEMV_SMALL_RPW; at batch 2, 4 -> 4 and 1 or 2 -> 0).
  int gemv_rows_per_warp_ = 0;
  int fused_cluster_ = 0;       // fused out_proj: 0 measured (4 or 8), else fixed (M3_MIMO_TC_FUSED_CLUSTER)
  int mimo_tc_min_batch_ = 1;  // bf16: tensor-core recurrence from this batch (M3_MIMO_TC_MIN_BATCH)
  int tc_fuse_max_batch_ = 2;  // ... with out_proj fused up to this batch (M3_MIMO_TC_FUSE_MAX_BATCH)
  bool l2_prefetch_ = false;  // measured slower at batch 1 (notes); M3_CUDA_L2_PREFETCH=1 turns it on
  int device_ = 0;

  CudaStream stream_;
  // Streams and events that fork the step's chains off stream_ and join them back.
  std::vector<CudaStream> chain_streams_;
  CudaEvent fork_event_;
  std::vector<CudaEvent> join_events_;
  int forced_chains_ = 0;  // M3_CUDA_CHAINS (A/B): chains per bucket, 0 = planned
  // The sampling kernels pull the next step's first weights into L2 (M3_CUDA_NEXT_STEP_PREFETCH=0: not).
  bool next_step_prefetch_ = true;
  DeviceWeights weights_;
  kernels::MimoStateLayout layout_;
  int64_t slot_state_floats_ = 0;

  DeviceBuffer state_;       // [max_slots + 1][n_layer][layout_.floats]
  DeviceBuffer res_, w_, o_, act_, logits_;
  // Two step tables, one per position in the queue's ring, each int32 [table_ints()]:
  // slots, tokens, state parities (max_bucket each). A queued step's table is copied on
  // table_stream_ while the step before it runs (the other table), so no copy sits
  // between two steps.
  DeviceBuffer table_;
  CudaStream table_stream_;
  CudaEvent table_ready_[kMaxQueuedSteps];
  DeviceBuffer params_dev_;  // SlotSampling [max_slots + 1]
  DeviceBuffer counters_;    // uint64 [max_slots + 1]
  DeviceBuffer last_token_;  // int32 [max_slots + 1]
  // Per queued step (kMaxQueuedSteps of each, by position in the queue's ring): the table
  // and sampling parameters it copies to the device (a later step's host side must not
  // change them before the copies run), its ids (written by the sampling kernels of the
  // graphs of its position: max_bucket from position * max_bucket) and the event that says
  // it is done.
  PinnedBuffer table_host_, params_host_;
  PinnedBuffer sampled_host_;
  int32_t* sampled_mapped_ = nullptr;  // sampled_host_ as the device addresses it
  CudaEvent step_done_[kMaxQueuedSteps];
  size_t table_ints() const { return 3 * static_cast<size_t>(max_bucket_); }
  std::vector<kernels::SlotSampling> params_;  // as set_sampling left them

  std::vector<int> bucket_sizes_;
  std::vector<int> bucket_of_batch_;  // index into graphs_ for 1..max_slots
  std::vector<DecodeGraph> graphs_;   // per bucket, reading table 0 (m3bench's replays too)
  std::vector<DecodeGraph> graphs_table1_;  // the same steps reading table 1
  std::vector<CudaEvent> timing_events_;

  bool params_dirty_ = true;
  std::vector<uint8_t> has_sample_;
  std::vector<uint64_t> steps_since_reset_;  // its parity picks the double-buffered state
  std::vector<uint64_t> seen_in_step_;
  uint64_t step_serial_ = 0;
  EngineStats stats_;
  // Set when a CUDA call failed after a step, reset or collection had started on the
  // device: what is queued there and the host's bookkeeping (state parities, queue) may
  // disagree, so every later step would risk wrong tokens. Empty while usable.
  std::string failure_;
};

}  // namespace m3::cuda
