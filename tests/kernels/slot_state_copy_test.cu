// SlotStateCopier (model/cuda/slot_state_copy.h) on a real device: a slot's regions saved
// to bytes and loaded into another slot are bit-identical, the copies wait for the work
// queued on the step stream before them, and the step stream's later work sees the load.
// Label gpu; skips without a device.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "model/cuda/slot_state_copy.h"

namespace m3 {
namespace {

using cuda::SlotDeviceState;
using cuda::SlotHostFlags;
using cuda::SlotStateCopier;

__global__ void add_one(float* x, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] += 1.0f;
}

struct TwoSlots {
  static constexpr size_t kFloats = 100003;  // odd, so nothing lines up by accident
  testing::DeviceArray<float> state{2 * kFloats};
  testing::DeviceArray<uint64_t> counters{2};
  testing::DeviceArray<int32_t> tokens{2};
  testing::DeviceArray<int32_t> frame_positions{2};
  SlotDeviceState slot(int i) {
    return {state.get() + i * kFloats, counters.get() + i, tokens.get() + i, frame_positions.get() + i};
  }
};

TEST(SlotStateCopy, SaveThenLoadIntoAnotherSlotIsBitIdentical) {
  M3_REQUIRE_CUDA_DEVICE();
  TwoSlots d;
  std::mt19937 rng(3);
  std::vector<float> host(2 * TwoSlots::kFloats);
  for (auto& v : host) v = std::uniform_real_distribution<float>(-1, 1)(rng);
  d.state.upload(host);
  d.counters.upload({77, 0});
  d.tokens.upload({123, 0});
  d.frame_positions.upload({5, 0});
  cudaStream_t stream;
  M3_CUDA_CHECK(cudaStreamCreate(&stream));
  SlotStateCopier copier(TwoSlots::kFloats);
  std::vector<std::byte> bytes(copier.bytes());
  copier.save(stream, d.slot(0), SlotHostFlags{true, 1}, bytes);
  const SlotHostFlags flags = copier.load(stream, d.slot(1), bytes, 1000);
  EXPECT_TRUE(flags.has_sample);
  EXPECT_EQ(flags.parity, 1u);
  M3_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<float> after = d.state.download();
  EXPECT_EQ(std::memcmp(after.data(), after.data() + TwoSlots::kFloats, sizeof(float) * TwoSlots::kFloats), 0);
  EXPECT_EQ(d.counters.download()[1], 77u);
  EXPECT_EQ(d.tokens.download()[1], 123);
  EXPECT_EQ(d.frame_positions.download()[1], 5);
  std::vector<std::byte> again(copier.bytes());
  copier.save(stream, d.slot(1), SlotHostFlags{true, 1}, again);
  EXPECT_EQ(again, bytes);
  M3_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(SlotStateCopy, CopiesAreOrderedWithTheStepStream) {
  M3_REQUIRE_CUDA_DEVICE();
  TwoSlots d;
  d.state.upload(std::vector<float>(2 * TwoSlots::kFloats, 0.0f));
  d.counters.upload({1, 1});
  d.tokens.upload({1, 1});
  d.frame_positions.upload({0, 0});
  cudaStream_t stream;
  M3_CUDA_CHECK(cudaStreamCreate(&stream));
  SlotStateCopier copier(TwoSlots::kFloats);
  std::vector<std::byte> bytes(copier.bytes());
  // A "step" queued before the save: the save sees its result.
  for (int i = 0; i < 50; ++i) add_one<<<64, 256, 0, stream>>>(d.slot(0).state, TwoSlots::kFloats);
  copier.save(stream, d.slot(0), SlotHostFlags{false, 0}, bytes);
  float first;
  std::memcpy(&first, bytes.data(), sizeof first);
  EXPECT_EQ(first, 50.0f);
  // A load, then a step queued after it: the step reads what was loaded.
  copier.load(stream, d.slot(1), bytes, 1000);
  add_one<<<64, 256, 0, stream>>>(d.slot(1).state, TwoSlots::kFloats);
  M3_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<float> after = d.state.download();
  for (size_t i = 0; i < TwoSlots::kFloats; i += 997) ASSERT_EQ(after[TwoSlots::kFloats + i], 51.0f) << i;
  M3_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(SlotStateCopy, RefusesBytesOfAnotherShape) {
  M3_REQUIRE_CUDA_DEVICE();
  TwoSlots d;
  cudaStream_t stream;
  M3_CUDA_CHECK(cudaStreamCreate(&stream));
  SlotStateCopier copier(TwoSlots::kFloats);
  std::vector<std::byte> bytes(copier.bytes() - 1);
  EXPECT_THROW(copier.load(stream, d.slot(1), bytes, 1000), std::invalid_argument);
  std::vector<std::byte> bad(copier.bytes());
  const int32_t token = 5000;
  std::memcpy(bad.data() + sizeof(float) * TwoSlots::kFloats + 8, &token, sizeof token);
  EXPECT_THROW(copier.load(stream, d.slot(1), bad, 1000), std::invalid_argument);
  // The two spare bytes after the flags must be zero; the frame position must not be negative.
  std::vector<std::byte> spare(copier.bytes());
  spare[sizeof(float) * TwoSlots::kFloats + 14] = std::byte{1};
  EXPECT_THROW(copier.check(spare, 1000), std::invalid_argument);
  std::vector<std::byte> frame(copier.bytes());
  const int32_t negative = -1;
  std::memcpy(frame.data() + sizeof(float) * TwoSlots::kFloats + 16, &negative, sizeof negative);
  EXPECT_THROW(copier.check(frame, 1000), std::invalid_argument);
  EXPECT_NO_THROW(copier.check(std::vector<std::byte>(copier.bytes()), 1000));
  M3_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace m3
