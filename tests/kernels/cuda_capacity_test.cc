// The CUDA side of max_batch auto and state_dtype: auto asks the device's
// free memory and sizes from it; an engine of 4096 slots (103 buckets, the largest 4096)
// steps them all and gives a slot what the CPU engine gives it; state_dtype bf16 halves
// the ssm bytes and steps as the CPU engine's bf16 state does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "model/engine.h"
#include "model/slot_budget.h"
#include "model/weights.h"
#include "model/cuda_policy.h"
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

// The largest relative difference of two logit rows, over the reference's largest entry.
double relative_difference(const float* got, const float* ref, int n) {
  double diff = 0, scale = 0;
  for (int i = 0; i < n; ++i) {
    diff = std::max(diff, double(std::fabs(got[i] - ref[i])));
    scale = std::max(scale, double(std::fabs(ref[i])));
  }
  return diff / scale;
}

// CUDA bf16 state against the CPU engine's (same rounding of the state, fp32 arithmetic)
// and against the CUDA engine's fp32 state, on the model in `dir`: five slots side by side,
// one alone (batch 1; out_proj fused into the recurrence where `fused`), then a slot saved
// and loaded into another.
void check_bf16_state(const std::filesystem::path& dir, bool fused, bool streaming = false) {
  const ModelWeights weights = ModelWeights::load(dir);
  const ModelConfig& c = weights.config();
  EngineOptions o;
  o.max_slots = 6;
  o.weight_dtype = WeightDType::BF16;
  o.state_dtype = StateDType::BF16;
  o.cuda.step_variants.out_proj_fused = fused ? Tuned::On : Tuned::Off;
  if (streaming) o.cuda.recurrence.streaming_min_batch = 1;
  auto cuda = make_engine("cuda", weights, o);
  auto cpu = make_engine("cpu", weights, o);
  o.state_dtype = StateDType::F32;
  auto cuda_fp32_state = make_engine("cuda", weights, o);
  const size_t ssm_floats = size_t(c.n_layer) * c.n_heads() * c.ssm.headdim * c.ssm.d_state;
  EXPECT_EQ(cuda->slot_state_bytes(), cuda_fp32_state->slot_state_bytes() - 2 * ssm_floats);

  const int V = c.padded_vocab(), vocab = c.vocab_size;
  const std::vector<int32_t> five = {0, 1, 2, 3, 4}, alone = {5};
  std::vector<int32_t> tokens(5), sampled(5), cpu_sampled(5);
  std::vector<float> logits(5 * size_t(V)), cpu_logits(5 * size_t(V)), fp32_logits(5 * size_t(V));
  std::vector<float> one_logits(V), cpu_one_logits(V);
  double worst = 0, worst_vs_fp32_state = 0;
  for (int t = 0; t < 24; ++t) {
    for (int s = 0; s < 5; ++s) tokens[s] = (s * 37 + t * 11 + 1) % vocab;
    cuda->step(five, tokens, sampled, logits);
    cpu->step(five, tokens, cpu_sampled, cpu_logits);
    cuda_fp32_state->step(five, tokens, cpu_sampled, fp32_logits);
    for (int s = 0; s < 5; ++s) {
      const size_t row = size_t(s) * V;
      worst = std::max(worst, relative_difference(&logits[row], &cpu_logits[row], V));
      worst_vs_fp32_state =
          std::max(worst_vs_fp32_state, relative_difference(&logits[row], &fp32_logits[row], V));
    }
    const int32_t one_token[] = {tokens[0]};
    int32_t one = 0, cpu_one = 0;
    cuda->step(alone, one_token, {&one, 1}, one_logits);
    cpu->step(alone, one_token, {&cpu_one, 1}, cpu_one_logits);
    worst = std::max(worst, relative_difference(one_logits.data(), cpu_one_logits.data(), V));
  }
  // Within the bf16 tolerance of the goldens (m3check's 3e-2), and not the fp32 state's
  // logits bit for bit: the state really is rounded.
  EXPECT_LE(worst, 3e-2);
  EXPECT_GT(worst_vs_fp32_state, 0.0);
  EXPECT_LE(worst_vs_fp32_state, 3e-2);

  // A bf16 slot saved and loaded into another holds the same bytes and decodes alike: bit
  // for bit, except where batch 2 adds out_proj with atomics (in no fixed order: a last-bit
  // difference in the residual may flip the bf16 rounding of an activation, so the two
  // rows then agree within the bf16 tolerance).
  std::vector<std::byte> bytes(cuda->slot_state_bytes()), copied(cuda->slot_state_bytes());
  cuda->save_slot(2, bytes);
  cuda->load_slot(5, bytes);
  cuda->save_slot(5, copied);
  EXPECT_TRUE(bytes == copied);
  const std::vector<int32_t> pair = {2, 5};
  std::vector<int32_t> pair_tokens = {kContinueToken, kContinueToken}, pair_sampled(2);
  std::vector<float> pair_logits(2 * size_t(V));
  for (int t = 0; t < 4; ++t) {
    cuda->step(pair, pair_tokens, pair_sampled, pair_logits);
    EXPECT_EQ(pair_sampled[0], pair_sampled[1]) << "step " << t;
    const double apart = relative_difference(&pair_logits[V], &pair_logits[0], V);
    if (fused) {
      EXPECT_LE(apart, 3e-2) << "step " << t;
    } else {
      EXPECT_EQ(apart, 0.0) << "step " << t;
    }
  }
}

