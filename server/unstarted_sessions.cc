#include "server/unstarted_sessions.h"

namespace m3 {

UnstartedSessions::Added UnstartedSessions::add(Stream* stream, Clock::time_point now) {
  std::lock_guard lock(mu_);
  if (ended_) return Added::kShuttingDown;
  if (streams_.size() >= limit_) return Added::kFull;
  streams_.emplace(stream, now);
  return Added::kYes;
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
    for (const auto& [stream, added] : streams_) taken.push_back(stream);
    streams_.clear();
  }
  return end_taken(taken, status, message);
}

size_t UnstartedSessions::end_idle(Clock::time_point added_before, StreamStatus status,
                                   const std::string& message) {
  std::vector<Stream*> taken;
  {
    std::lock_guard lock(mu_);
    for (auto it = streams_.begin(); it != streams_.end();) {
      if (it->second < added_before) {
        taken.push_back(it->first);
        it = streams_.erase(it);
      } else {
        ++it;
      }
    }
  }
  return end_taken(taken, status, message);
}

size_t UnstartedSessions::end_taken(const std::vector<Stream*>& taken, StreamStatus status,
                                    const std::string& message) {
  // Outside the lock: finishing a stream lets gRPC end the call (OnDone may run at once).
  for (Stream* stream : taken) stream->end_unstarted(status, message);
  return taken.size();
}

size_t UnstartedSessions::size() const {
  std::lock_guard lock(mu_);
  return streams_.size();
}

}  // namespace m3
