#include "model/cpu/cpu_ops.h"

#include <algorithm>
#include <cmath>

namespace m3::cpu {
namespace {

float silu(float v) { return v / (1.0f + std::exp(-v)); }
float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }
// As torch.nn.functional.softplus: linear above 20, where log1p(exp(v)) == v in fp32.
float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

// Rotates the pairs (i, i + N/2), i < S, of v by angles with cosines c and sines s.
void rotate_halves(float* v, int N, int S, const float* c, const float* s) {
  const int half = N / 2;
  for (int i = 0; i < S; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * c[i] - b * s[i];
    v[i + half] = a * s[i] + b * c[i];
  }
}

}  // namespace

void rmsnorm(const float* v, const float* weight, int n, float eps, float* out) {
  const float mean_square = dot(v, v, n) / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(mean_square + eps);
  for (int i = 0; i < n; ++i) out[i] = v[i] * inv * weight[i];
}

namespace {

// Dot products of one weight row with NB input vectors, each summed exactly as dot()
// sums it (8 lanes, the same final combine), so that blocking never changes a result.
template <int NB>
[[gnu::always_inline]] inline void dot_rows(const float* w, const float* x, int64_t x_stride, int n,
                                            float* out, int64_t out_stride) {
  float acc[NB][8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int b = 0; b < NB; ++b) {
      for (int k = 0; k < 8; ++k) acc[b][k] += w[i + k] * x[b * x_stride + i + k];
    }
  }
  for (; i < n; ++i) {
    for (int b = 0; b < NB; ++b) acc[b][i & 7] += w[i] * x[b * x_stride + i];
  }
  for (int b = 0; b < NB; ++b) {
    const float* a = acc[b];
    out[b * out_stride] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  }
}

}  // namespace

float dot(const float* a, const float* b, int n) {
  float out;
  dot_rows<1>(a, b, 0, n, &out, 0);
  return out;
}

namespace {

[[gnu::always_inline]] inline void matvec_rows_body(const float* W, int in, int out_rows,
                                                    int row_begin, int row_end, const float* x,
                                                    int batch, float* y) {
  for (int j = row_begin; j < row_end; ++j) {
    const float* row = W + static_cast<int64_t>(j) * in;
    float* yj = y + j;
    int b = 0;
    for (; b + 4 <= batch; b += 4) {
      dot_rows<4>(row, x + static_cast<int64_t>(b) * in, in, in, yj + static_cast<int64_t>(b) * out_rows,
                  out_rows);
    }
    for (; b < batch; ++b) {
      dot_rows<1>(row, x + static_cast<int64_t>(b) * in, in, in, yj + static_cast<int64_t>(b) * out_rows,
                  out_rows);
    }
  }
}

// Wider vectors where the CPU has them. AVX2 alone enables no FMA contraction, so both
// versions compute bit-identical results. Chosen by a plain CPU check rather than an
// ifunc (target_clones), whose resolver runs before sanitizer runtimes start.
[[gnu::target("avx2")]] void matvec_rows_avx2(const float* W, int in, int out_rows, int row_begin,
                                              int row_end, const float* x, int batch, float* y) {
  matvec_rows_body(W, in, out_rows, row_begin, row_end, x, batch, y);
}

void matvec_rows_generic(const float* W, int in, int out_rows, int row_begin, int row_end,
                         const float* x, int batch, float* y) {
  matvec_rows_body(W, in, out_rows, row_begin, row_end, x, batch, y);
}

using MatvecFn = void (*)(const float*, int, int, int, int, const float*, int, float*);
MatvecFn pick_matvec() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") ? matvec_rows_avx2 : matvec_rows_generic;
}

