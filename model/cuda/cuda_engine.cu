// The CUDA engine: weights and state on the device, every buffer allocated at load, and
// one captured graph per batch bucket that runs the whole decode step. A step costs one
// small H2D copy of the slot table and one graph launch, whose sampling kernels write the
// sampled ids straight into pinned host memory.
#include "model/cuda_engine.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/common.cuh"
#include "kernels/embedding.cuh"
#include "kernels/gemv.cuh"
#include "model/cpu_sampling.h"
#include "model/cuda/cuda_engine_impl.h"
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

using kernels::KernelLaunch;

constexpr int kMaxChains = 4;

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

}  // namespace

CudaEngine::CudaEngine(const ModelWeights& weights, const EngineOptions& options)
    : config_(weights.config()),
      max_slots_(options.max_slots),
      scratch_slot_(options.max_slots),
      use_graphs_(options.use_graphs),
      device_(options.device) {
  if (max_slots_ < 1) {
    throw std::invalid_argument("cuda engine: max_slots must be at least 1, got " +
                                std::to_string(max_slots_));
  }
  const int devices = cuda_device_count();
  if (device_ < 0 || device_ >= devices) {
    throw std::runtime_error("cuda engine: device " + std::to_string(device_) + " requested, " +
                             std::to_string(devices) + " visible");
  }
  M3_CUDA_CHECK(cudaSetDevice(device_));
  check_config_supported(config_);
  // Switches for A/B measurements (m3bench): PDL on, L2 prefetch of later kernels' weights
  // off and of the next step's first weights on by default; the small buckets' step
  // variants measured at load unless a switch fixes them (0 / 1).
  if (const char* env = std::getenv("M3_CUDA_PDL"); env != nullptr && std::string(env) == "0") {
    pdl_ = false;
  }
  out_proj_fusion_ = std::clamp(kernels::env_int("M3_CUDA_FUSED_OUT_PROJ", -1), -1, 1);
  if (options.deterministic) out_proj_fusion_ = 0;  // the fused out_proj adds with atomics
  embedding_gather_ = std::clamp(kernels::env_int("M3_CUDA_FUSED_EMBEDDING", -1), -1, 1);
  gemv_rows_per_warp_ = kernels::gemv_small_rows_per_warp_switch();
  fused_cluster_ = kernels::mimo_step_tc_fused_cluster_switch();
  if (const char* env = std::getenv("M3_CUDA_L2_PREFETCH"); env != nullptr) {
    l2_prefetch_ = std::string(env) == "1";
  }
  mimo_tc_min_batch_ = kernels::env_int("M3_MIMO_TC_MIN_BATCH", mimo_tc_min_batch_);  // 0 or less: never
  tc_fuse_max_batch_ = kernels::env_int("M3_MIMO_TC_FUSE_MAX_BATCH", tc_fuse_max_batch_);
  forced_chains_ = std::clamp(kernels::env_int("M3_CUDA_CHAINS", 0), 0, kMaxChains);
  next_step_prefetch_ = kernels::env_int("M3_CUDA_NEXT_STEP_PREFETCH", 1) != 0;
  M3_CUDA_CHECK(cudaStreamCreateWithFlags(stream_.out(), cudaStreamNonBlocking));
  M3_CUDA_CHECK(cudaStreamCreateWithFlags(table_stream_.out(), cudaStreamNonBlocking));
  for (auto& e : table_ready_) M3_CUDA_CHECK(cudaEventCreateWithFlags(e.out(), cudaEventDisableTiming));
  chain_streams_.resize(kMaxChains - 1);
  join_events_.resize(kMaxChains - 1);
  for (auto& s : chain_streams_) M3_CUDA_CHECK(cudaStreamCreateWithFlags(s.out(), cudaStreamNonBlocking));
  for (auto& e : join_events_) M3_CUDA_CHECK(cudaEventCreateWithFlags(e.out(), cudaEventDisableTiming));
  M3_CUDA_CHECK(cudaEventCreateWithFlags(fork_event_.out(), cudaEventDisableTiming));

  const ModelConfig& c = config_;
  weights_ = upload_weights(weights, options.weight_dtype == WeightDType::BF16
                                         ? kernels::WeightType::BF16
                                         : kernels::WeightType::F32);
  layout_ = kernels::mimo_state_layout(c.n_heads(), c.ssm.headdim, c.ssm.d_state,
                                       c.ssm.mimo_rank, c.n_angles());
  slot_state_floats_ = layout_.floats * c.n_layer;

  for (int b = 1; b < max_slots_; b *= 2) bucket_sizes_.push_back(b);
  bucket_sizes_.push_back(max_slots_);
  max_bucket_ = max_slots_;
  bucket_of_batch_.assign(max_slots_ + 1, 0);
  for (int n = 1, g = 0; n <= max_slots_; ++n) {
    while (bucket_sizes_[g] < n) ++g;
    bucket_of_batch_[n] = g;
  }

  const int n_all = max_slots_ + 1;  // + the scratch slot
  const size_t B = max_bucket_;
  state_ = DeviceBuffer(sizeof(float) * slot_state_floats_ * n_all, "recurrent state");
  res_ = DeviceBuffer(sizeof(float) * B * c.d_model, "residual stream");
  w_ = DeviceBuffer(sizeof(float) * B * c.in_proj_rows(), "in_proj output");
  o_ = DeviceBuffer(sizeof(float) * B * c.d_inner(), "mixer output");
  if (c.has_mlp()) act_ = DeviceBuffer(sizeof(float) * B * c.mlp_width(), "mlp activation");
  logits_ = DeviceBuffer(sizeof(float) * B * c.padded_vocab(), "logits");
  table_ = DeviceBuffer(sizeof(int32_t) * table_ints() * kMaxQueuedSteps, "step tables");
  params_dev_ = DeviceBuffer(sizeof(kernels::SlotSampling) * n_all, "sampling params");
  counters_ = DeviceBuffer(sizeof(uint64_t) * n_all, "step counters");
  last_token_ = DeviceBuffer(sizeof(int32_t) * n_all, "last sampled tokens");
  table_host_ = PinnedBuffer(sizeof(int32_t) * table_ints() * kMaxQueuedSteps, "step tables (host)");
  sampled_host_ = PinnedBuffer(sizeof(int32_t) * B * kMaxQueuedSteps, "sampled ids (host)");
  params_host_ = PinnedBuffer(sizeof(kernels::SlotSampling) * n_all * kMaxQueuedSteps, "sampling params (host)");
  // The sampling kernels write the ids straight into pinned host memory: a device-to-host
  // copy after the graph cost each step() call about 5 us of wall time at batch 1 to 16
  // (H200, PERFORMANCE_NOTES.md run 177), none of device time.
  M3_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&sampled_mapped_), sampled_host_.as<void>(), 0));

  M3_CUDA_CHECK(cudaMemset(state_.get(), 0, state_.bytes()));
  M3_CUDA_CHECK(cudaMemset(res_.get(), 0, res_.bytes()));
  M3_CUDA_CHECK(cudaMemset(counters_.get(), 0, counters_.bytes()));
  M3_CUDA_CHECK(cudaMemset(last_token_.get(), 0, last_token_.bytes()));
  auto* th = table_host_.as<int32_t>();
  for (size_t i = 0; i < B; ++i) { th[i] = scratch_slot_; th[B + i] = 0; th[2 * B + i] = 0; }
  for (int t = 0; t < kMaxQueuedSteps; ++t) {
    M3_CUDA_CHECK(cudaMemcpy(table_.as<int32_t>() + t * table_ints(), th, sizeof(int32_t) * table_ints(),
                             cudaMemcpyHostToDevice));
  }
  params_.assign(n_all, kernels::SlotSampling{});
  has_sample_.assign(max_slots_, 0);
  steps_since_reset_.assign(max_slots_, 0);
  seen_in_step_.assign(max_slots_, 0);

  timing_events_.resize(2);
  for (auto& e : timing_events_) M3_CUDA_CHECK(cudaEventCreate(e.out()));
  for (auto& e : step_done_) M3_CUDA_CHECK(cudaEventCreateWithFlags(e.out(), cudaEventDisableTiming));

  build_plans();
  if (use_graphs_) capture_graphs();
  zero_slot(scratch_slot_);  // the variants' trial steps ran on it
  M3_CUDA_CHECK(cudaDeviceSynchronize());
}

