// The Engine contract on the CPU backend: continue tokens, reset, batching independence,
// per-slot sampling counters, argument errors, stats.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/cpu/cpu_engine.h"
#include "model/cpu/cpu_sampling.h"
#include "model/engine.h"
#include "model/weights.h"
#include "test_models.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

using testing::ScratchDir;
using ::testing::HasSubstr;

class CpuEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<ScratchDir>("contract");
    testing::write_model(testing::small_config(), dir_->path());
    weights_ = std::make_unique<ModelWeights>(ModelWeights::load(dir_->path()));
  }
  std::unique_ptr<Engine> engine(int slots, int threads = 2) {
    EngineOptions o;
    o.max_slots = slots;
    o.cpu_threads = threads;
    return make_cpu_engine(*weights_, o);
  }
  int V() const { return weights_->config().padded_vocab(); }
  int vocab() const { return weights_->config().vocab_size; }

  // Steps one slot; returns its logits.
  std::vector<float> step1(Engine& e, int slot, int32_t token, int32_t* sampled = nullptr) {
    std::vector<float> logits(static_cast<size_t>(V()));
    int32_t s = -1;
    const int32_t slots[] = {slot};
    const int32_t tokens[] = {token};
    e.step(slots, tokens, std::span<int32_t>(&s, 1), logits);
    if (sampled) *sampled = s;
    return logits;
  }

  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<ModelWeights> weights_;
};

template <typename F>
std::string invalid_argument_of(F&& f) {
  return test::error_of<std::invalid_argument>(f);
}

TEST_F(CpuEngineTest, ReportsItsShape) {
  auto e = engine(3);
  EXPECT_EQ(e->backend(), "cpu");
  EXPECT_EQ(e->load_report(), "");  // nothing chosen at load
  EXPECT_EQ(e->max_slots(), 3);
  EXPECT_EQ(e->config().vocab_size, 203);
  EXPECT_EQ(e->config().padded_vocab(), 208);
}

TEST_F(CpuEngineTest, ContinueTokenFeedsThePreviousSample) {
  auto a = engine(1), b = engine(1);
  int32_t first = -1;
  step1(*a, 0, 5, &first);
  ASSERT_GE(first, 0);
  ASSERT_LT(first, vocab());
  const std::vector<float> continued = step1(*a, 0, kContinueToken);
  step1(*b, 0, 5);
  const std::vector<float> explicit_token = step1(*b, 0, first);
  EXPECT_EQ(continued, explicit_token);
}

TEST_F(CpuEngineTest, ResetReplaysIdentically) {
  auto e = engine(2);
  SamplingParams p;
  p.temperature = 1.3f;
  p.top_k = 50;
  p.seed = 77;
  e->set_sampling(1, p);
  const auto run = [&] {
    std::vector<float> all;
    std::vector<int32_t> sampled;
    int32_t s = -1;
    for (int32_t t : {3, 9, 200, 0}) {
      const auto l = step1(*e, 1, t, &s);
      all.insert(all.end(), l.begin(), l.end());
      sampled.push_back(s);
    }
    for (int i = 0; i < 12; ++i) {  // free-running on its own samples
      const auto l = step1(*e, 1, kContinueToken, &s);
      all.insert(all.end(), l.begin(), l.end());
      sampled.push_back(s);
    }
    return std::make_pair(all, sampled);
  };
  const auto first = run();
  e->reset(1);
  const auto second = run();
  EXPECT_EQ(first.first, second.first);
  EXPECT_EQ(first.second, second.second);
  EXPECT_EQ(invalid_argument_of([&] { e->reset(1); step1(*e, 1, kContinueToken); }),
            "step: slot 1 has no sampled token to continue from (kContinueToken right after reset)");
}

TEST_F(CpuEngineTest, SlotAloneEqualsSlotInABatch) {
  // Slot 2 gets the same tokens in both engines; in the batched one other slots come and
  // go around it, in a different list order, with another thread count.
  auto alone = engine(4, 1), batched = engine(4, 2);
  const std::vector<int32_t> mine = {7, 1, 150, 33, 33, 2, 99, 5};
  for (size_t t = 0; t < mine.size(); ++t) {
    const std::vector<float> ref = step1(*alone, 2, mine[t]);
    std::vector<int32_t> slots = {2};
    std::vector<int32_t> tokens = {mine[t]};
    if (t >= 1) { slots.insert(slots.begin(), 0); tokens.insert(tokens.begin(), static_cast<int32_t>(t * 11)); }
    if (t >= 3 && t < 6) { slots.push_back(3); tokens.push_back(202); }
    if (t == 4) batched->reset(0);
    std::vector<int32_t> sampled(slots.size());
    std::vector<float> logits(slots.size() * static_cast<size_t>(V()));
    batched->step(slots, tokens, sampled, logits);
    const size_t at = static_cast<size_t>(std::find(slots.begin(), slots.end(), 2) - slots.begin());
    const std::vector<float> got(logits.begin() + static_cast<long>(at * V()),
                                 logits.begin() + static_cast<long>((at + 1) * V()));
    ASSERT_EQ(got, ref) << "step " << t;
  }
}

