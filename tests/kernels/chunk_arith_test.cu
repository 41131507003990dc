// The chunk kernels' integer division by the fast float division (div_small in
// kernels/prefill_chunk_tc.cuh), against integer division over every pair its comment
// promises: 0 <= a < 2^21, 0 < b < 256.
#include <cstdint>

#include "gpu_test_util.h"
#include "kernels/prefill_chunk_tc.cuh"

namespace m3 {
namespace {

constexpr int kMaxA = 1 << 21, kMaxB = 256;

// Counts the pairs whose quotient differs, keeping the first one seen.
__global__ void div_small_mismatch_kernel(unsigned long long* mismatches, int* first_a, int* first_b) {
  const int64_t total = static_cast<int64_t>(kMaxA) * (kMaxB - 1);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int a = static_cast<int>(i % kMaxA), b = 1 + static_cast<int>(i / kMaxA);
    if (kernels::prefill_detail::tc::div_small(a, b) != a / b) {
      if (atomicAdd(mismatches, 1ull) == 0) {
        *first_a = a;
        *first_b = b;
      }
    }
  }
}

TEST(ChunkArith, DivSmallIsExactOverItsRange) {
  M3_REQUIRE_CUDA_DEVICE();
  testing::DeviceArray<unsigned long long> mismatches(std::vector<unsigned long long>{0});
  testing::DeviceArray<int> first_a(std::vector<int>{-1}), first_b(std::vector<int>{-1});
  div_small_mismatch_kernel<<<1024, 256>>>(mismatches.get(), first_a.get(), first_b.get());
  M3_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(mismatches.download()[0], 0u) << "first: " << first_a.download()[0] << " / " << first_b.download()[0];
}

}  // namespace
}  // namespace m3
