// The chunk kernels of the prefill scan (kernels 3 and 5 of kernels/prefill_scan.cuh) on
// register fragments, for bf16 operands, MIMO heads and d_state a multiple of 32. Per
// (chunk, head), eight warps of 16 (token, rank) rows each build their own rows of k (and,
// for the output, q) straight in the mma.sync m16n8k16 operand layout, every load of a lane
// independent of the others. Why: the general kernels stage q, k, G and xv through
// shared-memory fills whose global loads each block waits on in turn.
//
//   chunk state:  dS = Xv^T diag(exp(L_e - L_s) u_s) K, k rows in shared memory row-major and
//                 read as the right operand by ldmatrix.trans.
//   chunk output: y = exp(L) .* (Q S~^T) + ((Q K^T) .* M) Xv + D Xv, then the gate, the
//                 optional grouped RMSNorm and mimo_o into o. q stays in registers, and each
//                 16-column tile of G turns from accumulator into operand in place (two
//                 m16n8 accumulator tiles side by side are one A fragment), so only k, xv and
//                 S~ pass through shared memory (S~ by cp.async, under the row building).
//
// The layout it relies on: in an A fragment lane (g, c) holds columns 16 kt + 2c, +1 and
// +8, +9 of rows g and g + 8; a MIMO rotation pairs entry n with n + N/2, which for N a
// multiple of 32 is tile kt + N/32 at the same place, so each lane holds both entries of
// every pair it rotates.
#include <cuda_bf16.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/mma_bf16.cuh"
#include "kernels/prefill_chunk.cuh"

namespace m3::kernels::prefill_detail {
namespace {

constexpr int kRows = kPrefillRowsBf16;  // (token, rank) rows of a chunk
constexpr int kThreads = kRows * 2;      // a warp per 16 rows
constexpr int kMaxPT = kMaxP / 8;          // 8-column tiles of y
// Row strides 4 words past a multiple of 32 words: the fragment loads and stores are free
// of bank conflicts.
constexpr int kLdK = kMaxN + 8;   // k [rows][n]
constexpr int kLdS = kMaxN + 8;   // S~ [p][n]
constexpr int kLdXv = kRows + 8;  // xv^T [p][rows]
constexpr size_t kKBytes = 2 * (size_t)kRows * kLdK;
constexpr size_t kSBytes = 2 * (size_t)kMaxP * kLdS;
constexpr size_t kXvBytes = 2 * (size_t)kMaxP * kLdXv;
constexpr size_t kSmemBytes = kKBytes + kSBytes + kXvBytes + 3 * sizeof(float) * kRows;
static_assert(kSmemBytes <= kMaxSharedBytesPerBlock, "chunk output kernel over the shared-memory limit");
static_assert(kKBytes % 16 == 0 && kSBytes % 16 == 0 && kXvBytes % 16 == 0, "areas stay 16-byte aligned");
static_assert(kLdS * 2 % 16 == 0, "rows of S~ take 16-byte copies");

__device__ __forceinline__ float2 ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

// One row's entries of q (C) or k (B) after bias and rotation, as this lane holds them in an
// A fragment: frag[hh][kt][hf] packs columns n, n+1 with n = (hh * H2 + kt) * 16 + 2c + 8 hf
// (H2 = N / 32 tiles a half). Zeros when the row is past the chunk's tokens.
template <int kH2>
__device__ __forceinline__ void rotated_row_fragment(const float* nrm, const float* bias, const float2* rot_t,
                                                     int S, int c, bool valid, uint32_t (&frag)[2][kH2][2]) {
  constexpr int kHalf = kH2 * 16;
#pragma unroll
  for (int kt = 0; kt < kH2; ++kt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int n = kt * 16 + 2 * c + 8 * hf;
      float2 v0 = make_float2(0.f, 0.f), v1 = v0;
      if (valid) {
        const float2 a0 = ld2(nrm + n), b0 = ld2(bias + n), a1 = ld2(nrm + n + kHalf), b1 = ld2(bias + n + kHalf);
        const float2 x0 = make_float2(a0.x + b0.x, a0.y + b0.y), x1 = make_float2(a1.x + b1.x, a1.y + b1.y);
        v0 = x0;
        v1 = x1;
        // Pairs n and n + 1: (x0.x, x1.x) and (x0.y, x1.y), each rotated by its own angle.
        if (n < S) {
          const float2 r = rot_t[n];
          v0.x = x0.x * r.x - x1.x * r.y;
          v1.x = x0.x * r.y + x1.x * r.x;
        }
        if (n + 1 < S) {
          const float2 r = rot_t[n + 1];
          v0.y = x0.y * r.x - x1.y * r.y;
          v1.y = x0.y * r.y + x1.y * r.x;
        }
      }
      frag[0][kt][hf] = pack_bf16(v0.x, v0.y);
      frag[1][kt][hf] = pack_bf16(v1.x, v1.y);
    }
  }
}

// This warp's k rows (bf16, rotated) into ks [rows][kLdK], row-major; zeros past m.
template <int kH2>
__device__ __forceinline__ void store_k_rows(const PrefillScanArgs& a, const ChunkPlace& cp, int h, int i_lo,
                                             int m, __nv_bfloat16* ks) {
  constexpr int kN = kH2 * 32;
  const int H = a.dims.heads, R = a.dims.rank, S = a.dims.n_angles, cq = threadIdx.x & 3;
  uint32_t frag[2][2][kH2][2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = i_lo + 8 * half;
    const bool valid = i < m;
    const int t = valid ? i / R : 0, r = i % R;
    rotated_row_fragment<kH2>(a.ws.b_norm + ((int64_t)(cp.first + t) * R + r) * kN,
                              a.B_bias + ((int64_t)h * R + r) * kN, a.ws.rot + ((int64_t)(cp.first + t) * H + h) * S,
                              S, cq, valid, frag[half]);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
      for (int kt = 0; kt < kH2; ++kt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int n = (hh * kH2 + kt) * 16 + 2 * cq + 8 * hf;
          *reinterpret_cast<uint32_t*>(ks + (i_lo + 8 * half) * kLdK + n) = frag[half][hh][kt][hf];
        }
      }
    }
  }
}

