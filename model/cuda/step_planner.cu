#include "model/cuda/step_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/embedding.cuh"
#include "kernels/prefill_rows.cuh"

namespace m3::cuda {

StepPlanReport StepPlan::report() const {
  StepPlanReport r;
  r.bucket = batch;
  r.variant = variant;
  for (size_t c = 0; c < chain_begin.size(); ++c) {
    std::vector<PlannedKernel>& chain = r.chains.emplace_back();
    for (size_t i = chain_begin[c]; i < chain_end(c); ++i) {
      const kernels::KernelLaunch& l = launches[i];
      chain.push_back(PlannedKernel{l.name(), l.variant(), {l.grid().x, l.grid().y, l.grid().z},
                                    {l.block().x, l.block().y, l.block().z}, l.dynamic_smem()});
    }
  }
  return r;
}

StepPlanner::StepPlanner(const ModelConfig& config, const DeviceWeights& weights, const StepBuffers& buffers,
                         const kernels::MimoStateLayout& layout, const CudaPolicy& policy, const StepGemms* gemms)
    : config_(config), weights_(weights), buffers_(buffers), layout_(layout), policy_(policy), gemms_(gemms) {}

StepPlan StepPlanner::plan(int batch, const StepVariant& variant, int table) const {
  const ModelConfig& c = config_;
  const int B = buffers_.max_bucket;
  const int32_t* slots = buffers_.tables + table * buffers_.table_ints();
  StepPlan g;
  g.batch = batch;
  Outcome outcome;
  const int chains = chains_for_batch(batch);
  const bool gemms = step_uses_gemms(policy_, batch);
  for (int k = 0; k < chains; ++k) {
    Chain chain;
    chain.row0 = chain_row0(batch, chains, k);
    chain.rows = chain_row0(batch, chains, k + 1) - chain.row0;
    chain.split = chains > 1;
    const size_t row0 = static_cast<size_t>(chain.row0);
    chain.slots = slots + row0;
    chain.tokens = slots + B + row0;
    chain.parities = slots + 2 * B + row0;
    chain.sampled = buffers_.sampled + table * B + row0;
    chain.residual = buffers_.residual + row0 * c.d_model;
    chain.in_proj_out = buffers_.in_proj_out + row0 * c.padded_in_proj_rows();
    chain.mixer_out = buffers_.mixer_out + row0 * c.d_inner();
    chain.mlp_act = c.has_mlp() ? buffers_.mlp_act + row0 * c.mlp_width() : nullptr;
    chain.logits = buffers_.logits + row0 * c.padded_vocab();
    chain.variant = &variant;
    if (gemms) {
      chain.gemm = gemms_ != nullptr ? gemms_->chain(k) : nullptr;
      if (chain.gemm == nullptr || buffers_.gemm_u == nullptr) {
        throw std::logic_error("step planner: bucket " + std::to_string(batch) + " uses GEMMs, none were made for chain " +
                               std::to_string(k));
      }
      chain.u = static_cast<char*>(buffers_.gemm_u) + row0 * c.d_model * matrix_element_bytes();
      chain.fc1_out = c.has_mlp() ? buffers_.gemm_fc1_out + row0 * 2 * c.mlp_width() : nullptr;
    }
    g.chain_begin.push_back(g.launches.size());
    plan_chain(chain, batch, g.launches, outcome);
  }
  // (With GEMMs the embedding rows always come by their own kernel.)
  g.variant = StepVariant{outcome.out_proj_fused, variant.embedding_gathered && !gemms, variant.gemv_rows_per_warp,
                          outcome.fused_cluster};
  return g;
}

// The whole step (embedding, every layer, lm_head, sampling) for the chain's rows.
void StepPlanner::plan_chain(const Chain& chain, int batch, std::vector<kernels::KernelLaunch>& out,
                             Outcome& outcome) const {
  const kernels::GemvGather gather = plan_embedding(chain, out);
  for (int i = 0; i < config_.n_layer; ++i) {
    plan_mixer(i, chain, i == 0 ? gather : kernels::GemvGather{}, out, outcome);
    if (config_.has_mlp()) plan_mlp(i, chain, out);
  }
  plan_head(chain, batch, out);
}

size_t StepPlanner::matrix_element_bytes() const { return weights_.type == WeightDType::BF16 ? 2 : 4; }

kernels::GemvArgs StepPlanner::projection(const Chain& chain, const void* weight, int out_rows, int cols,
                                          const float* x, const float* norm, float* y,
                                          kernels::GemvEpilogue epilogue) const {
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
  a.batch = chain.rows;
  a.epilogue = epilogue;
  a.beside_other_chains = chain.split;
  a.rows_per_warp = chain.variant->gemv_rows_per_warp;
  a.policy = policy_.gemv;
  return a;
}

kernels::KernelLaunch StepPlanner::norm_rows(const Chain& chain, const float* x, const float* norm,
                                             const char* name) const {
  const int cols = config_.d_model, rows = chain.rows;
  const WeightDType type = weights_.type;
  void* u = chain.u;
  return kernels::KernelLaunch::library(name, [=](cudaStream_t stream) {
           kernels::rmsnorm_rows(x, cols, norm, cols, ModelConfig::kNormEps, u, type, cols, rows, stream);
         })
      .described("RMSNorm of " + std::to_string(rows) + " rows");
}

kernels::KernelLaunch StepPlanner::gemm_call(const Chain& chain, const kernels::LtGemm& gemm, const void* weight,
                                             const void* x, float* y, const char* name) const {
  const int rows = chain.rows, bucket = gemm.bucket_of(rows);
  const kernels::LtGemm* g = &gemm;
  const kernels::LtGemmShape& s = gemm.shape();
  return kernels::KernelLaunch::library(name, [=](cudaStream_t stream) { g->run_bucket(bucket, weight, x, y, stream); })
      .described("cuBLASLt GEMM " + std::to_string(rows) + " x " + std::to_string(s.in_features) + " -> " +
                 std::to_string(s.out_features) + (s.accumulate ? ", accumulating" : ""));
}

kernels::GemvGather StepPlanner::plan_embedding(const Chain& chain, std::vector<kernels::KernelLaunch>& out) const {
  const ModelConfig& c = config_;
  // (The GEMM path's first norm reads the residual: the embedding rows come by their kernel.)
  if (chain.variant->embedding_gathered && chain.gemm == nullptr) {
    return kernels::GemvGather{weights_.embedding, c.padded_vocab(), chain.slots, chain.tokens,
                               buffers_.last_token, chain.residual};
  }
  const kernels::EmbeddingArgs emb{weights_.embedding, weights_.type, c.padded_vocab(), c.d_model, chain.slots,
                                   chain.tokens, buffers_.last_token, chain.residual, chain.rows};
  out.push_back(kernels::plan_embedding(emb));
  return {};
}

void StepPlanner::plan_mixer(int layer, const Chain& chain, const kernels::GemvGather& gather,
                             std::vector<kernels::KernelLaunch>& out, Outcome& outcome) const {
  const ModelConfig& c = config_;
  const auto L = c.in_proj_layout();
  const DeviceLayer& lw = weights_.layers[layer];
  if (chain.gemm != nullptr) {
    out.push_back(norm_rows(chain, chain.residual, lw.norm, "in_proj_norm"));
    out.push_back(gemm_call(chain, *chain.gemm->in_proj, lw.in_proj, chain.u, chain.in_proj_out, "in_proj"));
  } else {
    kernels::GemvArgs in_proj = projection(chain, lw.in_proj, c.in_proj_rows(), c.d_model, chain.residual, lw.norm,
                                           chain.in_proj_out, kernels::GemvEpilogue::Store);
    in_proj.y_stride = c.padded_in_proj_rows();
    in_proj.gather = gather;
    out.push_back(kernels::plan_gemv(in_proj).named("in_proj"));
  }

  kernels::MimoStepArgs m;
  m.heads = c.n_heads();
  m.headdim = c.ssm.headdim;
  m.d_state = c.ssm.d_state;
  m.rank = c.ssm.mimo_rank;
  m.n_angles = c.n_angles();
  m.mimo_rotation = c.ssm.is_mimo;
  m.a_floor = static_cast<float>(c.ssm.A_floor);
  m.norm_eps = ModelConfig::kNormEps;
  m.w = chain.in_proj_out;
  m.w_stride = c.padded_in_proj_rows();
  m.off_z = L.z; m.off_x = L.x; m.off_B = L.B; m.off_C = L.C;
  m.off_dt = L.dd_dt; m.off_A = L.dd_A; m.off_trap = L.trap; m.off_ang = L.ang;
  m.dt_bias = lw.dt_bias; m.D = lw.D; m.B_bias = lw.B_bias; m.C_bias = lw.C_bias;
  m.B_norm = lw.B_norm; m.C_norm = lw.C_norm;
  m.mimo_x = lw.mimo_x; m.mimo_z = lw.mimo_z; m.mimo_o = lw.mimo_o; m.out_norm = lw.out_norm;
  m.state = buffers_.state;
  m.slot_stride = buffers_.slot_state_floats;
  m.layer_offset = layout_.floats * layer;
  m.state_bf16 = layout_.ssm_bf16;
  m.slots = chain.slots;
  m.parities = chain.parities;
  m.o = chain.mixer_out;
  m.o_stride = c.d_inner();
  m.o_bf16 = chain.gemm != nullptr && weights_.type == WeightDType::BF16;  // out_proj's GEMM input
  m.batch = chain.rows;
  m.beside_other_chains = chain.split;
  // The recurrence on tensor cores (tf32 operands) only where the weights are bf16:
  // fp32 engines keep fp32 arithmetic throughout.
  const int tc_min_batch = policy_.recurrence_tensor_core_min_batch;
  m.tensor_cores = weights_.type == WeightDType::BF16 && tc_min_batch > 0 && chain.rows >= tc_min_batch &&
                   kernels::mimo_step_tc_applies(m);
  // Where the variant asks for it, up to the policy's batch on tensor cores, 2 on CUDA
  // cores: beyond, the blocks holding their out_proj columns keep the next in_proj's
  // blocks from starting early, and the atomics grow with the batch.
  const StepVariant& variant = *chain.variant;
  bool out_proj_fused = false;
  if (variant.out_proj_fused && chain.gemm == nullptr &&
      chain.rows <= (m.tensor_cores ? policy_.recurrence_fuse_max_batch : 2)) {
    m.out_proj = lw.out_proj;
    m.out_proj_type = weights_.type;
    m.residual = chain.residual;
    m.residual_stride = c.d_model;
    m.d_model = c.d_model;
    m.fused_cluster = variant.fused_cluster != 0 ? variant.fused_cluster : policy_.step_variants.fused_cluster;
    out_proj_fused = kernels::mimo_step_can_fuse_out_proj(m, policy_.recurrence);
    if (!out_proj_fused) m.out_proj = nullptr;
    if (out_proj_fused && m.tensor_cores) outcome.fused_cluster = kernels::mimo_step_tc_fused_cluster(m);
  }
  outcome.out_proj_fused = outcome.out_proj_fused || out_proj_fused;
  out.push_back(kernels::plan_mimo_step(m, policy_.recurrence));

  if (chain.gemm != nullptr) {
    out.push_back(gemm_call(chain, *chain.gemm->out_proj, lw.out_proj, chain.mixer_out, chain.residual, "out_proj"));
  } else if (!out_proj_fused) {
    out.push_back(kernels::plan_gemv(projection(chain, lw.out_proj, c.d_model, c.d_inner(), chain.mixer_out, nullptr,
                                                chain.residual, kernels::GemvEpilogue::Accumulate))
                      .named("out_proj"));
  }
}

void StepPlanner::plan_mlp(int layer, const Chain& chain, std::vector<kernels::KernelLaunch>& out) const {
  const ModelConfig& c = config_;
  const DeviceLayer& lw = weights_.layers[layer];
  if (chain.gemm != nullptr) {
    out.push_back(norm_rows(chain, chain.residual, lw.norm2, "fc1_norm"));
    out.push_back(gemm_call(chain, *chain.gemm->fc1, lw.fc1, chain.u, chain.fc1_out, "fc1"));
    const int F = c.mlp_width(), rows = chain.rows;
    const WeightDType type = weights_.type;
    const float* fc1_out = chain.fc1_out;
    void* act = chain.mlp_act;
    out.push_back(kernels::KernelLaunch::library("gated_silu", [=](cudaStream_t stream) {
      kernels::gated_silu_rows(fc1_out, 2 * F, F, act, type, F, rows, stream);
    }));
    out.push_back(gemm_call(chain, *chain.gemm->fc2, lw.fc2, chain.mlp_act, chain.residual, "fc2"));
    return;
  }
  out.push_back(kernels::plan_gemv(projection(chain, lw.fc1, c.mlp_width(), c.d_model, chain.residual, lw.norm2,
                                              chain.mlp_act, kernels::GemvEpilogue::GatedSilu))
                    .named("fc1"));
  out.push_back(kernels::plan_gemv(projection(chain, lw.fc2, c.d_model, c.mlp_width(), chain.mlp_act, nullptr,
                                              chain.residual, kernels::GemvEpilogue::Accumulate))
                    .named("fc2"));
}

void StepPlanner::plan_head(const Chain& chain, int batch, std::vector<kernels::KernelLaunch>& out) const {
  const ModelConfig& c = config_;
  if (chain.gemm != nullptr) {
    out.push_back(norm_rows(chain, chain.residual, weights_.norm_f, "lm_head_norm"));
    out.push_back(gemm_call(chain, *chain.gemm->lm_head, weights_.lm_head, chain.u, chain.logits, "lm_head"));
  } else {
    out.push_back(kernels::plan_gemv(projection(chain, weights_.lm_head, c.padded_vocab(), c.d_model, chain.residual,
                                                weights_.norm_f, chain.logits, kernels::GemvEpilogue::Store))
                      .named("lm_head"));
  }

  kernels::SamplingArgs s;
  s.logits = chain.logits;
  s.logits_stride = c.padded_vocab();
  s.vocab = c.vocab_size;
  s.slots = chain.slots;
  s.params = buffers_.sampling;
  s.counters = buffers_.counters;
  s.last_token = buffers_.last_token;
  s.masks = buffers_.masks;
  s.tokens = chain.tokens;
  s.frame_positions = buffers_.frame_positions;
  s.sampled = chain.sampled;
  s.batch = chain.rows;
  if (policy_.next_step_prefetch) {
    // This chain's share of the first in_proj's weights, for the next step (whose first
    // kernel has no predecessor to overlap its loads with); one block a multiprocessor.
    const uint64_t bytes = matrix_element_bytes() * c.in_proj_rows() * c.d_model;
    const uint64_t from = (bytes * chain.row0 / batch) & ~uint64_t{15};
    const uint64_t to =
        chain.row0 + chain.rows == batch ? bytes : (bytes * (chain.row0 + chain.rows) / batch) & ~uint64_t{15};
    s.prefetch = {static_cast<const char*>(weights_.layers[0].in_proj) + from, to - from};
    s.prefetch_blocks = kernels::multiprocessor_count();
  }
  out.push_back(kernels::plan_sampling(s).described(
      s.prefetch_blocks > 0 ? "+ " + std::to_string(s.prefetch_blocks) + " blocks pulling the next step's first weights"
                            : ""));
}

}  // namespace m3::cuda
