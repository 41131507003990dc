// Converse sessions as the scheduler keeps them (session_swap_after_s): how many are open,
// how many wait between turns off the engine's slots, and how long a swap-in takes.
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
  // A swap-in: from the session's input arriving (or the slot being free, when later) to
  // its state being in a slot again.
  void observe_swap_in(double seconds);

 private:
  prometheus::Gauge* open_;
  prometheus::Gauge* swapped_out_;
  prometheus::Counter* swap_ins_;
  prometheus::Histogram* swap_in_seconds_;
};

}  // namespace m3
