#include "server/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <exception>

#include "server/metrics.h"
#include "server/session_metrics.h"

namespace m3 {
namespace {

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

Scheduler::Scheduler(Engine& engine, SchedulerOptions options, ServerMetrics* metrics,
                     std::shared_ptr<spdlog::logger> log)
    : engine_(engine),
      options_(options),
      metrics_(metrics),
      log_(log ? std::move(log) : spdlog::default_logger()),
      flusher_(static_cast<size_t>(engine.max_slots() + options.queue_capacity) + 16),
      prefill_chunk_(engine.has_prefill_path() ? std::min(options.prefill_chunk_tokens, engine.max_prefill_tokens())
                                               : 0),
      prefill_alone_(prefill_chunk_ == 0
                         ? 0
                         : std::max(prefill_chunk_, std::min(options.prefill_alone_tokens, engine.max_prefill_tokens()))) {
  const int n = engine.max_slots();
  slots_.resize(n);
  for (auto& s : slots_) s.feed.reserve(512);
  for (int i = n - 1; i >= 0; --i) free_slots_.push_back(i);
  for (SubmittedStep& step : steps_) {
    step.entries.reserve(n);
    step.slots.reserve(n);
    step.tokens.reserve(n);
    step.sampled.reserve(n);
  }
  prefill_order_.reserve(n);
  prefill_runs_.reserve(n);
  prefill_sampled_.reserve(n);
  prefill_entries_.entries.reserve(n);
  wake_list_.reserve(static_cast<size_t>(n + options.queue_capacity) + 16);
  admitted_.reserve(n);
  prefix_saves_.reserve(n);
  rejected_.reserve(static_cast<size_t>(options.queue_capacity) + 1);
  graph_replays_seen_ = engine.stats().graph_replays;
  thread_ = std::thread([this] { run(); });
}

Scheduler::~Scheduler() {
  cancel_all();
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  // The state buffers go with this scheduler: no copy of the engine's may still use them.
  for (int i = 0; i < engine_.max_slots(); ++i)
    while (!engine_.slot_ready(i)) std::this_thread::yield();
}

Scheduler::Admission Scheduler::submit(std::shared_ptr<Sequence> sequence) {
  {
    std::lock_guard lock(mu_);
    if (!accepting_) return {StreamStatus::kUnavailable, kShuttingDownMessage};
    if (!engine_failure_.empty()) return {StreamStatus::kUnavailable, engine_unusable_message()};
    const int capacity = engine_.max_slots() + options_.queue_capacity;
    if (sequence->params().session && options_.max_sessions > 0 && sessions_open_ >= options_.max_sessions) {
      return {StreamStatus::kResourceExhausted, "server at capacity: " + std::to_string(sessions_open_) +
                                                    " Converse sessions are open (max_sessions); retry later"};
    }
    if (in_flight_ - swapped_count_ >= capacity) {
      return {StreamStatus::kResourceExhausted,
              "server at capacity: all " + std::to_string(engine_.max_slots()) +
                  " slots are busy and " + std::to_string(options_.queue_capacity) +
                  " requests are already waiting (queue_capacity); retry later"};
    }
    if (sequence->params().session) {
      ++sessions_open_;
      if (options_.session_metrics) options_.session_metrics->set_open(static_cast<size_t>(sessions_open_));
    }
    waiting_.push_back(std::move(sequence));
    ++in_flight_;
    wake_ = true;
  }
  cv_.notify_one();
  return {};
}

void Scheduler::wake() {
  {
    std::lock_guard lock(mu_);
    wake_ = true;
  }
  cv_.notify_one();
}

void Scheduler::stop_accepting() {
  {
    std::lock_guard lock(mu_);
    accepting_ = false;
    wake_ = true;  // idle sessions end at the next token boundary (service_slot)
  }
  cv_.notify_one();
}

bool Scheduler::wait_until_idle(Clock::time_point deadline) {
  std::unique_lock lock(mu_);
  return idle_cv_.wait_until(lock, deadline, [&] { return in_flight_ == 0; });
}

void Scheduler::cancel_all() {
  {
    std::lock_guard lock(mu_);
    accepting_ = false;
    cancel_all_ = true;
    wake_ = true;
  }
  cv_.notify_one();
  std::unique_lock lock(mu_);
  idle_cv_.wait(lock, [&] { return in_flight_ == 0; });
  cancel_all_ = false;
}

int Scheduler::in_flight() const {
  std::lock_guard lock(mu_);
  return in_flight_;
}

void Scheduler::wake_writer(const std::shared_ptr<Sequence>& seq) { wake_list_.push_back(seq); }

void Scheduler::close_unadmitted(const std::shared_ptr<Sequence>& seq, StreamStatus status,
                                 std::string message) {
  if (seq->outbox().close(status, std::move(message))) wake_writer(seq);
  {
    std::lock_guard lock(mu_);
    --in_flight_;
    note_session_closed_locked(*seq);
  }
  idle_cv_.notify_all();
}

void Scheduler::admit_waiting(Clock::time_point now) {
  bool cancel_everything = false, engine_unusable = false;
  {
    std::lock_guard lock(mu_);
    cancel_everything = cancel_all_;
    engine_unusable = !engine_failure_.empty();
    if (cancel_everything || engine_unusable) {
      while (!waiting_.empty()) {
        rejected_.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
      }
    } else {
      // Requests cancelled while waiting give their queue place back at once.
      if (wake_) {
        for (auto it = waiting_.begin(); it != waiting_.end();) {
          if ((*it)->cancel_requested()) {
            rejected_.push_back(std::move(*it));
            it = waiting_.erase(it);
          } else {
            ++it;
          }
        }
      }
      while (!waiting_.empty() && admitted_.size() < free_slots_.size()) {
        admitted_.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
      }
    }
    wake_ = false;
    if (metrics_) metrics_->set_queue_depth(static_cast<int>(waiting_.size()));
  }
  for (auto& seq : rejected_) {
    if (cancel_everything) {
      close_unadmitted(seq, StreamStatus::kUnavailable, kShuttingDownMessage);
    } else if (engine_unusable) {
      close_unadmitted(seq, StreamStatus::kUnavailable, engine_unusable_message());
    } else {
      close_unadmitted(seq, seq->cancel_status(), seq->cancel_message());
    }
  }
  rejected_.clear();

  for (auto& seq : admitted_) {
    seq->summary.queue_ms = ms_between(seq->arrival(), now);
    if (seq->cancel_requested()) {
      close_unadmitted(seq, seq->cancel_status(), seq->cancel_message());
      continue;
    }
    if (now >= seq->params().deadline) {
      close_unadmitted(seq, StreamStatus::kDeadlineExceeded,
                       "deadline exceeded while waiting for a free slot");
      continue;
    }
    const int i = free_slots_.back();
    const SequenceState* start = seq->params().start_state.get();
    try {
      engine_.reset(i);
      engine_.set_sampling(i, seq->params().sampling);
      if (start != nullptr) engine_.load_slot(i, start->bytes);
    } catch (const std::exception& e) {
      log_->error("engine could not start a sequence in slot {}: {}", i, e.what());
      close_unadmitted(seq, StreamStatus::kInternal, std::string("engine error: ") + e.what());
      continue;
    }
    free_slots_.pop_back();
    Slot& s = slots_[i];
    s.seq = std::move(seq);
    s.phase = Phase::kIdle;
    s.idle_since = now;
    s.feed.clear();
    s.fed = 0;
    s.reply_requested = false;
    s.save_requested = false;
    s.save_pending = false;
    s.shutdown_saving = false;
    s.cacheable = options_.prefix_cache != nullptr && start == nullptr;
    s.reply_max_new = 0;
    s.has_sample = start != nullptr && start->last_sample >= 0;
    s.last_sample = start != nullptr ? start->last_sample : 0;
    s.state_tokens = start != nullptr ? start->tokens : 0;
    s.generated = 0;
    s.scheduled = 0;
    s.in_flight = 0;
    s.turn = 0;
    s.turn_prompt_tokens = 0;
    s.turn_start = s.seq->arrival();
    s.seq->mark_input_changed();
    ++active_;
    if (metrics_) metrics_->set_active_sequences(active_);
  }
  admitted_.clear();

  if (cancel_everything) shutdown_all_slots();
}

void Scheduler::shutdown_all_slots() {
  const Clock::time_point now = Clock::now();
  while (!swapped_.empty()) close_swapped(swapped_.size() - 1, StreamStatus::kUnavailable, kShuttingDownMessage);
  for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
    Slot& s = slots_[i];
    if (!s.seq) continue;
    if (!s.seq->params().session) {
      end_reply(i, FinishReason::kCancelled, now);  // Finished{CANCELLED}, then OK
      continue;
    }
    // A reply in progress reaches its client as it stands, with its TurnFinished.
    if (s.phase == Phase::kReplying) end_reply(i, FinishReason::kCancelled, now);
    finish(i, StreamStatus::kUnavailable, kShuttingDownMessage, TokenOutbox::Unsent::kDeliver);
  }
}

void Scheduler::pull_input(Slot& s) {
  // The rest belongs to later turns, or comes after the save (answered first).
  if (s.reply_requested || s.save_requested || s.save_pending) return;
  if (s.fed == s.feed.size()) {
    if (s.fed > 0) s.cacheable = false;  // feed no longer holds every token of the state
    s.feed.clear();
    s.fed = 0;
  }
  Sequence::InputSegment seg = s.seq->take_input(&s.feed);
  if (s.cacheable && s.state_tokens == 0 && s.fed < s.feed.size()) start_from_cached_prefix(static_cast<int>(&s - slots_.data()));
  if (seg.end_turn) {
    s.reply_requested = true;
    s.reply_max_new = seg.max_new_tokens;
    if (s.seq->params().session) s.turn_start = seg.end_turn_time;
  }
  s.save_requested = seg.save;
  if (s.fed < s.feed.size()) s.phase = Phase::kFeeding;
}

void Scheduler::service_slot(int i, Clock::time_point now) {
  Slot& s = slots_[i];
  Sequence& seq = *s.seq;
  if (seq.cancel_requested()) {
    finish(i, seq.cancel_status(), seq.cancel_message());
    return;
  }
  if (now >= seq.params().deadline) {
    finish(i, StreamStatus::kDeadlineExceeded,
           "deadline exceeded after " + std::to_string(seq.summary.generated_tokens) +
               " generated tokens");
    return;
  }
  while (true) {  // snapshots stored for it since the last boundary, in order with its tokens
    std::string saved = seq.take_saved();
    if (saved.empty()) break;
    if (seq.outbox().snapshot_saved(std::move(saved))) wake_writer(s.seq);
    s.save_pending = false;
    seq.mark_input_changed();  // what was sent after the save
  }
  // Shutting down, a session between turns (idle, none of its input left to feed) has
  // nothing to finish: it ends now rather than holding the shutdown for its whole grace
  // period (docker stop's SIGKILL came first with the defaults). One with input or a
  // reply under way gets the grace. A step still in flight for it is dropped, as for a
  // cancellation.
  if (draining_ && seq.params().session && s.phase == Phase::kIdle && s.fed >= s.feed.size() &&
      seq.pending_input_tokens() == 0 && !s.save_requested && !s.save_pending) {
    // With a persistent store it is saved first (once its last token is in the state);
    // the save's handler ends it, naming the snapshot.
    if (!seq.params().save_on_shutdown) {
      finish(i, StreamStatus::kUnavailable, kShuttingDownMessage);
    } else if (!s.shutdown_saving && s.in_flight == 0) {
      s.shutdown_saving = true;
      save_state(i, /*for_shutdown=*/true);
    }
    return;
  }
  if (s.phase == Phase::kReplying) return;
  if (s.in_flight > 0) {
    // Its last sample is not back yet: a prompt being fed may grow; anything that needs
    // that sample (a reply to start, the session's idle clock) waits for it.
    if (s.phase == Phase::kFeeding && seq.input_changed()) pull_input(s);
    return;
  }
  if (!seq.input_changed()) {
    if (now >= idle_deadline(s)) finish(i, StreamStatus::kDeadlineExceeded, session_idle_message(s.turn));
    return;
  }

  pull_input(s);
  if (s.fed < s.feed.size()) return;  // feeding goes on in the next step
  while (s.save_requested) {  // all input before the save is in the state
    save_state(i);
    pull_input(s);
    if (s.fed < s.feed.size()) return;
  }
  if (s.reply_requested) {
    if (!s.has_sample) {
      finish(i, StreamStatus::kInvalidArgument, "end_turn with no input tokens to reply to");
      return;
    }
    // The last input token was fed already: its sample is the reply's first token.
    s.phase = Phase::kReplying;
    ++s.scheduled;
    emit(i, s.last_sample, now);
    return;
  }
  become_idle(s, now);
  if (seq.input_closed_and_empty() && !s.save_pending) finish(i, StreamStatus::kOk, "");
}

void Scheduler::save_state(int i, bool for_shutdown) {
  Slot& s = slots_[i];
  s.save_requested = false;
  SequenceState state;
  state.for_shutdown = for_shutdown;
  state.tokens = s.state_tokens;
  state.last_sample = s.has_sample ? s.last_sample : -1;
  try {
    state.bytes.resize(engine_.slot_state_bytes());
    engine_.save_slot(i, state.bytes);
  } catch (const std::exception& e) {
    state.bytes.clear();
    state.error = e.what();
  }
  if (!s.seq->params().on_state_saved) return;
  s.save_pending = !for_shutdown;  // until the handler's deliver_saved() or cancellation
  s.seq->params().on_state_saved(s.seq, std::move(state));
}

void Scheduler::start_from_cached_prefix(int i) {
  Slot& s = slots_[i];
  const PrefixStateCache::Entry* e = options_.prefix_cache->longest_prefix(s.feed);
  if (e == nullptr) return;
  try {
    engine_.load_slot(i, e->state);
  } catch (const std::exception& ex) {
    log_->error("prefix cache: the engine refused a kept state for slot {}: {}", i, ex.what());
    engine_.reset(i);
    return;
  }
  s.fed = e->tokens.size();
  s.state_tokens = s.fed;
}

void Scheduler::keep_prefix_states() {
  for (const auto& [i, tokens] : prefix_saves_) {
    const Slot& s = slots_[i];
    if (!s.seq || tokens > s.feed.size()) continue;  // it left (a failed step)
    const std::span<const int32_t> prefix(s.feed.data(), tokens);
    if (options_.prefix_cache->contains(prefix)) continue;
    std::vector<std::byte> state(engine_.slot_state_bytes());
    try {
      engine_.save_slot(i, state);
    } catch (const std::exception& ex) {
      log_->error("prefix cache: the engine could not save slot {}: {}", i, ex.what());
      continue;
    }
    options_.prefix_cache->insert(prefix, std::move(state));
  }
  prefix_saves_.clear();
}

void Scheduler::become_idle(Slot& s, Clock::time_point now) {
  if (s.phase != Phase::kIdle) s.idle_since = now;
  s.phase = Phase::kIdle;
}

Clock::time_point Scheduler::idle_deadline(const Slot& s) const {
  if (s.phase != Phase::kIdle || !s.seq->params().session ||
      options_.session_idle_timeout <= Clock::duration::zero())
    return Clock::time_point::max();
  return s.idle_since + options_.session_idle_timeout;
}

void Scheduler::emit(int i, int32_t token, Clock::time_point now) {
  Slot& s = slots_[i];
  Sequence& seq = *s.seq;
  ++s.generated;
  ++seq.summary.generated_tokens;
  if (s.generated == 1) {
    s.first_token_time = now;
    if (metrics_) metrics_->observe_time_to_first_token(seconds_between(s.turn_start, now));
    if (seq.summary.time_to_first_token_ms < 0)
      seq.summary.time_to_first_token_ms = ms_between(s.turn_start, now);
  } else if (metrics_) {
    metrics_->observe_inter_token_latency(seconds_between(s.last_token_time, now));
  }
  s.last_token_time = now;
  s.last_emitted = token;

  switch (seq.outbox().push(token)) {
    case TokenOutbox::Push::kQueued:
      break;
    case TokenOutbox::Push::kWakeWriter:
      wake_writer(s.seq);
      break;
    case TokenOutbox::Push::kOverflow:
      finish(i, StreamStatus::kResourceExhausted,
             "the client reads too slowly: " + std::to_string(seq.outbox().capacity()) +
                 " generated tokens were left unread (stream_buffer_tokens); stream cancelled");
      return;
  }
  const auto& stops = seq.params().stop_token_ids;
  if (token == seq.params().end_of_reply_id) {
    end_reply(i, FinishReason::kEndOfReply, now);
  } else if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
    end_reply(i, FinishReason::kStop, now);
  } else if (s.generated >= s.reply_max_new) {
    end_reply(i, FinishReason::kLength, now);
  }
}

