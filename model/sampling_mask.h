// The sampling masks an engine is given at load (EngineOptions::sampling_masks), as one
// flat table both engines read (kernels/token_mask.h), and the masks a vocabulary layout
// calls for.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/token_mask.h"

namespace m3 {

struct VocabLayout;

struct SamplingMask {
  std::string name;                                // what it allows, for messages: "units"
  std::vector<std::vector<TokenRange>> positions;  // per frame position; one for a plain mask
};

class SamplingMaskTable {
 public:
  SamplingMaskTable() = default;
  // Throws std::invalid_argument naming the mask when one has no position, a position
  // allows no id, or a range is empty or leaves [0, vocab_size).
  SamplingMaskTable(std::span<const SamplingMask> masks, int32_t vocab_size);

  int size() const { return static_cast<int>(period_.size()); }
  TokenMaskView view() const;
  std::span<const TokenRange> ranges(int mask, int position) const;

  // The flat arrays, for a copy to the device.
  const std::vector<int32_t>& first_position() const { return first_position_; }
  const std::vector<int32_t>& period() const { return period_; }
  const std::vector<int32_t>& range_begin() const { return range_begin_; }
  const std::vector<TokenRange>& flat_ranges() const { return ranges_; }

 private:
  std::vector<int32_t> first_position_, period_, range_begin_;
  std::vector<TokenRange> ranges_;
};

// The masks a layout calls for, each present only when its parts are: "text" (the text
// range), "text_and_controls", "units" (per frame position the codebook frame_order
// puts there), "units_and_controls" (the same, and a control, which restarts the frame,
// at a frame's first position).
std::vector<SamplingMask> sampling_masks_for(const VocabLayout& layout);

}  // namespace m3