// xv^T [p][rows] (bf16) for this warp's 16 rows from row0, zeros past m; with L and u, times
// the chunk-end weight exp(L_e - L_t) u_t of the row's token. Lane (pair jp of rows, p group
// pg): two rows a 4-byte store.
__device__ __forceinline__ void store_xv_transposed(const PrefillScanArgs& a, const ChunkPlace& cp, int h, int row0,
                                                    int m, const float* L, const float* u, __nv_bfloat16* xv_t) {
  const int P = a.dims.headdim, R = a.dims.rank, lane = threadIdx.x & 31;
  const int jp = lane & 7, pg = lane >> 3;
  const int j = row0 + 2 * jp;
  const int ta = j / R, ra = j % R, tb = (j + 1) / R, rb = (j + 1) % R;
  const bool va = j < m, vb = j + 1 < m;
  const float* xa = a.w + (int64_t)(cp.first + (va ? ta : 0)) * a.w_stride + a.off_x + h * P;
  const float* xb = a.w + (int64_t)(cp.first + (vb ? tb : 0)) * a.w_stride + a.off_x + h * P;
  const float* ma = a.mimo_x + ((int64_t)h * R + ra) * P;
  const float* mb = a.mimo_x + ((int64_t)h * R + rb) * P;
  const int e = cp.len - 1;
  const float sa = va && L != nullptr ? expf(L[e] - L[ta]) * u[ta] : 1.f;
  const float sb = vb && L != nullptr ? expf(L[e] - L[tb]) * u[tb] : 1.f;
#pragma unroll 4
  for (int p = pg; p < P; p += 4) {
    const float ea = va ? sa * (xa[p] * ma[p]) : 0.f, eb = vb ? sb * (xb[p] * mb[p]) : 0.f;
    *reinterpret_cast<uint32_t*>(xv_t + p * kLdXv + j) = pack_bf16(ea, eb);
  }
}

