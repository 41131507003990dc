// The engine interface's default pipelined stepping: the step runs inside submit_step()
// and its samples wait in a small ring until collect_step().
#include "model/engine.h"

#include <algorithm>
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

}  // namespace m3
