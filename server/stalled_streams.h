// Streams the scheduler has closed, until their calls are done. Such a stream ends only
// when its last messages and its status reach the client, which a client that stops
// reading (its receive window full) never lets happen: its reactor and buffers would live
// until the connection dies. The scheduler hands every stream over here as it closes it
// (most are done within milliseconds, and the next sweep forgets them); a periodic sweep
// cancels the call of any whose writer has completed no write for a while (the client
// sees CANCELLED). A client that reads at last, within that time, still gets the stream's
// status (RESOURCE_EXHAUSTED for a reader that fell behind).
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "server/sequence.h"

namespace m3 {

class StalledStreams {
 public:
  // Room for `expected` streams at a time without allocating (streams closed within a
  // sweep's period, and stalled ones).
  explicit StalledStreams(size_t expected = 4096);

  // Any thread (the scheduler's, as it closes a stream); holds the lock only for the push,
  // never while cut() walks the streams.
  void track(std::shared_ptr<Sequence> sequence, Clock::time_point now);
  // Cancels the calls of tracked streams whose writer completed no write during the last
  // `stall`, and forgets those whose call is done; returns how many it cancelled.
  size_t cut(Clock::time_point now, Clock::duration stall);
  size_t size() const;

 private:
  struct Closing {
    std::shared_ptr<Sequence> sequence;
    uint64_t writes_seen;
    Clock::time_point progress;  // when writes_seen was last seen to change
  };
  mutable std::mutex mu_;
  std::vector<Closing> closing_;
  std::vector<Closing> walking_;  // cut()'s, under cut_mu_ (survivors of earlier cuts)
  mutable std::mutex cut_mu_;     // one cut() at a time
};

}  // namespace m3
