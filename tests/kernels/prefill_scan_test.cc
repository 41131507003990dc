// The five prefill scan kernels (kernels/prefill_scan.cuh) against the float64 step twin
// (tests/kernels/prefill_twin.h): several runs per call, each its own slot with its own
// state parity, lengths that start and end inside chunks (1 to 255 tokens), both
// precisions, ranks 1 to 8, rotary fractions 0.5 and 1.0, MIMO and adjacent-pair rotation,
// the grouped output norm on and off. Every o entry starts as NaN and must be written; the
// full state of every run's slot is compared, and everything else must stay untouched.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/mimo_step.cuh"
#include "kernels/prefill_chunk_choice.h"
#include "kernels/prefill_scan.cuh"
#include "model/tensor.h"
#include "prefill_twin.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

using kernels::ScanPrecision;
using testing::DeviceArray;

struct GpuCase {
  twin::ScanDims d;
  ScanPrecision precision;
  // in_proj rows a multiple of 8 floats and o rows of even length, as the engine lays them
  // out: the bf16 shapes the register-fragment chunk kernels take then run on them.
  bool aligned = false;
};

std::string name_of(const GpuCase& c) {
  return "H" + std::to_string(c.d.H) + " P" + std::to_string(c.d.P) + " N" + std::to_string(c.d.N) + " R" +
         std::to_string(c.d.R) + " S" + std::to_string(c.d.S) + (c.d.out_norm ? " out_norm" : "") +
         (c.d.mimo_rotation ? "" : " pairs") + (c.precision == ScanPrecision::Fp32 ? " fp32" : " bf16") + (c.aligned ? " aligned" : "");
}

// gtest prints parameters into the ctest names: the shape, not the struct's bytes.
void PrintTo(const GpuCase& c, std::ostream* os) { *os << name_of(c); }

twin::HeadStates read_state(const twin::ScanDims& d, const kernels::MimoStateLayout& L, const std::vector<float>& st,
                            int64_t base, int parity) {
  const int64_t H = d.H, P = d.P, N = d.N, R = d.R, S = d.S;
  twin::HeadStates h;
  h.angle.assign(st.begin() + base + L.angle + parity * H * S, st.begin() + base + L.angle + (parity + 1) * H * S);
  h.ssm.assign(st.begin() + base + L.ssm, st.begin() + base + L.ssm + H * P * N);
  h.k_prev.assign(st.begin() + base + L.k_prev + parity * H * R * N,
                  st.begin() + base + L.k_prev + (parity + 1) * H * R * N);
  h.x_prev.assign(st.begin() + base + L.x_prev, st.begin() + base + L.x_prev + H * P);
  return h;
}

