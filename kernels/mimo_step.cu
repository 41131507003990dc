#include "kernels/mimo_step.cuh"

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kernels/common.cuh"
#include "kernels/mimo_state.cuh"

namespace m3::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct MimoParams {
  MimoStepArgs a;
  MimoStateLayout layout;
  int p_chunk;
};

// R: MIMO rank; NV: float4 of a state row per lane (N <= 128 * NV); RW: state rows a
// warp holds in registers (a block covers 8 * RW rows per pass).
//
// Everything that does not come from in_proj (the state rows, k_prev, the angles, the
// parameters) is loaded before waiting for the previous kernel, so with programmatic
// dependent launch the state stream overlaps in_proj's tail.
template <int R, int NV, int RW>
__global__ void __launch_bounds__(kThreads, 2) mimo_step_kernel(const MimoParams prm) {
  constexpr int kRowsPerWarp = RW;
  constexpr int kRowsPerGroup = kWarps * RW;
  const MimoStepArgs& a = prm.a;
  const int H = a.heads, P = a.headdim, N = a.d_state, S = a.n_angles, pc = prm.p_chunk;
  const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  const int p0 = chunk * pc;
  const int n4s = N / 4;

  extern __shared__ float4 smem4[];
  float* k = reinterpret_cast<float*>(smem4);  // [R][N]
  float* q = k + R * N;                        // [R][N]
  float* kp = q + R * N;                       // [R][N]
  float* bb = kp + R * N;                      // [R][N] B_bias of this head
  float* cb = bb + R * N;                      // [R][N] C_bias of this head
  float* bn = cb + R * N;                      // [N]
  float* cn = bn + N;                          // [N]
  float* theta = cn + N;                       // [S] (old angles, then new)
  float* xv = theta + ((S + 3) & ~3);          // [R][pc]
  float* xs = xv + R * pc;                     // [R][pc]
  float* y = xs + R * pc;                      // [R][pc]
  float* mx = y + R * pc;                      // [R][pc]
  float* mz = mx + R * pc;                     // [R][pc]
  float* mo = mz + R * pc;                     // [R][pc]
  float* xcur = mo + R * pc;                   // [pc]
  float* xold = xcur + pc;                     // [pc]
  float* zc = xold + pc;                       // [pc]
  float* onw = zc + pc;                        // [pc] out norm weight
  float* rs = onw + pc;                        // [R]
  float* braw = rs + ((R + 3) & ~3);           // [R][N] in_proj B
  float* craw = braw + R * N;                  // [R][N] in_proj C
  float* angs = craw + R * N;                  // [S] in_proj angle inputs
  float* o_s = angs + ((S + 3) & ~3);          // [pc] o, when out_proj is fused
  // [d_model][pc] columns of out_proj (raw weights), 16-byte aligned, when fused.
  unsigned char* wsl = reinterpret_cast<unsigned char*>(o_s + ((pc + 3) & ~3));
  const bool fused = a.out_proj != nullptr;

  // --- independent of the previous kernel ---
  const auto [ssm, xprev, angle_old, angle_new, kprev_old, kprev_new] = mimo_head_state(a, prm.layout, b, h);

  float4 sv[kRowsPerWarp][NV];  // first group of state rows
  auto load_rows = [&](int g0) {
#pragma unroll
    for (int u = 0; u < kRowsPerWarp; ++u) {
      const int pl = g0 + warp * kRowsPerWarp + u;
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int n4 = lane + 32 * v;
        if (pl < pc && n4 < n4s) sv[u][v] = reinterpret_cast<const float4*>(ssm + (int64_t)(p0 + pl) * N)[n4];
      }
    }
  };
  load_rows(0);
  if (fused) {  // out_proj columns: async copies into shared memory, waited for at the end
    const int esize = a.out_proj_type == WeightDType::BF16 ? 2 : 4;
    const int row_bytes = pc * esize, pieces = row_bytes / 16;
    const unsigned char* src = static_cast<const unsigned char*>(a.out_proj) +
                               (size_t)(h * P + p0) * esize;
    const size_t src_row = (size_t)H * P * esize;
    for (int i = tid; i < a.d_model * pieces; i += kThreads) {
      const int m = i / pieces, q = i % pieces;
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(wsl + m * row_bytes + q * 16));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src + m * src_row + q * 16));
    }
    asm volatile("cp.async.commit_group;");
  }
  prefetch_l2(a.prefetch[0]);
  prefetch_l2(a.prefetch[1]);
  // All independent loads in flight at once (registers), then into shared memory.
  constexpr int kVecItems = (R * 128 * NV + kThreads - 1) / kThreads;  // of R*N per thread
  const int RN = R * N;
  float r_kp[kVecItems], r_bb[kVecItems], r_cb[kVecItems];
