// The CPU engine with state_dtype bf16: the ssm state stored rounded to bf16 between
// steps, updated in fp32. Its logits follow the fp32-state engine's closely but not
// bitwise; its output does not depend on the batch it shares or the thread count; reset
// clears it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "model/cpu/cpu_engine.h"
#include "model/engine.h"
#include "model/weights.h"
#include "test_models.h"

namespace m3 {
namespace {

using testing::ScratchDir;

class CpuBf16StateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelConfig c = testing::small_config();
    c.ssm.d_state = 32;
    testing::write_model(c, dir_.path());
    weights_ = std::make_unique<ModelWeights>(ModelWeights::load(dir_.path()));
  }
  std::unique_ptr<Engine> engine(StateDType state, int slots, int threads = 2) {
    EngineOptions o;
    o.max_slots = slots;
    o.cpu_threads = threads;
    o.state_dtype = state;
    return make_cpu_engine(*weights_, o);
  }
  int V() const { return weights_->config().padded_vocab(); }

  // Feeds tokens[t] to every slot of `slots` at step t; returns the logits of all steps,
  // [step][position][V].
  std::vector<float> run(Engine& e, const std::vector<int32_t>& slots, int steps) {
    const size_t n = slots.size();
    std::vector<float> out;
    std::vector<float> logits(n * static_cast<size_t>(V()));
    std::vector<int32_t> tokens(n), sampled(n);
    for (int t = 0; t < steps; ++t) {
      for (size_t i = 0; i < n; ++i) tokens[i] = (37 * t + 11 * slots[i] + 5) % weights_->config().vocab_size;
      e.step(slots, tokens, sampled, logits);
      out.insert(out.end(), logits.begin(), logits.end());
    }
    return out;
  }

  // max|a - b| / max|b| of one step's row.
  static double rel_err(const float* a, const float* b, int n) {
    double diff = 0, scale = 0;
    for (int i = 0; i < n; ++i) {
      diff = std::max(diff, double(std::fabs(a[i] - b[i])));
      scale = std::max(scale, double(std::fabs(b[i])));
    }
    return diff / scale;
  }

  ScratchDir dir_{"bf16_state"};
  std::unique_ptr<ModelWeights> weights_;
};

// The first step reads a zero state (exact in bf16) and computes its output from the
// state updated in fp32, so it equals the fp32 engine's bit for bit; from the second step
// on the rounded state shows, within bf16's relative precision.
TEST_F(CpuBf16StateTest, UpdatesInFp32AndRoundsOnlyWhatItStores) {
  const std::vector<int32_t> slots = {0, 1};
  auto fp32 = engine(StateDType::F32, 2), bf16 = engine(StateDType::BF16, 2);
  const int steps = 64;
  const std::vector<float> a = run(*bf16, slots, steps), b = run(*fp32, slots, steps);
  const size_t row = static_cast<size_t>(V());
  EXPECT_TRUE(std::equal(a.begin(), a.begin() + 2 * row, b.begin())) << "step 1 differs";
  double worst = 0;
  for (size_t r = 2; r < a.size() / row; ++r) worst = std::max(worst, rel_err(&a[r * row], &b[r * row], V()));
  EXPECT_GT(worst, 0.0) << "bf16 state left every logit exact: nothing was rounded";
  EXPECT_LT(worst, 3e-2);
}

TEST_F(CpuBf16StateTest, ASequenceGetsTheSameLogitsAloneOrInABatchWithAnyThreadCount) {
  auto together = engine(StateDType::BF16, 4, 2);
  auto alone = engine(StateDType::BF16, 4, 1);
  const std::vector<float> batch = run(*together, {3, 1, 0}, 20);
  const std::vector<float> one = run(*alone, {1}, 20);
  const size_t row = static_cast<size_t>(V());
  for (int t = 0; t < 20; ++t) {
    ASSERT_TRUE(std::equal(one.begin() + t * row, one.begin() + (t + 1) * row, batch.begin() + (3 * t + 1) * row))
        << "step " << t;
  }
}

TEST_F(CpuBf16StateTest, ResetClearsTheStoredState) {
  auto e = engine(StateDType::BF16, 2);
  const std::vector<float> first = run(*e, {1}, 10);
  e->reset(1);
  EXPECT_EQ(run(*e, {1}, 10), first);
}

// The prefill path stores the state after every token as the step does: the same state,
// the same next token.
TEST_F(CpuBf16StateTest, PrefillLeavesTheStateSteppingLeaves) {
  auto stepped = engine(StateDType::BF16, 2), prefilled = engine(StateDType::BF16, 2);
  const std::vector<int32_t> prompt = {5, 17, 42, 99, 3, 64, 128, 7, 11};
  int32_t slot = 1, step_sample = -1;
  for (int32_t t : prompt) stepped->step({&slot, 1}, {&t, 1}, {&step_sample, 1});
  const PrefillRun run{1, prompt};
  int32_t prefill_sample = -1;
  prefilled->prefill({&run, 1}, {&prefill_sample, 1});
  EXPECT_EQ(prefill_sample, step_sample);
  const CpuSlotSnapshot a = cpu_slot_snapshot(*stepped, 1), b = cpu_slot_snapshot(*prefilled, 1);
  EXPECT_EQ(a.state, b.state);
  const int64_t ssm_floats = int64_t{weights_->config().n_heads()} * weights_->config().ssm.headdim *
                             weights_->config().ssm.d_state * weights_->config().n_layer;
  EXPECT_EQ(static_cast<int64_t>(a.state.size()), weights_->config().state_floats_per_layer() * weights_->config().n_layer)
      << "the snapshot holds the widened ssm state too (" << ssm_floats << " floats)";
}

}  // namespace
}  // namespace m3