TEST_F(CudaCapacityTest, Bf16StateHoldsHalfTheSsmBytesAndStepsAsTheCpuEnginesBf16State) {
  M3_REQUIRE_CUDA_DEVICE();
  check_bf16_state(dir_.path(), /*fused=*/false);
}

// s2s-14l's head shape (rank 4, headdim 64, d_state 128), where batch 1 fuses out_proj.
TEST_F(CudaCapacityTest, Bf16StateInTheFusedBatchOneKernelStepsAsTheCpuEnginesBf16State) {
  M3_REQUIRE_CUDA_DEVICE();
  ModelConfig c = testing::small_config();
  c.d_model = 128;
  c.ssm.mimo_rank = 4;
  c.ssm.headdim = 64;
  c.ssm.d_state = 128;
  ScratchDir dir("cuda_bf16_state_s2s_heads");
  testing::write_model(c, dir.path());
  check_bf16_state(dir.path(), /*fused=*/true);
}

// The same head shape with every batch's recurrence in the streaming kernel, whose stages
// hold the bf16 state as it is stored.
TEST_F(CudaCapacityTest, Bf16StateInTheStreamingKernelStepsAsTheCpuEnginesBf16State) {
  M3_REQUIRE_CUDA_DEVICE();
  ModelConfig c = testing::small_config();
  c.d_model = 128;
  c.ssm.mimo_rank = 4;
  c.ssm.headdim = 64;
  c.ssm.d_state = 128;
  ScratchDir dir("cuda_bf16_state_streaming");
  testing::write_model(c, dir.path());
  check_bf16_state(dir.path(), /*fused=*/false, /*streaming=*/true);
}

TEST_F(CudaCapacityTest, Bf16StateWithFp32WeightsIsRefusedByName) {
  M3_REQUIRE_CUDA_DEVICE();
  EngineOptions o;
  o.weight_dtype = WeightDType::F32;
  o.state_dtype = StateDType::BF16;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { make_engine("cuda", *weights_, o); }),
            "cuda engine: state_dtype bf16 needs weight_dtype bf16: the recurrence that stores bf16 state runs "
            "on tensor cores, for bf16 weights (state_dtype fp32 can)");
}

TEST_F(CudaCapacityTest, Bf16StateWithTheCudaCoreRecurrenceAtSmallBatchesIsRefusedByName) {
  M3_REQUIRE_CUDA_DEVICE();
  EngineOptions o;
  o.weight_dtype = WeightDType::BF16;
  o.state_dtype = StateDType::BF16;
  o.cuda.recurrence_tensor_core_min_batch = 2;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { make_engine("cuda", *weights_, o); }),
            "cuda engine: state_dtype bf16 needs cuda.recurrence_tensor_core_min_batch 1 (got 2): the CUDA-core "
            "recurrence stores fp32 state only (state_dtype fp32 can)");
}

}  // namespace
}  // namespace m3
