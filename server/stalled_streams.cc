#include "server/stalled_streams.h"

namespace m3 {

void StalledStreams::track(std::shared_ptr<Sequence> sequence, Clock::time_point now) {
  const uint64_t writes = sequence->writes_done();
  std::lock_guard lock(mu_);
  closing_.push_back({std::move(sequence), writes, now});
}

size_t StalledStreams::cut(Clock::time_point now, Clock::duration stall) {
  size_t cancelled = 0;
  std::lock_guard lock(mu_);
  for (auto it = closing_.begin(); it != closing_.end();) {
    Sequence& seq = *it->sequence;
    const uint64_t writes = seq.writes_done();
    if (!seq.writer_attached()) {
      it = closing_.erase(it);  // its call is done
    } else if (writes != it->writes_seen) {
      it->writes_seen = writes;  // still draining: the client reads
      it->progress = now;
      ++it;
    } else if (now - it->progress >= stall) {
      if (seq.cut_stalled_stream()) ++cancelled;
      it = closing_.erase(it);
    } else {
      ++it;
    }
  }
  return cancelled;
}

size_t StalledStreams::size() const {
  std::lock_guard lock(mu_);
  return closing_.size();
}

}  // namespace m3
