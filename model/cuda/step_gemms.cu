#include "model/cuda/step_gemms.h"

#include <algorithm>
#include <stdexcept>

#include "kernels/common.cuh"

namespace m3::cuda {
namespace {

// A chain's GEMMs are small (at most a few thousand rows of s2s-14l's shapes): no split of
// the inner dimension needs more than this.
constexpr size_t kChainWorkspaceBytes = 8u << 20;

enum Projection { kInProj, kOutProj, kLmHead, kFc1, kFc2 };
constexpr const char* kNames[] = {"in_proj", "out_proj", "lm_head", "fc1", "fc2"};

// in_proj, out_proj, lm_head (and fc1, fc2 with an MLP), their y rows as the step's buffers
// lay them out, each planned for `rows`.
std::vector<kernels::LtGemmShape> shapes(const ModelConfig& c, WeightDType type, const std::vector<int>& rows) {
  const int in_proj = c.padded_in_proj_rows(), F = c.mlp_width();
  const int max_rows = rows.empty() ? 1 : *std::max_element(rows.begin(), rows.end());
  auto shape = [&](int out_features, int in_features, bool accumulate) {
    // Rows are packed: x rows in_features wide, y rows out_features wide.
    return kernels::LtGemmShape{out_features, in_features, max_rows, type, in_features, out_features, accumulate, rows};
  };
  std::vector<kernels::LtGemmShape> s = {shape(in_proj, c.d_model, false), shape(c.d_model, c.d_inner(), true),
                                         shape(c.padded_vocab(), c.d_model, false)};
  if (c.has_mlp()) {
    s.push_back(shape(2 * F, c.d_model, false));
    s.push_back(shape(c.d_model, F, true));
  }
  return s;
}

}  // namespace

std::string step_gemm_refusal(const ModelConfig& config) {
  const std::vector<kernels::LtGemmShape> s = shapes(config, WeightDType::BF16, {1});
  for (size_t i = 0; i < s.size(); ++i) {
    const std::string why = kernels::lt_gemm_shape_refusal(s[i]);
    if (!why.empty()) {
      return std::string(kNames[i]) + " (" + std::to_string(s[i].out_features) + " x " +
             std::to_string(s[i].in_features) + "): " + why;
    }
  }
  return "";
}

StepGemms::StepGemms(const ModelConfig& config, WeightDType type, const std::vector<std::vector<int>>& chain_rows) {
  const std::string refusal = step_gemm_refusal(config);
  chains_.resize(chain_rows.size());
  for (size_t k = 0; k < chain_rows.size(); ++k) {
    if (chain_rows[k].empty()) continue;
    if (!refusal.empty()) throw std::invalid_argument("decode GEMMs: " + refusal);
    ChainGemms& g = chains_[k];
    g.context = std::make_unique<kernels::LtContext>(kChainWorkspaceBytes);
    const std::vector<kernels::LtGemmShape> s = shapes(config, type, chain_rows[k]);
    auto make = [&](Projection p) { return std::make_unique<kernels::LtGemm>(*g.context, s[p]); };
    g.in_proj = make(kInProj);
    g.out_proj = make(kOutProj);
    g.lm_head = make(kLmHead);
    if (config.has_mlp()) {
      g.fc1 = make(kFc1);
      g.fc2 = make(kFc2);
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
