// prefill() on the CPU engine (the reference) against the same tokens fed one step() at a
// time: logits, samples, the whole slot state (bitwise: the same arithmetic in the same
// order) and the decoding after it; and the base class's step-by-step default.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/cpu/cpu_engine.h"
#include "model/engine.h"
#include "model/weights.h"
#include "prefill_check.h"
#include "test_models.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

using testing::PrefillComparison;
using testing::ScratchDir;
using ::testing::HasSubstr;

struct Model {
  std::unique_ptr<ScratchDir> dir;
  std::unique_ptr<ModelWeights> weights;
};

Model make_model(const ModelConfig& config, const std::string& tag) {
  Model m;
  m.dir = std::make_unique<ScratchDir>(tag);
  testing::write_model(config, m.dir->path());
  m.weights = std::make_unique<ModelWeights>(ModelWeights::load(m.dir->path()));
  return m;
}

std::unique_ptr<Engine> cpu_engine(const Model& m, int slots, int max_prefill_tokens = 8192,
                                   int threads = 2) {
  EngineOptions o;
  o.max_slots = slots;
  o.cpu_threads = threads;
  o.max_prefill_tokens = max_prefill_tokens;
  return make_cpu_engine(*m.weights, o);
}

// Prefill and step-by-step on two CPU engines, then every slot's whole state compared.
void check_cpu(const Model& m, const PrefillComparison& c, int max_prefill_tokens = 8192) {
  const int n = static_cast<int>(c.lengths.size());
  auto stepped = cpu_engine(m, n, max_prefill_tokens), prefilled = cpu_engine(m, n, max_prefill_tokens);
  testing::compare_prefill_with_steps(*stepped, *prefilled, c);
  for (int i = 0; i < n; ++i) {
    const CpuSlotSnapshot a = cpu_slot_snapshot(*stepped, i), b = cpu_slot_snapshot(*prefilled, i);
    EXPECT_EQ(a.counter, b.counter) << "slot " << i;
    EXPECT_EQ(a.next_input, b.next_input) << "slot " << i;
    ASSERT_EQ(a.state.size(), b.state.size());
    size_t differing = 0;
    for (size_t k = 0; k < a.state.size(); ++k) differing += a.state[k] != b.state[k];
    EXPECT_EQ(differing, 0u) << "slot " << i << ": state floats differing of " << a.state.size();
  }
}

PrefillComparison lengths(std::vector<int> l) {
  PrefillComparison c;
  c.lengths = std::move(l);
  return c;
}

class CpuPrefillLength : public ::testing::TestWithParam<int> {};

TEST_P(CpuPrefillLength, EqualsStepByStepBitwise) {
  static const Model m = make_model(testing::small_config(), "prefill_len");
  check_cpu(m, lengths({GetParam()}));
}

INSTANTIATE_TEST_SUITE_P(Lengths, CpuPrefillLength,
                         ::testing::Values(1, 2, 15, 16, 17, 63, 64, 65, 255, 1000, 4097));