// Every handle and buffer is released by its member's destructor (graphs first: they
// were declared after the streams, events and buffers they use).
CudaEngine::~CudaEngine() {
  cudaSetDevice(device_);
  // Queued steps write into pinned buffers freed below; the table copies run on their own stream.
  if (stream_) cudaStreamSynchronize(stream_);
  if (table_stream_) cudaStreamSynchronize(table_stream_);
}

void CudaEngine::build_plans() {
  for (int batch : bucket_sizes_) {
    std::vector<DecodeGraph> candidates;
    for (const StepVariant& v : step_variant_candidates(batch)) {
      DecodeGraph g = plan_step(batch, v);
      // A variant the shape does not allow plans like another one: keep one of them.
      const bool seen = std::any_of(candidates.begin(), candidates.end(),
                                    [&](const DecodeGraph& o) { return o.variant == g.variant; });
      if (!seen) candidates.push_back(std::move(g));
    }
    graphs_.push_back(choose_step_variant(std::move(candidates)));
    graphs_table1_.push_back(plan_step(batch, graphs_.back().variant, 1));
  }
}

DecodeGraph CudaEngine::plan_step(int batch, StepVariant variant, int table) const {
  const ModelConfig& c = config_;
  const auto L = c.in_proj_layout();
  const int B = max_bucket_;
  auto* slots = table_.as<int32_t>() + table * table_ints();
  auto* tokens = slots + B;
  auto* parities = slots + 2 * B;
  int32_t* sampled = sampled_mapped_ + table * B;
  bool any_out_proj_fused = false;
  int fused_cluster = 0;  // as planned (the tensor-core kernel's)
  // One chain: the whole step (embedding, every layer, lm_head, sampling) for batch rows
  // [row0, row0 + rows) of the bucket; `split`: other chains run beside it.
  auto plan_chain = [&](std::vector<KernelLaunch>& out, int row0, int rows, bool split) {
    float* res = res_.as<float>() + static_cast<size_t>(row0) * c.d_model;
    float* w = w_.as<float>() + static_cast<size_t>(row0) * c.in_proj_rows();
    float* o = o_.as<float>() + static_cast<size_t>(row0) * c.d_inner();
    float* act = c.has_mlp() ? act_.as<float>() + static_cast<size_t>(row0) * c.mlp_width() : nullptr;
    float* logits = logits_.as<float>() + static_cast<size_t>(row0) * c.padded_vocab();
    // Every projection of the step: y (+)= W . x, x RMS-normalised first when `norm` is
    // given; x rows are `cols` wide and y rows `out_rows` wide.
    auto projection_args = [&](const void* weight, int out_rows, int cols, const float* x, const float* norm,
                               float* y, kernels::GemvEpilogue epilogue) {
      kernels::GemvArgs a;
      a.weight = weight;
      a.type = weights_.type;
      a.out_rows = out_rows;
      a.cols = cols;
      a.x = x;
      a.x_stride = cols;
      a.norm_weight = norm;
      a.norm_eps = ModelConfig::kNormEps;
      a.y = y;
      a.y_stride = out_rows;
      a.batch = rows;
      a.epilogue = epilogue;
      a.beside_other_chains = split;
      a.rows_per_warp = variant.gemv_rows_per_warp;
      return a;
    };
    auto plan_projection = [&](const char* name, const void* weight, int out_rows, int cols,
                               const float* x, const float* norm, float* y,
                               kernels::GemvEpilogue epilogue) {
      return kernels::plan_gemv(projection_args(weight, out_rows, cols, x, norm, y, epilogue)).named(name);
    };
    const size_t msize = weights_.type == kernels::WeightType::BF16 ? 2 : 4;
    // The embedding rows: gathered by the first in_proj itself (which also writes them to
    // the residual stream), or copied there by a kernel of their own.
    kernels::GemvGather gather;
    if (variant.embedding_gathered) {
      gather = kernels::GemvGather{weights_.embedding, c.padded_vocab(), slots + row0, tokens + row0,
                                   last_token_.as<int32_t>(), res};
    } else {
      kernels::EmbeddingArgs emb{weights_.embedding, weights_.type, c.padded_vocab(), c.d_model,
                                 slots + row0, tokens + row0, last_token_.as<int32_t>(), res, rows};
      if (l2_prefetch_) emb.prefetch[0] = {weights_.layers[0].in_proj, msize * c.in_proj_rows() * c.d_model};
      out.push_back(kernels::plan_embedding(emb));
    }
    for (int i = 0; i < c.n_layer; ++i) {
      const DeviceLayer& lw = weights_.layers[i];
      kernels::GemvArgs in_proj = projection_args(lw.in_proj, c.in_proj_rows(), c.d_model, res, lw.norm, w,
                                                  kernels::GemvEpilogue::Store);
      if (i == 0) in_proj.gather = gather;
      out.push_back(kernels::plan_gemv(in_proj).named("in_proj"));

      kernels::MimoStepArgs m;
      m.heads = c.n_heads();
      m.headdim = c.ssm.headdim;
      m.d_state = c.ssm.d_state;
      m.rank = c.ssm.mimo_rank;
      m.n_angles = c.n_angles();
      m.mimo_rotation = c.ssm.is_mimo;
      m.a_floor = static_cast<float>(c.ssm.A_floor);
      m.norm_eps = ModelConfig::kNormEps;
      m.w = w;
      m.w_stride = c.in_proj_rows();
      m.off_z = L.z; m.off_x = L.x; m.off_B = L.B; m.off_C = L.C;
      m.off_dt = L.dd_dt; m.off_A = L.dd_A; m.off_trap = L.trap; m.off_ang = L.ang;
      m.dt_bias = lw.dt_bias; m.D = lw.D; m.B_bias = lw.B_bias; m.C_bias = lw.C_bias;
      m.B_norm = lw.B_norm; m.C_norm = lw.C_norm;
      m.mimo_x = lw.mimo_x; m.mimo_z = lw.mimo_z; m.mimo_o = lw.mimo_o; m.out_norm = lw.out_norm;
      m.state = state_.as<float>();
      m.slot_stride = slot_state_floats_;
      m.layer_offset = layout_.floats * i;
      m.slots = slots + row0;
      m.parities = parities + row0;
      m.o = o;
      m.o_stride = c.d_inner();
      m.batch = rows;
      m.beside_other_chains = split;
      // While the recurrence runs (latency-bound at small batch), pull the next two
      // matrices into L2: this layer's out_proj and whatever gemv follows it.
      m.prefetch[0] = {lw.out_proj, msize * c.d_model * c.d_inner()};
      if (!l2_prefetch_) {
        m.prefetch[0] = {};
      } else if (c.has_mlp()) {
        m.prefetch[1] = {lw.fc1, msize * 2 * c.mlp_width() * c.d_model};
      } else if (i + 1 < c.n_layer) {
        m.prefetch[1] = {weights_.layers[i + 1].in_proj, msize * c.in_proj_rows() * c.d_model};
      } else {
        m.prefetch[1] = {weights_.lm_head, msize * c.padded_vocab() * c.d_model};
      }
      // The recurrence on tensor cores (tf32 operands) only where the weights are bf16:
      // fp32 engines keep fp32 arithmetic throughout.
      m.tensor_cores = weights_.type == kernels::WeightType::BF16 && mimo_tc_min_batch_ > 0 &&
                       rows >= mimo_tc_min_batch_ && kernels::mimo_step_tc_applies(m);
      bool out_proj_fused = false;
      // Where the variant asks for it, at batch 1-2: beyond, measured on the H200
      // (PERFORMANCE_NOTES.md runs 104-115), it only lost (tensor cores: batch 8 219 -> 403 us
      // a step; every (16 rows, sequence) block holds its out_proj columns in registers, and
      // beside them the next in_proj's blocks cannot start early; CUDA cores: the atomics
      // grow with the batch). At batch 2 it wins only beside CUDA-core gemvs of four rows a
      // warp (runs 173-174: 159-160 against 164-167 us; beside the tensor-core gemvs
      // 162-166). Whether it wins depends on the GPU: measured at load
      // (cuda_engine_tuning.cu).
      if (variant.out_proj_fused && rows <= (m.tensor_cores ? tc_fuse_max_batch_ : 2)) {
        m.out_proj = lw.out_proj;
        m.out_proj_type = weights_.type;
        m.residual = res;
        m.residual_stride = c.d_model;
        m.d_model = c.d_model;
        m.fused_cluster = variant.fused_cluster;
        out_proj_fused = kernels::mimo_step_can_fuse_out_proj(m);
        if (!out_proj_fused) m.out_proj = nullptr;
        if (out_proj_fused && m.tensor_cores) fused_cluster = kernels::mimo_step_tc_fused_cluster(m);
      }
      any_out_proj_fused = any_out_proj_fused || out_proj_fused;
      out.push_back(kernels::plan_mimo_step(m));

      if (!out_proj_fused) {
        out.push_back(plan_projection("out_proj", lw.out_proj, c.d_model, c.d_inner(), o, nullptr, res,
                                      kernels::GemvEpilogue::Accumulate));
      }

      if (c.has_mlp()) {
        out.push_back(plan_projection("fc1", lw.fc1, c.mlp_width(), c.d_model, res, lw.norm2, act,
                                      kernels::GemvEpilogue::GatedSilu));
        out.push_back(plan_projection("fc2", lw.fc2, c.d_model, c.mlp_width(), act, nullptr, res,
                                      kernels::GemvEpilogue::Accumulate));
      }
    }
    out.push_back(plan_projection("lm_head", weights_.lm_head, c.padded_vocab(), c.d_model, res,
                                  weights_.norm_f, logits, kernels::GemvEpilogue::Store));

    kernels::SamplingArgs s;
    s.logits = logits;
    s.logits_stride = c.padded_vocab();
    s.vocab = c.vocab_size;
    s.slots = slots + row0;
    s.params = params_dev_.as<kernels::SlotSampling>();
    s.counters = counters_.as<uint64_t>();
    s.last_token = last_token_.as<int32_t>();
    s.sampled = sampled + row0;
    s.batch = rows;
    if (next_step_prefetch_) {
      // This chain's share of the first in_proj's weights, for the next step; one block a
      // multiprocessor (H200, PERFORMANCE_NOTES.md runs 178-179: 0.5-2 us a step at every
      // batch; two or four times as many blocks, or the first out_proj too, gained nothing more).
      const uint64_t bytes = msize * c.in_proj_rows() * c.d_model;
      const uint64_t from = (bytes * row0 / batch) & ~uint64_t{15};
      const uint64_t to = row0 + rows == batch ? bytes : (bytes * (row0 + rows) / batch) & ~uint64_t{15};
      s.prefetch = {static_cast<const char*>(weights_.layers[0].in_proj) + from, to - from};
      s.prefetch_blocks = kernels::multiprocessor_count();
    }
    out.push_back(kernels::plan_sampling(s));
  };
  DecodeGraph g;
  g.batch = batch;
  const int chains = chains_for_batch(batch);
  for (int k = 0; k < chains; ++k) {
    const int row0 = k * batch / chains;
    g.chain_begin.push_back(g.launches.size());
    plan_chain(g.launches, row0, (k + 1) * batch / chains - row0, chains > 1);
  }
  g.variant = StepVariant{any_out_proj_fused, variant.embedding_gathered, variant.gemv_rows_per_warp, fused_cluster};
  return g;
}

