// The engine interface's default pipelined stepping: the step runs inside submit_step()
// and its samples wait in a small ring until collect_step().
#include "model/engine.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace m3 {

void Engine::submit_step(std::span<const int32_t> slots, std::span<const int32_t> tokens) {
  if (queued_count_ == kMaxQueuedSteps) {
    throw std::logic_error("submit_step: " + std::to_string(kMaxQueuedSteps) +
                           " steps are queued already; collect_step() one first");
  }
  std::vector<int32_t>& samples = queued_samples_[(queued_head_ + queued_count_) % kMaxQueuedSteps];
  samples.resize(slots.size());  // grows to the largest batch once, then never allocates
  step(slots, tokens, samples);
  if (!slots.empty()) ++queued_count_;
}

void Engine::collect_step(std::span<int32_t> sampled) {
  if (queued_count_ == 0) throw std::logic_error("collect_step: no step is queued");
  const std::vector<int32_t>& samples = queued_samples_[queued_head_];
  if (sampled.size() != samples.size()) {
    throw std::invalid_argument("collect_step: the step has " + std::to_string(samples.size()) +
                                " slots but " + std::to_string(sampled.size()) + " sampled entries");
  }
  std::copy(samples.begin(), samples.end(), sampled.begin());
  queued_head_ = (queued_head_ + 1) % kMaxQueuedSteps;
  --queued_count_;
}

}  // namespace m3
