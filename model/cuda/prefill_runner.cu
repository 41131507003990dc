#include "model/cuda/prefill_runner.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/common.cuh"
#include "kernels/gemv.cuh"
#include "kernels/sampling.cuh"
#include "model/cuda/graph_capture.h"

namespace m3::cuda {
namespace {

kernels::PrefillScanDims scan_dims(const ModelConfig& c, WeightDType type) {
  kernels::PrefillScanDims d;
  d.heads = c.n_heads();
  d.headdim = c.ssm.headdim;
  d.d_state = c.ssm.d_state;
  d.rank = c.ssm.mimo_rank;
  d.n_angles = c.n_angles();
  // bf16 weights: bf16 tensor-core operands (logits within 3e-2); fp32 weights keep fp32
  // products (within 1e-3).
  d.precision = type == WeightDType::BF16 ? kernels::ScanPrecision::Bf16TensorCores : kernels::ScanPrecision::Fp32;
  return d;
}

}  // namespace

std::string PrefillRunner::refusal(const ModelConfig& config, WeightDType type) {
  if (const auto why = kernels::prefill_scan_shape_refusal(scan_dims(config, type))) return *why;
  return {};
}

PrefillRunner::PrefillRunner(const ModelConfig& config, const DeviceWeights& weights, const StepBuffers& buffers,
                             const kernels::MimoStateLayout& layout, const CudaPolicy& policy, int max_runs,
                             int max_tokens, cudaStream_t stream)
    : config_(config),
      weights_(weights),
      buffers_(buffers),
      layout_(layout),
      max_runs_(max_runs),
      max_tokens_(max_tokens),
      dims_(scan_dims(config, weights.type)),
      pdl_(policy.pdl),
      chunk_tokens_(kernels::prefill_chunk_tokens(dims_)),
      act_(weights.type) {
  const ModelConfig& c = config_;
  if (const std::string why = refusal(c, weights.type); !why.empty()) {
    throw std::invalid_argument("cuda engine: cuda.prefill: chunked cannot run this model: " + why +
                                " (cuda.prefill: steps can)");
  }
  if (max_runs_ < 1 || max_tokens_ < 1) {
    throw std::invalid_argument("cuda engine: chunked prefill needs at least one run and one token, got " +
                                std::to_string(max_runs_) + " runs and " + std::to_string(max_tokens_) + " tokens");
  }
  scan_plan_ = kernels::prepare_prefill_scan(dims_);

  scan_workspace_ = DeviceBuffer(kernels::prefill_scan_workspace_bytes(dims_, max_tokens_, max_runs_),
                                 "prefill scan workspace");
  kernels::PrefillRowSizes sizes;
  sizes.d_model = c.d_model;
  sizes.in_proj_rows = c.padded_in_proj_rows();  // the padding's columns of w stay zero
  sizes.d_inner = c.d_inner();
  sizes.mlp_width = c.has_mlp() ? c.mlp_width() : 0;
  sizes.act = act_;
  sizes.max_tokens = max_tokens_;
  rows_storage_ = DeviceBuffer(kernels::prefill_row_buffer_bytes(sizes), "prefill row buffers");
  // Zeroed once: the GEMMs compute whole row buckets, and the rows past a call's tokens
  // then read finite values.
  M3_CUDA_CHECK(cudaMemset(rows_storage_.get(), 0, rows_storage_.bytes()));
  rows_ = kernels::prefill_row_buffers(sizes, rows_storage_.get());

  const size_t table_ints = tokens_at() + static_cast<size_t>(max_tokens_);
  table_ = DeviceBuffer(sizeof(int32_t) * table_ints, "prefill run table");
  table_host_ = PinnedBuffer(sizeof(int32_t) * table_ints, "prefill run table (host)");
  sampled_host_ = PinnedBuffer(sizeof(int32_t) * max_runs_, "prefill sampled ids (host)");
  M3_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&sampled_mapped_), sampled_host_.as<void>(), 0));
  lengths_.assign(max_runs_, 0);

  lt_ = std::make_unique<kernels::LtContext>();
  auto gemm = [&](int out_features, int in_features, int x_stride, int y_stride, bool accumulate) {
    kernels::LtGemmShape s;
    s.out_features = out_features;
    s.in_features = in_features;
    s.max_rows = max_tokens_;
    s.type = weights.type;
    s.x_stride = x_stride;
    s.y_stride = y_stride;
    s.accumulate = accumulate;
    return std::make_unique<kernels::LtGemm>(*lt_, s);
  };
  in_proj_ = gemm(c.padded_in_proj_rows(), c.d_model, rows_.u_stride, rows_.w_stride, false);
  out_proj_ = gemm(c.d_model, c.d_inner(), rows_.o_stride, rows_.res_stride, true);
  if (c.has_mlp()) {
    fc1_ = gemm(2 * c.mlp_width(), c.d_model, rows_.u_stride, rows_.fc1_stride, false);
    fc2_ = gemm(c.d_model, c.mlp_width(), rows_.mlp_act_stride, rows_.res_stride, true);
  }

  // The head of every batch a call can have, planned as the decode step plans its own.
  const int32_t* slots = table_.as<int32_t>() + slot_at();
  for (int b = 1; b <= max_runs_; ++b) {
    kernels::GemvArgs g;
    g.weight = weights.lm_head;
    g.type = weights.type;
    g.out_rows = c.padded_vocab();
    g.cols = c.d_model;
    g.x = rows_.last;
    g.x_stride = rows_.res_stride;
    g.norm_weight = weights.norm_f;
    g.norm_eps = ModelConfig::kNormEps;
    g.y = buffers_.logits;
    g.y_stride = c.padded_vocab();
    g.batch = b;
    g.epilogue = kernels::GemvEpilogue::Store;
    g.policy = policy.gemv;
    lm_head_.push_back(kernels::plan_gemv(g).named("prefill lm_head"));

    kernels::SamplingArgs s;
    s.logits = buffers_.logits;
    s.logits_stride = c.padded_vocab();
    s.vocab = c.vocab_size;
    s.slots = slots;
    s.params = buffers_.sampling;
    s.counters = buffers_.counters;
    s.last_token = buffers_.last_token;
    s.masks = buffers_.masks;
    s.tokens = table_.as<int32_t>() + last_token_at();
    s.frame_positions = buffers_.frame_positions;
    s.sampled = sampled_mapped_;
    s.batch = b;
    sampling_.push_back(kernels::plan_sampling(s));
  }

  // Every row bucket's cuBLASLt kernel loaded now rather than by the first call that needs
  // it (several milliseconds each). The row buffers are zero, so they stay finite.
  const DeviceLayer& l0 = weights.layers[0];
  in_proj_->run_every_bucket(l0.in_proj, rows_.u, rows_.w, stream);
  out_proj_->run_every_bucket(l0.out_proj, rows_.o, rows_.res, stream);
  if (c.has_mlp()) {
    fc1_->run_every_bucket(l0.fc1, rows_.u, rows_.fc1_out, stream);
    fc2_->run_every_bucket(l0.fc2, rows_.mlp_act, rows_.res, stream);
  }

  // A graph for every length a lone run may have up to the policy's limit, each uploaded,
  // so the first call of a length runs as fast as any later one.
  const int graph_lengths = std::min(policy.prefill_graph_max_tokens, max_tokens_);
  graphs_.resize(graph_lengths);
  for (int t = 1; t <= graph_lengths; ++t) {
    const int32_t length = t;
    int32_t token_begin[2], chunk_begin[2];
    const int chunks =
        kernels::fill_prefill_runs(std::span<const int32_t>(&length, 1), chunk_tokens_, token_begin, chunk_begin);
    CudaGraph graph;  // needed only until instantiated
    capture_graph(stream, [&] { enqueue(1, t, chunks, t, stream); }, graph, graphs_[t - 1]);
  }
  M3_CUDA_CHECK(cudaStreamSynchronize(stream));
}

