// The chunk output kernel of the prefill scan (kernel 5 of kernels/prefill_scan.cuh) on
// register fragments, for bf16-weight engines, MIMO heads and d_state a multiple of 32:
//     y = exp(L) .* (Q S~^T) + ((Q K^T) .* M) Xv + D Xv
// then the gate, the optional grouped RMSNorm and mimo_o into o, for one (chunk, head) a
// block of eight warps, each warp 16 (token, rank) rows.
//
// What a block does, in order:
//   1. copies most of what it reads into shared memory with one batch of cp.async (the
//      chunk's normed B rows in fp16, its x and z rows, the mimo vectors) while its lanes
//      load their normed C rows (fp16) straight into A-fragment registers and the angles'
//      cos and sin and both biases into fp16 tables; S~, the state pass's, is copied after
//      the wait for that kernel;
//   2. rotates k in place and q in its registers in fp16 pair arithmetic (two entries an
//      instruction): Q K^T runs on fp16 operands (2^-11 relative, finer than bf16's 2^-8);
//      meanwhile the mask M[t][s] becomes a table (tokens x tokens, at most 32 tokens a
//      chunk);
//   3. builds Xv = x .* mimo_x in bf16 over the dead tables, read by ldmatrix.trans as the
//      right operand of G Xv, while the warps compute Q S~^T (q converted to bf16 a fragment
//      at a time, S~ being bf16);
//   4. each warp walks the 16-column tiles of G up to the diagonal: Q K^T, times M, packed to
//      bf16 in place (two m16n8 accumulator tiles side by side are one A fragment), times Xv;
//      then adds D Xv, applies the norm and the gate, and sums its rows over the rank.
// Why: done per element in fp32 inside the loop over G's tiles, the rotations, Xv and the
// mask cost several instructions an entry; the tables and the fp16 pairs take most of that
// work out of the loop and halve what is left.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/prefill_chunk_tc.cuh"

