#include "kernels/prefill_scan.cuh"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/mimo_state.cuh"  // widen_bf16x4
#include "kernels/mimo_step.cuh"   // MimoStateLayout
#include "kernels/prefill_chunk.cuh"
#include "kernels/tile_mma.cuh"

namespace m3::kernels {
namespace {

using namespace prefill_detail;

// Shared-memory plan of the chunk kernels for operand type Op, sized for the largest head
// the kernels take (P 64, N 128), so the sizes are compile-time constants checked below.
template <typename Op>
struct ChunkSmem {
  static constexpr bool kBf16 = sizeof(Op) == 2;
  static constexpr int kRows = kBf16 ? kPrefillRowsBf16 : kPrefillRowsFp32;  // (token, rank) rows
  static constexpr int kPad = kBf16 ? 8 : 4;  // rows 4 words past a multiple of 32 words
  static constexpr int kLdRows = kRows + kPad;                              // rows indexed by (t, r)
  static constexpr int kLdN = kMaxN + kPad;                                 // rows indexed by n
  static constexpr int kLdQ = (kMaxN > kRows ? kMaxN : kRows) + kPad;       // Q, then the masked G
  static constexpr int kLdY = kMaxP + 4;                                    // y, fp32
  static constexpr int kThreadsOut = kRows * 2;                             // a warp per 16 rows
  // Chunk state: XvW^T [P][rows] and K^T [N][rows], then the per-token floats.
  static constexpr size_t kStateBytes = sizeof(Op) * (size_t)(kMaxP + kMaxN) * kLdRows + 4 * sizeof(float) * kRows;
  // Chunk output: Q (then G) [rows][kLdQ]; S~ [P][kLdN], then K [rows][kLdN], then y
  // (fp32 [rows][kLdY]) in one area; Xv^T [P][rows]; the per-token floats.
  static constexpr size_t kQBytes = sizeof(Op) * (size_t)kRows * kLdQ;
  static constexpr size_t kSKRows = kMaxP > kRows ? kMaxP : kRows;
  static constexpr size_t kSKBytes0 = sizeof(Op) * kSKRows * kLdN;
  static constexpr size_t kYBytes = sizeof(float) * (size_t)kRows * kLdY;
  static constexpr size_t kSKBytes = kSKBytes0 > kYBytes ? kSKBytes0 : kYBytes;
  static constexpr size_t kXvBytes = sizeof(Op) * (size_t)kMaxP * kLdRows;
  static constexpr size_t kOutBytes = kQBytes + kSKBytes + kXvBytes + 4 * sizeof(float) * kRows;
  static_assert(kStateBytes <= kMaxSharedBytesPerBlock, "chunk state kernel over the shared-memory limit");
  static_assert(kOutBytes <= kMaxSharedBytesPerBlock, "chunk output kernel over the shared-memory limit");
  static_assert(kQBytes % 16 == 0 && kSKBytes % 16 == 0 && kXvBytes % 16 == 0, "areas stay 16-byte aligned");
  static_assert(kLdN * sizeof(Op) % 16 == 0, "rows of S~ take 16-byte stores");
};

constexpr int kStateThreads = 256;

// Rows j < rows (j = t * R + r) of the chunk's k (is_k) or q after bias and rotation,
// entry n of row j written to dst[j * row_stride + n * col_stride], zeros for rows past m.
// A thread takes four rotation pairs of a row per pass, all its loads issued before any
// use (the fills are latency-bound otherwise: a block runs 8 warps).
template <typename Op>
__device__ __forceinline__ void fill_rotated(const PrefillScanArgs& a, const ChunkPlace& cp, int h, bool is_k,
                                             int rows, Op* dst, int row_stride, int col_stride, int threads) {
  const int N = a.dims.d_state, R = a.dims.rank, H = a.dims.heads, S = a.dims.n_angles, half = N / 2;
  const int quads = half / 4;  // N is a multiple of 16
  const int m = cp.len * R;
  const bool mimo = a.mimo_rotation;
  for (int idx = threadIdx.x; idx < rows * quads; idx += threads) {
    const int j = idx / quads, i = (idx % quads) * 4;  // pairs i .. i+3
    // Pair k is (n0[k], n1[k]): halves (i+k, i+k+N/2), or adjacent (2(i+k), 2(i+k)+1).
    // Its entries sit in two 4-float blocks: lo = n0 of the four pairs (halves) or the
    // first two pairs (adjacent), hi the rest.
    const int lo = mimo ? i : 2 * i, hi = mimo ? i + half : 2 * i + 4;
    float x0[4] = {0.f, 0.f, 0.f, 0.f}, x1[4] = {0.f, 0.f, 0.f, 0.f};
    if (j < m) {
      const int t = cp.first + j / R, r = j % R;
      const float* nrm = (is_k ? a.ws.b_norm : a.ws.c_norm) + ((int64_t)t * R + r) * N;
      const float* bias = (is_k ? a.B_bias : a.C_bias) + ((int64_t)h * R + r) * N;
      const float2* rot = a.ws.rot + ((int64_t)t * H + h) * S;
      const float4 nl = *reinterpret_cast<const float4*>(nrm + lo), nh = *reinterpret_cast<const float4*>(nrm + hi);
      float bl[4], bh[4];
      float2 cs[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        bl[k] = bias[lo + k];
        bh[k] = bias[hi + k];
        cs[k] = i + k < S ? rot[i + k] : make_float2(1.f, 0.f);
      }
      const float e[8] = {nl.x + bl[0], nl.y + bl[1], nl.z + bl[2], nl.w + bl[3],
                          nh.x + bh[0], nh.y + bh[1], nh.z + bh[2], nh.w + bh[3]};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float a0 = mimo ? e[k] : e[2 * k], a1 = mimo ? e[4 + k] : e[2 * k + 1];
        if (i + k < S) {
          x0[k] = a0 * cs[k].x - a1 * cs[k].y;
          x1[k] = a0 * cs[k].y + a1 * cs[k].x;
        } else {
          x0[k] = a0;
          x1[k] = a1;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int n0 = mimo ? i + k : 2 * (i + k), n1 = mimo ? i + k + half : 2 * (i + k) + 1;
      dst[j * row_stride + n0 * col_stride] = to_operand<Op>(x0[k]);
      dst[j * row_stride + n1 * col_stride] = to_operand<Op>(x1[k]);
    }
  }
}

// xv of rows j < rows (zeros past m), times scale[t] when given, transposed:
// dst[p * ld + j] = scale[t] * x_t[p] * mimo_x[h, r, p]. Four p per thread per pass.
template <typename Op>
__device__ __forceinline__ void fill_xv_transposed(const PrefillScanArgs& a, const ChunkPlace& cp, int h,
                                                   const float* scale, int rows, Op* dst, int ld, int threads) {
  const int P = a.dims.headdim, R = a.dims.rank, quads = P / 4;
  const int m = cp.len * R;
  for (int idx = threadIdx.x; idx < rows * quads; idx += threads) {
    const int j = idx / quads, p = (idx % quads) * 4;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (j < m) {
      const int t = j / R, r = j % R;
      const float* x = a.w + (int64_t)(cp.first + t) * a.w_stride + a.off_x + h * P + p;
      const float* mx = a.mimo_x + ((int64_t)h * R + r) * P + p;
      float xs[4], ms[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        xs[k] = x[k];
        ms[k] = mx[k];
      }
      const float sc = scale != nullptr ? scale[t] : 1.f;
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = scale != nullptr ? sc * (xs[k] * ms[k]) : xs[k] * ms[k];
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) dst[(p + k) * ld + j] = to_operand<Op>(v[k]);
  }
}

// ---- 1. token params --------------------------------------------------------------------
// A warp for each of B's and C's 2R rows at rank 4, so that no warp walks two in turn.
constexpr int kParamThreads = 256;
// kVec4: B's and C's rows in 16-byte pieces, a lane four entries (launch_prefill_scan checks
// that the rows, the norm weights and the destinations allow it).
template <bool kVec4>
__global__ void __launch_bounds__(kParamThreads) prefill_token_params_kernel(const ScanParams prm) {
  const PrefillScanArgs& a = prm.a;
  const int t = blockIdx.x;
  const int H = a.dims.heads, N = a.dims.d_state, R = a.dims.rank;
  allow_next_kernel();  // the angles kernel waits for this one before reading dt
  const float* row = a.w + (int64_t)t * a.w_stride;
  for (int h = threadIdx.x; h < H; h += kParamThreads) {
    const float dt = softplus(row[a.off_dt + h] + a.dt_bias[h]);
    const float dA = row[a.off_A + h];
    const float A = fminf(-(fmaxf(dA, 0.f) + 1.f / (1.f - fminf(dA, 0.f))), -a.a_floor);
    const float trap = 1.f / (1.f + expf(-row[a.off_trap + h]));
    const int64_t i = (int64_t)t * H + h;
    a.ws.tok_a[i] = A * dt;
    a.ws.tok_gamma[i] = trap * dt;
    a.ws.tok_bterm[i] = (1.f - trap) * dt;
    a.ws.tok_dt[i] = dt;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int v = warp; v < 2 * R; v += kParamThreads / 32) {
    const bool is_b = v < R;
    const int r = is_b ? v : v - R;
    const float* src = row + (is_b ? a.off_B : a.off_C) + r * N;
    const float* nw = is_b ? a.B_norm : a.C_norm;
    const int64_t at = ((int64_t)t * R + r) * N;
    float* dst = (is_b ? a.ws.b_norm : a.ws.c_norm) + at;
    __half* dst_h = (is_b ? a.ws.b_norm_h : a.ws.c_norm_h) + at;
    float ss = 0.f;
    if constexpr (kVec4) {
      // N <= 128: one piece a lane.
      const int n = 4 * lane;
      const float4 x = n < N ? *reinterpret_cast<const float4*>(src + n) : make_float4(0.f, 0.f, 0.f, 0.f);
      ss = x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
      const float scale = rsqrtf(warp_sum(ss) / N + a.norm_eps);
      if (n < N) {
        const float4 g = *reinterpret_cast<const float4*>(nw + n);
        const float4 v = make_float4(x.x * scale * g.x, x.y * scale * g.y, x.z * scale * g.z, x.w * scale * g.w);
        store4(dst + n, v);
        store4(dst_h + n, v);
      }
    } else {
      for (int n = lane; n < N; n += 32) ss += src[n] * src[n];
      const float scale = rsqrtf(warp_sum(ss) / N + a.norm_eps);
      for (int n = lane; n < N; n += 32) {
        const float v = src[n] * scale * nw[n];
        dst[n] = v;
        dst_h[n] = __float2half_rn(v);
      }
    }
  }
}

// ---- 2. angles ----------------------------------------------------------------------------
// A block per (head, run, group of kAngleGroup angles): lane l takes angle l % kAngleGroup of
// the group and, with the other lanes of its angle, one of kAngleSegments contiguous
// segments of the run (warp w, sub-segment l / kAngleGroup). Pass 1 sums each segment's
// increments; each thread adds the totals of the segments before its own to the slot's
// angle; pass 2 rewalks the segment in token order (the order the decode step adds them
// in), writing cos and sin of theta_t (the rotation the chunk kernels apply). Why groups of
// angles: a block a (head, run) left most of the GPU idle (28 blocks at s2s-14l) on a loop
// of 64 sincos a thread; a group of 8 gives 4x the blocks and a quarter of the loop.
// A thread's first kAngleCache increments stay in shared memory from pass 1 to pass 2 (a
// segment of a run of up to 2048 tokens whole), so pass 2 reads them where it would compute
// tanhf again; the sums are the same bit for bit.
constexpr int kAngleThreads = 1024;
constexpr int kAngleGroup = 8;
constexpr int kAngleSegments = kAngleThreads / kAngleGroup;  // 128
constexpr int kAngleCache = 16;
constexpr size_t kAngleCacheBytes = sizeof(float) * kAngleCache * kAngleThreads;  // dynamic shared memory
__device__ __forceinline__ float angle_increment(const PrefillScanArgs& a, int t, int h, int s) {
  return tanhf(a.w[(int64_t)t * a.w_stride + a.off_ang + s]) * a.ws.tok_dt[(int64_t)t * a.dims.heads + h] * kPi;
}
__global__ void __launch_bounds__(kAngleThreads) prefill_angles_kernel(const ScanParams prm) {
  const PrefillScanArgs& a = prm.a;
  const int H = a.dims.heads, S = a.dims.n_angles;
  const int h = blockIdx.x, run = blockIdx.y;
  const int s = blockIdx.z * kAngleGroup + threadIdx.x % kAngleGroup;
  const int segment = threadIdx.x / kAngleGroup;  // warp-major: a warp holds 4 adjacent segments
  const int t0 = a.runs.token_begin[run], t1 = a.runs.token_begin[run + 1];
  const int seg = (t1 - t0 + kAngleSegments - 1) / kAngleSegments;
  const int b0 = min(t1, t0 + segment * seg), b1 = min(t1, b0 + seg);
  __shared__ float totals[kAngleSegments][kAngleGroup];
  const int slot = a.runs.slot[run], parity = a.runs.parity[run] & 1;
  float* angle = a.state + slot * a.slot_stride + a.layer_offset + prm.layout.angle + h * S;
  const bool mine = s < S;
  // The slot's angle is read before the barrier: the new one may go to the same half.
  const float theta0 = mine ? angle[(int64_t)parity * H * S + s] : 0.f;
  wait_for_previous_kernel();  // dt is the token-params kernel's
  allow_next_kernel();
  extern __shared__ float cached[];  // [kAngleCache][kAngleThreads]
  float sum = 0.f;
  if (mine) {
#pragma unroll 8
    for (int t = b0; t < b1; ++t) {
      const float inc = angle_increment(a, t, h, s);
      if (t - b0 < kAngleCache) cached[(t - b0) * kAngleThreads + threadIdx.x] = inc;
      sum += inc;
    }
  }
  totals[segment][threadIdx.x % kAngleGroup] = sum;
  __syncthreads();  // every segment's total is in, every old angle read
  if (!mine) return;
  const int g = threadIdx.x % kAngleGroup;
  float theta = theta0;
  for (int w = 0; w < segment; ++w) theta += totals[w][g];
#pragma unroll 4
  for (int t = b0; t < b1; ++t) {
    theta += t - b0 < kAngleCache ? cached[(t - b0) * kAngleThreads + threadIdx.x] : angle_increment(a, t, h, s);
    float sn, cs;
    sincosf(theta, &sn, &cs);
    a.ws.rot[((int64_t)t * H + h) * S + s] = make_float2(cs, sn);
  }
  if (segment == kAngleSegments - 1) {
    // The last segment's theta is the run's end only when it reaches it; the sum of every
    // total is, whatever the segments.
    float total = theta0;
    for (int w = 0; w < kAngleSegments; ++w) total += totals[w][g];
    angle[(int64_t)((parity + (t1 - t0)) & 1) * H * S + s] = total;
  }
}

// The same angles for calls of short runs only: a thread per (run, head, angle) adds the
// increments in token order from the slot's angle, as the decode step does.
constexpr int kSerialAngleThreads = 256;
__global__ void __launch_bounds__(kSerialAngleThreads) prefill_angles_serial_kernel(const ScanParams prm) {
  const PrefillScanArgs& a = prm.a;
  const int H = a.dims.heads, S = a.dims.n_angles;
  const int64_t item = (int64_t)blockIdx.x * kSerialAngleThreads + threadIdx.x;
  const bool mine = item < (int64_t)a.runs.n_runs * H * S;
  const int s = mine ? static_cast<int>(item % S) : 0;
  const int h = mine ? static_cast<int>(item / S % H) : 0;
  const int run = mine ? static_cast<int>(item / S / H) : 0;
  float* angle = nullptr;
  float theta = 0.f;
  int parity = 0;
  if (mine) {
    parity = a.runs.parity[run] & 1;
    angle = a.state + a.runs.slot[run] * a.slot_stride + a.layer_offset + prm.layout.angle + h * S + s;
    theta = angle[(int64_t)parity * H * S];
  }
  wait_for_previous_kernel();  // dt is the token-params kernel's
  allow_next_kernel();
  if (!mine) return;
  const int t0 = a.runs.token_begin[run], t1 = a.runs.token_begin[run + 1];
#pragma unroll 4
  for (int t = t0; t < t1; ++t) {
    theta += angle_increment(a, t, h, s);
    float sn, cs;
    sincosf(theta, &sn, &cs);
    a.ws.rot[((int64_t)t * H + h) * S + s] = make_float2(cs, sn);
  }
  angle[(int64_t)((parity + (t1 - t0)) & 1) * H * S] = theta;
}

// ---- 3. chunk state -----------------------------------------------------------------------
// dS[p][n] = sum_j XvW[j][p] K[j][n] with XvW[(t,r)][p] = exp(L_e - L_t) u_t x_t[p] mimo_x[r][p].
template <typename Op>
__global__ void __launch_bounds__(kStateThreads) prefill_chunk_state_kernel(const ScanParams prm) {
  using Sm = ChunkSmem<Op>;
  const PrefillScanArgs& a = prm.a;
  const int c = blockIdx.x, h = blockIdx.y;
  const int H = a.dims.heads, P = a.dims.headdim, N = a.dims.d_state, R = a.dims.rank;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  extern __shared__ float4 smem4[];
  Op* xvw_t = reinterpret_cast<Op*>(smem4);     // [P][kLdRows]
  Op* k_t = xvw_t + kMaxP * Sm::kLdRows;        // [N][kLdRows]
  float* L = reinterpret_cast<float*>(k_t + kMaxN * Sm::kLdRows);
  float* gam = L + Sm::kRows;
  float* u = gam + Sm::kRows;
  float* wts = u + Sm::kRows;

  wait_for_previous_kernel();
  allow_next_kernel();
  const ChunkPlace cp = chunk_place(a, c, Sm::kRows / R);
  const int m = cp.len * R, m16 = (m + 15) & ~15;
  chunk_token_terms(a, cp, h, L, gam, u);
  __syncthreads();
  for (int i = threadIdx.x; i < cp.len; i += kStateThreads) wts[i] = expf(L[cp.len - 1] - L[i]) * u[i];
  fill_rotated<Op>(a, cp, h, /*is_k=*/true, m16, k_t, 1, Sm::kLdRows, kStateThreads);
  __syncthreads();
  fill_xv_transposed<Op>(a, cp, h, wts, m16, xvw_t, Sm::kLdRows, kStateThreads);
  __syncthreads();

  Op* delta = static_cast<Op*>(a.ws.chunk_delta) + ((int64_t)c * H + h) * P * N;
  const int groups = (N + 63) / 64, jobs = (P / 16) * groups;
  const int g = lane >> 2, cq = lane & 3;
  for (int job = warp; job < jobs; job += kStateThreads / 32) {
    const int rt = job / groups, ng = job % groups;
    const int nt_limit = min(8, N / 8 - ng * 8);
    float acc[8][4] = {};
    warp_tile_mma<8>(acc, xvw_t + rt * 16 * Sm::kLdRows, Sm::kLdRows, k_t + ng * 64 * Sm::kLdRows, Sm::kLdRows, m16,
                     nt_limit);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt < nt_limit) {
        const int p = rt * 16 + g, n = ng * 64 + nt * 8 + 2 * cq;
        store_pair(delta + (int64_t)p * N + n, acc[nt][0], acc[nt][1]);
        store_pair(delta + (int64_t)(p + 8) * N + n, acc[nt][2], acc[nt][3]);
      }
    }
  }
  if (threadIdx.x == 0) a.ws.chunk_decay[(int64_t)c * H + h] = expf(L[cp.len - 1]);
}

// ---- 4. state pass ------------------------------------------------------------------------
// Four consecutive entries of Op as one load brings them in, and widened to fp32.
template <typename Op>
struct Quad;
template <>
struct Quad<float> {
  using Bits = float4;
  static __device__ __forceinline__ float4 widen(float4 v) { return v; }
};
template <>
struct Quad<__nv_bfloat16> {
  using Bits = uint2;
  static __device__ __forceinline__ float4 widen(uint2 v) { return widen_bf16x4(v); }
};

// Four consecutive state entries of one row per thread, through the run's chunks in order,
// with the next kAheadBytes of deltas a thread in flight (PrefillScanPlan says which).
template <typename Op, int kAheadBytes>
__global__ void __launch_bounds__(kStateThreads) prefill_state_pass_kernel(const ScanParams prm) {
  const PrefillScanArgs& a = prm.a;
  const int H = a.dims.heads, P = a.dims.headdim, N = a.dims.d_state, R = a.dims.rank;
  const int h = blockIdx.y, run = blockIdx.z;
  const int e = (blockIdx.x * kStateThreads + threadIdx.x) * 4;
  wait_for_previous_kernel();  // the chunk state kernel's deltas
  allow_next_kernel();
  if (e >= P * N) return;
  const int p = e / N, n = e % N;
  const int slot = a.runs.slot[run], parity = a.runs.parity[run] & 1;
  const int t0 = a.runs.token_begin[run];
  float* st = a.state + slot * a.slot_stride + a.layer_offset;
  // The ssm rows in fp32, or in bf16 (state_dtype bf16: widened here, rounded at the store).
  const int64_t e_at = ((int64_t)h * P + p) * N + n;
  float* ssm = st + prm.layout.ssm + e_at;
  __nv_bfloat16* ssm_bf16 = reinterpret_cast<__nv_bfloat16*>(st + prm.layout.ssm) + e_at;
  float4 s;
  if (prm.layout.ssm_bf16) {
    s = widen_bf16x4(*reinterpret_cast<const uint2*>(ssm_bf16));
  } else {
    s = *reinterpret_cast<const float4*>(ssm);
  }
  // The slot's previous token enters at the run's first step with weight (1-trap)*dt there.
  const float nb = a.ws.tok_bterm[(int64_t)t0 * H + h];
  const float xp = st[prm.layout.x_prev + h * P + p];
  // Scalar loads: k_prev sits after the [2][H][S] angles, 16-byte aligned only when H * S
  // is even, which the shapes prefill_scan_shape_refusal accepts do not guarantee.
  const float* kp = st + prm.layout.k_prev + (int64_t)parity * H * R * N + (int64_t)h * R * N + n;
  for (int r = 0; r < R; ++r) {
    const float coef = nb * (xp * a.mimo_x[((int64_t)h * R + r) * P + p]);
    const float* k = kp + r * N;
    s.x = fmaf(coef, k[0], s.x); s.y = fmaf(coef, k[1], s.y); s.z = fmaf(coef, k[2], s.z); s.w = fmaf(coef, k[3], s.w);
  }
  const int c0 = a.runs.chunk_begin[run], c1 = a.runs.chunk_begin[run + 1];
  Op* state_in = static_cast<Op*>(a.ws.chunk_state_in);
  const Op* deltas = static_cast<const Op*>(a.ws.chunk_delta);
  const int64_t head_at = (int64_t)h * P * N + (int64_t)p * N + n, chunk_floats = (int64_t)H * P * N;
  // Each chunk's inputs are loaded kAhead chunks before they are used (the stores between
  // would otherwise hold every load back to one round trip a chunk): a run's chunks are a
  // chain, so at few runs a call the grid is too small to hide the memory's latency by its
  // warps alone. The chunks' decays come a window of 32 at a time, one a lane, and go round
  // by shuffles: the same for every thread of the head, they would otherwise take a load
  // and a register a chunk.
  using Bits = typename Quad<Op>::Bits;
  constexpr int kWindow = 32;
  constexpr int kAhead = kAheadBytes / sizeof(Bits) < kWindow ? kAheadBytes / sizeof(Bits) : kWindow;
  static_assert(kWindow % kAhead == 0, "the delta ring turns whole within a window");
  const int lane = threadIdx.x & 31;
  const float* decays = a.ws.chunk_decay + h;
  // The next delta to load and the next chunk start to store, a chunk apart each.
  const Op* d_at = deltas + c0 * chunk_floats + head_at;
  Op* s_at = state_in + c0 * chunk_floats + head_at;
  Bits d_next[kAhead];
#pragma unroll
  for (int k = 0; k < kAhead; ++k) {
    if (c0 + k < c1) d_next[k] = *reinterpret_cast<const Bits*>(d_at);
    d_at += chunk_floats;
  }
  float window_decay = c0 + lane < c1 ? decays[(int64_t)(c0 + lane) * H] : 0.f;
  // (Every lane of a warp takes the same branches: a warp's 32 threads hold entries of one
  // head and one run, since P * N / 4 is a multiple of 64.)
  for (int c = c0; c < c1; c += kWindow) {
    const int nc = c + kWindow + lane;
    const float next_decay = nc < c1 ? decays[(int64_t)nc * H] : 0.f;
#pragma unroll
    for (int k = 0; k < kWindow; ++k) {
      const int cc = c + k;
      if (cc < c1) {
        const float4 d = Quad<Op>::widen(d_next[k % kAhead]);
        const float decay = __shfl_sync(0xffffffffu, window_decay, k);
        if (cc + kAhead < c1) d_next[k % kAhead] = *reinterpret_cast<const Bits*>(d_at);
        d_at += chunk_floats;
        store4(s_at, s);
        s_at += chunk_floats;
        s.x = fmaf(decay, s.x, d.x); s.y = fmaf(decay, s.y, d.y); s.z = fmaf(decay, s.z, d.z); s.w = fmaf(decay, s.w, d.w);
      }
    }
    window_decay = next_decay;
  }
  if (prm.layout.ssm_bf16) {
    store4(ssm_bf16, s);
  } else {
    store4(ssm, s);
  }
}

// ---- 5. chunk output ----------------------------------------------------------------------
// Two blocks an SM where shared memory allows (sm_90): one block's eight warps leave the
// SM idle on the fills' global loads.
template <typename Op>
__global__ void __launch_bounds__(ChunkSmem<Op>::kThreadsOut, 2) prefill_chunk_output_kernel(const ScanParams prm) {
  using Sm = ChunkSmem<Op>;
  constexpr int kThreads = Sm::kThreadsOut;
  const PrefillScanArgs& a = prm.a;
  const int c = blockIdx.x, h = blockIdx.y;
  const int H = a.dims.heads, P = a.dims.headdim, N = a.dims.d_state, R = a.dims.rank;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, cq = lane & 3;
  extern __shared__ float4 smem4[];
  unsigned char* base = reinterpret_cast<unsigned char*>(smem4);
  Op* q = reinterpret_cast<Op*>(base);                              // [rows][kLdQ], later G
  Op* sk = reinterpret_cast<Op*>(base + Sm::kQBytes);               // S~ [P][kLdN], then K [rows][kLdN]
  float* ys = reinterpret_cast<float*>(base + Sm::kQBytes);         // then y [rows][kLdY]
  Op* xv_t = reinterpret_cast<Op*>(base + Sm::kQBytes + Sm::kSKBytes);  // [P][kLdRows]
  float* L = reinterpret_cast<float*>(base + Sm::kQBytes + Sm::kSKBytes + Sm::kXvBytes);
  float* gam = L + Sm::kRows;
  float* u = gam + Sm::kRows;
  float* rs = u + Sm::kRows;
  wait_for_previous_kernel();  // S~ is the state pass's
  allow_next_kernel();

  const ChunkPlace cp = chunk_place(a, c, Sm::kRows / R);
  const int m = cp.len * R, m16 = (m + 15) & ~15;
  chunk_token_terms(a, cp, h, L, gam, u);
  fill_rotated<Op>(a, cp, h, /*is_k=*/false, m16, q, Sm::kLdQ, 1, kThreads);
  {  // S~ in 16-byte pieces (N is a multiple of 16, the smem rows 16-byte aligned)
    constexpr int kVec = 16 / sizeof(Op);
    const Op* src = static_cast<const Op*>(a.ws.chunk_state_in) + ((int64_t)c * H + h) * P * N;
    for (int idx = threadIdx.x; idx < P * N / kVec; idx += kThreads) {
      const int e = idx * kVec;
      *reinterpret_cast<uint4*>(sk + (e / N) * Sm::kLdN + e % N) = *reinterpret_cast<const uint4*>(src + e);
    }
  }
  fill_xv_transposed<Op>(a, cp, h, nullptr, m16, xv_t, Sm::kLdRows, kThreads);
  __syncthreads();

  // This warp's rows: 16 * warp + g and + 8 (tokens row / R; 16 is a multiple of R, so a
  // warp's rows never share a token with a later warp's).
  const int row0 = warp * 16;
  const bool active = row0 < m16;
  const int i_lo = row0 + g, i_hi = i_lo + 8;
  constexpr int kPT = kMaxP / 8;
  float y[kPT][4] = {};
  if (active) {  // what the chunk inherits: exp(L_t) q_t . S~
    warp_tile_mma<kPT>(y, q + row0 * Sm::kLdQ, Sm::kLdQ, sk, Sm::kLdN, N, P / 8);
    const float e_lo = i_lo < m ? expf(L[i_lo / R]) : 0.f, e_hi = i_hi < m ? expf(L[i_hi / R]) : 0.f;
#pragma unroll
    for (int nt = 0; nt < kPT; ++nt) {
      y[nt][0] *= e_lo; y[nt][1] *= e_lo; y[nt][2] *= e_hi; y[nt][3] *= e_hi;
    }
  }
  __syncthreads();
  fill_rotated<Op>(a, cp, h, /*is_k=*/true, m16, sk, Sm::kLdN, 1, kThreads);
  __syncthreads();

  if (active) {
    // G = (Q K^T) .* M over this warp's rows and the columns up to its diagonal.
    constexpr int kGT = Sm::kRows / 8;
    const int g_tiles = (row0 + 16) / 8;
    float gacc[kGT][4] = {};
    warp_tile_mma<kGT>(gacc, q + row0 * Sm::kLdQ, Sm::kLdQ, sk, Sm::kLdN, N, g_tiles);
    const int t_lo = i_lo / R, t_hi = i_hi / R;
#pragma unroll
    for (int nt = 0; nt < kGT; ++nt) {
      if (nt < g_tiles) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e < 2 ? i_lo : i_hi, t = e < 2 ? t_lo : t_hi;
          const int j = nt * 8 + 2 * cq + (e & 1), s = j / R;
          float mask = 0.f;
          if (i < m && j < m && s <= t) mask = s == t ? gam[t] : expf(L[t] - L[s]) * u[s];
          gacc[nt][e] *= mask;
        }
      }
    }
    __syncwarp();  // every lane is done reading this warp's q rows
#pragma unroll
    for (int nt = 0; nt < kGT; ++nt) {
      if (nt < g_tiles) {
        Op* d = q + i_lo * Sm::kLdQ + nt * 8 + 2 * cq;
        d[0] = to_operand<Op>(gacc[nt][0]);
        d[1] = to_operand<Op>(gacc[nt][1]);
        d[8 * Sm::kLdQ] = to_operand<Op>(gacc[nt][2]);
        d[8 * Sm::kLdQ + 1] = to_operand<Op>(gacc[nt][3]);
      }
    }
    __syncwarp();
    warp_tile_mma<kPT>(y, q + row0 * Sm::kLdQ, Sm::kLdQ, xv_t, Sm::kLdRows, row0 + 16, P / 8);
  }
  __syncthreads();  // K is no longer read: its area takes y
  if (active) {
    const float Dh = a.D[h];
#pragma unroll
    for (int nt = 0; nt < kPT; ++nt) {
      if (nt < P / 8) {
        const int p = nt * 8 + 2 * cq;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = half == 0 ? i_lo : i_hi;
          if (i >= m) continue;
          const int t = i / R, r = i % R;
          const float* x = a.w + (int64_t)(cp.first + t) * a.w_stride + a.off_x + h * P;
          const float* mx = a.mimo_x + ((int64_t)h * R + r) * P;
          ys[i * Sm::kLdY + p] = y[nt][2 * half] + Dh * (x[p] * mx[p]);
          ys[i * Sm::kLdY + p + 1] = y[nt][2 * half + 1] + Dh * (x[p + 1] * mx[p + 1]);
        }
      }
    }
  }
  __syncthreads();
  if (a.out_norm != nullptr) {
    for (int i = warp; i < m; i += kThreads / 32) {
      float ss = 0.f;
      for (int p = lane; p < P; p += 32) ss += ys[i * Sm::kLdY + p] * ys[i * Sm::kLdY + p];
      ss = warp_sum(ss);
      if (lane == 0) rs[i] = rsqrtf(ss / P + a.norm_eps);
    }
    __syncthreads();
  }
  // Four p of one token a thread per pass, every global load issued first.
  for (int idx = threadIdx.x; idx < cp.len * (P / 4); idx += kThreads) {
    const int t = idx / (P / 4), p = (idx % (P / 4)) * 4;
    const int64_t row = cp.first + t;
    float z[4], onw[4], out[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      z[k] = a.w[row * a.w_stride + a.off_z + h * P + p + k];
      onw[k] = a.out_norm != nullptr ? a.out_norm[h * P + p + k] : 1.f;
      out[k] = 0.f;
    }
    for (int r = 0; r < R; ++r) {
      const int i = t * R + r;
      const float* mz = a.mimo_z + ((int64_t)h * R + r) * P + p;
      const float* mo = a.mimo_o + ((int64_t)h * R + r) * P + p;
      float zs[4], os[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        zs[k] = mz[k];
        os[k] = mo[k];
      }
      const float scale = a.out_norm != nullptr ? rs[i] : 1.f;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float yv = ys[i * Sm::kLdY + p + k];
        if (a.out_norm != nullptr) yv *= scale * onw[k];
        out[k] += yv * silu(z[k] * zs[k]) * os[k];
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) store_output(a.o, a.o_bf16, row * a.o_stride + h * P + p + k, out[k]);
  }
  if (cp.first + cp.len == cp.run_end) write_last_token_prev(prm, cp, h, kThreads);
}

