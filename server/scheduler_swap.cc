// Scheduler: Converse sessions off the engine's slots between turns
// (SchedulerOptions::session_swap_after). A session idle that long, or any idle session
// when others wait for a slot, has its state copied to host memory and gives up its slot;
// when its next input arrives it takes a free slot before new requests do, its state is
// loaded back and it goes on exactly where it left off (the state is the whole context).
// Open sessions are then bounded by max_sessions, not by slots. The states lie in buffers
// the engine makes for its copies (page-locked on the CUDA engine), kept for reuse.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <thread>

#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/session_metrics.h"

namespace m3 {

bool Scheduler::swappable(const Slot& s) const {
  return s.seq && s.seq->params().session && s.phase == Phase::kIdle && s.in_flight == 0 && s.loading.empty() &&
         s.fed >= s.feed.size() && !s.reply_requested && !s.save_requested && !s.save_pending &&
         !s.shutdown_saving && !s.seq->cancel_requested() && !s.seq->input_waiting();
}

void Scheduler::swap_out_idle_sessions(Clock::time_point now) {
  if (options_.session_swap_after <= Clock::duration::zero() || swap_refused_ || draining_) return;
  size_t wanted = 0;  // sessions and requests that wait for a slot
  for (const SwappedSession& w : swapped_) wanted += w.wants_in ? 1 : 0;
  {
    std::lock_guard lock(mu_);
    wanted += waiting_.size();
  }
  for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
    const Slot& s = slots_[i];
    if (!swappable(s)) continue;
    const bool due = now - s.idle_since >= options_.session_swap_after;
    if (!due && wanted <= free_slots_.size()) continue;
    swap_out(i);
  }
}

Clock::time_point Scheduler::next_swap_due() const {
  Clock::time_point due = Clock::time_point::max();
  if (options_.session_swap_after <= Clock::duration::zero() || swap_refused_) return due;
  for (const Slot& s : slots_)
    if (swappable(s)) due = std::min(due, s.idle_since + options_.session_swap_after);
  for (const SwappedSession& w : swapped_)
    if (!w.wants_in && options_.session_idle_timeout > Clock::duration::zero())
      due = std::min(due, w.slot.idle_since + options_.session_idle_timeout);
  return due;
}

HostStateBuffer Scheduler::take_state_buffer() {
  if (spare_states_.empty()) {
    HostStateBuffer made = engine_.allocate_host_state();
    ++state_buffers_;
    if (options_.session_metrics) options_.session_metrics->set_state_buffers(state_buffers_, state_buffers_ * made.size());
    return made;
  }
  HostStateBuffer buffer = std::move(spare_states_.back());
  spare_states_.pop_back();
  return buffer;
}

void Scheduler::give_back_state_buffer(HostStateBuffer buffer) {
  if (!buffer.empty()) spare_states_.push_back(std::move(buffer));
}

void Scheduler::swap_out(int i) {
  Slot& s = slots_[i];
  SwappedSession out;
  try {
    out.state = take_state_buffer();
    // The copy runs beside the steps: the slot may take another sequence at once (its
    // reset waits for the copy on the device).
    engine_.save_slot_async(i, out.state);
    out.saved_from = i;
  } catch (const std::exception& e) {
    // This engine cannot copy its state: sessions keep their slots, as without swapping.
    log_->warn("idle sessions cannot leave their slots: {}", e.what());
    give_back_state_buffer(std::move(out.state));
    swap_refused_ = true;
    return;
  }
  const uint32_t next_generation = s.generation + 1;
  out.slot = std::move(s);
  s = Slot{};
  s.generation = next_generation;
  s.feed.reserve(512);
  free_slots_.push_back(i);
  --active_;
  if (metrics_) metrics_->set_active_sequences(active_);
  swapped_.push_back(std::move(out));
  {
    std::lock_guard lock(mu_);
    swapped_count_ = static_cast<int>(swapped_.size());
  }
  if (options_.session_metrics) options_.session_metrics->set_swapped_out(swapped_.size());
}