PrefillRunner::~PrefillRunner() = default;

void PrefillRunner::enqueue(int n, int tokens, int chunks, int max_run_tokens, cudaStream_t stream) {
  const ModelConfig& c = config_;
  const int32_t* d = table_.as<int32_t>();
  kernels::PrefillRuns dev_runs;
  dev_runs.slot = d + slot_at();
  dev_runs.parity = d + parity_at();
  dev_runs.token_begin = d + token_begin_at();
  dev_runs.chunk_begin = d + chunk_begin_at();
  dev_runs.n_runs = n;
  dev_runs.n_tokens = tokens;
  dev_runs.n_chunks = chunks;
  dev_runs.max_run_tokens = max_run_tokens;

  const float eps = ModelConfig::kNormEps;
  kernels::gather_rows(weights_.embedding, weights_.type, c.padded_vocab(), c.d_model, d + tokens_at(), tokens,
                       rows_.res, rows_.res_stride, stream);

  const auto L = c.in_proj_layout();
  kernels::PrefillScanArgs a;
  a.dims = dims_;
  a.plan = scan_plan_;
  a.mimo_rotation = c.ssm.is_mimo;
  a.a_floor = static_cast<float>(c.ssm.A_floor);
  a.norm_eps = eps;
  a.w = rows_.w;
  a.w_stride = rows_.w_stride;
  a.off_z = L.z; a.off_x = L.x; a.off_B = L.B; a.off_C = L.C;
  a.off_dt = L.dd_dt; a.off_A = L.dd_A; a.off_trap = L.trap; a.off_ang = L.ang;
  a.state = buffers_.state;
  a.slot_stride = buffers_.slot_state_floats;
  a.runs = dev_runs;
  a.ws = kernels::prefill_scan_workspace(dims_, max_tokens_, max_runs_, scan_workspace_.get());
  a.o = rows_.o;
  a.o_stride = rows_.o_stride;
  a.o_bf16 = act_ == WeightDType::BF16;
  a.pdl = pdl_;

  for (int i = 0; i < c.n_layer; ++i) {
    const DeviceLayer& lw = weights_.layers[i];
    kernels::rmsnorm_rows(rows_.res, rows_.res_stride, lw.norm, c.d_model, eps, rows_.u, act_, rows_.u_stride,
                          tokens, stream);
    in_proj_->run(lw.in_proj, rows_.u, rows_.w, tokens, stream);
    a.dt_bias = lw.dt_bias; a.D = lw.D; a.B_bias = lw.B_bias; a.C_bias = lw.C_bias;
    a.B_norm = lw.B_norm; a.C_norm = lw.C_norm;
    a.mimo_x = lw.mimo_x; a.mimo_z = lw.mimo_z; a.mimo_o = lw.mimo_o; a.out_norm = lw.out_norm;
    a.layer_offset = layout_.floats * i;
    a.state_bf16 = layout_.ssm_bf16;
    kernels::launch_prefill_scan(a, stream);
    out_proj_->run(lw.out_proj, rows_.o, rows_.res, tokens, stream);
    if (c.has_mlp()) {
      kernels::rmsnorm_rows(rows_.res, rows_.res_stride, lw.norm2, c.d_model, eps, rows_.u, act_, rows_.u_stride,
                            tokens, stream);
      fc1_->run(lw.fc1, rows_.u, rows_.fc1_out, tokens, stream);
      kernels::gated_silu_rows(rows_.fc1_out, rows_.fc1_stride, c.mlp_width(), rows_.mlp_act, act_,
                               rows_.mlp_act_stride, tokens, stream);
      fc2_->run(lw.fc2, rows_.mlp_act, rows_.res, tokens, stream);
    }
  }

  // Each run's last token: norm_f + lm_head and sampling at batch n, the slot's counter
  // first advanced past the run's earlier tokens (a step advances it once per token).
  kernels::last_rows_of_runs(rows_.res, rows_.res_stride, dev_runs.token_begin, n, c.d_model, rows_.last,
                             rows_.res_stride, stream);
  kernels::advance_run_counters(buffers_.counters, dev_runs.slot, dev_runs.token_begin, n, stream);
  // No programmatic dependent launch: sampling reads the counters before its wait.
  lm_head_[n - 1].launch(stream, false);
  sampling_[n - 1].launch(stream, false);
}

