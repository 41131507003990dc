// Where one head's recurrent state lives for one batch entry of a MIMO step (device side of
// MimoStateLayout): the angle and k_prev buffers are double-buffered by the slot's step
// parity, so the step reads the old copy and writes the other.
#pragma once

#include <cstdint>

#include "kernels/mimo_step.cuh"

namespace m3::kernels {

// Four consecutive ssm entries stored in bf16 (MimoStateLayout::ssm_bf16), 8 bytes, widened
// exactly to fp32.
__device__ __forceinline__ float4 widen_bf16x4(uint2 v) {
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                     __uint_as_float(v.y & 0xffff0000u));
}

struct MimoHeadState {
  float* ssm;                // [P][N], fp32 or (layout.ssm_bf16) bf16
  float* x_prev;             // [P]
  const float* angle_old;    // [S]
  float* angle_new;          // [S]
  const float* k_prev_old;   // [R][N]
  float* k_prev_new;         // [R][N]
};

__device__ __forceinline__ MimoHeadState mimo_head_state(const MimoStepArgs& a, const MimoStateLayout& layout,
                                                         int b, int h) {
  const int slot = a.slots[b];
  const int parity = a.parities[b] & 1;
  const int64_t H = a.heads, P = a.headdim, N = a.d_state, S = a.n_angles, RN = (int64_t)a.rank * a.d_state;
  float* st = a.state + slot * a.slot_stride + a.layer_offset;
  // A bf16 ssm part: the head's rows start h * P * N bf16 values (half as many floats) in.
  return MimoHeadState{st + layout.ssm + (layout.ssm_bf16 ? h * P * N / 2 : h * P * N),
                       st + layout.x_prev + h * P,
                       st + layout.angle + parity * H * S + h * S,
                       st + layout.angle + (1 - parity) * H * S + h * S,
                       st + layout.k_prev + parity * H * RN + h * RN,
                       st + layout.k_prev + (1 - parity) * H * RN + h * RN};
}

}  // namespace m3::kernels
