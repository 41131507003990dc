// The scheduler's chunked prefill against a scripted engine that records every step and
// prefill call: prompts read in chunks within the budget, decoding interleaved with a long
// prompt, the oldest prompt first, a Converse turn's pieces read as they arrive; and on the
// CPU engine, the same streams as with one decode step per prompt token.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <mutex>
#include <thread>

#include "model/random_model.h"
#include "model/weights.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "collecting_writer.h"

namespace m3 {
namespace {

using namespace std::chrono_literals;

// Samples (input + 1) % vocab, one step or one prefill run alike; records every call.
class RecordingEngine final : public Engine {
 public:
  struct Call {
    bool prefill = false;
    int queued = 0;  // steps queued when it was called
    std::vector<std::pair<int32_t, std::vector<int32_t>>> slots;  // slot, its tokens
  };

  explicit RecordingEngine(int slots, bool prefill_path = true) : last_(slots, -1), prefill_path_(prefill_path) {
    config_.vocab_size = 1000;
  }
  bool has_prefill_path() const override { return prefill_path_; }
  std::string_view backend() const override { return "recording"; }
  const ModelConfig& config() const override { return config_; }
  int max_slots() const override { return static_cast<int>(last_.size()); }
  void reset(int slot) override { last_[slot] = -1; }
  void set_sampling(int, const SamplingParams&) override {}
  void step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
            std::span<int32_t> sampled, std::span<float>) override {
    std::this_thread::sleep_for(1ms);  // so that requests can arrive mid-stream
    Call call;
    call.queued = queued_steps();
    for (size_t i = 0; i < slots.size(); ++i) {
      const int32_t in = tokens[i] == kContinueToken ? last_[slots[i]] : tokens[i];
      if (in < 0) throw std::invalid_argument("continue without a previous sample");
      sampled[i] = (in + 1) % config_.vocab_size;
      last_[slots[i]] = sampled[i];
      call.slots.push_back({slots[i], {tokens[i]}});
    }
    record(std::move(call));
  }
  void prefill(std::span<const PrefillRun> runs, std::span<int32_t> sampled,
               std::span<float> logits) override {
    Call call;
    call.prefill = true;
    call.queued = queued_steps();
    validate_prefill(runs, sampled, logits);
    for (const PrefillRun& run : runs) {
      for (const int32_t t : run.tokens) {
        if (t == kFailToken) throw std::runtime_error("device lost");
      }
    }
    {
      std::unique_lock lock(mu_);
      held_entered_ |= held_;
      cv_.notify_all();
      cv_.wait(lock, [&] { return !held_; });
    }
    std::this_thread::sleep_for(1ms);
    for (size_t i = 0; i < runs.size(); ++i) {
      sampled[i] = (runs[i].tokens.back() + 1) % config_.vocab_size;
      last_[runs[i].slot] = sampled[i];
      call.slots.push_back({runs[i].slot, {runs[i].tokens.begin(), runs[i].tokens.end()}});
    }
    record(std::move(call));
  }
  static constexpr int32_t kFailToken = 666;  // prefill() of it fails
  int max_prefill_tokens() const override { return 1 << 20; }
  // prefill() waits while held.
  void hold_prefill() {
    std::lock_guard lock(mu_);
    held_ = true;
  }
  // Waits until a prefill() call waits in the hold.
  void wait_held() {
    std::unique_lock lock(mu_);
    EXPECT_TRUE(cv_.wait_for(lock, 10s, [&] { return held_entered_; }));
  }
  void release_prefill() {
    {
      std::lock_guard lock(mu_);
      held_ = false;
    }
    cv_.notify_all();
  }
  EngineStats stats() const override {
    std::lock_guard lock(mu_);
    return {calls_.size(), 0, 0};
  }
  // (No state to copy: these tests do not save or load slots.)
  size_t slot_state_bytes() const override { throw std::logic_error("RecordingEngine keeps no state"); }
  void save_slot(int, std::span<std::byte>) override { throw std::logic_error("RecordingEngine keeps no state"); }
  void load_slot(int, std::span<const std::byte>) override { throw std::logic_error("RecordingEngine keeps no state"); }
  std::vector<Call> calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }
  // Blocks until `pred(calls)` holds (10 s at most).
  template <typename Pred>
  bool wait_for(Pred pred) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, 10s, [&] { return pred(calls_); });
  }

 private:
  void record(Call call) {
    {
      std::lock_guard lock(mu_);
      calls_.push_back(std::move(call));
    }
    cv_.notify_all();
  }
  ModelConfig config_;
  std::vector<int32_t> last_;
  bool prefill_path_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Call> calls_;
  bool held_ = false, held_entered_ = false;
};

