// The MIMO step (mimo_step.cuh's contract, the tensor-core arithmetic of mimo_step_tc.cu)
// for large batches, as a stream: persistent blocks, each stepping one head of a run of
// sequences, with the next sequences' state already on its way into shared memory.
//
// Why: from batch 64 on, 90% of the step's bytes are the recurrent state, read once and
// written once. The per-head kernel (one block per head and sequence) loads its 32 KB,
// then spends the rest of its life in a dependent chain (in_proj's outputs, norms,
// rotation, update, output) during which that block moves no bytes; a multiprocessor holds
// three or four of them, so the state streamed at about two thirds of the copy bandwidth.
// Here block (h, k) steps head h of sequences k, k + K, k + 2K, ...: while it computes one,
// cp.async copies of the next kStages - 1 (state rows, k_prev, x_prev, old angles and
// in_proj's outputs) are in flight into a ring of shared-memory stages, and the new state
// goes out by 16-byte stores straight from the update's registers. The head's parameters
// are loaded once per block instead of once per sequence.
//
// Layout inside a block (256 threads): warp w takes state rows 16 (w % 4) .. + 15 and
// column half w / 4, the per-head kernel's two-warps-a-tile form; a stage's state rows are
// stored with their 16-byte pieces swizzled so that the fragment reads hit distinct banks.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/common.cuh"
#include "kernels/mimo_state.cuh"
#include "kernels/mimo_step.cuh"
#include "kernels/mimo_step_tc_math.cuh"

