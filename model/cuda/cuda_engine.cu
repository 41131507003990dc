// The CUDA engine's Engine API: load (buffers, the steps planned and captured), argument
// checks, the step queue. A step costs one small H2D copy of the slot table and one graph
// launch, whose sampling kernels write the sampled ids straight into pinned host memory.
#include "model/cuda/cuda_engine.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/common.cuh"
#include "kernels/gemv.cuh"
#include "model/cpu/cpu_sampling.h"
#include "model/decode_buckets.h"
#include "model/cuda/cuda_engine_impl.h"
#include "model/cuda/step_tuner.h"
#include "model/weights.h"

namespace m3 {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::unique_ptr<Engine> make_cuda_engine(const ModelWeights& weights, const EngineOptions& options) {
  return std::make_unique<cuda::CudaEngine>(weights, options);
}

namespace cuda {
namespace {

std::string slot_context(const char* fn, int slot) {
  return std::string(fn) + ": slot " + std::to_string(slot);
}

// What the kernels need of a model's shape, checked before anything is uploaded or
// allocated and said in the config's terms, by the planners' own rules (a planner would
// refuse later, naming kernel arguments). The CPU engine runs any config that validates.
void check_config_supported(const ModelConfig& c) {
  auto refuse = [](const std::string& key, int value, const std::string& rule) {
    throw std::invalid_argument("cuda engine: cannot run this model: " + key + " = " + std::to_string(value) + " " +
                                rule + " (the cpu backend can)");
  };
  // Every projection's input: in_proj and lm_head read d_model, out_proj d_inner, the
  // MLP's down projection its width.
  auto check_projection_input = [&](const std::string& key, int cols) {
    if (const std::string why = kernels::gemv_cols_refusal(cols); !why.empty()) refuse(key, cols, why);
  };
  check_projection_input("d_model", c.d_model);
  check_projection_input("d_inner (ssm_cfg.expand * d_model)", c.d_inner());
  if (c.has_mlp()) check_projection_input("the MLP width (d_intermediate rounded up to 128)", c.mlp_width());
  if (const auto r = kernels::mimo_step_shape_refusal(c.ssm.headdim, c.ssm.d_state, c.ssm.mimo_rank)) {
    refuse("ssm_cfg." + r->dimension, r->value, r->rule);
  }
}

// state_dtype bf16: only the tensor-core recurrence stores bf16 state, so every batch must
// take it (bf16 weights, a head shape it runs, tensor cores from batch 1).
void check_bf16_state_supported(const ModelConfig& c, const EngineOptions& options, const CudaPolicy& policy) {
  auto refuse = [](const std::string& why) {
    throw std::invalid_argument("cuda engine: state_dtype bf16 " + why + " (state_dtype fp32 can)");
  };
  if (options.weight_dtype != WeightDType::BF16) {
    refuse("needs weight_dtype bf16: the recurrence that stores bf16 state runs on tensor cores, for bf16 weights");
  }
  if (policy.recurrence_tensor_core_min_batch != 1) {
    refuse("needs cuda.recurrence_tensor_core_min_batch 1 (got " +
           std::to_string(policy.recurrence_tensor_core_min_batch) +
           "): the CUDA-core recurrence stores fp32 state only");
  }
  kernels::MimoStepArgs shape;
  shape.heads = c.n_heads();
  shape.headdim = c.ssm.headdim;
  shape.d_state = c.ssm.d_state;
  shape.rank = c.ssm.mimo_rank;
  shape.n_angles = c.n_angles();
  if (!kernels::mimo_step_tc_applies(shape)) {
    refuse("needs a head shape the tensor-core recurrence runs: mimo_rank 1, 2 or 4 (got " +
           std::to_string(c.ssm.mimo_rank) + "), headdim a multiple of 16 up to 64 (got " +
           std::to_string(c.ssm.headdim) + "), d_state a multiple of 16 up to 128 (got " +
           std::to_string(c.ssm.d_state) + ")");
  }
}

}  // namespace

CudaEngine::CudaEngine(const ModelWeights& weights, const EngineOptions& options)
    : config_(weights.config()),
      policy_(options.cuda),
      max_slots_(options.max_slots),
      scratch_slot_(options.max_slots),
      use_graphs_(options.use_graphs),
      device_(options.device),
      prefill_token_budget_(options.max_prefill_tokens) {
  if (max_slots_ < 1) {
    throw std::invalid_argument("cuda engine: max_slots must be at least 1, got " +
                                std::to_string(max_slots_));
  }
  policy_.validate();
  if (options.deterministic) policy_.step_variants.out_proj_fused = Tuned::Off;  // the fused out_proj adds with atomics
  if (!options.use_graphs) policy_.prefill_graph_max_tokens = 0;  // no graphs at all, the prefill's neither
  const int devices = cuda_device_count();
  if (device_ < 0 || device_ >= devices) {
    throw std::runtime_error("cuda engine: device " + std::to_string(device_) + " requested, " +
                             std::to_string(devices) + " visible");
  }
  M3_CUDA_CHECK(cudaSetDevice(device_));
  check_config_supported(config_);
  const bool bf16_state = options.state_dtype == StateDType::BF16;
  if (bf16_state) check_bf16_state_supported(config_, options, policy_);
  // Refused before anything is uploaded, in the config's terms, when chunked was asked for.
  const std::string chunked_refusal = PrefillRunner::refusal(config_, options.weight_dtype);
  if (policy_.prefill == PrefillPath::Chunked && !chunked_refusal.empty()) {
    throw std::invalid_argument("cuda engine: cuda.prefill: chunked cannot run this model: " + chunked_refusal +
                                " (cuda.prefill: steps can)");
  }
  const bool chunked_prefill = policy_.prefill == PrefillPath::Chunked ||
                               (policy_.prefill == PrefillPath::Auto && chunked_refusal.empty());
  M3_CUDA_CHECK(cudaStreamCreateWithFlags(stream_.out(), cudaStreamNonBlocking));
  M3_CUDA_CHECK(cudaStreamCreateWithFlags(table_stream_.out(), cudaStreamNonBlocking));
  for (auto& e : table_ready_) M3_CUDA_CHECK(cudaEventCreateWithFlags(e.out(), cudaEventDisableTiming));
  launcher_ = std::make_unique<StepLauncher>(stream_, policy_.pdl);

  const ModelConfig& c = config_;
  weights_ = upload_weights(weights, options.weight_dtype);
  layout_ = kernels::mimo_state_layout(c.n_heads(), c.ssm.headdim, c.ssm.d_state, c.ssm.mimo_rank, c.n_angles(),
                                       bf16_state);
  slot_state_floats_ = layout_.floats * c.n_layer;

  // The gemvs take any shape; the GEMMs only rows of whole 16-byte pieces.
  if (!step_gemm_refusal(c).empty()) policy_.projection_gemm_min_batch = 0;
  bucket_sizes_ = decode_bucket_sizes(max_slots_, policy_.buckets_per_octave);
  max_bucket_ = max_slots_;
  bucket_of_batch_.assign(max_slots_ + 1, 0);
  for (int n = 1, g = 0; n <= max_slots_; ++n) {
    while (bucket_sizes_[g] < n) ++g;
    bucket_of_batch_[n] = g;
  }
  masks_ = DeviceMaskTable(SamplingMaskTable(options.sampling_masks, c.vocab_size));
  const std::vector<std::vector<int>> gemm_rows = step_gemm_chain_rows(policy_, layout_.ssm_bf16, bucket_sizes_);
  if (!gemm_rows.empty()) step_gemms_ = std::make_unique<StepGemms>(c, options.weight_dtype, gemm_rows);
  allocate_buffers();
  params_.assign(max_slots_ + 1, kernels::SlotSampling{});
  has_sample_.assign(max_slots_, 0);
  steps_since_reset_.assign(max_slots_, 0);
  seen_in_step_.assign(max_slots_, 0);
  slot_copied_.resize(max_slots_);
  copy_in_flight_.assign(max_slots_, 0);
  copy_unwaited_.assign(max_slots_, 0);
  for (auto& e : step_done_) M3_CUDA_CHECK(cudaEventCreateWithFlags(e.out(), cudaEventDisableTiming));

  if (step_gemms_ != nullptr) {
    const DeviceLayer& l0 = weights_.layers[0];
    step_gemms_->load_kernels({l0.in_proj, l0.out_proj, weights_.lm_head, l0.fc1, l0.fc2, buffers_.gemm_u,
                               buffers_.mixer_out, buffers_.mlp_act, buffers_.in_proj_out, buffers_.residual,
                               buffers_.logits, buffers_.gemm_fc1_out},
                              stream_);
  }
  build_steps();
  if (chunked_prefill) {
    prefill_runner_ = std::make_unique<PrefillRunner>(config_, weights_, buffers_, layout_, policy_, max_slots_,
                                                      prefill_token_budget_, stream_);
    prefill_parities_.assign(max_slots_, 0);
  }
  zero_slot(scratch_slot_);  // the variants' trial steps ran on it
  M3_CUDA_CHECK(cudaDeviceSynchronize());
}

// Every buffer a step touches, at its largest bucket, zeroed; both device step tables
// point every row at the scratch slot.
void CudaEngine::allocate_buffers() {
  const ModelConfig& c = config_;
  const int n_all = max_slots_ + 1;  // + the scratch slot
  const size_t B = max_bucket_;
  state_ = DeviceBuffer(sizeof(float) * slot_state_floats_ * n_all, "recurrent state");
  res_ = DeviceBuffer(sizeof(float) * B * c.d_model, "residual stream");
  w_ = DeviceBuffer(sizeof(float) * B * c.padded_in_proj_rows(), "in_proj output");
  o_ = DeviceBuffer(sizeof(float) * B * c.d_inner(), "mixer output");
  if (c.has_mlp()) act_ = DeviceBuffer(sizeof(float) * B * c.mlp_width(), "mlp activation");
  if (step_gemms_ != nullptr) {
    gemm_u_ = DeviceBuffer(sizeof(float) * B * c.d_model, "normed rows for the step's GEMMs");
    M3_CUDA_CHECK(cudaMemset(gemm_u_.get(), 0, gemm_u_.bytes()));
    if (c.has_mlp()) gemm_fc1_out_ = DeviceBuffer(sizeof(float) * B * 2 * c.mlp_width(), "fc1 output");
  }
  logits_ = DeviceBuffer(sizeof(float) * B * c.padded_vocab(), "logits");
  table_ = DeviceBuffer(sizeof(int32_t) * table_ints() * kMaxQueuedSteps, "step tables");
  params_dev_ = DeviceBuffer(sizeof(kernels::SlotSampling) * n_all, "sampling params");
  counters_ = DeviceBuffer(sizeof(uint64_t) * n_all, "step counters");
  last_token_ = DeviceBuffer(sizeof(int32_t) * n_all, "last sampled tokens");
  frame_positions_ = DeviceBuffer(sizeof(int32_t) * n_all, "frame positions");
  slot_copier_ = SlotStateCopier(static_cast<size_t>(slot_state_floats_));
  table_host_ = PinnedBuffer(sizeof(int32_t) * table_ints() * kMaxQueuedSteps, "step tables (host)");
  sampled_host_ = PinnedBuffer(sizeof(int32_t) * B * kMaxQueuedSteps, "sampled ids (host)");
  params_host_ = PinnedBuffer(sizeof(kernels::SlotSampling) * n_all * kMaxQueuedSteps, "sampling params (host)");
  // The sampling kernels write the ids straight into pinned host memory: a device-to-host
  // copy after the graph would add to each step() call's wall time.
  M3_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&sampled_mapped_), sampled_host_.as<void>(), 0));

  M3_CUDA_CHECK(cudaMemset(state_.get(), 0, state_.bytes()));
  M3_CUDA_CHECK(cudaMemset(res_.get(), 0, res_.bytes()));
  M3_CUDA_CHECK(cudaMemset(o_.get(), 0, o_.bytes()));  // the GEMMs' warm-up reads them (load_kernels)
  if (act_.get() != nullptr) M3_CUDA_CHECK(cudaMemset(act_.get(), 0, act_.bytes()));
  M3_CUDA_CHECK(cudaMemset(counters_.get(), 0, counters_.bytes()));
  M3_CUDA_CHECK(cudaMemset(last_token_.get(), 0, last_token_.bytes()));
  M3_CUDA_CHECK(cudaMemset(frame_positions_.get(), 0, frame_positions_.bytes()));
  auto* th = table_host_.as<int32_t>();
  for (size_t i = 0; i < B; ++i) { th[i] = scratch_slot_; th[B + i] = 0; th[2 * B + i] = 0; }
  for (int t = 0; t < kMaxQueuedSteps; ++t) {
    M3_CUDA_CHECK(cudaMemcpy(table_.as<int32_t>() + t * table_ints(), th, sizeof(int32_t) * table_ints(),
                             cudaMemcpyHostToDevice));
  }

  buffers_.state = state_.as<float>();
  buffers_.slot_state_floats = slot_state_floats_;
  buffers_.residual = res_.as<float>();
  buffers_.in_proj_out = w_.as<float>();
  buffers_.gemm_u = gemm_u_.get();
  buffers_.gemm_fc1_out = gemm_fc1_out_.as<float>();
  buffers_.mixer_out = o_.as<float>();
  buffers_.mlp_act = act_.as<float>();
  buffers_.logits = logits_.as<float>();
  buffers_.tables = table_.as<int32_t>();
  buffers_.sampled = sampled_mapped_;
  buffers_.sampling = params_dev_.as<kernels::SlotSampling>();
  buffers_.counters = counters_.as<uint64_t>();
  buffers_.last_token = last_token_.as<int32_t>();
  buffers_.masks = masks_.view();
  buffers_.frame_positions = frame_positions_.as<int32_t>();
  buffers_.max_bucket = max_bucket_;
}

