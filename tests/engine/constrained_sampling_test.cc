// Constrained sampling: sample_token restricted to a mask's ranges is the plain
// definition over the allowed ids alone, and the CPU engine keeps a slot inside its mask
// (units only: no other token in 10,000 hot draws; flattened codebooks in frame order,
// a control restarting the frame, an input token starting one).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/philox.h"
#include "model/cpu/cpu_engine.h"
#include "model/cpu/cpu_sampling.h"
#include "model/engine.h"
#include "model/sampling_mask.h"
#include "model/vocab_layout.h"
#include "model/weights.h"
#include "test_models.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

using testing::ScratchDir;

TEST(MaskedSampleToken, IsTheDefinitionOverTheAllowedIdsAlone) {
  const int vocab = 203;
  const std::vector<TokenRange> allowed = {{3, 9, 0}, {40, 41, 0}, {100, 180, 0}, {202, 203, 0}};
  std::vector<int32_t> ids;
  for (const TokenRange& r : allowed)
    for (int32_t i = r.lo; i < r.hi; ++i) ids.push_back(i);
  SamplingScratch scratch(vocab), compact_scratch(vocab);
  int checked = 0;
  for (uint64_t trial = 0; trial < 400; ++trial) {
    std::vector<float> logits(208);
    for (size_t i = 0; i < logits.size(); ++i)
      logits[i] = 6.0f * (philox_uniform(trial, i) - 0.5f) + (i % 7 == 0 ? 4.0f : 0.0f);
    if (trial % 9 == 0) logits[ids[trial % ids.size()]] = logits[ids[(trial + 1) % ids.size()]];  // a tie
    std::vector<float> compact;
    for (int32_t id : ids) compact.push_back(logits[static_cast<size_t>(id)]);
    SamplingParams p;
    p.temperature = trial % 5 == 0 ? 0.0f : 0.3f + 0.01f * static_cast<float>(trial % 150);
    p.top_k = trial % 3 == 0 ? static_cast<int32_t>(trial % 40) : 0;
    p.top_p = trial % 4 == 0 ? 0.8f : 1.0f;
    p.seed = 1000 + trial;
    const int32_t got = sample_token(logits, vocab, p, trial, scratch, allowed);
    const int32_t want = ids[static_cast<size_t>(
        sample_token(compact, static_cast<int>(compact.size()), p, trial, compact_scratch))];
    EXPECT_EQ(got, want) << "trial " << trial;
    ++checked;
  }
  EXPECT_EQ(checked, 400);
}

TEST(MaskedSampleToken, GreedyAmongTheAllowedAndRefusesBadRanges) {
  std::vector<float> logits(20, 0.0f);
  logits[2] = 9.0f;  // the overall best is not allowed
  logits[12] = 3.0f;
  logits[15] = 3.0f;
  const std::vector<TokenRange> allowed = {{10, 20, 0}};
  SamplingScratch scratch(20);
  EXPECT_EQ(sample_token(logits, 20, SamplingParams{}, 0, scratch, allowed), 12);  // lowest of the tie
  EXPECT_EQ(sample_token(logits, 20, SamplingParams{}, 0, scratch), 2);
  const std::vector<TokenRange> outside = {{10, 21, 0}};
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { sample_token(logits, 20, SamplingParams{}, 0, scratch, outside); }),
            "sample_token: allowed range [10, 21) is empty or outside [0, 20)");
}

class ConstrainedEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<ScratchDir>("constrained");
    testing::write_model(testing::small_config(), dir_->path());  // vocab 203
    weights_ = std::make_unique<ModelWeights>(ModelWeights::load(dir_->path()));
    // text [0, 100), 4 codebooks of 25 units at [100, 200) in frame order 2, 0, 3, 1,
    // controls 200..202.
    layout_ = VocabLayout::parse(R"({
      "text": {"size": 100},
      "speech_units": {"first_id": 100, "codebooks": 4, "units_per_codebook": 25, "frame_order": [2, 0, 3, 1]},
      "controls": {"bos": 200, "end_of_turn": 201, "end_of_reply": 202}
    })", "vocab.json", 203, dir_->path());
    masks_ = sampling_masks_for(layout_);
    EngineOptions o;
    o.max_slots = 4;
    o.cpu_threads = 2;
    o.sampling_masks = masks_;
    engine_ = make_cpu_engine(*weights_, o);
  }
  int mask(const std::string& name) const {
    for (size_t i = 0; i < masks_.size(); ++i)
      if (masks_[i].name == name) return static_cast<int>(i);
    ADD_FAILURE() << "no mask " << name;
    return -1;
  }
  // Feeds `prompt` to every slot, then continues `steps` times; returns each slot's
  // samples (the last prompt token's sample first).
  std::vector<std::vector<int32_t>> run(const SamplingParams& p, const std::vector<int32_t>& prompt, int steps) {
    const std::vector<int32_t> slots = {0, 1, 2, 3};
    std::vector<std::vector<int32_t>> out(slots.size());
    for (int32_t s : slots) {
      engine_->reset(s);
      SamplingParams ps = p;
      ps.seed = p.seed + static_cast<uint64_t>(s);
      engine_->set_sampling(s, ps);
    }
    std::vector<int32_t> sampled(slots.size());
    for (size_t t = 0; t < prompt.size(); ++t) {
      const std::vector<int32_t> tokens(slots.size(), prompt[t]);
      engine_->step(slots, tokens, sampled);
    }
    for (size_t i = 0; i < slots.size(); ++i) out[i].push_back(sampled[i]);
    const std::vector<int32_t> cont(slots.size(), kContinueToken);
    for (int t = 1; t < steps; ++t) {
      engine_->step(slots, cont, sampled);
      for (size_t i = 0; i < slots.size(); ++i) out[i].push_back(sampled[i]);
    }
    return out;
  }

  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<ModelWeights> weights_;
  VocabLayout layout_;
  std::vector<SamplingMask> masks_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(ConstrainedEngineTest, UnitsOnlyYieldsNoOtherTokenIn10000HotSteps) {
  EXPECT_EQ(engine_->sampling_mask_count(), 4);
  SamplingParams p{1.5f, 0, 1.0f, 42};
  // Unconstrained, the same model and temperature leave the units (the test can fail).
  int outside = 0;
  for (const auto& samples : run(p, {200, 5, 7}, 250))
    for (int32_t id : samples) outside += !layout_.speech_units->contains(id);
  EXPECT_GT(outside, 100);

  p.mask = mask("units");
  int draws = 0;
  std::vector<int> per_codebook(4, 0);
  for (const auto& samples : run(p, {200, 5, 7}, 2500)) {
    for (size_t t = 0; t < samples.size(); ++t) {
      const int32_t id = samples[t];
      ASSERT_TRUE(layout_.speech_units->contains(id)) << "step " << t << " sampled " << id;
      // Flattened frames in order: position t % 4 holds codebook frame_order[t % 4].
      ASSERT_EQ(layout_.speech_units->codebook_of(id), layout_.speech_units->frame_order[t % 4]) << "step " << t;
      ++per_codebook[static_cast<size_t>(layout_.speech_units->codebook_of(id))];
      ++draws;
    }
  }
  EXPECT_EQ(draws, 10000);
  for (int n : per_codebook) EXPECT_EQ(n, 2500);
}

TEST_F(ConstrainedEngineTest, AnInputTokenStartsAFrameAndAControlRestartsIt) {
  SamplingParams p{1.2f, 0, 1.0f, 7};
  p.mask = mask("units_and_controls");
  int controls = 0;
  for (const auto& samples : run(p, {3}, 600)) {
    int position = 0;
    for (size_t t = 0; t < samples.size(); ++t) {
      const int32_t id = samples[t];
      if (layout_.control_name(id) != nullptr) {
        ASSERT_EQ(position, 0) << "a control inside a frame at step " << t;
        ++controls;
        continue;  // the next sample starts a frame
      }
      ASSERT_TRUE(layout_.speech_units->contains(id)) << "step " << t << " sampled " << id;
      ASSERT_EQ(layout_.speech_units->codebook_of(id), layout_.speech_units->frame_order[static_cast<size_t>(position)])
          << "step " << t;
      position = (position + 1) % 4;
    }
  }
  EXPECT_GT(controls, 0);  // the random model does pick controls, so the restart was exercised

  // Mid-frame, an input token puts the next sample at a frame's first position again.
  p.mask = mask("units");
  engine_->reset(0);
  engine_->set_sampling(0, p);
  const int32_t slot[] = {0};
  int32_t s = -1;
  const int32_t first[] = {3}, cont[] = {kContinueToken};
  engine_->step(slot, first, std::span<int32_t>(&s, 1));
  engine_->step(slot, cont, std::span<int32_t>(&s, 1));
  EXPECT_EQ(layout_.speech_units->codebook_of(s), 0);  // position 1: codebook 0
  const int32_t input[] = {201};
  engine_->step(slot, input, std::span<int32_t>(&s, 1));
  EXPECT_EQ(layout_.speech_units->codebook_of(s), 2);  // position 0 again: codebook 2
}