// NR weight rows against NB input vectors: each of the NR x NB dot products summed exactly
// as dot_rows sums it (lane i % 8, the same final combine), with each loaded value reused
// NB or NR times.
template <int NR, int NB>
[[gnu::always_inline]] inline void dot_tile(const float* w, int64_t w_stride, const float* x,
                                            int64_t x_stride, int n, float* y, int64_t y_stride) {
  float acc[NR][NB][8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int r = 0; r < NR; ++r) {
      for (int b = 0; b < NB; ++b) {
        for (int k = 0; k < 8; ++k) acc[r][b][k] += w[r * w_stride + i + k] * x[b * x_stride + i + k];
      }
    }
  }
  for (; i < n; ++i) {
    for (int r = 0; r < NR; ++r) {
      for (int b = 0; b < NB; ++b) acc[r][b][i & 7] += w[r * w_stride + i] * x[b * x_stride + i];
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int b = 0; b < NB; ++b) {
      const float* a = acc[r][b];
      y[b * y_stride + r] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
  }
}

[[gnu::always_inline]] inline void matmul_rows_body(const float* W, int in, int out_rows,
                                                    int row_begin, int row_end, const float* x,
                                                    int tokens, float* y) {
  // About 128 KiB of inputs per block: they stay in L2 while every row passes over them.
  const int block = std::max(4, (32768 / std::max(in, 1)) / 4 * 4);
  for (int t0 = 0; t0 < tokens; t0 += block) {
    const int t1 = std::min(tokens, t0 + block);
    int j = row_begin;
    for (; j + 2 <= row_end; j += 2) {
      const float* row = W + static_cast<int64_t>(j) * in;
      int t = t0;
      for (; t + 4 <= t1; t += 4) {
        dot_tile<2, 4>(row, in, x + static_cast<int64_t>(t) * in, in, in,
                       y + static_cast<int64_t>(t) * out_rows + j, out_rows);
      }
      for (; t < t1; ++t) {
        dot_tile<2, 1>(row, in, x + static_cast<int64_t>(t) * in, in, in,
                       y + static_cast<int64_t>(t) * out_rows + j, out_rows);
      }
    }
    for (; j < row_end; ++j) {
      const float* row = W + static_cast<int64_t>(j) * in;
      for (int t = t0; t < t1; ++t) {
        dot_tile<1, 1>(row, in, x + static_cast<int64_t>(t) * in, in, in,
                       y + static_cast<int64_t>(t) * out_rows + j, out_rows);
      }
    }
  }
}

[[gnu::target("avx2")]] void matmul_rows_avx2(const float* W, int in, int out_rows, int row_begin,
                                              int row_end, const float* x, int tokens, float* y) {
  matmul_rows_body(W, in, out_rows, row_begin, row_end, x, tokens, y);
}

void matmul_rows_generic(const float* W, int in, int out_rows, int row_begin, int row_end,
                         const float* x, int tokens, float* y) {
  matmul_rows_body(W, in, out_rows, row_begin, row_end, x, tokens, y);
}

MatvecFn pick_matmul() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") ? matmul_rows_avx2 : matmul_rows_generic;
}
}  // namespace

void matmul_rows(const float* W, int in, int out_rows, int row_begin, int row_end,
                 const float* x, int tokens, float* y) {
  static const MatvecFn matmul = pick_matmul();
  matmul(W, in, out_rows, row_begin, row_end, x, tokens, y);
}

void matvec_rows(const float* W, int in, int out_rows, int row_begin, int row_end,
                 const float* x, int batch, float* y) {
  static const MatvecFn matvec = pick_matvec();  // a function-local static: no init-order trap
  matvec(W, in, out_rows, row_begin, row_end, x, batch, y);
}

void gated_silu(const float* fc1_out, int F, float* out) {
  for (int i = 0; i < F; ++i) out[i] = fc1_out[i] * silu(fc1_out[F + i]);
}

int mixer_head_scratch_floats(const MixerDims& d) {
  return 2 * d.R * d.N + 4 * d.R * d.P + 2 * d.S;
}

