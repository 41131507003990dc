// Constrained sampling on the CUDA engine: with the masks given at load, fp32 steps sample
// what the CPU engine samples (mixed masks, input tokens restarting frames); a units-only
// slot yields no other token in 10,000 hot steps (plain and pipelined), flattened
// codebooks in frame order; a mask it was not given is refused.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "model/cpu/cpu_engine.h"
#include "model/cuda/cuda_engine.h"
#include "model/sampling_mask.h"
#include "model/vocab_layout.h"
#include "model/weights.h"
#include "test_models.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

class CudaEngineMasks : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::cuda_device_present()) GTEST_SKIP() << "no CUDA device";
    dir_ = std::make_unique<testing::ScratchDir>("cuda_masks");
    testing::write_model(testing::small_config(), dir_->path());  // vocab 203
    weights_ = std::make_unique<ModelWeights>(ModelWeights::load(dir_->path()));
    // text [0, 100), 4 codebooks of 25 units at [100, 200) in frame order 2, 0, 3, 1,
    // controls 200..202; masks: text, text_and_controls, units, units_and_controls.
    layout_ = VocabLayout::parse(R"({
      "text": {"size": 100},
      "speech_units": {"first_id": 100, "codebooks": 4, "units_per_codebook": 25, "frame_order": [2, 0, 3, 1]},
      "controls": {"bos": 200, "end_of_turn": 201, "end_of_reply": 202}
    })", "vocab.json", 203, dir_->path());
    options_.max_slots = 4;
    options_.weight_dtype = WeightDType::F32;
    options_.cpu_threads = 2;
    options_.sampling_masks = sampling_masks_for(layout_);
    ASSERT_EQ(options_.sampling_masks[kUnits].name, "units");
  }
  static constexpr int kText = 0, kUnits = 2, kUnitsAndControls = 3;

  std::unique_ptr<testing::ScratchDir> dir_;
  std::unique_ptr<ModelWeights> weights_;
  VocabLayout layout_;
  EngineOptions options_;
};

TEST_F(CudaEngineMasks, Fp32StepsSampleWhatTheCpuEngineSamples) {
  auto gpu = make_cuda_engine(*weights_, options_);
  auto cpu = make_cpu_engine(*weights_, options_);
  ASSERT_EQ(gpu->sampling_mask_count(), 4);
  SamplingParams unknown;
  unknown.mask = 4;
  EXPECT_NE(test::error_of<std::invalid_argument>([&] { gpu->set_sampling(0, unknown); })
                .find("mask 4 is not -1 (none) or one of this engine's 4 sampling masks"),
            std::string::npos);
  const std::vector<int32_t> slots = {2, 0, 1, 3};
  const int masks[] = {kUnits, kUnitsAndControls, kText, -1};
  for (size_t i = 0; i < slots.size(); ++i) {
    SamplingParams p{1.3f, i == 1 ? 30 : 0, i == 2 ? 0.9f : 1.f, 17 + i};
    p.mask = masks[i];
    for (Engine* e : {gpu.get(), cpu.get()}) {
      e->reset(slots[i]);
      e->set_sampling(slots[i], p);
    }
  }
  std::vector<int32_t> g_ids(slots.size()), c_ids(slots.size());
  for (int t = 0; t < 40; ++t) {
    // Input tokens now and then (each starts a frame again), else the samples continue.
    std::vector<int32_t> tokens(slots.size(), kContinueToken);
    if (t == 0 || t == 13) tokens.assign(slots.size(), 200);
    if (t == 22) tokens[0] = 7;
    gpu->step(slots, tokens, g_ids);
    cpu->step(slots, tokens, c_ids);
    ASSERT_EQ(g_ids, c_ids) << "step " << t;
  }
}

TEST_F(CudaEngineMasks, UnitsOnlyYieldsNoOtherTokenIn10000HotSteps) {
  auto engine = make_cuda_engine(*weights_, options_);
  const std::vector<int32_t> slots = {0, 1, 2, 3};
  for (int32_t s : slots) {
    SamplingParams p{1.5f, 0, 1.0f, 42 + static_cast<uint64_t>(s)};
    p.mask = kUnits;
    engine->reset(s);
    engine->set_sampling(s, p);
  }
  const SpeechUnitVocab& u = *layout_.speech_units;
  int draws = 0;
  const auto check = [&](const std::vector<int32_t>& sampled, int t) {
    for (int32_t id : sampled) {
      ASSERT_TRUE(u.contains(id)) << "step " << t << " sampled " << id;
      ASSERT_EQ(u.codebook_of(id), u.frame_order[static_cast<size_t>(t % 4)]) << "step " << t;
      ++draws;
    }
  };
  std::vector<int32_t> sampled(slots.size());
  const std::vector<int32_t> cont(slots.size(), kContinueToken);
  engine->step(slots, std::vector<int32_t>(slots.size(), 200), sampled);
  check(sampled, 0);
  for (int t = 1; t < 1250; ++t) {  // one step at a time
    engine->step(slots, cont, sampled);
    check(sampled, t);
  }
  engine->submit_step(slots, cont);  // then two queued at a time, as the server runs it
  for (int t = 1250; t < 2500; ++t) {
    if (t + 1 < 2500) engine->submit_step(slots, cont);
    engine->collect_step(sampled);
    check(sampled, t);
  }
  EXPECT_EQ(draws, 10000);
}

}  // namespace
}  // namespace m3
