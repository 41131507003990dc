// What the engine thread has made for one stream and the stream's writer has not sent
// yet: generated tokens (a fixed-size ring, so pushing never allocates), the turn ends
// between them, and finally the stream's status.
//
// Slow readers: tokens made while a write is in flight are coalesced into the next
// Tokens message. When `capacity` tokens are unread, push() reports an overflow and
// the scheduler ends the stream with RESOURCE_EXHAUSTED; the model never waits for a
// reader, so one slow client cannot stall the batch.
//
// One writer at a time: push()/end_turn()/close() return true when the writer is idle
// and must be woken (the caller hands the stream to the StreamFlusher); the writer then
// calls take() until it returns kNothing, which marks it idle again.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace m3 {

enum class FinishReason { kLength, kStop, kCancelled, kEndOfReply };
const char* finish_reason_name(FinishReason reason);  // "length", "stop", "cancelled", "end_of_reply"

// Final status of a stream (the gRPC code it maps to).
enum class StreamStatus {
  kOk,
  kCancelled,
  kInvalidArgument,
  kResourceExhausted,
  kDeadlineExceeded,
  kInternal,
  kUnavailable,
  // Snapshots: an unknown id, another model's, a damaged one, an engine that
  // cannot copy its state.
  kNotFound,
  kFailedPrecondition,
  kDataLoss,
  kUnimplemented,
  kUnauthenticated,  // no valid API key (refused before anything else)
};
const char* stream_status_name(StreamStatus);  // "ok", "invalid_argument", ... (metric labels)
// The UNAVAILABLE message of every request a shutdown refuses or ends.
inline constexpr const char kShuttingDownMessage[] = "the server is shutting down";

struct TurnStats {
  uint32_t prompt_tokens = 0;
  uint32_t generated_tokens = 0;
  double queue_ms = 0;
  double time_to_first_token_ms = 0;
  double duration_ms = 0;
  double tokens_per_second = 0;
};

struct TurnEnd {
  uint32_t turn = 0;
  FinishReason reason = FinishReason::kLength;
  TurnStats stats;
};

class TokenOutbox {
 public:
  explicit TokenOutbox(size_t capacity);

  enum class Push { kQueued, kWakeWriter, kOverflow };
  // Engine thread. No allocation.
  Push push(int32_t token);
  bool end_turn(const TurnEnd& end);
  // A Converse session's SaveSnapshot answered, in order with the tokens (engine thread).
  bool snapshot_saved(std::string snapshot_id);
  // After close() nothing more is accepted. With kOk everything queued is delivered
  // first; with an error status unsent tokens and turn ends are dropped (the stream ends
  // now: a slow reader, a failed step), unless kDeliver asks for them to go first (a
  // shutdown ending a session mid-reply: its reply so far, then its TurnFinished).
  enum class Unsent { kDrop, kDeliver };
  bool close(StreamStatus status, std::string message, Unsent unsent = Unsent::kDrop);

  struct Item {
    enum Kind { kNothing, kTokens, kTurnEnd, kSnapshotSaved, kClosed } kind = kNothing;
    TurnEnd turn_end;
    std::string snapshot_id;  // kSnapshotSaved
    StreamStatus status = StreamStatus::kOk;
    std::string message;
  };
  // Writer side. kTokens appends the tokens to *tokens (cleared first).
  Item take(std::vector<int32_t>* tokens);

  bool closed() const;
  size_t capacity() const { return ring_.size(); }

 private:
  mutable std::mutex mu_;
  std::vector<int32_t> ring_;
  uint64_t pushed_ = 0;  // tokens ever pushed
  uint64_t taken_ = 0;   // tokens ever taken
  struct PendingEnd {
    uint64_t at;  // pushed_ when the turn ended
    TurnEnd end;
    std::string snapshot_id;  // not empty: a snapshot_saved(), not a turn end
  };
  std::deque<PendingEnd> turn_ends_;
  bool closed_ = false;
  bool close_delivered_ = false;
  StreamStatus status_ = StreamStatus::kOk;
  std::string message_;
  bool writer_busy_ = false;
};

}  // namespace m3
