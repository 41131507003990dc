// The chunk state kernel of the prefill scan (kernel 3 of kernels/prefill_scan.cuh) on
// register fragments, for bf16 operands, MIMO heads and d_state a multiple of 32:
//     dS = Xv^T diag(exp(L_e - L_s) u_s) K
// for one (chunk, head) a block. The block first copies everything it reads into shared
// memory with one batch of cp.async (the chunk's normed B rows in fp16, its x rows and
// mimo_x) and loads the angles' cos and sin and B's bias into fp16 tables, so it waits on
// about one memory round trip; k is then rotated in place in fp16 pair arithmetic (two
// entries an instruction) and stored in bf16, read as the right operand by ldmatrix.trans,
// XvW is built beside it (row-major, read as the transposed left operand by ldmatrix.trans
// too), and eight warps multiply them on mma.sync m16n8k16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/prefill_chunk_tc.cuh"

namespace m3::kernels::prefill_detail::tc {
namespace {

// Where the state kernel's areas lie in its dynamic shared memory (byte offsets), sized from
// the head shape: tokens = kRows / R rows of x and angles.
struct StateSmem {
  int k = 0, xv = 0, x = 0, cos = 0, sin = 0, bias16 = 0, mx = 0;
  int terms = 0;  // L, gamma, u: `tokens` floats each
  int ldx = 0;    // floats between rows of x
  int ldxv = 0;   // bf16 between rows of XvW
  int ldr = 0;    // rotation_table_width
  int bytes = 0;
};

StateSmem state_smem(const PrefillScanDims& d) {
  const int tokens = kRows / d.rank, P = d.headdim, R = d.rank, N = d.d_state;
  StateSmem m;
  m.ldx = P + 8;  // 8 words past a multiple of 32 for P a multiple of 16: the Xv reads spread over the banks
  m.ldxv = P + 8;  // rows 4 words apart modulo 32: ldmatrix reads are free of bank conflicts
  m.ldr = rotation_table_width(d.n_angles);
  SmemPlan plan;
  m.k = plan.take(2 * kRows * kLdK);
  m.xv = plan.take(2 * kRows * m.ldxv);
  m.x = plan.take(4 * tokens * m.ldx);
  m.cos = plan.take(2 * tokens * m.ldr);
  m.sin = plan.take(2 * tokens * m.ldr);
  m.bias16 = plan.take(2 * R * N);
  m.mx = plan.take(4 * R * P);
  m.terms = plan.take(4 * 3 * tokens);
  m.bytes = plan.bytes();
  return m;
}

// The rows and vectors the block of (chunk cp, head h) reads, into shared memory by cp.async
// (one commit group).
__device__ __forceinline__ void stage_chunk(const PrefillScanArgs& a, const StateSmem& sm, const ChunkPlace& cp, int h,
                                            unsigned char* base) {
  const int P = a.dims.headdim, N = a.dims.d_state, R = a.dims.rank;
  const int tokens = kRows / R;
  const int64_t row_floats = a.w_stride;
  copy_rows(base + sm.k, 2 * kLdK, a.ws.b_norm_h + (int64_t)cp.first * R * N, 2 * N, kRows, cp.len * R, 2 * N);
  copy_rows(base + sm.x, 4 * sm.ldx, a.w + cp.first * row_floats + a.off_x + h * P, 4 * row_floats, tokens, cp.len,
            4 * P);
  copy_rows(base + sm.mx, 0, a.mimo_x + (int64_t)h * R * P, 0, 1, 1, 4 * R * P);
  cp_async_commit();
}

// The slot's state of one head for a run that is a single chunk, where this kernel does the
// state pass's work (ScanParams::whole_runs_in_state_kernel).
struct WholeRunHead {
  float* ssm;                 // [P][N] fp32, or bf16 (ssm_bf16) at the same address
  bool ssm_bf16;
  const float* x_prev;        // [P]
  const float* k_prev;        // [R][N], the parity's half
  __nv_bfloat16* state_in;    // the chunk's S~ [P][N], for the output kernel
  float nb, decay;            // the previous token's weight at the run's first step; the chunk's decay
};

// Entries (p, n) and (p, n + 1): S~ = ssm + nb x_prev[p] sum_r mimo_x[r][p] k_prev[r][n],
// stored for the output kernel, and the new state decay * S~ + dS. The same operations in
// the same order and roundings as prefill_state_pass_kernel over a run of one chunk (dS
// rounded to bf16 as it would be stored for the pass), so either path gives the same bits.
__device__ __forceinline__ void finish_whole_run_pair(const WholeRunHead& w, const float* mx, int R, int P, int N, int p,
                                                      int n, float d0, float d1) {
  const int64_t at = (int64_t)p * N + n;
  float s0, s1;
  if (w.ssm_bf16) {
    const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(reinterpret_cast<const __nv_bfloat16*>(w.ssm) + at);
    s0 = __low2float(v);
    s1 = __high2float(v);
  } else {
    const float2 v = *reinterpret_cast<const float2*>(w.ssm + at);
    s0 = v.x;
    s1 = v.y;
  }
  const float xp = w.x_prev[p];
  for (int r = 0; r < R; ++r) {
    const float coef = w.nb * (xp * mx[r * P + p]);
    s0 = fmaf(coef, w.k_prev[r * N + n], s0);
    s1 = fmaf(coef, w.k_prev[r * N + n + 1], s1);
  }
  store_pair(w.state_in + at, s0, s1);
  const __nv_bfloat162 d = __floats2bfloat162_rn(d0, d1);
  s0 = fmaf(w.decay, s0, __low2float(d));
  s1 = fmaf(w.decay, s1, __high2float(d));
  if (w.ssm_bf16) {
    store_pair(reinterpret_cast<__nv_bfloat16*>(w.ssm) + at, s0, s1);
  } else {
    store_pair(w.ssm + at, s0, s1);
  }
}

// dS[p][n] = sum_j XvW[j][p] K[j][n]; warp w takes rows p of tile w % (P/16) and the 64
// columns n of group w / (P/16). kWholeRuns: every run of the call is this one chunk, and
// the block finishes its head's state (finish_whole_run_pair) instead of storing dS.
template <int kH2, int kR, bool kWholeRuns>
__global__ void __launch_bounds__(kThreads) prefill_chunk_state_tc_kernel(const ScanParams prm, const StateSmem sm) {
  constexpr int kN = kH2 * 32, R = kR;
  const PrefillScanArgs& a = prm.a;
  const int c = blockIdx.x, h = blockIdx.y;
  const int H = a.dims.heads, P = a.dims.headdim;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, cq = lane & 3;
  extern __shared__ float4 smem4[];
  unsigned char* base = reinterpret_cast<unsigned char*>(smem4);
  const __nv_bfloat16* ks = reinterpret_cast<const __nv_bfloat16*>(base + sm.k);  // [rows][kLdK]
  const __nv_bfloat16* xvw = reinterpret_cast<const __nv_bfloat16*>(base + sm.xv);  // [rows][ldxv]

  const ChunkPlace cp = chunk_place(a, c, kRows / R);
  const int m = cp.len * R, m16 = (m + 15) & ~15;
  // The previous kernel is the angles kernel where there are angles, else the token-params
  // kernel: with angles only their cos and sin wait for it (the B and x rows and the token
  // terms are two kernels back or older, complete once this kernel runs); without, all does.
  const bool angles_before = a.dims.n_angles > 0;
  if (angles_before) {
    stage_chunk(a, sm, cp, h, base);
    stage_token_terms(a, cp, h, reinterpret_cast<float*>(base + sm.terms));
  }
  wait_for_previous_kernel();
  allow_next_kernel();
  if (!angles_before) {
    stage_chunk(a, sm, cp, h, base);
    stage_token_terms(a, cp, h, reinterpret_cast<float*>(base + sm.terms));
  }
  load_rotation_tables<kRows / kR, kN>(a, cp, h, reinterpret_cast<uint32_t*>(base + sm.cos),
                                       reinterpret_cast<uint32_t*>(base + sm.sin),
                                       reinterpret_cast<uint2*>(base + sm.bias16), sm.ldr, false);
  cp_async_wait<0>();
  __syncthreads();  // the staged rows and the token terms are in
  // k in bf16, the type of XvW, its left operand.
  rotate_k_in_place<kH2, kR, true>(reinterpret_cast<__half*>(base + sm.k),
                                   reinterpret_cast<const __half*>(base + sm.bias16),
                                   reinterpret_cast<const __half*>(base + sm.cos),
                                   reinterpret_cast<const __half*>(base + sm.sin), sm.ldr, m);
  // XvW [rows][p]: each row's x_t[p] mimo_x[r][p] times its token's chunk-end weight
  // exp(L_e - L_t) u_t; rows past the chunk's tokens zeros.
  {
    const float* L = reinterpret_cast<const float*>(base + sm.terms);
    const float* u = L + 2 * (kRows / kR);
    const float l_end = L[cp.len - 1];
    const int len = cp.len;
    build_token_rows<kR>(reinterpret_cast<const float*>(base + sm.x), sm.ldx, reinterpret_cast<const float*>(base + sm.mx),
                         P, P, reinterpret_cast<__nv_bfloat16*>(base + sm.xv), sm.ldxv,
                         [&](int t) { return t < len ? exp_fast(l_end - L[t]) * u[t] : 0.f; });
  }
  __syncthreads();  // k and XvW are in

  const int p_tiles = P / 16, jobs = p_tiles * ((kN + 63) / 64);
  __nv_bfloat16* delta = static_cast<__nv_bfloat16*>(a.ws.chunk_delta) + ((int64_t)c * H + h) * P * kN;
  WholeRunHead whole{};
  if constexpr (kWholeRuns) {
    const int run = cp.run, parity = a.runs.parity[run] & 1;
    float* st = a.state + a.runs.slot[run] * a.slot_stride + a.layer_offset;
    // A bf16 ssm part: the head's rows start h * P * N bf16 values (half as many floats) in.
    whole.ssm = st + prm.layout.ssm + (prm.layout.ssm_bf16 ? (int64_t)h * P * kN / 2 : (int64_t)h * P * kN);
    whole.ssm_bf16 = prm.layout.ssm_bf16;
    whole.x_prev = st + prm.layout.x_prev + h * P;
    whole.k_prev = st + prm.layout.k_prev + (int64_t)parity * H * R * kN + (int64_t)h * R * kN;
    whole.state_in = static_cast<__nv_bfloat16*>(a.ws.chunk_state_in) + ((int64_t)c * H + h) * P * kN;
    whole.nb = a.ws.tok_bterm[(int64_t)cp.first * H + h];
    whole.decay = expf(reinterpret_cast<const float*>(base + sm.terms)[cp.len - 1]);
  }
  for (int job = warp; job < jobs; job += kThreads / 32) {
    const int pt = job % p_tiles, ng = job / p_tiles;
    const int nts = min(8, kN / 8 - ng * 8);  // 8-column tiles of this group (4 when N is 32 or 96's last)
    float acc[8][4] = {};
    // The A fragment of rows p (pt's 16) and columns j0..j0+15 is one ldmatrix.x4.trans of
    // XvW: its matrices are rows j0.. at p0 and p0 + 8, then rows j0 + 8.. at p0 and p0 + 8.
    const __nv_bfloat16* a_row =
        xvw + ((lane & 7) + 8 * (lane >> 4)) * sm.ldxv + pt * 16 + 8 * ((lane >> 3) & 1);
    // Matrices of the trans x4: rows j0.. and j0+8.. of column tiles nt and nt + 1.
    const __nv_bfloat16* b_row = ks + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kLdK + ng * 64 + 8 * (lane >> 4);
#pragma unroll
    for (int j0 = 0; j0 < kRows; j0 += 16) {
      if (j0 < m16) {
        uint32_t af[4];
        ldmatrix_x4_trans(af, a_row + j0 * sm.ldxv);
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
        if constexpr (kWholeRuns) {
          const float* mx = reinterpret_cast<const float*>(base + sm.mx);
          finish_whole_run_pair(whole, mx, R, P, kN, p, n, acc[nt][0], acc[nt][1]);
          finish_whole_run_pair(whole, mx, R, P, kN, p + 8, n, acc[nt][2], acc[nt][3]);
        } else {
          store_pair(delta + (int64_t)p * kN + n, acc[nt][0], acc[nt][1]);
          store_pair(delta + (int64_t)(p + 8) * kN + n, acc[nt][2], acc[nt][3]);
        }
      }
    }
  }
  if (threadIdx.x == 0) a.ws.chunk_decay[(int64_t)c * H + h] = expf(reinterpret_cast<const float*>(base + sm.terms)[cp.len - 1]);
}

}  // namespace

int chunk_state_tc_smem_bytes(const PrefillScanDims& d) { return state_smem(d).bytes; }

void prepare_chunk_state_tc() {
  set_every_shape_smem_limit([&]<int kH2, int kR>() { return prefill_chunk_state_tc_kernel<kH2, kR, false>; },
                             "prefill chunk state kernel");
  set_every_shape_smem_limit([&]<int kH2, int kR>() { return prefill_chunk_state_tc_kernel<kH2, kR, true>; },
                             "prefill chunk state kernel (whole runs)");
}

}  // namespace m3::kernels::prefill_detail::tc

namespace m3::kernels::prefill_detail {

void launch_chunk_state_tc(const ScanParams& prm, cudaStream_t stream) {
  if (prm.whole_runs_in_state_kernel) {
    tc::launch_chunk_kernel(prm, tc::state_smem(prm.a.dims), stream,
                            [&]<int kH2, int kR>() { return tc::prefill_chunk_state_tc_kernel<kH2, kR, true>; });
  } else {
    tc::launch_chunk_kernel(prm, tc::state_smem(prm.a.dims), stream,
                            [&]<int kH2, int kR>() { return tc::prefill_chunk_state_tc_kernel<kH2, kR, false>; });
  }
}

}  // namespace m3::kernels::prefill_detail
