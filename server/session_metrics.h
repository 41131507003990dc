// Converse sessions as the scheduler keeps them (session_swap_after_s): how many are open,
// how many wait between turns off the engine's slots, the host memory their states take,
// and how long a swap-in takes.
#pragma once

#include <cstddef>

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace m3 {

class SessionMetrics {
 public:
  explicit SessionMetrics(prometheus::Registry& registry);
  void set_open(size_t sessions);
  void set_swapped_out(size_t sessions);
  // Host buffers the scheduler keeps for swapped states (page-locked on the CUDA engine),
  // in use or spare for the next swap-out, and their bytes.
  void set_state_buffers(size_t buffers, size_t bytes);
  // A swap-in: from the session's input arriving (or the slot being free, when later) to
  // its state being in a slot again.
  void observe_swap_in(double seconds);

 private:
  prometheus::Gauge* open_;
  prometheus::Gauge* swapped_out_;
  prometheus::Gauge* state_buffers_;
  prometheus::Gauge* state_buffer_bytes_;
  prometheus::Counter* swap_ins_;
  prometheus::Histogram* swap_in_seconds_;
};

}  // namespace m3