// Every handle and buffer is released by its member's destructor (graphs first: they
// were declared after the streams, events and buffers they use).
CudaEngine::~CudaEngine() {
  cudaSetDevice(device_);
  // Queued steps write into pinned buffers freed below; the table copies run on their own stream.
  if (stream_) cudaStreamSynchronize(stream_);
  if (table_stream_) cudaStreamSynchronize(table_stream_);
}

void CudaEngine::build_steps() {
  const StepPlanner planner(config_, weights_, buffers_, layout_, policy_, step_gemms_.get());
  for (int batch : bucket_sizes_) {
    std::vector<StepGraph> candidates;
    for (const StepVariant& v : step_variant_candidates(batch, policy_.step_variants)) {
      StepGraph g{planner.plan(batch, v, 0)};
      // A variant the shape does not allow plans like another one: keep one of them.
      const bool seen = std::any_of(candidates.begin(), candidates.end(),
                                    [&](const StepGraph& o) { return o.plan.variant == g.plan.variant; });
      if (!seen) candidates.push_back(std::move(g));
    }
    graphs_.push_back(choose_fastest_step(std::move(candidates), *launcher_, use_graphs_));
    graphs_table1_.push_back(StepGraph{planner.plan(batch, graphs_.back().plan.variant, 1)});
  }
  if (!use_graphs_) return;
  for (StepGraph& g : graphs_) {
    if (g.exec == nullptr) launcher_->capture(g);  // the candidates of tuned buckets already are
  }
  for (StepGraph& g : graphs_table1_) launcher_->capture(g);
}

