#include "model/cpu/cpu_engine.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iomanip>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "model/cpu/cpu_ops.h"
#include "model/cpu/cpu_sampling.h"
#include "model/cpu/cpu_thread_pool.h"
#include "model/tensor.h"
#include "model/weights.h"

namespace m3 {
namespace {

std::string gib(double bytes) {
  std::ostringstream s;
  s << std::setprecision(3) << bytes / (1ull << 30) << " GiB";
  return s.str();
}

// A checkpoint tensor widened to fp32, its element count checked against what the step
// indexes (the loader checks shapes too; this keeps a bad loader from becoming an
// out-of-bounds read).
std::vector<float> load_f32(const TensorView& t, int64_t expected_numel) {
  if (t.numel() != expected_numel) {
    throw std::runtime_error("cpu engine: tensor " + t.name + " has " + std::to_string(t.numel()) +
                             " elements " + t.shape_str() + ", the step needs " +
                             std::to_string(expected_numel));
  }
  std::vector<float> out(static_cast<size_t>(expected_numel));
  to_f32(t, out);
  return out;
}

struct LayerWeights {
  std::vector<float> norm, in_proj, dt_bias, D, B_bias, C_bias, B_norm, C_norm;
  std::vector<float> mimo_x, mimo_z, mimo_o, out_norm, out_proj;
  std::vector<float> norm2, fc1, fc2;  // empty without an MLP
};

class CpuEngine final : public Engine {
 public:
  CpuEngine(const ModelWeights& weights, const EngineOptions& options);

  std::string_view backend() const override { return "cpu"; }
  const ModelConfig& config() const override { return config_; }
  int max_slots() const override { return max_slots_; }
  int sampling_mask_count() const override { return masks_.size(); }
  void reset(int slot) override;
  void set_sampling(int slot, const SamplingParams& params) override;
  void step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
            std::span<int32_t> sampled, std::span<float> logits) override;
  EngineStats stats() const override;
  void prefill(std::span<const PrefillRun> runs, std::span<int32_t> sampled,
               std::span<float> logits) override;
  int max_prefill_tokens() const override { return max_prefill_tokens_; }
  bool has_prefill_path() const override { return true; }
  CpuSlotSnapshot snapshot(int slot) const;
  size_t slot_state_bytes() const override;
  void save_slot(int slot, std::span<std::byte> out) override;
  void load_slot(int slot, std::span<const std::byte> in) override;

 private:
  // A stretch of one run's tokens inside a prefill window: rows [row, row + count).
  struct PrefillSegment {
    int slot, row, count;
    int run;       // index in prefill()'s runs
    bool last;     // ends its run
  };
  void check_slot(int slot, const char* op) const;
  void validate_step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                     std::span<int32_t> sampled, std::span<float> logits);
  void run_layer(int layer, int batch, std::span<const int32_t> slots);
  cpu::MixerState slot_state(int slot, int layer);
  // One layer over the `rows` tokens of the current prefill window (prefill_segments_).
  void prefill_layer(int layer, int rows);
  // res += hidden; out = rmsnorm(res) * weight, for `rows` rows of width d_model.
  void add_and_norm(int rows, const std::vector<float>& weight, float* out);
  // y[t, out] = W x[t] for t < tokens, rows split over the pool.
  void matmul(const std::vector<float>& W, int in, int out, const float* x, int tokens, float* y);
  // Head h of a step with bf16 state: its ssm rows widened into `ssm_scratch` (one layer's
  // ssm, at the head's offset), stepped in fp32, rounded back to nearest even.
  void mixer_head_step_bf16(const cpu::MixerParams& params, int b, int h, int slot, int layer,
                            float* scratch, float* ssm_scratch);
  // y[b, rows] = W x[b] for b < batch, rows split over the pool.
  void matvec(const std::vector<float>& W, int in, int out, const float* x, int batch, float* y);

  ModelConfig config_;
  int max_slots_;
  int d_model_, d_inner_, V_, F_;
  cpu::MixerDims dims_;
  cpu::InProjOffsets in_offsets_{};
  int bc_offset_B_ = 0, bc_offset_C_ = 0, in_rows_ = 0;

  std::vector<float> embedding_, norm_f_, lm_head_own_;
  const float* lm_head_ = nullptr;  // embedding_ when tied, else lm_head_own_
  std::vector<LayerWeights> layers_;

  // Recurrent state: [slot][layer][angle | ssm | k_prev | x_prev]. With bf16 state the
  // ssm part (the bulk) lives in ssm_bf16_ ([slot][layer][H, P, N]) and is not in state_;
  // the angles, which grow without bound, and the small k_prev and x_prev stay fp32.
  int64_t state_per_layer_ = 0;
  int64_t angle_off_ = 0, ssm_off_ = 0, k_prev_off_ = 0, x_prev_off_ = 0;
  std::vector<float> state_;
  bool bf16_state_ = false;
  int64_t ssm_per_layer_ = 0;
  std::vector<uint16_t> ssm_bf16_;
  std::vector<float> ssm_scratch_;  // per pool share, one layer's ssm (bf16 state only)
  std::vector<uint64_t> counter_;
  std::vector<int32_t> last_sampled_;  // -1: nothing sampled since reset
  std::vector<SamplingParams> params_;
  SamplingMaskTable masks_;
  std::vector<int32_t> frame_position_;  // of the slot's next sample after a continue token