// ---- chunk state --------------------------------------------------------------------------
// dS[p][n] = sum_j XvW[j][p] K[j][n]; warp w takes rows p of tile w % (P/16) and the 64
// columns n of group w / (P/16).
constexpr size_t kStateSmemBytes = kKBytes + kXvBytes + 3 * sizeof(float) * kRows;
static_assert(kStateSmemBytes <= kMaxSharedBytesPerBlock, "chunk state kernel over the shared-memory limit");

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

template <int kH2>
__global__ void __launch_bounds__(kThreads) prefill_chunk_state_tc_kernel(const ScanParams prm) {
  constexpr int kN = kH2 * 32;
  const PrefillScanArgs& a = prm.a;
  const int c = blockIdx.x, h = blockIdx.y;
  const int H = a.dims.heads, P = a.dims.headdim, R = a.dims.rank;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, cq = lane & 3;
  extern __shared__ float4 smem4[];
  unsigned char* base = reinterpret_cast<unsigned char*>(smem4);
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(base);              // [rows][kLdK]
  __nv_bfloat16* xvw_t = reinterpret_cast<__nv_bfloat16*>(base + kKBytes);  // [P][kLdXv]
  float* L = reinterpret_cast<float*>(base + kKBytes + kXvBytes);
  float* gam = L + kRows;
  float* u = gam + kRows;

  const ChunkPlace cp = chunk_place(a, c, kRows / R);
  const int m = cp.len * R, m16 = (m + 15) & ~15;
  const int row0 = warp * 16;
  chunk_token_terms(a, cp, h, L, gam, u);
  store_k_rows<kH2>(a, cp, h, row0 + g, m, ks);
  __syncthreads();  // the token terms are in
  store_xv_transposed(a, cp, h, row0, m, L, u, xvw_t);
  __syncthreads();  // k and XvW^T are in

  const int p_tiles = P / 16, jobs = p_tiles * ((kN + 63) / 64);
  float* delta = a.ws.chunk_delta + ((int64_t)c * H + h) * P * kN;
  for (int job = warp; job < jobs; job += kThreads / 32) {
    const int pt = job % p_tiles, ng = job / p_tiles;
    const int nts = min(8, kN / 8 - ng * 8);  // 8-column tiles of this group (4 when N is 32 or 96's last)
    float acc[8][4] = {};
    const __nv_bfloat16* a_lo = xvw_t + (pt * 16 + g) * kLdXv + 2 * cq;
    for (int j0 = 0; j0 < m16; j0 += 16) {
      const uint32_t a0 = *reinterpret_cast<const uint32_t*>(a_lo + j0);
      const uint32_t a1 = *reinterpret_cast<const uint32_t*>(a_lo + 8 * kLdXv + j0);
      const uint32_t a2 = *reinterpret_cast<const uint32_t*>(a_lo + j0 + 8);
      const uint32_t a3 = *reinterpret_cast<const uint32_t*>(a_lo + 8 * kLdXv + j0 + 8);
      // Matrices of the x4: rows j0.. and j0+8.. of column tiles nt and nt + 1.
      const __nv_bfloat16* brow = ks + (j0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kLdK + ng * 64 + 8 * (lane >> 4);
#pragma unroll
      for (int nt = 0; nt < 8; nt += 2) {
        if (nt < nts) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, brow + nt * 8);
          mma_bf16(acc[nt], a0, a1, a2, a3, b[0], b[1]);
          mma_bf16(acc[nt + 1], a0, a1, a2, a3, b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt < nts) {
        const int p = pt * 16 + g, n = ng * 64 + nt * 8 + 2 * cq;
        *reinterpret_cast<float2*>(delta + (int64_t)p * kN + n) = make_float2(acc[nt][0], acc[nt][1]);
        *reinterpret_cast<float2*>(delta + (int64_t)(p + 8) * kN + n) = make_float2(acc[nt][2], acc[nt][3]);
      }
    }
  }
  if (threadIdx.x == 0) a.ws.chunk_log_decay[(int64_t)c * H + h] = L[cp.len - 1];
}

// acc[nt] += Q (this warp's rows, qf) . Bt[rows nt * 8 + g]^T for nt < count, with Bt bf16
// [rows][ld] holding one row per output column (S~ for the inherited state, k for G).
template <int kH2, int NT>
__device__ __forceinline__ void q_times_rows(float (&acc)[NT][4], const uint32_t (&qf)[2][kH2][4],
                                             const __nv_bfloat16* bt, int ld, int count) {
  const int lane = threadIdx.x & 31, g = lane >> 2, cq = lane & 3;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
    for (int kt = 0; kt < kH2; ++kt) {
      const int n0 = (hh * kH2 + kt) * 16 + 2 * cq;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (nt < count) {
          const __nv_bfloat16* b = bt + (nt * 8 + g) * ld + n0;
          mma_bf16(acc[nt], qf[hh][kt][0], qf[hh][kt][1], qf[hh][kt][2], qf[hh][kt][3],
                   *reinterpret_cast<const uint32_t*>(b), *reinterpret_cast<const uint32_t*>(b + 8));
        }
      }
    }
  }
}