const StepGraph& CudaEngine::graph_for_batch(int batch, int table) const {
  return (table == 0 ? graphs_ : graphs_table1_)[bucket_of_batch_[batch]];
}

std::string CudaEngine::load_report() const { return tuner_report(graphs_); }

int CudaEngine::prefill_graph_max_tokens() const {
  return prefill_runner_ ? prefill_runner_->graph_max_tokens() : 0;
}

void CudaEngine::use_device() const {
  int current = -1;
  M3_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device_) M3_CUDA_CHECK(cudaSetDevice(device_));
}

void CudaEngine::check_usable(const char* fn) const {
  if (!failure_.empty()) {
    throw std::runtime_error(std::string(fn) + ": the cuda engine is unusable after a CUDA error in an earlier call (" +
                             failure_ + "); a new engine is needed");
  }
}

template <typename Work>
void CudaEngine::or_unusable(Work&& work) {
  try {
    use_device();
    work();
  } catch (const std::exception& e) {
    failure_ = e.what();
    throw;
  }
}

void CudaEngine::check_slot(const char* fn, int slot) const {
  if (slot < 0 || slot >= max_slots_) {
    throw std::invalid_argument(slot_context(fn, slot) + " is out of range [0, " + std::to_string(max_slots_) + ")");
  }
}