  // Activations of one step, indexed by position in the step's slot list.
  std::vector<float> res_, normed_, hidden_, in_out_, B_normed_, C_normed_, mixer_out_;
  std::vector<float> fc1_out_, mlp_act_, logits_;
  std::vector<float> head_scratch_;  // per pool share
  int head_scratch_floats_ = 0;
  std::vector<SamplingScratch> sampling_scratch_;  // per position
  std::vector<int32_t> inputs_;
  std::vector<uint64_t> seen_stamp_;  // duplicate-slot check without clearing
  uint64_t stamp_ = 0;

  // Prefill: at most max_prefill_tokens_ a call, read prefill_window_ tokens at a time
  // through every layer (the activation buffers above hold that many rows).
  int max_prefill_tokens_ = 0, prefill_window_ = 0;
  std::vector<PrefillSegment> prefill_segments_;
  std::vector<float> prefill_last_;  // [run] the final-normed last token

  std::atomic<uint64_t> steps_{0}, tokens_{0};
  CpuThreadPool pool_;
};

CpuEngine::CpuEngine(const ModelWeights& weights, const EngineOptions& options)
    : config_(weights.config()),
      max_slots_(options.max_slots),
      pool_(options.cpu_threads),
      masks_(options.sampling_masks, weights.config().vocab_size) {
  if (max_slots_ < 1) {
    throw std::invalid_argument("cpu engine: max_slots must be >= 1, got " +
                                std::to_string(max_slots_));
  }
  const ModelConfig& c = config_;
  if (!c.ssm.is_mimo) {
    throw std::runtime_error("cpu engine: " + weights.dir().string() +
                             ": only MIMO Mamba-3 models are supported (ssm_cfg.is_mimo is false)");
  }
  if (c.ssm.ngroups != 1) {
    throw std::runtime_error("cpu engine: " + weights.dir().string() + ": ngroups must be 1, got " +
                             std::to_string(c.ssm.ngroups));
  }
  d_model_ = c.d_model;
  d_inner_ = c.d_inner();
  V_ = c.padded_vocab();
  F_ = c.has_mlp() ? c.mlp_width() : 0;
  dims_.H = c.n_heads();
  dims_.P = c.ssm.headdim;
  dims_.N = c.ssm.d_state;
  dims_.R = c.ssm.mimo_rank;
  dims_.S = c.n_angles();
  dims_.outproj_norm = c.ssm.is_outproj_norm;
  dims_.A_floor = static_cast<float>(c.ssm.A_floor);
  dims_.eps = ModelConfig::kNormEps;
  const auto layout = c.in_proj_layout();
  in_offsets_ = {layout.z, layout.x, layout.dd_dt, layout.dd_A, layout.trap, layout.ang};
  bc_offset_B_ = layout.B;
  bc_offset_C_ = layout.C;
  in_rows_ = layout.total;

  const int H = dims_.H, P = dims_.P, N = dims_.N, R = dims_.R;
  embedding_ = load_f32(weights.tensor("backbone.embedding.weight"), int64_t{V_} * d_model_);
  norm_f_ = load_f32(weights.tensor("backbone.norm_f.weight"), d_model_);
  // Tied: one fp32 copy serves both (the loader checked a stored lm_head.weight is equal).
  if (c.tie_embeddings) {
    lm_head_ = embedding_.data();
  } else {
    lm_head_own_ = load_f32(weights.lm_head(), int64_t{V_} * d_model_);
    lm_head_ = lm_head_own_.data();
  }
  layers_.resize(static_cast<size_t>(c.n_layer));
  for (int i = 0; i < c.n_layer; ++i) {
    LayerWeights& l = layers_[static_cast<size_t>(i)];
    const auto get = [&](const char* suffix, int64_t n) {
      return load_f32(weights.layer(i, suffix), n);
    };
    l.norm = get("norm.weight", d_model_);
    l.in_proj = get("mixer.in_proj.weight", int64_t{in_rows_} * d_model_);
    l.dt_bias = get("mixer.dt_bias", H);
    l.D = get("mixer.D", H);
    l.B_bias = get("mixer.B_bias", int64_t{H} * R * N);
    l.C_bias = get("mixer.C_bias", int64_t{H} * R * N);
    l.B_norm = get("mixer.B_norm.weight", N);
    l.C_norm = get("mixer.C_norm.weight", N);
    l.mimo_x = get("mixer.mimo_x", int64_t{H} * R * P);
    l.mimo_z = get("mixer.mimo_z", int64_t{H} * R * P);
    l.mimo_o = get("mixer.mimo_o", int64_t{H} * R * P);
    if (dims_.outproj_norm) l.out_norm = get("mixer.norm.weight", d_inner_);
    l.out_proj = get("mixer.out_proj.weight", int64_t{d_model_} * d_inner_);
    if (F_ > 0) {
      l.norm2 = get("norm2.weight", d_model_);
      l.fc1 = get("mlp.fc1.weight", int64_t{2} * F_ * d_model_);
      l.fc2 = get("mlp.fc2.weight", int64_t{d_model_} * F_);
    }
  }

  bf16_state_ = options.state_dtype == StateDType::BF16;
  ssm_per_layer_ = int64_t{H} * P * N;
  angle_off_ = 0;
  ssm_off_ = angle_off_ + int64_t{H} * dims_.S;
  k_prev_off_ = ssm_off_ + (bf16_state_ ? 0 : ssm_per_layer_);
  x_prev_off_ = k_prev_off_ + int64_t{R} * H * N;
  state_per_layer_ = x_prev_off_ + int64_t{H} * P;
  const size_t slots = static_cast<size_t>(max_slots_);
  // Below 16 GiB a sequence (ModelConfig::validate): slots x that fits in 64 bits.
  const size_t per_sequence = static_cast<size_t>(c.n_layer * state_per_layer_);
  const size_t state_floats = slots * per_sequence;
  const size_t per_sequence_bytes =
      4 * per_sequence + (bf16_state_ ? 2 * static_cast<size_t>(c.n_layer * ssm_per_layer_) : 0);
  auto state_too_large = [&](const std::string& why) {
    return std::runtime_error("cpu engine: " + weights.dir().string() + ": the recurrent state of " +
                              std::to_string(max_slots_) + " slots needs " +
                              gib(static_cast<double>(per_sequence_bytes) * static_cast<double>(slots)) +
                              " (" + gib(static_cast<double>(per_sequence_bytes)) + " a sequence), " + why +
                              "; lower max_batch");
  };
  // More than the machine has would be touched into the OOM killer, not refused by malloc.
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page_size > 0) {
    const size_t memory = static_cast<size_t>(pages) * static_cast<size_t>(page_size);
    if (per_sequence_bytes > memory / slots) {
      throw state_too_large("more than this machine's " + gib(static_cast<double>(memory)) + " of memory");
    }
  }
  try {
    state_.assign(state_floats, 0.0f);
    if (bf16_state_) ssm_bf16_.assign(slots * static_cast<size_t>(c.n_layer * ssm_per_layer_), 0);
  } catch (const std::bad_alloc&) {
    throw state_too_large("more than this process can allocate");
  }
  counter_.assign(slots, 0);
  last_sampled_.assign(slots, -1);
  params_.assign(slots, SamplingParams{});
  frame_position_.assign(slots, 0);

  if (options.max_prefill_tokens < 1) {
    throw std::invalid_argument("cpu engine: max_prefill_tokens must be >= 1, got " +
                                std::to_string(options.max_prefill_tokens));
  }
  max_prefill_tokens_ = options.max_prefill_tokens;
  // A window of 256 tokens keeps the matrix products efficient and the buffers small.
  prefill_window_ = std::min(max_prefill_tokens_, 256);
  prefill_segments_.reserve(slots);
  prefill_last_.resize(slots * d_model_);
  const size_t rows = std::max(slots, static_cast<size_t>(prefill_window_));
  res_.resize(rows * d_model_);
  normed_.resize(rows * d_model_);
  hidden_.resize(rows * d_model_);
  in_out_.resize(rows * static_cast<size_t>(in_rows_));
  B_normed_.resize(rows * static_cast<size_t>(R * N));
  C_normed_.resize(rows * static_cast<size_t>(R * N));
  mixer_out_.resize(rows * static_cast<size_t>(d_inner_));
  fc1_out_.resize(rows * static_cast<size_t>(2 * F_));
  mlp_act_.resize(rows * static_cast<size_t>(F_));
  logits_.resize(slots * static_cast<size_t>(V_));
  head_scratch_floats_ = cpu::mixer_head_scratch_floats(dims_);
  head_scratch_.resize(static_cast<size_t>(pool_.threads()) * head_scratch_floats_);
  if (bf16_state_) ssm_scratch_.resize(static_cast<size_t>(pool_.threads() * ssm_per_layer_));
  sampling_scratch_.reserve(slots);
  for (size_t i = 0; i < slots; ++i) sampling_scratch_.emplace_back(c.vocab_size);
  inputs_.resize(slots);
  seen_stamp_.assign(slots, 0);
}

