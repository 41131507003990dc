#include "server/stalled_streams.h"

#include <iterator>

namespace m3 {

StalledStreams::StalledStreams(size_t expected) {
  closing_.reserve(expected);
  walking_.reserve(expected);
}

void StalledStreams::track(std::shared_ptr<Sequence> sequence, Clock::time_point now) {
  const uint64_t writes = sequence->writes_done();
  std::lock_guard lock(mu_);
  closing_.push_back({std::move(sequence), writes, now});
}

size_t StalledStreams::cut(Clock::time_point now, Clock::duration stall) {
  std::lock_guard cut_lock(cut_mu_);
  {
    std::lock_guard lock(mu_);
    walking_.insert(walking_.end(), std::make_move_iterator(closing_.begin()),
                    std::make_move_iterator(closing_.end()));
    closing_.clear();
  }
  size_t cancelled = 0, kept = 0;
  for (size_t i = 0; i < walking_.size(); ++i) {
    Closing& c = walking_[i];
    Sequence& seq = *c.sequence;
    const uint64_t writes = seq.writes_done();
    if (!seq.writer_attached()) continue;  // its call is done
    if (writes != c.writes_seen) {         // still draining: the client reads
      c.writes_seen = writes;
      c.progress = now;
    } else if (now - c.progress >= stall) {
      if (seq.cut_stalled_stream()) ++cancelled;
      continue;
    }
    if (kept != i) walking_[kept] = std::move(c);
    ++kept;
  }
  walking_.erase(walking_.begin() + static_cast<std::ptrdiff_t>(kept), walking_.end());  // survivors stay
  return cancelled;
}

size_t StalledStreams::size() const {
  std::lock_guard cut_lock(cut_mu_);  // (cut()'s order: cut_mu_, then mu_)
  std::lock_guard lock(mu_);
  return closing_.size() + walking_.size();
}

}  // namespace m3
