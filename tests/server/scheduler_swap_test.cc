// The scheduler's swap-in against an engine whose state copies take several polls to land
// (as the CUDA engine's load_slot_async runs beside the steps): the swapped-in session
// sits out every step until its slot is ready, the other streams step meanwhile, and the
// session then answers as if it had never left.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "collecting_writer.h"
#include "server/scheduler.h"

namespace m3 {
namespace {

using namespace std::chrono_literals;

// Samples (input + 1) % vocab; a slot's state is its last sample. A load_slot_async or
// save_slot_async copy lands only after kPollsPerLoad calls of slot_ready() (a save's bytes
// are the slot's at the call; a load from memory a save still writes reads them after it,
// as the copies run in order on one stream).
class SlowCopyEngine final : public Engine {
 public:
  static constexpr int kPollsPerLoad = 3;
  explicit SlowCopyEngine(int slots) : last_(slots, -1) { config_.vocab_size = 1000; }
  std::string_view backend() const override { return "slow-copy"; }
  const ModelConfig& config() const override { return config_; }
  int max_slots() const override { return static_cast<int>(last_.size()); }
  void reset(int slot) override {
    std::lock_guard lock(mu_);
    if (pending_.count(slot)) ++violations_;
    last_[slot] = -1;
  }
  void set_sampling(int, const SamplingParams&) override {}
  void step(std::span<const int32_t> slots, std::span<const int32_t> tokens, std::span<int32_t> sampled,
            std::span<float>) override {
    std::this_thread::sleep_for(200us);  // a stream's reader keeps up, as with a real step
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < slots.size(); ++i) {
      if (pending_.count(slots[i])) ++violations_;  // a step that would wait for the copy
      const int32_t in = tokens[i] == kContinueToken ? last_[slots[i]] : tokens[i];
      if (in < 0) throw std::invalid_argument("continue without a previous sample");
      sampled[i] = (in + 1) % config_.vocab_size;
      last_[slots[i]] = sampled[i];
    }
    if (!pending_.empty()) ++steps_beside_a_load_;
  }
  EngineStats stats() const override { return {}; }
  size_t slot_state_bytes() const override { return sizeof(int32_t); }
  void save_slot(int slot, std::span<std::byte> out) override {
    std::lock_guard lock(mu_);
    std::memcpy(out.data(), &last_[slot], sizeof(int32_t));
    ++saves_;
  }
  void load_slot(int slot, std::span<const std::byte> in) override {
    std::lock_guard lock(mu_);
    land_saves_into(in.data());
    std::memcpy(&last_[slot], in.data(), sizeof(int32_t));
  }
  void load_slot_async(int slot, const HostStateBuffer& in) override {
    std::lock_guard lock(mu_);
    land_saves_into(in.bytes().data());
    pending_[slot] = Pending{in.bytes().data(), kPollsPerLoad};  // the memory, as a DMA reads it
    ++async_loads_;
  }
  void save_slot_async(int slot, HostStateBuffer& out) override {
    std::lock_guard lock(mu_);
    saving_[slot] = Saving{out.bytes().data(), last_[slot], kPollsPerLoad};
    ++saves_;
  }
  bool slot_ready(int slot) const override {
    std::lock_guard lock(mu_);
    if (auto it = saving_.find(slot); it != saving_.end()) {
      if (it->second.polls_left-- > 0) return false;
      std::memcpy(it->second.target, &it->second.value, sizeof(int32_t));
      saving_.erase(it);
    }
    auto it = pending_.find(slot);
    if (it == pending_.end()) return true;
    if (it->second.polls_left-- > 0) return false;
    std::memcpy(&last_[slot], it->second.source, sizeof(int32_t));
    pending_.erase(it);
    return true;
  }
  int saves() const {
    std::lock_guard lock(mu_);
    return saves_;
  }
  int async_loads() const {
    std::lock_guard lock(mu_);
    return async_loads_;
  }
  int violations() const {
    std::lock_guard lock(mu_);
    return violations_;
  }
  int steps_beside_a_load() const {
    std::lock_guard lock(mu_);
    return steps_beside_a_load_;
  }

 private:
  struct Pending {
    const std::byte* source;
    int polls_left;
  };
  struct Saving {
    std::byte* target;
    int32_t value;
    int polls_left;
  };
  void land_saves_into(const std::byte* memory) const {
    for (auto it = saving_.begin(); it != saving_.end();) {
      if (it->second.target != memory) {
        ++it;
        continue;
      }
      std::memcpy(it->second.target, &it->second.value, sizeof(int32_t));
      it = saving_.erase(it);
    }
  }
  ModelConfig config_;
  mutable std::vector<int32_t> last_;
  mutable std::mutex mu_;
  mutable std::map<int, Pending> pending_;
  mutable std::map<int, Saving> saving_;
  int saves_ = 0, async_loads_ = 0, violations_ = 0, steps_beside_a_load_ = 0;
};

using m3::testing::CollectingWriter;

TEST(SchedulerSwapTest, ASwappedInSessionSitsOutStepsUntilItsStateIsInWhileOthersStep) {
  SlowCopyEngine engine(2);
  SchedulerOptions options;
  options.session_swap_after = 1ms;
  Scheduler scheduler(engine, options, nullptr, nullptr);

  CollectingWriter session;
  SequenceParams session_params;
  session_params.session = true;
  session.seq = std::make_shared<Sequence>(session_params, 4096, &session);
  ASSERT_EQ(scheduler.submit(session.seq).status, StreamStatus::kOk);
  session.seq->add_input(std::vector<int32_t>{5, 6});
  session.seq->end_turn(3);
  scheduler.wake();
  while (session.count() < 3) std::this_thread::sleep_for(1ms);

  // A stream that decodes until cancelled, beside the session's swaps.
  CollectingWriter stream;
  stream.seq = std::make_shared<Sequence>(SequenceParams{}, 4096, &stream);
  stream.seq->add_input(std::vector<int32_t>{100});
  stream.seq->end_turn(100000);
  stream.seq->close_input();
  ASSERT_EQ(scheduler.submit(stream.seq).status, StreamStatus::kOk);
  while (engine.saves() < 1 || stream.count() < 5) std::this_thread::sleep_for(1ms);  // the session left its slot

  session.seq->add_input(std::vector<int32_t>{20});
  session.seq->end_turn(2);
  scheduler.wake();
  while (session.count() < 5) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(session.got(), (std::vector<int32_t>{7, 8, 9, 21, 22}));
  EXPECT_GE(engine.async_loads(), 1);
  EXPECT_EQ(engine.violations(), 0);            // no step or reset of the slot before its copy was in
  EXPECT_GE(engine.steps_beside_a_load(), 1);  // the stream stepped while it landed

  stream.seq->request_cancel(StreamStatus::kCancelled, "cancelled by the test");
  session.seq->close_input();
  scheduler.wake();
  EXPECT_EQ(stream.wait_closed(), StreamStatus::kCancelled);
  EXPECT_EQ(session.wait_closed(), StreamStatus::kOk);
}

}  // namespace
}  // namespace m3