void CpuEngine::check_slot(int slot, const char* op) const {
  if (slot < 0 || slot >= max_slots_) {
    throw std::invalid_argument(std::string(op) + ": slot " + std::to_string(slot) +
                                " out of range [0, " + std::to_string(max_slots_) + ")");
  }
}

void CpuEngine::reset(int slot) {
  check_slot(slot, "reset");
  const int64_t per_slot = config_.n_layer * state_per_layer_;
  std::fill_n(state_.begin() + slot * per_slot, per_slot, 0.0f);
  if (bf16_state_) {
    const int64_t ssm_per_slot = config_.n_layer * ssm_per_layer_;
    std::fill_n(ssm_bf16_.begin() + slot * ssm_per_slot, ssm_per_slot, uint16_t{0});
  }
  counter_[static_cast<size_t>(slot)] = 0;
  last_sampled_[static_cast<size_t>(slot)] = -1;
  frame_position_[static_cast<size_t>(slot)] = 0;
}

void CpuEngine::set_sampling(int slot, const SamplingParams& params) {
  check_slot(slot, "set_sampling");
  if (const std::string why = sampling_params_error(params, masks_.size()); !why.empty()) {
    throw std::invalid_argument("set_sampling: slot " + std::to_string(slot) + ": " + why);
  }
  params_[static_cast<size_t>(slot)] = params;
}