std::vector<double> widen(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// Which state pass a call takes: the plan's, or one of the two whatever the run count.
enum class StatePass { Planned, Deep, Shallow };
// Which angles kernel: the plan's (by the longest run), or one of the two whatever the runs.
enum class AnglesPath { Planned, Serial, Segmented };

// Where a call of runs of one chunk each finishes their states: planned (the chunk state
// kernel, where it runs on register fragments), or the state pass.
enum class WholeRuns { Planned, StatePass };

// What a call left: o (as fp32) and every slot's state.
struct CallResult {
  std::vector<float> o, state;
};

// One call of launch_prefill_scan over `lengths` (run i on slot slots[i]); checks o and states.
CallResult run_call(const GpuCase& c, const std::vector<int>& lengths, const std::vector<int>& slots, uint32_t seed,
                    StatePass pass = StatePass::Planned, AnglesPath angles = AnglesPath::Planned,
                    WholeRuns whole = WholeRuns::Planned) {
  SCOPED_TRACE(name_of(c) + " seed " + std::to_string(seed) +
               (pass == StatePass::Deep ? ", deep state pass" : pass == StatePass::Shallow ? ", shallow state pass" : "") +
               (angles == AnglesPath::Serial ? ", serial angles" : angles == AnglesPath::Segmented ? ", segmented angles" : ""));
  const twin::ScanDims& d = c.d;
  const bool fp32 = c.precision == ScanPrecision::Fp32;
  const kernels::MimoStateLayout L = kernels::mimo_state_layout(d.H, d.P, d.N, d.R, d.S);
  kernels::PrefillScanDims kd{d.H, d.P, d.N, d.R, d.S, c.precision};
  kernels::PrefillScanPlan plan = kernels::prepare_prefill_scan(kd);
  if (pass != StatePass::Planned) plan.deep_state_pass_max_runs = pass == StatePass::Deep ? 1 << 30 : 0;
  if (angles != AnglesPath::Planned) plan.serial_angles_max_tokens = angles == AnglesPath::Serial ? 1 << 30 : 0;
  if (whole == WholeRuns::StatePass) plan.single_chunk_runs_in_state_kernel = false;
  const int n_runs = static_cast<int>(lengths.size());
  const int n_slots = n_runs + 2;  // slot 0 and the last one take no run
  const int64_t slot_stride = 2 * L.floats, layer_offset = L.floats;  // the second of two layers
  twin::InProjSplit split = twin::in_proj_split(d, 5);
  if (c.aligned) split.stride = (split.stride + 7) / 8 * 8;
  const twin::ScanParams p = twin::random_params(d, seed);

  std::vector<int32_t> token_begin(n_runs + 1), chunk_begin(n_runs + 1), parity(n_runs), slot32(slots.begin(), slots.end());
  const int chunk_tokens = kernels::prefill_chunk_tokens(kd);
  const int n_chunks = kernels::fill_prefill_runs(std::vector<int32_t>(lengths.begin(), lengths.end()), chunk_tokens,
                                                  token_begin.data(), chunk_begin.data());
  const int T = token_begin[n_runs];
  for (int i = 0; i < n_runs; ++i) parity[i] = (i * 7 + static_cast<int>(seed)) & 1;

  const std::vector<float> w = testing::random_floats(static_cast<size_t>(T) * split.stride, seed + 50, -1.5f, 1.5f);
  const std::vector<float> state0 = testing::random_floats(static_cast<size_t>(n_slots) * slot_stride, seed + 51, -0.5f, 0.5f);
  const int di = d.H * d.P, o_stride = di + (c.aligned ? 2 : 3);

  DeviceArray<float> dw(w), dstate(state0);
  DeviceArray<float> dt_bias(p.dt_bias), D(p.D), B_bias(p.B_bias), C_bias(p.C_bias), B_norm(p.B_norm),
      C_norm(p.C_norm), mimo_x(p.mimo_x), mimo_z(p.mimo_z), mimo_o(p.mimo_o), out_norm(p.out_norm);
  DeviceArray<int32_t> dslot(slot32), dparity(parity), dtok(token_begin), dchunk(chunk_begin);
  DeviceArray<unsigned char> ws(kernels::prefill_scan_workspace_bytes(kd, T, n_runs));
  ws.poison();
  DeviceArray<float> o32(static_cast<size_t>(T) * o_stride);
  DeviceArray<uint16_t> o16(static_cast<size_t>(T) * o_stride);
  o32.poison();
  o16.poison();

  kernels::PrefillScanArgs a;
  a.dims = kd;
  a.plan = plan;
  a.mimo_rotation = d.mimo_rotation;
  a.a_floor = static_cast<float>(d.a_floor);
  a.norm_eps = static_cast<float>(d.eps);
  a.w = dw.get();
  a.w_stride = split.stride;
  a.off_z = split.z; a.off_x = split.x; a.off_B = split.B; a.off_C = split.C;
  a.off_dt = split.dt; a.off_A = split.A; a.off_trap = split.trap; a.off_ang = split.ang;
  a.dt_bias = dt_bias.get(); a.D = D.get(); a.B_bias = B_bias.get(); a.C_bias = C_bias.get();
  a.B_norm = B_norm.get(); a.C_norm = C_norm.get();
  a.mimo_x = mimo_x.get(); a.mimo_z = mimo_z.get(); a.mimo_o = mimo_o.get();
  a.out_norm = d.out_norm ? out_norm.get() : nullptr;
  a.state = dstate.get();
  a.slot_stride = slot_stride;
  a.layer_offset = layer_offset;
  a.runs = kernels::PrefillRuns{dslot.get(), dparity.get(), dtok.get(), dchunk.get(), n_runs, T, n_chunks,
                                *std::max_element(lengths.begin(), lengths.end())};
  a.ws = kernels::prefill_scan_workspace(kd, T, n_runs, ws.get());
  a.o = fp32 ? static_cast<void*>(o32.get()) : static_cast<void*>(o16.get());
  a.o_stride = o_stride;
  a.o_bf16 = !fp32;
  kernels::launch_prefill_scan(a, nullptr);
  M3_CUDA_CHECK(cudaDeviceSynchronize());

  std::vector<float> o(static_cast<size_t>(T) * o_stride);
  if (fp32) {
    o = o32.download();
  } else {
    const std::vector<uint16_t> bits = o16.download();
    for (size_t i = 0; i < bits.size(); ++i) o[i] = bf16_to_f32(bits[i]);
  }
  const std::vector<float> state = dstate.download();
  // The columns past H*P in each o row are not the kernels': they keep the poison.
  size_t o_pad_written = 0;
  for (int t = 0; t < T; ++t)
    for (int j = di; j < o_stride; ++j) o_pad_written += std::isnan(o[static_cast<size_t>(t) * o_stride + j]) ? 0 : 1;
  EXPECT_EQ(o_pad_written, 0u) << "o entries past H*P written";
  // fp32: the angles grow to thousands of radians over a long run, where fp32 sums (the
  // decode step's too) drift by ~1e-3 rad from float64; an indexing error costs O(1).
  const double tol_o = fp32 ? 2e-3 : 3e-2, tol_ssm = fp32 ? 2e-3 : 2e-2, tol_vec = 2e-3;

  // The workspace's intermediates against the chunked twin's, run by run: a kernel that
  // disagrees shows here by name before its errors reach o and the state.
  const std::vector<unsigned char> wsh = ws.download();
  auto host_of = [&](const void* dev) {
    return wsh.data() + (static_cast<const unsigned char*>(dev) - static_cast<const unsigned char*>(static_cast<void*>(ws.get())));
  };
  auto floats_of = [&](const float* dev, size_t from, size_t n) {
    const float* h = reinterpret_cast<const float*>(host_of(dev)) + from;
    return std::vector<double>(h, h + n);
  };
  auto halves_of = [&](const __half* dev, size_t from, size_t n) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(host_of(dev)) + from;
    std::vector<double> v(n);
    for (size_t k = 0; k < n; ++k) v[k] = f16_to_f32(h[k]);
    return v;
  };
  const size_t H = d.H, PN = static_cast<size_t>(d.P) * d.N, RN = static_cast<size_t>(d.R) * d.N;
  for (int i = 0; i < n_runs; ++i) {
    SCOPED_TRACE("intermediates of run " + std::to_string(i) + " (" + std::to_string(lengths[i]) + " tokens)");
    twin::HeadStates scratch = read_state(d, L, state0, slots[i] * slot_stride + layer_offset, parity[i]);
    std::vector<double> o_unused;
    twin::ChunkTrace tr;
    twin::chunked_run(d, p, split, w.data() + static_cast<size_t>(token_begin[i]) * split.stride, lengths[i],
                      chunk_tokens, scratch, o_unused, &tr);
    const size_t t0 = token_begin[i], len = lengths[i], c0 = chunk_begin[i], nc = chunk_begin[i + 1] - chunk_begin[i];
    EXPECT_LE(twin::max_rel_diff(floats_of(a.ws.tok_a, t0 * H, len * H), tr.tok_a), 1e-5) << "tok_a";
    EXPECT_LE(twin::max_rel_diff(floats_of(a.ws.tok_gamma, t0 * H, len * H), tr.tok_gamma), 1e-5) << "tok_gamma";
    EXPECT_LE(twin::max_rel_diff(floats_of(a.ws.tok_bterm, t0 * H, len * H), tr.tok_bterm), 1e-5) << "tok_bterm";
    EXPECT_LE(twin::max_rel_diff(floats_of(a.ws.tok_dt, t0 * H, len * H), tr.tok_dt), 1e-5) << "tok_dt";
    EXPECT_LE(twin::max_rel_diff(floats_of(a.ws.b_norm, t0 * RN, len * RN), tr.b_norm), 1e-5) << "b_norm";
    EXPECT_LE(twin::max_rel_diff(floats_of(a.ws.c_norm, t0 * RN, len * RN), tr.c_norm), 1e-5) << "c_norm";
    // fp16 keeps 11 significant bits: each value rounded to within 2^-11 of itself.
    EXPECT_LE(twin::max_rel_diff(halves_of(a.ws.b_norm_h, t0 * RN, len * RN), tr.b_norm), 5e-4) << "b_norm_h";
    EXPECT_LE(twin::max_rel_diff(halves_of(a.ws.c_norm_h, t0 * RN, len * RN), tr.c_norm), 5e-4) << "c_norm_h";
    if (d.S > 0) {
      const float* rot = reinterpret_cast<const float*>(host_of(a.ws.rot)) + 2 * t0 * H * d.S;
      double worst = 0;
      for (size_t k = 0; k < len * H * d.S; ++k) {
        const double dc = std::abs(rot[2 * k] - std::cos(tr.theta[k])), ds = std::abs(rot[2 * k + 1] - std::sin(tr.theta[k]));
        worst = std::isnan(dc + ds) ? INFINITY : std::max({worst, dc, ds});
      }
      EXPECT_LE(worst, 2e-3) << "cos/sin of the angles";
    }
    // Decays are compared as their logs (the chunk's sum of a), where fp32 holds them; over
    // long chunks a decay may be below fp32's smallest normal, and there it must be as small.
    const std::vector<double> decay_got = floats_of(a.ws.chunk_decay, c0 * H, nc * H);
    std::vector<double> log_got, log_expect;
    size_t decay_bad = 0;
    for (size_t k = 0; k < decay_got.size(); ++k) {
      if (tr.chunk_decay[k] > 1e-30) {
        log_got.push_back(std::log(decay_got[k]));
        log_expect.push_back(std::log(tr.chunk_decay[k]));
      } else if (!(decay_got[k] <= 1e-29)) {
        ++decay_bad;
      }
    }
    EXPECT_LE(twin::max_rel_diff(log_got, log_expect), 1e-5) << "chunk_decay";
    EXPECT_EQ(decay_bad, 0u) << "chunk_decay below fp32's range";
    std::vector<double> state_in(nc * H * PN);
    if (fp32) {
      state_in = floats_of(static_cast<const float*>(a.ws.chunk_state_in), c0 * H * PN, nc * H * PN);
    } else {
      const uint16_t* b = reinterpret_cast<const uint16_t*>(host_of(a.ws.chunk_state_in)) + c0 * H * PN;
      for (size_t k = 0; k < state_in.size(); ++k) state_in[k] = bf16_to_f32(b[k]);
    }
    EXPECT_LE(twin::max_rel_diff(state_in, tr.chunk_state_in), tol_ssm) << "state entering each chunk";
  }

  std::vector<bool> slot_used(n_slots, false);
  for (int i = 0; i < n_runs; ++i) {
    SCOPED_TRACE("run " + std::to_string(i) + " of " + std::to_string(lengths[i]) + " tokens, slot " +
                 std::to_string(slots[i]) + ", parity " + std::to_string(parity[i]));
    slot_used[slots[i]] = true;
    const int64_t base = slots[i] * slot_stride + layer_offset;
    twin::HeadStates expect = read_state(d, L, state0, base, parity[i]);
    std::vector<double> o_expect;
    twin::step_run(d, p, split, w.data() + static_cast<size_t>(token_begin[i]) * split.stride, lengths[i], expect,
                   o_expect);
    std::vector<double> o_got;
    for (int t = token_begin[i]; t < token_begin[i + 1]; ++t)
      for (int j = 0; j < di; ++j) o_got.push_back(o[static_cast<size_t>(t) * o_stride + j]);
    EXPECT_LE(twin::max_rel_diff(o_got, o_expect), tol_o) << "o";
    const int parity_new = (parity[i] + lengths[i]) & 1;
    const twin::HeadStates got = read_state(d, L, state, base, parity_new);
    EXPECT_LE(twin::max_rel_diff(got.ssm, expect.ssm), tol_ssm) << "ssm";
    EXPECT_LE(twin::max_rel_diff(got.angle, expect.angle), tol_vec) << "angle";
    EXPECT_LE(twin::max_rel_diff(got.k_prev, expect.k_prev), tol_vec) << "k_prev";
    EXPECT_LE(twin::max_rel_diff(got.x_prev, expect.x_prev), 0.0) << "x_prev";
    // The first layer of the slot is not this call's.
    EXPECT_EQ(0, std::memcmp(state.data() + slots[i] * slot_stride, state0.data() + slots[i] * slot_stride,
                             sizeof(float) * layer_offset));
  }
  for (int s = 0; s < n_slots; ++s) {
    if (slot_used[s]) continue;
    EXPECT_EQ(0, std::memcmp(state.data() + s * slot_stride, state0.data() + s * slot_stride, sizeof(float) * slot_stride))
        << "slot " << s << " took no run but changed";
  }
  return {o, state};
}

