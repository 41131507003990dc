// Choosing the step of the small buckets by measurement at load. At batch 1 and 2 a step
// is a chain of short dependent kernels, and which of its variants is faster depends on
// the GPU it runs on, not only on its model: on H200s lent for this project, out_proj
// fused into the recurrence took the batch-1 step of s2s-14l from 137 to 115 us on some
// and from 131 to 145 on others (PERFORMANCE_NOTES.md runs 115, 123-126), with the same
// binary. So where several are possible the engine captures each variant, replays them in
// turns, and keeps the fastest, as cuDNN's benchmark mode and TensorRT's tactic timing do.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "model/cuda/cuda_engine_impl.h"

namespace m3::cuda {
namespace {

// Buckets up to this size are tuned; larger ones take the planned variant (their steps
// are longer than a variant's difference, measured at batch 4-64: within 1 us).
constexpr int kTunedMaxBatch = 2;
constexpr int kWarmupReplays = 3;
constexpr int kRounds = 5;       // turns through the candidates
constexpr int kGroup = 10;       // replays a turn

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

// Every combination the switches leave open (-1: both ways; 0 / 1: that way only), and at
// batch 1 two or four rows a warp for the CUDA-core gemvs (four halves in_proj's blocks,
// so the fused recurrence's fit beside them: run 131, 145 -> 125 us on a machine where
// the fused step had lost), at batch 2 the tensor-core gemvs or the CUDA-core ones with
// four rows a warp (the same reason: run 173, 164 -> 160 us with out_proj fused), and
// clusters of 4 or 8 blocks for the fused out_proj's sums
// (run 133: 4 wins beside four rows a warp, 120.5 against 124.8 us; run 115: 8 wins beside
// two, 115.9 against 120.3). Out of the tuned buckets: out_proj fused where the planner
// allows it (the recurrence decides, see plan_step), the embedding gathered.
std::vector<StepVariant> CudaEngine::step_variant_candidates(int batch) const {
  const bool tuned = batch <= kTunedMaxBatch;
  auto ways = [&](int sw) {
    if (sw >= 0) return std::vector<bool>{sw == 1};
    return tuned ? std::vector<bool>{true, false} : std::vector<bool>{true};
  };
  std::vector<int> rows_per_warp = {0};
  if (batch == 1) rows_per_warp = gemv_rows_per_warp_ > 0 ? std::vector<int>{gemv_rows_per_warp_} : std::vector<int>{2, 4};
  // Batch 2: the tensor-core gemvs (0) or the CUDA-core kernel with four rows a warp.
  if (batch == 2) rows_per_warp = gemv_rows_per_warp_ > 0 ? std::vector<int>{gemv_rows_per_warp_ == 4 ? 4 : 0}
                                                          : std::vector<int>{0, 4};
  std::vector<StepVariant> out;
  for (bool fused : ways(out_proj_fusion_)) {
    std::vector<int> clusters = {0};
    if (fused && tuned) clusters = fused_cluster_ > 0 ? std::vector<int>{fused_cluster_} : std::vector<int>{8, 4};
    for (bool gathered : ways(embedding_gather_))
      for (int rpw : rows_per_warp)
        for (int cl : clusters) out.push_back(StepVariant{fused, gathered, rpw, cl});
  }
  return out;
}

// One candidate: taken as it is. Several: each is captured (when graphs are on) and
// replayed in turns on the bucket's rows (the scratch slot at load), the fastest by median
// kept, the others released with `candidates` (also when a capture or replay throws).
DecodeGraph CudaEngine::choose_step_variant(std::vector<DecodeGraph> candidates) {
  if (candidates.size() == 1) return std::move(candidates.front());
  if (use_graphs_) {
    for (DecodeGraph& g : candidates) capture(g);
  }
  std::vector<std::vector<float>> us(candidates.size());
  for (DecodeGraph& g : candidates) {
    for (int i = 0; i < kWarmupReplays; ++i) run_plan(g, use_graphs_);
  }
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < candidates.size(); ++i) us[i].push_back(replay_group_us(candidates[i], use_graphs_, kGroup));
  }
  std::vector<std::pair<StepVariant, float>> measured;
  size_t best = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    measured.emplace_back(candidates[i].variant, median(us[i]));
    if (measured[i].second < measured[best].second) best = i;
  }
  DecodeGraph chosen = std::move(candidates[best]);
  chosen.measured = std::move(measured);
  return chosen;
}

// "batch 1: <variant> (<us> us, fastest of <n> measured); batch 2: ..." for the buckets
// that measured their variants.
std::string CudaEngine::load_report() const {
  std::string out;
  for (const DecodeGraph& g : graphs_) {
    if (g.measured.empty()) continue;
    float us = 0.f;
    for (const auto& [variant, t] : g.measured) {
      if (variant == g.variant) us = t;
    }
    char time[32];
    std::snprintf(time, sizeof time, "%.1f", us);
    if (!out.empty()) out += "; ";
    out += "batch " + std::to_string(g.batch) + ": " + to_string(g.variant) + " (" + time + " us a step, fastest of " +
           std::to_string(g.measured.size()) + " measured)";
  }
  return out;
}

}  // namespace m3::cuda
