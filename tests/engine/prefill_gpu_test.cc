// prefill() on the CUDA engine, both ways it can read a prompt (cuda.prefill: steps, the
// base class's decode step a token, and chunked, the GEMMs and the chunked scan), against
// an engine fed one step() at a time (fp32: the CPU engine; bf16: the CUDA engine itself):
// the lengths, model features, several slots in one call and a prompt in pieces that the
// CPU tests cover, within the golden tolerances (fp32 1e-3, bf16 3e-2) on the last prompt
// token's logits and on every continuation step's, which read the state, angles,
// k_prev/x_prev and next input prefill left (the continuation is teacher-forced so that a
// near tie does not cascade). Skips without a CUDA device.
#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "model/engine.h"
#include "model/random_model.h"
#include "model/weights.h"
#include "prefill_check.h"
#include "test_models.h"

namespace m3 {
namespace {

using testing::PrefillComparison;
using testing::ScratchDir;

struct GpuCase {
  const char* name;
  double rope_fraction;
  bool outproj_norm;
  int d_intermediate;
  WeightDType dtype;
  // The head's shape where it is not small_config's (0: small_config's).
  int d_state = 0, headdim = 0, rank = 0;
};

void PrintTo(const GpuCase& c, std::ostream* os) { *os << c.name; }

const char* path_name(PrefillPath p) { return p == PrefillPath::Chunked ? "chunked" : "steps"; }

}  // namespace
void PrintTo(PrefillPath p, std::ostream* os) { *os << path_name(p); }  // beside PrefillPath, for gtest
namespace {

class CudaPrefill : public ::testing::TestWithParam<std::tuple<GpuCase, PrefillPath>> {
 protected:
  const GpuCase& feature() const { return std::get<0>(GetParam()); }
  PrefillPath path() const { return std::get<1>(GetParam()); }
  void SetUp() override {
    if (!cuda_backend_available()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
    ModelConfig config = testing::small_config();
    config.ssm.rope_fraction = feature().rope_fraction;
    config.ssm.is_outproj_norm = feature().outproj_norm;
    config.d_intermediate = feature().d_intermediate;
    if (feature().d_state > 0) config.ssm.d_state = feature().d_state;
    if (feature().headdim > 0) config.ssm.headdim = feature().headdim;
    if (feature().rank > 0) config.ssm.mimo_rank = feature().rank;
    dir_ = std::make_unique<ScratchDir>(std::string("gpu_prefill_") + feature().name + "_" + path_name(path()));
    // bf16 cases store the weights in bf16, so that the fp32 CPU reference reads the very
    // weights the bf16 engine does and the comparison measures the engine alone.
    write_random_model(config, 7, feature().dtype == WeightDType::BF16 ? DType::BF16 : DType::F32, dir_->path());
    weights_ = std::make_unique<ModelWeights>(ModelWeights::load(dir_->path()));
  }
  std::unique_ptr<Engine> engine(int slots) {
    EngineOptions o;
    o.max_slots = slots;
    o.weight_dtype = feature().dtype;
    o.max_prefill_tokens = 8192;
    o.deterministic = true;
    o.cuda.prefill = path();
    auto e = make_engine("cuda", *weights_, o);
    EXPECT_EQ(e->has_prefill_path(), path() == PrefillPath::Chunked);
    EXPECT_EQ(e->max_prefill_tokens(), 8192);
    return e;
  }
  // The reference, one step() a token: fp32 cases, the CPU engine, each logit within 1e-3;
  // bf16 cases, the CUDA engine's own decode step (bf16 activations: its distance from the
  // fp32 CPU engine is m3check's to judge), within 3e-2 of the row's largest logit, the
  // golden tolerance's measure.
  std::unique_ptr<Engine> reference(int slots) {
    EngineOptions o;
    o.max_slots = slots;
    o.max_prefill_tokens = 8192;
    if (feature().dtype == WeightDType::F32) return make_engine("cpu", *weights_, o);
    o.weight_dtype = feature().dtype;
    o.deterministic = true;
    o.cuda.prefill = PrefillPath::Steps;
    return make_engine("cuda", *weights_, o);
  }
  void check(PrefillComparison c) {
    const int n = static_cast<int>(c.lengths.size());
    auto stepped = reference(n), prefilled = engine(n);
    const bool fp32 = feature().dtype == WeightDType::F32;
    c.tolerance = fp32 ? 1e-3f : 3e-2f;
    c.row_relative = !fp32;
    c.compare_samples = false;
    testing::compare_prefill_with_steps(*stepped, *prefilled, c);
  }

  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<ModelWeights> weights_;
};

TEST_P(CudaPrefill, EveryLengthAlone) {
  for (int len : {1, 2, 15, 16, 17, 63, 64, 65, 255, 1000, 4097}) {
    SCOPED_TRACE("length " + std::to_string(len));
    PrefillComparison c;
    c.lengths = {len};
    check(c);
  }
}

TEST_P(CudaPrefill, SeveralSlotsInOneCall) {
  PrefillComparison c;
  c.lengths = {1, 17, 300, 64, 129};
  check(c);
}

TEST_P(CudaPrefill, PromptInPieces) {
  PrefillComparison c;
  c.lengths = {300, 1, 77};
  c.pieces = 5;
  check(c);
}

TEST_P(CudaPrefill, DecodeContinuesAfterLongerPrompts) {
  PrefillComparison c;
  c.lengths = {65, 255};
  c.continue_steps = 32;
  check(c);
}

INSTANTIATE_TEST_SUITE_P(
    Features, CudaPrefill,
    ::testing::Combine(::testing::Values(GpuCase{"fp32_rope_half", 0.5, false, 0, WeightDType::F32},
                                         GpuCase{"fp32_rope_full", 1.0, false, 0, WeightDType::F32},
                                         GpuCase{"fp32_outproj_norm", 0.5, true, 0, WeightDType::F32},
                                         GpuCase{"fp32_mlp", 0.5, false, 100, WeightDType::F32},
                                         GpuCase{"bf16_all", 1.0, true, 200, WeightDType::BF16},
                                         // d_state a multiple of 32: the chunk output kernel on
                                         // register fragments, at each of its tile counts.
                                         GpuCase{"bf16_n128_r4_p64", 0.5, true, 0, WeightDType::BF16, 128, 64, 4},
                                         GpuCase{"bf16_n96_r8_rope_full", 1.0, false, 0, WeightDType::BF16, 96, 32, 8},
                                         GpuCase{"bf16_n64_r2_mlp", 0.5, false, 100, WeightDType::BF16, 64, 32, 2},
                                         GpuCase{"bf16_n32_r1_p16", 0.5, true, 0, WeightDType::BF16, 32, 16, 1}),
                       ::testing::Values(PrefillPath::Steps, PrefillPath::Chunked)),
    [](const ::testing::TestParamInfo<std::tuple<GpuCase, PrefillPath>>& info) {
      return std::string(std::get<0>(info.param).name) + "_" + path_name(std::get<1>(info.param));
    });

// The sample after the prompt, the next input it becomes (kContinueToken) and the
// random-draw counter: the chunked engine and the stepping one (fp32, both CUDA) sample the
// same ids at temperature 1 after the prompt and through the continuation, which feeds
// each engine its own samples. A counter left behind by the run's length, or a last token
// not written, makes the draws differ at once.
TEST(CudaPrefillSampling, ChunkedLeavesTheNextInputAndCountersAsSteps) {
  if (!cuda_backend_available()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  ScratchDir dir("gpu_prefill_sampling");
  testing::write_model(testing::small_config(), dir.path());
  const ModelWeights weights = ModelWeights::load(dir.path());
  auto engine = [&](PrefillPath path) {
    EngineOptions o;
    o.max_slots = 3;
    o.weight_dtype = WeightDType::F32;
    o.deterministic = true;
    o.cuda.prefill = path;
    return make_engine("cuda", weights, o);
  };
  auto stepped = engine(PrefillPath::Steps), chunked = engine(PrefillPath::Chunked);
  PrefillComparison c;
  c.lengths = {1, 40, 300};
  c.pieces = 3;
  c.sampling.temperature = 1.0f;
  c.sampling.seed = 5;
  c.continue_steps = 16;
  c.tolerance = 1e-3f;
  c.compare_samples = true;
  testing::compare_prefill_with_steps(*stepped, *chunked, c);
}

// cuda.prefill: chunked on a head shape the chunked scan cannot run (headdim 8; the decode
// step can) fails at load, naming the setting and the reason.
TEST(CudaPrefillLoad, ChunkedRefusesAShapeItCannotRun) {
  if (!cuda_backend_available()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  ModelConfig config = testing::small_config();
  config.ssm.headdim = 8;
  ScratchDir dir("gpu_prefill_refused_shape");
  testing::write_model(config, dir.path());
  const ModelWeights weights = ModelWeights::load(dir.path());
  EngineOptions o;
  o.cuda.prefill = PrefillPath::Steps;
  EXPECT_FALSE(make_engine("cuda", weights, o)->has_prefill_path());
  o.cuda.prefill = PrefillPath::Chunked;
  try {
    make_engine("cuda", weights, o);
    FAIL() << "chunked prefill accepted headdim 8";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cuda.prefill: chunked cannot run this model"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("headdim"), std::string::npos) << e.what();
  }
}

// A lone run of up to cuda.prefill_graph_max_tokens tokens replays the graph captured at
// load for its length; the graph holds the very launches a call makes without it, so the
// logits, the samples and the state it leaves (read back whole) are the same bit for bit,
// in a first piece and in a later one that continues the slot's state. A run past the
// limit, or two runs in one call, are launched kernel by kernel.
TEST(CudaPrefillGraphs, ReplayLeavesWhatTheLaunchesLeaveBitForBit) {
  if (!cuda_backend_available()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  ModelConfig config = testing::small_config();
  config.ssm.d_state = 64;  // the register-fragment chunk kernels
  config.d_intermediate = 100;
  ScratchDir dir("gpu_prefill_graphs");
  write_random_model(config, 3, DType::BF16, dir.path());
  const ModelWeights weights = ModelWeights::load(dir.path());
  auto engine = [&](int graph_tokens) {
    EngineOptions o;
    o.max_slots = 4;
    o.weight_dtype = WeightDType::BF16;
    o.max_prefill_tokens = 256;
    o.deterministic = true;
    o.cuda.prefill = PrefillPath::Chunked;
    o.cuda.prefill_graph_max_tokens = graph_tokens;
    return make_engine("cuda", weights, o);
  };
  auto graphed = engine(64), launched = engine(0);
  const size_t V = static_cast<size_t>(config.padded_vocab());
  const std::vector<int32_t> prompt = testing::random_tokens(200, config.vocab_size, 17);
  SamplingParams sampling;
  sampling.temperature = 1.0f;
  sampling.seed = 9;
  for (Engine* e : {graphed.get(), launched.get()}) {
    for (int slot = 0; slot < 4; ++slot) e->set_sampling(slot, sampling);
  }
  // (slot, first token, length): lone runs at the graphs' edges, a later piece of slot 0,
  // a run past the limit, and two runs in one call.
  struct Call {
    std::vector<std::array<int, 3>> runs;
    bool replays;
  };
  const std::vector<Call> calls = {{{{0, 0, 1}}, true},    {{{1, 1, 31}}, true},  {{{2, 2, 33}}, true},
                                   {{{3, 3, 64}}, true},   {{{0, 1, 64}}, true},  {{{1, 40, 65}}, false},
                                   {{{2, 50, 7}, {3, 70, 9}}, false}};
  uint64_t replays = 0;
  for (const Call& call : calls) {
    std::vector<PrefillRun> runs;
    for (const auto& [slot, first, length] : call.runs) {
      runs.push_back({slot, std::span<const int32_t>(prompt).subspan(static_cast<size_t>(first),
                                                                     static_cast<size_t>(length))});
    }
    SCOPED_TRACE("slot " + std::to_string(runs[0].slot) + ", " + std::to_string(runs[0].tokens.size()) +
                 " tokens, " + std::to_string(runs.size()) + " runs");
    std::vector<int32_t> sampled_g(runs.size()), sampled_l(runs.size());
    std::vector<float> logits_g(runs.size() * V), logits_l(runs.size() * V);
    graphed->prefill(runs, sampled_g, logits_g);
    launched->prefill(runs, sampled_l, logits_l);
    replays += call.replays ? 1 : 0;
    EXPECT_EQ(graphed->stats().graph_replays, replays);
    EXPECT_EQ(launched->stats().graph_replays, 0u);
    EXPECT_EQ(sampled_g, sampled_l);
    ASSERT_EQ(logits_g, logits_l);
    for (const PrefillRun& run : runs) {
      std::vector<std::byte> state_g(graphed->slot_state_bytes()), state_l(launched->slot_state_bytes());
      graphed->save_slot(run.slot, state_g);
      launched->save_slot(run.slot, state_l);
      ASSERT_EQ(state_g, state_l) << "slot " << run.slot << "'s state";
    }
  }
}

}  // namespace
}  // namespace m3