twin::ScanDims dims(int H, int P, int N, int R, double rope, bool out_norm, bool mimo_rotation = true) {
  twin::ScanDims d;
  d.H = H; d.P = P; d.N = N; d.R = R;
  d.S = static_cast<int>(N * rope) / 2;
  d.out_norm = out_norm;
  d.mimo_rotation = mimo_rotation;
  return d;
}

class PrefillScanGpu : public ::testing::TestWithParam<GpuCase> {};

TEST_P(PrefillScanGpu, MatchesStepTwinOnEveryRunLength) {
  M3_REQUIRE_CUDA_DEVICE();
  // Runs of 1, 2, 15, 16, 17, 63, 64, 65 and 255 tokens over two calls, slots out of order.
  run_call(GetParam(), {17, 1, 255, 64, 2}, {3, 1, 5, 2, 4}, 1);
  run_call(GetParam(), {15, 65, 16, 63}, {2, 4, 1, 3}, 2);
}

// A chunk finds its run by one warp-wide lookup up to 31 runs and by a search past them:
// 31 and 32 runs sit on either side of that line.
TEST_P(PrefillScanGpu, ManyShortRunsFindTheirChunks) {
  M3_REQUIRE_CUDA_DEVICE();
  for (const int n_runs : {13, 31, 32, 33}) {
    std::vector<int> lengths, slots;
    for (int i = 0; i < n_runs; ++i) {
      lengths.push_back(i % 3 == 0 ? 1 : i % 3 == 1 ? 2 : 33);
      slots.push_back(n_runs - i);
    }
    run_call(GetParam(), lengths, slots, 4 + n_runs);
  }
}

