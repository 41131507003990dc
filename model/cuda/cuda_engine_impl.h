// The CUDA decode engine: weights and state on the device, every buffer allocated at load,
// and one captured graph per batch bucket (and place in the step queue) that runs the
// whole decode step. make_cuda_engine() (cuda_engine.h) returns one. This file and
// cuda_engine.cu are the Engine API (validation, the step queue); the step itself is
// planned by StepPlanner (step_plan.h), captured and replayed by StepLauncher
// (step_graph.h), chosen among variants by the tuner (step_tuner.h); the profiling hooks
// (profiling.h) are in cuda_engine_profiling.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/mimo_step.cuh"
#include "kernels/sampling.cuh"
#include "model/cuda/cuda_handle.h"
#include "model/cuda/device_buffer.h"
#include "model/cuda/device_masks.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/profiling.h"
#include "model/cuda/slot_state_copy.h"
#include "model/cuda/prefill_runner.h"
#include "model/cuda/step_graph.h"
#include "model/cuda/step_plan.h"
#include "model/engine.h"

namespace m3::cuda {

class CudaEngine final : public Engine, public CudaProfiling {
 public:
  CudaEngine(const ModelWeights& weights, const EngineOptions& options);
  ~CudaEngine() override;
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  // --- Engine ---
  std::string_view backend() const override { return "cuda"; }
  std::string load_report() const override;
  std::string failure() const override { return failure_; }
  const ModelConfig& config() const override { return config_; }
  int max_slots() const override { return max_slots_; }
  int sampling_mask_count() const override { return masks_.size(); }
  void reset(int slot) override;
  void set_sampling(int slot, const SamplingParams& params) override;
  void step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
            std::span<int32_t> sampled, std::span<float> logits = {}) override;
  void submit_step(std::span<const int32_t> slots, std::span<const int32_t> tokens) override;
  void collect_step(std::span<int32_t> sampled) override;
  // cuda.prefill: chunked reads the runs with the chunked kernels (prefill_runner.h);
  // steps leaves prefill() to the base class (a decode step a token).
  void prefill(std::span<const PrefillRun> runs, std::span<int32_t> sampled,
               std::span<float> logits = {}) override;
  int max_prefill_tokens() const override { return prefill_token_budget_; }
  bool has_prefill_path() const override { return prefill_runner_ != nullptr; }
  EngineStats stats() const override { return stats_; }
  // On copy_stream beside the steps (slot_state_copy.h).
  size_t slot_state_bytes() const override { return slot_copier_.bytes(); }
  void save_slot(int slot, std::span<std::byte> out) override;
  void load_slot(int slot, std::span<const std::byte> in) override;
  HostStateBuffer allocate_host_state() const override;
  void load_slot_async(int slot, const HostStateBuffer& in) override;
  void save_slot_async(int slot, HostStateBuffer& out) override;
  bool slot_ready(int slot) const override;

  // --- CudaProfiling (cuda_engine_profiling.cu) ---
  const std::vector<int>& bucket_sizes() const override { return bucket_sizes_; }
  int bucket_for(int batch) const override { return graph_for_batch(batch).plan.batch; }
  bool graphs_enabled() const override { return use_graphs_; }
  int prefill_graph_max_tokens() const override;
  const CudaPolicy& policy() const override { return policy_; }
  StepVariant step_variant(int batch) const override { return graph_for_batch(batch).plan.variant; }
  const std::vector<std::pair<StepVariant, float>>& step_variant_timings(int batch) const override {
    return graph_for_batch(batch).measured;
  }
  int kernels_per_step(int batch) const override;
  StepPlanReport step_plan(int batch) const override;
  std::vector<float> time_replays(int batch, int iters, bool use_graph) override;
  std::vector<KernelTime> time_kernels(int batch, int reps) override;
  double floor_bytes(int batch) const override;