TEST_F(CpuEngineTest, EachSlotDrawsWithItsOwnSeedAndCounter) {
  auto e = engine(2);
  SamplingParams p0, p1;
  p0.temperature = 1.0f;
  p0.seed = 1;
  p1.temperature = 0.7f;
  p1.top_p = 0.9f;
  p1.seed = 2;
  e->set_sampling(0, p0);
  e->set_sampling(1, p1);
  SamplingScratch scratch(vocab());
  const std::vector<int32_t> slots = {1, 0};
  std::vector<int32_t> tokens = {4, 8}, sampled(2);
  std::vector<float> logits(2 * static_cast<size_t>(V()));
  for (uint64_t counter = 0; counter < 20; ++counter) {
    e->step(slots, tokens, sampled, logits);
    const std::span<const float> row1(logits.data(), static_cast<size_t>(V()));
    const std::span<const float> row0(logits.data() + V(), static_cast<size_t>(V()));
    ASSERT_EQ(sampled[0], sample_token(row1, vocab(), p1, counter, scratch)) << counter;
    ASSERT_EQ(sampled[1], sample_token(row0, vocab(), p0, counter, scratch)) << counter;
    tokens = {kContinueToken, kContinueToken};
  }
}

TEST_F(CpuEngineTest, HotSamplingNeverReturnsPaddedIds) {
  auto e = engine(1);
  SamplingParams p;
  p.temperature = 50.0f;  // nearly uniform over the vocabulary
  e->set_sampling(0, p);
  int32_t s = -1;
  step1(*e, 0, 1, &s);
  int32_t highest = 0;
  for (int i = 0; i < 300; ++i) {
    const auto logits = step1(*e, 0, kContinueToken, &s);
    ASSERT_EQ(logits.size(), 208u);
    ASSERT_GE(s, 0);
    ASSERT_LT(s, 203);
    highest = std::max(highest, s);
  }
  EXPECT_GT(highest, 150);  // the draws do range over the vocabulary
}

TEST_F(CpuEngineTest, BadArgumentsNameTheSlotOrToken) {
  auto e = engine(4);
  std::vector<int32_t> sampled(2);
  const auto step = [&](std::vector<int32_t> slots, std::vector<int32_t> tokens, size_t n_logits = 0) {
    std::vector<float> logits(n_logits);
    std::vector<int32_t> out(slots.size());
    return invalid_argument_of([&] { e->step(slots, tokens, out, logits); });
  };
  EXPECT_EQ(step({4}, {1}), "step: slot 4 out of range [0, 4)");
  EXPECT_EQ(step({-1}, {1}), "step: slot -1 out of range [0, 4)");
  EXPECT_EQ(step({1, 1}, {1, 2}), "step: slot 1 listed twice");
  EXPECT_EQ(step({0, 1, 2, 3, 0}, {1, 1, 1, 1, 1}), "step: 5 slots, max_slots is 4");
  EXPECT_EQ(step({2}, {203}), "step: slot 2: token 203 outside [0, 203)");
  EXPECT_EQ(step({2}, {-7}), "step: slot 2: token -7 outside [0, 203)");
  EXPECT_EQ(step({0, 3}, {1}), "step: tokens has 1 entries, slots has 2");
  EXPECT_EQ(step({0}, {1}, 5), "step: logits has 5 floats, need 1 x padded vocab 208 (or empty)");
  EXPECT_EQ(invalid_argument_of([&] {
              const int32_t s[] = {0, 1}, t[] = {1, 1};
              int32_t out[1];
              e->step(s, t, out);
            }),
            "step: sampled has 1 entries, slots has 2");
  EXPECT_EQ(invalid_argument_of([&] { e->reset(9); }), "reset: slot 9 out of range [0, 4)");
  SamplingParams bad;
  bad.top_p = 2.0f;
  EXPECT_EQ(invalid_argument_of([&] { e->set_sampling(1, bad); }),
            "set_sampling: slot 1: top_p must be in [0, 1], got 2.000000");
  EXPECT_EQ(invalid_argument_of([&] { e->set_sampling(4, SamplingParams{}); }),
            "set_sampling: slot 4 out of range [0, 4)");
  // A rejected step changes nothing: the slot still cannot continue.
  EXPECT_EQ(step({0}, {kContinueToken}),
            "step: slot 0 has no sampled token to continue from (kContinueToken right after reset)");
  EXPECT_EQ(e->stats().steps, 0u);
}

TEST_F(CpuEngineTest, RejectedStepLeavesStateUntouched) {
  auto a = engine(2), b = engine(2);
  step1(*a, 0, 10);
  step1(*b, 0, 10);
  const int32_t slots[] = {0, 1}, tokens[] = {11, 999};
  int32_t out[2];
  EXPECT_THROW(a->step(slots, tokens, out), std::invalid_argument);
  EXPECT_EQ(step1(*a, 0, 12), step1(*b, 0, 12));
}