TEST_P(PrefillScanGpu, OneLongRun) {
  M3_REQUIRE_CUDA_DEVICE();
  run_call(GetParam(), {1000}, {1}, 3);
}

// The plan picks the state pass by the run count; each must hold for any count, over
// runs whose chunks fill several windows of decays (1000 tokens: 32 chunks or more) and
// runs shorter than one.
TEST_P(PrefillScanGpu, BothStatePassesMatchTheStepTwin) {
  M3_REQUIRE_CUDA_DEVICE();
  for (const StatePass pass : {StatePass::Deep, StatePass::Shallow}) {
    run_call(GetParam(), {1000, 17}, {2, 1}, 6, pass);
    run_call(GetParam(), {1100}, {1}, 7, pass);
  }
}

// The plan picks the angles kernel by the call's longest run; each must hold for any runs:
// short ones (one thread a run's angle, token by token) and long ones (segments).
TEST_P(PrefillScanGpu, BothAnglesKernelsMatchTheStepTwin) {
  M3_REQUIRE_CUDA_DEVICE();
  for (const AnglesPath angles : {AnglesPath::Serial, AnglesPath::Segmented}) {
    run_call(GetParam(), {8, 1, 64, 33, 8}, {3, 1, 5, 2, 4}, 8, StatePass::Planned, angles);
    run_call(GetParam(), {300, 5}, {2, 1}, 9, StatePass::Planned, angles);
  }
}

