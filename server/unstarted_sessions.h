// Converse streams that are open but have not started a session (nothing sent yet, so no
// Sequence): the scheduler does not know them, so a shutdown's wait and cancel_all would
// pass them by and gRPC would hold the shutdown for its whole deadline, then end them
// with CANCELLED. The service ends them itself when shutdown starts, with the status
// every session gets then (UNAVAILABLE). They are bounded in number, and one that sends
// nothing for the session idle timeout is ended as an idle session is (end_idle).
//
// Exactly one side finishes such a stream: a stream is in the set from its start until
// it leaves, either on its own (take() returns true: it starts its session, or ends
// before one) or because end_all() or end_idle() took it (take() then returns false, and
// they finish it). So they only touch streams that cannot have finished, and so are
// still alive.
#pragma once

#include <chrono>
#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "server/token_outbox.h"

namespace m3 {

class UnstartedSessions {
 public:
  class Stream {
   public:
    // Finishes the stream with this status (called once, by end_all()).
    virtual void end_unstarted(StreamStatus status, const std::string& message) = 0;

   protected:
    ~Stream() = default;
  };

  using Clock = std::chrono::steady_clock;

  // At most `limit` streams at a time.
  explicit UnstartedSessions(size_t limit) : limit_(limit) {}

  enum class Added { kYes, kShuttingDown, kFull };
  // kShuttingDown: end_all() has run; kFull: `limit` streams are open already. The stream
  // was not added then.
  Added add(Stream* stream, Clock::time_point now = Clock::now());
  // true: the stream was in the set and the caller now owns its end; false: end_all() or
  // end_idle() took it and finishes it (the caller must not).
  bool take(Stream* stream);
  // Takes every stream out and finishes it; add() fails from now on. Returns how many.
  size_t end_all(StreamStatus status, const std::string& message);
  // Takes out and finishes the streams added before `added_before`. Returns how many.
  size_t end_idle(Clock::time_point added_before, StreamStatus status, const std::string& message);
  size_t size() const;
  size_t limit() const { return limit_; }

 private:
  size_t end_taken(const std::vector<Stream*>& taken, StreamStatus status, const std::string& message);

  const size_t limit_;
  mutable std::mutex mu_;
  std::unordered_map<Stream*, Clock::time_point> streams_;  // -> when it was added
  bool ended_ = false;
};

}  // namespace m3
