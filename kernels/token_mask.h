// Sampling masks as lists of token id ranges, one layout for the host (the CPU engine,
// the tests' twin) and the device (the sampling kernel). A vocabulary's parts (text,
// each codebook of speech units) are contiguous id ranges, so a mask is a few [lo, hi)
// ranges rather than a bitset over the vocabulary.
//
// A mask has `period` frame positions (1 for a plain mask; the codebook count for units
// flattened into frames, position p allowing only codebook frame_order[p]). A slot
// samples at position 0 after every input token it is given, and after a sampled token
// from a range that restarts the frame (a control between frames); otherwise the next
// sample is at the next position, modulo the period.
#pragma once

#include <cstdint>

#include "kernels/philox.h"  // M3_HOST_DEVICE

namespace m3 {

struct TokenRange {
  int32_t lo = 0;  // [lo, hi)
  int32_t hi = 0;
  int32_t restarts_frame = 0;  // nonzero: a token from here puts the next at position 0
};

// Pointers into one table of masks (host or device memory). Mask m's positions are
// first_position[m] .. first_position[m] + period[m] - 1; position q's ranges are
// ranges[range_begin[q]] .. ranges[range_begin[q + 1] - 1].
struct TokenMaskView {
  const int32_t* first_position = nullptr;  // [n_masks]
  const int32_t* period = nullptr;          // [n_masks]
  const int32_t* range_begin = nullptr;     // [positions + 1]
  const TokenRange* ranges = nullptr;
  int n_masks = 0;
};

// The ranges of `mask` at frame position `position` (taken modulo the period).
M3_HOST_DEVICE void mask_ranges(const TokenMaskView& v, int mask, int position, int* begin, int* end) {
  const int q = v.first_position[mask] + position % v.period[mask];
  *begin = v.range_begin[q];
  *end = v.range_begin[q + 1];
}

// The position of the sample after `token`, sampled at `position` of `mask`.
M3_HOST_DEVICE int next_frame_position(const TokenMaskView& v, int mask, int position, int32_t token) {
  int begin, end;
  mask_ranges(v, mask, position, &begin, &end);
  for (int r = begin; r < end; ++r) {
    if (token >= v.ranges[r].lo && token < v.ranges[r].hi && v.ranges[r].restarts_frame) return 0;
  }
  return (position + 1) % v.period[mask];
}

}  // namespace m3
