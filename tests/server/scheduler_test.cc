// The scheduler against a scripted engine that records every step: batching, prefill
// beside decoding, leaving within one step, the bounded queue, the session idle timeout,
// pipelined steps against steps one at a time, failed steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "server/scheduler.h"
#include "collecting_writer.h"

namespace m3 {
namespace {

using namespace std::chrono_literals;

// Samples (input + 1) % vocab; kContinueToken feeds the slot's previous sample.
class ScriptedEngine final : public Engine {
 public:
  explicit ScriptedEngine(int slots) : last_(slots, -1) { config_.vocab_size = 1000; }
  std::string_view backend() const override { return "scripted"; }
  const ModelConfig& config() const override { return config_; }
  int max_slots() const override { return static_cast<int>(last_.size()); }
  void reset(int slot) override { last_[slot] = -1; }
  void set_sampling(int, const SamplingParams&) override {}
  void step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
            std::span<int32_t> sampled, std::span<float>) override {
    std::this_thread::sleep_for(1ms);  // so that requests can arrive mid-stream
    bool failing = false;
    for (const int32_t t : tokens) failing |= t == kFailToken;
    if (failing && for_good_) {
      std::lock_guard lock(mu_);
      failed_ = true;
    }
    if (failing && !fail_at_collect_) throw std::runtime_error("device lost");
    std::vector<std::pair<int32_t, int32_t>> record;
    for (size_t i = 0; i < slots.size(); ++i) {
      const int32_t in = tokens[i] == kContinueToken ? last_[slots[i]] : tokens[i];
      if (in < 0) throw std::invalid_argument("continue without a previous sample");
      sampled[i] = (in + 1) % config_.vocab_size;
      last_[slots[i]] = sampled[i];
      record.emplace_back(slots[i], tokens[i]);
    }
    std::lock_guard lock(mu_);
    steps_.push_back(std::move(record));
    fails_when_collected_.push_back(failing);
  }
  void submit_step(std::span<const int32_t> slots, std::span<const int32_t> tokens) override {
    {
      std::lock_guard lock(mu_);
      queued_at_submit_.push_back(queued_steps());
    }
    Engine::submit_step(slots, tokens);
  }
  // A step that feeds kFailToken fails: in step() (so in submit_step), or, with
  // fail_at_collect, when it is collected.
  static constexpr int32_t kFailToken = 666;
  void fail_at_collect() { fail_at_collect_ = true; }
  // After a failing step the engine can run no more (as the CUDA engine after a CUDA error).
  void fail_for_good() { for_good_ = true; }
  std::string failure() const override {
    std::lock_guard lock(mu_);
    return failed_ ? "device lost for good" : "";
  }
  void collect_step(std::span<int32_t> sampled) override {
    Engine::collect_step(sampled);
    std::lock_guard lock(mu_);
    const bool failing = fails_when_collected_.front();  // the oldest queued step's
    fails_when_collected_.pop_front();
    if (failing) throw std::runtime_error("device lost");
  }
  EngineStats stats() const override {
    std::lock_guard lock(mu_);
    return {steps_.size(), 0, 0};
  }
  // (No state to copy: these tests do not save or load slots.)
  size_t slot_state_bytes() const override { throw std::logic_error("ScriptedEngine keeps no state"); }
  void save_slot(int, std::span<std::byte>) override { throw std::logic_error("ScriptedEngine keeps no state"); }
  void load_slot(int, std::span<const std::byte>) override { throw std::logic_error("ScriptedEngine keeps no state"); }
  // Steps already queued (submitted, not collected) at each submit_step.
  std::vector<int> queued_at_submit() const {
    std::lock_guard lock(mu_);
    return queued_at_submit_;
  }
  std::vector<std::vector<std::pair<int32_t, int32_t>>> steps() const {
    std::lock_guard lock(mu_);
    return steps_;
  }

