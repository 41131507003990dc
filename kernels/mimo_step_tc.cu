// The MIMO step (same contract as mimo_step.cu) with the state update and the y
// projection on tensor cores, for engines whose weights are bf16.
//
// Why: the CUDA-core kernel issues about 13 dependent fp32 FMAs per state element (the
// rank-2R update and the R output sums) plus the address and reduction work around them;
// Nsight Compute showed it bound by its instruction stream (31% of DRAM bandwidth at
// batch 64). Per head both products are small matrix products:
//   ssm' = alpha * ssm + [gamma*xv | beta*xs] (P x 2R)  .  [k ; k_prev] (2R x N)
//   y    = ssm' (P x N)  .  q^T (N x R)
// With R = 4 the update's inner dimension is exactly the 8 of mma.m16n8k8 (tf32), so one
// mma replaces 16 x 8 x 8 FMAs, and the updated state goes from the update's accumulator
// registers straight into the y product's A fragment: a dot product does not care in which
// order its terms come, so each lane's two accumulator columns are fed to the two k slots
// it owns, with q read in the same order.
//
// Precision: operands are rounded to tf32 (10-bit mantissa, relative error <= 2^-11; the
// updated state enters y truncated, <= 2^-10); products are exact and accumulate in fp32,
// and the state itself stays fp32 (alpha * ssm is an fp32 multiply). That is finer than
// the bf16 weights feeding these values (2^-9), which is why only bf16-weight engines use
// this kernel; fp32 engines keep the CUDA-core kernel. With state_dtype bf16 the state is
// rounded to bf16 as it is stored (and so only this kernel stores bf16 state).
//
// Layout: one block per (head, batch entry); warp w takes 16 state rows (row tile w % RT)
// and a 1/CS share of the N columns. Each lane keeps, per 16-column group m, columns
// 16m + 4t .. 16m + 4t + 3 of rows g and g + 8 (g = lane / 4, t = lane % 4): two 16-byte
// loads, the row-major [P][N] state layout of MimoStateLayout unchanged.
#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kernels/cluster.cuh"
#include "kernels/common.cuh"
#include "kernels/mimo_state.cuh"
#include "kernels/mimo_step.cuh"
#include "kernels/mimo_step_tc_math.cuh"

