// The chunk kernels of the prefill scan (kernels 3 and 5 of kernels/prefill_scan.cuh) on
// register fragments, for bf16 operands, MIMO heads and d_state a multiple of 32. A block
// takes one (chunk, head): it first copies everything it reads into shared memory with one
// batch of cp.async (the chunk's normed B rows in fp16, its x and z rows, angles, biases,
// the mimo vectors and, for the output, S~), so a block waits on about two memory round
// trips in all; then eight warps of 16 (token, rank) rows each compute on mma.sync m16n8k16.
// Why: built straight from global memory, each warp's rows were a dozen dependent round
// trips (the loads of a lane do not all fit its registers at once), and the blocks spent
// their time waiting on them.
//
//   chunk state:  dS = Xv^T diag(exp(L_e - L_s) u_s) K; k is rotated in place in shared
//                 memory and read as the right operand by ldmatrix.trans.
//   chunk output: y = exp(L) .* (Q S~^T) + ((Q K^T) .* M) Xv + D Xv, then the gate, the
//                 optional grouped RMSNorm and mimo_o into o. q is loaded (fp16, normed)
//                 into registers in the A-fragment layout and rotated there; each 16-column
//                 tile of G turns from accumulator into operand in place (two m16n8
//                 accumulator tiles side by side are one A fragment); the Xv operand is
//                 made from the staged x rows as it is used.
//
// The layout it relies on: in an A fragment lane (g, c) holds columns 16 kt + 2c, +1 and
// +8, +9 of rows g and g + 8; a MIMO rotation pairs entry n with n + N/2, which for N a
// multiple of 32 is tile kt + N/32 at the same place, so each lane holds both entries of
// every pair it rotates.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/mma_bf16.cuh"
#include "kernels/prefill_chunk.cuh"