void Scheduler::end_reply(int i, FinishReason reason, Clock::time_point now) {
  Slot& s = slots_[i];
  Sequence& seq = *s.seq;
  TurnEnd end;
  end.turn = s.turn;
  end.reason = reason;
  end.stats.prompt_tokens = s.turn_prompt_tokens;
  end.stats.generated_tokens = s.generated;
  end.stats.queue_ms = s.turn == 0 ? seq.summary.queue_ms : 0.0;
  end.stats.time_to_first_token_ms = s.generated > 0 ? ms_between(s.turn_start, s.first_token_time) : 0.0;
  end.stats.duration_ms = ms_between(s.turn_start, now);
  if (s.generated > 1 && s.last_token_time > s.first_token_time)
    end.stats.tokens_per_second =
        (s.generated - 1) / seconds_between(s.first_token_time, s.last_token_time);
  seq.summary.prompt_tokens += s.turn_prompt_tokens;
  ++seq.summary.turns;
  seq.summary.last_finish = finish_reason_name(reason);
  if (seq.outbox().end_turn(end)) wake_writer(s.seq);

  if (!seq.params().session) {
    finish(i, StreamStatus::kOk, "");
    return;
  }
  // The next turn starts by feeding this reply's last token (it is context too).
  const int32_t carry = s.generated > 0 ? s.last_emitted : -1;
  ++s.turn;
  s.reply_requested = false;
  s.generated = 0;
  s.scheduled = 0;
  s.turn_prompt_tokens = 0;
  s.feed.clear();
  s.fed = 0;
  s.has_sample = false;
  StepEntry* fed_already = nullptr;  // the step after this sample's continued the reply
  if (s.in_flight > 0 && submitted_after_ != nullptr) {
    for (StepEntry& e : submitted_after_->entries) {
      if (e.slot == i && e.generation == s.generation) fed_already = &e;
    }
  }
  if (fed_already != nullptr) {
    // That step fed the sample just emitted (kContinueToken): the carry is in, and what it
    // samples is kept as a prompt token's.
    fed_already->use = SampleUse::kKeep;
    s.turn_prompt_tokens = 1;
    become_idle(s, now);
  } else if (carry >= 0) {
    s.feed.push_back(carry);
    s.phase = Phase::kFeeding;
  } else {
    become_idle(s, now);
  }
  seq.mark_input_changed();
}

