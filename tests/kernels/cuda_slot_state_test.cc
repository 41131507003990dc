// Engine::save_slot / load_slot on the CUDA engine (label gpu; skips without a device): a
// slot's state saved and loaded into another slot is bit-identical, the decode after it
// gives the same tokens (greedy and seeded), also with steps queued around the copies
// (submit_step/collect_step, as the server's pipelined scheduler runs them), page-locked
// host buffers (allocate_host_state) copy directly and give the same bytes, and bytes
// of another shape or a bad token are refused without making the engine unusable.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "gpu_test_util.h"
#include "model/cuda/cuda_engine.h"
#include "model/cuda/device_buffer.h"
#include "model/weights.h"
#include "engine_steps.h"
#include "test_models.h"

namespace m3 {
namespace {

using testing::decode;
using testing::saved;
using testing::step1;

using testing::ScratchDir;

class CudaSlotState : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::cuda_device_present()) GTEST_SKIP() << "no CUDA device";
    dir_ = std::make_unique<ScratchDir>("cuda_slot_state");
    testing::write_model(testing::small_config(), dir_->path());
    weights_ = std::make_unique<ModelWeights>(ModelWeights::load(dir_->path()));
  }
  std::unique_ptr<Engine> engine(int slots, WeightDType dtype = WeightDType::BF16) {
    EngineOptions o;
    o.max_slots = slots;
    o.weight_dtype = dtype;
    o.deterministic = true;  // bitwise-repeatable steps, so that two runs can be compared
    return make_cuda_engine(*weights_, o);
  }

  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<ModelWeights> weights_;
};

TEST_F(CudaSlotState, LoadIntoAnotherSlotIsBitIdenticalAndDecodesTheSame) {
  for (WeightDType dtype : {WeightDType::BF16, WeightDType::F32}) {
    auto e = engine(3, dtype);
    SamplingParams p;
    p.temperature = 1.1f;
    p.seed = 9;
    for (int slot : {0, 2}) e->set_sampling(slot, p);
    for (int32_t t : {4, 17, 150, 3, 9}) step1(*e, 0, t);  // an odd count: the other parity half
    const std::vector<std::byte> a = saved(*e, 0);
    e->reset(2);
    e->load_slot(2, a);
    EXPECT_EQ(saved(*e, 2), a);
    EXPECT_EQ(decode(*e, 2, 16), decode(*e, 0, 16));
    // And in a new engine with more slots.
    auto other = engine(4, dtype);
    other->set_sampling(3, p);
    other->load_slot(3, a);
    EXPECT_EQ(saved(*other, 3), a);
  }
}

TEST_F(CudaSlotState, CopiesAreOrderedWithQueuedSteps) {
  auto e = engine(2);
  // Slot 0 fed 6 tokens; the last two steps are still queued when the save is called.
  for (int32_t t : {1, 2, 3, 4}) step1(*e, 0, t);
  const int32_t slot0[] = {0};
  const int32_t t5[] = {5}, t6[] = {6};
  e->submit_step(slot0, t5);
  e->submit_step(slot0, t6);
  const std::vector<std::byte> during = saved(*e, 0);
  int32_t out = 0;
  e->collect_step({&out, 1});
  e->collect_step({&out, 1});
  EXPECT_EQ(saved(*e, 0), during);  // it saw both queued steps
  // A load followed at once by queued steps into the same slot: they read the loaded state.
  e->load_slot(1, during);
  const int32_t slot1[] = {1};
  const int32_t cont[] = {kContinueToken};
  int32_t a = 0, b = 0;
  e->submit_step(slot1, cont);
  e->submit_step(slot0, cont);
  e->collect_step({&a, 1});
  e->collect_step({&b, 1});
  EXPECT_EQ(a, b);
}

TEST_F(CudaSlotState, HostStateBuffersArePageLockedAndCopyAsPageableBytesDo) {
  auto e = engine(3);
  for (int32_t t : {8, 1, 77}) step1(*e, 0, t);
  HostStateBuffer buffer = e->allocate_host_state();
  ASSERT_EQ(buffer.size(), e->slot_state_bytes());
  ASSERT_TRUE(cuda::is_page_locked(buffer.bytes().data(), buffer.size()));
  EXPECT_TRUE(cuda::is_page_locked(buffer.bytes().data() + 1, buffer.size() - 1));
  EXPECT_FALSE(cuda::is_page_locked(buffer.bytes().data() + 1, buffer.size()));
  const std::vector<std::byte> pageable = saved(*e, 0);
  EXPECT_FALSE(cuda::is_page_locked(pageable.data(), pageable.size()));
  // Every byte written by the direct save: the buffer starts as something no save gives.
  std::memset(buffer.bytes().data(), 0xab, buffer.size());
  e->save_slot(0, buffer.bytes());
  ASSERT_TRUE(std::equal(pageable.begin(), pageable.end(), buffer.bytes().begin()));
  // A direct load beside a queued step of another slot, then a step of the loaded slot
  // queued behind it: it reads the loaded state.
  const int32_t slot0[] = {0}, slot2[] = {2};
  const int32_t cont[] = {kContinueToken};
  e->reset(2);
  e->submit_step(slot0, cont);
  e->load_slot(2, buffer.bytes());
  std::memset(buffer.bytes().data(), 0, buffer.size());  // the caller's again once load_slot returns
  e->submit_step(slot2, cont);
  int32_t from0 = 0, from2 = 0;
  e->collect_step({&from0, 1});
  e->collect_step({&from2, 1});
  EXPECT_EQ(from2, from0);
  EXPECT_EQ(saved(*e, 2), saved(*e, 0));
}