// Runs of one chunk each (a burst of short prompts): the chunk state kernel finishes their
// states itself, with the state pass's arithmetic, so both paths give the same bits.
TEST_P(PrefillScanGpu, RunsOfOneChunkFinishedByEitherKernelAlike) {
  M3_REQUIRE_CUDA_DEVICE();
  // Six runs (a chunk finds its run by one warp-wide lookup) and forty (by a search).
  std::vector<int> many, many_slots;
  for (int i = 0; i < 40; ++i) {
    many.push_back(1 + (i * 7) % 16);
    many_slots.push_back(40 - i);
  }
  for (const auto& [lengths, slots] : {std::pair{std::vector<int>{8, 1, 32, 5, 8, 31}, std::vector<int>{3, 1, 5, 2, 6, 4}},
                                       std::pair{many, many_slots}}) {
    const CallResult planned = run_call(GetParam(), lengths, slots, 10);
    const CallResult passed = run_call(GetParam(), lengths, slots, 10, StatePass::Planned, AnglesPath::Planned,
                                       WholeRuns::StatePass);
    ASSERT_EQ(planned.o.size(), passed.o.size());
    ASSERT_EQ(planned.state.size(), passed.state.size());
    EXPECT_EQ(0, std::memcmp(planned.o.data(), passed.o.data(), sizeof(float) * planned.o.size())) << "o";
    EXPECT_EQ(0, std::memcmp(planned.state.data(), passed.state.data(), sizeof(float) * planned.state.size()))
        << "states";
  }
}