void CudaEngine::reset(int slot) {
  check_usable("reset");
  check_slot("reset", slot);
  or_unusable([&] {  // queued behind the steps already submitted, ahead of later ones
    wait_for_copy(slot);
    zero_slot(slot);
  });
  has_sample_[slot] = 0;
  steps_since_reset_[slot] = 0;
}

SlotDeviceState CudaEngine::device_slot(int slot) const {
  return {state_.as<float>() + static_cast<size_t>(slot) * slot_state_floats_, counters_.as<uint64_t>() + slot,
          last_token_.as<int32_t>() + slot, frame_positions_.as<int32_t>() + slot};
}

// Ordered with the steps: the copy waits for those submitted before it (a save returns once
// they are done), and a load is what the steps submitted after it read.
void CudaEngine::save_slot(int slot, std::span<std::byte> out) {
  check_usable("save_slot");
  check_slot("save_slot", slot);
  if (out.size() != slot_copier_.bytes()) {
    throw std::invalid_argument("save_slot: " + std::to_string(out.size()) + " bytes given, a slot's state is " +
                                std::to_string(slot_copier_.bytes()));
  }
  const SlotHostFlags flags{has_sample_[slot] != 0, static_cast<uint32_t>(steps_since_reset_[slot] & 1)};
  or_unusable([&] { slot_copier_.save(stream_, device_slot(slot), flags, out); });
}