// Chains per bucket: each serves its share of the rows with its own kernels, and the
// chains run side by side (forked off stream_ and joined back), so one chain's
// memory-bound recurrence overlaps another's latency-bound projections. Two from batch 32:
// measured on the H200 (PERFORMANCE_NOTES.md run 87), batch 64 790 -> 719 us and 32
// 455 -> 442; below 32 the chains only compete (batch 4 180 -> 203). M3_CUDA_CHAINS=1..4
// forces a count for every bucket (A/B measurements).
int CudaEngine::chains_for_batch(int batch) const {
  const int chains = forced_chains_ > 0 ? forced_chains_ : batch >= 32 ? 2 : 1;
  return std::max(1, std::min(chains, batch));
}

// Chain 0 on stream_, chain k on chain_streams_[k - 1], forked after whatever stream_
// holds and joined back into it; PDL inside each chain (its first kernel follows an event
// or a host copy, not a kernel).
void CudaEngine::launch_chains(const DecodeGraph& g) {
  const size_t chains = g.chain_begin.size();
  auto chain_end = [&](size_t k) { return k + 1 < chains ? g.chain_begin[k + 1] : g.launches.size(); };
  if (chains > 1) {
    M3_CUDA_CHECK(cudaEventRecord(fork_event_, stream_));
    for (size_t k = 1; k < chains; ++k) M3_CUDA_CHECK(cudaStreamWaitEvent(chain_streams_[k - 1], fork_event_, 0));
  }
  for (size_t i = 0; i < chain_end(0); ++i) g.launches[i].launch(stream_, pdl_ && i > 0);
  for (size_t k = 1; k < chains; ++k) {
    const size_t begin = g.chain_begin[k];
    for (size_t i = begin; i < chain_end(k); ++i) g.launches[i].launch(chain_streams_[k - 1], pdl_ && i > begin);
  }
  for (size_t k = 1; k < chains; ++k) {
    M3_CUDA_CHECK(cudaEventRecord(join_events_[k - 1], chain_streams_[k - 1]));
    M3_CUDA_CHECK(cudaStreamWaitEvent(stream_, join_events_[k - 1], 0));
  }
}