struct Variant {
  const char* name;
  double rope_fraction;
  bool outproj_norm;
  int d_intermediate;
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

class CpuPrefillVariant : public ::testing::TestWithParam<Variant> {};

TEST_P(CpuPrefillVariant, EqualsStepByStepForEveryFeature) {
  ModelConfig config = testing::small_config();
  config.ssm.rope_fraction = GetParam().rope_fraction;
  config.ssm.is_outproj_norm = GetParam().outproj_norm;
  config.d_intermediate = GetParam().d_intermediate;
  const Model m = make_model(config, std::string("prefill_") + GetParam().name);
  // Several slots in one call, one run crossing the 256-token window.
  check_cpu(m, lengths({1, 17, 300, 64}));
  // Seeded sampling: the draw after the prompt uses the counter its last step would.
  PrefillComparison sampled = lengths({5, 40});
  sampled.sampling.temperature = 1.0f;
  sampled.sampling.top_k = 50;
  sampled.sampling.top_p = 0.95f;
  sampled.sampling.seed = 1234;
  sampled.continue_steps = 20;
  check_cpu(m, sampled);
}

INSTANTIATE_TEST_SUITE_P(
    Features, CpuPrefillVariant,
    ::testing::Values(Variant{"rope_half", 0.5, false, 0}, Variant{"rope_full", 1.0, false, 0},
                      Variant{"outproj_norm", 0.5, true, 0}, Variant{"mlp", 0.5, false, 100},
                      Variant{"all", 1.0, true, 200}),
    [](const ::testing::TestParamInfo<Variant>& info) { return std::string(info.param.name); });

TEST(CpuPrefill, PromptInPiecesEqualsOneCall) {
  const Model m = make_model(testing::small_config(), "prefill_pieces");
  PrefillComparison c = lengths({300, 1, 77});
  c.pieces = 5;  // a Converse turn arriving in pieces, other slots' pieces in the same calls
  check_cpu(m, c);
  PrefillComparison sampled = lengths({90});
  sampled.pieces = 7;
  sampled.sampling.temperature = 0.7f;
  sampled.sampling.seed = 99;
  check_cpu(m, sampled);
}

TEST(CpuPrefill, SmallWindowSplitsRunsAndSlots) {
  // max_prefill_tokens 40: the CPU engine reads 40 tokens at a time, so the runs below
  // are cut across windows, several per window.
  const Model m = make_model(testing::small_config(), "prefill_window");
  PrefillComparison c = lengths({13, 1, 26});
  check_cpu(m, c, 40);
}

TEST(CpuPrefill, ContinuesAfterSteps) {
  // Steps, then a prefill on the same slot, then steps: as if all were steps.
  const Model m = make_model(testing::small_config(), "prefill_mixed");
  auto a = cpu_engine(m, 1), b = cpu_engine(m, 1);
  const std::vector<int32_t> tokens = testing::random_tokens(30, 203, 5);
  const int32_t slot0[] = {0};
  int32_t sa = -1, sb = -1;
  for (int t = 0; t < 10; ++t) {
    a->step(slot0, std::span<const int32_t>(&tokens[t], 1), std::span<int32_t>(&sa, 1));
    b->step(slot0, std::span<const int32_t>(&tokens[t], 1), std::span<int32_t>(&sb, 1));
  }
  for (int t = 10; t < 30; ++t) a->step(slot0, std::span<const int32_t>(&tokens[t], 1), std::span<int32_t>(&sa, 1));
  const PrefillRun run{0, std::span<const int32_t>(tokens).subspan(10)};
  b->prefill(std::span<const PrefillRun>(&run, 1), std::span<int32_t>(&sb, 1));
  EXPECT_EQ(sa, sb);
  EXPECT_EQ(cpu_slot_snapshot(*a, 0).state, cpu_slot_snapshot(*b, 0).state);
  EXPECT_EQ(cpu_slot_snapshot(*a, 0).counter, 30u);
  EXPECT_EQ(cpu_slot_snapshot(*b, 0).counter, 30u);
}

// An engine that keeps the base class's prefill (steps one position at a time) over a CPU
// engine: the path the CUDA engine takes until it has its own.
class StepOnlyEngine final : public Engine {
 public:
  explicit StepOnlyEngine(std::unique_ptr<Engine> inner) : inner_(std::move(inner)) {}
  std::string_view backend() const override { return "step-only"; }
  const ModelConfig& config() const override { return inner_->config(); }
  int max_slots() const override { return inner_->max_slots(); }
  void reset(int slot) override { inner_->reset(slot); }
  void set_sampling(int slot, const SamplingParams& p) override { inner_->set_sampling(slot, p); }
  void step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
            std::span<int32_t> sampled, std::span<float> logits) override {
    inner_->step(slots, tokens, sampled, logits);
  }
  EngineStats stats() const override { return inner_->stats(); }
  size_t slot_state_bytes() const override { return inner_->slot_state_bytes(); }
  void save_slot(int slot, std::span<std::byte> out) override { inner_->save_slot(slot, out); }
  void load_slot(int slot, std::span<const std::byte> in) override { inner_->load_slot(slot, in); }
  Engine& inner() { return *inner_; }

 private:
  std::unique_ptr<Engine> inner_;
};

TEST(CpuPrefill, BaseClassDefaultEqualsStepByStep) {
  const Model m = make_model(testing::small_config(), "prefill_default");
  StepOnlyEngine via_steps(cpu_engine(m, 3));
  auto stepped = cpu_engine(m, 3);
  PrefillComparison c = lengths({1, 50, 9});
  c.pieces = 3;
  c.sampling.temperature = 0.9f;
  c.sampling.seed = 5;
  testing::compare_prefill_with_steps(*stepped, via_steps, c);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(cpu_slot_snapshot(*stepped, i).state, cpu_slot_snapshot(via_steps.inner(), i).state);
    EXPECT_EQ(cpu_slot_snapshot(*stepped, i).counter, cpu_slot_snapshot(via_steps.inner(), i).counter);
  }
  EXPECT_EQ(via_steps.max_prefill_tokens(), EngineOptions{}.max_prefill_tokens);
  EXPECT_FALSE(via_steps.has_prefill_path());
  EXPECT_TRUE(stepped->has_prefill_path());
}