void CudaEngine::load_slot(int slot, std::span<const std::byte> in) {
  check_usable("load_slot");
  check_slot("load_slot", slot);
  slot_copier_.check(in, config_.vocab_size);
  SlotHostFlags flags;
  or_unusable([&] { flags = slot_copier_.load(stream_, device_slot(slot), in, config_.vocab_size); });
  has_sample_[slot] = flags.has_sample ? 1 : 0;
  steps_since_reset_[slot] = flags.parity;  // only its parity is read: the current half stays current
}

// Page-locked so that the copier moves it with one DMA; where the system will lock no more,
// plain memory, which the copier stages (slower, still exact).
HostStateBuffer CudaEngine::allocate_host_state() const {
  const size_t bytes = slot_copier_.bytes();
  use_device();  // the page-locking context is this engine's device's
  try {
    auto* data = static_cast<std::byte*>(allocate_pinned(bytes, "a slot's state on the host"));
    return HostStateBuffer(data, bytes, [](std::byte* p) noexcept { free_pinned(p); });
  } catch (const std::runtime_error&) {
    return HostStateBuffer::plain(bytes);
  }
}

// The copy runs on the copier's stream beside the steps; only work that uses the slot waits
// for it (wait_for_copies), so the other slots' steps go on.
void CudaEngine::load_slot_async(int slot, const HostStateBuffer& in) {
  check_usable("load_slot_async");
  check_slot("load_slot_async", slot);
  if (!is_page_locked(in.bytes().data(), in.size())) {  // not this engine's buffer: an ordinary load
    load_slot(slot, in.bytes());
    return;
  }
  slot_copier_.check(in.bytes(), config_.vocab_size);
  SlotHostFlags flags;
  or_unusable([&] {
    flags = slot_copier_.load_async(stream_, device_slot(slot), in.bytes(), config_.vocab_size,
                                    async_copy_event(slot));
  });
  has_sample_[slot] = flags.has_sample ? 1 : 0;
  steps_since_reset_[slot] = flags.parity;
}

