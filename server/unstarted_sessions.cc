#include "server/unstarted_sessions.h"

#include <vector>

namespace m3 {

bool UnstartedSessions::add(Stream* stream) {
  std::lock_guard lock(mu_);
  if (ended_) return false;
  streams_.insert(stream);
  return true;
}

bool UnstartedSessions::take(Stream* stream) {
  std::lock_guard lock(mu_);
  return streams_.erase(stream) == 1;
}

size_t UnstartedSessions::end_all(StreamStatus status, const std::string& message) {
  std::vector<Stream*> taken;
  {
    std::lock_guard lock(mu_);
    ended_ = true;
    taken.assign(streams_.begin(), streams_.end());
    streams_.clear();
  }
  // Outside the lock: finishing a stream lets gRPC end the call (OnDone may run at once).
  for (Stream* stream : taken) stream->end_unstarted(status, message);
  return taken.size();
}

size_t UnstartedSessions::size() const {
  std::lock_guard lock(mu_);
  return streams_.size();
}

}  // namespace m3