TEST(PrefillScanPlan, DeepStatePassWhereItsWholeGridIsResident) {
  M3_REQUIRE_CUDA_DEVICE();
  // A run of s2s-14l's layer is 8 x 28 blocks of the pass, one of the small shape's 1 x 2:
  // the same resident blocks X give runs of X / 224 and X / 2.
  const kernels::PrefillScanPlan s2s =
      kernels::prepare_prefill_scan(kernels::PrefillScanDims{28, 64, 128, 4, 32, ScanPrecision::Bf16TensorCores});
  const kernels::PrefillScanPlan small =
      kernels::prepare_prefill_scan(kernels::PrefillScanDims{2, 16, 32, 2, 8, ScanPrecision::Bf16TensorCores});
  ASSERT_GE(small.deep_state_pass_max_runs, 1);
  const int x_lo = 2 * small.deep_state_pass_max_runs, x_hi = x_lo + 1;
  EXPECT_TRUE(s2s.deep_state_pass_max_runs == x_lo / 224 || s2s.deep_state_pass_max_runs == x_hi / 224)
      << s2s.deep_state_pass_max_runs << " runs for s2s-14l, " << small.deep_state_pass_max_runs << " for the small shape";
}

std::vector<GpuCase> cases() {
  std::vector<GpuCase> out;
  for (ScanPrecision prec : {ScanPrecision::Bf16TensorCores, ScanPrecision::Fp32}) {
    out.push_back({dims(2, 64, 128, 4, 0.5, false), prec});  // the s2s head shape
    out.push_back({dims(2, 64, 128, 4, 1.0, true), prec});
    out.push_back({dims(3, 16, 32, 2, 0.5, true), prec});
    out.push_back({dims(2, 32, 48, 1, 1.0, false), prec});
    out.push_back({dims(1, 16, 32, 8, 0.5, false), prec});
    out.push_back({dims(2, 16, 16, 1, 1.0, false, false), prec});
    // Three angles on one head: k_prev then starts 8 bytes past a 16-byte boundary.
    out.push_back({dims(1, 16, 32, 2, 0.1875, false), prec});
  }
  for (const twin::ScanDims& d : {dims(2, 64, 128, 4, 0.5, false), dims(2, 64, 128, 4, 1.0, true),
                                  dims(3, 16, 32, 2, 0.5, true), dims(1, 16, 32, 8, 0.5, false),
                                  dims(2, 32, 96, 1, 1.0, false), dims(2, 48, 64, 2, 1.0, true)}) {
    out.push_back({d, ScanPrecision::Bf16TensorCores, true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, PrefillScanGpu, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<GpuCase>& info) { return "case" + std::to_string(info.index); });

TEST(PrefillScanHost, RefusesShapesTheKernelsCannotRun) {
  using kernels::PrefillScanDims;
  EXPECT_NE(test::error_of<std::invalid_argument>([] {
              kernels::prepare_prefill_scan(PrefillScanDims{4, 80, 128, 4, 32, ScanPrecision::Fp32});
            }).find("headdim must be a multiple of 16, at most 64"),
            std::string::npos);
  EXPECT_NE(test::error_of<std::invalid_argument>([] {
              kernels::prepare_prefill_scan(PrefillScanDims{4, 64, 256, 4, 32, ScanPrecision::Fp32});
            }).find("d_state must be a multiple of 16, at most 128"),
            std::string::npos);
  EXPECT_NE(test::error_of<std::invalid_argument>([] {
              kernels::prepare_prefill_scan(PrefillScanDims{4, 64, 128, 3, 32, ScanPrecision::Fp32});
            }).find("mimo_rank must be 1, 2, 4 or 8"),
            std::string::npos);
  EXPECT_FALSE(kernels::prefill_scan_shape_refusal(PrefillScanDims{28, 64, 128, 4, 32, ScanPrecision::Bf16TensorCores}));
}

// No device needed: which chunk kernels a call takes is decided on the host. The s2s-14l head
// takes the register-fragment kernels within the RTX 5090's shared memory; a shape whose
// plan would pass it, or rows the 16-byte copies cannot take, go to the general kernels.
TEST(PrefillScanHost, RegisterFragmentKernelsTakeTheS2sHeadWithinTheSharedMemoryLimit) {
  using kernels::PrefillScanDims;
  const PrefillScanDims s2s{28, 64, 128, 4, 32, ScanPrecision::Bf16TensorCores};
  EXPECT_LE(kernels::prefill_detail::chunk_tc_smem_bytes(s2s, true), static_cast<int>(kernels::kMaxSharedBytesPerBlock));
  EXPECT_LE(kernels::prefill_detail::chunk_tc_smem_bytes(s2s, false), static_cast<int>(kernels::kMaxSharedBytesPerBlock));
  // Every pair rotated (rope_fraction 1.0): the output kernel's fp16 rotation tables lie
  // under its Xv, so the plan grows no larger.
  const PrefillScanDims full_rope{28, 64, 128, 4, 64, ScanPrecision::Bf16TensorCores};
  EXPECT_EQ(kernels::prefill_detail::chunk_tc_smem_bytes(full_rope, true),
            kernels::prefill_detail::chunk_tc_smem_bytes(s2s, true));
  EXPECT_LE(kernels::prefill_detail::chunk_tc_smem_bytes(full_rope, false), static_cast<int>(kernels::kMaxSharedBytesPerBlock));
  const auto* aligned = reinterpret_cast<const float*>(uintptr_t{1} << 20);  // never dereferenced
  kernels::PrefillScanArgs a;
  a.dims = s2s;
  a.w = aligned;
  a.w_stride = 4736;  // the engine's: in_proj's rows padded to a multiple of 64
  a.off_z = 0;
  a.off_x = 28 * 64;
  a.B_bias = a.C_bias = a.mimo_x = a.mimo_z = a.mimo_o = aligned;
  a.o_stride = 28 * 64;
  EXPECT_TRUE(kernels::prefill_detail::chunk_tc_applies(a));
  a.w_stride = 4730;  // x rows 8 bytes past a 16-byte boundary
  EXPECT_FALSE(kernels::prefill_detail::chunk_tc_applies(a));
  a.w_stride = 4736;
  a.dims.precision = ScanPrecision::Fp32;
  EXPECT_FALSE(kernels::prefill_detail::chunk_tc_applies(a));
  // Rank 2 with every pair rotated: 64 tokens of x, z and angles a chunk, over the limit.
  a.dims = PrefillScanDims{4, 64, 128, 2, 64, ScanPrecision::Bf16TensorCores};
  a.off_x = 4 * 64;
  a.o_stride = 4 * 64;
  EXPECT_GT(kernels::prefill_detail::chunk_tc_smem_bytes(a.dims, true), static_cast<int>(kernels::kMaxSharedBytesPerBlock));
  EXPECT_FALSE(kernels::prefill_detail::chunk_tc_applies(a));
}

// No device needed: the check comes before any launch.
TEST(PrefillScanHost, RefusesAStateLayoutItCannotMoveInFloat4) {
  kernels::PrefillScanArgs a;
  a.dims = kernels::PrefillScanDims{2, 64, 128, 4, 32, ScanPrecision::Bf16TensorCores};
  a.state = reinterpret_cast<float*>(uintptr_t{1} << 20);  // aligned, never dereferenced
  a.slot_stride = 1024;
  a.layer_offset = 6;
  a.runs.n_runs = 1;
  a.runs.n_tokens = 1;
  a.runs.n_chunks = 1;
  EXPECT_NE(test::error_of<std::invalid_argument>([&] { kernels::launch_prefill_scan(a, nullptr); })
                .find("layer_offset (6)"),
            std::string::npos);
}

TEST(PrefillScanHost, RunTableCountsChunksAndRefusesEmptyRuns) {
  std::vector<int32_t> tb(4), cb(4);
  EXPECT_EQ(kernels::fill_prefill_runs(std::vector<int32_t>{1, 32, 33}, 32, tb.data(), cb.data()), 1 + 1 + 2);
  EXPECT_EQ(tb, (std::vector<int32_t>{0, 1, 33, 66}));
  EXPECT_EQ(cb, (std::vector<int32_t>{0, 1, 2, 4}));
  EXPECT_NE(test::error_of<std::invalid_argument>([&] {
              kernels::fill_prefill_runs(std::vector<int32_t>{4, 0}, 32, tb.data(), cb.data());
            }).find("run 1 has 0 tokens"),
            std::string::npos);
  EXPECT_LE(4, kernels::prefill_max_chunks(66, 3, 32));
}

// The workspace's areas lie inside the bytes it asks for, 256-byte aligned and apart, sized
// for the largest call: the chunks' S~ and deltas in the operand type.
TEST(PrefillScanHost, WorkspaceAreasLieApartInsideItsSize) {
  for (const ScanPrecision precision : {ScanPrecision::Bf16TensorCores, ScanPrecision::Fp32}) {
    const kernels::PrefillScanDims d{28, 64, 128, 4, 32, precision};
    const int max_tokens = 2048, max_runs = 8;
    const size_t bytes = kernels::prefill_scan_workspace_bytes(d, max_tokens, max_runs);
    alignas(256) static unsigned char probe[1];  // never dereferenced: only addresses are compared
    const uintptr_t base = reinterpret_cast<uintptr_t>(probe);
    const kernels::PrefillScanWorkspace w = kernels::prefill_scan_workspace(d, max_tokens, max_runs, probe);
    const size_t T = max_tokens, H = d.heads, RN = 4 * 128, PN = 64 * 128, S = d.n_angles;
    const size_t C = kernels::prefill_max_chunks(max_tokens, max_runs, kernels::prefill_chunk_tokens(d));
    const size_t op = precision == ScanPrecision::Fp32 ? 4 : 2;
    auto at = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
    std::vector<std::pair<uintptr_t, size_t>> areas = {
        {at(w.tok_a), 4 * T * H},          {at(w.tok_gamma), 4 * T * H},     {at(w.tok_bterm), 4 * T * H},
        {at(w.tok_dt), 4 * T * H},         {at(w.b_norm), 4 * T * RN},       {at(w.c_norm), 4 * T * RN},
        {at(w.b_norm_h), 2 * T * RN},      {at(w.c_norm_h), 2 * T * RN},     {at(w.rot), 8 * T * H * S},
        {at(w.chunk_decay), 4 * C * H},    {at(w.chunk_delta), op * C * H * PN},
        {at(w.chunk_state_in), op * C * H * PN},
    };
    std::sort(areas.begin(), areas.end());
    for (size_t i = 0; i < areas.size(); ++i) {
      SCOPED_TRACE("area at offset " + std::to_string(areas[i].first - base));
      EXPECT_EQ((areas[i].first - base) % 256, 0u);
      EXPECT_GE(areas[i].first, base);
      EXPECT_LE(areas[i].first + areas[i].second, base + bytes);
      if (i + 1 < areas.size()) EXPECT_LE(areas[i].first + areas[i].second, areas[i + 1].first);
    }
    EXPECT_EQ(areas.back().first + areas.back().second, base + bytes);  // no slack past the last area
  }
}

}  // namespace
}  // namespace m3