namespace m3::kernels {
namespace {

struct TcParams {
  MimoStepArgs a;
  MimoStateLayout layout;
  int trigger_point;  // recurrence_trigger_point(batch, beside_other_chains)
  int p_blocks;       // blocks per head, each taking P / p_blocks state rows (fused: P / 16)
};

// 16 bytes of a state row, not kept in L1 and fetched from DRAM in 256-byte pieces (the
// state is read once a step): faster up to batch 16 in one chain, slower from batch 32,
// where the plain load stays; each in a kernel variant of its own, since a runtime choice
// between the two slowed the plain path itself (docs/PERFORMANCE.md).
__device__ __forceinline__ float4 load_state_streamed(const float* p) {
  float4 v;
  asm volatile("ld.global.L1::no_allocate.L2::256B.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p));
  return v;
}

// The same 16-byte piece's four entries held in bf16 (state_dtype bf16).
__device__ __forceinline__ float4 load_state_bf16(const __nv_bfloat16* p, bool streamed) {
  uint2 v;
  if (streamed) {
    asm volatile("ld.global.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  } else {
    v = *reinterpret_cast<const uint2*>(p);
  }
  return widen_bf16x4(v);
}

// Shared-memory plan, in floats (every part a multiple of 4, so float4 parts stay aligned).
// PR: the block's state rows (P / p_blocks); DM: d_model when out_proj is fused, else 0.
struct TcSmem {
  int kf, qf, braw, craw, ys, scale, red, mx, mz, mo, on, sn, cs, os, part, total;
};
__host__ __device__ inline TcSmem tc_smem(int R, int N, int P, int PR, int CS, int DM) {
  TcSmem s{};
  int at = 0;
  s.kf = at; at += 8 * N;       // [N/16][32 lanes][4]: k and k_prev as update B fragments
  s.qf = at; at += 8 * N;       // [N/16][32 lanes][4]: q as y-product B fragments
  s.braw = at; at += R * N;     // in_proj B
  s.craw = at; at += R * N;     // in_proj C
  s.ys = at; at += CS * R * PR; // y partial sums per column share
  s.scale = at; at += (2 * R + 3) & ~3;
  s.red = at; at += 8 * R;      // output-norm partial sums
  s.mx = at; at += R * P;       // mimo_x, mimo_z, mimo_o of the head
  s.mz = at; at += R * P;
  s.mo = at; at += R * P;
  s.on = at; at += (P + 3) & ~3;  // output-norm weight of the head
  s.sn = at; at += 64;          // sin and cos of the head's new angles
  s.cs = at; at += 64;
  s.os = at; at += DM > 0 ? (PR + 3) & ~3 : 0;  // the block's outputs, for the fused out_proj
  s.part = at; at += DM;                         // its partial sums of out_proj (float4 each)
  s.total = at;
  return s;
}

// R: rank (1, 2 or 4; the update's 8 inner slots hold R of k and R of k_prev, the rest
// zero). RT: 16-row tiles of the block (4: a whole head of up to 64 rows; 1: one of the
// head's P / 16 blocks of 16 rows, for the fused out_proj). CS: warps sharing a row tile
// (each takes N / CS columns). The block always has RT * CS warps; with fewer rows the
// spare warps only help with the prologue.
//
// kFused: out_proj fused (mimo_step_tc_fused_kernel). The CL blocks of a cluster (two
// heads' 8 blocks of 16 rows at s2s-14l) share their outputs through distributed shared
// memory; block k then sums the k-th CL-th of out_proj's rows over the cluster's columns,
// held in registers from before the PDL wait, in a fixed order, and adds the sums into the
// residual stream with fp32 vector atomics. No out_proj kernel (and no kernel boundary)
// follows; the order of the additions over clusters, and so the last bits of the
// residual, vary from run to run.
//
// Every load that does not depend on another (the state's and parameters' before the PDL
// wait, in_proj's after it) is issued before the first use of any of them, so a block
// waits for one memory round trip: the per-thread item counts below are compile-time, so
// the loads sit in registers rather than in a load-store chain.
// kStreamed: the state rows come in by load_state_streamed, else by plain loads.
// kBf16State: the ssm state is stored in bf16 (MimoStateLayout::ssm_bf16): each piece is
// widened on load, the update and y run on the fp32 values, and the new state is rounded
// to bf16 only as it is stored.
template <int R, int RT, int CS, bool kFused, bool kStreamed, bool kBf16State, int CL = 1>
__device__ __forceinline__ void mimo_step_tc_body(const TcParams& prm) {
  static_assert(!kFused || RT == 1, "the fused out_proj takes 16-row blocks");
  constexpr int kT = 32 * RT * CS;
  constexpr int NG = 8 / CS;  // 16-column groups per warp at most (runtime N / 16 / CS)
  constexpr int kKE = (256 + kT - 1) / kT;     // update-fragment entries per thread (2N <= 256)
  // Rotation items: pair i = tid % 64 at ranks tid / 64 + j * (kT / 64), j < kRJ.
  constexpr int kRJ = (R + kT / 64 - 1) / (kT / 64);
  constexpr int kEI = (R * 64 + kT - 1) / kT;  // epilogue parameters per array per thread
  constexpr int kBI = (R * 128 + kT - 1) / kT; // in_proj B (and C) values per thread
  // Output: LR adjacent lanes per row (of up to 64), each taking RL of its ranks; R lanes
  // where the block has a thread for every (row, rank) pair, else one.
  constexpr int LR = kT >= 64 * R ? R : 1, RL = R / LR;
  const MimoStepArgs& a = prm.a;
  const int P = a.headdim, N = a.d_state, S = a.n_angles;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rt = warp % RT, ch = warp / RT;
  const int PR = P / prm.p_blocks, pb = blockIdx.x % prm.p_blocks, p_base = pb * PR;
  const bool updater = rt < PR / 16;  // this warp owns state rows
  const int p0 = p_base + rt * 16;    // its first row in the head
  const int ng = N / 16 / CS;
  const int m0 = ch * ng;
  const int RN = R * N, RP = R * P, half = N / 2;

  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const TcSmem L = tc_smem(R, N, P, PR, CS, kFused ? a.d_model : 0);
  float *kf = sm + L.kf, *qf = sm + L.qf, *braw = sm + L.braw, *craw = sm + L.craw;
  float *ys = sm + L.ys, *scale = sm + L.scale, *red = sm + L.red;
  float *mxs = sm + L.mx, *mzs = sm + L.mz, *mos = sm + L.mo, *ons = sm + L.on;
  float *sns = sm + L.sn, *css = sm + L.cs;
  const int pair = tid & 63;
  const bool rotates = pair < half;
  const int pi0 = a.mimo_rotation ? pair : 2 * pair, pi1 = a.mimo_rotation ? pair + half : 2 * pair + 1;

  const int h = blockIdx.x / prm.p_blocks, b = blockIdx.y;
  // --- independent of the previous kernel: state rows, k_prev, parameters ---
  const auto [ssm, xprev, angle_old, angle_new, kprev_old, kprev_new] = mimo_head_state(a, prm.layout, b, h);

  float4 sv[NG][2];  // rows p0 + g and p0 + g + 8, columns 16m + 4t .. + 3
  const float* row_g = ssm + (int64_t)(p0 + g) * N + 4 * t;
  const __nv_bfloat16* row_gb = reinterpret_cast<const __nv_bfloat16*>(ssm) + (int64_t)(p0 + g) * N + 4 * t;
  float xp0 = 0.f, xp1 = 0.f, mxa0 = 0.f, mxa1 = 0.f;  // the A fragment's inputs (rank t)
  if (updater) {
#pragma unroll
    for (int mi = 0; mi < NG; ++mi) {
      if (mi < ng) {
        if constexpr (kBf16State) {
          sv[mi][0] = load_state_bf16(row_gb + 16 * (m0 + mi), kStreamed);
          sv[mi][1] = load_state_bf16(row_gb + 8 * N + 16 * (m0 + mi), kStreamed);
        } else if constexpr (kStreamed) {
          sv[mi][0] = load_state_streamed(row_g + 16 * (m0 + mi));
          sv[mi][1] = load_state_streamed(row_g + 8 * N + 16 * (m0 + mi));
        } else {
          sv[mi][0] = *reinterpret_cast<const float4*>(row_g + 16 * (m0 + mi));
          sv[mi][1] = *reinterpret_cast<const float4*>(row_g + 8 * N + 16 * (m0 + mi));
        }
      }
    }
    xp0 = xprev[p0 + g];
    xp1 = xprev[p0 + g + 8];
    if (t < R) {
      mxa0 = a.mimo_x[((int64_t)h * R + t) * P + p0 + g];
      mxa1 = a.mimo_x[((int64_t)h * R + t) * P + p0 + g + 8];
    }
  }
  // Fused out_proj: this block (cluster rank k) sums rows [k, k + 1) * d_model / CL; thread
  // (quad, cg) holds rows 4 (k nq + quad) .. + 3 of cluster block cg's 16 bf16 columns (two
  // 16-byte pieces a row, 32 registers) until the end. A block's columns are
  // blockIdx.x * 16 .. + 15 (blocks run head-major, P / 16 a head).
  const int nq = kFused ? a.d_model / 4 / CL : 0, rank = blockIdx.x % CL;
  uint4 wreg[kFused ? 8 : 1];
  if constexpr (kFused) {
    if (tid < nq * CL) {
      const int quad = tid % nq, cg = tid / nq;
      const size_t row = (size_t)a.heads * P;
      const uint16_t* src = static_cast<const uint16_t*>(a.out_proj) + (size_t)4 * (rank * nq + quad) * row +
                            (size_t)(blockIdx.x - rank + cg) * 16;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        wreg[k] = load16_no_l1(src + k * row);
        wreg[4 + k] = load16_no_l1(src + k * row + 8);
      }
    }
  }
  prefetch_l2(a.prefetch[0]);
  prefetch_l2(a.prefetch[1]);
  // k_prev for the update's B fragments (k_prev_fragment_column; k filled in below).
  float kp[kKE][2];
#pragma unroll
  for (int j = 0; j < kKE; ++j) {
    const int e = tid + j * kT, et = e & 3;
    const int nA = k_prev_fragment_column(e);
    kp[j][0] = kp[j][1] = 0.f;
    if (e < 2 * N && et < R) {
      kp[j][0] = kprev_old[et * N + nA];
      kp[j][1] = kprev_old[et * N + nA + 2];
    }
  }
  // Rotation items: biases of this thread's ranks, norm weights of its pair, old angle.
  float ib[kRJ][2], ic[kRJ][2], nb[2] = {0.f, 0.f}, nc[2] = {0.f, 0.f};
  if (rotates) {
    nb[0] = a.B_norm[pi0]; nb[1] = a.B_norm[pi1];
    nc[0] = a.C_norm[pi0]; nc[1] = a.C_norm[pi1];
  }
#pragma unroll
  for (int j = 0; j < kRJ; ++j) {
    const int r = (tid >> 6) + j * (kT / 64);
    if (rotates && r < R) {
      const float* bbias = a.B_bias + ((int64_t)h * R + r) * N;
      const float* cbias = a.C_bias + ((int64_t)h * R + r) * N;
      ib[j][0] = bbias[pi0]; ib[j][1] = bbias[pi1];
      ic[j][0] = cbias[pi0]; ic[j][1] = cbias[pi1];
    }
  }
  const float th_old = tid < S ? angle_old[tid] : 0.f;
  // The epilogue's parameters, for shared memory.
  float emx[kEI], emz[kEI], emo[kEI], eon = 1.f;
#pragma unroll
  for (int j = 0; j < kEI; ++j) {
    const int i = tid + j * kT;
    if (i < RP) {
      emx[j] = a.mimo_x[(int64_t)h * RP + i];
      emz[j] = a.mimo_z[(int64_t)h * RP + i];
      emo[j] = a.mimo_o[(int64_t)h * RP + i];
    }
  }
  if (a.out_norm != nullptr && tid < P) eon = a.out_norm[h * P + tid];
  const float dt_bias = a.dt_bias[h], Dh = a.D[h];
  wait_for_previous_kernel(prm.trigger_point);
  // Every input from in_proj in one round of loads.
  const float* w = a.w + (int64_t)b * a.w_stride;
  const float dt_raw = w[a.off_dt + h], dA = w[a.off_A + h], trap_raw = w[a.off_trap + h];
  float x0 = 0.f, x1 = 0.f, e_x = 0.f, e_z = 0.f;
  if (updater) {
    x0 = w[a.off_x + h * P + p0 + g];
    x1 = w[a.off_x + h * P + p0 + g + 8];
  }
  const int e_row = tid / LR, e_rank0 = (tid % LR) * RL;  // output: row and first rank
  const bool emits = e_row < PR;
  if (emits) {
    e_x = w[a.off_x + h * P + p_base + e_row];
    e_z = w[a.off_z + h * P + p_base + e_row];
  }
  float rb[kBI], rc[kBI];
#pragma unroll
  for (int j = 0; j < kBI; ++j) {
    const int i = tid + j * kT;
    if (i < RN) { rb[j] = w[a.off_B + i]; rc[j] = w[a.off_C + i]; }
  }
  const float ang_in = tid < S ? w[a.off_ang + tid] : 0.f;
  // Now the stores: the first that need a load to have landed. Placed after the in_proj
  // loads are issued, so that k_prev's trip to DRAM (it is state: not in L2 at large
  // batches) and the in_proj outputs' trip to L2 overlap; before the PDL wait, these
  // stores held every block up on DRAM first (a quarter of all stall samples at batch 64).
#pragma unroll
  for (int j = 0; j < kKE; ++j) {
    const int e = tid + j * kT;
    if (e < 2 * N) {
      reinterpret_cast<float4*>(kf)[e] =
          make_float4(0.f, __uint_as_float(to_tf32(kp[j][0])), 0.f, __uint_as_float(to_tf32(kp[j][1])));
      reinterpret_cast<float4*>(qf)[e] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#pragma unroll
  for (int j = 0; j < kEI; ++j) {
    const int i = tid + j * kT;
    if (i < RP) { mxs[i] = emx[j]; mzs[i] = emz[j]; mos[i] = emo[j]; }
  }
  if (tid < P) ons[tid] = eon;

#pragma unroll
  for (int j = 0; j < kBI; ++j) {
    const int i = tid + j * kT;
    if (i < RN) { braw[i] = rb[j]; craw[i] = rc[j]; }
  }
  const auto [dt, alpha, beta, gamma] = step_scalars(dt_raw, dA, trap_raw, dt_bias, a.a_floor);
  // The update's A fragment: [gamma * x * mimo_x | beta * x_prev * mimo_x] at rows g, g+8.
  const uint32_t fa0 = to_tf32(gamma * (x0 * mxa0)), fa1 = to_tf32(gamma * (x1 * mxa1));
  const uint32_t fa2 = to_tf32(beta * (xp0 * mxa0)), fa3 = to_tf32(beta * (xp1 * mxa1));
  __syncthreads();
  if (prm.trigger_point == 3) allow_next_kernel();

  // The new angles (thread s < S) and their sines and cosines, once per pair.
  constexpr float kPi = 3.14159265358979323846f;
  if (tid < S) {
    const float theta = th_old + tanhf(ang_in) * dt * kPi;
    angle_new[tid] = theta;
    sincosf(theta, &sns[tid], &css[tid]);
  }
  // RMSNorm scales of B[r] and C[r], one warp per vector.
  for (int v = warp; v < 2 * R; v += kT / 32) {
    const float* src = (v < R ? braw : craw) + (v % R) * N;
    float ss = 0.f;
    for (int n = lane; n < N; n += 32) ss += src[n] * src[n];
    ss = warp_sum(ss);
    if (lane == 0) scale[v] = rsqrtf(ss * __frcp_rn(static_cast<float>(N)) + a.norm_eps);
  }
  __syncthreads();
  if (prm.trigger_point == 4) allow_next_kernel();

  // k and q: normalised, weighted, biased, rotated; k also becomes next step's k_prev.
  const float sn = pair < S ? sns[pair] : 0.f, cs = pair < S ? css[pair] : 1.f;
#pragma unroll
  for (int j = 0; j < kRJ; ++j) {
    const int r = (tid >> 6) + j * (kT / 64);
    if (!rotates || r >= R) continue;
    const int i0 = pi0, i1 = pi1;
    float k0 = braw[r * N + i0] * scale[r] * nb[0] + ib[j][0];
    float k1 = braw[r * N + i1] * scale[r] * nb[1] + ib[j][1];
    float q0 = craw[r * N + i0] * scale[R + r] * nc[0] + ic[j][0];
    float q1 = craw[r * N + i1] * scale[R + r] * nc[1] + ic[j][1];
    {  // (pairs past S: sn 0, cs 1)
      const float k0r = k0 * cs - k1 * sn, q0r = q0 * cs - q1 * sn;
      k1 = k0 * sn + k1 * cs;
      q1 = q0 * sn + q1 * cs;
      k0 = k0r;
      q0 = q0r;
    }
    kprev_new[r * N + i0] = k0;
    kprev_new[r * N + i1] = k1;
    // Into the fragment layouts (k_fragment_slot, q_fragment_slot).
    const int ns[2] = {i0, i1};
    const float kv[2] = {k0, k1}, qv[2] = {q0, q1};
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      kf[k_fragment_slot(ns[u], r)] = __uint_as_float(to_tf32(kv[u]));
      qf[q_fragment_slot(ns[u], r)] = __uint_as_float(to_tf32(qv[u]));
    }
  }
  __syncthreads();

  // The update and y, 16 columns per step; the new state goes back as it is produced.
  if (updater) {
    float yacc[4] = {0.f, 0.f, 0.f, 0.f};
    float* out_g = ssm + (int64_t)(p0 + g) * N + 4 * t;
    float* out_g8 = out_g + 8 * N;
    __nv_bfloat16* out_gb = reinterpret_cast<__nv_bfloat16*>(ssm) + (int64_t)(p0 + g) * N + 4 * t;
    __nv_bfloat16* out_gb8 = out_gb + 8 * N;
#pragma unroll
    for (int mi = 0; mi < NG; ++mi) {
      if (mi < ng) {
        const int m = m0 + mi;
        const float4 kv = reinterpret_cast<const float4*>(kf)[m * 32 + lane];
        const float4 qv = reinterpret_cast<const float4*>(qf)[m * 32 + lane];
        const float4 s0 = sv[mi][0], s1 = sv[mi][1];
        float ca[4] = {alpha * s0.x, alpha * s0.y, alpha * s1.x, alpha * s1.y};
        float cb[4] = {alpha * s0.z, alpha * s0.w, alpha * s1.z, alpha * s1.w};
        mma_tf32(ca, fa0, fa1, fa2, fa3, __float_as_uint(kv.x), __float_as_uint(kv.y));
        mma_tf32(cb, fa0, fa1, fa2, fa3, __float_as_uint(kv.z), __float_as_uint(kv.w));
        // Explicit 16-byte stores: written as plain assignments they came out as four
        // 4-byte stores (4x the L2 sectors, measured).
        if constexpr (kBf16State) {
          store_state_bf16(out_gb + 16 * m, ca[0], ca[1], cb[0], cb[1]);
          store_state_bf16(out_gb8 + 16 * m, ca[2], ca[3], cb[2], cb[3]);
        } else {
          __stcg(reinterpret_cast<float4*>(out_g + 16 * m), make_float4(ca[0], ca[1], cb[0], cb[1]));
          __stcg(reinterpret_cast<float4*>(out_g8 + 16 * m), make_float4(ca[2], ca[3], cb[2], cb[3]));
        }
        mma_tf32(yacc, __float_as_uint(ca[0]), __float_as_uint(ca[2]), __float_as_uint(ca[1]),
                 __float_as_uint(ca[3]), __float_as_uint(qv.x), __float_as_uint(qv.y));
        mma_tf32(yacc, __float_as_uint(cb[0]), __float_as_uint(cb[2]), __float_as_uint(cb[1]),
                 __float_as_uint(cb[3]), __float_as_uint(qv.z), __float_as_uint(qv.w));
      }
    }
    // yacc: rows g, g+8 at ranks 2t, 2t+1 (ranks >= R are padding).
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = 2 * t + j;
      if (r < R) {
        ys[(ch * R + r) * PR + rt * 16 + g] = yacc[j];
        ys[(ch * R + r) * PR + rt * 16 + g + 8] = yacc[2 + j];
      }
    }
  }
  if (prm.trigger_point == 0) allow_next_kernel();
  __syncthreads();

  // Output, row e_row at ranks e_rank0 .. + RL - 1 (a row's LR lanes summed by shuffles
  // at the end): D skip, optional grouped norm (over the head's rows, in however many
  // blocks), gate, mimo_o reduction. With one thread doing all R ranks of a row this was a
  // chain of R x CS shared-memory loads and R gates; spread over the lanes it is shorter.
  const int p = p_base + e_row;
  float y[RL];
#pragma unroll
  for (int j = 0; j < RL; ++j) {
    const int r = e_rank0 + j;
    y[j] = 0.f;
    if (emits) {
      float v = Dh * (e_x * mxs[r * P + p]);
#pragma unroll
      for (int c = 0; c < CS; ++c) v += ys[(c * R + r) * PR + e_row];
      y[j] = v;
    }
  }
  if (a.out_norm != nullptr) {  // sums of y^2 over the head's rows
    const int emit_warps = (PR * LR + 31) / 32;
#pragma unroll
    for (int j = 0; j < RL; ++j) {  // over the warp's rows: lanes of the same ranks
      float ss = y[j] * y[j];
#pragma unroll
      for (int off = LR; off < 32; off <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      if (lane < LR && warp < emit_warps) red[warp * R + lane * RL + j] = ss;
    }
    if constexpr (kFused) {  // the head's p_blocks blocks are in this cluster
      cluster_arrive_release<CL>();
      cluster_wait_acquire<CL>();
    } else {
      __syncthreads();
    }
    if (emits) {
#pragma unroll
      for (int j = 0; j < RL; ++j) {
        const int r = e_rank0 + j;
        float ss = 0.f;
        if constexpr (kFused) {  // the same order in every block of the head
          for (int k = 0; k < prm.p_blocks; ++k) {
            const float* rk = map_cluster_rank<CL>(red, rank - pb + k);
            for (int wi = 0; wi < emit_warps; ++wi) ss += rk[wi * R + r];
          }
        } else {
          for (int wi = 0; wi < emit_warps; ++wi) ss += red[wi * R + r];
        }
        y[j] *= rsqrtf(ss / P + a.norm_eps) * ons[p];
      }
    }
  }
  float out = 0.f;
  if (emits) {
#pragma unroll
    for (int j = 0; j < RL; ++j) {
      const int r = e_rank0 + j;
      const float zv = e_z * mzs[r * P + p];
      out += y[j] * (zv * __frcp_rn(1.f + __expf(-zv))) * mos[r * P + p];
    }
  }
#pragma unroll
  for (int off = 1; off < LR; off <<= 1) out += __shfl_xor_sync(0xffffffffu, out, off);
  if (emits && e_rank0 == 0) {
    if constexpr (kFused) {
      sm[L.os + e_row] = out;
    } else {
      store_output(a.o, a.o_bf16, (int64_t)b * a.o_stride + h * P + p, out);
    }
    xprev[p] = e_x;  // every read of the old x_prev happened before the first barrier
  }
  if constexpr (kFused) {
    cluster_arrive_release<CL>();
    cluster_wait_acquire<CL>();  // every block of the cluster has its outputs in shared memory
    float4* part = reinterpret_cast<float4*>(sm + L.part);
    if (tid < nq * CL) {  // partial sums of rows 4 (k nq + quad) .. + 3 over block cg's columns
      const int quad = tid % nq, cg = tid / nq;
      const float4* os4 = reinterpret_cast<const float4*>(map_cluster_rank<CL>(sm + L.os, cg));
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float4 o0 = os4[2 * q], o1 = os4[2 * q + 1];
        const float ov[8] = {o0.x, o0.y, o0.z, o0.w, o1.x, o1.y, o1.z, o1.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint4 wv = wreg[4 * q + k];
          const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            acc[k] = fmaf(__uint_as_float(words[j] << 16), ov[2 * j], acc[k]);
            acc[k] = fmaf(__uint_as_float(words[j] & 0xffff0000u), ov[2 * j + 1], acc[k]);
          }
        }
      }
      part[cg * nq + quad] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    }
    cluster_arrive_release<CL>();  // this block has read the others' outputs
    __syncthreads();
    if (tid < nq) {
      float4 sum = part[tid];
#pragma unroll
      for (int cg = 1; cg < CL; ++cg) {
        const float4 v = part[cg * nq + tid];
        sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
      }
      float* res = a.residual + (int64_t)b * a.residual_stride + 4 * (rank * nq + tid);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      atomicAdd(reinterpret_cast<float4*>(res), sum);
#else
      atomicAdd(res, sum.x); atomicAdd(res + 1, sum.y); atomicAdd(res + 2, sum.z); atomicAdd(res + 3, sum.w);
#endif
    }
    cluster_wait_acquire<CL>();  // keep this block's outputs until the cluster has read them
  }
}

template <int R, int CS, bool kStreamed, bool kBf16State>
__global__ void __launch_bounds__(128 * CS, CS == 1 ? 4 : (CS == 2 ? 3 : 1)) mimo_step_tc_kernel(const TcParams prm) {
  mimo_step_tc_body<R, 4, CS, false, kStreamed, kBf16State>(prm);
}

// (Only ever at batch 1 and 2, in one chain: streamed state loads.)
template <int R, int CL, bool kBf16State>
__global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(256, 2) mimo_step_tc_fused_kernel(const TcParams prm) {
  mimo_step_tc_body<R, 1, 8, true, true, kBf16State, CL>(prm);
}

// Where the recurrence lets out_proj launch (PdlTrigger's 0-2, or 3 / 4: after its first /
// second barrier, once in_proj's outputs / the norms are in), planned by batch: right after
// the wait up to batch 8 (out_proj's blocks then have their weights in when its wait ends),
// after the norms at batch 16 and after the loads from batch 32 (its own blocks then get
// the multiprocessors first); beside another chain right after the wait at every batch
// (the other chain fills the GPU). MimoStepPolicy::trigger fixes one point instead.
int recurrence_trigger_point(int batch, bool beside_other_chains, RecurrenceTrigger policy) {
  if (policy != RecurrenceTrigger::Planned) return static_cast<int>(policy);
  if (beside_other_chains) return 1;
  return batch < 16 ? 1 : batch < 32 ? 4 : 3;
}

// Whether the unfused kernel loads the state by load_state_streamed (one chain, up to batch
// 16, fp32 state) or by plain loads (beside other chains, a larger batch, or bf16 state,
// whose 8-byte pieces were slower streamed: 290.9 against 256.3 us a step at batch 16);
// MimoStepPolicy::state_load fixes one instead.
bool state_load_streamed(const MimoStepArgs& a, StateLoad policy) {
  if (policy != StateLoad::Planned) return policy == StateLoad::Streamed;
  return !a.state_bf16 && !a.beside_other_chains && a.batch <= 16;
}

TcParams tc_params(const MimoStepArgs& a, int p_blocks, const MimoStepPolicy& policy) {
  return TcParams{a, mimo_state_layout(a.heads, a.headdim, a.d_state, a.rank, a.n_angles, a.state_bf16),
                  recurrence_trigger_point(a.batch, a.beside_other_chains, policy.trigger), p_blocks};
}

template <int R, int CS>
KernelLaunch plan_cs(const MimoStepArgs& a, const MimoStepPolicy& policy) {
  const TcSmem s = tc_smem(R, a.d_state, a.headdim, a.headdim, CS, 0);
  const bool streamed = state_load_streamed(a, policy.state_load);
  auto* kernel = a.state_bf16 ? (streamed ? mimo_step_tc_kernel<R, CS, true, true> : mimo_step_tc_kernel<R, CS, false, true>)
                              : (streamed ? mimo_step_tc_kernel<R, CS, true, false> : mimo_step_tc_kernel<R, CS, false, false>);
  const TcParams params = tc_params(a, 1, policy);
  return KernelLaunch::make("mimo_step_tc", kernel, dim3(a.heads, a.batch), dim3(128 * CS), sizeof(float) * s.total,
                            params)
      .described("tensor cores, " + std::to_string(CS) + (CS == 1 ? " warp" : " warps") + " a row tile, " +
                 (streamed ? "streamed" : "plain") + (a.state_bf16 ? " bf16" : "") + " state loads, trigger " +
                 std::to_string(params.trigger_point));
}

bool mimo_step_tc_shape_applies(const MimoStepArgs& a) {
  const bool rank_ok = a.rank == 1 || a.rank == 2 || a.rank == 4;
  return rank_ok && a.headdim % 16 == 0 && a.headdim <= 64 && a.d_state % 16 == 0 &&
         a.d_state <= 128 && 2 * a.n_angles <= a.d_state;
}

// Blocks of a cluster of the fused kernel for p_blocks blocks a head: args.fused_cluster
// if set, else 8 where the shape allows, else 4 (0: none fits).
int fused_cluster(const MimoStepArgs& a, int p_blocks) {
  const int forced = a.fused_cluster;
  for (const int cl : {8, 4}) {
    if (forced != 0 && cl != forced) continue;
    // The grouped output norm sums a head's rows over its blocks through the cluster, so
    // each head's blocks must lie in one (headdim 48: three blocks a head, no cluster).
    if (a.out_norm != nullptr && cl % p_blocks != 0) continue;
    if ((a.heads * p_blocks) % cl == 0 && a.d_model % (4 * cl) == 0) return cl;
  }
  return 0;
}

// Blocks per head with out_proj fused (0: it cannot be). Each block takes 16 of the head's
// rows with 8 warps (one 16-column group of a 128-column state each); clusters of blocks
// sum their products before the atomics, so there are fewer of them. Why 16-row blocks with
// the columns in registers: a whole head's columns (114 KB) do not fit in the RTX 5090's
// shared memory, and blocks staging their columns in shared memory made the
// multiprocessors drain to change their L1 / shared split beside the gemvs; these keep the
// unfused kernel's footprint.
int fused_blocks_per_head(const MimoStepArgs& a) {
  if (a.out_proj == nullptr || a.out_proj_type != WeightDType::BF16 || a.residual == nullptr) return 0;
  if (a.d_model <= 0 || a.d_model % 4 != 0 || a.d_model > 4 * 256) return 0;
  if (a.residual_stride % 4 != 0 || reinterpret_cast<uintptr_t>(a.residual) % 16 != 0) return 0;
  const int p_blocks = a.headdim / 16;  // 1, 2 or 4: a head's blocks share a cluster (grouped norm)
  if (a.d_state != 128 || fused_cluster(a, p_blocks) == 0 || !cluster_launch_supported()) return 0;
  return p_blocks;
}

template <int R>
KernelLaunch plan_fused(const MimoStepArgs& a, const MimoStepPolicy& policy) {
  const int p_blocks = fused_blocks_per_head(a);
  const TcSmem s = tc_smem(R, a.d_state, a.headdim, 16, 8, a.d_model);
  const int cluster = fused_cluster(a, p_blocks);
  const TcParams params = tc_params(a, p_blocks, policy);
  auto* kernel = a.state_bf16 ? (cluster == 8 ? mimo_step_tc_fused_kernel<R, 8, true> : mimo_step_tc_fused_kernel<R, 4, true>)
                              : (cluster == 8 ? mimo_step_tc_fused_kernel<R, 8, false> : mimo_step_tc_fused_kernel<R, 4, false>);
  return KernelLaunch::make("mimo_step_tc", kernel,
                            dim3(a.heads * p_blocks, a.batch), dim3(256), sizeof(float) * s.total, params)
      .described("tensor cores, out_proj fused, clusters of " + std::to_string(cluster) +
                 (a.state_bf16 ? ", bf16 state" : "") + ", trigger " +
                 std::to_string(params.trigger_point));
}

// Two warps per row tile (256 threads, 3 blocks per SM) unless one-warp tiles (128
// threads, 4 blocks per SM) take fewer waves of blocks (batch 16 and the two chains of
// batch 64 on the H200): where the waves tie, the two-warp tiles win.
template <int R>
KernelLaunch plan_rank_tc(const MimoStepArgs& a, const MimoStepPolicy& policy) {
  if (a.out_proj != nullptr) return plan_fused<R>(a, policy);
  if (policy.streaming_min_batch > 0 && a.batch >= policy.streaming_min_batch && mimo_step_stream_applies(a)) {
    return plan_mimo_step_stream(a, policy);
  }
  const int groups = a.d_state / 16;
  const int forced = policy.tc_column_split;
  if (forced == 4 && groups % 4 == 0) return plan_cs<R, 4>(a, policy);
  if (forced == 1 || groups % 2 != 0) return plan_cs<R, 1>(a, policy);
  KernelLaunch two = plan_cs<R, 2>(a, policy);
  if (forced == 2) return two;
  const int sms = multiprocessor_count();
  KernelLaunch one = plan_cs<R, 1>(a, policy);
  const int blocks = a.heads * a.batch;
  auto waves = [&](const KernelLaunch& k, int threads) {
    const int per_wave = std::max(1, k.resident_blocks_per_sm(threads) * sms);
    return (blocks + per_wave - 1) / per_wave;
  };
  return waves(one, 128) < waves(two, 256) ? one : two;
}

}  // namespace

bool mimo_step_tc_can_fuse_out_proj(const MimoStepArgs& a) {
  return mimo_step_tc_shape_applies(a) && fused_blocks_per_head(a) > 0;
}

int mimo_step_tc_fused_cluster(const MimoStepArgs& a) {
  return mimo_step_tc_can_fuse_out_proj(a) ? fused_cluster(a, fused_blocks_per_head(a)) : 0;
}

bool mimo_step_tc_applies(const MimoStepArgs& a) {
  return mimo_step_tc_shape_applies(a) && (a.out_proj == nullptr || fused_blocks_per_head(a) > 0);
}

KernelLaunch plan_mimo_step_tc(const MimoStepArgs& a, const MimoStepPolicy& policy) {
  if (!mimo_step_tc_applies(a)) {
    throw std::invalid_argument("mimo_step (tensor cores): needs rank 1, 2 or 4, headdim a multiple of 16 "
                                "up to 64, d_state a multiple of 16 up to 128; to fuse out_proj also bf16 "
                                "weights, d_state 128, d_model a multiple of 16 up to 1024, heads x headdim / "
                                "16 a multiple of 4, a residual stride that is a multiple of 4");
  }
  switch (a.rank) {
    case 1: return plan_rank_tc<1>(a, policy);
    case 2: return plan_rank_tc<2>(a, policy);
    default: return plan_rank_tc<4>(a, policy);
  }
}

}  // namespace m3::kernels