// A slot saved mid-frame carries its frame position: loaded into another slot, it goes on
// sampling the codebooks in frame order, drawing what the saved slot would have drawn.
TEST_F(ConstrainedEngineTest, ASavedSlotKeepsItsFramePosition) {
  SamplingParams p{1.5f, 0, 1.0f, 11};
  p.mask = mask("units");
  const int32_t from[] = {0}, into[] = {3};
  for (int32_t s : {0, 3}) {
    engine_->reset(s);
    engine_->set_sampling(s, p);
  }
  int32_t sample = -1;
  const int32_t first[] = {5}, cont[] = {kContinueToken};
  engine_->step(from, first, std::span<int32_t>(&sample, 1));
  engine_->step(from, cont, std::span<int32_t>(&sample, 1));  // the next sample is at position 2
  std::vector<std::byte> bytes(engine_->slot_state_bytes());
  engine_->save_slot(0, bytes);
  engine_->load_slot(3, bytes);
  for (int t = 0; t < 12; ++t) {
    int32_t a = -1, b = -1;
    engine_->step(from, cont, std::span<int32_t>(&a, 1));
    engine_->step(into, cont, std::span<int32_t>(&b, 1));
    ASSERT_EQ(a, b) << "step " << t;
    ASSERT_EQ(layout_.speech_units->codebook_of(b), layout_.speech_units->frame_order[static_cast<size_t>((t + 2) % 4)])
        << "step " << t;
  }
  // A negative frame position is not a state this engine wrote.
  const size_t at = bytes.size() - sizeof(int32_t);
  const int32_t negative = -3;
  std::memcpy(bytes.data() + at, &negative, sizeof negative);
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { engine_->load_slot(3, bytes); }),
            "load_slot: the state's frame position -3 is negative");
}

TEST_F(ConstrainedEngineTest, TextMasksAndGreedy) {
  SamplingParams p{0.9f, 0, 1.0f, 3};
  p.mask = mask("text");
  for (const auto& samples : run(p, {150}, 300))
    for (int32_t id : samples) ASSERT_LT(id, 100);
  p.mask = mask("text_and_controls");
  p.temperature = 0.0f;  // greedy inside the mask
  for (const auto& samples : run(p, {150}, 50))
    for (int32_t id : samples) ASSERT_TRUE(id < 100 || id >= 200) << id;
}

TEST_F(ConstrainedEngineTest, PrefillSamplesInsideTheMaskAsSteppingDoes) {
  EngineOptions o;
  o.max_slots = 4;
  o.cpu_threads = 2;
  o.sampling_masks = masks_;
  auto stepped = make_cpu_engine(*weights_, o);
  SamplingParams p{1.4f, 0, 1.0f, 9};
  p.mask = mask("units_and_controls");
  const std::vector<int32_t> prompt = {200, 5, 7, 201};
  for (Engine* e : {engine_.get(), stepped.get()}) {
    e->reset(1);
    e->set_sampling(1, p);
  }
  int32_t a = -1, b = -1;
  const PrefillRun run{1, prompt};
  engine_->prefill({&run, 1}, {&a, 1});
  const int32_t slot[] = {1};
  for (int32_t t : prompt) stepped->step(slot, {&t, 1}, {&b, 1});
  ASSERT_EQ(a, b);
  const int32_t cont[] = {kContinueToken};
  for (int t = 0; t < 60; ++t) {  // the frame positions continue alike
    engine_->step(slot, cont, {&a, 1});
    stepped->step(slot, cont, {&b, 1});
    ASSERT_EQ(a, b) << "step " << t;
    ASSERT_TRUE(layout_.speech_units->contains(a) || layout_.control_name(a) != nullptr) << a;
  }
}

TEST_F(ConstrainedEngineTest, AMaskTheEngineDoesNotHaveIsRefused) {
  SamplingParams p;
  p.mask = 4;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { engine_->set_sampling(1, p); }),
            "set_sampling: slot 1: mask 4 is not -1 (none) or one of this engine's 4 sampling masks");
  p.mask = -2;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { engine_->set_sampling(1, p); }),
            "set_sampling: slot 1: mask -2 is not -1 (none) or one of this engine's 4 sampling masks");
}

}  // namespace
}  // namespace m3