 private:
  ModelConfig config_;
  std::vector<int32_t> last_;
  mutable std::mutex mu_;
  std::vector<std::vector<std::pair<int32_t, int32_t>>> steps_;
  std::vector<int> queued_at_submit_;
  bool fail_at_collect_ = false;
  bool for_good_ = false, failed_ = false;
  std::deque<bool> fails_when_collected_;  // per queued step
};

using m3::testing::CollectingWriter;

std::unique_ptr<CollectingWriter> start(Scheduler& scheduler, std::vector<int32_t> prompt,
                                        uint32_t max_new, Scheduler::Admission* admission = nullptr,
                                        std::vector<int32_t> stop_ids = {}) {
  auto writer = std::make_unique<CollectingWriter>();
  SequenceParams params;
  params.stop_token_ids = std::move(stop_ids);
  writer->seq = std::make_shared<Sequence>(params, 4096, writer.get());
  writer->seq->add_input(prompt);
  writer->seq->end_turn(max_new);
  writer->seq->close_input();
  Scheduler::Admission a = scheduler.submit(writer->seq);
  if (admission) *admission = a;
  return writer;
}

TEST(SchedulerTest, PrefillRunsBesideDecodingInOneStep) {
  ScriptedEngine engine(2);
  Scheduler scheduler(engine, {}, nullptr, nullptr);
  // A decodes until cancelled, so it is still decoding when B arrives however late the
  // test thread runs.
  auto a = start(scheduler, {1}, 100000);
  while (a->count() < 5) std::this_thread::sleep_for(1ms);
  auto b = start(scheduler, {500, 501, 502}, 3);
  EXPECT_EQ(b->wait_closed(), StreamStatus::kOk);
  a->seq->request_cancel(StreamStatus::kCancelled, "cancelled by the test");
  scheduler.wake();
  EXPECT_EQ(a->wait_closed(), StreamStatus::kCancelled);
  EXPECT_EQ(b->got(), (std::vector<int32_t>{503, 504, 505}));
  const std::vector<int32_t> got_a = a->got();
  ASSERT_GE(got_a.size(), 5u);
  for (size_t i = 0; i < got_a.size(); ++i) ASSERT_EQ(got_a[i], static_cast<int32_t>(2 + i)) << i;

  // B's prompt tokens went in the same steps as A's decoding.
  int shared = 0;
  for (const auto& step : engine.steps()) {
    if (step.size() != 2) continue;
    bool a_decodes = false, b_prefills = false;
    for (auto [slot, token] : step) {
      a_decodes |= token == kContinueToken;
      b_prefills |= token == 501 || token == 502;
    }
    shared += a_decodes && b_prefills;
  }
  EXPECT_EQ(shared, 2);
}

TEST(SchedulerTest, ACancelledSequenceLeavesWithinOneStep) {
  ScriptedEngine engine(1);
  Scheduler scheduler(engine, {}, nullptr, nullptr);
  auto a = start(scheduler, {1}, 100000);
  while (a->count() < 10) std::this_thread::sleep_for(1ms);
  a->seq->request_cancel(StreamStatus::kCancelled, "cancelled by the client");
  // Counted after the cancel (counted before it, a test thread preempted between the two
  // would count steps that preceded the cancel against it).
  const size_t steps_after_cancel = engine.stats().steps;
  scheduler.wake();
  EXPECT_EQ(a->wait_closed(), StreamStatus::kCancelled);
  // The step in progress when it was cancelled may finish; no other step includes it.
  EXPECT_LE(engine.stats().steps, steps_after_cancel + 1);
  auto b = start(scheduler, {7}, 2);
  EXPECT_EQ(b->wait_closed(), StreamStatus::kOk);
  EXPECT_EQ(b->got(), (std::vector<int32_t>{8, 9}));
}

// A Converse-style session on a one-slot engine.
// Its first turn (5, 6 -> 7, 8, 9) is answered before this returns.
std::unique_ptr<CollectingWriter> start_session(Scheduler& scheduler) {
  auto writer = std::make_unique<CollectingWriter>();
  SequenceParams params;
  params.session = true;
  writer->seq = std::make_shared<Sequence>(params, 4096, writer.get());
  EXPECT_EQ(scheduler.submit(writer->seq).status, StreamStatus::kOk);
  writer->seq->add_input(std::vector<int32_t>{5, 6});
  writer->seq->end_turn(3);
  scheduler.wake();
  while (writer->count() < 3) std::this_thread::sleep_for(1ms);
  return writer;
}

TEST(SchedulerTest, AnIdleSessionEndsAfterTheIdleTimeoutAndFreesItsSlot) {
  ScriptedEngine engine(1);
  SchedulerOptions options;
  options.session_idle_timeout = 300ms;
  Scheduler scheduler(engine, options, nullptr, nullptr);
  auto session = start_session(scheduler);
  const Clock::time_point reply_done = Clock::now();
  // Waits for the slot the silent session holds.
  auto waiting = start(scheduler, {1}, 2);
  EXPECT_EQ(session->wait_closed(), StreamStatus::kDeadlineExceeded);
  // Not at once: the idle clock started when the reply ended (shortly before reply_done).
  EXPECT_GE(Clock::now() - reply_done, 150ms);
  EXPECT_EQ(session->got(), (std::vector<int32_t>{7, 8, 9}));
  EXPECT_EQ(session->message(),
            "session idle: no input within 0.3 s (the server's session_idle_timeout_s) after 1 "
            "finished turns; the session ended and its slot was freed");
  EXPECT_EQ(waiting->wait_closed(), StreamStatus::kOk);
  EXPECT_EQ(waiting->got(), (std::vector<int32_t>{2, 3}));
}

TEST(SchedulerTest, ASessionThatGetsItsNextTurnInTimeGoesOn) {
  ScriptedEngine engine(1);
  SchedulerOptions options;
  options.session_idle_timeout = 2s;
  Scheduler scheduler(engine, options, nullptr, nullptr);
  auto session = start_session(scheduler);
  // Each turn restarts the idle clock: three pauses of 750 ms outlast one timeout (each
  // leaves 1.25 s for a slow test thread).
  for (int32_t turn = 1; turn <= 3; ++turn) {
    std::this_thread::sleep_for(750ms);
    session->seq->add_input(std::vector<int32_t>{10 * turn});
    session->seq->end_turn(1);
    scheduler.wake();
    while (session->count() < 3 + static_cast<size_t>(turn)) std::this_thread::sleep_for(1ms);
  }
  session->seq->close_input();
  scheduler.wake();
  EXPECT_EQ(session->wait_closed(), StreamStatus::kOk);
  EXPECT_EQ(session->got(), (std::vector<int32_t>{7, 8, 9, 11, 21, 31}));
}

TEST(SchedulerTest, TheQueueIsBounded) {
  ScriptedEngine engine(1);
  SchedulerOptions options;
  options.queue_capacity = 1;
  Scheduler scheduler(engine, options, nullptr, nullptr);
  Scheduler::Admission admission;
  auto running = start(scheduler, {1}, 100000, &admission);
  EXPECT_EQ(admission.status, StreamStatus::kOk);
  auto queued = start(scheduler, {2}, 3, &admission);
  EXPECT_EQ(admission.status, StreamStatus::kOk);
  auto refused = start(scheduler, {3}, 3, &admission);
  EXPECT_EQ(admission.status, StreamStatus::kResourceExhausted);
  EXPECT_EQ(admission.message,
            "server at capacity: all 1 slots are busy and 1 requests are already waiting "
            "(queue_capacity); retry later");
  running->seq->request_cancel(StreamStatus::kCancelled, "test");
  scheduler.wake();
  EXPECT_EQ(queued->wait_closed(), StreamStatus::kOk);
  EXPECT_EQ(queued->got(), (std::vector<int32_t>{3, 4, 5}));
  scheduler.stop_accepting();
  start(scheduler, {3}, 3, &admission);
  EXPECT_EQ(admission.status, StreamStatus::kUnavailable);
  EXPECT_EQ(admission.message, "the server is shutting down");
}

// Pipelined steps (the default) hand every stream what steps one at a time do, also where
// a reply ends with a stop token while the next step, already submitted, continued it: a
// Generate then drops that sample; a session takes that step as its next turn's first
// input (the reply's last token), so its later turns match too.
TEST(SchedulerTest, PipelinedStepsStreamWhatStepsOneAtATimeDo) {
  for (const bool pipelined : {true, false}) {
    SCOPED_TRACE(pipelined ? "pipelined" : "one at a time");
    ScriptedEngine engine(3);
    SchedulerOptions options;
    options.pipelined = pipelined;
    Scheduler scheduler(engine, options, nullptr, nullptr);
    auto stops = start(scheduler, {1}, 50, nullptr, {20});
    auto plain = start(scheduler, {100, 101}, 5);

    auto session = std::make_unique<CollectingWriter>();
    SequenceParams params;
    params.session = true;
    params.stop_token_ids = {9};
    session->seq = std::make_shared<Sequence>(params, 4096, session.get());
    ASSERT_EQ(scheduler.submit(session->seq).status, StreamStatus::kOk);
    session->seq->add_input(std::vector<int32_t>{5, 6});
    session->seq->end_turn(10);  // ends at the stop token: 7, 8, 9
    scheduler.wake();
    while (session->count() < 3) std::this_thread::sleep_for(1ms);
    session->seq->end_turn(3);  // no new input: the reply goes on from the carried 9
    scheduler.wake();
    while (session->count() < 6) std::this_thread::sleep_for(1ms);
    session->seq->add_input(std::vector<int32_t>{50});
    session->seq->end_turn(2);
    session->seq->close_input();
    scheduler.wake();

    EXPECT_EQ(stops->wait_closed(), StreamStatus::kOk);
    std::vector<int32_t> counted;
    for (int32_t t = 2; t <= 20; ++t) counted.push_back(t);
    EXPECT_EQ(stops->got(), counted);
    EXPECT_EQ(plain->wait_closed(), StreamStatus::kOk);
    EXPECT_EQ(plain->got(), (std::vector<int32_t>{102, 103, 104, 105, 106}));
    EXPECT_EQ(session->wait_closed(), StreamStatus::kOk);
    EXPECT_EQ(session->got(), (std::vector<int32_t>{7, 8, 9, 10, 11, 12, 51, 52}));

    // Each step after the first was submitted while the one before it was still queued
    // (pipelined), or after it was collected.
    const std::vector<int> queued = engine.queued_at_submit();
    ASSERT_GE(queued.size(), 19u);  // the longest stream alone takes 19
    const auto overlapped = std::count(queued.begin(), queued.end(), 1);
    if (pipelined) {
      EXPECT_GE(overlapped, 15) << "of " << queued.size() << " steps";
    } else {
      EXPECT_EQ(overlapped, 0);
    }
  }
}

// A step the engine fails (when submitted or when collected) ends the sequences in it with
// INTERNAL; the sequence beside it in later steps and later requests are served.
TEST(SchedulerTest, AFailedStepEndsItsSequencesAndTheServerGoesOn) {
  for (const bool at_collect : {false, true}) {
    SCOPED_TRACE(at_collect ? "fails when collected" : "fails when submitted");
    ScriptedEngine engine(2);
    if (at_collect) engine.fail_at_collect();
    Scheduler scheduler(engine, {}, nullptr, nullptr);
    auto steady = start(scheduler, {1}, 100000);  // still decoding when the doomed one arrives
    while (steady->count() < 5) std::this_thread::sleep_for(1ms);
    auto doomed = start(scheduler, {ScriptedEngine::kFailToken, 3}, 5);
    EXPECT_EQ(doomed->wait_closed(), StreamStatus::kInternal);
    EXPECT_EQ(doomed->message(), "engine error: device lost");
    EXPECT_TRUE(doomed->got().empty());
    // The sequence decoding beside it was in the failed step too; it ends the same way,
    // having streamed only what its earlier steps made, in order.
    EXPECT_EQ(steady->wait_closed(), StreamStatus::kInternal);
    const std::vector<int32_t> got = steady->got();
    for (size_t k = 0; k < got.size(); ++k) EXPECT_EQ(got[k], static_cast<int32_t>(2 + k));
    auto after = start(scheduler, {7}, 3);
    EXPECT_EQ(after->wait_closed(), StreamStatus::kOk);
    EXPECT_EQ(after->got(), (std::vector<int32_t>{8, 9, 10}));
  }
}

// An engine that can run no more after a failed step (Engine::failure()): the server is
// told once, what holds a slot ends with UNAVAILABLE at once, and requests are refused so.
TEST(SchedulerTest, AnEngineThatCanRunNoMoreIsReportedAndRequestsAreRefused) {
  ScriptedEngine engine(2);
  engine.fail_for_good();
  std::mutex mu;
  std::vector<std::string> reported;
  SchedulerOptions options;
  options.on_engine_unusable = [&](const std::string& why) {
    std::lock_guard lock(mu);
    reported.push_back(why);
  };
  Scheduler scheduler(engine, options, nullptr, nullptr);
  auto doomed = start(scheduler, {ScriptedEngine::kFailToken, 3}, 5);
  EXPECT_EQ(doomed->wait_closed(), StreamStatus::kInternal);
  EXPECT_EQ(doomed->message(), "engine error: device lost");
  Scheduler::Admission admission;
  auto after = start(scheduler, {7}, 3, &admission);
  EXPECT_EQ(admission.status, StreamStatus::kUnavailable);
  EXPECT_EQ(admission.message,
            "the engine can run no more steps after a device error (device lost for good); the server "
            "must be restarted");
  std::lock_guard lock(mu);
  EXPECT_EQ(reported, (std::vector<std::string>{"device lost for good"}));
}

}  // namespace
}  // namespace m3