// The interface's default submit_step / collect_step: samples come back in submission
// order, as step() gives them; a refused step queues nothing; the queue holds two.
TEST_F(CpuEngineTest, SubmittedStepsCollectWhatStepGives) {
  auto a = engine(2), b = engine(2);
  for (Engine* e : {a.get(), b.get()}) e->set_sampling(1, SamplingParams{0.9f, 0, 1.f, 5});
  const int32_t slots[] = {0, 1}, first[] = {3, 4}, next[] = {kContinueToken, kContinueToken};
  int32_t want[3][2], got[3][2];
  b->step(slots, first, want[0]);
  b->step(slots, next, want[1]);
  b->step(slots, next, want[2]);
  a->submit_step(slots, first);
  a->submit_step(slots, next);
  EXPECT_EQ(a->queued_steps(), 2);
  EXPECT_EQ(test::error_of<std::logic_error>([&] { a->submit_step(slots, next); }),
            "submit_step: 2 steps are queued already; collect_step() one first");
  a->collect_step(got[0]);
  const int32_t bad[] = {0, 999};
  EXPECT_THROW(a->submit_step(slots, bad), std::invalid_argument);
  EXPECT_EQ(a->queued_steps(), 1);
  a->submit_step(slots, next);
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { a->collect_step(std::span<int32_t>(got[1], 1)); }),
            "collect_step: the step has 2 slots but 1 sampled entries");
  a->collect_step(got[1]);
  a->collect_step(got[2]);
  EXPECT_EQ(a->queued_steps(), 0);
  EXPECT_EQ(test::error_of<std::logic_error>([&] { a->collect_step(got[0]); }), "collect_step: no step is queued");
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(got[t][0], want[t][0]) << "step " << t;
    EXPECT_EQ(got[t][1], want[t][1]) << "step " << t;
  }
}

TEST_F(CpuEngineTest, StatsCountStepsAndTokens) {
  auto e = engine(3);
  const int32_t slots[] = {0, 2}, tokens[] = {1, 2};
  int32_t out[2];
  e->step(slots, tokens, out);
  e->step(std::span<const int32_t>(slots, 1), std::span<const int32_t>(tokens, 1),
          std::span<int32_t>(out, 1));
  const EngineStats s = e->stats();
  EXPECT_EQ(s.steps, 2u);
  EXPECT_EQ(s.tokens, 3u);
  EXPECT_EQ(s.graph_replays, 0u);
}

TEST_F(CpuEngineTest, NeedsAtLeastOneSlot) {
  EXPECT_EQ(invalid_argument_of([&] { engine(0); }), "cpu engine: max_slots must be >= 1, got 0");
}

TEST_F(CpuEngineTest, RefusesAStateLargerThanTheMachine) {
  // max_batch is a config value; a state beyond memory must be refused, not touched into
  // the OOM killer.
  const std::string msg = test::error_of([&] { engine(1 << 30); });
  EXPECT_THAT(msg, HasSubstr("cpu engine: " + dir_->path().string() + ": the recurrent state of 1073741824 slots"));
  EXPECT_THAT(msg, HasSubstr("GiB of memory; lower max_batch"));
}

TEST_F(CpuEngineTest, FactoryKnowsItsBackends) {
  EngineOptions o;
  o.max_slots = 2;
  EXPECT_EQ(make_engine("cpu", *weights_, o)->backend(), "cpu");
  EXPECT_EQ(invalid_argument_of([&] { make_engine("tpu", *weights_, o); }),
            "make_engine: unknown backend \"tpu\" (expected cpu, cuda or auto)");
  if (cuda_backend_available()) {
    EXPECT_EQ(make_engine("auto", *weights_, o)->backend(), "cuda");
  } else {
    EXPECT_EQ(make_engine("auto", *weights_, o)->backend(), "cpu");
    const std::string msg = test::error_of([&] { make_engine("cuda", *weights_, o); });
    EXPECT_NE(msg.find("make_engine: backend \"cuda\" requested but"), std::string::npos) << msg;
  }
}

TEST(WeightDType, NamesRoundTrip) {
  for (WeightDType d : {WeightDType::F32, WeightDType::BF16}) {
    WeightDType back{};
    ASSERT_TRUE(parse_weight_dtype(weight_dtype_name(d), &back));
    EXPECT_EQ(back, d);
  }
  EXPECT_EQ(weight_dtype_name(WeightDType::F32), "fp32");
  EXPECT_EQ(weight_dtype_name(WeightDType::BF16), "bf16");
  WeightDType untouched = WeightDType::BF16;
  EXPECT_FALSE(parse_weight_dtype("float32", &untouched));
  EXPECT_EQ(untouched, WeightDType::BF16);
}

}  // namespace
}  // namespace m3
