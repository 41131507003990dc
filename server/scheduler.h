// Continuous batching over the engine's slots, on one engine thread.
//
// Every sequence holding a slot advances one token per engine step: a sequence being
// prefilled feeds its next prompt token (its sample is ignored), a replying sequence
// feeds kContinueToken and emits what was sampled. Sequences join (slot reset) and leave
// (finished, cancelled, past their deadline) between steps, so one step later their slot
// serves the next waiting request. When all slots are taken, requests wait in a bounded
// queue; past it, submit() refuses with RESOURCE_EXHAUSTED.
//
// A Converse session keeps its slot between turns (the recurrent state is the whole
// context) and takes no step while it waits for input, for up to the session idle
// timeout. The last token of each reply is fed at the start of the next turn, so a
// session equals one Generate of the concatenated turns and replies.
//
// Per step the engine thread reads the clock once, touches only preallocated arrays and
// each stream's ring buffer, and never logs or calls into gRPC.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model/engine.h"
#include "server/sequence.h"
#include "server/stream_flusher.h"

namespace spdlog {
class logger;
}

namespace m3 {

class ServerMetrics;

struct SchedulerOptions {
  int queue_capacity = 64;
  // A Converse session that waits this long for its next input (no turn pending or being
  // generated) ends with DEADLINE_EXCEEDED and frees its slot; zero: never.
  Clock::duration session_idle_timeout = Clock::duration::zero();
};

class Scheduler {
 public:
  // metrics may be null. The engine thread starts here.
  Scheduler(Engine& engine, SchedulerOptions options, ServerMetrics* metrics,
            std::shared_ptr<spdlog::logger> log);
  ~Scheduler();  // cancels what is left (UNAVAILABLE) and joins the engine thread

  struct Admission {
    StreamStatus status = StreamStatus::kOk;  // kOk: queued or running
    std::string message;
  };
  // Any thread. On refusal the sequence is not touched (the caller finishes its stream).
  Admission submit(std::shared_ptr<Sequence> sequence);
  // Any thread: a sequence got input, was cancelled or closed its input.
  void wake();

  // Shutdown: refuse new requests (UNAVAILABLE), let running ones go on.
  void stop_accepting();
  // Waits until no sequence is left or `deadline`; returns true when none is left.
  bool wait_until_idle(Clock::time_point deadline);
  // Ends every sequence now: replies end with FinishReason::kCancelled; Generate streams
  // then close OK, sessions and queued requests with UNAVAILABLE. Waits until done.
  void cancel_all();

  int in_flight() const;  // queued + holding a slot

 private:
  enum class Phase { kFree, kFeeding, kIdle, kReplying };
  struct Slot {
    std::shared_ptr<Sequence> seq;
    Phase phase = Phase::kFree;
    std::vector<int32_t> feed;  // this turn's input; feed[fed] is the next to feed
    size_t fed = 0;
    bool reply_requested = false;
    uint32_t reply_max_new = 0;
    bool has_sample = false;  // last_sample was sampled after the last fed token
    int32_t last_sample = 0;
    int32_t last_emitted = 0;  // carried into the next turn of a session
    uint32_t generated = 0;  // in this reply
    uint32_t turn = 0;
    uint32_t turn_prompt_tokens = 0;
    Clock::time_point turn_start;  // arrival (turn 0) or end_turn
    Clock::time_point idle_since;  // when the phase last became kIdle
    Clock::time_point first_token_time;
    Clock::time_point last_token_time;
  };

  void run();
  void admit_waiting(Clock::time_point now);
  void service_slot(int slot, Clock::time_point now);
  void pull_input(Slot& s);
  static void become_idle(Slot& s, Clock::time_point now);
  // When this slot's session runs out of idle time; max() when it is not an idle session.
  Clock::time_point idle_deadline(const Slot& s) const;
  void emit(int slot, int32_t token, Clock::time_point now);
  void end_reply(int slot, FinishReason reason, Clock::time_point now);
  void finish(int slot, StreamStatus status, std::string message);
  void close_unadmitted(const std::shared_ptr<Sequence>& seq, StreamStatus status,
                        std::string message);
  void wake_writer(const std::shared_ptr<Sequence>& seq);
  void shutdown_all_slots();

  Engine& engine_;
  const SchedulerOptions options_;
  ServerMetrics* metrics_;
  std::shared_ptr<spdlog::logger> log_;
  StreamFlusher flusher_;

  // Engine-thread state.
  std::vector<Slot> slots_;
  std::vector<int> free_slots_;
  std::vector<int32_t> step_slots_, step_tokens_, step_sampled_;
  std::vector<std::shared_ptr<Sequence>> wake_list_;  // writers to wake after this step
  std::vector<std::shared_ptr<Sequence>> admitted_, rejected_;
  uint64_t graph_replays_seen_ = 0;
  int active_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;       // the engine thread waits here when nothing runs
  std::condition_variable idle_cv_;  // wait_until_idle / cancel_all
  std::deque<std::shared_ptr<Sequence>> waiting_;
  int in_flight_ = 0;
  bool wake_ = false;
  bool accepting_ = true;
  bool cancel_all_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace m3