template <typename F>
std::string invalid_argument_of(F&& f) {
  return test::error_of<std::invalid_argument>(f);
}

TEST(CpuPrefill, RefusesBadArguments) {
  const Model m = make_model(testing::small_config(), "prefill_errors");
  auto e = cpu_engine(m, 2, 10);
  EXPECT_EQ(e->max_prefill_tokens(), 10);
  const std::vector<int32_t> ok = {1, 2, 3}, bad = {1, 203}, cont = {kContinueToken};
  std::vector<int32_t> sampled(2);
  const auto call = [&](std::vector<PrefillRun> runs, size_t n_sampled, size_t n_logits = 0) {
    sampled.assign(n_sampled, 0);
    std::vector<float> logits(n_logits);
    e->prefill(runs, sampled, logits);
  };
  EXPECT_THAT(invalid_argument_of([&] { call({{2, ok}}, 1); }), HasSubstr("slot 2 out of range [0, 2)"));
  EXPECT_THAT(invalid_argument_of([&] { call({{0, ok}, {0, ok}}, 2); }), HasSubstr("slot 0 listed twice"));
  EXPECT_THAT(invalid_argument_of([&] { call({{1, {}}}, 1); }), HasSubstr("slot 1: no tokens"));
  EXPECT_THAT(invalid_argument_of([&] { call({{0, bad}}, 1); }),
              HasSubstr("slot 0: token 203 at position 1 outside [0, 203)"));
  EXPECT_THAT(invalid_argument_of([&] { call({{0, cont}}, 1); }), HasSubstr("kContinueToken is for step()"));
  const std::vector<int32_t> eleven(11, 4), six(6, 4), five(5, 4);
  EXPECT_THAT(invalid_argument_of([&] { call({{0, eleven}}, 1); }),
              HasSubstr("11 tokens in one call, at most 10"));
  EXPECT_THAT(invalid_argument_of([&] { call({{0, six}, {1, five}}, 2); }),
              HasSubstr("11 tokens in one call, at most 10"));
  EXPECT_THAT(invalid_argument_of([&] { call({{0, ok}}, 2); }), HasSubstr("sampled has 2 entries, runs has 1"));
  EXPECT_THAT(invalid_argument_of([&] { call({{0, ok}}, 1, 5); }), HasSubstr("logits has 5 floats"));
  // Nothing was fed by the refused calls.
  EXPECT_EQ(cpu_slot_snapshot(*e, 0).counter, 0u);
  EXPECT_EQ(cpu_slot_snapshot(*e, 1).counter, 0u);
  // A queued step must be collected first.
  const int32_t slot[] = {1}, token[] = {3};
  e->submit_step(slot, token);
  const std::string queued = test::error_of<std::logic_error>([&] { call({{0, ok}}, 1); });
  EXPECT_THAT(queued, HasSubstr("1 steps are queued"));
  int32_t s = 0;
  e->collect_step(std::span<int32_t>(&s, 1));
  call({{0, ok}, {1, ok}}, 2);
  EXPECT_EQ(cpu_slot_snapshot(*e, 0).counter, 3u);
  EXPECT_EQ(cpu_slot_snapshot(*e, 1).counter, 4u);
  EXPECT_EQ(e->stats().tokens, 7u);
}

TEST(CpuPrefill, RefusesAZeroTokenLimitAtLoad) {
  const Model m = make_model(testing::small_config(), "prefill_limit");
  EngineOptions o;
  o.max_prefill_tokens = 0;
  EXPECT_THAT(invalid_argument_of([&] { make_cpu_engine(*m.weights, o); }),
              HasSubstr("max_prefill_tokens must be >= 1, got 0"));
  EXPECT_THAT(invalid_argument_of([&] { make_engine("cpu", *m.weights, o); }),
              HasSubstr("max_prefill_tokens must be >= 1, got 0"));
}

}  // namespace
}  // namespace m3