using m3::testing::CollectingWriter;

std::unique_ptr<CollectingWriter> start(Scheduler& scheduler, std::vector<int32_t> prompt, uint32_t max_new,
                                        SamplingParams sampling = {}) {
  auto writer = std::make_unique<CollectingWriter>();
  SequenceParams params;
  params.sampling = sampling;
  writer->seq = std::make_shared<Sequence>(params, 4096, writer.get());
  writer->seq->add_input(prompt);
  writer->seq->end_turn(max_new);
  writer->seq->close_input();
  EXPECT_EQ(scheduler.submit(writer->seq).status, StreamStatus::kOk);
  return writer;
}

std::vector<int32_t> iota(int32_t first, int count) {
  std::vector<int32_t> v(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) v[static_cast<size_t>(i)] = first + i;
  return v;
}

SchedulerOptions chunked(int tokens, bool pipelined = true) {
  SchedulerOptions o;
  o.prefill_chunk_tokens = tokens;
  o.pipelined = pipelined;
  return o;
}

TEST(SchedulerPrefillTest, APromptIsReadInChunksOfTheBudget) {
  for (const bool pipelined : {true, false}) {
    SCOPED_TRACE(pipelined ? "pipelined" : "one at a time");
    RecordingEngine engine(1);
    Scheduler scheduler(engine, chunked(4, pipelined), nullptr, nullptr);
    auto a = start(scheduler, iota(100, 10), 3);
    EXPECT_EQ(a->wait_closed(), StreamStatus::kOk);
    EXPECT_EQ(a->got(), (std::vector<int32_t>{110, 111, 112}));
    std::vector<std::vector<int32_t>> chunks;
    for (const auto& call : engine.calls()) {
      if (call.prefill) {
        ASSERT_EQ(call.slots.size(), 1u);
        chunks.push_back(call.slots[0].second);
        EXPECT_EQ(call.queued, 0) << "prefill() with a step queued";
      } else {
        for (const auto& [slot, tokens] : call.slots) EXPECT_EQ(tokens[0], kContinueToken);
      }
    }
    EXPECT_EQ(chunks, (std::vector<std::vector<int32_t>>{iota(100, 4), iota(104, 4), iota(108, 2)}));
  }
}

TEST(SchedulerPrefillTest, APromptReadWhileNoStreamRepliesTakesTheLargerPass) {
  RecordingEngine engine(2);
  SchedulerOptions options = chunked(4);
  options.prefill_alone_tokens = 8;
  Scheduler scheduler(engine, options, nullptr, nullptr);
  auto alone = start(scheduler, iota(100, 10), 2);
  EXPECT_EQ(alone->wait_closed(), StreamStatus::kOk);
  EXPECT_EQ(alone->got(), (std::vector<int32_t>{110, 111}));
  // Beside a replying stream, passes of prefill_chunk_tokens again.
  auto a = start(scheduler, {1}, 100000);
  while (a->count() < 5) std::this_thread::sleep_for(1ms);
  auto b = start(scheduler, iota(500, 10), 2);
  EXPECT_EQ(b->wait_closed(), StreamStatus::kOk);
  a->seq->request_cancel(StreamStatus::kCancelled, "cancelled by the test");
  scheduler.wake();
  EXPECT_EQ(a->wait_closed(), StreamStatus::kCancelled);
  EXPECT_EQ(b->got(), (std::vector<int32_t>{510, 511}));
  std::vector<std::vector<int32_t>> reads;
  for (const auto& call : engine.calls())
    if (call.prefill)
      for (const auto& [slot, tokens] : call.slots) reads.push_back(tokens);
  EXPECT_EQ(reads, (std::vector<std::vector<int32_t>>{iota(100, 8), iota(108, 2), {1}, iota(500, 4), iota(504, 4),
                                                       iota(508, 2)}));
}