// ---- chunk output -------------------------------------------------------------------------
template <int kH2>
__global__ void __launch_bounds__(kThreads, 2) prefill_chunk_output_tc_kernel(const ScanParams prm) {
  constexpr int kN = kH2 * 32;
  const PrefillScanArgs& a = prm.a;
  const int c = blockIdx.x, h = blockIdx.y;
  const int H = a.dims.heads, P = a.dims.headdim, R = a.dims.rank, S = a.dims.n_angles;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, cq = lane & 3;
  extern __shared__ float4 smem4[];
  unsigned char* base = reinterpret_cast<unsigned char*>(smem4);
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(base);                         // [rows][kLdK]
  __nv_bfloat16* ss = reinterpret_cast<__nv_bfloat16*>(base + kKBytes);               // [P][kLdS]
  __nv_bfloat16* xv_t = reinterpret_cast<__nv_bfloat16*>(base + kKBytes + kSBytes);   // [P][kLdXv]
  float* L = reinterpret_cast<float*>(base + kKBytes + kSBytes + kXvBytes);
  float* gam = L + kRows;
  float* u = gam + kRows;

  const ChunkPlace cp = chunk_place(a, c, kRows / R);
  const int m = cp.len * R;
  {  // S~ in 16-byte pieces, in flight while the rows are built
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(a.ws.chunk_state_in) + ((int64_t)c * H + h) * P * kN;
    for (int idx = threadIdx.x; idx < P * kN / 8; idx += kThreads) {
      const int e = idx * 8;
      cp_async16(ss + (e / kN) * kLdS + e % kN, src + e);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  chunk_token_terms(a, cp, h, L, gam, u);

  // This warp's rows: row0 + g and row0 + g + 8 (16 is a multiple of R: a warp's rows never
  // share a token with another warp's).
  const int row0 = warp * 16;
  const int i_lo = row0 + g, i_hi = i_lo + 8;
  const int t_lo = i_lo / R, t_hi = i_hi / R, r = i_lo % R;  // i_hi % R == r
  const bool v_lo = i_lo < m, v_hi = i_hi < m;
  auto norm_row = [&](const float* normed, int t) { return normed + ((int64_t)(cp.first + t) * R + r) * kN; };
  const float* bias_q = a.C_bias + ((int64_t)h * R + r) * kN;
  const float2* rot_lo = a.ws.rot + ((int64_t)(cp.first + (v_lo ? t_lo : 0)) * H + h) * S;
  const float2* rot_hi = a.ws.rot + ((int64_t)(cp.first + (v_hi ? t_hi : 0)) * H + h) * S;
  const int t_lo_safe = v_lo ? t_lo : 0, t_hi_safe = v_hi ? t_hi : 0;

  store_k_rows<kH2>(a, cp, h, i_lo, m, ks);  // the right operand of Q K^T, a row per column
  store_xv_transposed(a, cp, h, row0, m, nullptr, nullptr, xv_t);
  // q stays in registers: qf[hh][kt] is the A fragment of column tile hh * H2 + kt.
  uint32_t qf[2][kH2][4];
  {
    uint32_t qlo[2][kH2][2], qhi[2][kH2][2];
    rotated_row_fragment<kH2>(norm_row(a.ws.c_norm, t_lo_safe), bias_q, rot_lo, S, cq, v_lo, qlo);
    rotated_row_fragment<kH2>(norm_row(a.ws.c_norm, t_hi_safe), bias_q, rot_hi, S, cq, v_hi, qhi);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
      for (int kt = 0; kt < kH2; ++kt) {
        qf[hh][kt][0] = qlo[hh][kt][0];
        qf[hh][kt][1] = qhi[hh][kt][0];
        qf[hh][kt][2] = qlo[hh][kt][1];
        qf[hh][kt][3] = qhi[hh][kt][1];
      }
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();  // k, xv^T, S~ and the token terms are in

  const int pts = P / 8;
  float y[kMaxPT][4] = {};
  if (row0 < m) {
    q_times_rows<kH2>(y, qf, ss, kLdS, pts);  // what the chunk inherits: exp(L_t) q_t . S~
    const float e_lo = v_lo ? expf(L[t_lo]) : 0.f, e_hi = v_hi ? expf(L[t_hi]) : 0.f;
#pragma unroll
    for (int pt = 0; pt < kMaxPT; ++pt) {
      y[pt][0] *= e_lo; y[pt][1] *= e_lo; y[pt][2] *= e_hi; y[pt][3] *= e_hi;
    }
    // The chunk's own tokens, 16 columns of G at a time up to the diagonal.
    for (int jt = 0; jt <= warp; ++jt) {
      const int j0 = jt * 16;
      float gacc[2][4] = {};
      q_times_rows<kH2>(gacc, qf, ks + j0 * kLdK, kLdK, 2);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e < 2 ? i_lo : i_hi, t = e < 2 ? t_lo : t_hi;
          const int jj = j0 + nt * 8 + 2 * cq + (e & 1), s = jj / R;
          float mask = 0.f;
          if (i < m && jj < m && s <= t) mask = s == t ? gam[t] : expf(L[t] - L[s]) * u[s];
          gacc[nt][e] *= mask;
        }
      }
      const uint32_t g0 = pack_bf16(gacc[0][0], gacc[0][1]), g1 = pack_bf16(gacc[0][2], gacc[0][3]);
      const uint32_t g2 = pack_bf16(gacc[1][0], gacc[1][1]), g3 = pack_bf16(gacc[1][2], gacc[1][3]);
#pragma unroll
      for (int pt = 0; pt < kMaxPT; ++pt) {
        if (pt < pts) {
          const __nv_bfloat16* b = xv_t + (pt * 8 + g) * kLdXv + j0 + 2 * cq;
          mma_bf16(y[pt], g0, g1, g2, g3, *reinterpret_cast<const uint32_t*>(b),
                   *reinterpret_cast<const uint32_t*>(b + 8));
        }
      }
    }

    // The skip term D xv (in fp32), the optional norm, the gate; then the sum over the rank.
    const float Dh = a.D[h];
    const float* x_lo = a.w + (int64_t)(cp.first + t_lo_safe) * a.w_stride + a.off_x + h * P;
    const float* x_hi = a.w + (int64_t)(cp.first + t_hi_safe) * a.w_stride + a.off_x + h * P;
    const float* z_lo = a.w + (int64_t)(cp.first + t_lo_safe) * a.w_stride + a.off_z + h * P;
    const float* z_hi = a.w + (int64_t)(cp.first + t_hi_safe) * a.w_stride + a.off_z + h * P;
    const float* mx = a.mimo_x + ((int64_t)h * R + r) * P;
    const float* mz = a.mimo_z + ((int64_t)h * R + r) * P;
    const float* mo = a.mimo_o + ((int64_t)h * R + r) * P;
    float ss_lo = 0.f, ss_hi = 0.f;
#pragma unroll
    for (int pt = 0; pt < kMaxPT; ++pt) {
      if (pt < pts) {
        const int p = pt * 8 + 2 * cq;
        const float2 m2 = ld2(mx + p), xl = ld2(x_lo + p), xh = ld2(x_hi + p);
        y[pt][0] += Dh * (xl.x * m2.x);
        y[pt][1] += Dh * (xl.y * m2.y);
        y[pt][2] += Dh * (xh.x * m2.x);
        y[pt][3] += Dh * (xh.y * m2.y);
        ss_lo += y[pt][0] * y[pt][0] + y[pt][1] * y[pt][1];
        ss_hi += y[pt][2] * y[pt][2] + y[pt][3] * y[pt][3];
      }
    }
    float rs_lo = 1.f, rs_hi = 1.f;
    if (a.out_norm != nullptr) {  // a row's p are spread over the four lanes of its g
      ss_lo += __shfl_xor_sync(0xffffffffu, ss_lo, 1);
      ss_lo += __shfl_xor_sync(0xffffffffu, ss_lo, 2);
      ss_hi += __shfl_xor_sync(0xffffffffu, ss_hi, 1);
      ss_hi += __shfl_xor_sync(0xffffffffu, ss_hi, 2);
      rs_lo = rsqrtf(ss_lo / P + a.norm_eps);
      rs_hi = rsqrtf(ss_hi / P + a.norm_eps);
    }
#pragma unroll
    for (int pt = 0; pt < kMaxPT; ++pt) {
      if (pt < pts) {
        const int p = pt * 8 + 2 * cq;
        const float2 on = a.out_norm != nullptr ? ld2(a.out_norm + h * P + p) : make_float2(1.f, 1.f);
        const float2 zl = ld2(z_lo + p), zh = ld2(z_hi + p), z2 = ld2(mz + p), o2 = ld2(mo + p);
        y[pt][0] = v_lo ? y[pt][0] * rs_lo * on.x * silu(zl.x * z2.x) * o2.x : 0.f;
        y[pt][1] = v_lo ? y[pt][1] * rs_lo * on.y * silu(zl.y * z2.y) * o2.y : 0.f;
        y[pt][2] = v_hi ? y[pt][2] * rs_hi * on.x * silu(zh.x * z2.x) * o2.x : 0.f;
        y[pt][3] = v_hi ? y[pt][3] * rs_hi * on.y * silu(zh.y * z2.y) * o2.y : 0.f;
      }
    }
    // A token's R rows are the lanes whose g differ in their low log2(R) bits (lane bits 2..).
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      if (off < 4 * R) {
#pragma unroll
        for (int pt = 0; pt < kMaxPT; ++pt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) y[pt][e] += __shfl_xor_sync(0xffffffffu, y[pt][e], off);
        }
      }
    }
    // Every lane of a token holds its sums; rank lane r stores the column tiles pt = r mod R.
#pragma unroll
    for (int pt = 0; pt < kMaxPT; ++pt) {
      if (pt < pts && pt % R == r) {
        const int p = pt * 8 + 2 * cq;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          if (!(half == 0 ? v_lo : v_hi)) continue;
          const int64_t row = cp.first + (half == 0 ? t_lo : t_hi);
          const float o0 = y[pt][2 * half], o1 = y[pt][2 * half + 1];
          if (a.o_bf16) {
            *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(a.o) + row * a.o_stride + h * P + p) =
                pack_bf16(o0, o1);
          } else {
            *reinterpret_cast<float2*>(static_cast<float*>(a.o) + row * a.o_stride + h * P + p) =
                make_float2(o0, o1);
          }
        }
      }
    }
  }
  if (cp.first + cp.len == cp.run_end) write_last_token_prev(prm, cp, h, kThreads);
}

