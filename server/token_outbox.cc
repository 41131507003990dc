#include "server/token_outbox.h"

#include <algorithm>
#include <stdexcept>

namespace m3 {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kEndOfReply: return "end_of_reply";
  }
  return "unknown";
}

const char* stream_status_name(StreamStatus s) {
  switch (s) {
    case StreamStatus::kOk: return "ok";
    case StreamStatus::kCancelled: return "cancelled";
    case StreamStatus::kInvalidArgument: return "invalid_argument";
    case StreamStatus::kResourceExhausted: return "resource_exhausted";
    case StreamStatus::kDeadlineExceeded: return "deadline_exceeded";
    case StreamStatus::kInternal: return "internal";
    case StreamStatus::kUnavailable: return "unavailable";
    case StreamStatus::kNotFound: return "not_found";
    case StreamStatus::kFailedPrecondition: return "failed_precondition";
    case StreamStatus::kDataLoss: return "data_loss";
    case StreamStatus::kUnimplemented: return "unimplemented";
    case StreamStatus::kUnauthenticated: return "unauthenticated";
  }
  return "unknown";
}

TokenOutbox::TokenOutbox(size_t capacity) : ring_(capacity) {
  if (capacity == 0) throw std::invalid_argument("TokenOutbox: capacity must be at least 1");
}

TokenOutbox::Push TokenOutbox::push(int32_t token) {
  std::lock_guard lock(mu_);
  if (closed_) return Push::kQueued;
  if (pushed_ - taken_ == ring_.size()) return Push::kOverflow;
  ring_[pushed_ % ring_.size()] = token;
  ++pushed_;
  if (writer_busy_) return Push::kQueued;
  writer_busy_ = true;
  return Push::kWakeWriter;
}

bool TokenOutbox::end_turn(const TurnEnd& end) {
  std::lock_guard lock(mu_);
  if (closed_) return false;
  turn_ends_.push_back({pushed_, end});
  if (writer_busy_) return false;
  writer_busy_ = true;
  return true;
}

bool TokenOutbox::snapshot_saved(std::string snapshot_id) {
  std::lock_guard lock(mu_);
  if (closed_) return false;
  turn_ends_.push_back({pushed_, TurnEnd{}, std::move(snapshot_id)});
  if (writer_busy_) return false;
  writer_busy_ = true;
  return true;
}

bool TokenOutbox::close(StreamStatus status, std::string message, Unsent unsent) {
  std::lock_guard lock(mu_);
  if (closed_) return false;
  closed_ = true;
  status_ = status;
  message_ = std::move(message);
  if (status != StreamStatus::kOk && unsent == Unsent::kDrop) {
    taken_ = pushed_;  // an error ends the stream now: unsent tokens are dropped
    turn_ends_.clear();
  }
  if (writer_busy_) return false;
  writer_busy_ = true;
  return true;
}

TokenOutbox::Item TokenOutbox::take(std::vector<int32_t>* tokens) {
  std::lock_guard lock(mu_);
  Item item;
  const uint64_t next_end = turn_ends_.empty() ? pushed_ : turn_ends_.front().at;
  if (taken_ < next_end) {
    tokens->clear();
    for (uint64_t i = taken_; i < next_end; ++i) tokens->push_back(ring_[i % ring_.size()]);
    taken_ = next_end;
    item.kind = Item::kTokens;
  } else if (!turn_ends_.empty()) {
    item.kind = turn_ends_.front().snapshot_id.empty() ? Item::kTurnEnd : Item::kSnapshotSaved;
    item.turn_end = turn_ends_.front().end;
    item.snapshot_id = std::move(turn_ends_.front().snapshot_id);
    turn_ends_.pop_front();
  } else if (closed_ && !close_delivered_) {
    close_delivered_ = true;
    item.kind = Item::kClosed;
    item.status = status_;
    item.message = message_;
  } else {
    writer_busy_ = false;
  }
  return item;
}

bool TokenOutbox::closed() const {
  std::lock_guard lock(mu_);
  return closed_;
}

}  // namespace m3
