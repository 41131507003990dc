#include "reference_decoder.h"

#include <cmath>

namespace m3::testing {
namespace {

double silu(double v) { return v / (1.0 + std::exp(-v)); }

std::vector<double> rmsnorm(const std::vector<double>& v, const double* weight, size_t n,
                            size_t offset = 0) {
  double ss = 0;
  for (size_t i = 0; i < n; ++i) ss += v[offset + i] * v[offset + i];
  const double scale = 1.0 / std::sqrt(ss / static_cast<double>(n) + 1e-5);
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = v[offset + i] * scale * weight[i];
  return out;
}

}  // namespace

ReferenceDecoder::ReferenceDecoder(const ModelWeights& weights)
    : c_(weights.config()), weights_(weights) {
  reset();
}

void ReferenceDecoder::reset() {
  const size_t H = c_.n_heads(), P = c_.ssm.headdim, N = c_.ssm.d_state, R = c_.ssm.mimo_rank;
  state_.assign(static_cast<size_t>(c_.n_layer),
                LayerState{std::vector<double>(H * c_.n_angles()), std::vector<double>(H * P * N),
                           std::vector<double>(R * H * N), std::vector<double>(H * P)});
}

const std::vector<double>& ReferenceDecoder::w(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    const std::vector<float> f = to_f32(name == "<head>" ? weights_.lm_head() : weights_.tensor(name));
    it = tensors_.emplace(name, std::vector<double>(f.begin(), f.end())).first;
  }
  return it->second;
}

std::vector<double> ReferenceDecoder::linear(const std::string& name,
                                             const std::vector<double>& x) const {
  const std::vector<double>& W = w(name);
  const size_t in = x.size(), out = W.size() / in;
  std::vector<double> y(out, 0.0);
  for (size_t o = 0; o < out; ++o) {
    for (size_t i = 0; i < in; ++i) y[o] += W[o * in + i] * x[i];
  }
  return y;
}