template <typename Op>
void set_smem_limits() {
  using Sm = ChunkSmem<Op>;
  const std::pair<const void*, size_t> kernels[] = {
      {reinterpret_cast<const void*>(prefill_chunk_state_kernel<Op>), Sm::kStateBytes},
      {reinterpret_cast<const void*>(prefill_chunk_output_kernel<Op>), Sm::kOutBytes},
  };
  for (const auto& [fn, bytes] : kernels) set_chunk_kernel_smem_limit(fn, bytes, "prefill chunk kernel");
}

constexpr int kDeepPassBytes = 256, kShallowPassBytes = 128;
int state_pass_tiles(int P, int N) { return (P * N / 4 + kStateThreads - 1) / kStateThreads; }

// Runs whose deep state pass is resident all at once (PrefillScanPlan).
template <typename Op>
int deep_state_pass_max_runs(const PrefillScanDims& d) {
  int per_sm = 0;
  M3_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, prefill_state_pass_kernel<Op, kDeepPassBytes>,
                                                              kStateThreads, 0));
  return per_sm * multiprocessor_count() / (state_pass_tiles(d.headdim, d.d_state) * d.heads);
}

template <typename Op>
void launch_chunks(ScanParams prm, cudaStream_t stream) {
  using Sm = ChunkSmem<Op>;
  const PrefillScanArgs& a = prm.a;
  const int H = a.dims.heads, P = a.dims.headdim, N = a.dims.d_state;
  const bool tc = sizeof(Op) == 2 && chunk_tc_applies(a);
  prm.whole_runs_in_state_kernel =
      tc && a.plan.single_chunk_runs_in_state_kernel && a.runs.n_chunks == a.runs.n_runs;
  if (tc) {
    launch_chunk_state_tc(prm, stream);
  } else {
    launch_scan_kernel(prefill_chunk_state_kernel<Op>, dim3(a.runs.n_chunks, H), kStateThreads, Sm::kStateBytes,
                       stream, a.pdl, prm);
  }
  if (!prm.whole_runs_in_state_kernel) {
    const bool deep = a.runs.n_runs <= a.plan.deep_state_pass_max_runs;
    launch_scan_kernel(deep ? prefill_state_pass_kernel<Op, kDeepPassBytes> : prefill_state_pass_kernel<Op, kShallowPassBytes>,
                       dim3(state_pass_tiles(P, N), H, a.runs.n_runs), kStateThreads, 0, stream, a.pdl, prm);
  }
  if (tc) {
    launch_chunk_output_tc(prm, stream);
    return;
  }
  launch_scan_kernel(prefill_chunk_output_kernel<Op>, dim3(a.runs.n_chunks, H), Sm::kThreadsOut, Sm::kOutBytes,
                     stream, a.pdl, prm);
}

