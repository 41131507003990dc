// How a decode bucket's step is shaped before any kernel is chosen: how many chains of
// kernels it splits into, side by side, and whether its projections run as GEMMs. Plain
// C++ (the CUDA engine's planner and host-only tests read the same rules).
#pragma once

#include <vector>

#include "model/cuda_policy.h"

namespace m3 {

// The batch from which the step's projections (in_proj, out_proj, the MLP, lm_head) run as
// cuBLASLt GEMMs (cuda.projection_gemm_min_batch; 0: never). Planned: from 128, with
// either state dtype. Below it the gemvs, whose weight streams are shared by few rows and
// which keep programmatic dependent launch, are the faster (docs/PERFORMANCE.md).
int projection_gemm_min_batch(const CudaPolicy& policy);
bool step_uses_gemms(const CudaPolicy& policy, int batch);

// Chains a bucket of `batch` rows splits into (cuda.chains, or planned): each serves its
// share of the rows with its own kernels and the chains run side by side, so that one
// chain's memory-bound recurrence hides another's latency-bound gemvs. Planned: one below
// batch 32, where chains only compete; two above on the gemvs; one on the GEMMs, which are
// not latency-bound and beside the other chain's recurrence slow it more than they gain
// (fp32 state at batch 1024: 9.87 ms a step in two chains, 8.25 in one), except with bf16
// state above batch 1024, whose shorter recurrence hides the GEMMs better (2 to 3% faster
// in two chains from batch 2048).
int step_chains(const CudaPolicy& policy, bool state_bf16, int batch);

// Rows of chain k of `chains` in a bucket of `batch` rows.
inline int chain_row0(int batch, int chains, int k) { return k * batch / chains; }

// For the step's GEMM plans: chain k's row count in every bucket of `buckets` that uses
// GEMMs, in the buckets' order.
std::vector<std::vector<int>> step_gemm_chain_rows(const CudaPolicy& policy, bool state_bf16,
                                                   const std::vector<int>& buckets);

}  // namespace m3
