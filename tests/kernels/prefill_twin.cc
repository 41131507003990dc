#include "prefill_twin.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace m3::twin {
namespace {

std::vector<float> uniform(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

struct TokenTerms {
  double dt, a, gamma, bterm;
};

TokenTerms token_terms(const ScanDims& d, const ScanParams& p, const InProjSplit& s, const float* row, int h) {
  const double v = static_cast<double>(row[s.dt + h]) + p.dt_bias[h];
  const double dt = v > 20 ? v : std::log1p(std::exp(v));
  const double dA = row[s.A + h];
  const double A = std::min(-(std::max(dA, 0.0) + 1.0 / (1.0 - std::min(dA, 0.0))), -d.a_floor);
  const double trap = 1.0 / (1.0 + std::exp(-static_cast<double>(row[s.trap + h])));
  return {dt, A * dt, trap * dt, (1 - trap) * dt};
}

// RMS-normed B (is_b) or C row r of a token, before bias.
std::vector<double> normed(const ScanDims& d, const ScanParams& p, const InProjSplit& s, const float* row, bool is_b,
                           int r) {
  const float* src = row + (is_b ? s.B : s.C) + r * d.N;
  const std::vector<float>& nw = is_b ? p.B_norm : p.C_norm;
  double ss = 0;
  for (int n = 0; n < d.N; ++n) ss += static_cast<double>(src[n]) * src[n];
  const double sc = 1.0 / std::sqrt(ss / d.N + d.eps);
  std::vector<double> out(d.N);
  for (int n = 0; n < d.N; ++n) out[n] = src[n] * sc * nw[n];
  return out;
}

// Bias and rotation by theta (S angles) of a normed vector.
std::vector<double> biased_rotated(const ScanDims& d, std::vector<double> v, const float* bias, const double* theta) {
  for (int n = 0; n < d.N; ++n) v[n] += bias[n];
  const int half = d.N / 2;
  for (int i = 0; i < half && i < d.S; ++i) {
    const int i0 = d.mimo_rotation ? i : 2 * i, i1 = d.mimo_rotation ? i + half : 2 * i + 1;
    const double c = std::cos(theta[i]), sn = std::sin(theta[i]);
    const double a = v[i0], b = v[i1];
    v[i0] = a * c - b * sn;
    v[i1] = a * sn + b * c;
  }
  return v;
}

// Step 6 of the decode page for one token and head: y [R][P] -> o [P].
void output_stage(const ScanDims& d, const ScanParams& p, const InProjSplit& s, const float* row, int h,
                  const std::vector<std::vector<double>>& y, double* o) {
  std::vector<double> rs(d.R, 1.0);
  if (d.out_norm) {
    for (int r = 0; r < d.R; ++r) {
      double ss = 0;
      for (int pp = 0; pp < d.P; ++pp) ss += y[r][pp] * y[r][pp];
      rs[r] = 1.0 / std::sqrt(ss / d.P + d.eps);
    }
  }
  for (int pp = 0; pp < d.P; ++pp) {
    double out = 0;
    for (int r = 0; r < d.R; ++r) {
      double yv = y[r][pp];
      if (d.out_norm) yv *= rs[r] * p.out_norm[h * d.P + pp];
      const int hr = (h * d.R + r) * d.P + pp;
      const double zv = static_cast<double>(row[s.z + h * d.P + pp]) * p.mimo_z[hr];
      out += yv * (zv / (1 + std::exp(-zv))) * p.mimo_o[hr];
    }
    o[h * d.P + pp] = out;
  }
}

}  // namespace

InProjSplit in_proj_split(const ScanDims& d, int extra) {
  InProjSplit s;
  const int di = d.H * d.P;
  s.z = 0;
  s.x = di;
  s.B = 2 * di;
  s.C = s.B + d.R * d.N;
  s.dt = s.C + d.R * d.N;
  s.A = s.dt + d.H;
  s.trap = s.A + d.H;
  s.ang = s.trap + d.H;
  s.stride = s.ang + d.S + extra;
  return s;
}

ScanParams random_params(const ScanDims& d, uint32_t seed) {
  ScanParams p;
  p.dt_bias = uniform(d.H, seed + 1, -2.f, 0.5f);
  p.D = uniform(d.H, seed + 2, -1.f, 1.f);
  p.B_bias = uniform(static_cast<size_t>(d.H) * d.R * d.N, seed + 3, -0.3f, 0.3f);
  p.C_bias = uniform(static_cast<size_t>(d.H) * d.R * d.N, seed + 4, -0.3f, 0.3f);
  p.B_norm = uniform(d.N, seed + 5, 0.5f, 1.5f);
  p.C_norm = uniform(d.N, seed + 6, 0.5f, 1.5f);
  p.mimo_x = uniform(static_cast<size_t>(d.H) * d.R * d.P, seed + 7, -1.f, 1.f);
  p.mimo_z = uniform(static_cast<size_t>(d.H) * d.R * d.P, seed + 8, -1.f, 1.f);
  p.mimo_o = uniform(static_cast<size_t>(d.H) * d.R * d.P, seed + 9, -1.f, 1.f);
  p.out_norm = uniform(static_cast<size_t>(d.H) * d.P, seed + 10, 0.5f, 1.5f);
  return p;
}

HeadStates random_state(const ScanDims& d, uint32_t seed) {
  auto dbl = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  HeadStates st;
  st.angle = dbl(uniform(static_cast<size_t>(d.H) * d.S, seed + 1, -3.f, 3.f));
  st.ssm = dbl(uniform(static_cast<size_t>(d.H) * d.P * d.N, seed + 2, -0.5f, 0.5f));
  st.k_prev = dbl(uniform(static_cast<size_t>(d.H) * d.R * d.N, seed + 3, -1.f, 1.f));
  st.x_prev = dbl(uniform(static_cast<size_t>(d.H) * d.P, seed + 4, -1.f, 1.f));
  return st;
}

void step_run(const ScanDims& d, const ScanParams& p, const InProjSplit& s, const float* w, int T, HeadStates& st,
              std::vector<double>& o) {
  const int H = d.H, P = d.P, N = d.N, R = d.R, S = d.S;
  o.assign(static_cast<size_t>(T) * H * P, 0.0);
  for (int t = 0; t < T; ++t) {
    const float* row = w + static_cast<size_t>(t) * s.stride;
    for (int h = 0; h < H; ++h) {
      const TokenTerms tt = token_terms(d, p, s, row, h);
      const double alpha = std::exp(tt.a), beta = tt.bterm * alpha, gamma = tt.gamma;
      double* theta = st.angle.data() + h * S;
      for (int i = 0; i < S; ++i) theta[i] += std::tanh(static_cast<double>(row[s.ang + i])) * tt.dt * M_PI;
      std::vector<std::vector<double>> k(R), q(R);
      for (int r = 0; r < R; ++r) {
        k[r] = biased_rotated(d, normed(d, p, s, row, true, r), &p.B_bias[(h * R + r) * N], theta);
        q[r] = biased_rotated(d, normed(d, p, s, row, false, r), &p.C_bias[(h * R + r) * N], theta);
      }
      std::vector<std::vector<double>> y(R, std::vector<double>(P));
      for (int pp = 0; pp < P; ++pp) {
        const double x = row[s.x + h * P + pp], xp = st.x_prev[h * P + pp];
        double* srow = &st.ssm[(static_cast<size_t>(h) * P + pp) * N];
        for (int n = 0; n < N; ++n) {
          double v = alpha * srow[n];
          for (int r = 0; r < R; ++r) {
            const double mx = p.mimo_x[(h * R + r) * P + pp];
            v += gamma * x * mx * k[r][n] + beta * xp * mx * st.k_prev[(h * R + r) * N + n];
          }
          srow[n] = v;
        }
        for (int r = 0; r < R; ++r) {
          double acc = 0;
          for (int n = 0; n < N; ++n) acc += srow[n] * q[r][n];
          y[r][pp] = acc + p.D[h] * x * p.mimo_x[(h * R + r) * P + pp];
        }
        st.x_prev[h * P + pp] = x;
      }
      for (int r = 0; r < R; ++r)
        for (int n = 0; n < N; ++n) st.k_prev[(h * R + r) * N + n] = k[r][n];
      output_stage(d, p, s, row, h, y, &o[static_cast<size_t>(t) * H * P]);
    }
  }
}

void chunked_run(const ScanDims& d, const ScanParams& p, const InProjSplit& s, const float* w, int T,
                 int chunk_tokens, HeadStates& st, std::vector<double>& o, ChunkTrace* trace) {
  const int H = d.H, P = d.P, N = d.N, R = d.R, S = d.S;
  o.assign(static_cast<size_t>(T) * H * P, 0.0);
  auto row_of = [&](int t) { return w + static_cast<size_t>(t) * s.stride; };
  const int chunks = (T + chunk_tokens - 1) / chunk_tokens;
  if (trace != nullptr) {
    const size_t TH = static_cast<size_t>(T) * H;
    trace->tok_a.assign(TH, 0); trace->tok_gamma.assign(TH, 0); trace->tok_bterm.assign(TH, 0); trace->tok_dt.assign(TH, 0);
    trace->theta.assign(TH * S, 0);
    trace->b_norm.assign(static_cast<size_t>(T) * R * N, 0);
    trace->c_norm.assign(static_cast<size_t>(T) * R * N, 0);
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) {
        const std::vector<double> b = normed(d, p, s, row_of(t), true, r), c = normed(d, p, s, row_of(t), false, r);
        std::copy(b.begin(), b.end(), trace->b_norm.begin() + (static_cast<size_t>(t) * R + r) * N);
        std::copy(c.begin(), c.end(), trace->c_norm.begin() + (static_cast<size_t>(t) * R + r) * N);
      }
    trace->chunk_decay.assign(static_cast<size_t>(chunks) * H, 0);
    trace->chunk_state_in.assign(static_cast<size_t>(chunks) * H * P * N, 0);
  }
  for (int h = 0; h < H; ++h) {
    // Token terms and the angle scan (kernels 1 and 2).
    std::vector<TokenTerms> tt(T);
    std::vector<double> theta(static_cast<size_t>(T) * S);
    std::vector<double> carry(st.angle.begin() + h * S, st.angle.begin() + (h + 1) * S);
    for (int t = 0; t < T; ++t) {
      tt[t] = token_terms(d, p, s, row_of(t), h);
      for (int i = 0; i < S; ++i) {
        carry[i] += std::tanh(static_cast<double>(row_of(t)[s.ang + i])) * tt[t].dt * M_PI;
        theta[static_cast<size_t>(t) * S + i] = carry[i];
        if (trace != nullptr) trace->theta[(static_cast<size_t>(t) * H + h) * S + i] = carry[i];
      }
      if (trace != nullptr) {
        const size_t i = static_cast<size_t>(t) * H + h;
        trace->tok_a[i] = tt[t].a; trace->tok_gamma[i] = tt[t].gamma;
        trace->tok_bterm[i] = tt[t].bterm; trace->tok_dt[i] = tt[t].dt;
      }
    }
    // Rotated k and q of every (token, rank) row, and xv.
    std::vector<std::vector<double>> k(static_cast<size_t>(T) * R), q(static_cast<size_t>(T) * R);
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) {
        const double* th = &theta[static_cast<size_t>(t) * S];
        k[t * R + r] = biased_rotated(d, normed(d, p, s, row_of(t), true, r), &p.B_bias[(h * R + r) * N], th);
        q[t * R + r] = biased_rotated(d, normed(d, p, s, row_of(t), false, r), &p.C_bias[(h * R + r) * N], th);
      }
    auto xv = [&](int t, int r, int pp) {
      return static_cast<double>(row_of(t)[s.x + h * P + pp]) * p.mimo_x[(h * R + r) * P + pp];
    };
    // S~ entering the first chunk: the slot's state plus its previous token's term (kernel 4).
    std::vector<double> Sst(st.ssm.begin() + static_cast<size_t>(h) * P * N,
                            st.ssm.begin() + static_cast<size_t>(h + 1) * P * N);
    for (int pp = 0; pp < P; ++pp)
      for (int r = 0; r < R; ++r) {
        const double coef = tt[0].bterm * st.x_prev[h * P + pp] * p.mimo_x[(h * R + r) * P + pp];
        for (int n = 0; n < N; ++n) Sst[pp * N + n] += coef * st.k_prev[(h * R + r) * N + n];
      }
    for (int c0 = 0; c0 < T; c0 += chunk_tokens) {
      const int len = std::min(chunk_tokens, T - c0);
      std::vector<double> L(len), u(len), gam(len);
      double acc = 0;
      for (int i = 0; i < len; ++i) {
        acc += tt[c0 + i].a;
        L[i] = acc;
        gam[i] = tt[c0 + i].gamma;
        u[i] = gam[i] + (c0 + i + 1 < T ? tt[c0 + i + 1].bterm : 0.0);
      }
      if (trace != nullptr) {
        const size_t ch = static_cast<size_t>(c0 / chunk_tokens) * H + h;
        trace->chunk_decay[ch] = std::exp(L[len - 1]);
        std::copy(Sst.begin(), Sst.end(), trace->chunk_state_in.begin() + ch * P * N);
      }
      // Chunk output (kernel 5): inherited, masked intra-chunk and D terms.
      for (int i = 0; i < len; ++i) {
        const int t = c0 + i;
        std::vector<std::vector<double>> y(R, std::vector<double>(P));
        for (int r = 0; r < R; ++r) {
          const std::vector<double>& qv = q[t * R + r];
          // (Q K^T) .* M for this row, over the chunk's rows up to its own token.
          std::vector<double> coef(static_cast<size_t>(i + 1) * R);
          for (int j = 0; j <= i; ++j) {
            const double mask = j == i ? gam[i] : std::exp(L[i] - L[j]) * u[j];
            for (int r2 = 0; r2 < R; ++r2) {
              const std::vector<double>& kv = k[(c0 + j) * R + r2];
              double qk = 0;
              for (int n = 0; n < N; ++n) qk += qv[n] * kv[n];
              coef[j * R + r2] = qk * mask;
            }
          }
          for (int pp = 0; pp < P; ++pp) {
            double inh = 0;
            for (int n = 0; n < N; ++n) inh += qv[n] * Sst[pp * N + n];
            double v = std::exp(L[i]) * inh;
            for (int j = 0; j <= i; ++j)
              for (int r2 = 0; r2 < R; ++r2) v += coef[j * R + r2] * xv(c0 + j, r2, pp);
            y[r][pp] = v + p.D[h] * xv(t, r, pp);
          }
        }
        output_stage(d, p, s, row_of(t), h, y, &o[static_cast<size_t>(t) * H * P]);
      }
      // Chunk state (kernel 3) and the pass to the next chunk (kernel 4).
      std::vector<double> next(Sst.size());
      const double decay = std::exp(L[len - 1]);
      for (int pp = 0; pp < P; ++pp)
        for (int n = 0; n < N; ++n) {
          double v = decay * Sst[pp * N + n];
          for (int j = 0; j < len; ++j) {
            const double wj = std::exp(L[len - 1] - L[j]) * u[j];
            for (int r = 0; r < R; ++r) v += wj * xv(c0 + j, r, pp) * k[(c0 + j) * R + r][n];
          }
          next[pp * N + n] = v;
        }
      Sst = next;
    }
    std::copy(Sst.begin(), Sst.end(), st.ssm.begin() + static_cast<size_t>(h) * P * N);
    std::copy(carry.begin(), carry.end(), st.angle.begin() + h * S);
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < N; ++n) st.k_prev[(h * R + r) * N + n] = k[(T - 1) * R + r][n];
    for (int pp = 0; pp < P; ++pp) st.x_prev[h * P + pp] = row_of(T - 1)[s.x + h * P + pp];
  }
}

double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double diff = std::abs(a[i] - b[i]);
    num = std::isnan(diff) ? std::numeric_limits<double>::infinity() : std::max(num, diff);
    den = std::max(den, std::abs(b[i]));
  }
  return den > 0 ? num / den : num;
}

}  // namespace m3::twin