EngineStats CpuEngine::stats() const {
  EngineStats s;
  s.steps = steps_.load(std::memory_order_relaxed);
  s.tokens = tokens_.load(std::memory_order_relaxed);
  return s;
}

// A slot's bytes: its state floats as the step keeps them ([layer][angle | ssm | k_prev |
// x_prev]), then the random-draw counter (u64), the last sampled token (i32, -1: none) and
// the frame position of the slot's next sample (i32, what constrained sampling's codebook
// order reads), host byte order.
size_t CpuEngine::slot_state_bytes() const {
  return sizeof(float) * static_cast<size_t>(config_.n_layer * state_per_layer_) + sizeof(uint64_t) +
         2 * sizeof(int32_t);
}

void CpuEngine::save_slot(int slot, std::span<std::byte> out) {
  check_slot(slot, "save_slot");
  if (out.size() != slot_state_bytes()) {
    throw std::invalid_argument("save_slot: " + std::to_string(out.size()) + " bytes given, a slot's state is " +
                                std::to_string(slot_state_bytes()));
  }
  const size_t floats = static_cast<size_t>(config_.n_layer * state_per_layer_);
  std::byte* p = out.data();
  std::memcpy(p, state_.data() + slot * floats, sizeof(float) * floats);
  p += sizeof(float) * floats;
  std::memcpy(p, &counter_[static_cast<size_t>(slot)], sizeof(uint64_t));
  p += sizeof(uint64_t);
  std::memcpy(p, &last_sampled_[static_cast<size_t>(slot)], sizeof(int32_t));
  std::memcpy(p + sizeof(int32_t), &frame_position_[static_cast<size_t>(slot)], sizeof(int32_t));
}

void CpuEngine::load_slot(int slot, std::span<const std::byte> in) {
  check_slot(slot, "load_slot");
  if (in.size() != slot_state_bytes()) {
    throw std::invalid_argument("load_slot: " + std::to_string(in.size()) + " bytes given, a slot's state is " +
                                std::to_string(slot_state_bytes()));
  }
  const size_t floats = static_cast<size_t>(config_.n_layer * state_per_layer_);
  const std::byte* p = in.data() + sizeof(float) * floats;
  uint64_t counter;
  int32_t last;
  std::memcpy(&counter, p, sizeof counter);
  std::memcpy(&last, p + sizeof counter, sizeof last);
  int32_t frame_position;
  std::memcpy(&frame_position, p + sizeof counter + sizeof last, sizeof frame_position);
  if (frame_position < 0) {
    throw std::invalid_argument("load_slot: the state's frame position " + std::to_string(frame_position) +
                                " is negative");
  }
  // A token kContinueToken would feed must be one the embedding has.
  if (last < -1 || last >= config_.vocab_size) {
    throw std::invalid_argument("load_slot: the state's next input token " + std::to_string(last) +
                                " is outside [-1, " + std::to_string(config_.vocab_size) + ")");
  }
  std::memcpy(state_.data() + slot * floats, in.data(), sizeof(float) * floats);
  counter_[static_cast<size_t>(slot)] = counter;
  last_sampled_[static_cast<size_t>(slot)] = last;
  frame_position_[static_cast<size_t>(slot)] = frame_position;
}

