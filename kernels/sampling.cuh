// Token sampling on the device, one block per batch entry, exactly the engine contract's
// definition (model/engine.h, brief): greedy argmax (lowest id on ties) when
// temperature <= 0; otherwise top-k, softmax with temperature, top-p, and one Philox draw
// keyed by (seed, the slot's step counter). No sort: ids are ordered by a 64-bit key
// (logit, then lower id first), and the top-k cut, the top-p cut and the draw are each a
// bitwise search for a key threshold over block-wide counts and sums.
//
// Afterwards the sampled id goes to sampled[b] and last_token[slot] (next step's input
// when the host passes kContinueToken) and the slot's counter advances by one.
//
// A slot whose params name a mask (0 <= mask < masks.n_masks, frame_positions given)
// samples only among the ids of that mask's ranges at the slot's frame position, as if
// the vocabulary held no others (token_mask.h): position 0 when tokens[b] is an input
// token, frame_positions[slot] when it is kContinueToken; the position of the slot's
// next sample is written back. The masks stay on the device from load: choosing one is
// a parameter of the slot, read by the captured graph, with no host work per token.
//
// Only the logits may come from the kernel launched before it in the stream: slots,
// tokens, params, counters and frame positions are read before the
// programmatic-dependent-launch wait, so they must be complete when the step's first
// kernel starts (the engine writes them between steps).
#pragma once

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/launch.cuh"
#include "kernels/token_mask.h"

namespace m3::kernels {

struct SlotSampling {
  float temperature = 0.f;
  int32_t top_k = 0;
  float top_p = 1.f;
  int32_t mask = -1;  // -1: every id
  uint64_t seed = 0;
};
static_assert(sizeof(SlotSampling) == 24, "SlotSampling is copied to the device as is");

struct SamplingArgs {
  const float* logits = nullptr;  // [batch, logits_stride]
  int logits_stride = 0;
  int vocab = 0;                  // ids >= vocab are never picked
  const int32_t* slots = nullptr;           // [batch]
  const SlotSampling* params = nullptr;     // [n_slots]
  uint64_t* counters = nullptr;             // [n_slots]
  int32_t* last_token = nullptr;            // [n_slots]
  int32_t* sampled = nullptr;               // [batch]
  int batch = 0;
  // Constrained sampling (optional): the masks (device memory), the step's input tokens
  // [batch] and the slots' frame positions [n_slots].
  TokenMaskView masks;
  const int32_t* tokens = nullptr;
  int32_t* frame_positions = nullptr;
  // Pulled into L2 by `prefetch_blocks` extra blocks once the logits are in: the next
  // step's first weights, which nothing else could load early (a step's first kernel has
  // no predecessor to overlap).
  L2Prefetch prefetch;
  int prefetch_blocks = 0;
};

KernelLaunch plan_sampling(const SamplingArgs& args);

}  // namespace m3::kernels
