// The arithmetic the two tensor-core recurrences share (the per-head kernel of
// mimo_step_tc.cu and the streaming kernel of mimo_step_stream.cu): tf32 operands and the
// m16n8k8 product, the step's per-head scalars, where k and q go in the fragments, and the
// bf16 state's rounding on store.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace m3::kernels {

__device__ __forceinline__ uint32_t to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}

// d += A (16x8, tf32) . B (8x8, tf32), fp32 accumulate.
__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four new state entries rounded to bf16 (to nearest even) and stored as one 8-byte piece.
__device__ __forceinline__ void store_state_bf16(__nv_bfloat16* p, float a, float b, float c, float d) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
  __stcg(reinterpret_cast<uint2*>(p),
         make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi)));
}

// One head's step scalars from its in_proj outputs: dt by softplus, A clamped to at most
// -a_floor, the trapezoid weight, and the update's decay and input weights.
struct StepScalars {
  float dt, alpha, beta, gamma;
};
__device__ __forceinline__ StepScalars step_scalars(float dt_raw, float dA, float trap_raw, float dt_bias,
                                                    float a_floor) {
  const float dt = softplus(dt_raw + dt_bias);
  // Reciprocals by __frcp_rn (correctly rounded, no division subroutine): every thread
  // derives these scalars itself rather than waiting on a barrier for one to share them.
  const float A = fminf(-(fmaxf(dA, 0.f) + __frcp_rn(1.f - fminf(dA, 0.f))), -a_floor);
  const float trap = __frcp_rn(1.f + expf(-trap_raw));
  const float alpha = expf(A * dt);
  return StepScalars{dt, alpha, (1.f - trap) * dt * alpha, trap * dt};
}

// Where entry n of k at rank r goes in the update's B fragments ([N/16][32 lanes][4] floats:
// entry (m, lane) holds k[t][nA], k_prev[t][nA], k[t][nA + 2], k_prev[t][nA + 2] with
// nA = 16m + 4(g/2) + g%2), and where entry n of q goes in the y product's ([N/16][32][4]).
__device__ __forceinline__ int k_fragment_slot(int n, int r) {
  const int m = n >> 4, wn = n & 15;
  const int kl = ((2 * (wn >> 2) + (wn & 1)) << 2) + r;
  return (m * 32 + kl) * 4 + 2 * ((wn >> 1) & 1);
}
__device__ __forceinline__ int q_fragment_slot(int n, int r) {
  const int m = n >> 4, wn = n & 15;
  return (m * 32 + r * 4 + (wn >> 2)) * 4 + (wn & 3);
}
// The k_prev half of fragment entry e (its two columns, -1 where rank et >= R): e = m * 32 + lane.
__device__ __forceinline__ int k_prev_fragment_column(int e) {
  const int el = e & 31, eg = el >> 2;
  return 16 * (e >> 5) + 4 * (eg >> 1) + (eg & 1);
}

}  // namespace m3::kernels