void Scheduler::finish(int i, StreamStatus status, std::string message, TokenOutbox::Unsent unsent) {
  wait_loaded(i);  // its buffer goes back to the spares only once nothing reads it
  Slot& s = slots_[i];
  std::shared_ptr<Sequence> seq = std::move(s.seq);
  s.seq.reset();
  ++s.generation;  // samples of its steps still queued are dropped when they come back
  s.in_flight = 0;
  if (seq->summary.turns == 0) seq->summary.prompt_tokens = s.turn_prompt_tokens;
  s.phase = Phase::kFree;
  free_slots_.push_back(i);
  --active_;
  if (metrics_) metrics_->set_active_sequences(active_);
  if (seq->outbox().close(status, std::move(message), unsent)) wake_writer(seq);
  // Its last messages and status may wait behind data its client's window holds back,
  // whether or not a write is in flight now: watched until its call is done.
  if (options_.stalled_streams != nullptr) options_.stalled_streams->track(seq, Clock::now());
  {
    std::lock_guard lock(mu_);
    --in_flight_;
    note_session_closed_locked(*seq);
  }
  idle_cv_.notify_all();
}

void Scheduler::schedule(int i, SubmittedStep& step, Clock::time_point now) {
  Slot& s = slots_[i];
  int32_t token;
  SampleUse use;
  if (s.phase == Phase::kReplying) s.cacheable = false;  // replies are not prefixes to keep
  if (s.phase == Phase::kFeeding) {
    if (reads_by_prefill(s)) return;  // read by prefill() instead
    token = s.feed[s.fed++];
    if (s.cacheable && (s.fed % static_cast<size_t>(options_.prefix_cache->interval()) == 0 ||
                        (s.fed == s.feed.size() && s.reply_requested)))
      prefix_saves_.emplace_back(i, s.fed);
    ++s.turn_prompt_tokens;
    use = SampleUse::kKeep;
    if (s.fed == s.feed.size()) {
      if (s.reply_requested) {
        // This token's sample is the reply's first token.
        s.phase = Phase::kReplying;
        ++s.scheduled;
        use = SampleUse::kEmit;
      } else {
        // Input that arrives meanwhile is picked up once the sample is back.
        become_idle(s, now);
      }
    }
  } else if (s.phase == Phase::kReplying && s.scheduled < s.reply_max_new) {
    token = kContinueToken;
    ++s.scheduled;
    use = SampleUse::kEmit;
  } else {
    return;  // idle, or its reply ends with the sample in flight
  }
  ++s.in_flight;
  ++s.state_tokens;
  step.entries.push_back({i, s.generation, use});
  step.slots.push_back(i);
  step.tokens.push_back(token);
}

