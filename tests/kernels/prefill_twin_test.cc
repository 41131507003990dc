// The chunked prefill algorithm (the float64 twin of kernels/prefill_scan.cuh) against the
// decode recurrence run token by token: outputs and the whole state after runs that start
// and end inside chunks, at several chunk sizes, ranks, rotary fractions, with and without
// the grouped output norm, and for a run read in pieces. No GPU needed.
#include <gtest/gtest.h>

#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "prefill_twin.h"

namespace m3 {
namespace {

std::vector<float> random_rows(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.5f, 1.5f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

void expect_states_near(const twin::HeadStates& a, const twin::HeadStates& b, double tol) {
  EXPECT_LE(twin::max_rel_diff(a.ssm, b.ssm), tol) << "ssm";
  EXPECT_LE(twin::max_rel_diff(a.angle, b.angle), tol) << "angle";
  EXPECT_LE(twin::max_rel_diff(a.k_prev, b.k_prev), tol) << "k_prev";
  EXPECT_LE(twin::max_rel_diff(a.x_prev, b.x_prev), tol) << "x_prev";
}

struct Case {
  twin::ScanDims d;
  int chunk_tokens;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "H" << c.d.H << " P" << c.d.P << " N" << c.d.N << " R" << c.d.R << " S" << c.d.S
      << (c.d.out_norm ? " out_norm" : "") << (c.d.mimo_rotation ? "" : " pairs") << " chunk " << c.chunk_tokens;
}

class ChunkedTwin : public ::testing::TestWithParam<Case> {};

TEST_P(ChunkedTwin, MatchesStepByStepForEveryRunLength) {
  const Case c = GetParam();
  const twin::InProjSplit split = twin::in_proj_split(c.d, 3);
  const twin::ScanParams p = twin::random_params(c.d, 11);
  for (int T : {1, 2, 15, 16, 17, 63, 64, 65, 255}) {
    SCOPED_TRACE("T " + std::to_string(T));
    const std::vector<float> w = random_rows(static_cast<size_t>(T) * split.stride, 100 + T);
    twin::HeadStates step = twin::random_state(c.d, 7), chunked = step;
    std::vector<double> o_step, o_chunked;
    twin::step_run(c.d, p, split, w.data(), T, step, o_step);
    twin::chunked_run(c.d, p, split, w.data(), T, c.chunk_tokens, chunked, o_chunked);
    EXPECT_LE(twin::max_rel_diff(o_chunked, o_step), 1e-9);
    expect_states_near(chunked, step, 1e-9);
  }
}

TEST_P(ChunkedTwin, RunReadInPiecesMatchesOneRun) {
  const Case c = GetParam();
  const twin::InProjSplit split = twin::in_proj_split(c.d, 0);
  const twin::ScanParams p = twin::random_params(c.d, 12);
  const int T = 100;
  const std::vector<float> w = random_rows(static_cast<size_t>(T) * split.stride, 5);
  twin::HeadStates step = twin::random_state(c.d, 8), pieces = step;
  std::vector<double> o_step, o_piece, o_pieces;
  twin::step_run(c.d, p, split, w.data(), T, step, o_step);
  int t = 0;
  for (int len : {1, 18, 33, 48}) {
    twin::chunked_run(c.d, p, split, w.data() + static_cast<size_t>(t) * split.stride, len, c.chunk_tokens, pieces,
                      o_piece);
    o_pieces.insert(o_pieces.end(), o_piece.begin(), o_piece.end());
    t += len;
  }
  ASSERT_EQ(t, T);
  EXPECT_LE(twin::max_rel_diff(o_pieces, o_step), 1e-9);
  expect_states_near(pieces, step, 1e-9);
}

twin::ScanDims dims(int H, int P, int N, int R, double rope, bool out_norm, bool mimo_rotation = true) {
  twin::ScanDims d;
  d.H = H; d.P = P; d.N = N; d.R = R;
  d.S = static_cast<int>(N * rope) / 2;
  d.out_norm = out_norm;
  d.mimo_rotation = mimo_rotation;
  return d;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ChunkedTwin,
    ::testing::Values(Case{dims(2, 16, 32, 4, 0.5, false), 16}, Case{dims(2, 16, 32, 4, 1.0, true), 32},
                      Case{dims(3, 8, 16, 2, 0.5, true), 16}, Case{dims(1, 16, 16, 1, 1.0, false), 64},
                      Case{dims(2, 8, 32, 8, 0.5, false), 8}, Case{dims(2, 8, 16, 1, 1.0, false, false), 16}));

}  // namespace
}  // namespace m3