size_t align256(size_t v) { return (v + 255) & ~size_t{255}; }

}  // namespace

std::optional<std::string> prefill_scan_shape_refusal(const PrefillScanDims& d) {
  if (d.heads <= 0) return "heads must be positive";
  if (d.headdim <= 0 || d.headdim % 16 != 0 || d.headdim > kMaxP) return "headdim must be a multiple of 16, at most 64";
  if (d.d_state <= 0 || d.d_state % 16 != 0 || d.d_state > kMaxN) return "d_state must be a multiple of 16, at most 128";
  if (d.rank != 1 && d.rank != 2 && d.rank != 4 && d.rank != 8) return "mimo_rank must be 1, 2, 4 or 8";
  if (d.n_angles < 0 || 2 * d.n_angles > d.d_state) return "at most d_state / 2 angles";
  return std::nullopt;
}

int fill_prefill_runs(std::span<const int32_t> lengths, int chunk_tokens, int32_t* token_begin,
                      int32_t* chunk_begin) {
  if (chunk_tokens <= 0) throw std::invalid_argument("prefill runs: chunk_tokens must be positive");
  token_begin[0] = 0;
  chunk_begin[0] = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] <= 0) {
      throw std::invalid_argument("prefill runs: run " + std::to_string(i) + " has " + std::to_string(lengths[i]) +
                                  " tokens; every run needs at least one");
    }
    token_begin[i + 1] = token_begin[i] + lengths[i];
    chunk_begin[i + 1] = chunk_begin[i] + (lengths[i] + chunk_tokens - 1) / chunk_tokens;
  }
  return chunk_begin[lengths.size()];
}

