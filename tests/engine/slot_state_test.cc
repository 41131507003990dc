// Engine::save_slot / load_slot on the CPU engine: a slot's state copied out and back (into
// another slot, or another engine of the same model) is bit-identical, and the decode
// that follows gives the same tokens as the slot that was never copied.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "model/cpu/cpu_engine.h"
#include "model/engine.h"
#include "model/weights.h"
#include "engine_steps.h"
#include "test_models.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

using testing::decode;
using testing::saved;
using testing::step1;
using testing::feed;

using testing::ScratchDir;
using ::testing::HasSubstr;

class SlotStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<ScratchDir>("slot_state");
    testing::write_model(testing::small_config(), dir_->path());
    weights_ = std::make_unique<ModelWeights>(ModelWeights::load(dir_->path()));
  }
  std::unique_ptr<Engine> engine(int slots) {
    EngineOptions o;
    o.max_slots = slots;
    o.cpu_threads = 2;
    return make_cpu_engine(*weights_, o);
  }

  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<ModelWeights> weights_;
};

TEST_F(SlotStateTest, SizeCoversStateCounterAndToken) {
  auto e = engine(2);
  const ModelConfig& c = e->config();
  EXPECT_EQ(e->slot_state_bytes(),
            sizeof(float) * static_cast<size_t>(c.n_layer) * static_cast<size_t>(c.state_floats_per_layer()) + 16);
}

TEST_F(SlotStateTest, LoadIntoAnotherSlotIsBitIdenticalAndDecodesTheSameGreedy) {
  auto e = engine(3);
  feed(*e, 0, {4, 17, 150, 3, 9});
  const std::vector<std::byte> a = saved(*e, 0);
  e->load_slot(2, a);
  EXPECT_EQ(saved(*e, 2), a);
  const std::vector<int32_t> original = decode(*e, 0, 12), copy = decode(*e, 2, 12);
  EXPECT_EQ(copy, original);
  // Decoding moved the state on: the copy taken before is no longer what the slot holds.
  EXPECT_NE(saved(*e, 0), a);
}

TEST_F(SlotStateTest, SeededSamplingContinuesTheSameDrawsInAnotherEngine) {
  SamplingParams p;
  p.temperature = 1.2f;
  p.top_k = 40;
  p.seed = 99;
  auto a = engine(2), b = engine(4);
  a->set_sampling(1, p);
  b->set_sampling(3, p);  // the sampling parameters are not part of the state
  feed(*a, 1, {1, 2, 3});
  decode(*a, 1, 5);  // the counter has moved on by 8 draws
  const std::vector<std::byte> bytes = saved(*a, 1);
  b->load_slot(3, bytes);
  EXPECT_EQ(saved(*b, 3), bytes);
  EXPECT_EQ(decode(*b, 3, 20), decode(*a, 1, 20));
}

TEST_F(SlotStateTest, AFreshStateHasNoTokenToContinueFrom) {
  auto e = engine(2);
  feed(*e, 0, {5});
  e->reset(1);
  e->load_slot(0, saved(*e, 1));
  EXPECT_THAT(test::error_of<std::invalid_argument>([&] { step1(*e, 0, kContinueToken); }),
              HasSubstr("no sampled token to continue from"));
}

TEST_F(SlotStateTest, BadArgumentsAreRefusedAndLeaveTheSlot) {
  auto e = engine(2);
  feed(*e, 0, {5, 6});
  const std::vector<std::byte> before = saved(*e, 0);
  std::vector<std::byte> small(e->slot_state_bytes() - 1);
  EXPECT_THAT(test::error_of<std::invalid_argument>([&] { e->load_slot(0, small); }),
              HasSubstr("bytes given, a slot's state is"));
  EXPECT_THAT(test::error_of<std::invalid_argument>([&] { e->save_slot(2, small); }),
              HasSubstr("slot 2 out of range"));
  std::vector<std::byte> bad_token = before;
  const int32_t token = 5000;
  std::memcpy(bad_token.data() + bad_token.size() - 8, &token, sizeof token);
  EXPECT_THAT(test::error_of<std::invalid_argument>([&] { e->load_slot(0, bad_token); }),
              HasSubstr("next input token 5000 is outside [-1, 203)"));
  EXPECT_EQ(saved(*e, 0), before);
}

}  // namespace
}  // namespace m3