void CpuEngine::validate_step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                              std::span<int32_t> sampled, std::span<float> logits) {
  if (slots.size() > static_cast<size_t>(max_slots_)) {
    throw std::invalid_argument("step: " + std::to_string(slots.size()) + " slots, max_slots is " +
                                std::to_string(max_slots_));
  }
  if (tokens.size() != slots.size()) {
    throw std::invalid_argument("step: tokens has " + std::to_string(tokens.size()) +
                                " entries, slots has " + std::to_string(slots.size()));
  }
  if (sampled.size() != slots.size()) {
    throw std::invalid_argument("step: sampled has " + std::to_string(sampled.size()) +
                                " entries, slots has " + std::to_string(slots.size()));
  }
  if (!logits.empty() && logits.size() != slots.size() * static_cast<size_t>(V_)) {
    throw std::invalid_argument("step: logits has " + std::to_string(logits.size()) +
                                " floats, need " + std::to_string(slots.size()) + " x padded vocab " +
                                std::to_string(V_) + " (or empty)");
  }
  ++stamp_;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int slot = slots[i];
    check_slot(slot, "step");
    if (seen_stamp_[static_cast<size_t>(slot)] == stamp_) {
      throw std::invalid_argument("step: slot " + std::to_string(slot) + " listed twice");
    }
    seen_stamp_[static_cast<size_t>(slot)] = stamp_;
    const int32_t token = tokens[i];
    if (token == kContinueToken) {
      if (last_sampled_[static_cast<size_t>(slot)] < 0) {
        throw std::invalid_argument("step: slot " + std::to_string(slot) +
                                    " has no sampled token to continue from (kContinueToken "
                                    "right after reset)");
      }
    } else if (token < 0 || token >= config_.vocab_size) {
      throw std::invalid_argument("step: slot " + std::to_string(slot) + ": token " +
                                  std::to_string(token) + " outside [0, " +
                                  std::to_string(config_.vocab_size) + ")");
    }
  }
}

cpu::MixerState CpuEngine::slot_state(int slot, int layer) {
  float* base = state_.data() + (int64_t{slot} * config_.n_layer + layer) * state_per_layer_;
  return {base + angle_off_, base + ssm_off_, base + k_prev_off_, base + x_prev_off_};
}

void CpuEngine::mixer_head_step_bf16(const cpu::MixerParams& params, int b, int h, int slot,
                                     int layer, float* scratch, float* ssm_scratch) {
  const int RN = dims_.R * dims_.N;
  const int64_t head = int64_t{dims_.P} * dims_.N;
  uint16_t* stored = ssm_bf16_.data() + (int64_t{slot} * config_.n_layer + layer) * ssm_per_layer_ + h * head;
  float* wide = ssm_scratch + h * head;
  for (int64_t i = 0; i < head; ++i) wide[i] = bf16_to_f32(stored[i]);
  cpu::MixerState state = slot_state(slot, layer);
  state.ssm = ssm_scratch;
  cpu::mixer_head_step(dims_, params, in_offsets_, in_out_.data() + int64_t{b} * in_rows_,
                       B_normed_.data() + int64_t{b} * RN, C_normed_.data() + int64_t{b} * RN, h,
                       state, scratch, mixer_out_.data() + int64_t{b} * d_inner_);
  for (int64_t i = 0; i < head; ++i) stored[i] = f32_to_bf16(wide[i]);
}

void CpuEngine::matvec(const std::vector<float>& W, int in, int out, const float* x, int batch,
                       float* y) {
  const float* w = W.data();
  pool_.run(out, [=](int64_t begin, int64_t end, int) {
    cpu::matvec_rows(w, in, out, static_cast<int>(begin), static_cast<int>(end), x, batch, y);
  });
}

