// Constrained sampling on the CUDA engine: a units-only slot yields no other token in
// 10,000 hot steps, flattened codebooks in frame order. Until the engine passes its
// masks to the sampling kernel (sampling_mask_count() == 0), it must refuse a mask with
// a clear error, and the property test skips saying so.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "model/cuda_engine.h"
#include "model/sampling_mask.h"
#include "model/vocab_layout.h"
#include "model/weights.h"
#include "test_models.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

TEST(CudaEngineMasks, UnitsOnlyYieldsNoOtherTokenIn10000HotSteps) {
  M3_REQUIRE_CUDA_DEVICE();
  testing::ScratchDir dir("cuda_masks");
  testing::write_model(testing::small_config(), dir.path());  // vocab 203
  const ModelWeights weights = ModelWeights::load(dir.path());
  const VocabLayout layout = VocabLayout::parse(R"({
    "text": {"size": 100},
    "speech_units": {"first_id": 100, "codebooks": 4, "units_per_codebook": 25, "frame_order": [2, 0, 3, 1]},
    "controls": {"bos": 200, "end_of_turn": 201, "end_of_reply": 202}
  })", "vocab.json", 203, dir.path());
  EngineOptions options;
  options.max_slots = 4;
  options.weight_dtype = WeightDType::F32;
  options.sampling_masks = sampling_masks_for(layout);
  const int units_mask = 2;
  ASSERT_EQ(options.sampling_masks[units_mask].name, "units");
  auto engine = make_cuda_engine(weights, options);
  SamplingParams p{1.5f, 0, 1.0f, 42};
  p.mask = units_mask;
  if (engine->sampling_mask_count() == 0) {
    EXPECT_NE(test::error_of<std::invalid_argument>([&] { engine->set_sampling(0, p); })
                  .find("mask 2 is not -1 (none) or one of this engine's 0 sampling masks"),
              std::string::npos);
    GTEST_SKIP() << "the CUDA engine does not pass sampling masks to its sampling kernel yet";
  }
  const std::vector<int32_t> slots = {0, 1, 2, 3};
  for (int32_t s : slots) {
    engine->reset(s);
    p.seed = 42 + static_cast<uint64_t>(s);
    engine->set_sampling(s, p);
  }
  std::vector<int32_t> sampled(slots.size());
  engine->step(slots, std::vector<int32_t>(slots.size(), 200), sampled);
  const std::vector<int32_t> cont(slots.size(), kContinueToken);
  const SpeechUnitVocab& u = *layout.speech_units;
  int draws = 0;
  for (int t = 0; t < 2500; ++t) {
    if (t > 0) engine->step(slots, cont, sampled);
    for (int32_t id : sampled) {
      ASSERT_TRUE(u.contains(id)) << "step " << t << " sampled " << id;
      ASSERT_EQ(u.codebook_of(id), u.frame_order[static_cast<size_t>(t % 4)]) << "step " << t;
      ++draws;
    }
  }
  EXPECT_EQ(draws, 10000);
}

}  // namespace
}  // namespace m3