// As save_slot, but the host does not wait: the copy runs after the steps queued so far,
// and later work on the slot waits for it on the device.
void CudaEngine::save_slot_async(int slot, HostStateBuffer& out) {
  check_usable("save_slot_async");
  check_slot("save_slot_async", slot);
  if (!is_page_locked(out.bytes().data(), out.size())) {  // not this engine's buffer: an ordinary save
    save_slot(slot, out.bytes());
    return;
  }
  const SlotHostFlags flags{has_sample_[slot] != 0, static_cast<uint32_t>(steps_since_reset_[slot] & 1)};
  or_unusable([&] { slot_copier_.save_async(stream_, device_slot(slot), flags, out.bytes(), async_copy_event(slot)); });
}

cudaEvent_t CudaEngine::async_copy_event(int slot) {
  if (slot_copied_[slot] == nullptr) {
    M3_CUDA_CHECK(cudaEventCreateWithFlags(slot_copied_[slot].out(), cudaEventDisableTiming));
  }
  copy_in_flight_[slot] = 1;
  copy_unwaited_[slot] = 1;
  return slot_copied_[slot];
}

bool CudaEngine::slot_ready(int slot) const {
  if (slot < 0 || slot >= max_slots_ || !copy_in_flight_[slot]) return true;
  const cudaError_t done = cudaEventQuery(slot_copied_[slot]);
  if (done == cudaErrorNotReady) return false;
  // An error here is the device's: the next call that queues work reports it and makes
  // the engine unusable, so the buffer is not read again either way.
  if (done != cudaSuccess) cudaGetLastError();
  copy_in_flight_[slot] = 0;
  return true;
}

void CudaEngine::wait_for_copy(int32_t slot) {
  if (!copy_unwaited_[slot]) return;
  M3_CUDA_CHECK(cudaStreamWaitEvent(stream_, slot_copied_[slot], 0));
  copy_unwaited_[slot] = 0;  // all later work on stream_ is ordered after it too
}

void CudaEngine::wait_for_copies(std::span<const int32_t> slots) {
  for (const int32_t slot : slots) wait_for_copy(slot);
}

// The slot's device side as a new sequence finds it: state, random-draw counter, last
// sampled token and frame position zero (queued on stream_).
void CudaEngine::zero_slot(int slot) {
  float* st = state_.as<float>() + static_cast<size_t>(slot) * slot_state_floats_;
  M3_CUDA_CHECK(cudaMemsetAsync(st, 0, sizeof(float) * slot_state_floats_, stream_));
  M3_CUDA_CHECK(cudaMemsetAsync(counters_.as<uint64_t>() + slot, 0, sizeof(uint64_t), stream_));
  M3_CUDA_CHECK(cudaMemsetAsync(last_token_.as<int32_t>() + slot, 0, sizeof(int32_t), stream_));
  M3_CUDA_CHECK(cudaMemsetAsync(frame_positions_.as<int32_t>() + slot, 0, sizeof(int32_t), stream_));
}