void CpuEngine::run_layer(int layer, int batch, std::span<const int32_t> slots) {
  const LayerWeights& l = layers_[static_cast<size_t>(layer)];
  const float eps = ModelConfig::kNormEps;
  const int RN = dims_.R * dims_.N;

  for (int b = 0; b < batch; ++b) {
    float* res = res_.data() + int64_t{b} * d_model_;
    const float* h = hidden_.data() + int64_t{b} * d_model_;
    for (int i = 0; i < d_model_; ++i) res[i] += h[i];
    cpu::rmsnorm(res, l.norm.data(), d_model_, eps, normed_.data() + int64_t{b} * d_model_);
  }
  matvec(l.in_proj, d_model_, in_rows_, normed_.data(), batch, in_out_.data());

  for (int b = 0; b < batch; ++b) {
    const float* w = in_out_.data() + int64_t{b} * in_rows_;
    for (int r = 0; r < dims_.R; ++r) {
      cpu::rmsnorm(w + bc_offset_B_ + r * dims_.N, l.B_norm.data(), dims_.N, eps,
                   B_normed_.data() + int64_t{b} * RN + r * dims_.N);
      cpu::rmsnorm(w + bc_offset_C_ + r * dims_.N, l.C_norm.data(), dims_.N, eps,
                   C_normed_.data() + int64_t{b} * RN + r * dims_.N);
    }
  }

  const cpu::MixerParams params{l.dt_bias.data(), l.D.data(),      l.B_bias.data(),
                                l.C_bias.data(),  l.mimo_x.data(), l.mimo_z.data(),
                                l.mimo_o.data(),  dims_.outproj_norm ? l.out_norm.data() : nullptr};
  const int H = dims_.H;
  pool_.run(int64_t{batch} * H, [&](int64_t begin, int64_t end, int share) {
    float* scratch = head_scratch_.data() + int64_t{share} * head_scratch_floats_;
    for (int64_t item = begin; item < end; ++item) {
      const int b = static_cast<int>(item / H), h = static_cast<int>(item % H);
      if (bf16_state_) {
        mixer_head_step_bf16(params, b, h, slots[static_cast<size_t>(b)], layer, scratch,
                             ssm_scratch_.data() + int64_t{share} * ssm_per_layer_);
        continue;
      }
      cpu::MixerState state = slot_state(slots[static_cast<size_t>(b)], layer);
      cpu::mixer_head_step(dims_, params, in_offsets_, in_out_.data() + int64_t{b} * in_rows_,
                           B_normed_.data() + int64_t{b} * RN, C_normed_.data() + int64_t{b} * RN,
                           h, state, scratch, mixer_out_.data() + int64_t{b} * d_inner_);
    }
  });
  matvec(l.out_proj, d_inner_, d_model_, mixer_out_.data(), batch, hidden_.data());

  if (F_ > 0) {
    for (int b = 0; b < batch; ++b) {
      float* res = res_.data() + int64_t{b} * d_model_;
      const float* h = hidden_.data() + int64_t{b} * d_model_;
      for (int i = 0; i < d_model_; ++i) res[i] += h[i];
      cpu::rmsnorm(res, l.norm2.data(), d_model_, eps, normed_.data() + int64_t{b} * d_model_);
    }
    matvec(l.fc1, d_model_, 2 * F_, normed_.data(), batch, fc1_out_.data());
    for (int b = 0; b < batch; ++b) {
      cpu::gated_silu(fc1_out_.data() + int64_t{b} * 2 * F_, F_, mlp_act_.data() + int64_t{b} * F_);
    }
    matvec(l.fc2, F_, d_model_, mlp_act_.data(), batch, hidden_.data());
  }
}

void CpuEngine::step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                     std::span<int32_t> sampled, std::span<float> logits) {
  validate_step(slots, tokens, sampled, logits);
  const int batch = static_cast<int>(slots.size());
  if (batch == 0) return;

  for (int b = 0; b < batch; ++b) {
    const int32_t t = tokens[static_cast<size_t>(b)];
    const int32_t token = t == kContinueToken ? last_sampled_[static_cast<size_t>(slots[b])] : t;
    // The residual stream starts at zero so that layer 0's "res = h + res" is just h.
    std::fill_n(res_.begin() + int64_t{b} * d_model_, d_model_, 0.0f);
    std::copy_n(embedding_.begin() + int64_t{token} * d_model_, d_model_,
                hidden_.begin() + int64_t{b} * d_model_);
  }
  for (int layer = 0; layer < config_.n_layer; ++layer) run_layer(layer, batch, slots);

  for (int b = 0; b < batch; ++b) {
    float* res = res_.data() + int64_t{b} * d_model_;
    const float* h = hidden_.data() + int64_t{b} * d_model_;
    for (int i = 0; i < d_model_; ++i) res[i] += h[i];
    cpu::rmsnorm(res, norm_f_.data(), d_model_, ModelConfig::kNormEps,
                 normed_.data() + int64_t{b} * d_model_);
  }
  const float* head = lm_head_;
  float* out = logits_.data();
  const float* x = normed_.data();
  const int V = V_, d = d_model_;
  pool_.run(V, [=](int64_t begin, int64_t end, int) {
    cpu::matvec_rows(head, d, V, static_cast<int>(begin), static_cast<int>(end), x, batch, out);
  });

  pool_.run(batch, [&](int64_t begin, int64_t end, int) {
    for (int64_t b = begin; b < end; ++b) {
      const size_t slot = static_cast<size_t>(slots[static_cast<size_t>(b)]);
      const std::span<const float> row(logits_.data() + b * V_, static_cast<size_t>(V_));
      const SamplingParams& p = params_[slot];
      // An input token starts a frame; a continue token samples the frame's next position.
      if (tokens[static_cast<size_t>(b)] != kContinueToken) frame_position_[slot] = 0;
      const std::span<const TokenRange> allowed =
          p.mask >= 0 ? masks_.ranges(p.mask, frame_position_[slot]) : std::span<const TokenRange>{};
      const int32_t token = sample_token(row, config_.vocab_size, p, counter_[slot],
                                         sampling_scratch_[static_cast<size_t>(b)], allowed);
      sampled[static_cast<size_t>(b)] = token;
      if (p.mask >= 0) frame_position_[slot] = next_frame_position(masks_.view(), p.mask, frame_position_[slot], token);
    }
  });
  for (int b = 0; b < batch; ++b) {
    const size_t slot = static_cast<size_t>(slots[static_cast<size_t>(b)]);
    last_sampled_[slot] = sampled[static_cast<size_t>(b)];
    ++counter_[slot];
  }
  if (!logits.empty()) {
    std::memcpy(logits.data(), logits_.data(), sizeof(float) * static_cast<size_t>(batch) * V_);
  }
  steps_.fetch_add(1, std::memory_order_relaxed);
  tokens_.fetch_add(static_cast<uint64_t>(batch), std::memory_order_relaxed);
}

