#include "model/decode_buckets.h"

#include <stdexcept>

namespace m3 {

std::string decode_buckets_refusal(int per_octave) {
  if (per_octave == 1 || per_octave == 2 || per_octave == 4 || per_octave == 8 || per_octave == 16) return "";
  return "must be 1, 2, 4, 8 or 16, got " + std::to_string(per_octave);
}

std::vector<int> decode_bucket_sizes(int max_slots, int per_octave) {
  if (max_slots < 1) throw std::invalid_argument("decode buckets: max_slots must be at least 1");
  if (const std::string why = decode_buckets_refusal(per_octave); !why.empty()) {
    throw std::invalid_argument("decode buckets: buckets_per_octave " + why);
  }
  std::vector<int> sizes;
  for (int b = 1; b < max_slots && b < kFineBucketsFrom; b *= 2) sizes.push_back(b);
  for (int octave = kFineBucketsFrom; octave < max_slots; octave *= 2) {
    const int step = octave / per_octave;
    for (int b = octave; b < 2 * octave && b < max_slots; b += step) sizes.push_back(b);
  }
  sizes.push_back(max_slots);
  return sizes;
}

}  // namespace m3