namespace {

// Carves the workspace from `base` into *w and returns the bytes it takes, so that the size
// and the layout cannot disagree (base 0 and w unread: only the size).
size_t lay_out_workspace(const PrefillScanDims& d, int max_tokens, int max_runs, uintptr_t base,
                         PrefillScanWorkspace* w) {
  const size_t T = max_tokens, H = d.heads, R = d.rank, N = d.d_state, P = d.headdim, S = d.n_angles;
  const size_t C = prefill_max_chunks(max_tokens, max_runs, prefill_chunk_tokens(d));
  const size_t op = d.precision == ScanPrecision::Fp32 ? 4 : 2;
  uintptr_t at = base;
  auto take = [&](size_t bytes) {
    void* p = reinterpret_cast<void*>(at);
    at += align256(bytes);
    return p;
  };
  w->tok_a = static_cast<float*>(take(4 * T * H));
  w->tok_gamma = static_cast<float*>(take(4 * T * H));
  w->tok_bterm = static_cast<float*>(take(4 * T * H));
  w->tok_dt = static_cast<float*>(take(4 * T * H));
  w->b_norm = static_cast<float*>(take(4 * T * R * N));
  w->c_norm = static_cast<float*>(take(4 * T * R * N));
  w->b_norm_h = static_cast<__half*>(take(2 * T * R * N));
  w->c_norm_h = static_cast<__half*>(take(2 * T * R * N));
  w->rot = static_cast<float2*>(take(8 * T * H * S));
  w->chunk_decay = static_cast<float*>(take(4 * C * H));
  w->chunk_delta = take(op * C * H * P * N);
  w->chunk_state_in = take(op * C * H * P * N);
  return at - base;
}

}  // namespace