void CudaEngine::run_plan(const DecodeGraph& g, bool use_graph) {
  if (use_graph) {
    M3_CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
    return;
  }
  launch_chains(g);
}

void CudaEngine::capture(DecodeGraph& g) {
  M3_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  try {
    launch_chains(g);
  } catch (...) {
    CudaGraph broken;  // ends the capture; released on the way out
    cudaStreamEndCapture(stream_, broken.out());
    throw;
  }
  M3_CUDA_CHECK(cudaStreamEndCapture(stream_, g.graph.out()));
  M3_CUDA_CHECK(cudaGraphInstantiate(g.exec.out(), g.graph, 0));
  M3_CUDA_CHECK(cudaGraphUpload(g.exec, stream_));
}

void CudaEngine::capture_graphs() {
  for (DecodeGraph& g : graphs_) {
    if (g.exec == nullptr) capture(g);  // the candidates of tuned buckets already are
  }
  for (DecodeGraph& g : graphs_table1_) capture(g);
}

const DecodeGraph& CudaEngine::graph_for_batch(int batch, int table) const {
  return (table == 0 ? graphs_ : graphs_table1_)[bucket_of_batch_[batch]];
}

int CudaEngine::kernels_per_step(int batch) const {
  return static_cast<int>(graph_for_batch(batch).launches.size());
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

void CudaEngine::reset(int slot) {
  check_usable("reset");
  if (slot < 0 || slot >= max_slots_) {
    throw std::invalid_argument(slot_context("reset", slot) + " is out of range [0, " +
                                std::to_string(max_slots_) + ")");
  }
  or_unusable([&] { zero_slot(slot); });  // queued behind the steps already submitted, ahead of later ones
  has_sample_[slot] = 0;
  steps_since_reset_[slot] = 0;
}

// The slot's device side as a new sequence finds it: state, random-draw counter and last
// sampled token zero (queued on stream_).
void CudaEngine::zero_slot(int slot) {
  float* st = state_.as<float>() + static_cast<size_t>(slot) * slot_state_floats_;
  M3_CUDA_CHECK(cudaMemsetAsync(st, 0, sizeof(float) * slot_state_floats_, stream_));
  M3_CUDA_CHECK(cudaMemsetAsync(counters_.as<uint64_t>() + slot, 0, sizeof(uint64_t), stream_));
  M3_CUDA_CHECK(cudaMemsetAsync(last_token_.as<int32_t>() + slot, 0, sizeof(int32_t), stream_));
}

void CudaEngine::set_sampling(int slot, const SamplingParams& params) {
  if (slot < 0 || slot >= max_slots_) {
    throw std::invalid_argument(slot_context("set_sampling", slot) + " is out of range [0, " +
                                std::to_string(max_slots_) + ")");
  }
  if (const std::string why = sampling_params_error(params); !why.empty()) {
    throw std::invalid_argument(slot_context("set_sampling", slot) + ": " + why);
  }
  kernels::SlotSampling& s = params_[slot];
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
    if (slot < 0 || slot >= max_slots_) {
      throw std::invalid_argument(slot_context("step", slot) + " is out of range [0, " +
                                  std::to_string(max_slots_) + ")");
    }
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
  const DecodeGraph& g = graph_for_batch(static_cast<int>(n), q);
  const int B = max_bucket_;
  auto* th = table_host_.as<int32_t>() + q * table_ints();
  for (size_t i = 0; i < n; ++i) {
    th[i] = slots[i];
    th[B + i] = tokens[i];
    th[2 * B + i] = static_cast<int32_t>(steps_since_reset_[slots[i]] & 1);
  }
  for (int i = static_cast<int>(n); i < g.batch; ++i) { th[i] = scratch_slot_; th[B + i] = 0; th[2 * B + i] = 0; }
  if (params_dirty_) {
    auto* ph = params_host_.as<kernels::SlotSampling>() + q * params_.size();
    std::copy(params_.begin(), params_.end(), ph);
    M3_CUDA_CHECK(cudaMemcpyAsync(params_dev_.get(), ph, params_dev_.bytes(), cudaMemcpyHostToDevice, stream_));
    params_dirty_ = false;
  }
  // Table q's last reader is the step collected before this one took position q, so the
  // copy may run at once, beside the step now on the device.
  M3_CUDA_CHECK(cudaMemcpyAsync(table_.as<int32_t>() + q * table_ints(), th, sizeof(int32_t) * table_ints(),
                                cudaMemcpyHostToDevice, table_stream_));
  M3_CUDA_CHECK(cudaEventRecord(table_ready_[q], table_stream_));
  M3_CUDA_CHECK(cudaStreamWaitEvent(stream_, table_ready_[q], 0));
  run_plan(g, use_graphs_);
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

void CudaEngine::collect_step(std::span<int32_t> sampled) {
  check_usable("collect_step");
  const int q = queue_position_for_collect(sampled);
  or_unusable([&] { M3_CUDA_CHECK(cudaEventSynchronize(step_done_[q])); });
  const int32_t* sh = sampled_host_.as<int32_t>() + static_cast<size_t>(q) * max_bucket_;
  std::copy(sh, sh + sampled.size(), sampled.begin());
  queue_pop();
}

std::vector<float> CudaEngine::time_replays(int batch, int iters, bool use_graph) {
  if (batch < 1 || batch > max_slots_) {
    throw std::invalid_argument("time_replays: batch " + std::to_string(batch) + " is outside [1, " +
                                std::to_string(max_slots_) + "]");
  }
  if (use_graph && !use_graphs_) {
    throw std::invalid_argument("time_replays: the engine was built with use_graphs=false");
  }
  use_device();
  const DecodeGraph& g = graph_for_batch(batch);
  constexpr int kGroup = 10;
  std::vector<float> us;
  us.reserve(iters / kGroup + 1);
  for (int i = 0; i < iters; i += kGroup) us.push_back(replay_group_us(g, use_graph, kGroup));
  return us;
}

// Replays go back to back in a group between two events, so the host's launch latency is
// hidden as it is in a serving loop; returns the group's mean per step.
float CudaEngine::replay_group_us(const DecodeGraph& g, bool use_graph, int group) {
  M3_CUDA_CHECK(cudaEventRecord(timing_events_[0], stream_));
  for (int j = 0; j < group; ++j) run_plan(g, use_graph);
  M3_CUDA_CHECK(cudaEventRecord(timing_events_[1], stream_));
  M3_CUDA_CHECK(cudaEventSynchronize(timing_events_[1]));
  float ms = 0.f;
  M3_CUDA_CHECK(cudaEventElapsedTime(&ms, timing_events_[0], timing_events_[1]));
  return ms * 1000.f / group;
}

std::vector<CudaEngine::KernelTime> CudaEngine::time_kernels(int batch, int reps) {
  if (batch < 1 || batch > max_slots_ || reps < 1) {
    throw std::invalid_argument("time_kernels: batch " + std::to_string(batch) + " or reps " +
                                std::to_string(reps) + " out of range");
  }
  use_device();
  const DecodeGraph& g = graph_for_batch(batch);
  std::vector<KernelTime> out;
  for (const kernels::KernelLaunch& l : g.launches) {
    l.launch(stream_, false);
    M3_CUDA_CHECK(cudaEventRecord(timing_events_[0], stream_));
    for (int r = 0; r < reps; ++r) l.launch(stream_, false);
    M3_CUDA_CHECK(cudaEventRecord(timing_events_[1], stream_));
    M3_CUDA_CHECK(cudaEventSynchronize(timing_events_[1]));
    float ms = 0.f;
    M3_CUDA_CHECK(cudaEventElapsedTime(&ms, timing_events_[0], timing_events_[1]));
    out.push_back({l.name(), ms * 1000.f / reps});
  }
  return out;
}

double CudaEngine::floor_bytes(int batch) const {
  const ModelConfig& c = config_;
  const double msize = weights_.type == kernels::WeightType::BF16 ? 2.0 : 4.0;
  const double state = 2.0 * sizeof(float) * static_cast<double>(c.state_floats_per_layer()) *
                       c.n_layer * batch;
  const double embedding = msize * c.d_model * batch;
  const double logits = 4.0 * c.padded_vocab() * batch;
  return static_cast<double>(weights_.matrix_bytes + weights_.vector_bytes) + state + embedding + logits;
}

}  // namespace cuda
}  // namespace m3
