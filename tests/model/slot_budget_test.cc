// What a slot costs and what max_batch `auto` picks from it: the CUDA sizing as a function
// of the free bytes and the model config (no device needed), the CPU one of its cores.
#include "model/slot_budget.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "tests/model/test_util.h"

namespace m3 {
namespace {

using ::testing::HasSubstr;
using test::error_of;

constexpr uint64_t kGiB = uint64_t{1} << 30;

ModelConfig s2s_14l() {
  return ModelConfig::load(std::filesystem::path(M3_CONFIGS_DIR) / "s2s-14l.json");
}

// s2s-14l: 28 heads x (32 angles + 64 x 128 ssm + 4 x 128 k_prev + 64 x_prev) = 246,400
// floats a layer, 14 layers.
TEST(SlotBudget, StateBytesOfS2s14l) {
  const ModelConfig c = s2s_14l();
  EXPECT_EQ(slot_state_bytes(c, StateDType::F32), int64_t{246'400} * 4 * 14);  // 13.8 MB
  // bf16: only the 28 x 64 x 128 ssm floats a layer take 2 bytes; the other 17,024 stay fp32.
  EXPECT_EQ(slot_state_bytes(c, StateDType::BF16), (int64_t{229'376} * 2 + 17'024 * 4) * 14);
  // residual 896 + in_proj 4,736 (4,724 padded to 64) + mixer 1,792 + logits 4,096 + the
  // GEMMs' normed rows 896 floats, + 128 bytes of tables.
  EXPECT_EQ(slot_step_buffer_bytes(c), 4 * 12'416 + 128);
  EXPECT_EQ(weight_bytes(c, WeightDType::BF16), 2 * c.parameter_count());
  EXPECT_EQ(weight_bytes(c, WeightDType::F32), 4 * c.parameter_count());
}

// 40 GiB free: 4 GiB headroom (10%) and 172 MB of bf16 weights leave 38.48 GB, 2,779
// slots of 13.84 MB, rounded down to 2,752 (a multiple of 64).
TEST(CudaAutoMaxBatch, FillsFreeMemoryAfterWeightsAndHeadroom) {
  const ModelConfig c = s2s_14l();
  ASSERT_EQ(c.parameter_count(), 86'126'992);
  const MaxBatchChoice choice = cuda_auto_max_batch(40 * kGiB, c, WeightDType::BF16, StateDType::F32);
  EXPECT_EQ(choice.max_batch, 2752);
  EXPECT_EQ(choice.reason,
            "cuda: 40.0 GiB free, 13.8 MB a slot (13.8 MB fp32 state), 0.2 GiB of weights, "
            "4.0 GiB headroom; a multiple of 64");
}

TEST(CudaAutoMaxBatch, WhatItChoosesFitsAndOneMoreStepOf64DoesNot) {
  const ModelConfig c = s2s_14l();
  for (uint64_t gib : {8, 24, 48, 80}) {
    for (StateDType state : {StateDType::F32, StateDType::BF16}) {
      const uint64_t free = gib * kGiB;
      const int n = cuda_auto_max_batch(free, c, WeightDType::BF16, state).max_batch;
      const double per_slot = double(slot_state_bytes(c, state) + slot_step_buffer_bytes(c));
      const double set_aside = std::max(0.1 * double(free), 2.0 * kGiB) + double(weight_bytes(c, WeightDType::BF16));
      SCOPED_TRACE(std::to_string(gib) + " GiB, state " + std::string(state_dtype_name(state)));
      EXPECT_EQ(n % 64, 0);
      EXPECT_LE(set_aside + n * per_slot, double(free));
      if (n < kMaxBatchLimit) EXPECT_GT(set_aside + (n + 64) * per_slot, double(free));
    }
  }
}

// bf16 state holds about twice the slots; an H200's free memory reaches the cap.
TEST(CudaAutoMaxBatch, Bf16StateHoldsMoreAndTheCapIs4096) {
  const ModelConfig c = s2s_14l();
  const int fp32 = cuda_auto_max_batch(24 * kGiB, c, WeightDType::BF16, StateDType::F32).max_batch;
  const int bf16 = cuda_auto_max_batch(24 * kGiB, c, WeightDType::BF16, StateDType::BF16).max_batch;
  EXPECT_EQ(fp32, 1600);
  EXPECT_EQ(bf16, 3072);
  const MaxBatchChoice h200 = cuda_auto_max_batch(139 * kGiB, c, WeightDType::BF16, StateDType::F32);
  EXPECT_EQ(h200.max_batch, 4096);
  EXPECT_THAT(h200.reason, HasSubstr("; capped at 4096"));
}

// Below 64 slots every slot counts: no rounding. 2.5 GiB: 2 GiB headroom, 364.6 MB left.
TEST(CudaAutoMaxBatch, SmallDevicesKeepEverySlotAndNoneFittingIsAnError) {
  const ModelConfig c = s2s_14l();
  EXPECT_EQ(cuda_auto_max_batch(5 * kGiB / 2, c, WeightDType::BF16, StateDType::F32).max_batch, 26);
  EXPECT_EQ(error_of([&] { cuda_auto_max_batch(2 * kGiB, c, WeightDType::BF16, StateDType::F32); }),
            "max_batch auto: not one slot fits on the cuda device (cuda: 2.0 GiB free, 13.8 MB a "
            "slot (13.8 MB fp32 state), 0.2 GiB of weights, 2.0 GiB headroom); set max_batch, or "
            "free device memory");
}

TEST(CpuAutoMaxBatch, OneSlotPerCoreAtLeastEight) {
  EXPECT_EQ(cpu_auto_max_batch(32).max_batch, 32);
  EXPECT_EQ(cpu_auto_max_batch(32).reason, "cpu engine, 32 cores");
  EXPECT_EQ(cpu_auto_max_batch(8).reason, "cpu engine, 8 cores");
  EXPECT_EQ(cpu_auto_max_batch(2).max_batch, 8);
  EXPECT_EQ(cpu_auto_max_batch(2).reason, "cpu engine, 2 cores; at least 8");
  EXPECT_EQ(cpu_auto_max_batch(1).reason, "cpu engine, 1 core; at least 8");
  EXPECT_EQ(cpu_auto_max_batch(10000).max_batch, kMaxBatchLimit);
}

TEST(StateDType, NamesRoundTrip) {
  StateDType d = StateDType::F32;
  ASSERT_TRUE(parse_state_dtype("bf16", &d));
  EXPECT_EQ(d, StateDType::BF16);
  EXPECT_EQ(state_dtype_name(d), "bf16");
  ASSERT_TRUE(parse_state_dtype("fp32", &d));
  EXPECT_EQ(state_dtype_name(d), "fp32");
  EXPECT_FALSE(parse_state_dtype("fp16", &d));
}

}  // namespace
}  // namespace m3