TEST(SchedulerPrefillTest, ConverseInputShorterThanTheMinimumRidesTheDecodeSteps) {
  RecordingEngine engine(1);
  SchedulerOptions options = chunked(8);
  options.prefill_min_tokens = 5;
  Scheduler scheduler(engine, options, nullptr, nullptr);
  auto converse = [&](std::vector<int32_t> input, uint32_t max_new) {
    auto session = std::make_unique<CollectingWriter>();
    SequenceParams params;
    params.session = true;
    params.streamed_input = true;
    session->seq = std::make_shared<Sequence>(params, 4096, session.get());
    EXPECT_EQ(scheduler.submit(session->seq).status, StreamStatus::kOk);
    session->seq->add_input(input);
    session->seq->end_turn(max_new);
    session->seq->close_input();
    scheduler.wake();
    EXPECT_EQ(session->wait_closed(), StreamStatus::kOk);
    return session->got();
  };
  EXPECT_EQ(converse(iota(100, 3), 2), (std::vector<int32_t>{103, 104}));  // 3 tokens: by decode steps
  EXPECT_EQ(converse(iota(200, 12), 2), (std::vector<int32_t>{212, 213}));  // 8 by prefill, 4 by steps
  // A Generate prompt is read by prefill however short.
  auto g = start(scheduler, iota(300, 3), 1);
  EXPECT_EQ(g->wait_closed(), StreamStatus::kOk);
  EXPECT_EQ(g->got(), (std::vector<int32_t>{303}));
  std::vector<std::vector<int32_t>> prefilled;
  std::vector<int32_t> stepped;
  for (const auto& call : engine.calls()) {
    for (const auto& [slot, tokens] : call.slots) {
      if (call.prefill) {
        prefilled.push_back(tokens);
      } else if (tokens[0] != kContinueToken) {
        stepped.push_back(tokens[0]);
      }
    }
  }
  EXPECT_EQ(prefilled, (std::vector<std::vector<int32_t>>{iota(200, 8), iota(300, 3)}));
  // A session also reads each reply's last token after it (104, 213): one token, a step.
  EXPECT_EQ(stepped, (std::vector<int32_t>{100, 101, 102, 104, 208, 209, 210, 211, 213}));
}

TEST(SchedulerPrefillTest, ASessionGivenItsInputWholeReadsItByPrefillHoweverShort) {
  // As CreateSnapshot's sequence: a session (it stays for the save) whose input is not
  // streamed.
  RecordingEngine engine(1);
  SchedulerOptions options = chunked(8);
  options.prefill_min_tokens = 5;
  Scheduler scheduler(engine, options, nullptr, nullptr);
  auto session = std::make_unique<CollectingWriter>();
  SequenceParams params;
  params.session = true;
  session->seq = std::make_shared<Sequence>(params, 4096, session.get());
  ASSERT_EQ(scheduler.submit(session->seq).status, StreamStatus::kOk);
  session->seq->add_input(iota(100, 3));
  session->seq->end_turn(1);
  session->seq->close_input();
  scheduler.wake();
  EXPECT_EQ(session->wait_closed(), StreamStatus::kOk);
  EXPECT_EQ(session->got(), (std::vector<int32_t>{103}));
  const auto calls = engine.calls();
  ASSERT_FALSE(calls.empty());
  EXPECT_TRUE(calls.front().prefill);
  EXPECT_EQ(calls.front().slots.at(0).second, iota(100, 3));
  for (const auto& call : calls) {
    if (call.prefill) continue;
    for (const auto& [slot, tokens] : call.slots) EXPECT_EQ(tokens[0], kContinueToken);
  }
}