void Scheduler::submit(SubmittedStep& step) {
  try {
    engine_.submit_step(step.slots, step.tokens);
  } catch (const std::exception& e) {
    fail_step(step, e);
    return;
  }
  if (metrics_) metrics_->set_batch_size(static_cast<int>(step.size()));
}

void Scheduler::collect(SubmittedStep& step, SubmittedStep* next) {
  step.sampled.resize(step.size());  // within the capacity reserved at construction
  try {
    engine_.collect_step(step.sampled);
  } catch (const std::exception& e) {
    fail_step(step, e);
    return;
  }
  const Clock::time_point now = Clock::now();
  submitted_after_ = next;
  for (size_t k = 0; k < step.size(); ++k) {
    const StepEntry& e = step.entries[k];
    Slot& s = slots_[e.slot];
    if (!s.seq || s.generation != e.generation) continue;  // it left meanwhile
    --s.in_flight;
    const int32_t token = step.sampled[k];
    s.has_sample = true;
    s.last_sample = token;
    if (e.use == SampleUse::kEmit) {
      emit(e.slot, token, now);
    } else if (s.phase == Phase::kIdle && s.in_flight == 0) {
      s.seq->mark_input_changed();  // what arrived while its prompt was fed
    }
  }
  submitted_after_ = nullptr;
  step.clear();
  if (metrics_) {
    const uint64_t replays = engine_.stats().graph_replays;
    if (replays != graph_replays_seen_) {
      metrics_->add_graph_replays(replays - graph_replays_seen_);
      graph_replays_seen_ = replays;
    }
  }
}

