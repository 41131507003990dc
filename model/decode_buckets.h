// The batch sizes a CUDA engine captures a decode step for (its buckets): a batch of n
// sequences runs at the smallest bucket that holds it, its spare rows stepping a scratch
// slot, so a bucket's step costs its full size. Powers of two up to 64, where the step is
// mostly the weights' bytes and nearly flat in the batch; above, where it is mostly the
// states' and grows with the batch, `per_octave` buckets between each power of two and
// the next (16: 64, 68, ..., 124, 128, 136, ...), so that a batch pays at most 1/per_octave
// more than its size; then max_slots itself.
#pragma once

#include <string>
#include <vector>

namespace m3 {

inline constexpr int kFineBucketsFrom = 64;

// Why `per_octave` is not a bucket count this rule takes (empty: it is): 1, 2, 4, 8 or 16.
std::string decode_buckets_refusal(int per_octave);
// Ascending, distinct, the last max_slots (>= 1).
std::vector<int> decode_bucket_sizes(int max_slots, int per_octave);

}  // namespace m3