size_t prefill_scan_workspace_bytes(const PrefillScanDims& d, int max_tokens, int max_runs) {
  PrefillScanWorkspace unused;
  return lay_out_workspace(d, max_tokens, max_runs, 0, &unused);
}

PrefillScanWorkspace prefill_scan_workspace(const PrefillScanDims& d, int max_tokens, int max_runs, void* base) {
  PrefillScanWorkspace w;
  lay_out_workspace(d, max_tokens, max_runs, reinterpret_cast<uintptr_t>(base), &w);
  return w;
}

PrefillScanPlan prepare_prefill_scan(const PrefillScanDims& d) {
  if (const auto refusal = prefill_scan_shape_refusal(d)) {
    throw std::invalid_argument("prefill scan (H " + std::to_string(d.heads) + ", P " + std::to_string(d.headdim) +
                                ", N " + std::to_string(d.d_state) + ", R " + std::to_string(d.rank) + ", S " +
                                std::to_string(d.n_angles) + "): " + *refusal);
  }
  PrefillScanPlan plan;
  static_assert(sizeof(float) * kAngleSegments * kAngleGroup + kAngleCacheBytes <= kMaxSharedBytesPerBlock,
                "the angles kernel's shared memory fits every target");
  allow_dynamic_smem(reinterpret_cast<const void*>(prefill_angles_kernel), kAngleCacheBytes);
  if (d.precision == ScanPrecision::Fp32) {
    set_smem_limits<float>();
    plan.deep_state_pass_max_runs = deep_state_pass_max_runs<float>(d);
  } else {
    set_smem_limits<__nv_bfloat16>();
    prepare_chunk_tc();
    plan.deep_state_pass_max_runs = deep_state_pass_max_runs<__nv_bfloat16>(d);
  }
  return plan;
}

