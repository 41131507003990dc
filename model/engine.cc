// The engine interface's default pipelined stepping: the step runs inside submit_step()
// and its samples wait in a small ring until collect_step().
#include "model/engine.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace m3 {

int Engine::queue_position_for_submit() const {
  if (queued_count_ == kMaxQueuedSteps) {
    throw std::logic_error("submit_step: " + std::to_string(kMaxQueuedSteps) +
                           " steps are queued already; collect_step() one first");
  }
  return (queued_head_ + queued_count_) % kMaxQueuedSteps;
}

void Engine::queue_push(size_t slots) {
  queued_slots_[queue_position_for_submit()] = slots;
  ++queued_count_;
}

int Engine::queue_position_for_collect(std::span<int32_t> sampled) const {
  if (queued_count_ == 0) throw std::logic_error("collect_step: no step is queued");
  const size_t slots = queued_slots_[queued_head_];
  if (sampled.size() != slots) {
    throw std::invalid_argument("collect_step: the step has " + std::to_string(slots) + " slots but " +
                                std::to_string(sampled.size()) + " sampled entries");
  }
  return queued_head_;
}

void Engine::queue_pop() {
  queued_head_ = (queued_head_ + 1) % kMaxQueuedSteps;
  --queued_count_;
}

void Engine::submit_step(std::span<const int32_t> slots, std::span<const int32_t> tokens) {
  std::vector<int32_t>& samples = queued_samples_[queue_position_for_submit()];
  samples.resize(slots.size());  // grows to the largest batch once, then never allocates
  step(slots, tokens, samples);
  if (!slots.empty()) queue_push(slots.size());
}

void Engine::collect_step(std::span<int32_t> sampled) {
  const std::vector<int32_t>& samples = queued_samples_[queue_position_for_collect(sampled)];
  std::copy(samples.begin(), samples.end(), sampled.begin());
  queue_pop();
}

size_t Engine::validate_prefill(std::span<const PrefillRun> runs, std::span<int32_t> sampled,
                                std::span<float> logits) {
  if (queued_count_ > 0) {
    throw std::logic_error("prefill: " + std::to_string(queued_count_) +
                           " steps are queued; collect_step() them first");
  }
  if (sampled.size() != runs.size()) {
    throw std::invalid_argument("prefill: sampled has " + std::to_string(sampled.size()) +
                                " entries, runs has " + std::to_string(runs.size()));
  }
  const size_t V = static_cast<size_t>(config().padded_vocab());
  if (!logits.empty() && logits.size() != runs.size() * V) {
    throw std::invalid_argument("prefill: logits has " + std::to_string(logits.size()) +
                                " floats, need " + std::to_string(runs.size()) + " x padded vocab " +
                                std::to_string(V) + " (or empty)");
  }
  prefill_seen_.assign(static_cast<size_t>(max_slots()), 0);  // allocates once
  const int32_t vocab = config().vocab_size;
  size_t total = 0;
  for (const PrefillRun& run : runs) {
    const auto where = [&] { return "prefill: slot " + std::to_string(run.slot); };  // built on errors only
    if (run.slot < 0 || run.slot >= max_slots()) {
      throw std::invalid_argument(where() + " out of range [0, " + std::to_string(max_slots()) + ")");
    }
    if (prefill_seen_[static_cast<size_t>(run.slot)]) throw std::invalid_argument(where() + " listed twice");
    prefill_seen_[static_cast<size_t>(run.slot)] = 1;
    if (run.tokens.empty()) throw std::invalid_argument(where() + ": no tokens (a run needs at least one)");
    for (size_t t = 0; t < run.tokens.size(); ++t) {
      const int32_t token = run.tokens[t];
      if (token < 0 || token >= vocab) {
        throw std::invalid_argument(where() + ": token " + std::to_string(token) + " at position " +
                                    std::to_string(t) + " outside [0, " + std::to_string(vocab) +
                                    ")" + (token == kContinueToken ? " (kContinueToken is for step())" : ""));
      }
    }
    total += run.tokens.size();
  }
  if (total > static_cast<size_t>(max_prefill_tokens())) {
    throw std::invalid_argument("prefill: " + std::to_string(total) + " tokens in one call, at most " +
                                std::to_string(max_prefill_tokens()) +
                                " (EngineOptions::max_prefill_tokens)");
  }
  return total;
}

void Engine::prefill(std::span<const PrefillRun> runs, std::span<int32_t> sampled,
                     std::span<float> logits) {
  validate_prefill(runs, sampled, logits);
  size_t longest = 0;
  for (const PrefillRun& run : runs) longest = std::max(longest, run.tokens.size());
  const size_t V = static_cast<size_t>(config().padded_vocab());
  for (size_t t = 0; t < longest; ++t) {
    prefill_slots_.clear();
    prefill_tokens_.clear();
    bool last_of_some = false;
    for (const PrefillRun& run : runs) {
      if (t >= run.tokens.size()) continue;
      prefill_slots_.push_back(run.slot);
      prefill_tokens_.push_back(run.tokens[t]);
      last_of_some |= t + 1 == run.tokens.size();
    }
    prefill_samples_.resize(prefill_slots_.size());
    const bool want_logits = last_of_some && !logits.empty();
    if (want_logits) prefill_logits_.resize(prefill_slots_.size() * V);
    step(prefill_slots_, prefill_tokens_, prefill_samples_,
         want_logits ? std::span<float>(prefill_logits_) : std::span<float>());
    size_t k = 0;  // position of runs[i] in this step
    for (size_t i = 0; i < runs.size(); ++i) {
      if (t >= runs[i].tokens.size()) continue;
      if (t + 1 == runs[i].tokens.size()) {
        sampled[i] = prefill_samples_[k];
        if (want_logits) std::memcpy(&logits[i * V], &prefill_logits_[k * V], sizeof(float) * V);
      }
      ++k;
    }
  }
}

}  // namespace m3