namespace m3::kernels {
namespace {

constexpr int kThreads = 256;

struct StreamParams {
  MimoStepArgs a;
  MimoStateLayout layout;
  int blocks_per_head;  // K
  int trigger_point;    // 0: the next kernel may launch at the end; 2: before the wait; else after it
  bool vector_inputs;   // in_proj's B and C rows start on 16 bytes: copied in 16-byte pieces
  bool vector_k_prev;   // so do the k_prev rows
};

__host__ __device__ constexpr int round4(int v) { return (v + 3) & ~3; }

// Stages a block keeps: two where a head's fp32 state (32 KB at d_state 128) leaves no room
// for a third under the 101,376-byte limit, else three.
__host__ __device__ constexpr int stream_stages(int N, bool bf16_state) { return !bf16_state && N == 128 ? 2 : 3; }

// Shared memory in floats: the stages of one sequence's inputs, then the block's own areas.
// Every part is a multiple of 4 floats, so 16-byte pieces stay aligned.
struct StreamSmem {
  int st, kp, xp, ao, bw, cw, xw, zw, aw, sc, stage;  // within a stage; stage: its size
  int kf, qf, ys, scale, red, mx, mz, mo, on, nb, nc, bb, cb, sn, cs, total;
};
__host__ __device__ constexpr StreamSmem stream_smem(int R, int N, int P, int S, bool bf16_state) {
  StreamSmem s{};
  int at = 0;
  s.st = at; at += bf16_state ? P * N / 2 : P * N;  // the head's state rows
  s.kp = at; at += R * N;          // k_prev (old parity)
  s.xp = at; at += round4(P);      // x_prev
  s.ao = at; at += round4(S);      // old angles
  s.bw = at; at += R * N;          // in_proj's B, C, x, z, angle inputs, dt / A / trap
  s.cw = at; at += R * N;
  s.xw = at; at += round4(P);
  s.zw = at; at += round4(P);
  s.aw = at; at += round4(S);
  s.sc = at; at += 4;
  s.stage = at;
  at *= stream_stages(N, bf16_state);
  s.kf = at; at += 8 * N;          // k and k_prev as update B fragments
  s.qf = at; at += 8 * N;          // q as y-product B fragments
  s.ys = at; at += 2 * R * P;      // y partial sums of the two column halves
  s.scale = at; at += round4(2 * R + 3);  // B / C norm scales, then alpha, beta, gamma
  s.red = at; at += 8 * R;         // output-norm partial sums
  s.mx = at; at += R * P;          // the head's parameters: mimo_x, mimo_z, mimo_o, output norm,
  s.mz = at; at += R * P;          // B and C norm weights and biases
  s.mo = at; at += R * P;
  s.on = at; at += round4(P);
  s.nb = at; at += N;
  s.nc = at; at += N;
  s.bb = at; at += R * N;
  s.cb = at; at += R * N;
  s.sn = at; at += 64;             // sin and cos of the new angles
  s.cs = at; at += 64;
  s.total = at;
  return s;
}

// The 16-byte piece c of state row `row` sits at piece (c ^ swizzle) of that row in a stage:
// the fragment reads of rows g and g + 1 (fp32) or g .. g + 3 (bf16) then fall in distinct
// banks. Rows of fewer than 8 pieces stay as they are.
template <int kPiecesPerRow, bool kBf16State>
__device__ __forceinline__ int state_swizzle(int row) {
  if constexpr (kPiecesPerRow < 8) return 0;
  return kBf16State ? (row & 3) << 1 : (row & 1) << 2;
}

template <int R, int N, bool kBf16State>
__global__ void __launch_bounds__(kThreads, 2) mimo_step_stream_kernel(const StreamParams prm) {
  constexpr int kStages = stream_stages(N, kBf16State);
  constexpr int kPerRow = kBf16State ? N / 8 : N / 4;  // 16-byte pieces of a state row
  constexpr int kRowsPerPass = kThreads / kPerRow;     // state rows one pass of the block copies
  constexpr int NG = N / 32;                            // 16-column groups of a warp's half
  constexpr int RN = R * N, kHalf = N / 2;
  constexpr int kRJ = (R + kThreads / 64 - 1) / (kThreads / 64);
  static_assert(kThreads % kPerRow == 0 && 2 * N <= kThreads && kHalf <= 64, "shape outside the block's plan");
  const MimoStepArgs& a = prm.a;
  const int P = a.headdim, S = a.n_angles, RP = R * P;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rt = warp & 3, ch = warp >> 2;
  const bool updater = rt < P / 16;
  const int p0 = rt * 16, m0 = ch * NG;
  const int K = prm.blocks_per_head, h = blockIdx.x / K, k0 = blockIdx.x % K;
  const int items = (a.batch - k0 + K - 1) / K;  // sequences k0, k0 + K, ...

  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const StreamSmem L = stream_smem(R, N, P, S, kBf16State);
  float *kf = sm + L.kf, *qf = sm + L.qf, *ys = sm + L.ys, *scale = sm + L.scale, *red = sm + L.red;
  float *mxs = sm + L.mx, *mzs = sm + L.mz, *mos = sm + L.mo, *ons = sm + L.on, *sns = sm + L.sn, *css = sm + L.cs;
  const float *nbs = sm + L.nb, *ncs = sm + L.nc, *bbs = sm + L.bb, *cbs = sm + L.cb;
  // This thread's state pieces: rows tid / kPerRow + kRowsPerPass * i, piece tid % kPerRow
  // (swizzled by the row's parity, the same in every pass), 16 bytes each.
  const int my_row = tid / kPerRow, my_piece = tid % kPerRow;
  const int my_dst = 4 * (my_row * kPerRow + (my_piece ^ state_swizzle<kPerRow, kBf16State>(my_row)));

  // What does not depend on the previous kernel: sequence j's state ...
  auto issue_state = [&](int j, int slot, int parity) {
    float* stg = sm + (j % kStages) * L.stage;
    const int64_t H = a.heads;
    const float* st = a.state + slot * a.slot_stride + a.layer_offset;
    const float* ssm = st + prm.layout.ssm + (kBf16State ? h * (int64_t)P * N / 2 : h * (int64_t)P * N) + 4 * tid;
#pragma unroll
    for (int i = 0; i < 64 / kRowsPerPass; ++i) {
      if (my_row + kRowsPerPass * i < P) {
        cp_async16(stg + L.st + my_dst + 4 * kPerRow * kRowsPerPass * i, ssm + 4 * kThreads * i);
      }
    }
    const float* kprev = st + prm.layout.k_prev + parity * H * RN + h * RN;
    if (prm.vector_k_prev) {
      if (4 * tid < RN) cp_async16(stg + L.kp + 4 * tid, kprev + 4 * tid);
    } else {
#pragma unroll
      for (int i = 0; i < (RN + kThreads - 1) / kThreads; ++i) {
        if (tid + kThreads * i < RN) cp_async4(stg + L.kp + tid + kThreads * i, kprev + tid + kThreads * i);
      }
    }
    if (tid < P) cp_async4(stg + L.xp + tid, st + prm.layout.x_prev + h * P + tid);
    if (tid < S) cp_async4(stg + L.ao + tid, st + prm.layout.angle + parity * H * S + h * S + tid);
  };
  // ... and its inputs from in_proj, which do.
  auto issue_inputs = [&](int j) {
    float* stg = sm + (j % kStages) * L.stage;
    const float* w = a.w + (int64_t)(k0 + j * K) * a.w_stride;
    if (prm.vector_inputs) {
      if (4 * tid < RN) {
        cp_async16(stg + L.bw + 4 * tid, w + a.off_B + 4 * tid);
        cp_async16(stg + L.cw + 4 * tid, w + a.off_C + 4 * tid);
      }
    } else {
#pragma unroll
      for (int i = 0; i < (RN + kThreads - 1) / kThreads; ++i) {
        const int e = tid + kThreads * i;
        if (e < RN) {
          cp_async4(stg + L.bw + e, w + a.off_B + e);
          cp_async4(stg + L.cw + e, w + a.off_C + e);
        }
      }
    }
    if (tid < P) {
      cp_async4(stg + L.xw + tid, w + a.off_x + h * P + tid);
      cp_async4(stg + L.zw + tid, w + a.off_z + h * P + tid);
    }
    if (tid < S) cp_async4(stg + L.aw + tid, w + a.off_ang + tid);
    if (tid < 3) cp_async4(stg + L.sc + tid, w + (tid == 0 ? a.off_dt : tid == 1 ? a.off_A : a.off_trap) + h);
  };

  // The head's parameters, once for all its sequences.
  for (int i = tid; i < RP; i += kThreads) {
    mxs[i] = a.mimo_x[(int64_t)h * RP + i];
    mzs[i] = a.mimo_z[(int64_t)h * RP + i];
    mos[i] = a.mimo_o[(int64_t)h * RP + i];
  }
  if (tid < P) ons[tid] = a.out_norm != nullptr ? a.out_norm[h * P + tid] : 1.f;
  if (tid < N) {
    sm[L.nb + tid] = a.B_norm[tid];
    sm[L.nc + tid] = a.C_norm[tid];
  }
  for (int i = tid; i < RN; i += kThreads) {
    sm[L.bb + i] = a.B_bias[(int64_t)h * RN + i];
    sm[L.cb + i] = a.C_bias[(int64_t)h * RN + i];
  }
  const float dt_bias = a.dt_bias[h], Dh = a.D[h];
  prefetch_l2(a.prefetch[0]);
  prefetch_l2(a.prefetch[1]);
  for (int j = 0; j < kStages && j < items; ++j) {
    const int b = k0 + j * K;
    issue_state(j, a.slots[b], a.parities[b] & 1);
  }
  if (prm.trigger_point == 2) allow_next_kernel();
  wait_for_previous_kernel();
  if (prm.trigger_point == 1) allow_next_kernel();
  for (int j = 0; j < kStages; ++j) {
    if (j < items) issue_inputs(j);
    cp_async_commit();  // one group a sequence, empty past the last, so the waits below count right
  }

  const int pair = tid & 63;
  const bool rotates = pair < kHalf;
  const int pi0 = a.mimo_rotation ? pair : 2 * pair, pi1 = a.mimo_rotation ? pair + kHalf : 2 * pair + 1;
  const int e_row = tid / R, e_rank = tid % R;  // output: row and rank
  const bool emits = e_row < P;
  for (int j = 0; j < items; ++j) {
    const int b = k0 + j * K;
    const float* stg = sm + (j % kStages) * L.stage;
    const int slot = a.slots[b], parity = a.parities[b] & 1;
    const bool refill = j + kStages < items;
    const int next_b = refill ? k0 + (j + kStages) * K : b;
    const int next_slot = a.slots[next_b], next_parity = a.parities[next_b] & 1;
    float* st = a.state + slot * a.slot_stride + a.layer_offset;
    cp_async_wait<kStages - 1>();
    __syncthreads();  // sequence j's stage is in; the last sequence's output phase is done

    // The head's scalars, by the warps that advance the angles (the rest read them after
    // the next barrier).
    if (warp == 0 || 32 * warp < S) {
      const auto [dt, alpha, beta, gamma] = step_scalars(stg[L.sc], stg[L.sc + 1], stg[L.sc + 2], dt_bias, a.a_floor);
      if (tid == 0) {
        scale[2 * R] = alpha;
        scale[2 * R + 1] = beta;
        scale[2 * R + 2] = gamma;
      }
      constexpr float kPi = 3.14159265358979323846f;
      if (tid < S) {
        const float theta = stg[L.ao + tid] + tanhf(stg[L.aw + tid]) * dt * kPi;
        st[prm.layout.angle + (1 - parity) * a.heads * S + h * S + tid] = theta;
        sincosf(theta, &sns[tid], &css[tid]);
      }
    }
    if (tid < 2 * N) {
      const int et = tid & 3, nA = k_prev_fragment_column(tid);
      const float kp0 = et < R ? stg[L.kp + et * N + nA] : 0.f, kp1 = et < R ? stg[L.kp + et * N + nA + 2] : 0.f;
      reinterpret_cast<float4*>(kf)[tid] =
          make_float4(0.f, __uint_as_float(to_tf32(kp0)), 0.f, __uint_as_float(to_tf32(kp1)));
      reinterpret_cast<float4*>(qf)[tid] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (warp < 2 * R) {  // RMSNorm scales of B[r] and C[r], one warp each
      const float* src = stg + (warp < R ? L.bw : L.cw) + (warp % R) * N;
      float ss = 0.f;
#pragma unroll
      for (int n = 0; n < N / 32; ++n) ss += src[lane + 32 * n] * src[lane + 32 * n];
      ss = warp_sum(ss);
      if (lane == 0) scale[warp] = rsqrtf(ss * (1.f / N) + a.norm_eps);
    }
    __syncthreads();

    // k and q: normalised, weighted, biased, rotated; k also becomes the next step's k_prev.
    if (rotates) {
      const float sn = pair < S ? sns[pair] : 0.f, cs = pair < S ? css[pair] : 1.f;
      float* kprev_new = st + prm.layout.k_prev + (1 - parity) * (int64_t)a.heads * RN + h * RN;
#pragma unroll
      for (int j2 = 0; j2 < kRJ; ++j2) {
        const int r = (tid >> 6) + j2 * (kThreads / 64);
        if (r >= R) continue;
        const float* braw = stg + L.bw + r * N;
        const float* craw = stg + L.cw + r * N;
        const float k0v = braw[pi0] * scale[r] * nbs[pi0] + bbs[r * N + pi0];
        const float k1v = braw[pi1] * scale[r] * nbs[pi1] + bbs[r * N + pi1];
        const float q0v = craw[pi0] * scale[R + r] * ncs[pi0] + cbs[r * N + pi0];
        const float q1v = craw[pi1] * scale[R + r] * ncs[pi1] + cbs[r * N + pi1];
        const float kr0 = k0v * cs - k1v * sn, kr1 = k0v * sn + k1v * cs;  // (pairs past S: sn 0, cs 1)
        const float qr0 = q0v * cs - q1v * sn, qr1 = q0v * sn + q1v * cs;
        kprev_new[r * N + pi0] = kr0;
        kprev_new[r * N + pi1] = kr1;
        kf[k_fragment_slot(pi0, r)] = __uint_as_float(to_tf32(kr0));
        kf[k_fragment_slot(pi1, r)] = __uint_as_float(to_tf32(kr1));
        qf[q_fragment_slot(pi0, r)] = __uint_as_float(to_tf32(qr0));
        qf[q_fragment_slot(pi1, r)] = __uint_as_float(to_tf32(qr1));
      }
    }
    __syncthreads();

    // The update and y, 16 columns at a time; the new state goes out as it is produced.
    const float e_x = emits ? stg[L.xw + e_row] : 0.f, e_z = emits ? stg[L.zw + e_row] : 0.f;
    if (updater) {
      const float alpha = scale[2 * R], beta = scale[2 * R + 1], gamma = scale[2 * R + 2];
      const int r0 = p0 + g, r1 = r0 + 8;
      const float mxa0 = t < R ? mxs[t * P + r0] : 0.f, mxa1 = t < R ? mxs[t * P + r1] : 0.f;
      const float x0 = stg[L.xw + r0], x1 = stg[L.xw + r1], xp0 = stg[L.xp + r0], xp1 = stg[L.xp + r1];
      const uint32_t fa0 = to_tf32(gamma * (x0 * mxa0)), fa1 = to_tf32(gamma * (x1 * mxa1));
      const uint32_t fa2 = to_tf32(beta * (xp0 * mxa0)), fa3 = to_tf32(beta * (xp1 * mxa1));
      const int sw = state_swizzle<kPerRow, kBf16State>(r0);  // rows r0 and r1 share it
      float yacc[4] = {0.f, 0.f, 0.f, 0.f};
      float* ssm = st + prm.layout.ssm + (kBf16State ? h * (int64_t)P * N / 2 : h * (int64_t)P * N);
      float* out0 = ssm + r0 * N + 4 * t;
      __nv_bfloat16* out0b = reinterpret_cast<__nv_bfloat16*>(ssm) + r0 * N + 4 * t;
#pragma unroll 2
      for (int mi = 0; mi < NG; ++mi) {
        const int m = m0 + mi;
        float4 s0, s1;
        if constexpr (kBf16State) {
          const int c = (2 * m + (t >> 1)) ^ sw;
          const uint2* base = reinterpret_cast<const uint2*>(stg + L.st);
          s0 = widen_bf16x4(base[2 * (r0 * kPerRow + c) + (t & 1)]);
          s1 = widen_bf16x4(base[2 * (r1 * kPerRow + c) + (t & 1)]);
        } else {
          const int c = (4 * m + t) ^ sw;
          const float4* base = reinterpret_cast<const float4*>(stg + L.st);
          s0 = base[r0 * kPerRow + c];
          s1 = base[r1 * kPerRow + c];
        }
        const float4 kv = reinterpret_cast<const float4*>(kf)[m * 32 + lane];
        const float4 qv = reinterpret_cast<const float4*>(qf)[m * 32 + lane];
        float ca[4] = {alpha * s0.x, alpha * s0.y, alpha * s1.x, alpha * s1.y};
        float cb[4] = {alpha * s0.z, alpha * s0.w, alpha * s1.z, alpha * s1.w};
        mma_tf32(ca, fa0, fa1, fa2, fa3, __float_as_uint(kv.x), __float_as_uint(kv.y));
        mma_tf32(cb, fa0, fa1, fa2, fa3, __float_as_uint(kv.z), __float_as_uint(kv.w));
        if constexpr (kBf16State) {
          store_state_bf16(out0b + 16 * m, ca[0], ca[1], cb[0], cb[1]);
          store_state_bf16(out0b + 8 * N + 16 * m, ca[2], ca[3], cb[2], cb[3]);
        } else {
          __stcg(reinterpret_cast<float4*>(out0 + 16 * m), make_float4(ca[0], ca[1], cb[0], cb[1]));
          __stcg(reinterpret_cast<float4*>(out0 + 8 * N + 16 * m), make_float4(ca[2], ca[3], cb[2], cb[3]));
        }
        mma_tf32(yacc, __float_as_uint(ca[0]), __float_as_uint(ca[2]), __float_as_uint(ca[1]),
                 __float_as_uint(ca[3]), __float_as_uint(qv.x), __float_as_uint(qv.y));
        mma_tf32(yacc, __float_as_uint(cb[0]), __float_as_uint(cb[2]), __float_as_uint(cb[1]),
                 __float_as_uint(cb[3]), __float_as_uint(qv.z), __float_as_uint(qv.w));
      }
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {  // yacc: rows g, g + 8 at ranks 2t, 2t + 1 (>= R: padding)
        const int r = 2 * t + jj;
        if (r < R) {
          ys[(ch * R + r) * P + r0] = yacc[jj];
          ys[(ch * R + r) * P + r1] = yacc[2 + jj];
        }
      }
    }
    __syncthreads();  // y is in; nothing reads this stage any more
    if (refill) {
      issue_state(j + kStages, next_slot, next_parity);
      issue_inputs(j + kStages);
    }
    cp_async_commit();

    // Output of row e_row at rank e_rank (a row's R lanes summed by shuffles): D skip,
    // optional grouped norm over the head's rows, gate, mimo_o reduction.
    float y = 0.f;
    if (emits) y = Dh * (e_x * mxs[e_rank * P + e_row]) + ys[e_rank * P + e_row] + ys[(R + e_rank) * P + e_row];
    if (a.out_norm != nullptr) {
      const int emit_warps = (P * R + 31) / 32;
      float ss = y * y;
#pragma unroll
      for (int off = R; off < 32; off <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      if (lane < R && warp < emit_warps) red[warp * R + lane] = ss;
      __syncthreads();
      if (emits) {
        float tot = 0.f;
        for (int wi = 0; wi < emit_warps; ++wi) tot += red[wi * R + e_rank];
        y *= rsqrtf(tot / P + a.norm_eps) * ons[e_row];
      }
    }
    float out = 0.f;
    if (emits) {
      const float zv = e_z * mzs[e_rank * P + e_row];
      out = y * (zv * __frcp_rn(1.f + __expf(-zv))) * mos[e_rank * P + e_row];
    }
#pragma unroll
    for (int off = 1; off < R; off <<= 1) out += __shfl_xor_sync(0xffffffffu, out, off);
    if (emits && e_rank == 0) {
      store_output(a.o, a.o_bf16, (int64_t)b * a.o_stride + h * P + e_row, out);
      st[prm.layout.x_prev + h * P + e_row] = e_x;
    }
  }
  if (prm.trigger_point == 0) allow_next_kernel();
}

template <int R, int N>
KernelLaunch make_stream(const StreamParams& prm, int blocks, size_t smem) {
  const dim3 grid(blocks), block(kThreads);
  return prm.a.state_bf16
             ? KernelLaunch::make("mimo_step_stream", mimo_step_stream_kernel<R, N, true>, grid, block, smem, prm)
             : KernelLaunch::make("mimo_step_stream", mimo_step_stream_kernel<R, N, false>, grid, block, smem, prm);
}

template <int R>
KernelLaunch make_stream_rank(const StreamParams& prm, int blocks, size_t smem) {
  switch (prm.a.d_state) {
    case 32: return make_stream<R, 32>(prm, blocks, smem);
    case 64: return make_stream<R, 64>(prm, blocks, smem);
    default: return make_stream<R, 128>(prm, blocks, smem);
  }
}

KernelLaunch make_stream_launch(const StreamParams& prm, int blocks, size_t smem) {
  switch (prm.a.rank) {
    case 1: return make_stream_rank<1>(prm, blocks, smem);
    case 2: return make_stream_rank<2>(prm, blocks, smem);
    default: return make_stream_rank<4>(prm, blocks, smem);
  }
}

}  // namespace

size_t mimo_step_stream_smem_bytes(const MimoStepArgs& a) {
  return sizeof(float) * static_cast<size_t>(stream_smem(a.rank, a.d_state, a.headdim, a.n_angles, a.state_bf16).total);
}

bool mimo_step_stream_applies(const MimoStepArgs& a) {
  const bool rank_ok = a.rank == 1 || a.rank == 2 || a.rank == 4;
  // Whole heads of up to 64 rows in 16-row tiles, d_state 32, 64 or 128 (kernels built for
  // each), and state rows that start on 16 bytes (cp.async copies them in 16-byte pieces).
  const bool shape_ok = a.headdim % 16 == 0 && a.headdim > 0 && a.headdim <= 64 &&
                        (a.d_state == 32 || a.d_state == 64 || a.d_state == 128) && 2 * a.n_angles <= a.d_state;
  const bool aligned = a.slot_stride % 4 == 0 && a.layer_offset % 4 == 0 &&
                       reinterpret_cast<uintptr_t>(a.state) % 16 == 0;
  return rank_ok && shape_ok && aligned && a.out_proj == nullptr && a.batch > 0 &&
         mimo_step_stream_smem_bytes(a) <= kMaxSharedBytesPerBlock;
}

KernelLaunch plan_mimo_step_stream(const MimoStepArgs& a, const MimoStepPolicy& policy) {
  if (!mimo_step_stream_applies(a)) {
    throw std::invalid_argument("mimo_step (streaming): needs rank 1, 2 or 4, headdim a multiple of 16 up to 64, "
                                "d_state 32, 64 or 128, state rows on 16 bytes and out_proj unfused");
  }
  const size_t smem = mimo_step_stream_smem_bytes(a);
  const MimoStateLayout layout = mimo_state_layout(a.heads, a.headdim, a.d_state, a.rank, a.n_angles, a.state_bf16);
  StreamParams prm{a, layout, 1, 1, false, false};
  const RecurrenceTrigger trigger = policy.trigger;
  prm.trigger_point = trigger == RecurrenceTrigger::AtEnd ? 0 : trigger == RecurrenceTrigger::BeforeWait ? 2 : 1;
  const auto on16 = [](const float* p, int64_t floats) { return reinterpret_cast<uintptr_t>(p + floats) % 16 == 0; };
  prm.vector_inputs = a.w_stride % 4 == 0 && on16(a.w, a.off_B) && on16(a.w, a.off_C);
  prm.vector_k_prev = layout.k_prev % 4 == 0 && (int64_t(a.heads) * a.rank * a.d_state) % 4 == 0;
  // As many blocks a head as the GPU holds at once, then as few as give each the same
  // number of sequences (its last round no longer than the others).
  const int resident = make_stream_launch(prm, a.heads, smem).resident_blocks_per_sm(kThreads);
  const int most = std::max(1, std::min(a.batch, resident * multiprocessor_count() / a.heads));
  const int per_block = (a.batch + most - 1) / most;
  prm.blocks_per_head = (a.batch + per_block - 1) / per_block;
  return make_stream_launch(prm, a.heads * prm.blocks_per_head, smem)
      .described("streaming, " + std::to_string(prm.blocks_per_head) + " blocks a head, " +
                 std::to_string(per_block) + " sequences a block, " +
                 std::to_string(stream_stages(a.d_state, a.state_bf16)) + " stages" +
                 (a.state_bf16 ? ", bf16 state" : "") + ", trigger " + std::to_string(prm.trigger_point));
}

}  // namespace m3::kernels
