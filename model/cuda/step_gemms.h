// The decode step's projections as cuBLASLt GEMMs in the large buckets
// (cuda.projection_gemm_min_batch). The gemv kernels are built to stream weights for a few
// rows; at hundreds of rows a chain a library GEMM does the same work in a fraction of the
// time (at batch 1024 the step's in_proj took 2,080 us as gemvs, 303 as GEMMs plus 129 for
// their norms), which pays wherever the other chain's recurrence does not hide the
// projections. RMSNorm, which the gemvs fuse, runs as its own row kernel before in_proj,
// fc1 and lm_head.
//
// One plan a projection and a chain: each chain steps on its own stream, so each has its
// own context (its workspace), and each plan takes exactly the row counts that chain has in
// the buckets that use GEMMs: chains' rows lie next to each other, and a GEMM computing a
// padded bucket of rows would write into the next chain's.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/gemm_lt.cuh"
#include "kernels/weight_dtype.h"
#include "model/config.h"

namespace m3::cuda {

struct ChainGemms {
  std::unique_ptr<kernels::LtContext> context;
  std::unique_ptr<kernels::LtGemm> in_proj, out_proj, lm_head, fc1, fc2;  // fc1, fc2: MLP only
};

class StepGemms {
 public:
  // chain_rows[k]: every row count chain k takes in a bucket that uses GEMMs (empty
  // lists: none). in_proj's output rows are ModelConfig::padded_in_proj_rows wide.
  StepGemms(const ModelConfig& config, WeightDType type, const std::vector<std::vector<int>>& chain_rows);
  // Chain k's plans, or null where it takes no GEMM rows.
  const ChainGemms* chain(int k) const;
  // One call of every plan at every row count on `stream` (then synchronised), so that
  // each cuBLASLt kernel's module is loaded before a graph captures it or a step needs
  // it. `weights` are one layer's matrices; every buffer holds the largest count's rows.
  struct WarmUp {
    const void *in_proj, *out_proj, *lm_head, *fc1, *fc2;
    const void *u, *o, *act;
    float *in_proj_out, *residual, *logits, *fc1_out;
  };
  void load_kernels(const WarmUp& w, cudaStream_t stream) const;

 private:
  std::vector<ChainGemms> chains_;
};

// "" when the model's projections can run as these GEMMs, else why not (a row width that
// is not a multiple of 8 elements: cuBLASLt's 16-byte rows).
std::string step_gemm_refusal(const ModelConfig& config);

}  // namespace m3::cuda