#pragma unroll
  for (int j = 0; j < kVecItems; ++j) {
    const int i = tid + j * kThreads;
    if (i < RN) {
      r_kp[j] = kprev_old[i];
      r_bb[j] = a.B_bias[(int64_t)h * RN + i];
      r_cb[j] = a.C_bias[(int64_t)h * RN + i];
    }
  }
  float r_bn = 0.f, r_cn = 0.f, r_th = 0.f, r_xo = 0.f, r_on = 0.f;
  if (tid < N) { r_bn = a.B_norm[tid]; r_cn = a.C_norm[tid]; }
  if (tid < S) r_th = angle_old[tid];
  if (tid < pc) {
    r_xo = xprev[p0 + tid];
    if (a.out_norm != nullptr) r_on = a.out_norm[h * P + p0 + tid];
  }
  constexpr int kRowItems = (R * 64 + kThreads - 1) / kThreads;  // R*pc <= R*64
  float r_mx[kRowItems], r_mz[kRowItems], r_mo[kRowItems];
#pragma unroll
  for (int j = 0; j < kRowItems; ++j) {
    const int idx = tid + j * kThreads;
    if (idx < R * pc) {
      const int r = idx / pc, i = idx % pc;
      const int64_t hr = ((int64_t)h * R + r) * P + p0 + i;
      r_mx[j] = a.mimo_x[hr];
      r_mz[j] = a.mimo_z[hr];
      r_mo[j] = a.mimo_o[hr];
    }
  }
  const float dt_bias = a.dt_bias[h], Dh = a.D[h];
#pragma unroll
  for (int j = 0; j < kVecItems; ++j) {
    const int i = tid + j * kThreads;
    if (i < RN) { kp[i] = r_kp[j]; bb[i] = r_bb[j]; cb[i] = r_cb[j]; }
  }
  if (tid < N) { bn[tid] = r_bn; cn[tid] = r_cn; }
  if (tid < S) theta[tid] = r_th;
  if (tid < pc) { xold[tid] = r_xo; onw[tid] = r_on; }
