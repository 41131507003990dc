#include "model/cuda/step_tuner.h"

#include <algorithm>
#include <cstdio>

namespace m3::cuda {
namespace {

// Buckets up to this size are tuned; larger ones take the planned variant (their steps
// are longer than a variant's difference).
constexpr int kTunedMaxBatch = 2;
constexpr int kWarmupReplays = 3;
constexpr int kRounds = 5;  // turns through the candidates
constexpr int kGroup = 10;  // replays a turn

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

std::string to_string(const StepVariant& v) {
  return std::string(v.out_proj_fused ? "out_proj fused" : "out_proj separate") +
         (v.fused_cluster > 0 ? " (clusters of " + std::to_string(v.fused_cluster) + ")" : "") +
         (v.embedding_gathered ? ", embedding gathered" : ", embedding kernel") +
         (v.gemv_rows_per_warp > 0 ? ", gemv rows a warp " + std::to_string(v.gemv_rows_per_warp) : "");
}

// At batch 1, two or four rows a warp for the CUDA-core gemvs (four halves in_proj's
// blocks, so the fused recurrence's fit beside them); at batch 2 the tensor-core gemvs or
// the CUDA-core ones with four rows a warp (the same reason); clusters of 4 or 8 blocks
// for the fused out_proj's sums. Out of the tuned buckets: out_proj fused where the
// planner allows it (the recurrence decides, see StepPlanner::plan_mixer), the embedding
// gathered.
std::vector<StepVariant> step_variant_candidates(int batch, const StepVariantPolicy& policy) {
  const bool tuned = batch <= kTunedMaxBatch;
  auto ways = [&](Tuned t) {
    if (t != Tuned::Measure) return std::vector<bool>{t == Tuned::On};
    return tuned ? std::vector<bool>{true, false} : std::vector<bool>{true};
  };
  std::vector<int> rows_per_warp = {0};
  if (batch == 1) {
    rows_per_warp = policy.batch1_gemv_rows_per_warp > 0 ? std::vector<int>{policy.batch1_gemv_rows_per_warp}
                                                         : std::vector<int>{2, 4};
  }
  // Batch 2: the tensor-core gemvs (0) or the CUDA-core kernel with four rows a warp.
  if (batch == 2) {
    rows_per_warp = policy.batch2_gemv == Batch2Gemv::TensorCores ? std::vector<int>{0}
                    : policy.batch2_gemv == Batch2Gemv::CudaCores ? std::vector<int>{4}
                                                                  : std::vector<int>{0, 4};
  }
  std::vector<StepVariant> out;
  for (bool fused : ways(policy.out_proj_fused)) {
    std::vector<int> clusters = {0};
    if (fused && tuned) {
      clusters = policy.fused_cluster > 0 ? std::vector<int>{policy.fused_cluster} : std::vector<int>{8, 4};
    }
    for (bool gathered : ways(policy.embedding_gathered))
      for (int rpw : rows_per_warp)
        for (int cl : clusters) out.push_back(StepVariant{fused, gathered, rpw, cl});
  }
  return out;
}

StepGraph choose_fastest_step(std::vector<StepGraph> candidates, StepLauncher& launcher, bool use_graphs) {
  if (candidates.size() == 1) return std::move(candidates.front());
  if (use_graphs) {
    for (StepGraph& g : candidates) launcher.capture(g);
  }
  std::vector<std::vector<float>> us(candidates.size());
  for (StepGraph& g : candidates) {
    for (int i = 0; i < kWarmupReplays; ++i) launcher.run(g, use_graphs);
  }
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < candidates.size(); ++i) {
      us[i].push_back(launcher.replay_group_us(candidates[i], use_graphs, kGroup));
    }
  }
  std::vector<std::pair<StepVariant, float>> measured;
  size_t best = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    measured.emplace_back(candidates[i].plan.variant, median(us[i]));
    if (measured[i].second < measured[best].second) best = i;
  }
  StepGraph chosen = std::move(candidates[best]);
  chosen.measured = std::move(measured);
  return chosen;
}

std::string tuner_report(const std::vector<StepGraph>& graphs) {
  std::string out;
  for (const StepGraph& g : graphs) {
    if (g.measured.empty()) continue;
    float us = 0.f;
    for (const auto& [variant, t] : g.measured) {
      if (variant == g.plan.variant) us = t;
    }
    char time[32];
    std::snprintf(time, sizeof time, "%.1f", us);
    if (!out.empty()) out += "; ";
    out += "batch " + std::to_string(g.plan.batch) + ": " + to_string(g.plan.variant) + " (" + time +
           " us a step, fastest of " + std::to_string(g.measured.size()) + " measured)";
  }
  return out;
}

}  // namespace m3::cuda
