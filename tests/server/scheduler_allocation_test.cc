// The scheduler's engine thread allocates nothing per token (server/README.md: step arrays
// preallocated, no log, no gRPC): this binary counts the global operator new
// (tests/engine/counting_new.cc) on the thread a fake engine's step() runs on, while two
// sequences decode side by side, pipelined.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "counting_new.h"
#include "server/scheduler.h"

namespace m3 {
namespace {

using namespace std::chrono_literals;

// Samples (input + 1) % 1000 and records nothing; marks the thread it runs on.
class QuietEngine final : public Engine {
 public:
  explicit QuietEngine(int slots) : last_(static_cast<size_t>(slots), 0) { config_.vocab_size = 1000; }
  std::string_view backend() const override { return "quiet"; }
  const ModelConfig& config() const override { return config_; }
  int max_slots() const override { return static_cast<int>(last_.size()); }
  void reset(int slot) override { last_[static_cast<size_t>(slot)] = 0; }
  void set_sampling(int, const SamplingParams&) override {}
  void step(std::span<const int32_t> slots, std::span<const int32_t> tokens, std::span<int32_t> sampled,
            std::span<float>) override {
    testing::mark_this_thread();
    for (size_t i = 0; i < slots.size(); ++i) {
      int32_t& last = last_[static_cast<size_t>(slots[i])];
      sampled[i] = ((tokens[i] == kContinueToken ? last : tokens[i]) + 1) % 1000;
      last = sampled[i];
    }
    steps_.fetch_add(1, std::memory_order_relaxed);
  }
  EngineStats stats() const override { return {steps_.load(), 0, 0}; }
  bool has_prefill_path() const override { return true; }
  // The base class's prefill (it steps, on the marked thread), counted.
  void prefill(std::span<const PrefillRun> runs, std::span<int32_t> sampled, std::span<float> logits) override {
    Engine::prefill(runs, sampled, logits);
    prefills.fetch_add(1, std::memory_order_relaxed);
  }
  std::atomic<uint64_t> prefills{0};
  // (No state to copy: these tests do not save or load slots.)
  size_t slot_state_bytes() const override { throw std::logic_error("QuietEngine keeps no state"); }
  void save_slot(int, std::span<std::byte>) override { throw std::logic_error("QuietEngine keeps no state"); }
  void load_slot(int, std::span<const std::byte>) override { throw std::logic_error("QuietEngine keeps no state"); }

 private:
  ModelConfig config_;
  std::vector<int32_t> last_;
  std::atomic<uint64_t> steps_{0};
};

// Takes what its outbox holds (on the flusher's thread) and counts it.
class CountingWriter final : public StreamWriter {
 public:
  void flush() override {
    for (;;) {
      const TokenOutbox::Item item = sequence->outbox().take(&scratch_);
      if (item.kind == TokenOutbox::Item::kNothing) return;
      if (item.kind == TokenOutbox::Item::kTokens) tokens += scratch_.size();
      if (item.kind == TokenOutbox::Item::kClosed) closed = true;
    }
  }
  std::shared_ptr<Sequence> sequence;
  std::atomic<size_t> tokens{0};
  std::atomic<bool> closed{false};