#pragma unroll
  for (int j = 0; j < kRowItems; ++j) {
    const int idx = tid + j * kThreads;
    if (idx < R * pc) { mx[idx] = r_mx[j]; mz[idx] = r_mz[j]; mo[idx] = r_mo[j]; }
  }

  wait_for_previous_kernel();
  // Every input from in_proj in one round of loads.
  const float* w = a.w + (int64_t)b * a.w_stride;
  const float dt_raw = w[a.off_dt + h], dA = w[a.off_A + h], trap_raw = w[a.off_trap + h];
  {
    float r_b[kVecItems], r_c[kVecItems];
#pragma unroll
    for (int j = 0; j < kVecItems; ++j) {
      const int i = tid + j * kThreads;
      if (i < RN) { r_b[j] = w[a.off_B + i]; r_c[j] = w[a.off_C + i]; }
    }
    const float r_ang = tid < S ? w[a.off_ang + tid] : 0.f;
    const float r_x = tid < pc ? w[a.off_x + h * P + p0 + tid] : 0.f;
    const float r_z = tid < pc ? w[a.off_z + h * P + p0 + tid] : 0.f;
#pragma unroll
    for (int j = 0; j < kVecItems; ++j) {
      const int i = tid + j * kThreads;
      if (i < RN) { braw[i] = r_b[j]; craw[i] = r_c[j]; }
    }
    if (tid < S) angs[tid] = r_ang;
    if (tid < pc) { xcur[tid] = r_x; zc[tid] = r_z; }
  }
  const float dt = softplus(dt_raw + dt_bias);
  const float A = fminf(-(fmaxf(dA, 0.f) + 1.f / (1.f - fminf(dA, 0.f))), -a.a_floor);
  const float trap = 1.f / (1.f + expf(-trap_raw));
  const float alpha = expf(A * dt);
  const float beta = (1.f - trap) * dt * alpha;
  const float gamma = trap * dt;
  __syncthreads();

  // B and C: RMSNorm over N, weight, per-head bias. One warp per vector.
  for (int v = warp; v < 2 * R; v += kWarps) {
    const bool is_b = v < R;
    const int r = is_b ? v : v - R;
    const float* src = (is_b ? braw : craw) + r * N;
    const float* nw = is_b ? bn : cn;
    const float* bias = (is_b ? bb : cb) + r * N;
    float ss = 0.f;
    for (int n = lane; n < N; n += 32) ss += src[n] * src[n];
    const float scale = rsqrtf(warp_sum(ss) / N + a.norm_eps);
    float* dst = (is_b ? k : q) + r * N;
    for (int n = lane; n < N; n += 32) dst[n] = src[n] * scale * nw[n] + bias[n];
  }
  constexpr float kPi = 3.14159265358979323846f;
  for (int s = tid; s < S; s += kThreads) {
    const float t = theta[s] + tanhf(angs[s]) * dt * kPi;
    theta[s] = t;
    if (chunk == 0) angle_new[s] = t;
  }
  __syncthreads();

  // Rotary on k and q; the MIMO input scalings; x becomes next step's x_prev.
  const int half = N / 2;
  for (int idx = tid; idx < R * half; idx += kThreads) {
    const int r = idx / half, i = idx % half;
    if (i < S) {
      float sn, cs;
      sincosf(theta[i], &sn, &cs);
      const int i0 = a.mimo_rotation ? i : 2 * i;
      const int i1 = a.mimo_rotation ? i + half : 2 * i + 1;
      float* kr = k + r * N;
      float* qr = q + r * N;
      const float k0 = kr[i0], k1 = kr[i1], q0 = qr[i0], q1 = qr[i1];
      kr[i0] = k0 * cs - k1 * sn;
      kr[i1] = k0 * sn + k1 * cs;
      qr[i0] = q0 * cs - q1 * sn;
      qr[i1] = q0 * sn + q1 * cs;
    }
  }
  for (int idx = tid; idx < R * pc; idx += kThreads) {
    const int i = idx % pc;
    xv[idx] = gamma * (xcur[i] * mx[idx]);  // scaled once, not per lane
    xs[idx] = beta * (xold[i] * mx[idx]);
  }
  for (int i = tid; i < pc; i += kThreads) xprev[p0 + i] = xcur[i];
  __syncthreads();
  if (chunk == 0) {
    for (int i = tid; i < R * N; i += kThreads) kprev_new[i] = k[i];
  }

  // The state update: each warp kRowsPerWarp rows per group, rows already in registers.
  for (int g0 = 0; g0 < pc; g0 += kRowsPerGroup) {
    if (g0 > 0) load_rows(g0);
    float yacc[kRowsPerWarp][R];
#pragma unroll
    for (int u = 0; u < kRowsPerWarp; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) yacc[u][r] = 0.f;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int n4 = lane + 32 * v;
      if (n4 >= n4s) continue;
      float4 kv[R], kpv[R], qv[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        kv[r] = reinterpret_cast<const float4*>(k + r * N)[n4];
        kpv[r] = reinterpret_cast<const float4*>(kp + r * N)[n4];
        qv[r] = reinterpret_cast<const float4*>(q + r * N)[n4];
      }
#pragma unroll
      for (int u = 0; u < kRowsPerWarp; ++u) {
        const int pl = g0 + warp * kRowsPerWarp + u;
        if (pl >= pc) continue;
        float gx[R], bx[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          gx[r] = xv[r * pc + pl];
          bx[r] = xs[r * pc + pl];
        }
        float s4[4] = {sv[u][v].x, sv[u][v].y, sv[u][v].z, sv[u][v].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float val = alpha * s4[j];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            val = fmaf(gx[r], (&kv[r].x)[j], val);
            val = fmaf(bx[r], (&kpv[r].x)[j], val);
          }
          s4[j] = val;
#pragma unroll
          for (int r = 0; r < R; ++r) yacc[u][r] = fmaf(val, (&qv[r].x)[j], yacc[u][r]);
        }
        reinterpret_cast<float4*>(ssm + (int64_t)(p0 + pl) * N)[n4] = make_float4(s4[0], s4[1], s4[2], s4[3]);
      }
    }
    // The sums of up to 32 (row, rank) pairs at once (transposed butterfly, 31 shuffles
    // for the whole-head variant's 8 rows x rank 4 instead of 160); lane L ends with pair
    // L of the set. (Only where all of a warp's sums fit one set: split sets pushed the
    // arrays to local memory.)
    constexpr int kRowsPerSet = kRowsPerWarp * R <= 32 ? kRowsPerWarp : 0;
    if constexpr (kRowsPerSet >= 1) {
#pragma unroll
      for (int u0 = 0; u0 < kRowsPerWarp; u0 += kRowsPerSet) {
        float flat[kRowsPerSet * R];
#pragma unroll
        for (int u = 0; u < kRowsPerSet; ++u)
#pragma unroll
          for (int r = 0; r < R; ++r) flat[u * R + r] = yacc[u0 + u][r];
        const float t = warp_sum_many(flat);
        if (lane < kRowsPerSet * R) {
          const int u = u0 + lane / R, r = lane % R;
          const int pl = g0 + warp * kRowsPerWarp + u;
          if (pl < pc) y[r * pc + pl] = t + Dh * (xcur[pl] * mx[r * pc + pl]);
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < kRowsPerWarp; ++u) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float t = warp_sum(yacc[u][r]);
          const int pl = g0 + warp * kRowsPerWarp + u;
          if (lane == 0 && pl < pc) y[r * pc + pl] = t + Dh * (xcur[pl] * mx[r * pc + pl]);
        }
      }
    }
  }
  allow_next_kernel();
  __syncthreads();

  if (a.out_norm != nullptr) {  // p_chunk == P: the whole head is here
    for (int r = warp; r < R; r += kWarps) {
      float ss = 0.f;
      for (int i = lane; i < pc; i += 32) ss += y[r * pc + i] * y[r * pc + i];
      ss = warp_sum(ss);
      if (lane == 0) rs[r] = rsqrtf(ss / P + a.norm_eps);
    }
    __syncthreads();
  }
  for (int i = tid; i < pc; i += kThreads) {
    const float z = zc[i];
    float out = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float yv = y[r * pc + i];
      if (a.out_norm != nullptr) yv *= rs[r] * onw[i];
      out += yv * silu(z * mz[r * pc + i]) * mo[r * pc + i];
    }
    if (fused) {
      o_s[i] = out;
    } else {
      store_output(a.o, a.o_bf16, (int64_t)b * a.o_stride + h * P + p0 + i, out);
    }
  }
  if (fused) {
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    float* res = a.residual + (int64_t)b * a.residual_stride;
    for (int m = tid; m < a.d_model; m += kThreads) {
      float acc = 0.f;
      if (a.out_proj_type == WeightDType::BF16) {
        const uint4* wr = reinterpret_cast<const uint4*>(wsl + (size_t)m * pc * 2);
        for (int q = 0; q < pc / 8; ++q) {
          const uint4 v = wr[q];
          const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            acc = fmaf(__uint_as_float(words[j] << 16), o_s[q * 8 + 2 * j], acc);
            acc = fmaf(__uint_as_float(words[j] & 0xffff0000u), o_s[q * 8 + 2 * j + 1], acc);
          }
        }
      } else {
        const float4* wr = reinterpret_cast<const float4*>(wsl + (size_t)m * pc * 4);
        for (int q = 0; q < pc / 4; ++q) {
          const float4 v = wr[q];
          acc = fmaf(v.x, o_s[q * 4], acc);
          acc = fmaf(v.y, o_s[q * 4 + 1], acc);
          acc = fmaf(v.z, o_s[q * 4 + 2], acc);
          acc = fmaf(v.w, o_s[q * 4 + 3], acc);
        }
      }
      atomicAdd(res + m, acc);
    }
  }
}