bool PrefillRunner::run(std::span<const PrefillRun> runs, std::span<const int32_t> parities,
                        std::span<int32_t> sampled, std::span<float> logits, cudaStream_t stream) {
  const ModelConfig& c = config_;
  const int n = static_cast<int>(runs.size());
  if (n == 0) return false;
  if (n > max_runs_ || parities.size() != runs.size() || sampled.size() != runs.size()) {
    throw std::invalid_argument("prefill: " + std::to_string(n) + " runs, " + std::to_string(parities.size()) +
                                " parities and " + std::to_string(sampled.size()) + " sampled entries (at most " +
                                std::to_string(max_runs_) + " runs)");
  }

  // The run table: slots, parities, token and chunk offsets, then every run's tokens.
  int32_t* th = table_host_.as<int32_t>();
  int tokens = 0, max_run_tokens = 0;
  for (int i = 0; i < n; ++i) {
    const auto len = static_cast<int32_t>(runs[i].tokens.size());
    if (len < 1 || tokens + len > max_tokens_) {
      throw std::invalid_argument("prefill: run " + std::to_string(i) + " of " + std::to_string(len) +
                                  " tokens after " + std::to_string(tokens) + " exceeds max_prefill_tokens " +
                                  std::to_string(max_tokens_));
    }
    th[slot_at() + i] = runs[i].slot;
    th[parity_at() + i] = parities[i];
    th[last_token_at() + i] = runs[i].tokens.back();
    lengths_[i] = len;
    std::copy(runs[i].tokens.begin(), runs[i].tokens.end(), th + tokens_at() + tokens);
    tokens += len;
    max_run_tokens = std::max(max_run_tokens, len);
  }
  const int chunks = kernels::fill_prefill_runs(std::span<const int32_t>(lengths_.data(), n), chunk_tokens_,
                                                th + token_begin_at(), th + chunk_begin_at());
  // The table's parts up to the last token in one copy (the host table is not touched
  // again before this call has synchronised).
  M3_CUDA_CHECK(cudaMemcpyAsync(table_.get(), th, sizeof(int32_t) * (tokens_at() + tokens), cudaMemcpyHostToDevice,
                                stream));
  const bool replay = n == 1 && tokens <= graph_max_tokens();
  if (replay) {
    M3_CUDA_CHECK(cudaGraphLaunch(graphs_[tokens - 1], stream));
  } else {
    enqueue(n, tokens, chunks, max_run_tokens, stream);
  }
  if (!logits.empty()) {
    M3_CUDA_CHECK(cudaMemcpyAsync(logits.data(), buffers_.logits,
                                  sizeof(float) * static_cast<size_t>(n) * c.padded_vocab(), cudaMemcpyDeviceToHost,
                                  stream));
  }
  M3_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int32_t* sh = sampled_host_.as<int32_t>();
  std::copy(sh, sh + n, sampled.begin());
  return replay;
}

}  // namespace m3::cuda