TEST_F(CudaSlotState, AsyncLoadsLandBesideOtherSlotsStepsAndStepsOfTheSlotWaitForThem) {
  auto e = engine(3);
  for (int32_t t : {3, 30, 190}) step1(*e, 0, t);
  step1(*e, 1, 7);
  HostStateBuffer buffer = e->allocate_host_state();
  e->save_slot(0, buffer.bytes());
  const int32_t slot0[] = {0}, slot1[] = {1}, slot2[] = {2};
  const int32_t cont[] = {kContinueToken};
  int32_t out = 0;
  // Slot 1 steps while the copy into slot 2 runs; slot 2 is then slot 0's state.
  e->load_slot_async(2, buffer);
  e->submit_step(slot1, cont);
  e->collect_step({&out, 1});
  while (!e->slot_ready(2)) {
  }
  EXPECT_EQ(saved(*e, 2), saved(*e, 0));
  // A step of the slot queued before its copy is known to be done waits for it.
  e->reset(2);
  e->load_slot_async(2, buffer);
  int32_t from0 = 0, from2 = 0;
  e->submit_step(slot2, cont);
  e->collect_step({&from2, 1});
  e->submit_step(slot0, cont);
  e->collect_step({&from0, 1});
  EXPECT_EQ(from2, from0);
  EXPECT_TRUE(e->slot_ready(2));
  // Bytes not in page-locked memory load as load_slot does.
  HostStateBuffer plain = HostStateBuffer::plain(e->slot_state_bytes());
  e->save_slot(1, plain.bytes());
  e->load_slot_async(2, plain);
  EXPECT_TRUE(e->slot_ready(2));
  EXPECT_EQ(saved(*e, 2), saved(*e, 1));
}

TEST_F(CudaSlotState, AsyncSavesHoldTheSlotAsItWasWhileTheSlotGoesOnToANewSequence) {
  auto e = engine(2);
  for (int32_t t : {12, 2, 99, 5}) step1(*e, 0, t);
  const std::vector<std::byte> before = saved(*e, 0);
  HostStateBuffer buffer = e->allocate_host_state();
  std::memset(buffer.bytes().data(), 0xcd, buffer.size());
  const int32_t slot0[] = {0};
  const int32_t cont[] = {kContinueToken};
  e->submit_step(slot0, cont);  // queued before the save: the save sees it
  e->save_slot_async(0, buffer);
  e->reset(0);  // the slot's next sequence: its reset waits for the copy on the device
  const int32_t first[] = {42};
  e->submit_step(slot0, first);
  int32_t out = 0;
  e->collect_step({&out, 1});
  e->collect_step({&out, 1});
  while (!e->slot_ready(0)) {
  }
  // The bytes are the slot after the queued step, before the reset: load them and compare.
  e->load_slot(1, buffer.bytes());
  auto replay = engine(2);
  replay->load_slot(0, before);
  const int32_t cont0[] = {kContinueToken};
  int32_t sample = 0;
  replay->step(slot0, cont0, {&sample, 1});
  EXPECT_EQ(saved(*e, 1), saved(*replay, 0));
}

TEST_F(CudaSlotState, BadBytesAreRefusedAndTheEngineGoesOn) {
  auto e = engine(2);
  step1(*e, 0, 5);
  std::vector<std::byte> small(e->slot_state_bytes() - 1);
  EXPECT_THROW(e->load_slot(1, small), std::invalid_argument);
  // The tail: counter (8 bytes), last token (4), flags (4), frame position (4).
  std::vector<std::byte> bad = saved(*e, 0);
  const int32_t token = 1 << 20;
  std::memcpy(bad.data() + bad.size() - 12, &token, sizeof token);
  EXPECT_THROW(e->load_slot(1, bad), std::invalid_argument);
  std::vector<std::byte> bad_frame = saved(*e, 0);
  const int32_t negative = -3;
  std::memcpy(bad_frame.data() + bad_frame.size() - 4, &negative, sizeof negative);
  EXPECT_THROW(e->load_slot(1, bad_frame), std::invalid_argument);
  EXPECT_EQ(e->failure(), "");
  EXPECT_GE(step1(*e, 0, 6), 0);
}

}  // namespace
}  // namespace m3
