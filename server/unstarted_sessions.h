// Converse streams that are open but have not started a session (nothing sent yet, so no
// Sequence): the scheduler does not know them, so a shutdown's wait and cancel_all would
// pass them by and gRPC would hold the shutdown for its whole deadline, then end them
// with CANCELLED. The service ends them itself when shutdown starts, with the status
// every session gets then (UNAVAILABLE).
//
// Exactly one side finishes such a stream: a stream is in the set from its start until
// it leaves, either on its own (take() returns true: it starts its session, or ends
// before one) or because end_all() took it (take() then returns false, and end_all()
// finishes it). So end_all() only touches streams that cannot have finished, and so are
// still alive.
#pragma once

#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_set>

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

  // false: end_all() has run (the server is shutting down) and the stream was not added.
  bool add(Stream* stream);
  // true: the stream was in the set and the caller now owns its end; false: end_all()
  // took it and finishes it (the caller must not).
  bool take(Stream* stream);
  // Takes every stream out and finishes it; add() fails from now on. Returns how many.
  size_t end_all(StreamStatus status, const std::string& message);
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::unordered_set<Stream*> streams_;
  bool ended_ = false;
};

}  // namespace m3