template <int R, int NV, int RW>
KernelLaunch plan_rank(const MimoStepArgs& a, int p_chunk) {
  const MimoParams prm{a, mimo_state_layout(a.heads, a.headdim, a.d_state, a.rank, a.n_angles), p_chunk};
  const size_t S4 = (a.n_angles + 3) & ~3;
  size_t floats = 7 * (size_t)R * a.d_state + 2 * (size_t)a.d_state + 2 * S4 +
                  6 * (size_t)R * p_chunk + 4 * (size_t)p_chunk + ((R + 3) & ~3);
  floats += (p_chunk + 3) & ~3;  // o_s
  floats = (floats + 3) & ~size_t{3};
  if (a.out_proj != nullptr) {
    floats += (size_t)a.d_model * p_chunk * (a.out_proj_type == WeightDType::BF16 ? 2 : 4) / 4;
  }
  return KernelLaunch::make("mimo_step", mimo_step_kernel<R, NV, RW>,
                            dim3(a.headdim / p_chunk, a.heads, a.batch), dim3(kThreads),
                            floats * sizeof(float), prm)
      .described("cuda cores, " + std::to_string(p_chunk) + " state rows a block" +
                 (a.out_proj != nullptr ? ", out_proj fused" : ""));
}

// From MimoStepPolicy::whole_head_min_batch (4 by default) a block takes a whole 64-row
// head (8 rows per warp): fewer blocks, each head's prologue (B/C norm, rotary) done once;
// below it, batch 1 and 2 stay on 16-row blocks (MimoStepPolicy::small_batch_rows) with
// out_proj fused. Out_proj is never fused at whole-head batches.
// Batches 1 and 2 split a head's rows finely (out_proj fused); larger ones give each
// block a whole head to amortise its prologue.
template <int R>
KernelLaunch plan_nv(const MimoStepArgs& a, const MimoStepPolicy& policy) {
  const bool split = a.out_norm == nullptr;
  if (a.d_state <= 128) {
    if (split && a.batch >= policy.whole_head_min_batch && a.headdim % 64 == 0) return plan_rank<R, 1, 8>(a, 64);
    if (split && a.batch >= 8 && a.headdim % 32 == 0) return plan_rank<R, 1, 4>(a, 32);
    if (split && policy.small_batch_rows == 8 && a.headdim % 8 == 0) return plan_rank<R, 1, 1>(a, 8);
    return plan_rank<R, 1, 2>(a, split && a.headdim % 16 == 0 ? 16 : a.headdim);
  }
  return plan_rank<R, 2, 2>(a, split && a.headdim % 16 == 0 ? 16 : a.headdim);
}

}  // namespace

