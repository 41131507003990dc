// The CUDA engine's decode buckets: powers of two up to 64, finer steps above, max_slots
// last; no batch pays more than 1/per_octave over its size from 64 on.
#include "model/decode_buckets.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

namespace m3 {
namespace {

TEST(DecodeBuckets, PowersOfTwoUpTo64ThenEighthsOfEachOctave) {
  EXPECT_EQ(decode_bucket_sizes(1, 8), (std::vector<int>{1}));
  EXPECT_EQ(decode_bucket_sizes(8, 8), (std::vector<int>{1, 2, 4, 8}));
  EXPECT_EQ(decode_bucket_sizes(40, 8), (std::vector<int>{1, 2, 4, 8, 16, 32, 40}));
  EXPECT_EQ(decode_bucket_sizes(100, 8), (std::vector<int>{1, 2, 4, 8, 16, 32, 64, 72, 80, 88, 96, 100}));
  EXPECT_EQ(decode_bucket_sizes(300, 4),
            (std::vector<int>{1, 2, 4, 8, 16, 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 300}));
  EXPECT_EQ(decode_bucket_sizes(1300, 16)[decode_bucket_sizes(1300, 16).size() - 5], 1088);
  EXPECT_EQ(decode_bucket_sizes(1300, 16).back(), 1300);
  EXPECT_EQ(decode_bucket_sizes(1300, 16)[decode_bucket_sizes(1300, 16).size() - 2], 1280);
  // One a power of two: the plan of powers of two only.
  EXPECT_EQ(decode_bucket_sizes(1024, 1), (std::vector<int>{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}));
}

TEST(DecodeBuckets, NoBatchFrom64PaysMoreThanAnEighthOverItsSize) {
  const std::vector<int> sizes = decode_bucket_sizes(4096, 8);
  EXPECT_EQ(sizes.size(), 6u + 6 * 8 + 1);  // 1-32, six octaves from 64, 4096
  EXPECT_EQ(sizes.back(), 4096);
  size_t g = 0;
  for (int n = 1; n <= 4096; ++n) {
    while (sizes[g] < n) ++g;
    if (n >= 64) EXPECT_LE(sizes[g], n + n / 8) << "batch " << n;
  }
}

TEST(DecodeBuckets, OtherCountsAreRefusedByName) {
  EXPECT_EQ(decode_buckets_refusal(3), "must be 1, 2, 4, 8 or 16, got 3");
  EXPECT_EQ(decode_buckets_refusal(32), "must be 1, 2, 4, 8 or 16, got 32");
  EXPECT_THROW(decode_bucket_sizes(64, 0), std::invalid_argument);
  EXPECT_THROW(decode_bucket_sizes(0, 8), std::invalid_argument);
}

}  // namespace
}  // namespace m3