void Scheduler::fail_step(SubmittedStep& step, const std::exception& e) {
  log_->error("engine step failed for {} sequences: {}", step.size(), e.what());
  // An engine that can run no more is marked so (refusing requests, reporting NOT_SERVING)
  // before any stream of the step ends, so that a client seeing its stream end finds the
  // server already refusing.
  bool unusable_now = false;
  if (std::string why = engine_.failure(); !why.empty()) {
    std::lock_guard lock(mu_);
    if (engine_failure_.empty()) {
      engine_failure_ = std::move(why);
      wake_ = true;  // the waiting requests are refused at the next boundary
      unusable_now = true;
    }
  }
  if (unusable_now) {
    log_->error("the engine can run no more steps ({}); new requests are refused with UNAVAILABLE "
                "and health reports NOT_SERVING: restart the server",
                engine_failure_);
    if (options_.on_engine_unusable) options_.on_engine_unusable(engine_failure_);
  }
  for (const StepEntry& entry : step.entries) {
    const Slot& s = slots_[entry.slot];
    if (s.seq && s.generation == entry.generation)
      finish(entry.slot, StreamStatus::kInternal, std::string("engine error: ") + e.what());
  }
  step.clear();
  if (unusable_now) {
    // What else holds a slot would fail at its next step: it ends now, as requests are refused.
    for (int i = 0; i < static_cast<int>(slots_.size()); ++i)
      if (slots_[i].seq) finish(i, StreamStatus::kUnavailable, engine_unusable_message());
  }
}

