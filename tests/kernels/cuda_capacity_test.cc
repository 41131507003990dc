// The CUDA side of max_batch auto and state_dtype: auto asks the device's
// free memory and sizes from it; an engine of 4096 slots (13 buckets, the largest 4096)
// steps them all and gives a slot what the CPU engine gives it; state_dtype bf16 is
// refused by name until the kernels store it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "model/engine.h"
#include "model/slot_budget.h"
#include "model/weights.h"
#include "test_models.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

using testing::ScratchDir;

class CudaCapacityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_model(testing::small_config(), dir_.path());
    weights_ = std::make_unique<ModelWeights>(ModelWeights::load(dir_.path()));
  }
  ScratchDir dir_{"cuda_capacity"};
  std::unique_ptr<ModelWeights> weights_;
};

TEST_F(CudaCapacityTest, AutoSizesFromTheDevicesFreeMemory) {
  M3_REQUIRE_CUDA_DEVICE();
  EngineOptions o;
  const uint64_t free = cuda_free_memory(0);
  EXPECT_GT(free, uint64_t{1} << 30);
  const MaxBatchChoice choice = choose_auto_max_batch("cuda", weights_->config(), o);
  // The small model's slot is a few hundred kB: every GPU this runs on holds the cap.
  EXPECT_EQ(choice.max_batch, kMaxBatchLimit) << choice.reason;
  EXPECT_EQ(choice.reason.rfind("cuda: ", 0), 0u) << choice.reason;
}

TEST_F(CudaCapacityTest, FourThousandNinetySixSlotsStepTogetherAsTheCpuEngineStepsOne) {
  M3_REQUIRE_CUDA_DEVICE();
  EngineOptions o;
  o.max_slots = kMaxBatchLimit;
  o.weight_dtype = WeightDType::F32;
  auto cuda = make_engine("cuda", *weights_, o);
  o.max_slots = 1;
  auto cpu = make_engine("cpu", *weights_, o);
  const int V = weights_->config().padded_vocab(), vocab = weights_->config().vocab_size;
  std::vector<int32_t> slots(kMaxBatchLimit), tokens(kMaxBatchLimit), sampled(kMaxBatchLimit);
  std::iota(slots.begin(), slots.end(), 0);
  std::vector<float> logits(static_cast<size_t>(kMaxBatchLimit) * V), ref(V);
  const int32_t watched = kMaxBatchLimit - 1, cpu_slot = 0;
  for (int t = 0; t < 4; ++t) {
    for (int s = 0; s < kMaxBatchLimit; ++s) tokens[s] = (s * 31 + t * 7) % vocab;
    cuda->step(slots, tokens, sampled, logits);
    int32_t one = 0;
    cpu->step({&cpu_slot, 1}, {&tokens[watched], 1}, {&one, 1}, ref);
    const float* row = logits.data() + static_cast<size_t>(watched) * V;
    double diff = 0, scale = 0;
    for (int i = 0; i < V; ++i) {
      diff = std::max(diff, double(std::fabs(row[i] - ref[i])));
      scale = std::max(scale, double(std::fabs(ref[i])));
    }
    EXPECT_LE(diff / scale, 1e-4) << "step " << t;
    EXPECT_EQ(sampled[watched], one) << "step " << t;
  }
}

TEST_F(CudaCapacityTest, Bf16StateIsRefusedByName) {
  M3_REQUIRE_CUDA_DEVICE();
  EngineOptions o;
  o.state_dtype = StateDType::BF16;
  EXPECT_EQ(test::error_of([&] { make_engine("cuda", *weights_, o); }),
            "state_dtype bf16 is not implemented on the cuda backend yet (use state_dtype fp32, or backend cpu)");
}

}  // namespace
}  // namespace m3