MimoStateLayout mimo_state_layout(int H, int P, int N, int R, int S, bool ssm_bf16) {
  MimoStateLayout l;
  l.ssm_bf16 = ssm_bf16;
  l.ssm = 0;
  // (P * N is even for every shape mimo_step_shape_refusal accepts.)
  l.x_prev = l.ssm + (ssm_bf16 ? (int64_t)H * P * N / 2 : (int64_t)H * P * N);
  l.angle = l.x_prev + (int64_t)H * P;
  l.k_prev = l.angle + 2 * (int64_t)H * S;
  l.floats = l.k_prev + 2 * (int64_t)H * R * N;
  l.floats = (l.floats + 3) & ~int64_t{3};  // keep each layer 16-byte aligned
  return l;
}

namespace {
// The rows per block plan_nv picks for the fused (small-batch) case.
int fused_p_chunk(const MimoStepArgs& a, const MimoStepPolicy& policy) {
  if (a.out_norm != nullptr || a.batch >= 8 || a.d_state > 128 || a.headdim % 16 != 0) return 0;
  if (a.headdim % 64 == 0 && a.batch >= policy.whole_head_min_batch) return 0;  // plan_nv: whole heads
  return policy.small_batch_rows;
}
}  // namespace

bool mimo_step_can_fuse_out_proj(const MimoStepArgs& a, const MimoStepPolicy& policy) {
  if (a.tensor_cores) {  // plan_mimo_step takes the tensor-core kernel where its shape applies
    MimoStepArgs unfused = a;
    unfused.out_proj = nullptr;
    if (mimo_step_tc_applies(unfused)) return mimo_step_tc_can_fuse_out_proj(a);
  }
  const int pc = fused_p_chunk(a, policy);
  if (pc == 0 || a.d_model <= 0) return false;
  const size_t esize = a.out_proj_type == WeightDType::BF16 ? 2 : 4;
  const size_t rest = sizeof(float) * (7 * (size_t)a.rank * a.d_state + 2 * (size_t)a.d_state +
                                       2 * (size_t)((a.n_angles + 3) & ~3) + 7 * (size_t)a.rank * pc + 8 * pc + 16);
  return rest + (size_t)a.d_model * pc * esize + 1024 <= kMaxSharedBytesPerBlock;
}

