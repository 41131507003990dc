#include "model/sampling_mask.h"

#include <algorithm>
#include <stdexcept>

#include "model/vocab_layout.h"

namespace m3 {
namespace {

std::string range_text(const TokenRange& r) {
  return "[" + std::to_string(r.lo) + ", " + std::to_string(r.hi) + ")";
}

// Controls as ranges of their own (consecutive ids merged), skipping those inside `skip`.
std::vector<TokenRange> control_ranges(const VocabLayout& layout, const TokenRange* skip) {
  std::vector<TokenRange> out;
  for (const ControlToken& c : layout.controls) {  // in id order
    if (skip != nullptr && c.id >= skip->lo && c.id < skip->hi) continue;
    if (!out.empty() && out.back().hi == c.id) {
      ++out.back().hi;
    } else {
      out.push_back({c.id, c.id + 1, 1});
    }
  }
  return out;
}

}  // namespace

SamplingMaskTable::SamplingMaskTable(std::span<const SamplingMask> masks, int32_t vocab_size) {
  range_begin_.push_back(0);
  for (const SamplingMask& m : masks) {
    const std::string where = "sampling mask \"" + m.name + "\"";
    if (m.positions.empty()) throw std::invalid_argument(where + " has no frame position");
    first_position_.push_back(static_cast<int32_t>(range_begin_.size()) - 1);
    period_.push_back(static_cast<int32_t>(m.positions.size()));
    for (size_t p = 0; p < m.positions.size(); ++p) {
      std::vector<TokenRange> sorted = m.positions[p];
      const std::string at = where + " position " + std::to_string(p);
      if (sorted.empty()) throw std::invalid_argument(at + " allows no token");
      std::sort(sorted.begin(), sorted.end(), [](const TokenRange& a, const TokenRange& b) { return a.lo < b.lo; });
      for (size_t i = 0; i < sorted.size(); ++i) {
        const TokenRange& r = sorted[i];
        if (r.lo < 0 || r.hi <= r.lo || r.hi > vocab_size) {
          throw std::invalid_argument(at + ": range " + range_text(r) + " is empty or leaves the vocabulary [0, " +
                                      std::to_string(vocab_size) + ")");
        }
        // Each id counts once in a draw: overlapping ranges would weigh it twice.
        if (i > 0 && r.lo < sorted[i - 1].hi) {
          throw std::invalid_argument(at + ": ranges " + range_text(sorted[i - 1]) + " and " + range_text(r) +
                                      " overlap");
        }
        ranges_.push_back(r);
      }
      range_begin_.push_back(static_cast<int32_t>(ranges_.size()));
    }
  }
}

TokenMaskView SamplingMaskTable::view() const {
  TokenMaskView v;
  v.first_position = first_position_.data();
  v.period = period_.data();
  v.range_begin = range_begin_.data();
  v.ranges = ranges_.data();
  v.n_masks = size();
  return v;
}

std::span<const TokenRange> SamplingMaskTable::ranges(int mask, int position) const {
  int begin, end;
  mask_ranges(view(), mask, position, &begin, &end);
  return {ranges_.data() + begin, static_cast<size_t>(end - begin)};
}

std::vector<SamplingMask> sampling_masks_for(const VocabLayout& layout) {
  std::vector<SamplingMask> masks;
  if (layout.text) {
    const TokenRange text{layout.text->first_id, layout.text->first_id + layout.text->size, 0};
    masks.push_back({"text", {{text}}});
    std::vector<TokenRange> with_controls{text};
    for (const TokenRange& c : control_ranges(layout, &text)) with_controls.push_back(c);
    if (!layout.controls.empty()) masks.push_back({"text_and_controls", {with_controls}});
  }
  if (layout.speech_units) {
    const SpeechUnitVocab& u = *layout.speech_units;
    SamplingMask units{"units", {}};
    for (int32_t codebook : u.frame_order) {
      const int32_t lo = u.id_of(codebook, 0);
      units.positions.push_back({{lo, lo + u.units_per_codebook, 0}});
    }
    SamplingMask with_controls = units;
    with_controls.name = "units_and_controls";
    for (const TokenRange& c : control_ranges(layout, nullptr)) with_controls.positions[0].push_back(c);
    masks.push_back(std::move(units));
    if (!layout.controls.empty()) masks.push_back(std::move(with_controls));
  }
  return masks;
}

}  // namespace m3
