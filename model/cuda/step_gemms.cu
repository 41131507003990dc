#include "model/cuda/step_gemms.h"

#include <algorithm>
#include <stdexcept>

#include "kernels/common.cuh"

namespace m3::cuda {
namespace {

// A chain's GEMMs are small (at most a few thousand rows of s2s-14l's shapes): no split of
// the inner dimension needs more than this.
constexpr size_t kChainWorkspaceBytes = 8u << 20;

struct Projection {
  int out_features, in_features, x_stride, y_stride;
  bool accumulate;
};

// in_proj, out_proj, lm_head, fc1, fc2: y rows as the step's buffers lay them out.
std::vector<Projection> projections(const ModelConfig& c, int in_proj_stride) {
  std::vector<Projection> p = {
      {in_proj_stride, c.d_model, c.d_model, in_proj_stride, false},
      {c.d_model, c.d_inner(), c.d_inner(), c.d_model, true},
      {c.padded_vocab(), c.d_model, c.d_model, c.padded_vocab(), false},
  };
  if (c.has_mlp()) {
    p.push_back({2 * c.mlp_width(), c.d_model, c.d_model, 2 * c.mlp_width(), false});
    p.push_back({c.d_model, c.mlp_width(), c.mlp_width(), c.d_model, true});
  }
  return p;
}

kernels::LtGemmShape shape_of(const Projection& p, WeightDType type, const std::vector<int>& rows) {
  kernels::LtGemmShape s;
  s.out_features = p.out_features;
  s.in_features = p.in_features;
  s.x_stride = p.x_stride;
  s.y_stride = p.y_stride;
  s.accumulate = p.accumulate;
  s.type = type;
  s.row_counts = rows;
  s.max_rows = 1;
  for (const int r : rows) s.max_rows = std::max(s.max_rows, r);
  return s;
}

}  // namespace

std::string step_gemm_refusal(const ModelConfig& config, int in_proj_stride) {
  static const char* kNames[] = {"in_proj", "out_proj", "lm_head", "fc1", "fc2"};
  const std::vector<Projection> p = projections(config, in_proj_stride);
  for (size_t i = 0; i < p.size(); ++i) {
    const std::string why = kernels::lt_gemm_shape_refusal(shape_of(p[i], WeightDType::BF16, {1}));
    if (!why.empty()) {
      return std::string(kNames[i]) + " (" + std::to_string(p[i].out_features) + " x " +
             std::to_string(p[i].in_features) + "): " + why;
    }
  }
  return "";
}

StepGemms::StepGemms(const ModelConfig& config, WeightDType type, int in_proj_stride,
                     const std::vector<std::vector<int>>& chain_rows) {
  const std::string refusal = step_gemm_refusal(config, in_proj_stride);
  const std::vector<Projection> p = projections(config, in_proj_stride);
  chains_.resize(chain_rows.size());
  for (size_t k = 0; k < chain_rows.size(); ++k) {
    if (chain_rows[k].empty()) continue;
    if (!refusal.empty()) throw std::invalid_argument("decode GEMMs: " + refusal);
    ChainGemms& g = chains_[k];
    g.context = std::make_unique<kernels::LtContext>(kChainWorkspaceBytes);
    auto make = [&](const Projection& q) {
      return std::make_unique<kernels::LtGemm>(*g.context, shape_of(q, type, chain_rows[k]));
    };
    g.in_proj = make(p[0]);
    g.out_proj = make(p[1]);
    g.lm_head = make(p[2]);
    if (config.has_mlp()) {
      g.fc1 = make(p[3]);
      g.fc2 = make(p[4]);
    }
  }
}

void StepGemms::load_kernels(const WarmUp& w, cudaStream_t stream) const {
  for (const ChainGemms& g : chains_) {
    if (g.context == nullptr) continue;
    g.in_proj->run_every_bucket(w.in_proj, w.u, w.in_proj_out, stream);
    g.out_proj->run_every_bucket(w.out_proj, w.o, w.residual, stream);
    g.lm_head->run_every_bucket(w.lm_head, w.u, w.logits, stream);
    if (g.fc1 != nullptr) {
      g.fc1->run_every_bucket(w.fc1, w.u, w.fc1_out, stream);
      g.fc2->run_every_bucket(w.fc2, w.act, w.residual, stream);
    }
  }
  M3_CUDA_CHECK(cudaStreamSynchronize(stream));
}

const ChainGemms* StepGemms::chain(int k) const {
  if (k < 0 || k >= static_cast<int>(chains_.size()) || chains_[k].context == nullptr) return nullptr;
  return &chains_[k];
}

}  // namespace m3::cuda