template <int kH2>
void set_limits() {
  set_chunk_kernel_smem_limit(reinterpret_cast<const void*>(prefill_chunk_state_tc_kernel<kH2>), kStateSmemBytes,
                              "prefill chunk state kernel");
  set_chunk_kernel_smem_limit(reinterpret_cast<const void*>(prefill_chunk_output_tc_kernel<kH2>), kSmemBytes,
                              "prefill chunk output kernel");
}

template <int kH2>
void launch_tiles(const ScanParams& prm, bool output, cudaStream_t stream) {
  const dim3 grid(prm.a.runs.n_chunks, prm.a.dims.heads);
  if (output) {
    prefill_chunk_output_tc_kernel<kH2><<<grid, kThreads, kSmemBytes, stream>>>(prm);
  } else {
    prefill_chunk_state_tc_kernel<kH2><<<grid, kThreads, kStateSmemBytes, stream>>>(prm);
  }
  M3_CUDA_CHECK(cudaGetLastError());
}

void launch(const ScanParams& prm, bool output, cudaStream_t stream) {
  switch (prm.a.dims.d_state / 32) {
    case 1: launch_tiles<1>(prm, output, stream); break;
    case 2: launch_tiles<2>(prm, output, stream); break;
    case 3: launch_tiles<3>(prm, output, stream); break;
    case 4: launch_tiles<4>(prm, output, stream); break;
    default: throw std::invalid_argument("prefill chunk kernels: d_state " + std::to_string(prm.a.dims.d_state) +
                                         " is not a multiple of 32 up to 128");
  }
}

}  // namespace