CpuSlotSnapshot CpuEngine::snapshot(int slot) const {
  check_slot(slot, "cpu_slot_snapshot");
  const int64_t per_slot = config_.n_layer * state_per_layer_;
  CpuSlotSnapshot out;
  out.state.assign(state_.begin() + slot * per_slot, state_.begin() + (slot + 1) * per_slot);
  if (bf16_state_) {  // + the ssm state, widened
    const int64_t ssm_per_slot = config_.n_layer * ssm_per_layer_;
    for (int64_t i = slot * ssm_per_slot; i < (slot + 1) * ssm_per_slot; ++i) out.state.push_back(bf16_to_f32(ssm_bf16_[i]));
  }
  out.counter = counter_[static_cast<size_t>(slot)];
  out.next_input = last_sampled_[static_cast<size_t>(slot)];
  return out;
}

void CpuEngine::matmul(const std::vector<float>& W, int in, int out, const float* x, int tokens,
                       float* y) {
  const float* w = W.data();
  pool_.run(out, [=](int64_t begin, int64_t end, int) {
    cpu::matmul_rows(w, in, out, static_cast<int>(begin), static_cast<int>(end), x, tokens, y);
  });
}

void CpuEngine::add_and_norm(int rows, const std::vector<float>& weight, float* out) {
  const int d = d_model_;
  pool_.run(rows, [&](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      float* res = res_.data() + r * d;
      const float* h = hidden_.data() + r * d;
      for (int i = 0; i < d; ++i) res[i] += h[i];
      cpu::rmsnorm(res, weight.data(), d, ModelConfig::kNormEps, out + r * d);
    }
  });
}

// The arithmetic of run_layer() row by row, with the projections as matrix products and
// each head's recurrence stepped through its segment's tokens in order.
void CpuEngine::prefill_layer(int layer, int rows) {
  const LayerWeights& l = layers_[static_cast<size_t>(layer)];
  const float eps = ModelConfig::kNormEps;
  const int RN = dims_.R * dims_.N;

  add_and_norm(rows, l.norm, normed_.data());
  matmul(l.in_proj, d_model_, in_rows_, normed_.data(), rows, in_out_.data());
  pool_.run(rows, [&](int64_t begin, int64_t end, int) {
    for (int64_t b = begin; b < end; ++b) {
      const float* w = in_out_.data() + b * in_rows_;
      for (int r = 0; r < dims_.R; ++r) {
        cpu::rmsnorm(w + bc_offset_B_ + r * dims_.N, l.B_norm.data(), dims_.N, eps,
                     B_normed_.data() + b * RN + r * dims_.N);
        cpu::rmsnorm(w + bc_offset_C_ + r * dims_.N, l.C_norm.data(), dims_.N, eps,
                     C_normed_.data() + b * RN + r * dims_.N);
      }
    }
  });

  const cpu::MixerParams params{l.dt_bias.data(), l.D.data(),      l.B_bias.data(),
                                l.C_bias.data(),  l.mimo_x.data(), l.mimo_z.data(),
                                l.mimo_o.data(),  dims_.outproj_norm ? l.out_norm.data() : nullptr};
  const int H = dims_.H;
  const int64_t items = static_cast<int64_t>(prefill_segments_.size()) * H;
  pool_.run(items, [&](int64_t begin, int64_t end, int share) {
    float* scratch = head_scratch_.data() + int64_t{share} * head_scratch_floats_;
    for (int64_t item = begin; item < end; ++item) {
      const PrefillSegment& seg = prefill_segments_[static_cast<size_t>(item / H)];
      const int h = static_cast<int>(item % H);
      if (bf16_state_) {  // stored after every token, as the step stores it
        for (int64_t b = seg.row; b < seg.row + seg.count; ++b) {
          mixer_head_step_bf16(params, static_cast<int>(b), h, seg.slot, layer, scratch,
                               ssm_scratch_.data() + int64_t{share} * ssm_per_layer_);
        }
        continue;
      }
      cpu::MixerState state = slot_state(seg.slot, layer);
      for (int64_t b = seg.row; b < seg.row + seg.count; ++b) {
        cpu::mixer_head_step(dims_, params, in_offsets_, in_out_.data() + b * in_rows_,
                             B_normed_.data() + b * RN, C_normed_.data() + b * RN, h, state,
                             scratch, mixer_out_.data() + b * d_inner_);
      }
    }
  });
  matmul(l.out_proj, d_inner_, d_model_, mixer_out_.data(), rows, hidden_.data());

  if (F_ > 0) {
    add_and_norm(rows, l.norm2, normed_.data());
    matmul(l.fc1, d_model_, 2 * F_, normed_.data(), rows, fc1_out_.data());
    pool_.run(rows, [&](int64_t begin, int64_t end, int) {
      for (int64_t b = begin; b < end; ++b) {
        cpu::gated_silu(fc1_out_.data() + b * 2 * F_, F_, mlp_act_.data() + b * F_);
      }
    });
    matmul(l.fc2, F_, d_model_, mlp_act_.data(), rows, hidden_.data());
  }
}