 private:
  std::vector<int32_t> scratch_;
};

TEST(SchedulerAllocation, TheEngineThreadAllocatesNothingPerToken) {
  QuietEngine engine(4);
  Scheduler scheduler(engine, {}, nullptr, nullptr);
  CountingWriter writers[2];
  for (int i = 0; i < 2; ++i) {
    writers[i].sequence = std::make_shared<Sequence>(SequenceParams{}, 1 << 16, &writers[i]);
    writers[i].sequence->add_input(std::vector<int32_t>{1 + i, 2, 3});
    writers[i].sequence->end_turn(1'000'000);
    writers[i].sequence->close_input();
    ASSERT_EQ(scheduler.submit(writers[i].sequence).status, StreamStatus::kOk);
  }
  const auto wait_for_tokens = [&](size_t n) {
    for (int i = 0; i < 3000 && (writers[0].tokens < n || writers[1].tokens < n); ++i) std::this_thread::sleep_for(10ms);
    return writers[0].tokens >= n && writers[1].tokens >= n;
  };
  ASSERT_TRUE(wait_for_tokens(100));  // both decoding, every buffer at its size
  testing::count_only_marked_threads(true);
  testing::start_counting_allocations();
  const uint64_t steps_before = engine.stats().steps;
  for (int i = 0; i < 3000 && engine.stats().steps < steps_before + 5000; ++i) std::this_thread::sleep_for(10ms);
  const long allocations = testing::stop_counting_allocations();
  const uint64_t steps = engine.stats().steps - steps_before;
  testing::count_only_marked_threads(false);
  EXPECT_GE(steps, 5000u);
  EXPECT_EQ(allocations, 0) << "over " << steps << " steps";

  for (auto& w : writers) w.sequence->request_cancel(StreamStatus::kCancelled, "done");
  scheduler.wake();
  for (int i = 0; i < 3000 && !(writers[0].closed && writers[1].closed); ++i) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(writers[0].closed && writers[1].closed);
}

// With chunked prefill: a session's input, arriving in pieces of 20 tokens, read in chunks
// of 8 beside a decoding stream. (No turn ends: ending one allocates on either path.)
TEST(SchedulerAllocation, TheEngineThreadAllocatesNothingPerPrefillChunk) {
  QuietEngine engine(2);
  SchedulerOptions options;
  options.prefill_chunk_tokens = 8;
  Scheduler scheduler(engine, options, nullptr, nullptr);
  CountingWriter decoding, session;
  SequenceParams params;
  decoding.sequence = std::make_shared<Sequence>(params, 1 << 16, &decoding);
  decoding.sequence->add_input(std::vector<int32_t>{1});
  decoding.sequence->end_turn(1'000'000);
  decoding.sequence->close_input();
  ASSERT_EQ(scheduler.submit(decoding.sequence).status, StreamStatus::kOk);
  SequenceParams session_params;
  session_params.session = true;
  session.sequence = std::make_shared<Sequence>(session_params, 1 << 16, &session);
  ASSERT_EQ(scheduler.submit(session.sequence).status, StreamStatus::kOk);
  for (int i = 0; i < 3000 && decoding.tokens < 10; ++i) std::this_thread::sleep_for(1ms);
  const std::vector<int32_t> piece(20, 7);
  const auto send_piece = [&] {
    const uint64_t before = engine.prefills.load();
    session.sequence->add_input(piece);
    scheduler.wake();
    for (int i = 0; i < 3000 && engine.prefills.load() < before + 3; ++i) std::this_thread::sleep_for(1ms);
    return engine.prefills.load() >= before + 3;
  };
  for (int p = 0; p < 5; ++p) ASSERT_TRUE(send_piece());  // every buffer at its size
  testing::count_only_marked_threads(true);
  testing::start_counting_allocations();
  const uint64_t prefills_before = engine.prefills.load();
  bool read = true;
  for (int p = 0; p < 40 && read; ++p) read = send_piece();
  const long allocations = testing::stop_counting_allocations();
  testing::count_only_marked_threads(false);
  EXPECT_TRUE(read);
  EXPECT_GE(engine.prefills.load() - prefills_before, 3u * 40);
  EXPECT_EQ(allocations, 0) << "over " << engine.prefills.load() - prefills_before << " prefill chunks";

  decoding.sequence->request_cancel(StreamStatus::kCancelled, "done");
  session.sequence->request_cancel(StreamStatus::kCancelled, "done");
  scheduler.wake();
  for (int i = 0; i < 3000 && !(decoding.closed && session.closed); ++i) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(decoding.closed && session.closed);
}

}  // namespace
}  // namespace m3
