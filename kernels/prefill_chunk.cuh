// What the chunk kernels of the prefill scan share (kernels/prefill_scan.cu and
// kernels/prefill_chunk_*_tc.cu): their parameters, where a chunk's tokens are, the
// per-token decay terms of a chunk, and the rotated entries of k and q. Internal to the
// prefill scan; the interface is kernels/prefill_scan.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "kernels/common.cuh"
#include "kernels/launch.cuh"  // launch_config
#include "kernels/mimo_step.cuh"  // MimoStateLayout
#include "kernels/prefill_chunk_choice.h"
#include "kernels/prefill_scan.cuh"

namespace m3::kernels::prefill_detail {

inline constexpr float kPi = 3.14159265358979323846f;
inline constexpr int kMaxP = 64, kMaxN = 128;

struct ScanParams {
  PrefillScanArgs a;
  MimoStateLayout layout;
  // Every run of the call is one chunk and the chunk state kernel does the state pass's
  // work for them (PrefillScanPlan::single_chunk_runs_in_state_kernel, where that kernel
  // runs on register fragments): no state pass follows.
  bool whole_runs_in_state_kernel = false;
};

// A scan kernel launched on `stream`, by programmatic dependent launch when `pdl` (the
// kernel then calls wait_for_previous_kernel before reading the previous kernel's outputs).
template <typename... Params, typename... Args>
void launch_scan_kernel(void (*kernel)(Params...), dim3 grid, int threads, size_t smem, cudaStream_t stream, bool pdl,
                        Args&&... args) {
  cudaLaunchAttribute attr{};
  const cudaLaunchConfig_t config = launch_config(grid, dim3(threads), smem, stream, pdl, attr);
  M3_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// The run that chunk c belongs to (runs.chunk_begin is ascending), by binary search.
__device__ __forceinline__ int run_of_chunk(const PrefillRuns& runs, int c) {
  int lo = 0, hi = runs.n_runs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (runs.chunk_begin[mid] <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Where chunk c's tokens are: rows [first, first + len) of run `run`, which ends at run_end.
struct ChunkPlace {
  int run, first, len, run_end;
  bool whole_run;  // the run's only chunk
};
// Every lane of the warp calls this (the chunk kernels do, at their start). Up to 31 runs,
// lane i reads chunk_begin[i] and token_begin[i] at once, a ballot counts the runs that
// begin at or before c and shuffles hand out the run's bounds: one round trip to memory,
// where the search and the bounds after it wait on log2(runs) + 1 in turn.
__device__ __forceinline__ ChunkPlace chunk_place(const PrefillScanArgs& a, int c, int chunk_tokens) {
  const PrefillRuns& runs = a.runs;
  int run_chunk, run_token, run_end;
  ChunkPlace p;
  if (runs.n_runs < 32) {
    const int lane = threadIdx.x & 31;
    const bool entry = lane <= runs.n_runs;  // both tables hold n_runs + 1 entries
    const int cb = entry ? runs.chunk_begin[lane] : 0;
    const int tb = entry ? runs.token_begin[lane] : 0;
    p.run = __popc(__ballot_sync(0xffffffffu, lane < runs.n_runs && cb <= c)) - 1;
    run_chunk = __shfl_sync(0xffffffffu, cb, p.run);
    run_token = __shfl_sync(0xffffffffu, tb, p.run);
    run_end = __shfl_sync(0xffffffffu, tb, p.run + 1);
  } else {
    p.run = run_of_chunk(runs, c);
    run_chunk = runs.chunk_begin[p.run];
    run_token = runs.token_begin[p.run];
    run_end = runs.token_begin[p.run + 1];
  }
  p.first = run_token + (c - run_chunk) * chunk_tokens;
  p.run_end = run_end;
  p.len = min(chunk_tokens, p.run_end - p.first);
  p.whole_run = c == run_chunk && p.first + p.len == p.run_end;
  return p;
}

// Warp 0: L[i] (running sum of a inside the chunk), gamma[i] and u[i] (gamma plus the next
// token's (1-trap)*dt, none past the run's end) for the chunk's tokens.
__device__ __forceinline__ void chunk_token_terms(const PrefillScanArgs& a, const ChunkPlace& cp, int h,
                                                  float* L, float* gam, float* u) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x, H = a.dims.heads;
  float carry = 0.f;
  for (int base = 0; base < cp.len; base += 32) {
    const int i = base + lane;
    const int t = cp.first + i;
    float v = i < cp.len ? a.ws.tok_a[(int64_t)t * H + h] : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float n = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += n;
    }
    if (i < cp.len) {
      L[i] = carry + v;
      const float g = a.ws.tok_gamma[(int64_t)t * H + h];
      gam[i] = g;
      u[i] = g + (t + 1 < cp.run_end ? a.ws.tok_bterm[(int64_t)(t + 1) * H + h] : 0.f);
    }
    carry += __shfl_sync(0xffffffffu, v, 31);
  }
}

// Two adjacent entries in the type of their destination (a chunk's delta: the bf16 kernels'
// deltas are rounded as their S~ is, which halves what the state pass reads; the output o).
__device__ __forceinline__ void store_pair(float* p, float v0, float v1) {
  *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* p, float v0, float v1) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
}

// Entries i0, i1 of row (t, r) of k (B, B_bias) or q (C, C_bias) after bias and rotation:
// pair i of N/2 (halves (i, i+N/2) for MIMO, adjacent (2i, 2i+1) otherwise), rotated by
// theta_t[i] (rot_t[i] = its cos and sin) when i < S.
__device__ __forceinline__ void rotated_pair(const PrefillScanArgs& a, const float* normed, const float* bias,
                                             const float2* rot_t, int i, float& v0, float& v1, int& i0, int& i1) {
  const int N = a.dims.d_state, half = N / 2;
  i0 = a.mimo_rotation ? i : 2 * i;
  i1 = a.mimo_rotation ? i + half : 2 * i + 1;
  const float x0 = normed[i0] + bias[i0], x1 = normed[i1] + bias[i1];
  if (i < a.dims.n_angles) {
    const float2 r = rot_t[i];
    const float cs = r.x, sn = r.y;
    v0 = x0 * cs - x1 * sn;
    v1 = x0 * sn + x1 * cs;
  } else {
    v0 = x0;
    v1 = x1;
  }
}

// The run's last token becomes the slot's k_prev (rotated B, parity (p + T) & 1) and x_prev,
// written by the block of the run's last chunk for head h.
__device__ __forceinline__ void write_last_token_prev(const ScanParams& prm, const ChunkPlace& cp, int h,
                                                      int threads) {
  const PrefillScanArgs& a = prm.a;
  const int H = a.dims.heads, P = a.dims.headdim, N = a.dims.d_state, R = a.dims.rank;
  const int t0 = a.runs.token_begin[cp.run];
  const int slot = a.runs.slot[cp.run];
  const int parity_new = (a.runs.parity[cp.run] + (cp.run_end - t0)) & 1;
  float* st = a.state + slot * a.slot_stride + a.layer_offset;
  float* kp = st + prm.layout.k_prev + (int64_t)parity_new * H * R * N + (int64_t)h * R * N;
  const int t = cp.run_end - 1, half = N / 2;
  for (int idx = threadIdx.x; idx < R * half; idx += threads) {
    const int r = idx / half, i = idx % half;
    float v0, v1;
    int i0, i1;
    rotated_pair(a, a.ws.b_norm + ((int64_t)t * R + r) * N, a.B_bias + ((int64_t)h * R + r) * N,
                 a.ws.rot + ((int64_t)t * H + h) * a.dims.n_angles, i, v0, v1, i0, i1);
    kp[r * N + i0] = v0;
    kp[r * N + i1] = v1;
  }
  for (int p = threadIdx.x; p < P; p += threads) {
    st[prm.layout.x_prev + h * P + p] = a.w[(int64_t)t * a.w_stride + a.off_x + h * P + p];
  }
}

void prepare_chunk_tc();  // load time: shared-memory checks and limits
// Load time, for each chunk kernel: throws naming the kernel when its static and dynamic
// shared memory pass kMaxSharedBytesPerBlock; raises its dynamic limit to at least `bytes`.
void set_chunk_kernel_smem_limit(const void* kernel, size_t bytes, const char* name);
void launch_chunk_state_tc(const ScanParams& prm, cudaStream_t stream);
void launch_chunk_output_tc(const ScanParams& prm, cudaStream_t stream);

}  // namespace m3::kernels::prefill_detail