void CpuEngine::prefill(std::span<const PrefillRun> runs, std::span<int32_t> sampled,
                        std::span<float> logits) {
  const size_t total = validate_prefill(runs, sampled, logits);
  if (runs.empty()) return;
  const int d = d_model_;

  // The runs' tokens one after another, through every layer a window at a time: a run cut
  // by a window's end goes on in the next from the state the first left.
  size_t run = 0, pos = 0;
  while (run < runs.size()) {
    prefill_segments_.clear();
    int rows = 0;
    while (run < runs.size() && rows < prefill_window_) {
      const std::span<const int32_t> tokens = runs[run].tokens;
      const int count = static_cast<int>(std::min(tokens.size() - pos,
                                                  static_cast<size_t>(prefill_window_ - rows)));
      const bool last = pos + count == tokens.size();
      prefill_segments_.push_back({runs[run].slot, rows, count, static_cast<int>(run), last});
      for (int k = 0; k < count; ++k) {
        const int64_t r = rows + k;
        std::fill_n(res_.begin() + r * d, d, 0.0f);
        std::copy_n(embedding_.begin() + int64_t{tokens[pos + k]} * d, d, hidden_.begin() + r * d);
      }
      rows += count;
      pos += count;
      if (last) {
        ++run;
        pos = 0;
      }
    }
    for (int layer = 0; layer < config_.n_layer; ++layer) prefill_layer(layer, rows);
    for (const PrefillSegment& seg : prefill_segments_) {
      if (!seg.last) continue;
      const int64_t r = seg.row + seg.count - 1;
      float* res = res_.data() + r * d;
      const float* h = hidden_.data() + r * d;
      for (int i = 0; i < d; ++i) res[i] += h[i];
      cpu::rmsnorm(res, norm_f_.data(), d, ModelConfig::kNormEps,
                   prefill_last_.data() + int64_t{seg.run} * d);
    }
  }

  // lm_head and the sample for each run's last token, as its step would: that step's
  // draw is the slot's counter plus the tokens before it.
  const int batch = static_cast<int>(runs.size());
  const float* head = lm_head_;
  float* out = logits_.data();
  const float* x = prefill_last_.data();
  const int V = V_;
  pool_.run(V, [=](int64_t begin, int64_t end, int) {
    cpu::matvec_rows(head, d, V, static_cast<int>(begin), static_cast<int>(end), x, batch, out);
  });
  pool_.run(batch, [&](int64_t begin, int64_t end, int) {
    for (int64_t b = begin; b < end; ++b) {
      const PrefillRun& r = runs[static_cast<size_t>(b)];
      const size_t slot = static_cast<size_t>(r.slot);
      const std::span<const float> row(logits_.data() + b * V_, static_cast<size_t>(V_));
      const SamplingParams& p = params_[slot];
      // After an input token the sample starts a frame (as in step()).
      const std::span<const TokenRange> allowed =
          p.mask >= 0 ? masks_.ranges(p.mask, 0) : std::span<const TokenRange>{};
      const int32_t token = sample_token(row, config_.vocab_size, p, counter_[slot] + r.tokens.size() - 1,
                                         sampling_scratch_[static_cast<size_t>(b)], allowed);
      sampled[static_cast<size_t>(b)] = token;
      frame_position_[slot] = p.mask >= 0 ? next_frame_position(masks_.view(), p.mask, 0, token) : 0;
    }
  });
  for (int b = 0; b < batch; ++b) {
    const PrefillRun& r = runs[static_cast<size_t>(b)];
    last_sampled_[static_cast<size_t>(r.slot)] = sampled[static_cast<size_t>(b)];
    counter_[static_cast<size_t>(r.slot)] += r.tokens.size();
  }
  if (!logits.empty()) {
    std::memcpy(logits.data(), logits_.data(), sizeof(float) * static_cast<size_t>(batch) * V_);
  }
  tokens_.fetch_add(total, std::memory_order_relaxed);
}

}  // namespace

std::unique_ptr<Engine> make_cpu_engine(const ModelWeights& weights, const EngineOptions& options) {
  return std::make_unique<CpuEngine>(weights, options);
}

CpuSlotSnapshot cpu_slot_snapshot(const Engine& engine, int slot) {
  const auto* cpu = dynamic_cast<const CpuEngine*>(&engine);
  if (cpu == nullptr) {
    throw std::invalid_argument("cpu_slot_snapshot: the engine is \"" + std::string(engine.backend()) +
                                "\", not the CPU engine");
  }
  return cpu->snapshot(slot);
}

}  // namespace m3