void launch_prefill_scan(const PrefillScanArgs& a, cudaStream_t stream) {
  if (a.runs.n_tokens <= 0 || a.runs.n_runs <= 0) return;
  const PrefillScanDims& d = a.dims;
  // The state pass moves ssm rows in float4: every slot's layer must start 16-byte aligned.
  if (reinterpret_cast<uintptr_t>(a.state) % 16 != 0 || a.slot_stride % 4 != 0 || a.layer_offset % 4 != 0) {
    throw std::invalid_argument("prefill scan: state, slot_stride (" + std::to_string(a.slot_stride) +
                                ") and layer_offset (" + std::to_string(a.layer_offset) +
                                ") must keep each layer's state 16-byte aligned (floats a multiple of 4)");
  }
  ScanParams prm{a, mimo_state_layout(d.heads, d.headdim, d.d_state, d.rank, d.n_angles, a.state_bf16)};
  // Programmatic dependent launch saved time from 8 chunks a call on and cost up to 0.13 ms
  // below (H200, s2s-14l, docs/PERFORMANCE.md): a call of fewer chunks runs without it.
  constexpr int kPdlMinChunks = 8;
  prm.a.pdl = a.pdl && a.runs.n_chunks >= kPdlMinChunks;
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool bc_vec4 = d.d_state % 4 == 0 && a.w_stride % 4 == 0 && a.off_B % 4 == 0 && a.off_C % 4 == 0 &&
                       aligned16(a.w) && aligned16(a.B_norm) && aligned16(a.C_norm);
  if (bc_vec4) {
    prefill_token_params_kernel<true><<<a.runs.n_tokens, kParamThreads, 0, stream>>>(prm);
  } else {
    prefill_token_params_kernel<false><<<a.runs.n_tokens, kParamThreads, 0, stream>>>(prm);
  }
  M3_CUDA_CHECK(cudaGetLastError());
  if (d.n_angles > 0 && a.runs.max_run_tokens <= a.plan.serial_angles_max_tokens) {
    const int64_t items = (int64_t)a.runs.n_runs * d.heads * d.n_angles;
    launch_scan_kernel(prefill_angles_serial_kernel,
                       dim3(static_cast<unsigned>((items + kSerialAngleThreads - 1) / kSerialAngleThreads)),
                       kSerialAngleThreads, 0, stream, prm.a.pdl, prm);
  } else if (d.n_angles > 0) {
    const int groups = (d.n_angles + kAngleGroup - 1) / kAngleGroup;
    launch_scan_kernel(prefill_angles_kernel, dim3(d.heads, a.runs.n_runs, groups), kAngleThreads, kAngleCacheBytes,
                       stream, prm.a.pdl, prm);
  }
  if (d.precision == ScanPrecision::Fp32) {
    launch_chunks<float>(prm, stream);
  } else {
    launch_chunks<__nv_bfloat16>(prm, stream);
  }
}

}  // namespace m3::kernels
