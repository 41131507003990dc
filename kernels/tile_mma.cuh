// One warp's share of a small matrix product out of shared memory, in the accumulator
// layout of mma.sync m16n8k16, for bf16 operands (tensor cores) or fp32 operands (fp32 FMAs
// that give each lane exactly the accumulator elements the mma would): kernels written
// once against this layout run in either precision.
//
// acc[nt] += A[16 rows, k_len] . Bt[8 rows of tile nt, k_len]^T for nt < nt_limit, with A and
// Bt row-major in shared memory (Bt holds the right operand transposed: one row per output
// column). Lane l holds rows g = l / 4 and g + 8, columns 2 (l % 4) and 2 (l % 4) + 1 of
// each 16 x 8 tile: acc[nt][0..1] row g, acc[nt][2..3] row g + 8. k_len is a multiple of 16.
// Row strides (in elements) that are 4 words more than a multiple of 32 words keep the
// fragment loads free of bank conflicts.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/mma_bf16.cuh"

namespace m3::kernels {

__device__ __forceinline__ uint32_t load_bf16_pair(const __nv_bfloat16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <int NT>
__device__ __forceinline__ void warp_tile_mma(float (&acc)[NT][4], const __nv_bfloat16* A, int lda,
                                              const __nv_bfloat16* Bt, int ldb, int k_len, int nt_limit) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const __nv_bfloat16* a_lo = A + g * lda + 2 * c;
  const __nv_bfloat16* a_hi = a_lo + 8 * lda;
  const __nv_bfloat16* b = Bt + g * ldb + 2 * c;
  for (int k0 = 0; k0 < k_len; k0 += 16) {
    const uint32_t a0 = load_bf16_pair(a_lo + k0), a1 = load_bf16_pair(a_hi + k0);
    const uint32_t a2 = load_bf16_pair(a_lo + k0 + 8), a3 = load_bf16_pair(a_hi + k0 + 8);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt < nt_limit) {
        const __nv_bfloat16* bn = b + nt * 8 * ldb + k0;
        mma_bf16(acc[nt], a0, a1, a2, a3, load_bf16_pair(bn), load_bf16_pair(bn + 8));
      }
    }
  }
}

template <int NT>
__device__ __forceinline__ void warp_tile_mma(float (&acc)[NT][4], const float* A, int lda, const float* Bt,
                                              int ldb, int k_len, int nt_limit) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const float* a_lo = A + g * lda;
  const float* a_hi = a_lo + 8 * lda;
  for (int k0 = 0; k0 < k_len; k0 += 4) {
    const float4 al = *reinterpret_cast<const float4*>(a_lo + k0);
    const float4 ah = *reinterpret_cast<const float4*>(a_hi + k0);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt < nt_limit) {
        const float4 b0 = *reinterpret_cast<const float4*>(Bt + (nt * 8 + 2 * c) * ldb + k0);
        const float4 b1 = *reinterpret_cast<const float4*>(Bt + (nt * 8 + 2 * c + 1) * ldb + k0);
        float* d = acc[nt];
        d[0] = fmaf(al.x, b0.x, d[0]); d[0] = fmaf(al.y, b0.y, d[0]); d[0] = fmaf(al.z, b0.z, d[0]); d[0] = fmaf(al.w, b0.w, d[0]);
        d[1] = fmaf(al.x, b1.x, d[1]); d[1] = fmaf(al.y, b1.y, d[1]); d[1] = fmaf(al.z, b1.z, d[1]); d[1] = fmaf(al.w, b1.w, d[1]);
        d[2] = fmaf(ah.x, b0.x, d[2]); d[2] = fmaf(ah.y, b0.y, d[2]); d[2] = fmaf(ah.z, b0.z, d[2]); d[2] = fmaf(ah.w, b0.w, d[2]);
        d[3] = fmaf(ah.x, b1.x, d[3]); d[3] = fmaf(ah.y, b1.y, d[3]); d[3] = fmaf(ah.z, b1.z, d[3]); d[3] = fmaf(ah.w, b1.w, d[3]);
      }
    }
  }
}

// A value in the operand type of warp_tile_mma.
template <typename Op>
__device__ __forceinline__ Op to_operand(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 to_operand<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ float to_operand<float>(float v) { return v; }

}  // namespace m3::kernels
