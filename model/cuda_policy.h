// Every choice the CUDA engine makes in building its decode step, in one typed struct:
// defaults in code (the plan the engine runs unless configured otherwise), overridden by
// the `cuda:` section of configs/server.yaml or by flags (`--cuda-pdl false`,
// `--cuda-gemv-row-block-cluster 4`: the key path joined with '-'), the same flags for
// m3serve, m3bench decode and m3check. EngineOptions carries it to the engine; the engine
// hands the kernels' parts to their planners. Plain C++: read without CUDA.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/plan_policy.h"

namespace m3 {

// A choice the engine measures at load where it has more than one way (the small buckets'
// step variants), or fixes one way.
enum class Tuned { Measure, Off, On };
// Batch 2's gemvs: tensor cores, or CUDA cores with four rows a warp (whose fewer, larger
// blocks leave room beside them for the fused recurrence's).
enum class Batch2Gemv { Measure, TensorCores, CudaCores };
// How prefill() reads a run: one decode step a token (the base engine's way), the chunked
// kernels (GEMMs over the run's tokens and the chunked scan, model/cuda/prefill_runner.h),
// or auto: chunked where they take the model's shape, steps otherwise.
enum class PrefillPath { Steps, Chunked, Auto };

// The batch-1 and batch-2 buckets' step variants: measured at load (Measure / 0) unless a
// field fixes one way. Which is faster depends on the GPU, not only on the model.
struct StepVariantPolicy {
  Tuned out_proj_fused = Tuned::Measure;      // out_proj inside the recurrence, added by atomics
  Tuned embedding_gathered = Tuned::Measure;  // the first in_proj reads the embedding rows itself
  int batch1_gemv_rows_per_warp = 0;          // CUDA-core gemvs at batch 1: 0 measured (2 and 4), 2 or 4
  Batch2Gemv batch2_gemv = Batch2Gemv::Measure;
  int fused_cluster = 0;                      // out_proj fused: blocks a cluster sums, 0 measured (8, 4), 4 or 8
};

struct CudaPolicy {
  // Programmatic dependent launch: each kernel's blocks start while the previous kernel
  // drains, in the decode step (where each kernel lets the next one start is gemv.trigger
  // and recurrence.trigger) and between the chunked prefill's scan kernels.
  bool pdl = true;
  // Chains a bucket splits into, side by side (each the whole step for its share of the
  // rows): 0 planned (model/step_shape.h), or 1 to 4 at every bucket.
  int chains = 0;
  // The sampling kernel's extra blocks pull the next step's first weights into L2.
  bool next_step_prefetch = true;
  // bf16 weights: the recurrence on tensor cores from this batch (0: never), with out_proj
  // fused into it up to recurrence_fuse_max_batch where the step variant asks for it.
  int recurrence_tensor_core_min_batch = 1;
  int recurrence_fuse_max_batch = 2;
  // The step's projections (in_proj, out_proj, the MLP, lm_head) as cuBLASLt GEMMs, each
  // with RMSNorm as its own row kernel, in the buckets from this batch (0: never, the gemvs
  // everywhere; -1 planned, model/step_shape.h).
  int projection_gemm_min_batch = -1;
  // Decode graphs between one power of two and the next from batch 64 (model/decode_buckets.h):
  // a batch runs at the smallest that holds it; 1: powers of two only.
  int buckets_per_octave = 16;
  PrefillPath prefill = PrefillPath::Auto;
  // Chunked prefill: a call of one run of at most this many tokens replays a CUDA graph
  // captured at load for its length (0: never), which takes the launch gaps of the ~8
  // kernels a layer that short runs are made of.
  int prefill_graph_max_tokens = 512;
  static constexpr int kMaxPrefillGraphTokens = 2048;  // a graph a length: load time and memory grow with it
  StepVariantPolicy step_variants;
  kernels::GemvPolicy gemv;
  kernels::MimoStepPolicy recurrence;

  // Throws std::invalid_argument naming the field ("cuda.chains must be 0 (planned) or 1
  // to 4, got 7").
  void validate() const;
  bool operator==(const CudaPolicy&) const;
};

// One setting of the policy: its key path under `cuda:` ("gemv.row_block_cluster"), what it
// does, and its value as text.
struct CudaPolicySetting {
  std::string path;
  std::string help;
  std::function<std::string(const CudaPolicy&)> get;
  // "" or why `text` is no value of this setting.
  std::function<std::string(CudaPolicy&, std::string_view text)> set;
};
const std::vector<CudaPolicySetting>& cuda_policy_settings();

// The flag of a key path: "gemv.row_block_cluster" -> "--cuda-gemv-row-block-cluster".
std::string cuda_policy_flag(std::string_view path);

// Sets the setting at `path` (a key path under `cuda:`) from `text`; "" or the reason it
// cannot ("unknown key 'cuda.gemv.rows'", "expected true or false, got 'yes please'").
std::string set_cuda_policy_value(CudaPolicy& policy, std::string_view path, std::string_view text);

// For command lines: when `flag` is a policy flag (--cuda-...), sets it from `value` and
// returns true (throws std::invalid_argument naming the flag on a bad value); false for
// any other flag.
bool set_cuda_policy_flag(CudaPolicy& policy, std::string_view flag, std::string_view value);

// Every policy flag with its help, one a line (for --help texts).
std::string cuda_policy_flags_help();

// "pdl=true chains=0 ... recurrence.whole_head_min_batch=4": every setting, for logs.
std::string to_string(const CudaPolicy& policy);

}  // namespace m3