void mixer_head_step(const MixerDims& d, const MixerParams& p, const InProjOffsets& layout,
                     const float* w, const float* B_normed, const float* C_normed, int h,
                     MixerState& state, float* scratch, float* o) {
  const int H = d.H, P = d.P, N = d.N, R = d.R, S = d.S;
  float* k = scratch;          // [R, N]
  float* q = k + R * N;        // [R, N]
  float* xv = q + R * N;       // [R, P]  x * mimo_x
  float* gx = xv + R * P;      // [R, P]  gamma * xv
  float* bx = gx + R * P;      // [R, P]  beta * x_prev * mimo_x
  float* y = bx + R * P;       // [R, P]
  float* cosines = y + R * P;  // [S]
  float* sines = cosines + S;  // [S]

  const float dt = softplus(w[layout.dd_dt + h] + p.dt_bias[h]);
  const float dd_A = w[layout.dd_A + h];
  const float A = std::min(-(std::max(dd_A, 0.0f) + 1.0f / (1.0f - std::min(dd_A, 0.0f))),
                           -d.A_floor);
  const float trap = sigmoid(w[layout.trap + h]);

  float* angle = state.angle + static_cast<int64_t>(h) * S;
  for (int s = 0; s < S; ++s) {
    const float theta = angle[s] + std::tanh(w[layout.ang + s]) * dt * kPi;
    angle[s] = theta;
    cosines[s] = std::cos(theta);
    sines[s] = std::sin(theta);
  }
  for (int r = 0; r < R; ++r) {
    const float* bb = p.B_bias + (static_cast<int64_t>(h) * R + r) * N;
    const float* cb = p.C_bias + (static_cast<int64_t>(h) * R + r) * N;
    for (int n = 0; n < N; ++n) {
      k[r * N + n] = B_normed[r * N + n] + bb[n];
      q[r * N + n] = C_normed[r * N + n] + cb[n];
    }
    rotate_halves(k + r * N, N, S, cosines, sines);
    rotate_halves(q + r * N, N, S, cosines, sines);
  }

  const float alpha = std::exp(A * dt);
  const float beta = (1.0f - trap) * dt * alpha;
  const float gamma = trap * dt;
  const float* x = w + layout.x + static_cast<int64_t>(h) * P;
  const float* z = w + layout.z + static_cast<int64_t>(h) * P;
  float* x_prev = state.x_prev + static_cast<int64_t>(h) * P;
  for (int r = 0; r < R; ++r) {
    const float* mx = p.mimo_x + (static_cast<int64_t>(h) * R + r) * P;
    for (int i = 0; i < P; ++i) {
      xv[r * P + i] = x[i] * mx[i];
      gx[r * P + i] = gamma * xv[r * P + i];
      bx[r * P + i] = beta * (x_prev[i] * mx[i]);
    }
  }

  float* ssm = state.ssm + static_cast<int64_t>(h) * P * N;
  const float D = p.D[h];
  for (int i = 0; i < P; ++i) {
    float* row = ssm + static_cast<int64_t>(i) * N;
    for (int n = 0; n < N; ++n) row[n] *= alpha;
    for (int r = 0; r < R; ++r) {
      const float g = gx[r * P + i], b = bx[r * P + i];
      const float* kr = k + r * N;
      const float* kp = state.k_prev + (static_cast<int64_t>(r) * H + h) * N;
      for (int n = 0; n < N; ++n) row[n] += g * kr[n] + b * kp[n];
    }
    for (int r = 0; r < R; ++r) y[r * P + i] = dot(row, q + r * N, N) + D * xv[r * P + i];
  }
  for (int r = 0; r < R; ++r) {
    std::copy(k + r * N, k + (r + 1) * N, state.k_prev + (static_cast<int64_t>(r) * H + h) * N);
  }
  std::copy(x, x + P, x_prev);

  if (d.outproj_norm) {
    const float* nw = p.norm + static_cast<int64_t>(h) * P;
    for (int r = 0; r < R; ++r) rmsnorm(y + r * P, nw, P, d.eps, y + r * P);
  }
  float* out = o + static_cast<int64_t>(h) * P;
  std::fill(out, out + P, 0.0f);
  for (int r = 0; r < R; ++r) {
    const float* mz = p.mimo_z + (static_cast<int64_t>(h) * R + r) * P;
    const float* mo = p.mimo_o + (static_cast<int64_t>(h) * R + r) * P;
    for (int i = 0; i < P; ++i) out[i] += y[r * P + i] * silu(z[i] * mz[i]) * mo[i];
  }
}

}  // namespace m3::cpu