void set_chunk_kernel_smem_limit(const void* fn, size_t bytes, const char* name) {
  cudaFuncAttributes attr{};
  M3_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
  if (attr.sharedSizeBytes + bytes > kMaxSharedBytesPerBlock) {
    throw std::runtime_error(std::string(name) + " needs " + std::to_string(attr.sharedSizeBytes + bytes) +
                             " bytes of shared memory per block, over the " +
                             std::to_string(kMaxSharedBytesPerBlock) + "-byte limit");
  }
  M3_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  // The whole carveout as shared memory, so that as many blocks fit an SM as it holds.
  M3_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     static_cast<int>(cudaSharedmemCarveoutMaxShared)));
}

bool chunk_tc_applies(const PrefillScanArgs& a) {
  const PrefillScanDims& d = a.dims;
  // Pairs of fp32 columns are read as float2: every row and offset even.
  const bool even = a.w_stride % 2 == 0 && a.off_x % 2 == 0 && a.off_z % 2 == 0 && a.o_stride % 2 == 0;
  return d.precision == ScanPrecision::Bf16TensorCores && a.mimo_rotation && d.d_state % 32 == 0 &&
         d.d_state <= kMaxN && d.headdim % 16 == 0 && d.headdim <= kMaxP && 16 % d.rank == 0 && even;
}

void prepare_chunk_tc() {
  set_limits<1>();
  set_limits<2>();
  set_limits<3>();
  set_limits<4>();
}

void launch_chunk_state_tc(const ScanParams& prm, cudaStream_t stream) { launch(prm, false, stream); }
void launch_chunk_output_tc(const ScanParams& prm, cudaStream_t stream) { launch(prm, true, stream); }

}  // namespace m3::kernels::prefill_detail