 private:
  // Makes this engine's device the calling thread's current one: a server's scheduler
  // thread steps an engine another thread built, and the runtime's rule is that a call
  // acts on the current device (0 unless set); this keeps every call of a step,
  // stream-ordered or not, on the engine's device.
  void use_device() const;
  // Refuses the call once a CUDA error has left the engine unusable (see failure_).
  void check_usable(const char* fn) const;
  // Throws std::invalid_argument naming `fn` unless 0 <= slot < max_slots.
  void check_slot(const char* fn, int slot) const;
  // Runs `work` (the CUDA part of a call, after its checks) on the engine's device; if it
  // throws, the engine is unusable from then on (failure_) and the error goes on.
  template <typename Work>
  void or_unusable(Work&& work);
  void allocate_buffers();
  // Every bucket's step: its variants planned, the fastest chosen (step_tuner.h), the
  // same step planned again on table 1; then every graph captured (when graphs are on).
  void build_steps();
  void zero_slot(int slot);
  // Orders stream_'s next work after the load_slot_async and save_slot_async copies of
  // these slots still running (the step, prefill or reset about to be queued uses them).
  void wait_for_copies(std::span<const int32_t> slots);
  void wait_for_copy(int32_t slot);
  // The event an async copy of the slot records (made at the slot's first), marked in flight.
  cudaEvent_t async_copy_event(int slot);
  SlotDeviceState device_slot(int slot) const;
  // The sampling parameters to the device (through queue position q's host copy) when
  // set_sampling changed them since the last upload.
  void upload_params_if_dirty(int q);
  // submit_step, and the copy of the step's logits into `logits` (when not empty) before
  // the step counts as done.
  void submit(std::span<const int32_t> slots, std::span<const int32_t> tokens, std::span<float> logits);
  // submit's part after validation, at queue position q (inside or_unusable): the copies,
  // the replay, the bookkeeping.
  void enqueue_step(std::span<const int32_t> slots, std::span<const int32_t> tokens, std::span<float> logits,
                    int q);
  const StepGraph& graph_for_batch(int batch, int table = 0) const;
  // The bucket's graph for m3bench's replays (table 0), after checking the batch.
  const StepGraph& graph_to_time(const char* fn, int batch) const;

  ModelConfig config_;
  CudaPolicy policy_;  // as given, out_proj never fused when `deterministic`
  int max_slots_ = 0;
  int scratch_slot_ = 0;  // padding entries of a bucket point here
  int max_bucket_ = 0;
  bool use_graphs_ = true;
  int device_ = 0;

  CudaStream stream_;
  DeviceWeights weights_;
  kernels::MimoStateLayout layout_;  // one layer's state, computed once for allocation and planning
  int64_t slot_state_floats_ = 0;

  DeviceBuffer state_;       // [max_slots + 1][n_layer][layout_.floats]
  DeviceBuffer res_, w_, o_, act_, logits_;
  // The buckets' projections as GEMMs (cuda.projection_gemm_min_batch; null where none
  // uses them), and the rows only they need.
  std::unique_ptr<StepGemms> step_gemms_;
  DeviceBuffer gemm_u_, gemm_fc1_out_;
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
  DeviceMaskTable masks_;    // EngineOptions::sampling_masks, on the device from load
  DeviceBuffer frame_positions_;  // int32 [max_slots + 1], read and advanced by the sampling kernel
  SlotStateCopier slot_copier_;  // one slot's state to and from host bytes
  // Per slot: the event of its last async copy (load_slot_async, save_slot_async); whether
  // that copy may still run (cleared once slot_ready() sees it done: its buffer is free);
  // and whether stream_ has yet to wait for it (cleared once a wait is queued, so a slot's
  // steps queue that wait once, not every step). The copies run in order on the copier's
  // stream, so the last one's event covers the earlier ones.
  std::vector<CudaEvent> slot_copied_;
  mutable std::vector<uint8_t> copy_in_flight_;
  std::vector<uint8_t> copy_unwaited_;
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

  StepBuffers buffers_;  // the device pointers above, for the planner
  std::unique_ptr<StepLauncher> launcher_;
  std::vector<int> bucket_sizes_;
  std::vector<int> bucket_of_batch_;  // index into graphs_ for 1..max_slots
  std::vector<StepGraph> graphs_;         // per bucket, reading table 0 (m3bench's replays too)
  std::vector<StepGraph> graphs_table1_;  // the same steps reading table 1
  int prefill_token_budget_ = 0;
  std::unique_ptr<PrefillRunner> prefill_runner_;  // cuda.prefill: chunked only
  std::vector<int32_t> prefill_parities_;          // [max_slots], filled per prefill call

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
