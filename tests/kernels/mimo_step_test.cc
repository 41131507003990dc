// The fused MIMO step against a float64 CPU twin written from
// ../shared/docs/MAMBA3_MIMO_DECODE.md, on random state and inputs of odd sizes, over two
// steps (so the parity double-buffering of angle and k_prev is exercised), with and
// without the grouped output norm, halves and adjacent-pair rotation.
#include <cmath>
#include <algorithm>
#include <numeric>

#include "gpu_test_util.h"
#include "kernels/mimo_step.cuh"
#include "tests/error_of.h"

namespace m3 {
namespace {

using testing::DeviceArray;

struct Dims {
  int H, P, N, R, S;
  bool out_norm;
  bool mimo_rotation;
};

struct Params {
  std::vector<float> dt_bias, D, B_bias, C_bias, B_norm, C_norm, mimo_x, mimo_z, mimo_o, out_norm;
};

// One step for one sequence; state in the kernel's layout, parity selects the buffers.
void twin_step(const Dims& d, const kernels::MimoStateLayout& L, const Params& p, const float* w,
               int off_z, int off_x, int off_B, int off_C, int off_dt, int off_A, int off_trap,
               int off_ang, std::vector<double>& st, int parity, std::vector<double>& o) {
  const int H = d.H, P = d.P, N = d.N, R = d.R, S = d.S;
  auto norm_vec = [&](const float* src, const std::vector<float>& nw) {
    double ss = 0;
    for (int n = 0; n < N; ++n) ss += static_cast<double>(src[n]) * src[n];
    const double sc = 1.0 / std::sqrt(ss / N + 1e-5);
    std::vector<double> out(N);
    for (int n = 0; n < N; ++n) out[n] = src[n] * sc * nw[n];
    return out;
  };
  for (int h = 0; h < H; ++h) {
    const double v = w[off_dt + h] + p.dt_bias[h];
    const double dt = v > 20 ? v : std::log1p(std::exp(v));
    const double dA = w[off_A + h];
    double A = -(std::max(dA, 0.0) + 1.0 / (1.0 - std::min(dA, 0.0)));
    A = std::min(A, -1e-4);
    const double trap = 1.0 / (1.0 + std::exp(-static_cast<double>(w[off_trap + h])));
    const double alpha = std::exp(A * dt), beta = (1 - trap) * dt * alpha, gamma = trap * dt;
    std::vector<double> theta(S);
    for (int s = 0; s < S; ++s) {
      theta[s] = st[L.angle + parity * H * S + h * S + s] + std::tanh(static_cast<double>(w[off_ang + s])) * dt * M_PI;
      st[L.angle + (1 - parity) * H * S + h * S + s] = theta[s];
    }
    std::vector<std::vector<double>> k(R), q(R), kp(R);
    for (int r = 0; r < R; ++r) {
      k[r] = norm_vec(w + off_B + r * N, p.B_norm);
      q[r] = norm_vec(w + off_C + r * N, p.C_norm);
      for (int n = 0; n < N; ++n) {
        k[r][n] += p.B_bias[(h * R + r) * N + n];
        q[r][n] += p.C_bias[(h * R + r) * N + n];
      }
      for (int i = 0; i < N / 2; ++i) {
        if (i >= S) continue;
        const int i0 = d.mimo_rotation ? i : 2 * i, i1 = d.mimo_rotation ? i + N / 2 : 2 * i + 1;
        const double c = std::cos(theta[i]), s = std::sin(theta[i]);
        for (auto* vec : {&k[r], &q[r]}) {
          const double a = (*vec)[i0], b = (*vec)[i1];
          (*vec)[i0] = a * c - b * s;
          (*vec)[i1] = a * s + b * c;
        }
      }
      kp[r].resize(N);
      for (int n = 0; n < N; ++n) {
        kp[r][n] = st[L.k_prev + parity * H * R * N + (h * R + r) * N + n];
        st[L.k_prev + (1 - parity) * H * R * N + (h * R + r) * N + n] = k[r][n];
      }
    }
    std::vector<std::vector<double>> y(R, std::vector<double>(P));
    for (int pp = 0; pp < P; ++pp) {
      const double x = w[off_x + h * P + pp];
      const double xprev = st[L.x_prev + h * P + pp];
      std::vector<double> xv(R), xs(R);
      for (int r = 0; r < R; ++r) {
        xv[r] = x * p.mimo_x[(h * R + r) * P + pp];
        xs[r] = xprev * p.mimo_x[(h * R + r) * P + pp];
      }
      for (int n = 0; n < N; ++n) {
        double& s = st[L.ssm + (static_cast<int64_t>(h) * P + pp) * N + n];
        double v = alpha * s;
        for (int r = 0; r < R; ++r) v += gamma * xv[r] * k[r][n] + beta * xs[r] * kp[r][n];
        s = v;
      }
      for (int r = 0; r < R; ++r) {
        double acc = 0;
        for (int n = 0; n < N; ++n) acc += st[L.ssm + (static_cast<int64_t>(h) * P + pp) * N + n] * q[r][n];
        y[r][pp] = acc + p.D[h] * xv[r];
      }
      st[L.x_prev + h * P + pp] = x;
    }
    std::vector<double> rs(R, 1.0);
    if (d.out_norm) {
      for (int r = 0; r < R; ++r) {
        double ss = 0;
        for (int pp = 0; pp < P; ++pp) ss += y[r][pp] * y[r][pp];
        rs[r] = 1.0 / std::sqrt(ss / P + 1e-5);
      }
    }
    for (int pp = 0; pp < P; ++pp) {
      double out = 0;
      for (int r = 0; r < R; ++r) {
        double yv = y[r][pp];
        if (d.out_norm) yv *= rs[r] * p.out_norm[h * P + pp];
        const double zv = w[off_z + h * P + pp] * p.mimo_z[(h * R + r) * P + pp];
        out += yv * (zv / (1 + std::exp(-zv))) * p.mimo_o[(h * R + r) * P + pp];
      }
      o[h * P + pp] = out;
    }
  }
}

// tensor_cores: the tf32 variant (mimo_step_tc.cu), held to 1e-2 instead of 1e-5 (tf32
// keeps 10 mantissa bits: the largest of a few thousand outputs' errors reaches 8e-3).
// `policy` is the planner's; `want_variant`, when given, is part of what the plan must say
// it chose (KernelLaunch::variant).
void run_dims(const Dims& d, uint32_t seed, int batch = 3, int fuse_d_model = 0,
              WeightDType fuse_type = WeightDType::BF16, bool tensor_cores = false,
              const kernels::MimoStepPolicy& policy = {}, const std::string& want_variant = "") {
  SCOPED_TRACE("H " + std::to_string(d.H) + " P " + std::to_string(d.P) + " N " + std::to_string(d.N) +
               " R " + std::to_string(d.R) + " S " + std::to_string(d.S));
  const int H = d.H, P = d.P, N = d.N, R = d.R, S = d.S;
  const kernels::MimoStateLayout L = kernels::mimo_state_layout(H, P, N, R, S);
  const int d_inner = H * P;
  const int off_z = 0, off_x = d_inner, off_B = 2 * d_inner, off_C = off_B + R * N,
            off_dt = off_C + R * N, off_A = off_dt + H, off_trap = off_A + H, off_ang = off_trap + H;
  const int w_stride = off_ang + S + 1;  // odd stride
  // Slots 1..batch in reverse order; slot 0 takes no step.
  const int n_slots = batch + 1;
  std::vector<int32_t> slots(batch);
  for (int i = 0; i < batch; ++i) slots[i] = batch - i;
  const int64_t layer_offset = L.floats;  // test the second of two layers
  const int64_t slot_stride = 2 * L.floats;

  Params p;
  p.dt_bias = testing::random_floats(H, seed + 1, -2.f, 0.5f);
  p.D = testing::random_floats(H, seed + 2);
  p.B_bias = testing::random_floats(H * R * N, seed + 3, -0.3f, 0.3f);
  p.C_bias = testing::random_floats(H * R * N, seed + 4, -0.3f, 0.3f);
  p.B_norm = testing::random_floats(N, seed + 5, 0.5f, 1.5f);
  p.C_norm = testing::random_floats(N, seed + 6, 0.5f, 1.5f);
  p.mimo_x = testing::random_floats(H * R * P, seed + 7);
  p.mimo_z = testing::random_floats(H * R * P, seed + 8);
  p.mimo_o = testing::random_floats(H * R * P, seed + 9);
  p.out_norm = testing::random_floats(H * P, seed + 10, 0.5f, 1.5f);
  std::vector<float> state = testing::random_floats(n_slots * slot_stride, seed + 11, -0.5f, 0.5f);
  std::vector<uint64_t> counters(n_slots);
  for (int s = 0; s < n_slots; ++s) counters[s] = static_cast<uint64_t>(s * 3 + 5);  // mixed parities

  DeviceArray<float> dt_bias(p.dt_bias), D(p.D), B_bias(p.B_bias), C_bias(p.C_bias), B_norm(p.B_norm),
      C_norm(p.C_norm), mimo_x(p.mimo_x), mimo_z(p.mimo_z), mimo_o(p.mimo_o), out_norm(p.out_norm);
  DeviceArray<float> dstate(state);
  DeviceArray<int32_t> dslots(slots);
  DeviceArray<int32_t> dparities(batch);
  DeviceArray<float> dw(static_cast<size_t>(batch) * w_stride);
  DeviceArray<float> dout(static_cast<size_t>(batch) * (d_inner + 2));
  // Fused out_proj: W_out [fuse_d_model, d_inner], residual [batch, res_stride] with a
  // guard column past d_model (the tensor-core kernel needs a stride that is a multiple of 4).
  const int res_stride = fuse_d_model + (tensor_cores ? 4 : 1);
  std::vector<float> w_out = testing::random_floats(static_cast<size_t>(std::max(fuse_d_model, 1)) * d_inner, seed + 30);
  if (fuse_type == WeightDType::BF16) w_out = testing::round_bf16(w_out);
  DeviceArray<float> dw_out32(w_out);
  DeviceArray<uint16_t> dw_out16(testing::to_bf16(w_out));
  std::vector<float> residual = testing::random_floats(static_cast<size_t>(batch) * res_stride, seed + 31);
  DeviceArray<float> dres(residual);

  const double tol = tensor_cores ? 1e-2 : 1e-5;
  std::vector<std::vector<double>> twin_state(n_slots);
  for (int s = 0; s < n_slots; ++s)
    twin_state[s].assign(state.begin() + s * slot_stride + layer_offset,
                         state.begin() + s * slot_stride + layer_offset + L.floats);

  for (int step = 0; step < 2; ++step) {
    const std::vector<float> w = testing::random_floats(static_cast<size_t>(batch) * w_stride, seed + 20 + step, -1.5f, 1.5f);
    dw.upload(w);
    dout.poison();
    kernels::MimoStepArgs a;
    a.heads = H; a.headdim = P; a.d_state = N; a.rank = R; a.n_angles = S;
    a.mimo_rotation = d.mimo_rotation;
    a.w = dw.get(); a.w_stride = w_stride;
    a.off_z = off_z; a.off_x = off_x; a.off_B = off_B; a.off_C = off_C;
    a.off_dt = off_dt; a.off_A = off_A; a.off_trap = off_trap; a.off_ang = off_ang;
    a.dt_bias = dt_bias.get(); a.D = D.get(); a.B_bias = B_bias.get(); a.C_bias = C_bias.get();
    a.B_norm = B_norm.get(); a.C_norm = C_norm.get();
    a.mimo_x = mimo_x.get(); a.mimo_z = mimo_z.get(); a.mimo_o = mimo_o.get();
    a.out_norm = d.out_norm ? out_norm.get() : nullptr;
    a.state = dstate.get(); a.slot_stride = slot_stride; a.layer_offset = layer_offset;
    std::vector<int32_t> parities(batch);
    for (int b = 0; b < batch; ++b) parities[b] = static_cast<int32_t>(counters[slots[b]] & 1);
    dparities.upload(parities);
    a.slots = dslots.get(); a.parities = dparities.get();
    a.o = dout.get(); a.o_stride = d_inner + 2;
    a.batch = batch;
    a.tensor_cores = tensor_cores;
    if (fuse_d_model > 0) {
      a.out_proj = fuse_type == WeightDType::BF16 ? static_cast<const void*>(dw_out16.get()) : dw_out32.get();
      a.out_proj_type = fuse_type;
      a.residual = dres.get();
      a.residual_stride = res_stride;
      a.d_model = fuse_d_model;
      ASSERT_TRUE(kernels::mimo_step_can_fuse_out_proj(a, policy));
      dres.upload(residual);
    }
    const kernels::KernelLaunch plan = kernels::plan_mimo_step(a, policy);
    const bool streaming = want_variant.rfind("streaming", 0) == 0;
    ASSERT_EQ(plan.name(), !tensor_cores ? "mimo_step" : streaming ? "mimo_step_stream" : "mimo_step_tc");
    ASSERT_NE(plan.variant().find(want_variant), std::string::npos) << plan.variant();
    plan.launch(nullptr, false);
    M3_CUDA_CHECK(cudaDeviceSynchronize());

    const std::vector<float> out = dout.download();
    for (int b = 0; b < batch; ++b) {
      std::vector<double> o(d_inner);
      const int slot = slots[b];
      twin_step(d, L, p, w.data() + b * w_stride, off_z, off_x, off_B, off_C, off_dt, off_A, off_trap,
                off_ang, twin_state[slot], static_cast<int>(counters[slot] & 1), o);
      if (fuse_d_model > 0) {
        const std::vector<float> res_got = dres.download();
        std::vector<double> want(fuse_d_model);
        std::vector<float> got(fuse_d_model);
        for (int m = 0; m < fuse_d_model; ++m) {
          double acc = residual[b * res_stride + m];
          for (int k = 0; k < d_inner; ++k) acc += static_cast<double>(w_out[static_cast<size_t>(m) * d_inner + k]) * o[k];
          want[m] = acc;
          got[m] = res_got[b * res_stride + m];
        }
        EXPECT_LT(testing::max_rel_err(got, want), tol) << "fused out_proj, step " << step << " entry " << b;
        EXPECT_EQ(res_got[b * res_stride + fuse_d_model], residual[b * res_stride + fuse_d_model]);
      } else {
        std::vector<float> got(out.begin() + b * (d_inner + 2), out.begin() + b * (d_inner + 2) + d_inner);
        EXPECT_LT(testing::max_rel_err(got, o), tol) << "step " << step << " entry " << b;
      }
    }
    const std::vector<float> st = dstate.download();
    for (int s = 0; s < n_slots; ++s) {
      std::vector<float> got(st.begin() + s * slot_stride + layer_offset,
                             st.begin() + s * slot_stride + layer_offset + L.floats);
      // Only the buffers of the parity written this step are compared (the other holds old values).
      const int par = static_cast<int>(counters[s] & 1);
      std::vector<float> g2;
      std::vector<double> r2;
      auto take = [&](int64_t from, int64_t n) {
        for (int64_t i = from; i < from + n; ++i) { g2.push_back(got[i]); r2.push_back(twin_state[s][i]); }
      };
      take(L.ssm, static_cast<int64_t>(H) * P * N);
      take(L.x_prev, H * P);
      take(L.angle + (1 - par) * H * S, H * S);
      take(L.k_prev + (1 - par) * H * R * N, H * R * N);
      EXPECT_LT(testing::max_rel_err(g2, r2), tol) << "state of slot " << s << " after step " << step;
    }
    // The engine advances each stepped slot's count; do it here.
    for (int32_t s : slots) ++counters[s];
  }
  // Slot 0 took no step: untouched, bit for bit.
  const std::vector<float> st = dstate.download();
  for (int64_t i = 0; i < slot_stride; ++i) ASSERT_EQ(st[i], state[i]);
}

TEST(MimoStepKernel, MatchesTwinOverTwoSteps) {
  M3_REQUIRE_CUDA_DEVICE();
  run_dims({3, 48, 36, 4, 9, false, true}, 100);   // head split over p-chunks
  run_dims({2, 20, 16, 2, 8, true, true}, 200);    // grouped output norm, full rotation
  run_dims({5, 32, 28, 1, 7, false, false}, 300);  // SISO-style adjacent pairs, rank 1
  run_dims({1, 64, 128, 8, 32, false, true}, 400); // rank 8
}

TEST(MimoStepKernel, MatchesTwinAtBatchSizesThatPickOtherTilings) {
  M3_REQUIRE_CUDA_DEVICE();
  run_dims({3, 64, 128, 4, 32, false, true}, 500, 4);   // a whole head per block (batch >= 4)
  run_dims({3, 64, 128, 4, 32, false, true}, 550, 8);
  run_dims({2, 64, 128, 4, 32, false, true}, 600, 17);
  run_dims({2, 64, 96, 4, 12, true, true}, 700, 9);     // grouped norm at a large batch
}

// Large batches: many blocks per head shape, slots far apart in the state buffer.
// Tilings the planner picks for shapes the other tests do not reach: d_state above 128
// (two column halves), headdim 32 at batch >= 8, rank 8 and rank 1 with a whole head a
// block (batch >= 4).
TEST(MimoStepKernel, MatchesTwinInTheRemainingTilings) {
  M3_REQUIRE_CUDA_DEVICE();
  run_dims({2, 32, 256, 2, 64, false, true}, 3000, 3);
  run_dims({2, 16, 200, 4, 50, true, true}, 3050, 5);
  run_dims({3, 32, 64, 4, 16, false, true}, 3100, 9);
  run_dims({1, 64, 128, 8, 32, false, true}, 3200, 4);
  run_dims({2, 64, 64, 1, 16, false, true}, 3300, 5);
}

TEST(MimoStepKernel, MatchesTwinAtLargeBatches) {
  M3_REQUIRE_CUDA_DEVICE();
  run_dims({3, 48, 36, 4, 9, true, true}, 1000, 149);     // grouped norm, rows < 64
  run_dims({3, 64, 128, 2, 32, false, true}, 1100, 101);  // rank 2
  run_dims({2, 64, 128, 4, 32, false, true}, 1200, 150);  // the s2s-14l head shape
}

TEST(MimoStepKernel, FusedOutProjAddsIntoTheResidual) {
  M3_REQUIRE_CUDA_DEVICE();
  run_dims({3, 48, 36, 4, 9, false, true}, 800, 3, 101, WeightDType::BF16);
  run_dims({2, 32, 28, 2, 7, false, true}, 900, 5, 64, WeightDType::F32);
}

// The tensor-core variant with out_proj fused: a head's rows in blocks of 16, clusters of
// 4 blocks (one head, two heads of 32 rows, four of 16) or 8 (d_model 896: two heads)
// adding their products into the residual; several batch entries and ranks, and the
// grouped norm over a head's blocks (its sums shared in the cluster) and within one-block
// heads. Every run compares the residual (and the guard column past d_model) with the
// twin's.
TEST(MimoStepKernel, TensorCoreVariantFusesOutProj) {
  M3_REQUIRE_CUDA_DEVICE();
  const auto bf16 = WeightDType::BF16;
  run_dims({3, 64, 128, 4, 32, false, true}, 1900, 1, 112, bf16, true);
  run_dims({2, 64, 128, 4, 32, false, true}, 1950, 6, 48, bf16, true);
  run_dims({2, 32, 128, 4, 16, false, true}, 2000, 3, 64, bf16, true);
  run_dims({3, 64, 128, 2, 32, false, true}, 2200, 4, 32, bf16, true);
  run_dims({2, 64, 128, 1, 32, false, false}, 2300, 2, 896, bf16, true);
  run_dims({4, 16, 128, 4, 32, true, true}, 2400, 3, 64, bf16, true);
  run_dims({2, 64, 128, 4, 32, true, true}, 2500, 3, 64, bf16, true);   // 8 blocks, cluster 8
  run_dims({3, 64, 128, 4, 32, true, true}, 2600, 2, 48, bf16, true);   // 12 blocks, clusters 4
  // Headdim 48: three blocks a head, so clusters of 4 cut heads. Without the grouped norm
  // that is fine (with it the planner refuses to fuse: TensorCoreVariantRefusesToFuse...).
  run_dims({4, 48, 128, 4, 32, false, true}, 2700, 1, 96, bf16, true);
}

// What the tensor-core kernel cannot fuse (fp32 columns, a d_model over 1024 or not a
// multiple of 16, a residual stride not a multiple of 4, a d_state other than 128, blocks
// that do not fill clusters of 4); without out_proj it still applies.
TEST(MimoStepKernel, TensorCoreVariantRefusesToFuseWhatItCannot) {
  M3_REQUIRE_CUDA_DEVICE();
  DeviceArray<uint16_t> w_out(2048 * 128);
  DeviceArray<float> res(4 * 2052);
  kernels::MimoStepArgs a;
  a.heads = 2; a.headdim = 64; a.d_state = 128; a.rank = 4; a.n_angles = 32; a.batch = 1;
  a.tensor_cores = true;
  a.out_proj = w_out.get(); a.out_proj_type = WeightDType::BF16;
  a.residual = res.get(); a.residual_stride = 68; a.d_model = 64;
  EXPECT_TRUE(kernels::mimo_step_can_fuse_out_proj(a));
  EXPECT_TRUE(kernels::mimo_step_tc_applies(a));
  EXPECT_EQ(kernels::plan_mimo_step(a).grid().x, 2u * 4u);  // 4 blocks of 16 rows a head
  a.heads = 3;  // 12 blocks: clusters of 4, not 8
  EXPECT_TRUE(kernels::mimo_step_can_fuse_out_proj(a));
  a.heads = 2;
  a.d_model = 72;
  EXPECT_FALSE(kernels::mimo_step_can_fuse_out_proj(a));
  a.d_model = 1028; a.residual_stride = 1028;
  EXPECT_FALSE(kernels::mimo_step_can_fuse_out_proj(a));
  a.d_model = 64;
  a.residual_stride = 65;
  EXPECT_FALSE(kernels::mimo_step_can_fuse_out_proj(a));
  a.residual_stride = 68;
  a.out_proj_type = WeightDType::F32;
  EXPECT_FALSE(kernels::mimo_step_tc_applies(a));
  const std::string msg = test::error_of<std::invalid_argument>([&] { kernels::plan_mimo_step(a); });
  EXPECT_NE(msg.find("out_proj cannot be fused"), std::string::npos) << msg;
  a.out_proj_type = WeightDType::BF16;
  a.d_state = 64;
  EXPECT_FALSE(kernels::mimo_step_can_fuse_out_proj(a));
  a.d_state = 128;
  a.heads = 1; a.headdim = 32;  // two blocks of 16 rows
  EXPECT_FALSE(kernels::mimo_step_can_fuse_out_proj(a));
  a.heads = 4; a.headdim = 48; a.d_model = 96; a.residual_stride = 100;  // three blocks a head
  EXPECT_TRUE(kernels::mimo_step_tc_can_fuse_out_proj(a));
  DeviceArray<float> out_norm(4 * 48);
  a.out_norm = out_norm.get();  // its sums need a head's blocks in one cluster (it addressed
  EXPECT_FALSE(kernels::mimo_step_tc_can_fuse_out_proj(a));  // a cluster rank that does not exist)
  EXPECT_FALSE(kernels::mimo_step_can_fuse_out_proj(a));  // so the engine keeps out_proj apart
  a.out_norm = nullptr;
  a.heads = 2; a.headdim = 64; a.d_model = 64; a.residual_stride = 68;
  a.out_proj = nullptr;
  EXPECT_TRUE(kernels::mimo_step_tc_applies(a));
}

// The tensor-core variant: both column splits (N / 16 even or odd), ranks 1 to 4 (the
// update's 8 inner slots zero-padded), the grouped norm, adjacent-pair rotation, and a
// large batch of the s2s-14l head shape.
TEST(MimoStepKernel, TensorCoreVariantMatchesTwin) {
  M3_REQUIRE_CUDA_DEVICE();
  const auto bf16 = WeightDType::BF16;
  run_dims({3, 64, 128, 4, 32, false, true}, 1300, 5, 0, bf16, true);
  run_dims({2, 32, 32, 4, 8, false, true}, 1400, 3, 0, bf16, true);   // the tiny golden shape
  run_dims({2, 48, 48, 2, 12, true, true}, 1500, 4, 0, bf16, true);   // grouped norm, 3 groups
  run_dims({3, 16, 16, 1, 4, false, false}, 1600, 2, 0, bf16, true);  // SISO pairs, one warp
  run_dims({2, 64, 128, 4, 32, true, true}, 1700, 7, 0, bf16, true);  // small_norm_mlp's shape
  run_dims({2, 64, 128, 4, 32, false, true}, 1800, 150, 0, bf16, true);
  run_dims({2, 64, 128, 2, 32, false, true}, 1850, 3, 0, bf16, true);  // rank 2, two warps a tile
  run_dims({2, 64, 128, 1, 32, false, false}, 1870, 3, 0, bf16, true); // rank 1, two warps a tile
}

// The tensor-core kernel's other forms, each fixed by the policy and asserted in the plan:
// plain and streamed state loads (the planner streams in single-chain buckets up to batch
// 16, plain beyond and beside other chains) and one, two and four warps a row tile.
TEST(MimoStepKernel, TensorCoreVariantUnderEachPolicyMatchesTwin) {
  M3_REQUIRE_CUDA_DEVICE();
  const auto bf16 = WeightDType::BF16;
  uint32_t seed = 1900;
  for (const auto load : {kernels::StateLoad::Plain, kernels::StateLoad::Streamed}) {
    kernels::MimoStepPolicy policy;
    policy.state_load = load;
    const std::string want = load == kernels::StateLoad::Plain ? "plain state loads" : "streamed state loads";
    SCOPED_TRACE(want);
    run_dims({3, 64, 128, 4, 32, false, true}, seed++, 5, 0, bf16, true, policy, want);
    run_dims({2, 48, 48, 2, 12, true, true}, seed++, 20, 0, bf16, true, policy, want);
  }
  for (const int split : {1, 2, 4}) {
    kernels::MimoStepPolicy policy;
    policy.tc_column_split = split;
    const std::string want = std::to_string(split) + (split == 1 ? " warp" : " warps") + " a row tile";
    SCOPED_TRACE(want);
    run_dims({3, 64, 128, 4, 32, false, true}, seed++, 5, 0, bf16, true, policy, want);
    run_dims({2, 64, 64, 1, 16, true, false}, seed++, 3, 0, bf16, true, policy, want);
  }
  kernels::MimoStepPolicy at_end;
  at_end.trigger = kernels::RecurrenceTrigger::AtEnd;
  run_dims({2, 32, 32, 4, 8, false, true}, seed++, 3, 0, bf16, true, at_end, "trigger 0");
}

// The streaming kernel (persistent blocks, a head of many sequences each, the next ones'
// state staged ahead in shared memory): one sequence a block, several (the ring of stages
// refilled), a ragged last round, the grouped norm, ranks 1, 2 and 4, SISO pairs, heads
// of 16 and 32 rows and 32-column states (no swizzle below 8 pieces a row). Shapes it does
// not take fall back to the per-head kernel.
TEST(MimoStepKernel, StreamingVariantMatchesTwin) {
  M3_REQUIRE_CUDA_DEVICE();
  const auto bf16 = WeightDType::BF16;
  kernels::MimoStepPolicy policy;
  policy.streaming_min_batch = 1;
  run_dims({3, 64, 128, 4, 32, false, true}, 2100, 5, 0, bf16, true, policy, "streaming");
  run_dims({2, 64, 128, 4, 32, true, true}, 2110, 601, 0, bf16, true, policy, "streaming");
  run_dims({2, 64, 128, 2, 32, false, true}, 2120, 300, 0, bf16, true, policy, "streaming");
  run_dims({2, 64, 64, 1, 16, true, false}, 2130, 70, 0, bf16, true, policy, "streaming");
  run_dims({2, 32, 32, 4, 8, false, true}, 2140, 40, 0, bf16, true, policy, "streaming");
  run_dims({3, 16, 64, 4, 16, true, true}, 2150, 9, 0, bf16, true, policy, "streaming");
  run_dims({2, 48, 48, 2, 12, true, true}, 2160, 20, 0, bf16, true, policy, "tensor cores");
  policy.streaming_min_batch = 64;  // below it, the per-head kernel
  run_dims({2, 64, 128, 4, 32, false, true}, 2170, 63, 0, bf16, true, policy, "tensor cores");
  run_dims({2, 64, 128, 4, 32, false, true}, 2180, 64, 0, bf16, true, policy, "streaming");
}

// No device needed: whether the streaming kernel takes a head is decided on the host. The
// s2s-14l head (28 x 64 x 128, rank 4) takes it within the RTX 5090's shared memory with
// fp32 and bf16 state; other d_state values, state rows off 16 bytes and a fused out_proj
// do not.
TEST(MimoStepStreamHost, TakesTheS2sHeadWithinTheSharedMemoryLimit) {
  kernels::MimoStepArgs a;
  a.heads = 28; a.headdim = 64; a.d_state = 128; a.rank = 4; a.n_angles = 32;
  a.state = reinterpret_cast<float*>(uintptr_t{1} << 20);  // never dereferenced
  a.layer_offset = kernels::mimo_state_layout(28, 64, 128, 4, 32).floats;
  a.slot_stride = 14 * a.layer_offset;
  a.batch = 256;
  for (const bool bf16_state : {false, true}) {
    a.state_bf16 = bf16_state;
    EXPECT_TRUE(kernels::mimo_step_stream_applies(a)) << bf16_state;
    EXPECT_LE(kernels::mimo_step_stream_smem_bytes(a), kernels::kMaxSharedBytesPerBlock) << bf16_state;
  }
  a.state_bf16 = false;
  a.d_state = 96;
  EXPECT_FALSE(kernels::mimo_step_stream_applies(a));
  a.d_state = 128;
  a.layer_offset += 2;
  EXPECT_FALSE(kernels::mimo_step_stream_applies(a));
  a.layer_offset -= 2;
  int fused = 0;
  a.out_proj = &fused;
  EXPECT_FALSE(kernels::mimo_step_stream_applies(a));
}

TEST(MimoStepKernel, RefusesAPolicyItHasNoPlanFor) {
  M3_REQUIRE_CUDA_DEVICE();
  kernels::MimoStepArgs a;
  a.heads = 2; a.headdim = 16; a.d_state = 16; a.rank = 1; a.n_angles = 4; a.batch = 1;
  kernels::MimoStepPolicy policy;
  policy.tc_column_split = 3;
  const std::string msg = test::error_of<std::invalid_argument>([&] { kernels::plan_mimo_step(a, policy); });
  EXPECT_NE(msg.find("policy tc_column_split must be 0 (planned), 1, 2 or 4, got 3"), std::string::npos) << msg;
}

TEST(MimoStepKernel, TensorCoreVariantRefusesWhatItCannotDo) {
  M3_REQUIRE_CUDA_DEVICE();
  kernels::MimoStepArgs a;
  a.heads = 2; a.headdim = 64; a.d_state = 128; a.rank = 8; a.n_angles = 32; a.batch = 1;
  EXPECT_FALSE(kernels::mimo_step_tc_applies(a));  // rank 8 needs 16 inner slots
  a.rank = 4;
  EXPECT_TRUE(kernels::mimo_step_tc_applies(a));
  a.headdim = 40;
  EXPECT_FALSE(kernels::mimo_step_tc_applies(a));
  const std::string msg = test::error_of<std::invalid_argument>([&] { kernels::plan_mimo_step_tc(a); });
  EXPECT_NE(msg.find("headdim a multiple of 16"), std::string::npos) << msg;
}

TEST(MimoStepKernel, RejectsUnsupportedRank) {
  M3_REQUIRE_CUDA_DEVICE();
  kernels::MimoStepArgs a;
  a.heads = 2; a.headdim = 16; a.d_state = 16; a.rank = 3; a.n_angles = 4; a.batch = 1;
  const std::string msg = test::error_of<std::invalid_argument>([&] { kernels::plan_mimo_step(a); });
  EXPECT_NE(msg.find("mimo_rank must be 1, 2, 4 or 8"), std::string::npos) << msg;
}

}  // namespace
}  // namespace m3
