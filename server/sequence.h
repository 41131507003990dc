// One request as the scheduler and its gRPC stream share it: the parameters fixed at
// the start, the input the client sends (a Generate prompt, or a Converse session's
// turns as they arrive), the outbox of generated tokens, and the flags the stream sets
// (cancelled, input closed) that the engine thread reads at the next token boundary.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "model/engine.h"
#include "server/token_outbox.h"

namespace m3 {

using Clock = std::chrono::steady_clock;

// The stream side of a sequence (a gRPC reactor). flush() sends what the outbox holds;
// it is called only by whoever TokenOutbox told to wake the writer.
class StreamWriter {
 public:
  virtual ~StreamWriter() = default;
  virtual void flush() = 0;
  // Cancels the stream's call (any thread; only through Sequence::cut_stalled_stream,
  // which knows the writer is still alive).
  virtual void cancel_call() {}
};

class Sequence;

// A sequence's state as the engine's slot bytes (Engine::save_slot), with what the
// scheduler needs beside them: the tokens it covers and the sample after its last token
// (-1: none), the first reply token when no more input comes.
struct SequenceState {
  std::vector<std::byte> bytes;
  uint64_t tokens = 0;
  int32_t last_sample = -1;
  std::string error;  // saving failed (the engine's message); bytes empty
  bool for_shutdown = false;  // saved because the server is shutting down (save_on_shutdown)
};

struct SequenceParams {
  std::string request_id;
  bool session = false;  // Converse: the slot stays with the client across turns
  // Converse: input arrives in pieces as the client speaks; a short piece rides the decode
  // steps (SchedulerOptions::prefill_min_tokens) instead of a prefill call of its own.
  bool streamed_input = false;
  SamplingParams sampling;
  std::vector<int32_t> stop_token_ids;
  int32_t end_of_reply_id = -1;  // emitting it ends the reply (FinishReason::kEndOfReply); -1: none
  Clock::time_point deadline = Clock::time_point::max();
  // Snapshots: the state the sequence starts from instead of a fresh one (loaded when it is
  // admitted), and where the state goes at each request_save() (called on the engine
  // thread: hand the bytes to another thread, do no I/O there).
  std::shared_ptr<const SequenceState> start_state;
  std::function<void(const std::shared_ptr<Sequence>&, SequenceState)> on_state_saved;
  // A session between turns at shutdown is saved (on_state_saved, for_shutdown) rather
  // than ended at once; the handler then ends it (a persistent store is configured).
  bool save_on_shutdown = false;
};

// What the scheduler reports about a finished sequence (for the request log line).
struct SequenceSummary {
  uint32_t prompt_tokens = 0;      // all turns
  uint32_t generated_tokens = 0;   // all turns
  uint32_t turns = 0;
  double time_to_first_token_ms = -1;  // first turn; -1: no token was made
  double queue_ms = 0;
  // How the last reply ended ("length", "stop", "cancelled": cut by a shutdown, an error or
  // the client); null when none ended. A stream cut by the drain ends "ok" with "cancelled".
  const char* last_finish = nullptr;
};

class Sequence {
 public:
  Sequence(SequenceParams params, size_t outbox_capacity, StreamWriter* writer);

  const SequenceParams& params() const { return params_; }
  TokenOutbox& outbox() { return outbox_; }
  StreamWriter* writer() const { return writer_; }
  Clock::time_point arrival() const { return arrival_; }

  // Stream side. Input of the current turn; end_turn closes the turn and asks for a
  // reply of max_new_tokens (already resolved against the session's value).
  void add_input(std::span<const int32_t> tokens);
  void end_turn(uint32_t max_new_tokens);
  // Input the engine thread has not taken yet (turns waiting for an earlier reply to end,
  // and the current turn's tokens sent since the last step), in tokens; a turn with no
  // input of its own counts one, the previous reply's last token it will feed.
  size_t pending_input_tokens();
  void close_input();  // the client will send nothing more
  // Saves the state once the input sent before this call is read (params().on_state_saved,
  // whose handler answers with deliver_saved() or ends the sequence with request_cancel());
  // input sent after it waits for that answer.
  void request_save();
  // A save's outcome for the stream, from the thread that stored it: the engine thread
  // passes it on at the next token boundary (Scheduler::wake() after this).
  void deliver_saved(std::string snapshot_id);
  std::string take_saved();  // engine thread; "" when none is waiting
  // The snapshot a shutdown saved the session as (for the stream's trailing metadata).
  void set_shutdown_snapshot(std::string snapshot_id);
  std::string shutdown_snapshot();
  // Ends the sequence at the next token boundary with this status.
  void request_cancel(StreamStatus status, std::string message);

  // Engine thread.
  struct InputSegment {
    std::vector<int32_t> tokens;
    bool end_turn = false;
    bool save = false;  // a request_save() marker (no tokens)
    uint32_t max_new_tokens = 0;
    Clock::time_point end_turn_time;
  };
  bool input_changed() { return input_changed_.exchange(false, std::memory_order_acq_rel); }
  void mark_input_changed() { input_changed_.store(true, std::memory_order_release); }
  // Moves input up to and including the next end_turn or save marker into *feed; returns
  // that segment's end_turn and save info (both false when neither has arrived yet).
  InputSegment take_input(std::vector<int32_t>* feed);
  bool input_closed_and_empty();
  bool input_waiting();  // input not taken yet, or the input closed
  bool cancel_requested() const { return cancel_requested_.load(std::memory_order_acquire); }
  StreamStatus cancel_status();
  std::string cancel_message();

  // Written by the engine thread before the outbox closes; read by the stream after.
  SequenceSummary summary;

  // A stream whose outbox is closed ends only when its last messages and its status reach
  // the client, which a client that reads nothing never lets happen (StalledStreams). The
  // writer counts its completed writes, and detaches when its call is done;
  // cut_stalled_stream() cancels the call of a writer still attached (false: detached).
  void note_write_done() { writes_done_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t writes_done() const { return writes_done_.load(std::memory_order_relaxed); }
  void detach_writer();
  bool writer_attached();
  bool cut_stalled_stream();
  bool was_cut();  // cut_stalled_stream() cancelled the call

 private:
  SequenceParams params_;
  TokenOutbox outbox_;
  StreamWriter* writer_;
  Clock::time_point arrival_;

  std::mutex input_mu_;
  std::deque<InputSegment> input_;
  size_t pending_tokens_ = 0;  // in input_, as pending_input_tokens() counts them
  bool input_closed_ = false;
  std::atomic<bool> input_changed_{false};
  std::atomic<bool> saved_waiting_{false};
  std::vector<std::string> saved_ids_;  // under input_mu_
  std::string shutdown_snapshot_;       // under input_mu_

  std::atomic<uint64_t> writes_done_{0};
  std::mutex writer_mu_;
  bool writer_attached_ = true;
  bool cut_ = false;

  std::atomic<bool> cancel_requested_{false};
  std::mutex cancel_mu_;
  StreamStatus cancel_status_ = StreamStatus::kCancelled;
  std::string cancel_message_;
};

}  // namespace m3