void Scheduler::service_swapped(Clock::time_point now) {
  for (size_t k = 0; k < swapped_.size();) {
    SwappedSession& w = swapped_[k];
    Sequence& seq = *w.slot.seq;
    if (seq.cancel_requested()) {
      close_swapped(k, seq.cancel_status(), seq.cancel_message());
      continue;
    }
    if (now >= seq.params().deadline) {
      close_swapped(k, StreamStatus::kDeadlineExceeded,
                    "deadline exceeded after " + std::to_string(seq.summary.generated_tokens) + " generated tokens");
      continue;
    }
    // Input flags raised before the swap-out (already read) are not input.
    if (!w.wants_in && seq.input_changed() && seq.input_waiting()) {
      w.wants_in = true;
      w.wanted_since = now;
    }
    if (!w.wants_in) {
      if (options_.session_idle_timeout > Clock::duration::zero() &&
          now >= w.slot.idle_since + options_.session_idle_timeout) {
        close_swapped(k, StreamStatus::kDeadlineExceeded, session_idle_message(w.slot.turn));
        continue;
      }
      if (draining_) {  // between turns at shutdown, as service_slot ends them
        if (!seq.params().save_on_shutdown) {
          close_swapped(k, StreamStatus::kUnavailable, kShuttingDownMessage);
          continue;
        }
        if (!w.shutdown_saving && seq.params().on_state_saved) {
          w.shutdown_saving = true;  // its handler ends it, naming the snapshot
          SequenceState state;
          while (!engine_.slot_ready(w.saved_from)) std::this_thread::yield();  // its bytes are in
          state.bytes.assign(w.state.bytes().begin(), w.state.bytes().end());
          state.tokens = w.slot.state_tokens;
          state.last_sample = w.slot.has_sample ? w.slot.last_sample : -1;
          state.for_shutdown = true;
          seq.params().on_state_saved(w.slot.seq, std::move(state));
        }
      }
      ++k;
      continue;
    }
    if (free_slots_.empty()) {
      ++k;
      continue;
    }
    swap_in(k);
  }
}

void Scheduler::swap_in(size_t k) {
  SwappedSession w = std::move(swapped_[k]);
  swapped_[k] = std::move(swapped_.back());
  swapped_.pop_back();
  {
    std::lock_guard lock(mu_);
    swapped_count_ = static_cast<int>(swapped_.size());
  }
  if (options_.session_metrics) options_.session_metrics->set_swapped_out(swapped_.size());
  const int i = free_slots_.back();
  try {
    engine_.reset(i);
    engine_.set_sampling(i, w.slot.seq->params().sampling);
    engine_.load_slot_async(i, w.state);
  } catch (const std::exception& e) {
    log_->error("engine could not take a session's state back into slot {}: {}", i, e.what());
    swapped_.push_back(std::move(w));
    close_swapped(swapped_.size() - 1, StreamStatus::kInternal, std::string("engine error: ") + e.what());
    return;
  }
  free_slots_.pop_back();
  Slot& s = slots_[i];
  const uint32_t generation = s.generation;
  s = std::move(w.slot);
  s.generation = generation;
  s.in_flight = 0;
  s.loading = std::move(w.state);  // until the copy is in (loaded())
  s.swap_wanted_since = w.wanted_since;
  s.seq->mark_input_changed();  // its input is read once the state is in (service_slot)
  ++active_;
  if (metrics_) metrics_->set_active_sequences(active_);
}

bool Scheduler::loaded(int i) {
  Slot& s = slots_[i];
  if (s.loading.empty()) return true;
  if (!engine_.slot_ready(i)) return false;
  give_back_state_buffer(std::move(s.loading));
  if (options_.session_metrics) {
    options_.session_metrics->observe_swap_in(std::chrono::duration<double>(Clock::now() - s.swap_wanted_since).count());
  }
  return true;
}

void Scheduler::wait_loaded(int i) {
  while (!loaded(i)) std::this_thread::yield();
}

void Scheduler::close_swapped(size_t k, StreamStatus status, std::string message) {
  std::shared_ptr<Sequence> seq = std::move(swapped_[k].slot.seq);
  give_back_state_buffer(std::move(swapped_[k].state));
  swapped_[k] = std::move(swapped_.back());
  swapped_.pop_back();
  if (options_.session_metrics) options_.session_metrics->set_swapped_out(swapped_.size());
  if (seq->outbox().close(status, std::move(message))) wake_writer(seq);
  if (options_.stalled_streams != nullptr) options_.stalled_streams->track(seq, Clock::now());
  {
    std::lock_guard lock(mu_);
    swapped_count_ = static_cast<int>(swapped_.size());
    --in_flight_;
    note_session_closed_locked(*seq);
  }
  idle_cv_.notify_all();
}

void Scheduler::note_session_closed_locked(const Sequence& seq) {
  if (!seq.params().session) return;
  --sessions_open_;
  if (options_.session_metrics) options_.session_metrics->set_open(static_cast<size_t>(sessions_open_));
}

std::string Scheduler::session_idle_message(uint32_t turns) const {
  char limit[32];
  std::snprintf(limit, sizeof limit, "%g", std::chrono::duration<double>(options_.session_idle_timeout).count());
  return std::string("session idle: no input within ") + limit +
         " s (the server's session_idle_timeout_s) after " + std::to_string(turns) +
         " finished turns; the session ended and its slot was freed";
}

}  // namespace m3