std::optional<MimoShapeRefusal> mimo_step_shape_refusal(int headdim, int d_state, int rank) {
  // A warp holds a state row as float4s, at most two a lane (256 columns); the block's
  // per-row tables are sized for heads of at most 64 rows; kernels exist for these ranks.
  if (d_state % 4 != 0 || d_state > 256) return MimoShapeRefusal{"d_state", d_state, "must be a multiple of 4, at most 256"};
  if (headdim > 64) return MimoShapeRefusal{"headdim", headdim, "must be at most 64"};
  if (rank != 1 && rank != 2 && rank != 4 && rank != 8) return MimoShapeRefusal{"mimo_rank", rank, "must be 1, 2, 4 or 8"};
  return std::nullopt;
}

KernelLaunch plan_mimo_step(const MimoStepArgs& a, const MimoStepPolicy& policy) {
  const std::string what = "mimo_step (H " + std::to_string(a.heads) + ", P " +
                           std::to_string(a.headdim) + ", N " + std::to_string(a.d_state) +
                           ", R " + std::to_string(a.rank) + ", S " + std::to_string(a.n_angles) + ")";
  if (a.heads <= 0 || a.headdim <= 0 || a.d_state <= 0 || a.batch <= 0) {
    throw std::invalid_argument(what + ": sizes must be positive");
  }
  if (const auto refusal = mimo_step_shape_refusal(a.headdim, a.d_state, a.rank)) {
    throw std::invalid_argument(what + ": " + refusal->dimension + " " + refusal->rule);
  }
  if (2 * a.n_angles > a.d_state) throw std::invalid_argument(what + ": more angles than pairs");
  if (const std::string why = mimo_step_policy_refusal(policy); !why.empty()) {
    throw std::invalid_argument(what + ": policy " + why);
  }
  if (a.out_proj != nullptr && !mimo_step_can_fuse_out_proj(a, policy)) {
    throw std::invalid_argument(what + ": out_proj cannot be fused at batch " + std::to_string(a.batch));
  }
  if (a.tensor_cores && mimo_step_tc_applies(a)) return plan_mimo_step_tc(a, policy);
  if (a.state_bf16) {
    throw std::invalid_argument(what + ": bf16 state is stored by the tensor-core kernel only (bf16 weights, "
                                "rank 1, 2 or 4, headdim a multiple of 16 up to 64, d_state a multiple of 16 "
                                "up to 128)");
  }
  // A head's rows split over blocks unless the grouped output norm needs the whole head.
  switch (a.rank) {
    case 1: return plan_nv<1>(a, policy);
    case 2: return plan_nv<2>(a, policy);
    case 4: return plan_nv<4>(a, policy);
    default: return plan_nv<8>(a, policy);  // (1, 2, 4 or 8: mimo_step_shape_refusal)
  }
}

}  // namespace m3::kernels
