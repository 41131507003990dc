// Prefill against step-by-step reading on any backend: the same prompts fed both ways to
// two engines of the same weights, then the same continuation decoded on both.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/engine.h"

namespace m3::testing {

struct PrefillComparison {
  std::vector<int> lengths;  // one prompt per slot (slot i gets lengths[i] tokens)
  int pieces = 1;            // prefill() calls each prompt is split over
  SamplingParams sampling;   // every slot's (seed + slot for each)
  int continue_steps = 8;    // decode steps after the prompt, on both engines
  float tolerance = 0.0f;    // on every logit; 0: bitwise equal
  // tolerance relative to the row's largest step-by-step logit (m3check's max_rel_err),
  // instead of to 1 + |logit| for each logit.
  bool row_relative = false;
  bool compare_samples = true;  // sampled ids equal (off where logits may differ a little)
  uint64_t seed = 11;        // of the prompts
};

// Random token ids in [0, vocab): the prompt of one slot.
std::vector<int32_t> random_tokens(int count, int vocab, uint64_t seed);

// Feeds `prompts` (one per slot, slots 0..n-1) to `stepped` one step() per position and to
// `prefilled` through prefill() in c.pieces calls, then decodes c.continue_steps more on
// both; checks (gtest assertions) the last prompt token's logits and samples, and every
// continuation step's. Both engines are fresh (reset) and have the same weights and slots.
void compare_prefill_with_steps(Engine& stepped, Engine& prefilled, const PrefillComparison& c);

}  // namespace m3::testing
