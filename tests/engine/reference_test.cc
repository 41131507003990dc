// The CPU engine against an independent float64 decoder on model variants the golden
// files do not cover: untied head, rope fraction 1.0, padded vocabulary, MLP with and
// without the outproj norm, MIMO rank 1 and 4.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "model/cpu/cpu_engine.h"
#include "model/weights.h"
#include "reference_decoder.h"
#include "test_models.h"

namespace m3 {
namespace {

struct Variant {
  std::string name;
  bool tied;
  double rope_fraction;
  int d_intermediate;
  bool outproj_norm;
  int mimo_rank;
  int vocab;
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

class AgainstFloat64 : public ::testing::TestWithParam<Variant> {};

TEST_P(AgainstFloat64, LogitsAgreeToFloat32Precision) {
  const Variant& v = GetParam();
  ModelConfig c = testing::small_config();
  c.tie_embeddings = v.tied;
  c.ssm.rope_fraction = v.rope_fraction;
  c.d_intermediate = v.d_intermediate;
  c.ssm.is_outproj_norm = v.outproj_norm;
  c.ssm.mimo_rank = v.mimo_rank;
  c.vocab_size = v.vocab;
  testing::ScratchDir dir("reference_" + v.name);
  testing::write_model(c, dir.path(), 11);
  const ModelWeights weights = ModelWeights::load(dir.path());

  EngineOptions o;
  o.max_slots = 2;
  auto engine = make_cpu_engine(weights, o);
  const int V = c.padded_vocab();
  // Two sequences in one batch; each against its own float64 decoder.
  testing::ReferenceDecoder ref0(weights), ref1(weights);
  const int32_t slots[] = {0, 1};
  std::vector<int32_t> sampled(2);
  std::vector<float> logits(2 * static_cast<size_t>(V));
  double worst = 0;
  for (int t = 0; t < 24; ++t) {
    const int32_t tokens[] = {(t * 37 + 1) % v.vocab, (t * 101 + 7) % v.vocab};
    engine->step(slots, tokens, sampled, logits);
    const std::vector<double> want[] = {ref0.step(tokens[0]), ref1.step(tokens[1])};
    for (int b = 0; b < 2; ++b) {
      ASSERT_EQ(want[b].size(), static_cast<size_t>(V));
      double max_diff = 0, max_ref = 0;
      for (int i = 0; i < V; ++i) {
        max_diff = std::max(max_diff, std::fabs(logits[static_cast<size_t>(b * V + i)] - want[b][i]));
        max_ref = std::max(max_ref, std::fabs(want[b][i]));
      }
      ASSERT_GT(max_ref, 0.1) << "degenerate logits";
      worst = std::max(worst, max_diff / max_ref);
    }
  }
  EXPECT_LE(worst, 1e-5) << v.name;
}

INSTANTIATE_TEST_SUITE_P(
    Variants, AgainstFloat64,
    ::testing::Values(Variant{"tied_rope_half_padded", true, 0.5, 0, false, 2, 203},
                      Variant{"untied_rope_full", false, 1.0, 0, false, 2, 203},
                      Variant{"mlp_outproj_norm", true, 0.5, 100, true, 2, 200},
                      Variant{"untied_mlp_no_norm_rope_full", false, 1.0, 130, false, 4, 197},
                      Variant{"rank1_outproj_norm", false, 0.5, 0, true, 1, 64}),
    [](const ::testing::TestParamInfo<Variant>& info) { return info.param.name; });

}  // namespace
}  // namespace m3