bool Scheduler::wants_prefill(const Slot& s) const {
  return s.seq && s.phase == Phase::kFeeding && s.in_flight == 0 && s.loading.empty() && s.fed < s.feed.size() &&
         reads_by_prefill(s);
}

void Scheduler::prefill(SubmittedStep& step) {
  prefill_order_.clear();
  for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
    if (wants_prefill(slots_[i])) prefill_order_.push_back(i);
  }
  // The oldest turn first, so that a burst of prompts reaches first tokens in arrival order.
  std::sort(prefill_order_.begin(), prefill_order_.end(),
            [&](int a, int b) { return slots_[a].turn_start < slots_[b].turn_start; });
  prefill_runs_.clear();
  prefill_entries_.clear();
  // prefill_chunk_ bounds a pass to hold the replying streams' inter-token latency; with
  // none replying (this iteration's step empty), a pass may read more.
  const bool alone = step.size() == 0 && std::none_of(slots_.begin(), slots_.end(), [](const Slot& s) {
    return s.seq && s.phase == Phase::kReplying;
  });
  size_t budget = static_cast<size_t>(alone ? prefill_alone_ : prefill_chunk_);
  size_t total = 0;
  for (const int i : prefill_order_) {
    if (budget == 0) break;
    const Slot& s = slots_[i];
    size_t n = std::min(budget, s.feed.size() - s.fed);
    if (s.cacheable) {  // a run ends at the prefix cache's next boundary, where its state is kept
      const size_t interval = static_cast<size_t>(options_.prefix_cache->interval());
      n = std::min(n, interval - s.fed % interval);
    }
    prefill_runs_.push_back({i, std::span<const int32_t>(s.feed).subspan(s.fed, n)});
    prefill_entries_.entries.push_back({i, s.generation, SampleUse::kKeep});
    budget -= n;
    total += n;
  }
  if (prefill_runs_.empty()) return;
  prefill_sampled_.resize(prefill_runs_.size());  // within the capacity reserved at construction
  const Clock::time_point start = Clock::now();
  try {
    engine_.prefill(prefill_runs_, prefill_sampled_);
  } catch (const std::exception& e) {
    fail_step(prefill_entries_, e);
    return;
  }
  const Clock::time_point now = Clock::now();
  if (metrics_) metrics_->observe_prefill(total, seconds_between(start, now));
  for (size_t k = 0; k < prefill_runs_.size(); ++k) {
    const int i = prefill_runs_[k].slot;
    Slot& s = slots_[i];
    s.fed += prefill_runs_[k].tokens.size();
    s.state_tokens += prefill_runs_[k].tokens.size();
    s.turn_prompt_tokens += static_cast<uint32_t>(prefill_runs_[k].tokens.size());
    if (s.cacheable && (s.fed % static_cast<size_t>(options_.prefix_cache->interval()) == 0 ||
                        (s.fed == s.feed.size() && s.reply_requested)))
      prefix_saves_.emplace_back(i, s.fed);
    s.has_sample = true;
    s.last_sample = prefill_sampled_[k];
    if (s.fed < s.feed.size()) continue;  // the rest in the next iterations
    if (s.reply_requested) {
      // The input's last token was read: its sample is the reply's first token, and the
      // reply goes on in this iteration's step.
      s.phase = Phase::kReplying;
      ++s.scheduled;
      emit(i, s.last_sample, now);
      if (s.seq && s.phase == Phase::kReplying) schedule(i, step, now);
    } else {
      become_idle(s, now);
      s.seq->mark_input_changed();  // what arrived meanwhile (or the input's close) is seen next
    }
  }
}