TEST(SchedulerPrefillTest, AnEngineWithoutAPrefillPathReadsPromptsByDecodeSteps) {
  // Its prefill() would step a whole chunk while the decoding streams wait: prompt tokens
  // ride in the decode steps instead.
  RecordingEngine engine(1, /*prefill_path=*/false);
  Scheduler scheduler(engine, chunked(4), nullptr, nullptr);
  auto a = start(scheduler, iota(100, 10), 3);
  EXPECT_EQ(a->wait_closed(), StreamStatus::kOk);
  EXPECT_EQ(a->got(), (std::vector<int32_t>{110, 111, 112}));
  std::vector<int32_t> fed;
  for (const auto& call : engine.calls()) {
    EXPECT_FALSE(call.prefill);
    for (const auto& [slot, tokens] : call.slots) {
      if (tokens[0] != kContinueToken) fed.push_back(tokens[0]);
    }
  }
  EXPECT_EQ(fed, iota(100, 10));
}

TEST(SchedulerPrefillTest, DecodingGoesOnWhileALongPromptIsRead) {
  RecordingEngine engine(2);
  ServerMetrics metrics("");
  Scheduler scheduler(engine, chunked(4), &metrics, nullptr);
  // A decodes until cancelled, so it decodes throughout B's prompt.
  auto a = start(scheduler, {1}, 100000);
  while (a->count() < 5) std::this_thread::sleep_for(1ms);
  auto b = start(scheduler, iota(500, 40), 2);
  EXPECT_EQ(b->wait_closed(), StreamStatus::kOk);
  a->seq->request_cancel(StreamStatus::kCancelled, "cancelled by the test");
  scheduler.wake();
  EXPECT_EQ(a->wait_closed(), StreamStatus::kCancelled);
  EXPECT_EQ(b->got(), (std::vector<int32_t>{540, 541}));
  const std::vector<int32_t> got_a = a->got();
  for (size_t i = 0; i < got_a.size(); ++i) ASSERT_EQ(got_a[i], static_cast<int32_t>(2 + i)) << i;

  // B's 40 tokens in 10 chunks of 4, and A stepped between every two of them.
  const auto calls = engine.calls();
  int chunks = 0, a_steps_since_chunk = 0;
  for (const auto& call : calls) {
    if (call.prefill) {
      if (call.slots[0].first != 1 && call.slots[0].second.size() == 1) continue;  // A's own prompt
      ASSERT_EQ(call.slots.size(), 1u);
      EXPECT_EQ(call.slots[0].second.size(), 4u);
      if (chunks > 0) EXPECT_GE(a_steps_since_chunk, 1) << "no decode step before chunk " << chunks;
      ++chunks;
      a_steps_since_chunk = 0;
    } else {
      for (const auto& [slot, tokens] : call.slots) a_steps_since_chunk += tokens[0] == kContinueToken;
    }
  }
  EXPECT_EQ(chunks, 10);
  const std::string text = metrics.serialize();
  EXPECT_NE(text.find("m3serve_prefill_tokens_total 41"), std::string::npos) << text;  // A's 1 + B's 40
  EXPECT_NE(text.find("m3serve_prefill_seconds_count 11"), std::string::npos) << text;
}

