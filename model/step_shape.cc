#include "model/step_shape.h"

#include <algorithm>

namespace m3 {

namespace {
// Where two chains on the GEMMs overtake one with bf16 state (docs/PERFORMANCE.md).
constexpr int kBf16StateSplitGemmsAbove = 1024;
constexpr int kPlannedGemmMinBatch = 128;
constexpr int kPlannedSplitMinBatch = 32;
}  // namespace

int projection_gemm_min_batch(const CudaPolicy& policy) {
  if (policy.projection_gemm_min_batch >= 0) return policy.projection_gemm_min_batch;
  return kPlannedGemmMinBatch;
}

bool step_uses_gemms(const CudaPolicy& policy, int batch) {
  const int from = projection_gemm_min_batch(policy);
  return from > 0 && batch >= from;
}

int step_chains(const CudaPolicy& policy, bool state_bf16, int batch) {
  int chains = policy.chains;
  if (chains <= 0) {
    if (batch < kPlannedSplitMinBatch) {
      chains = 1;
    } else if (step_uses_gemms(policy, batch)) {
      chains = state_bf16 && batch > kBf16StateSplitGemmsAbove ? 2 : 1;
    } else {
      chains = 2;
    }
  }
  return std::max(1, std::min(chains, batch));
}

std::vector<std::vector<int>> step_gemm_chain_rows(const CudaPolicy& policy, bool state_bf16,
                                                   const std::vector<int>& buckets) {
  std::vector<std::vector<int>> rows;
  for (const int batch : buckets) {
    if (!step_uses_gemms(policy, batch)) continue;
    const int chains = step_chains(policy, state_bf16, batch);
    if (static_cast<int>(rows.size()) < chains) rows.resize(chains);
    for (int k = 0; k < chains; ++k) {
      rows[k].push_back(chain_row0(batch, chains, k + 1) - chain_row0(batch, chains, k));
    }
  }
  return rows;
}

}  // namespace m3