namespace m3::kernels::prefill_detail::tc {
namespace {

// Where the output kernel's areas lie in its dynamic shared memory (byte offsets), sized from
// the head shape: tokens = kRows / R rows of x, z and angles. The fp16 tables of the
// rotations are dead once q and k are rotated; Xv is built over them.
struct OutputSmem {
  int k = 0, s = 0, x = 0, z = 0;
  int cos = 0, sin = 0, bias16 = 0;  // the rotations' tables (biases: B's, then C's)
  int xv = 0;                        // over the rotations' tables
  int mx = 0, mz = 0, mo = 0, onorm = 0, mask = 0, terms = 0;
  int ldx = 0;   // floats between rows of x and z
  int ldr = 0;   // rotation_table_width
  int ldxv = 0;  // bf16 between rows of Xv
  int ldm = 0;   // floats between rows of the mask table (0: no table)
  int ldv = 0;   // floats between the rank rows of mimo_x, mimo_z and mimo_o
  int bytes = 0;
};

bool mask_table(int rank) { return kRows / rank <= 32; }

OutputSmem output_smem(const PrefillScanDims& d) {
  const int tokens = kRows / d.rank, P = d.headdim, R = d.rank, N = d.d_state, S = d.n_angles;
  OutputSmem m;
  m.ldx = P + 8;  // 8 words past a multiple of 32 for P a multiple of 16: the Xv reads spread over the banks
  m.ldr = rotation_table_width(S);
  m.ldxv = P + 8;  // rows 4 words apart modulo 32: ldmatrix reads are free of bank conflicts
  // At rank 4 a G tile's lanes read the table at tokens t, t + 1 and columns s, s + 1: with
  // rows tokens + 1 = 33 words apart (t + 1, s) shared a bank with (t, s + 1); 34 puts the
  // four on four banks.
  m.ldm = mask_table(R) ? tokens + 2 : 0;
  // 8 words past a multiple of 32: the epilogue's lanes of a token's R ranks read R rows at
  // once, which P apart (a multiple of 32 words) sat on the same banks.
  m.ldv = P + 8;
  SmemPlan plan;
  m.k = plan.take(2 * kRows * kLdK);
  m.s = plan.take(2 * P * kLdS);
  m.x = plan.take(4 * tokens * m.ldx);
  m.z = plan.take(4 * tokens * m.ldx);
  SmemPlan rotation;
  const int cos = rotation.take(2 * tokens * m.ldr), sin = rotation.take(2 * tokens * m.ldr);
  const int bias16 = rotation.take(2 * 2 * R * N);
  m.xv = plan.take(std::max(rotation.bytes(), 2 * kRows * m.ldxv));
  m.cos = m.xv + cos;
  m.sin = m.xv + sin;
  m.bias16 = m.xv + bias16;
  m.mx = plan.take(4 * R * m.ldv);
  m.mz = plan.take(4 * R * m.ldv);
  m.mo = plan.take(4 * R * m.ldv);
  m.onorm = plan.take(4 * P);
  if (m.ldm > 0) m.mask = plan.take(4 * tokens * m.ldm);
  m.terms = plan.take(4 * 3 * tokens);
  m.bytes = plan.bytes();
  return m;
}

// The rows and vectors the block of (chunk cp, head h) reads, into shared memory by
// cp.async (one commit group).
__device__ __forceinline__ void stage_chunk(const PrefillScanArgs& a, const OutputSmem& sm, const ChunkPlace& cp, int h,
                                            unsigned char* base) {
  const int P = a.dims.headdim, N = a.dims.d_state, R = a.dims.rank;
  const int tokens = kRows / R;
  const int64_t row_floats = a.w_stride;
  copy_rows(base + sm.k, 2 * kLdK, a.ws.b_norm_h + (int64_t)cp.first * R * N, 2 * N, kRows, cp.len * R, 2 * N);
  copy_rows(base + sm.x, 4 * sm.ldx, a.w + cp.first * row_floats + a.off_x + h * P, 4 * row_floats, tokens, cp.len,
            4 * P);
  copy_rows(base + sm.z, 4 * sm.ldx, a.w + cp.first * row_floats + a.off_z + h * P, 4 * row_floats, tokens, cp.len,
            4 * P);
  copy_rows(base + sm.mx, 4 * sm.ldv, a.mimo_x + (int64_t)h * R * P, 4 * P, R, R, 4 * P);
  copy_rows(base + sm.mz, 4 * sm.ldv, a.mimo_z + (int64_t)h * R * P, 4 * P, R, R, 4 * P);
  copy_rows(base + sm.mo, 4 * sm.ldv, a.mimo_o + (int64_t)h * R * P, 4 * P, R, R, 4 * P);
  if (a.out_norm != nullptr) copy_rows(base + sm.onorm, 0, a.out_norm + h * P, 0, 1, 1, 4 * P);
  cp_async_commit();
}

// A lane's kKept column tiles (k R + r) of its two rows' sums, at o + o_lo and o + o_hi.
template <int kKept, int R, bool kFullP, typename T>
__device__ __forceinline__ void store_token_rows(T* o, int64_t o_lo, int64_t o_hi, const float (&y)[kMaxPT][4], int r,
                                                 int pts, bool v_lo, bool v_hi) {
#pragma unroll
  for (int k = 0; k < kKept; ++k) {
    if (kFullP || k * R + r < pts) {
      if (v_lo) store_pair(o + o_lo + k * R * 8, y[k][0], y[k][1]);
      if (v_hi) store_pair(o + o_hi + k * R * 8, y[k][2], y[k][3]);
    }
  }
}

// M[t][s]: gamma_t on the diagonal, exp(L_t - L_s) u_s below it, zeros above it and past the
// chunk's tokens.
__device__ __forceinline__ void build_mask_table(unsigned char* base, const OutputSmem& sm, int tokens, int len) {
  const float* L = reinterpret_cast<const float*>(base + sm.terms);
  const float *gam = L + tokens, *u = gam + tokens;
  float* mask = reinterpret_cast<float*>(base + sm.mask);
  for (int idx = threadIdx.x; idx < tokens * tokens; idx += kThreads) {
    const int t = idx / tokens, s = idx - t * tokens;
    float v = 0.f;
    if (t < len && s <= t) v = s == t ? gam[t] : exp_fast(L[t] - L[s]) * u[s];
    mask[t * sm.ldm + s] = v;
  }
}

// The row's q entries after bias and rotation, in place, as fp16 pairs. A row past the chunk's
// tokens keeps its bias: only its own outputs see it (G's row and y's row), and those are
// never stored.
template <int kH2>
__device__ __forceinline__ void rotate_q_row(uint32_t (&raw)[2][kH2][2], const __half* bias, const __half* cs,
                                             const __half* sn, int ldr, int c) {
  constexpr int kHalf = kH2 * 16;
#pragma unroll
  for (int kt = 0; kt < kH2; ++kt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int n = kt * 16 + 2 * c + 8 * hf;
      __half2 x0 = __hadd2(bits_half2(raw[0][kt][hf]), *reinterpret_cast<const __half2*>(bias + n));
      __half2 x1 = __hadd2(bits_half2(raw[1][kt][hf]), *reinterpret_cast<const __half2*>(bias + n + kHalf));
      if (n < ldr) {
        __half2 v0, v1;
        rotate_h2(x0, x1, *reinterpret_cast<const __half2*>(cs + n), *reinterpret_cast<const __half2*>(sn + n), v0,
                  v1);
        x0 = v0;
        x1 = v1;
      }
      raw[0][kt][hf] = half2_bits(x0);
      raw[1][kt][hf] = half2_bits(x1);
    }
  }
}

// mimo_o[r][p] *= out_norm[p]: the norm's weight and mimo_o scale the same entries, so the
// epilogue takes one product for both.
__device__ __forceinline__ void fold_norm_into_mo(unsigned char* base, const OutputSmem& sm, int entries, int P) {
  float* mo = reinterpret_cast<float*>(base + sm.mo);
  const float* onorm = reinterpret_cast<const float*>(base + sm.onorm);
  for (int i = threadIdx.x; i < entries; i += kThreads) {
    const int r = div_small(i, P), p = i - r * P;
    mo[r * sm.ldv + p] *= onorm[p];
  }
}

template <int kH2, int kR>
__global__ void __launch_bounds__(kThreads, 2) prefill_chunk_output_tc_kernel(const ScanParams prm, const OutputSmem sm) {
  constexpr int kN = kH2 * 32, R = kR, kTokens = kRows / kR;
  constexpr bool kMaskTable = kTokens <= 32;
  const PrefillScanArgs& a = prm.a;
  const int c = blockIdx.x, h = blockIdx.y;
  const int H = a.dims.heads, P = a.dims.headdim;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, cq = lane & 3;
  extern __shared__ float4 smem4[];
  unsigned char* base = reinterpret_cast<unsigned char*>(smem4);
  const __half* ks = reinterpret_cast<const __half*>(base + sm.k);                // [rows][kLdK]
  __nv_bfloat16* ss = reinterpret_cast<__nv_bfloat16*>(base + sm.s);              // [P][kLdS]
  const __nv_bfloat16* xv = reinterpret_cast<const __nv_bfloat16*>(base + sm.xv);  // [rows][ldxv]
  const float* xs = reinterpret_cast<const float*>(base + sm.x);                  // [tokens][ldx]
  const float* zs = reinterpret_cast<const float*>(base + sm.z);
  const float* mxs = reinterpret_cast<const float*>(base + sm.mx);                // [R][ldv]
  const float* mzs = reinterpret_cast<const float*>(base + sm.mz);
  const float* mos = reinterpret_cast<const float*>(base + sm.mo);
  const float* mask = reinterpret_cast<const float*>(base + sm.mask);             // [tokens][ldm]
  float* L = reinterpret_cast<float*>(base + sm.terms);
  const float* gam = L + kTokens;
  const float* u = gam + kTokens;

  const ChunkPlace cp = chunk_place(a, c, kTokens);
  const int m = cp.len * R;
  stage_chunk(a, sm, cp, h, base);

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
  load_rotation_tables<kTokens, kN>(a, cp, h, reinterpret_cast<uint32_t*>(base + sm.cos),
                                    reinterpret_cast<uint32_t*>(base + sm.sin), reinterpret_cast<uint2*>(base + sm.bias16),
                                    sm.ldr, true);
  stage_token_terms(a, cp, h, L);
  // All of the above is two kernels back or older; S~ is the state pass's.
  wait_for_previous_kernel();
  allow_next_kernel();
  copy_rows(reinterpret_cast<unsigned char*>(ss), 2 * kLdS,
            static_cast<const __nv_bfloat16*>(a.ws.chunk_state_in) + ((int64_t)c * H + h) * P * kN, 2 * kN, P, P,
            2 * kN);
  cp_async_wait<0>();
  __syncthreads();  // S~, the staged rows, the rotation tables and the token terms are in

  if constexpr (kMaskTable) build_mask_table(base, sm, kTokens, cp.len);
  // The right operand of Q K^T, a row per column, in fp16.
  rotate_k_in_place<kH2, kR, false>(reinterpret_cast<__half*>(base + sm.k),
                                    reinterpret_cast<const __half*>(base + sm.bias16),
                                    reinterpret_cast<const __half*>(base + sm.cos),
                                    reinterpret_cast<const __half*>(base + sm.sin), sm.ldr, m);
  // q stays in registers: qf[hh][kt] is the A fragment of column tile hh * H2 + kt.
  uint32_t qf[2][kH2][4];
  {
    const __half* bias_q = reinterpret_cast<const __half*>(base + sm.bias16) + (R + r) * kN;
    const __half* cs = reinterpret_cast<const __half*>(base + sm.cos);
    const __half* sn = reinterpret_cast<const __half*>(base + sm.sin);
    rotate_q_row<kH2>(qlo, bias_q, cs + t_lo_safe * sm.ldr, sn + t_lo_safe * sm.ldr, sm.ldr, cq);
    rotate_q_row<kH2>(qhi, bias_q, cs + t_hi_safe * sm.ldr, sn + t_hi_safe * sm.ldr, sm.ldr, cq);
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
  __syncthreads();  // k and the mask are in; the rotation tables are dead

  // Xv [rows][p] = x_t[p] mimo_x[r][p] (rows past the chunk's tokens zeros, as their staged x
  // rows are).
  build_token_rows<kR>(reinterpret_cast<const float*>(base + sm.x), sm.ldx, reinterpret_cast<const float*>(base + sm.mx),
                       sm.ldv, P, reinterpret_cast<__nv_bfloat16*>(base + sm.xv), sm.ldxv, [](int) { return 1.f; });
  if (a.out_norm != nullptr) fold_norm_into_mo(base, sm, R * P, P);
  const bool active = row0 < m;
  const int pts = P / 8;
  float y[kMaxPT][4] = {};
  if (active) {
    // What the chunk inherits: exp(L_t) q_t . S~.
    q_times_rows<kH2, kMaxPT, Operands::F16AsBf16>(y, qf, ss, kLdS, pts);
    const float e_lo = v_lo ? exp_fast(L[t_lo]) : 0.f, e_hi = v_hi ? exp_fast(L[t_hi]) : 0.f;
#pragma unroll
    for (int pt = 0; pt < kMaxPT; ++pt) {
      y[pt][0] *= e_lo; y[pt][1] *= e_lo; y[pt][2] *= e_hi; y[pt][3] *= e_hi;
    }
  }
  __syncthreads();  // Xv is in

  // Matrices of the trans x4: rows j0.. and j0+8.. of column tiles pt and pt + 1 of Xv.
  const __nv_bfloat16* xv_row = xv + ((lane & 7) + 8 * ((lane >> 3) & 1)) * sm.ldxv + 8 * (lane >> 4);
  // The chunk's own tokens, 16 columns of G at a time up to the diagonal, then the epilogue;
  // kFullP (headdim kMaxP, the common case) keeps the tile tests out of the code.
  auto finish = [&](auto full_p) {
    constexpr bool kFullP = decltype(full_p)::value;
    // M[i][j]: gamma_t on the diagonal token, exp(L_t - L_s) u_s below it. Columns jj and
    // jj + 1 share their token when R > 1 (jj even), and then their factors.
    auto mask_of = [&](bool row_ok, int t, int jj) {
      const int s = jj / kR;
      if constexpr (kMaskTable) {
        return mask[t * sm.ldm + s];
      } else {
        if (!row_ok || jj >= m || s > t) return 0.f;
        return s == t ? gam[t] : exp_fast(L[t] - L[s]) * u[s];
      }
    };
    // kTiles 16-column tiles of G from column j0: Q K^T, times M, packed to bf16 in place (two
    // m16n8 accumulator tiles side by side are one A fragment), times Xv. Two tiles at a time
    // give Q K^T four independent accumulator chains instead of two.
    auto g_tiles = [&]<int kTiles>(int j0) {
      float gacc[2 * kTiles][4] = {};
      q_times_rows<kH2, 2 * kTiles, Operands::F16>(gacc, qf, ks + j0 * kLdK, kLdK, 2 * kTiles);
#pragma unroll
      for (int nt = 0; nt < 2 * kTiles; ++nt) {
        const int jj = j0 + nt * 8 + 2 * cq;
        const float m_lo = mask_of(v_lo, t_lo, jj), m_hi = mask_of(v_hi, t_hi, jj);
        const float m_lo1 = kR > 1 ? m_lo : mask_of(v_lo, t_lo, jj + 1);
        const float m_hi1 = kR > 1 ? m_hi : mask_of(v_hi, t_hi, jj + 1);
        gacc[nt][0] *= m_lo;
        gacc[nt][1] *= m_lo1;
        gacc[nt][2] *= m_hi;
        gacc[nt][3] *= m_hi1;
      }
#pragma unroll
      for (int tile = 0; tile < kTiles; ++tile) {
        const float(&lo)[4] = gacc[2 * tile];
        const float(&hi)[4] = gacc[2 * tile + 1];
        const uint32_t g0 = pack_bf16(lo[0], lo[1]), g1 = pack_bf16(lo[2], lo[3]);
        const uint32_t g2 = pack_bf16(hi[0], hi[1]), g3 = pack_bf16(hi[2], hi[3]);
        const __nv_bfloat16* xv_j = xv_row + (j0 + 16 * tile) * sm.ldxv;
#pragma unroll
        for (int pt = 0; pt < kMaxPT; pt += 2) {
          if (kFullP || pt < pts) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, xv_j + pt * 8);
            mma_bf16(y[pt], g0, g1, g2, g3, b[0], b[1]);
            mma_bf16(y[pt + 1], g0, g1, g2, g3, b[2], b[3]);
          }
        }
      }
    };
    // Warp w's rows need tiles 0..w: pairs, then the last alone when w is even.
    int jt = 0;
    for (; jt < warp; jt += 2) g_tiles.template operator()<2>(jt * 16);
    if (jt == warp) g_tiles.template operator()<1>(jt * 16);

    // The skip term D xv (in fp32), the optional norm, the gate; then the sum over the rank.
    // Rows past the chunk's tokens read token 0's x and z (t_safe) and are never stored; a
    // token's rows are all valid or none, so their sums stay among themselves and nothing
    // here tests them.
    const float Dh = a.D[h];
    const float* x_lo = xs + t_lo_safe * sm.ldx;
    const float* x_hi = xs + t_hi_safe * sm.ldx;
    const float* z_lo = zs + t_lo_safe * sm.ldx;
    const float* z_hi = zs + t_hi_safe * sm.ldx;
    const float* mx = mxs + r * sm.ldv;
    const float* mz = mzs + r * sm.ldv;
    const float* mo = mos + r * sm.ldv;
#pragma unroll
    for (int pt = 0; pt < kMaxPT; ++pt) {
      if (kFullP || pt < pts) {
        const int p = pt * 8 + 2 * cq;
        const float2 m2 = ld2(mx + p), xl = ld2(x_lo + p), xh = ld2(x_hi + p);
        y[pt][0] += Dh * (xl.x * m2.x);
        y[pt][1] += Dh * (xl.y * m2.y);
        y[pt][2] += Dh * (xh.x * m2.x);
        y[pt][3] += Dh * (xh.y * m2.y);
      }
    }
    if (a.out_norm != nullptr) {  // its weight is in mo; a row's p are spread over the four lanes of its g
      float ss_lo = 0.f, ss_hi = 0.f;
#pragma unroll
      for (int pt = 0; pt < kMaxPT; ++pt) {
        if (kFullP || pt < pts) {
          ss_lo += y[pt][0] * y[pt][0] + y[pt][1] * y[pt][1];
          ss_hi += y[pt][2] * y[pt][2] + y[pt][3] * y[pt][3];
        }
      }
      ss_lo += __shfl_xor_sync(0xffffffffu, ss_lo, 1);
      ss_lo += __shfl_xor_sync(0xffffffffu, ss_lo, 2);
      ss_hi += __shfl_xor_sync(0xffffffffu, ss_hi, 1);
      ss_hi += __shfl_xor_sync(0xffffffffu, ss_hi, 2);
      const float rs_lo = rsqrtf(ss_lo / P + a.norm_eps), rs_hi = rsqrtf(ss_hi / P + a.norm_eps);
#pragma unroll
      for (int pt = 0; pt < kMaxPT; ++pt) {
        y[pt][0] *= rs_lo; y[pt][1] *= rs_lo; y[pt][2] *= rs_hi; y[pt][3] *= rs_hi;
      }
    }
#pragma unroll
    for (int pt = 0; pt < kMaxPT; ++pt) {
      if (kFullP || pt < pts) {
        const int p = pt * 8 + 2 * cq;
        const float2 zl = ld2(z_lo + p), zh = ld2(z_hi + p), z2 = ld2(mz + p), o2 = ld2(mo + p);
        y[pt][0] *= silu_fast(zl.x * z2.x) * o2.x;
        y[pt][1] *= silu_fast(zl.y * z2.y) * o2.y;
        y[pt][2] *= silu_fast(zh.x * z2.x) * o2.x;
        y[pt][3] *= silu_fast(zh.y * z2.y) * o2.y;
      }
    }
    // A token's R rows are the lanes whose g differ in their low log2(R) bits (lane bits 2..).
    // Each halving step keeps the tiles whose bit matches the lane's rank bit and adds the
    // partner's copy of them, so after log2(R) steps a lane holds the sums of tiles
    // pt = k R + r: half the shuffles of summing every tile in every lane.
#pragma unroll
    for (int s = 0; s < 3; ++s) {
      if ((1 << s) < R) {
        const bool bit = (r >> s) & 1;
#pragma unroll
        for (int q = 0; q < (kMaxPT >> (s + 1)); ++q) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            // Through scalars: a conditional over the array's entries became a select of
            // addresses, and the array went to local memory.
            const float even = y[2 * q][e], odd = y[2 * q + 1][e];
            y[q][e] = (bit ? odd : even) + __shfl_xor_sync(0xffffffffu, bit ? even : odd, 4 << s);
          }
        }
      }
    }
    // y[k] is column tile k R + r of the token's sum; the row's entries lie at fixed offsets
    // from one pointer a row.
    constexpr int kKept = kMaxPT / R;
    const int64_t o_lo = (int64_t)(cp.first + t_lo_safe) * a.o_stride + h * P + r * 8 + 2 * cq;
    const int64_t o_hi = (int64_t)(cp.first + t_hi_safe) * a.o_stride + h * P + r * 8 + 2 * cq;
    if (a.o_bf16) {
      store_token_rows<kKept, R, kFullP>(static_cast<__nv_bfloat16*>(a.o), o_lo, o_hi, y, r, pts, v_lo, v_hi);
    } else {
      store_token_rows<kKept, R, kFullP>(static_cast<float*>(a.o), o_lo, o_hi, y, r, pts, v_lo, v_hi);
    }
  };
  if (active) {
    if (pts == kMaxPT) {
      finish(std::true_type{});
    } else {
      finish(std::false_type{});
    }
  }
  if (cp.first + cp.len == cp.run_end) write_last_token_prev(prm, cp, h, kThreads);
}

}  // namespace

int chunk_output_tc_smem_bytes(const PrefillScanDims& d) { return output_smem(d).bytes; }

void prepare_chunk_output_tc() {
  set_every_shape_smem_limit([&]<int kH2, int kR>() { return prefill_chunk_output_tc_kernel<kH2, kR>; },
                             "prefill chunk output kernel");
}

}  // namespace m3::kernels::prefill_detail::tc

namespace m3::kernels::prefill_detail {

void launch_chunk_output_tc(const ScanParams& prm, cudaStream_t stream) {
  tc::launch_chunk_kernel(prm, tc::output_smem(prm.a.dims), stream,
                          [&]<int kH2, int kR>() { return tc::prefill_chunk_output_tc_kernel<kH2, kR>; });
}

}  // namespace m3::kernels::prefill_detail