TEST(SchedulerPrefillTest, TheBudgetIsSharedOldestPromptFirst) {
  RecordingEngine engine(4);
  Scheduler scheduler(engine, chunked(6), nullptr, nullptr);
  // W's prompt is being read while x, y and z arrive, in that order: they are admitted
  // together, and each call reads at most 6 tokens, the oldest prompt's first.
  engine.hold_prefill();
  auto w = start(scheduler, {1}, 100000);
  engine.wait_held();
  auto x = start(scheduler, iota(10, 5), 1);
  auto y = start(scheduler, iota(20, 5), 1);
  auto z = start(scheduler, iota(30, 5), 1);
  engine.release_prefill();
  for (auto* c : {x.get(), y.get(), z.get()}) EXPECT_EQ(c->wait_closed(), StreamStatus::kOk);
  w->seq->request_cancel(StreamStatus::kCancelled, "cancelled by the test");
  scheduler.wake();
  EXPECT_EQ(w->wait_closed(), StreamStatus::kCancelled);
  EXPECT_EQ(x->got(), (std::vector<int32_t>{15}));
  EXPECT_EQ(y->got(), (std::vector<int32_t>{25}));
  EXPECT_EQ(z->got(), (std::vector<int32_t>{35}));
  std::vector<std::vector<std::vector<int32_t>>> reads;  // per call, each run's tokens
  for (const auto& call : engine.calls()) {
    if (!call.prefill) continue;
    reads.emplace_back();
    for (const auto& [slot, tokens] : call.slots) reads.back().push_back(tokens);
    std::sort(reads.back().begin(), reads.back().end());  // slot order is not arrival order
  }
  const std::vector<std::vector<std::vector<int32_t>>> want = {
      {{1}}, {iota(10, 5), {20}}, {iota(21, 4), iota(30, 2)}, {iota(32, 3)}};
  EXPECT_EQ(reads, want);
}

TEST(SchedulerPrefillTest, AFailedPrefillEndsItsSequenceAndTheServerGoesOn) {
  RecordingEngine engine(2);
  Scheduler scheduler(engine, chunked(8), nullptr, nullptr);
  auto failing = start(scheduler, {1, RecordingEngine::kFailToken, 2}, 3);
  EXPECT_EQ(failing->wait_closed(), StreamStatus::kInternal);
  EXPECT_EQ(failing->message(), "engine error: device lost");
  auto next = start(scheduler, {7, 8}, 2);
  EXPECT_EQ(next->wait_closed(), StreamStatus::kOk);
  EXPECT_EQ(next->got(), (std::vector<int32_t>{9, 10}));
}