void CudaEngine::set_sampling(int slot, const SamplingParams& params) {
  check_slot("set_sampling", slot);
  if (const std::string why = sampling_params_error(params, masks_.size()); !why.empty()) {
    throw std::invalid_argument(slot_context("set_sampling", slot) + ": " + why);
  }
  kernels::SlotSampling& s = params_[slot];
  s.mask = params.mask;
  s.temperature = params.temperature;
  s.top_k = params.top_k;
  s.top_p = params.top_p;
  s.seed = params.seed;
  params_dirty_ = true;
}

void CudaEngine::step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                      std::span<int32_t> sampled, std::span<float> logits) {
  check_usable("step");
  if (queued_steps() != 0) {
    throw std::logic_error("step: " + std::to_string(queued_steps()) +
                           " submitted steps are not collected yet; collect_step() them first");
  }
  const size_t n = slots.size(), V = static_cast<size_t>(config_.padded_vocab());
  if (tokens.size() != n || sampled.size() != n || (!logits.empty() && logits.size() != n * V)) {
    throw std::invalid_argument("step: " + std::to_string(n) + " slots but " +
                                std::to_string(tokens.size()) + " tokens, " +
                                std::to_string(sampled.size()) + " sampled entries and " +
                                std::to_string(logits.size()) + " logits (need 0 or " +
                                std::to_string(n * V) + ")");
  }
  submit(slots, tokens, logits);
  if (!slots.empty()) collect_step(sampled);
}

void CudaEngine::submit_step(std::span<const int32_t> slots, std::span<const int32_t> tokens) {
  submit(slots, tokens, {});
}

void CudaEngine::submit(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                        std::span<float> logits) {
  check_usable("submit_step");
  const size_t n = slots.size();
  if (tokens.size() != n) {
    throw std::invalid_argument("submit_step: " + std::to_string(n) + " slots but " +
                                std::to_string(tokens.size()) + " tokens");
  }
  if (n == 0) return;
  if (n > static_cast<size_t>(max_slots_)) {
    throw std::invalid_argument("step: " + std::to_string(n) + " slots, more than max_slots " +
                                std::to_string(max_slots_));
  }
  // This step's place in the queue's ring picks its host-side table, parameters, ids and
  // graph (which reads that place's device table).
  const int q = queue_position_for_submit();
  ++step_serial_;
  for (size_t i = 0; i < n; ++i) {
    const int slot = slots[i];
    check_slot("step", slot);
    if (seen_in_step_[slot] == step_serial_) {
      throw std::invalid_argument(slot_context("step", slot) + " is listed twice");
    }
    seen_in_step_[slot] = step_serial_;
    const int32_t t = tokens[i];
    if (t == kContinueToken) {
      if (!has_sample_[slot]) {
        throw std::invalid_argument(slot_context("step", slot) +
                                    ": kContinueToken but the slot has no sampled token yet");
      }
    } else if (t < 0 || t >= config_.vocab_size) {
      throw std::invalid_argument(slot_context("step", slot) + ": token " + std::to_string(t) +
                                  " is outside [0, " + std::to_string(config_.vocab_size) + ")");
    }
  }

  // Validated: from here on a failure may leave part of the step on the device.
  or_unusable([&] { enqueue_step(slots, tokens, logits, q); });
}