namespace m3::kernels::prefill_detail {
namespace {

constexpr int kRows = kPrefillRowsBf16;  // (token, rank) rows of a chunk
constexpr int kThreads = kRows * 2;      // a warp per 16 rows
constexpr int kMaxPT = kMaxP / 8;        // 8-column tiles of y
// Row strides 4 words past a multiple of 32 words: the fragment loads and stores are free
// of bank conflicts.
constexpr int kLdK = kMaxN + 8;   // k [rows][n], 16-bit
constexpr int kLdS = kMaxN + 8;   // S~ [p][n], bf16
constexpr int kLdXv = kRows + 8;  // XvW^T [p][rows], bf16

// Where a chunk kernel's areas lie in its dynamic shared memory (byte offsets), sized from
// the head shape: tokens = kRows / R rows of x, z and angles. Offsets of areas a kernel does
// not use are 0.
struct TcSmem {
  int k = 0, s = 0, xv = 0, x = 0, z = 0, rot = 0, bias_k = 0, bias_q = 0, mx = 0, mz = 0, mo = 0, onorm = 0;
  int terms = 0;  // L, gamma, u: `tokens` floats each
  int ldx = 0;    // floats between rows of x and z
  int bytes = 0;
};

TcSmem tc_smem(const PrefillScanDims& d, bool output) {
  const int tokens = kRows / d.rank, P = d.headdim, R = d.rank, N = d.d_state;
  TcSmem m;
  m.ldx = P + 8;  // 8 words past a multiple of 32 for P a multiple of 16: the Xv reads spread over the banks
  int at = 0;
  auto take = [&](int bytes) {
    const int o = at;
    at += (bytes + 15) & ~15;
    return o;
  };
  m.k = take(2 * kRows * kLdK);
  if (output) m.s = take(2 * P * kLdS); else m.xv = take(2 * P * kLdXv);
  m.x = take(4 * tokens * m.ldx);
  if (output) m.z = take(4 * tokens * m.ldx);
  m.rot = take(8 * tokens * d.n_angles);
  m.bias_k = take(4 * R * N);
  if (output) m.bias_q = take(4 * R * N);
  m.mx = take(4 * R * P);
  if (output) {
    m.mz = take(4 * R * P);
    m.mo = take(4 * R * P);
    m.onorm = take(4 * P);
  }
  m.terms = take(4 * 3 * tokens);
  m.bytes = at;
  return m;
}

__device__ __forceinline__ float2 ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }

// Rows [0, rows) of row_bytes (a multiple of 16, at most 16 * kThreads) from src, src_ld
// bytes apart, to dst, dst_ld bytes apart, in 16-byte cp.async pieces; rows from `valid` on
// become zeros. A thread keeps one piece of a row and walks the rows.
__device__ __forceinline__ void copy_rows(unsigned char* dst, int dst_ld, const void* src, int64_t src_ld, int rows,
                                          int valid, int row_bytes) {
  const int pieces = row_bytes >> 4, rows_per_pass = kThreads / pieces;
  const int first = threadIdx.x / pieces, pc = threadIdx.x - first * pieces;
  if (first >= rows_per_pass) return;
  const char* from = static_cast<const char*>(src) + pc * 16;
  for (int row = first; row < rows; row += rows_per_pass) {
    unsigned char* to = dst + row * dst_ld + pc * 16;
    if (row < valid) {
      cp_async16(to, from + row * src_ld);
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Everything the chunk kernel of (chunk cp, head h) reads, into shared memory by cp.async
// (one commit group; the output kernel copies S~ after its wait for the state pass).
__device__ __forceinline__ void stage_chunk(const PrefillScanArgs& a, const TcSmem& sm, const ChunkPlace& cp, int h,
                                            bool output, unsigned char* base) {
  const int H = a.dims.heads, P = a.dims.headdim, N = a.dims.d_state, R = a.dims.rank, S = a.dims.n_angles;
  const int tokens = kRows / R;
  const int64_t row_floats = a.w_stride;
  copy_rows(base + sm.k, 2 * kLdK, a.ws.b_norm_h + (int64_t)cp.first * R * N, 2 * N, kRows, cp.len * R, 2 * N);
  copy_rows(base + sm.x, 4 * sm.ldx, a.w + cp.first * row_floats + a.off_x + h * P, 4 * row_floats, tokens, cp.len,
            4 * P);
  if (S > 0) {
    copy_rows(base + sm.rot, 8 * S, a.ws.rot + ((int64_t)cp.first * H + h) * S, 8 * (int64_t)H * S, tokens, cp.len,
              8 * S);
  }
  copy_rows(base + sm.bias_k, 0, a.B_bias + (int64_t)h * R * N, 0, 1, 1, 4 * R * N);
  copy_rows(base + sm.mx, 0, a.mimo_x + (int64_t)h * R * P, 0, 1, 1, 4 * R * P);
  if (output) {
    copy_rows(base + sm.z, 4 * sm.ldx, a.w + cp.first * row_floats + a.off_z + h * P, 4 * row_floats, tokens, cp.len,
              4 * P);
    copy_rows(base + sm.bias_q, 0, a.C_bias + (int64_t)h * R * N, 0, 1, 1, 4 * R * N);
    copy_rows(base + sm.mz, 0, a.mimo_z + (int64_t)h * R * P, 0, 1, 1, 4 * R * P);
    copy_rows(base + sm.mo, 0, a.mimo_o + (int64_t)h * R * P, 0, 1, 1, 4 * R * P);
    if (a.out_norm != nullptr) copy_rows(base + sm.onorm, 0, a.out_norm + h * P, 0, 1, 1, 4 * P);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Entries (n, n+1) of x0 and of x1 (their partners n + N/2) rotated, pair by pair, by theta
// (rot_t holds cos and sin) where the pair's index is below S.
__device__ __forceinline__ void rotate_pairs(float2 x0, float2 x1, const float2* rot_t, int n, int S, float2& v0,
                                             float2& v1) {
  v0 = x0;
  v1 = x1;
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

__device__ __forceinline__ float2 half2_bits_to_float2(uint32_t bits) {
  __half2 h;
  *reinterpret_cast<uint32_t*>(&h) = bits;
  return __half22float2(h);
}

// The staged normed B rows (fp16) become k in place: bias added, rotated, bf16; rows past m
// zeros. A thread takes eight adjacent entries of a row and their partners N/2 on.
template <int kH2, int kR>
__device__ __forceinline__ void rotate_k_in_place(unsigned char* base, const TcSmem& sm, int S, int m) {
  constexpr int kN = kH2 * 32, kHalf = kN / 2, kOctets = kHalf / 8;
  __half* kh = reinterpret_cast<__half*>(base + sm.k);
  const float* bias = reinterpret_cast<const float*>(base + sm.bias_k);
  const float2* rot = reinterpret_cast<const float2*>(base + sm.rot);
#pragma unroll 2
  for (int idx = threadIdx.x; idx < kRows * kOctets; idx += kThreads) {
    const int row = idx / kOctets, n0 = 8 * (idx - row * kOctets);
    uint4* lo = reinterpret_cast<uint4*>(kh + row * kLdK + n0);
    uint4* hi = reinterpret_cast<uint4*>(kh + row * kLdK + n0 + kHalf);
    if (row >= m) {
      *lo = make_uint4(0u, 0u, 0u, 0u);
      *hi = make_uint4(0u, 0u, 0u, 0u);
      continue;
    }
    const int t = row / kR, r = row % kR;
    const uint4 a = *lo, b = *hi;
    const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
    const float* bl = bias + r * kN + n0;
    uint32_t ow[4], pw[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int n = n0 + 2 * q;
      const float2 x0 = half2_bits_to_float2(aw[q]), x1 = half2_bits_to_float2(bw[q]);
      const float2 b0 = ld2(bl + 2 * q), b1 = ld2(bl + kHalf + 2 * q);
      float2 v0, v1;
      rotate_pairs(make_float2(x0.x + b0.x, x0.y + b0.y), make_float2(x1.x + b1.x, x1.y + b1.y), rot + t * S, n, S, v0,
                   v1);
      ow[q] = pack_bf16(v0.x, v0.y);
      pw[q] = pack_bf16(v1.x, v1.y);
    }
    *lo = make_uint4(ow[0], ow[1], ow[2], ow[3]);
    *hi = make_uint4(pw[0], pw[1], pw[2], pw[3]);
  }
}

// XvW^T [p][rows] (bf16) for this warp's 16 rows from row0, from the staged x rows and
// mimo_x, each row times its token's chunk-end weight exp(L_e - L_t) u_t; zeros past m.
// Lane (pair jp of rows, p group pg): two rows a 4-byte store.
template <int kR>
__device__ __forceinline__ void store_xvw_transposed(const unsigned char* base, const TcSmem& sm, int P, int row0,
                                                     int m, int len, __nv_bfloat16* xv_t) {
  constexpr int R = kR;
  const float* xs = reinterpret_cast<const float*>(base + sm.x);
  const float* mxs = reinterpret_cast<const float*>(base + sm.mx);
  const float* L = reinterpret_cast<const float*>(base + sm.terms);
  const float* u = L + 2 * (kRows / R);
  const int lane = threadIdx.x & 31, jp = lane & 7, pg = lane >> 3;
  const int j = row0 + 2 * jp;
  const int ta = j / R, ra = j - ta * R, tb = (j + 1) / R, rb = j + 1 - tb * R;
  const bool va = j < m, vb = j + 1 < m;
  const float sa = va ? expf(L[len - 1] - L[ta]) * u[ta] : 0.f;
  const float sb = vb ? expf(L[len - 1] - L[tb]) * u[tb] : 0.f;
  const float *xa = xs + ta * sm.ldx, *xb = xs + tb * sm.ldx, *ma = mxs + ra * P, *mb = mxs + rb * P;
#pragma unroll 4
  for (int p = pg; p < P; p += 4) {
    const float ea = va ? sa * (xa[p] * ma[p]) : 0.f, eb = vb ? sb * (xb[p] * mb[p]) : 0.f;
    *reinterpret_cast<uint32_t*>(xv_t + p * kLdXv + j) = pack_bf16(ea, eb);
  }
}

// The chunk's token terms into the staged area: L, gamma, u, `tokens` floats apart.
__device__ __forceinline__ void stage_token_terms(const PrefillScanArgs& a, const ChunkPlace& cp, int h,
                                                  unsigned char* base, const TcSmem& sm) {
  float* L = reinterpret_cast<float*>(base + sm.terms);
  const int tokens = kRows / a.dims.rank;
  chunk_token_terms(a, cp, h, L, L + tokens, L + 2 * tokens);
}

// ---- chunk state --------------------------------------------------------------------------
// dS[p][n] = sum_j XvW[j][p] K[j][n]; warp w takes rows p of tile w % (P/16) and the 64
// columns n of group w / (P/16).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

template <int kH2, int kR>
__global__ void __launch_bounds__(kThreads) prefill_chunk_state_tc_kernel(const ScanParams prm, const TcSmem sm) {
  constexpr int kN = kH2 * 32, R = kR;
  const PrefillScanArgs& a = prm.a;
  const int c = blockIdx.x, h = blockIdx.y;
  const int H = a.dims.heads, P = a.dims.headdim, S = a.dims.n_angles;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, cq = lane & 3;
  extern __shared__ float4 smem4[];
  unsigned char* base = reinterpret_cast<unsigned char*>(smem4);
  const __nv_bfloat16* ks = reinterpret_cast<const __nv_bfloat16*>(base + sm.k);  // [rows][kLdK]
  __nv_bfloat16* xvw_t = reinterpret_cast<__nv_bfloat16*>(base + sm.xv);          // [P][kLdXv]

  // With no angles kernel the token-params kernel is the previous one: wait before staging.
  wait_for_previous_kernel();
  allow_next_kernel();
  const ChunkPlace cp = chunk_place(a, c, kRows / R);
  const int m = cp.len * R, m16 = (m + 15) & ~15;
  stage_chunk(a, sm, cp, h, false, base);
  stage_token_terms(a, cp, h, base, sm);
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();  // the staged rows and the token terms are in
  rotate_k_in_place<kH2, kR>(base, sm, S, m);
  store_xvw_transposed<kR>(base, sm, P, warp * 16, m, cp.len, xvw_t);
  __syncthreads();  // k and XvW^T are in

  const int p_tiles = P / 16, jobs = p_tiles * ((kN + 63) / 64);
  float* delta = a.ws.chunk_delta + ((int64_t)c * H + h) * P * kN;
  for (int job = warp; job < jobs; job += kThreads / 32) {
    const int pt = job % p_tiles, ng = job / p_tiles;
    const int nts = min(8, kN / 8 - ng * 8);  // 8-column tiles of this group (4 when N is 32 or 96's last)
    float acc[8][4] = {};
    // The A fragment of rows p (pt's 16) and columns j0..j0+15 is one ldmatrix.x4: lanes
    // 0-15 name rows 0-15 at column j0, lanes 16-31 the same rows at j0 + 8.
    const __nv_bfloat16* a_row = xvw_t + (pt * 16 + (lane & 15)) * kLdXv + 8 * (lane >> 4);
    // Matrices of the trans x4: rows j0.. and j0+8.. of column tiles nt and nt + 1.
    const __nv_bfloat16* b_row = ks + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kLdK + ng * 64 + 8 * (lane >> 4);
#pragma unroll
    for (int j0 = 0; j0 < kRows; j0 += 16) {
      if (j0 < m16) {
        uint32_t af[4];
        ldmatrix_x4(af, a_row + j0);
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2) {
          if (nt < nts) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, b_row + j0 * kLdK + nt * 8);
            mma_bf16(acc[nt], af[0], af[1], af[2], af[3], b[0], b[1]);
            mma_bf16(acc[nt + 1], af[0], af[1], af[2], af[3], b[2], b[3]);
          }
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
  if (threadIdx.x == 0) a.ws.chunk_log_decay[(int64_t)c * H + h] = reinterpret_cast<const float*>(base + sm.terms)[cp.len - 1];
}

// acc[nt] += Q (this warp's rows, qf) . Bt[rows nt * 8 .. + 7]^T for nt < count (even), with
// Bt bf16 [rows][ld] holding one row per output column (S~ for the inherited state, k for
// G). Rows of Bt are the B operand's columns: one ldmatrix.x4 gives tiles nt and nt + 1.
template <int kH2, int NT>
__device__ __forceinline__ void q_times_rows(float (&acc)[NT][4], const uint32_t (&qf)[2][kH2][4],
                                             const __nv_bfloat16* bt, int ld, int count) {
  static_assert(NT % 2 == 0, "column tiles go in pairs");
  const int lane = threadIdx.x & 31;
  // Lanes 0-7: rows of tile nt at k0, 8-15: the same at k0 + 8, 16-31: tile nt + 1.
  const __nv_bfloat16* row = bt + ((lane & 7) + 8 * (lane >> 4)) * ld + 8 * ((lane >> 3) & 1);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
    for (int kt = 0; kt < kH2; ++kt) {
      const int k0 = (hh * kH2 + kt) * 16;
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        if (nt < count) {
          uint32_t b[4];
          ldmatrix_x4(b, row + nt * 8 * ld + k0);
          mma_bf16(acc[nt], qf[hh][kt][0], qf[hh][kt][1], qf[hh][kt][2], qf[hh][kt][3], b[0], b[1]);
          mma_bf16(acc[nt + 1], qf[hh][kt][0], qf[hh][kt][1], qf[hh][kt][2], qf[hh][kt][3], b[2], b[3]);
        }
      }
    }
  }
}

// One row's normed C entries (fp16 bits) as this lane holds them in an A fragment:
// raw[hh][kt][hf] packs columns n, n+1 with n = (hh * H2 + kt) * 16 + 2c + 8 hf. Zeros for
// a row past the chunk's tokens.
template <int kH2>
__device__ __forceinline__ void load_q_row(const __half* row, int c, bool valid, uint32_t (&raw)[2][kH2][2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
    for (int kt = 0; kt < kH2; ++kt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int n = (hh * kH2 + kt) * 16 + 2 * c + 8 * hf;
        raw[hh][kt][hf] = valid ? __ldg(reinterpret_cast<const unsigned int*>(row + n)) : 0u;
      }
    }
  }
}

// The row's q entries after bias and rotation, in place, as bf16 pairs; zeros when !valid.
template <int kH2>
__device__ __forceinline__ void rotate_q_row(uint32_t (&raw)[2][kH2][2], const float* bias, const float2* rot_t,
                                             int S, int c, bool valid) {
  constexpr int kHalf = kH2 * 16;
#pragma unroll
  for (int kt = 0; kt < kH2; ++kt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int n = kt * 16 + 2 * c + 8 * hf;
      const float2 a0 = half2_bits_to_float2(raw[0][kt][hf]), a1 = half2_bits_to_float2(raw[1][kt][hf]);
      const float2 b0 = ld2(bias + n), b1 = ld2(bias + n + kHalf);
      float2 v0, v1;
      rotate_pairs(make_float2(a0.x + b0.x, a0.y + b0.y), make_float2(a1.x + b1.x, a1.y + b1.y), rot_t, n, S, v0, v1);
      raw[0][kt][hf] = valid ? pack_bf16(v0.x, v0.y) : 0u;
      raw[1][kt][hf] = valid ? pack_bf16(v1.x, v1.y) : 0u;
    }
  }
}

// ---- chunk output -------------------------------------------------------------------------
template <int kH2, int kR>
__global__ void __launch_bounds__(kThreads, 2) prefill_chunk_output_tc_kernel(const ScanParams prm, const TcSmem sm) {
  constexpr int kN = kH2 * 32, R = kR;
  const PrefillScanArgs& a = prm.a;
  const int c = blockIdx.x, h = blockIdx.y;
  const int H = a.dims.heads, P = a.dims.headdim, S = a.dims.n_angles;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, cq = lane & 3;
  const int tokens = kRows / R;
  extern __shared__ float4 smem4[];
  unsigned char* base = reinterpret_cast<unsigned char*>(smem4);
  const __nv_bfloat16* ks = reinterpret_cast<const __nv_bfloat16*>(base + sm.k);  // [rows][kLdK]
  __nv_bfloat16* ss = reinterpret_cast<__nv_bfloat16*>(base + sm.s);              // [P][kLdS]
  const float* xs = reinterpret_cast<const float*>(base + sm.x);                  // [tokens][ldx]
  const float* zs = reinterpret_cast<const float*>(base + sm.z);
  const float2* rot = reinterpret_cast<const float2*>(base + sm.rot);             // [tokens][S]
  const float* mxs = reinterpret_cast<const float*>(base + sm.mx);                // [R][P]
  const float* mzs = reinterpret_cast<const float*>(base + sm.mz);
  const float* mos = reinterpret_cast<const float*>(base + sm.mo);
  const float* L = reinterpret_cast<const float*>(base + sm.terms);
  const float* gam = L + tokens;
  const float* u = gam + tokens;

  const ChunkPlace cp = chunk_place(a, c, tokens);
  const int m = cp.len * R;
  stage_chunk(a, sm, cp, h, true, base);

  // This warp's rows: row0 + g and row0 + g + 8 (16 is a multiple of R: a warp's rows never
  // share a token with another warp's).
  const int row0 = warp * 16;
  const int i_lo = row0 + g, i_hi = i_lo + 8;
  const int t_lo = i_lo / R, t_hi = i_hi / R, r = i_lo % R;  // i_hi % R == r
  const bool v_lo = i_lo < m, v_hi = i_hi < m;
  const int t_lo_safe = v_lo ? t_lo : 0, t_hi_safe = v_hi ? t_hi : 0;
  uint32_t qlo[2][kH2][2], qhi[2][kH2][2];  // in flight with the staging copies
  load_q_row<kH2>(a.ws.c_norm_h + ((int64_t)(cp.first + t_lo_safe) * R + r) * kN, cq, v_lo, qlo);
  load_q_row<kH2>(a.ws.c_norm_h + ((int64_t)(cp.first + t_hi_safe) * R + r) * kN, cq, v_hi, qhi);
  stage_token_terms(a, cp, h, base, sm);
  // All of the above is two kernels back or older; S~ is the state pass's.
  wait_for_previous_kernel();
  allow_next_kernel();
  copy_rows(reinterpret_cast<unsigned char*>(ss), 2 * kLdS,
            static_cast<const __nv_bfloat16*>(a.ws.chunk_state_in) + ((int64_t)c * H + h) * P * kN, 2 * kN, P, P,
            2 * kN);
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();  // S~, the staged rows and the token terms are in

  rotate_k_in_place<kH2, kR>(base, sm, S, m);  // the right operand of Q K^T, a row per column
  // q stays in registers: qf[hh][kt] is the A fragment of column tile hh * H2 + kt.
  uint32_t qf[2][kH2][4];
  {
    const float* bias_q = reinterpret_cast<const float*>(base + sm.bias_q) + r * kN;
    rotate_q_row<kH2>(qlo, bias_q, rot + t_lo_safe * S, S, cq, v_lo);
    rotate_q_row<kH2>(qhi, bias_q, rot + t_hi_safe * S, S, cq, v_hi);
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
  __syncthreads();  // k is in

  const int pts = P / 8;
  float y[kMaxPT][4] = {};
  if (row0 < m) {
    q_times_rows<kH2>(y, qf, ss, kLdS, pts);  // what the chunk inherits: exp(L_t) q_t . S~
    const float e_lo = v_lo ? expf(L[t_lo]) : 0.f, e_hi = v_hi ? expf(L[t_hi]) : 0.f;
#pragma unroll
    for (int pt = 0; pt < kMaxPT; ++pt) {
      y[pt][0] *= e_lo; y[pt][1] *= e_lo; y[pt][2] *= e_hi; y[pt][3] *= e_hi;
    }
    // The Xv operand's rows for this lane, j0 + 2c + {0, 1, 8, 9}: their tokens (past j0 / R)
    // and ranks are the same for every j0 (16 is a multiple of R).
    // For R > 1 rows 2c and 2c + 1 are one token's (and so are 2c + 8 and 2c + 9).
    const int je0 = 2 * cq;
    const int tj0 = je0 / kR, tj1 = kR > 1 ? tj0 : je0 + 1, tj8 = (je0 + 8) / kR, tj9 = kR > 1 ? tj8 : je0 + 9;
    const float* mx0 = mxs + (je0 % kR) * P + g;
    const float* mx1 = mxs + ((je0 + 1) % kR) * P + g;
    // The chunk's own tokens, 16 columns of G at a time up to the diagonal.
    for (int jt = 0; jt <= warp; ++jt) {
      const int j0 = jt * 16;
      float gacc[2][4] = {};
      q_times_rows<kH2>(gacc, qf, ks + j0 * kLdK, kLdK, 2);
      // M[i][j]: gamma_t on the diagonal token, exp(L_t - L_s) u_s below it. Columns jj and
      // jj + 1 share their token when R > 1 (jj even), and then their factors.
      auto mask = [&](bool row_ok, int t, int jj) {
        const int s = jj / kR;
        if (!row_ok || jj >= m || s > t) return 0.f;
        return s == t ? gam[t] : expf(L[t] - L[s]) * u[s];
      };
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int jj = j0 + nt * 8 + 2 * cq;
        const float m_lo = mask(v_lo, t_lo, jj), m_hi = mask(v_hi, t_hi, jj);
        const float m_lo1 = kR > 1 ? m_lo : mask(v_lo, t_lo, jj + 1);
        const float m_hi1 = kR > 1 ? m_hi : mask(v_hi, t_hi, jj + 1);
        gacc[nt][0] *= m_lo;
        gacc[nt][1] *= m_lo1;
        gacc[nt][2] *= m_hi;
        gacc[nt][3] *= m_hi1;
      }
      const uint32_t g0 = pack_bf16(gacc[0][0], gacc[0][1]), g1 = pack_bf16(gacc[0][2], gacc[0][3]);
      const uint32_t g2 = pack_bf16(gacc[1][0], gacc[1][1]), g3 = pack_bf16(gacc[1][2], gacc[1][3]);
      const float* xj = xs + (j0 / kR) * sm.ldx + g;
      const float *x0 = xj + tj0 * sm.ldx, *x1 = xj + tj1 * sm.ldx, *x8 = xj + tj8 * sm.ldx, *x9 = xj + tj9 * sm.ldx;
#pragma unroll
      for (int pt = 0; pt < kMaxPT; ++pt) {
        if (pt < pts) {
          const int p = pt * 8;
          const float w0 = mx0[p], w1 = mx1[p];
          const uint32_t b0 = pack_bf16(x0[p] * w0, x1[p] * w1), b1 = pack_bf16(x8[p] * w0, x9[p] * w1);
          mma_bf16(y[pt], g0, g1, g2, g3, b0, b1);
        }
      }
    }

    // The skip term D xv (in fp32), the optional norm, the gate; then the sum over the rank.
    const float Dh = a.D[h];
    const float* x_lo = xs + t_lo_safe * sm.ldx;
    const float* x_hi = xs + t_hi_safe * sm.ldx;
    const float* z_lo = zs + t_lo_safe * sm.ldx;
    const float* z_hi = zs + t_hi_safe * sm.ldx;
    const float* mx = mxs + r * P;
    const float* mz = mzs + r * P;
    const float* mo = mos + r * P;
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
    const float* onorm = reinterpret_cast<const float*>(base + sm.onorm);
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
        const float2 on = a.out_norm != nullptr ? ld2(onorm + p) : make_float2(1.f, 1.f);
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

template <int kH2, int kR>
void set_limits() {
  // The plan's size depends on the head shape; the limit is the most any shape may use,
  // and chunk_tc_applies keeps shapes whose plan is larger on the general kernels.
  set_chunk_kernel_smem_limit(reinterpret_cast<const void*>(prefill_chunk_state_tc_kernel<kH2, kR>),
                              kMaxSharedBytesPerBlock, "prefill chunk state kernel");
  set_chunk_kernel_smem_limit(reinterpret_cast<const void*>(prefill_chunk_output_tc_kernel<kH2, kR>),
                              kMaxSharedBytesPerBlock, "prefill chunk output kernel");
}

template <int kH2>
void set_limits_every_rank() {
  set_limits<kH2, 1>();
  set_limits<kH2, 2>();
  set_limits<kH2, 4>();
  set_limits<kH2, 8>();
}

template <int kH2, int kR>
void launch_tiles(const ScanParams& prm, bool output, cudaStream_t stream) {
  const dim3 grid(prm.a.runs.n_chunks, prm.a.dims.heads);
  const TcSmem sm = tc_smem(prm.a.dims, output);
  if (output) {
    launch_scan_kernel(prefill_chunk_output_tc_kernel<kH2, kR>, grid, kThreads, sm.bytes, stream, prm.a.pdl, prm, sm);
  } else {
    launch_scan_kernel(prefill_chunk_state_tc_kernel<kH2, kR>, grid, kThreads, sm.bytes, stream, prm.a.pdl, prm, sm);
  }
}

template <int kH2>
void launch_rank(const ScanParams& prm, bool output, cudaStream_t stream) {
  switch (prm.a.dims.rank) {
    case 1: launch_tiles<kH2, 1>(prm, output, stream); break;
    case 2: launch_tiles<kH2, 2>(prm, output, stream); break;
    case 4: launch_tiles<kH2, 4>(prm, output, stream); break;
    case 8: launch_tiles<kH2, 8>(prm, output, stream); break;
    default: throw std::invalid_argument("prefill chunk kernels: mimo_rank " + std::to_string(prm.a.dims.rank) +
                                         " is not 1, 2, 4 or 8");
  }
}

void launch(const ScanParams& prm, bool output, cudaStream_t stream) {
  switch (prm.a.dims.d_state / 32) {
    case 1: launch_rank<1>(prm, output, stream); break;
    case 2: launch_rank<2>(prm, output, stream); break;
    case 3: launch_rank<3>(prm, output, stream); break;
    case 4: launch_rank<4>(prm, output, stream); break;
    default: throw std::invalid_argument("prefill chunk kernels: d_state " + std::to_string(prm.a.dims.d_state) +
                                         " is not a multiple of 32 up to 128");
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void set_chunk_kernel_smem_limit(const void* fn, size_t bytes, const char* name) {
  cudaFuncAttributes attr{};
  M3_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
  if (attr.sharedSizeBytes + bytes > kMaxSharedBytesPerBlock) {
    throw std::runtime_error(std::string(name) + " needs " + std::to_string(attr.sharedSizeBytes + bytes) +
                             " bytes of shared memory per block, over the " +
                             std::to_string(kMaxSharedBytesPerBlock) + "-byte limit");
  }
  allow_dynamic_smem(fn, bytes);
  // The whole carveout as shared memory, so that as many blocks fit an SM as it holds.
  M3_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     static_cast<int>(cudaSharedmemCarveoutMaxShared)));
}

bool chunk_tc_applies(const PrefillScanArgs& a) {
  const PrefillScanDims& d = a.dims;
  if (!(d.precision == ScanPrecision::Bf16TensorCores && a.mimo_rotation && d.d_state % 32 == 0 &&
        d.d_state <= kMaxN && d.headdim % 16 == 0 && d.headdim <= kMaxP && (d.rank == 1 || d.rank == 2 || d.rank == 4 || d.rank == 8) &&
        d.n_angles % 2 == 0)) {
    return false;
  }
  // The staged rows are 16-byte cp.async pieces: rows and offsets of x and z a multiple of
  // four floats, the parameter arrays 16-byte aligned; o is written in pairs.
  const bool rows16 = a.w_stride % 4 == 0 && a.off_x % 4 == 0 && a.off_z % 4 == 0 && aligned16(a.w);
  const bool params16 = aligned16(a.B_bias) && aligned16(a.C_bias) && aligned16(a.mimo_x) && aligned16(a.mimo_z) &&
                        aligned16(a.mimo_o) && (a.out_norm == nullptr || aligned16(a.out_norm));
  const int most = std::max(chunk_tc_smem_bytes(d, true), chunk_tc_smem_bytes(d, false));
  return rows16 && params16 && a.o_stride % 2 == 0 && most <= static_cast<int>(kMaxSharedBytesPerBlock);
}

int chunk_tc_smem_bytes(const PrefillScanDims& d, bool output) { return tc_smem(d, output).bytes; }

void prepare_chunk_tc() {
  set_limits_every_rank<1>();
  set_limits_every_rank<2>();
  set_limits_every_rank<3>();
  set_limits_every_rank<4>();
}

void launch_chunk_state_tc(const ScanParams& prm, cudaStream_t stream) { launch(prm, false, stream); }
void launch_chunk_output_tc(const ScanParams& prm, cudaStream_t stream) { launch(prm, true, stream); }

}  // namespace m3::kernels::prefill_detail
