// The snapshot store's Prometheus series, registered beside the server's own.
#pragma once

#include <cstddef>
#include <cstdint>

namespace prometheus {
class Counter;
class Gauge;
class Registry;
}  // namespace prometheus

namespace m3 {

class SnapshotMetrics {
 public:
  explicit SnapshotMetrics(prometheus::Registry& registry);
  void set_stored(size_t snapshots, uint64_t bytes);
  void count_hit();
  void count_miss();
  void count_eviction();
  void count_error();

 private:
  prometheus::Gauge* stored_;
  prometheus::Gauge* bytes_;
  prometheus::Counter* hits_;
  prometheus::Counter* misses_;
  prometheus::Counter* evictions_;
  prometheus::Counter* errors_;
};

}  // namespace m3
