#include "server/sequence.h"

namespace m3 {

Sequence::Sequence(SequenceParams params, size_t outbox_capacity, StreamWriter* writer)
    : params_(std::move(params)), outbox_(outbox_capacity), writer_(writer), arrival_(Clock::now()) {}

void Sequence::add_input(std::span<const int32_t> tokens) {
  if (tokens.empty()) return;
  {
    std::lock_guard lock(input_mu_);
    if (input_.empty() || input_.back().end_turn || input_.back().save) input_.emplace_back();
    input_.back().tokens.insert(input_.back().tokens.end(), tokens.begin(), tokens.end());
    pending_tokens_ += tokens.size();
  }
  mark_input_changed();
}

void Sequence::end_turn(uint32_t max_new_tokens) {
  {
    std::lock_guard lock(input_mu_);
    if (input_.empty() || input_.back().end_turn || input_.back().save) {
      input_.emplace_back();  // a turn with no input: it will feed the last reply's token
      ++pending_tokens_;
    }
    input_.back().end_turn = true;
    input_.back().max_new_tokens = max_new_tokens;
    input_.back().end_turn_time = Clock::now();
  }
  mark_input_changed();
}

void Sequence::close_input() {
  {
    std::lock_guard lock(input_mu_);
    input_closed_ = true;
  }
  mark_input_changed();
}

void Sequence::request_save() {
  {
    std::lock_guard lock(input_mu_);
    input_.emplace_back();
    input_.back().save = true;
  }
  mark_input_changed();
}

void Sequence::deliver_saved(std::string snapshot_id) {
  {
    std::lock_guard lock(input_mu_);
    saved_ids_.push_back(std::move(snapshot_id));
  }
  saved_waiting_.store(true, std::memory_order_release);
}

std::string Sequence::take_saved() {
  if (!saved_waiting_.load(std::memory_order_acquire)) return "";
  std::lock_guard lock(input_mu_);
  std::string id;
  if (!saved_ids_.empty()) {
    id = std::move(saved_ids_.front());
    saved_ids_.erase(saved_ids_.begin());
  }
  saved_waiting_.store(!saved_ids_.empty(), std::memory_order_release);
  return id;
}

void Sequence::set_shutdown_snapshot(std::string snapshot_id) {
  std::lock_guard lock(input_mu_);
  shutdown_snapshot_ = std::move(snapshot_id);
}

std::string Sequence::shutdown_snapshot() {
  std::lock_guard lock(input_mu_);
  return shutdown_snapshot_;
}

void Sequence::request_cancel(StreamStatus status, std::string message) {
  {
    std::lock_guard lock(cancel_mu_);
    if (cancel_requested_.load()) return;  // the first reason wins
    cancel_status_ = status;
    cancel_message_ = std::move(message);
  }
  cancel_requested_.store(true, std::memory_order_release);
}

StreamStatus Sequence::cancel_status() {
  std::lock_guard lock(cancel_mu_);
  return cancel_status_;
}

std::string Sequence::cancel_message() {
  std::lock_guard lock(cancel_mu_);
  return cancel_message_;
}

Sequence::InputSegment Sequence::take_input(std::vector<int32_t>* feed) {
  std::lock_guard lock(input_mu_);
  InputSegment result;
  while (!input_.empty()) {
    InputSegment& front = input_.front();
    if (front.save) {
      result.save = true;
      input_.pop_front();
      break;
    }
    feed->insert(feed->end(), front.tokens.begin(), front.tokens.end());
    pending_tokens_ -= front.tokens.empty() ? 1 : front.tokens.size();
    if (front.end_turn) {
      result.end_turn = true;
      result.max_new_tokens = front.max_new_tokens;
      result.end_turn_time = front.end_turn_time;
      input_.pop_front();
      break;
    }
    input_.pop_front();
  }
  return result;
}

size_t Sequence::pending_input_tokens() {
  std::lock_guard lock(input_mu_);
  return pending_tokens_;
}

bool Sequence::input_waiting() {
  std::lock_guard lock(input_mu_);
  return !input_.empty() || input_closed_;
}

bool Sequence::input_closed_and_empty() {
  std::lock_guard lock(input_mu_);
  return input_closed_ && input_.empty();
}

void Sequence::detach_writer() {
  std::lock_guard lock(writer_mu_);
  writer_attached_ = false;
}

bool Sequence::writer_attached() {
  std::lock_guard lock(writer_mu_);
  return writer_attached_;
}

bool Sequence::cut_stalled_stream() {
  std::lock_guard lock(writer_mu_);  // the writer's OnDone waits here to detach
  if (!writer_attached_) return false;
  cut_ = true;
  writer_->cancel_call();
  return true;
}

bool Sequence::was_cut() {
  std::lock_guard lock(writer_mu_);
  return cut_;
}

}  // namespace m3
