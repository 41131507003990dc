// Token sampling on the host: the reference definition (brief, "Sampling") that the
// CPU engine uses and the CUDA sampling kernel is tested against.
//
// l = logits[0:vocab_size). temperature below FLT_MIN (<= 0, or so small that its
// reciprocal overflows): argmax, lowest id on ties. Otherwise ids
// are ordered by l descending (ties: lower id first); top_k > 0 keeps the first top_k;
// e_i = exp((l_i - l_max) / temperature) over the kept ids; top_p < 1 keeps the shortest
// prefix whose cumulative e reaches top_p * sum(e) (at least one id); with
// u = philox_uniform(seed, counter) the result is the first kept id whose cumulative e
// exceeds u * (sum of kept e). Sums run in float, in the sorted order.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kernels/token_mask.h"
#include "model/engine.h"

namespace m3 {

// Working memory for one sample_token() call at a time, sized once for a vocabulary,
// so that sampling allocates nothing.
class SamplingScratch {
 public:
  SamplingScratch() = default;
  explicit SamplingScratch(int vocab_size);
  int capacity() const { return static_cast<int>(order_.size()); }

 private:
  friend int32_t sample_token(std::span<const float>, int, const SamplingParams&, uint64_t,
                              SamplingScratch&, std::span<const TokenRange>);
  std::vector<int32_t> order_;
  std::vector<float> mass_;
};

// Argmax over logits[0:vocab_size), lowest id on ties; NaN never wins unless all are NaN
// (then 0).
int32_t greedy_token(std::span<const float> logits, int vocab_size);
// The same over the ids of `allowed` (disjoint ranges inside [0, vocab_size)); the
// lowest allowed id when all of them are NaN.
int32_t greedy_token(std::span<const float> logits, std::span<const TokenRange> allowed);

// The sampled id, always in [0, vocab_size). `logits` may be longer (padded vocabulary);
// only its first vocab_size entries are read. Throws std::invalid_argument when
// logits.size() < vocab_size or scratch.capacity() < vocab_size. NaN logits rank last.
// A non-empty `allowed` (disjoint ranges inside [0, vocab_size): a sampling mask's ranges
// at the slot's frame position) restricts the definition above to its ids, as if the
// vocabulary held no others; params.mask is not read here.
int32_t sample_token(std::span<const float> logits, int vocab_size, const SamplingParams& params,
                     uint64_t counter, SamplingScratch& scratch, std::span<const TokenRange> allowed = {});

// Why no backend accepts these parameters (a NaN or infinite temperature, top_k < 0,
// top_p outside [0, 1] or NaN, a mask other than -1 or one of the engine's
// `mask_count`), or empty. Allocates nothing for valid parameters (an engine's
// set_sampling runs once a request).
std::string sampling_params_error(const SamplingParams& params, int mask_count = 0);

}  // namespace m3