TEST(SchedulerPrefillTest, AConverseTurnIsReadInThePiecesItArrivesIn) {
  RecordingEngine engine(1);
  Scheduler scheduler(engine, chunked(64), nullptr, nullptr);
  auto session = std::make_unique<CollectingWriter>();
  SequenceParams params;
  params.session = true;
  session->seq = std::make_shared<Sequence>(params, 4096, session.get());
  ASSERT_EQ(scheduler.submit(session->seq).status, StreamStatus::kOk);
  const auto prefilled = [&](size_t n) {
    return engine.wait_for([&](const std::vector<RecordingEngine::Call>& calls) {
      return static_cast<size_t>(std::count_if(calls.begin(), calls.end(),
                                               [](const auto& c) { return c.prefill; })) >= n;
    });
  };
  session->seq->add_input(std::vector<int32_t>{5, 6});
  scheduler.wake();
  ASSERT_TRUE(prefilled(1));
  session->seq->add_input(std::vector<int32_t>{7});
  scheduler.wake();
  ASSERT_TRUE(prefilled(2));
  // The turn ends with nothing left to read: the reply starts from the last piece's sample.
  session->seq->end_turn(3);
  scheduler.wake();
  while (session->count() < 3) std::this_thread::sleep_for(1ms);
  session->seq->add_input(std::vector<int32_t>{40, 41});
  session->seq->end_turn(1);
  session->seq->close_input();
  scheduler.wake();
  EXPECT_EQ(session->wait_closed(), StreamStatus::kOk);
  EXPECT_EQ(session->got(), (std::vector<int32_t>{8, 9, 10, 42}));
  std::vector<std::vector<int32_t>> pieces;
  for (const auto& call : engine.calls()) {
    if (call.prefill) pieces.push_back(call.slots[0].second);
  }
  ASSERT_GE(pieces.size(), 3u);
  EXPECT_EQ(pieces[0], (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(pieces[1], (std::vector<int32_t>{7}));
  // The second turn starts with the first reply's last token (10), read alone at once or
  // with the input if that came first; the last reply's last token (42) is read too.
  std::vector<int32_t> rest;
  for (size_t i = 2; i < pieces.size(); ++i) rest.insert(rest.end(), pieces[i].begin(), pieces[i].end());
  EXPECT_EQ(rest, (std::vector<int32_t>{10, 40, 41, 42}));
}

// The CPU engine end to end: Generate requests side by side, sampled and greedy, and a
// session of several turns stream the same tokens with prompts read in chunks as with one
// decode step per prompt token.
std::vector<std::vector<int32_t>> serve_on_cpu(int chunk_tokens) {
  static const std::filesystem::path dir = [] {
    ModelConfig c;
    c.d_model = 64;
    c.n_layer = 2;
    c.vocab_size = 203;
    c.d_intermediate = 96;
    c.ssm.is_mimo = true;
    c.ssm.mimo_rank = 2;
    c.ssm.d_state = 16;
    c.ssm.headdim = 16;
    c.ssm.is_outproj_norm = true;
    const auto d = std::filesystem::temp_directory_path() /
                   ("m3-scheduler-prefill-" + std::to_string(::getpid()));
    write_random_model(c, 3, DType::F32, d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(std::filesystem::temp_directory_path() /
                                      ("m3-scheduler-prefill-" + std::to_string(::getpid())),
                                  ec);
    });
    return d;
  }();
  const ModelWeights weights = ModelWeights::load(dir);
  EngineOptions eo;
  eo.max_slots = 3;
  eo.cpu_threads = 1;
  if (chunk_tokens > 0) eo.max_prefill_tokens = chunk_tokens;
  auto engine = make_engine("cpu", weights, eo);
  std::vector<std::vector<int32_t>> out;
  {
    Scheduler scheduler(*engine, chunked(chunk_tokens), nullptr, nullptr);
    SamplingParams sampled;
    sampled.temperature = 0.9f;
    sampled.seed = 77;
    std::vector<std::unique_ptr<CollectingWriter>> writers;
    writers.push_back(start(scheduler, iota(3, 37), 12, sampled));
    writers.push_back(start(scheduler, iota(50, 9), 12));
    auto session = std::make_unique<CollectingWriter>();
    SequenceParams params;
    params.session = true;
    params.sampling = sampled;
    session->seq = std::make_shared<Sequence>(params, 4096, session.get());
    EXPECT_EQ(scheduler.submit(session->seq).status, StreamStatus::kOk);
    session->seq->add_input(iota(100, 20));
    session->seq->add_input(iota(120, 3));
    session->seq->end_turn(5);
    scheduler.wake();
    while (session->count() < 5) std::this_thread::sleep_for(1ms);
    session->seq->add_input(iota(150, 11));
    session->seq->end_turn(6);
    session->seq->close_input();
    scheduler.wake();
    writers.push_back(std::move(session));
    for (auto& w : writers) {
      EXPECT_EQ(w->wait_closed(), StreamStatus::kOk);
      out.push_back(w->got());
    }
  }
  return out;
}

TEST(SchedulerPrefillTest, TheCpuEngineStreamsWhatDecodeStepsStream) {
  const auto stepped = serve_on_cpu(0);
  ASSERT_EQ(stepped.size(), 3u);
  EXPECT_EQ(stepped[0].size(), 12u);
  EXPECT_EQ(stepped[2].size(), 11u);
  for (const int chunk : {1, 5, 64}) {
    SCOPED_TRACE("prefill_chunk_tokens " + std::to_string(chunk));
    EXPECT_EQ(serve_on_cpu(chunk), stepped);
  }
}

}  // namespace
}  // namespace m3
