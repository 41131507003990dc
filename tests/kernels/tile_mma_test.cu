// warp_tile_mma (kernels/tile_mma.cuh) in both operand types against a float64 product:
// the accumulator layout every prefill chunk kernel relies on (rows g and g + 8, columns
// 2 (lane % 4) and + 1 of each 16 x 8 tile), the n-tile limit and a k length of several
// 16-wide steps, with the padded row strides the kernels use.
#include <cuda_bf16.h>

#include <cmath>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/tile_mma.cuh"
#include "model/tensor.h"

namespace m3 {
namespace {

constexpr int kNT = 6, kK = 48, kLd = kK + 8;

// One warp: C[16][kNT*8] = A[16][kK] . Bt[kNT*8][kK]^T over the first nt_limit tiles, the
// rest of C left as it was (NaN).
template <typename Op>
__global__ void tile_product_kernel(const float* a, const float* bt, float* c, int nt_limit) {
  __shared__ __align__(16) Op sa[16 * kLd];
  __shared__ __align__(16) Op sb[kNT * 8 * kLd];
  for (int i = threadIdx.x; i < 16 * kK; i += 32) sa[(i / kK) * kLd + i % kK] = kernels::to_operand<Op>(a[i]);
  for (int i = threadIdx.x; i < kNT * 8 * kK; i += 32) sb[(i / kK) * kLd + i % kK] = kernels::to_operand<Op>(bt[i]);
  __syncwarp();
  float acc[kNT][4] = {};
  kernels::warp_tile_mma<kNT>(acc, sa, kLd, sb, kLd, kK, nt_limit);
  const int lane = threadIdx.x, g = lane >> 2, q = lane & 3;
  for (int nt = 0; nt < nt_limit; ++nt) {
    const int col = nt * 8 + 2 * q;
    c[g * kNT * 8 + col] = acc[nt][0];
    c[g * kNT * 8 + col + 1] = acc[nt][1];
    c[(g + 8) * kNT * 8 + col] = acc[nt][2];
    c[(g + 8) * kNT * 8 + col + 1] = acc[nt][3];
  }
}

template <typename Op>
void check(int nt_limit, double tol) {
  const std::vector<float> a = testing::round_bf16(testing::random_floats(16 * kK, 1));
  const std::vector<float> bt = testing::round_bf16(testing::random_floats(kNT * 8 * kK, 2));
  testing::DeviceArray<float> da(a), db(bt), dc(16 * kNT * 8);
  dc.poison();
  tile_product_kernel<Op><<<1, 32>>>(da.get(), db.get(), dc.get(), nt_limit);
  M3_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> c = dc.download();
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < kNT * 8; ++j) {
      const float got = c[i * kNT * 8 + j];
      if (j >= nt_limit * 8) {
        EXPECT_TRUE(std::isnan(got)) << "tile past the limit written at " << i << "," << j;
        continue;
      }
      double e = 0;
      for (int k = 0; k < kK; ++k) e += static_cast<double>(a[i * kK + k]) * bt[j * kK + k];
      ASSERT_NEAR(got, e, tol) << "row " << i << " col " << j;
    }
}

TEST(TileMma, Bf16TensorCoresMatchTheProduct) {
  M3_REQUIRE_CUDA_DEVICE();
  check<__nv_bfloat16>(kNT, 1e-4);  // bf16-exact inputs: only fp32 accumulation rounding
  check<__nv_bfloat16>(3, 1e-4);
}

TEST(TileMma, Fp32FmaMatchTheProduct) {
  M3_REQUIRE_CUDA_DEVICE();
  check<float>(kNT, 1e-5);
  check<float>(2, 1e-5);
}

}  // namespace
}  // namespace m3