std::string Scheduler::engine_unusable_message() const {
  return "the engine can run no more steps after a device error (" + engine_failure_ +
         "); the server must be restarted";
}

void Scheduler::run() {
  for (;;) {
    Clock::time_point now = Clock::now();
    {
      std::lock_guard lock(mu_);
      if (stop_) break;
      draining_ = !accepting_;
    }
    if (!swapped_.empty()) service_swapped(now);
    admit_waiting(now);

    // Token boundary: cancellations, deadlines and new input take effect here.
    SubmittedStep& step = steps_[newest_];
    Clock::time_point next_idle_deadline = Clock::time_point::max();
    bool loading = false;  // a swapped-in state still on its way into its slot
    for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
      if (!slots_[i].seq) continue;
      if (!loaded(i)) {
        loading = true;
        continue;
      }
      service_slot(i, now);
      if (!slots_[i].seq) continue;
      next_idle_deadline = std::min(next_idle_deadline, idle_deadline(slots_[i]));
      schedule(i, step, now);
    }
    if (options_.session_swap_after > Clock::duration::zero()) {
      swap_out_idle_sessions(now);
      next_idle_deadline = std::min(next_idle_deadline, next_swap_due());
    }
    SubmittedStep& older = steps_[1 - newest_];
    bool prefilled = false;
    if (prefill_chunk_ > 0 &&
        std::any_of(slots_.begin(), slots_.end(), [&](const Slot& s) { return wants_prefill(s); })) {
      // prefill() runs with no step queued: the queued step's samples first (this step,
      // built already, is the one after it), then the chunk, then this step.
      if (queued_) {
        collect(older, step.size() > 0 ? &step : nullptr);
        queued_ = false;
      }
      prefill(step);
      prefilled = true;
      if (!prefix_saves_.empty()) keep_prefix_states();  // before this step moves the states on
    }
    const bool submitted = step.size() > 0;
    if (submitted) submit(step);
    if (!prefix_saves_.empty()) keep_prefix_states();
    const bool collected = queued_ || prefilled;
    if (queued_) {
      collect(older, submitted ? &step : nullptr);
      queued_ = false;
    }
    if (step.size() > 0) {  // submitted (a failed submit left it empty)
      if (options_.pipelined) {
        queued_ = true;
        newest_ = 1 - newest_;
      } else {
        collect(step, nullptr);
      }
    }

    flusher_.wake_all(&wake_list_);
    if (submitted || collected) continue;  // slots whose sample just came back may go on
    if (loading) {  // the copy takes well under a millisecond: look again soon
      std::this_thread::yield();
      continue;
    }
    if (metrics_) metrics_->set_batch_size(0);
    std::unique_lock lock(mu_);
    // A slot freed in this pass may already serve a waiting request; an idle session's
    // time may run out while nothing else happens.
    // A swapped-out session whose input came may take a slot a swap-out just freed.
    const bool swap_in_waits =
        !free_slots_.empty() && std::any_of(swapped_.begin(), swapped_.end(), [](const SwappedSession& w) { return w.wants_in; });
    const auto woken = [&] {
      return wake_ || stop_ || swap_in_waits || (!waiting_.empty() && !free_slots_.empty());
    };
    if (next_idle_deadline == Clock::time_point::max()) {
      cv_.wait(lock, woken);
    } else {
      cv_.wait_until(lock, next_idle_deadline, woken);
    }
  }
  // Stopping: every sequence has left, so a step still queued is collected only to leave
  // the engine with none (its samples are dropped).
  if (queued_) {
    collect(steps_[1 - newest_], nullptr);
    queued_ = false;
  }
}

}  // namespace m3