std::vector<double> ReferenceDecoder::mixer(int layer, const std::vector<double>& u) {
  const std::string L = "backbone.layers." + std::to_string(layer) + ".mixer.";
  const size_t H = c_.n_heads(), P = c_.ssm.headdim, N = c_.ssm.d_state, R = c_.ssm.mimo_rank;
  const size_t S = c_.n_angles(), DI = c_.d_inner();
  LayerState& st = state_[static_cast<size_t>(layer)];

  const std::vector<double> proj = linear(L + "in_proj.weight", u);
  size_t at = 0;
  const auto take = [&](size_t n) {
    std::vector<double> v(proj.begin() + static_cast<long>(at), proj.begin() + static_cast<long>(at + n));
    at += n;
    return v;
  };
  const auto z = take(DI), x = take(DI), Braw = take(R * N), Craw = take(R * N);
  const auto dd_dt = take(H), dd_A = take(H), trap_raw = take(H), ang = take(S);

  std::vector<double> Bn(R * N), Cn(R * N);
  for (size_t r = 0; r < R; ++r) {
    const auto b = rmsnorm(Braw, w(L + "B_norm.weight").data(), N, r * N);
    const auto cc = rmsnorm(Craw, w(L + "C_norm.weight").data(), N, r * N);
    for (size_t n = 0; n < N; ++n) {
      Bn[r * N + n] = b[n];
      Cn[r * N + n] = cc[n];
    }
  }

  std::vector<double> o(DI, 0.0);
  for (size_t h = 0; h < H; ++h) {
    const double pre = dd_dt[h] + w(L + "dt_bias")[h];
    const double dt = pre > 20 ? pre : std::log1p(std::exp(pre));
    double A = -(std::max(dd_A[h], 0.0) + 1.0 / (1.0 - std::min(dd_A[h], 0.0)));
    A = std::min(A, -c_.ssm.A_floor);
    const double trap = 1.0 / (1.0 + std::exp(-trap_raw[h]));

    std::vector<double> theta(S);
    for (size_t s = 0; s < S; ++s) {
      theta[s] = st.angle[h * S + s] + std::tanh(ang[s]) * dt * M_PI;
      st.angle[h * S + s] = theta[s];
    }
    std::vector<double> q(R * N), k(R * N);
    for (size_t r = 0; r < R; ++r) {
      for (size_t n = 0; n < N; ++n) {
        q[r * N + n] = Cn[r * N + n] + w(L + "C_bias")[(h * R + r) * N + n];
        k[r * N + n] = Bn[r * N + n] + w(L + "B_bias")[(h * R + r) * N + n];
      }
      for (size_t i = 0; i < S; ++i) {
        const double cs = std::cos(theta[i]), sn = std::sin(theta[i]);
        for (double* v : {&q[r * N], &k[r * N]}) {
          const double a = v[i], b = v[i + N / 2];
          v[i] = a * cs - b * sn;
          v[i + N / 2] = a * sn + b * cs;
        }
      }
    }

    const double alpha = std::exp(A * dt), beta = (1 - trap) * dt * alpha, gamma = trap * dt;
    const auto& mx = w(L + "mimo_x");
    const auto& mz = w(L + "mimo_z");
    const auto& mo = w(L + "mimo_o");
    std::vector<double> y(R * P, 0.0);
    for (size_t p = 0; p < P; ++p) {
      for (size_t n = 0; n < N; ++n) {
        double sum = alpha * st.ssm[(h * P + p) * N + n];
        for (size_t r = 0; r < R; ++r) {
          const double m = mx[(h * R + r) * P + p];
          sum += gamma * x[h * P + p] * m * k[r * N + n];
          sum += beta * st.x_prev[h * P + p] * m * st.k_prev[(r * H + h) * N + n];
        }
        st.ssm[(h * P + p) * N + n] = sum;
      }
      for (size_t r = 0; r < R; ++r) {
        double acc = 0;
        for (size_t n = 0; n < N; ++n) acc += st.ssm[(h * P + p) * N + n] * q[r * N + n];
        y[r * P + p] = acc + w(L + "D")[h] * x[h * P + p] * mx[(h * R + r) * P + p];
      }
    }
    for (size_t r = 0; r < R; ++r) {
      for (size_t n = 0; n < N; ++n) st.k_prev[(r * H + h) * N + n] = k[r * N + n];
    }
    for (size_t p = 0; p < P; ++p) st.x_prev[h * P + p] = x[h * P + p];

    if (c_.ssm.is_outproj_norm) {
      for (size_t r = 0; r < R; ++r) {
        const auto yn = rmsnorm(y, w(L + "norm.weight").data() + h * P, P, r * P);
        for (size_t p = 0; p < P; ++p) y[r * P + p] = yn[p];
      }
    }
    for (size_t p = 0; p < P; ++p) {
      for (size_t r = 0; r < R; ++r) {
        const double zv = z[h * P + p] * mz[(h * R + r) * P + p];
        o[h * P + p] += y[r * P + p] * silu(zv) * mo[(h * R + r) * P + p];
      }
    }
  }
  return linear(L + "out_proj.weight", o);
}

std::vector<double> ReferenceDecoder::step(int token) {
  const size_t d = c_.d_model;
  const auto& emb = w("backbone.embedding.weight");
  std::vector<double> h(emb.begin() + static_cast<long>(token * d),
                        emb.begin() + static_cast<long>((token + 1) * d));
  std::vector<double> res(d, 0.0);
  for (int l = 0; l < c_.n_layer; ++l) {
    const std::string L = "backbone.layers." + std::to_string(l) + ".";
    for (size_t i = 0; i < d; ++i) res[i] += h[i];
    h = mixer(l, rmsnorm(res, w(L + "norm.weight").data(), d));
    if (c_.has_mlp()) {
      for (size_t i = 0; i < d; ++i) res[i] += h[i];
      const auto ag = linear(L + "mlp.fc1.weight", rmsnorm(res, w(L + "norm2.weight").data(), d));
      const size_t F = ag.size() / 2;
      std::vector<double> act(F);
      for (size_t i = 0; i < F; ++i) act[i] = ag[i] * silu(ag[F + i]);
      h = linear(L + "mlp.fc2.weight", act);
    }
  }
  for (size_t i = 0; i < d; ++i) res[i] += h[i];
  return linear("<head>", rmsnorm(res, w("backbone.norm_f.weight").data(), d));
}

}  // namespace m3::testing