void CudaEngine::enqueue_step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                              std::span<float> logits, int q) {
  const size_t n = slots.size();
  const size_t V = static_cast<size_t>(config_.padded_vocab());
  const StepGraph& g = graph_for_batch(static_cast<int>(n), q);
  const int B = max_bucket_;
  auto* th = table_host_.as<int32_t>() + q * table_ints();
  for (size_t i = 0; i < n; ++i) {
    th[i] = slots[i];
    th[B + i] = tokens[i];
    th[2 * B + i] = static_cast<int32_t>(steps_since_reset_[slots[i]] & 1);
  }
  for (int i = static_cast<int>(n); i < g.plan.batch; ++i) { th[i] = scratch_slot_; th[B + i] = 0; th[2 * B + i] = 0; }
  upload_params_if_dirty(q);
  wait_for_copies(slots);
  // Table q's last reader is the step collected before this one took position q, so the
  // copy may run at once, beside the step now on the device.
  M3_CUDA_CHECK(cudaMemcpyAsync(table_.as<int32_t>() + q * table_ints(), th, sizeof(int32_t) * table_ints(),
                                cudaMemcpyHostToDevice, table_stream_));
  M3_CUDA_CHECK(cudaEventRecord(table_ready_[q], table_stream_));
  M3_CUDA_CHECK(cudaStreamWaitEvent(stream_, table_ready_[q], 0));
  launcher_->run(g, use_graphs_);
  if (!logits.empty()) {
    M3_CUDA_CHECK(cudaMemcpyAsync(logits.data(), logits_.get(), sizeof(float) * n * V,
                                  cudaMemcpyDeviceToHost, stream_));
  }
  M3_CUDA_CHECK(cudaEventRecord(step_done_[q], stream_));
  // Bookkeeping for the steps after this one: the device has the slot's sample by then.
  for (size_t i = 0; i < n; ++i) {
    has_sample_[slots[i]] = 1;
    ++steps_since_reset_[slots[i]];
  }
  queue_push(n);
  ++stats_.steps;
  if (use_graphs_) ++stats_.graph_replays;
  stats_.tokens += n;
}

void CudaEngine::upload_params_if_dirty(int q) {
  if (!params_dirty_) return;
  auto* ph = params_host_.as<kernels::SlotSampling>() + q * params_.size();
  std::copy(params_.begin(), params_.end(), ph);
  M3_CUDA_CHECK(cudaMemcpyAsync(params_dev_.get(), ph, params_dev_.bytes(), cudaMemcpyHostToDevice, stream_));
  params_dirty_ = false;
}

void CudaEngine::prefill(std::span<const PrefillRun> runs, std::span<int32_t> sampled, std::span<float> logits) {
  if (!prefill_runner_) {
    Engine::prefill(runs, sampled, logits);
    return;
  }
  check_usable("prefill");
  const size_t tokens = validate_prefill(runs, sampled, logits);  // also: no step queued
  if (runs.empty()) return;
  for (size_t i = 0; i < runs.size(); ++i) {
    prefill_parities_[i] = static_cast<int32_t>(steps_since_reset_[runs[i].slot] & 1);
  }
  // Validated: from here on a failure may leave part of the call on the device. With no
  // step queued, queue position 0's host copy of the parameters is free.
  or_unusable([&] {
    upload_params_if_dirty(0);
    for (const PrefillRun& run : runs) wait_for_copy(run.slot);
    if (prefill_runner_->run(runs, std::span<const int32_t>(prefill_parities_.data(), runs.size()), sampled,
                             logits, stream_)) {
      ++stats_.graph_replays;
    }
  });
  // The slots as runs[i].tokens.size() steps would leave them: the sample is on the device
  // (last_token), and the state parity moved on by the run's length.
  for (const PrefillRun& run : runs) {
    has_sample_[run.slot] = 1;
    steps_since_reset_[run.slot] += run.tokens.size();
  }
  stats_.tokens += tokens;
}

void CudaEngine::collect_step(std::span<int32_t> sampled) {
  check_usable("collect_step");
  const int q = queue_position_for_collect(sampled);
  or_unusable([&] { M3_CUDA_CHECK(cudaEventSynchronize(step_done_[q])); });
  const int32_t* sh = sampled_host_.as<int32_t>() + static_cast<size_t>(q) * max_bucket_;
  std::copy(sh, sh + sampled.size(), sampled.begin());
  queue_pop();
}

}  // namespace cuda
}  // namespace m3
