#include "server/snapshot_metrics.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

namespace m3 {
namespace {
prometheus::Counter* counter(prometheus::Registry& r, const char* name, const char* help) {
  return &prometheus::BuildCounter().Name(name).Help(help).Register(r).Add({});
}
prometheus::Gauge* gauge(prometheus::Registry& r, const char* name, const char* help) {
  return &prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
}
}  // namespace

SnapshotMetrics::SnapshotMetrics(prometheus::Registry& r)
    : stored_(gauge(r, "m3serve_snapshots_stored", "Snapshots this server's store holds (as it counts them)")),
      bytes_(gauge(r, "m3serve_snapshot_bytes", "Bytes of the snapshots this server's store holds")),
      hits_(counter(r, "m3serve_snapshot_hits_total", "Snapshot reads that found their snapshot")),
      misses_(counter(r, "m3serve_snapshot_misses_total", "Snapshot reads of an unknown or expired id")),
      evictions_(counter(r, "m3serve_snapshot_evictions_total",
                         "Snapshots dropped to keep the store within snapshot_capacity_bytes")),
      errors_(counter(r, "m3serve_snapshot_store_errors_total",
                      "Store calls that failed (unreachable, I/O error, over capacity)")) {}

void SnapshotMetrics::set_stored(size_t snapshots, uint64_t bytes) {
  stored_->Set(static_cast<double>(snapshots));
  bytes_->Set(static_cast<double>(bytes));
}
void SnapshotMetrics::count_hit() { hits_->Increment(); }
void SnapshotMetrics::count_miss() { misses_->Increment(); }
void SnapshotMetrics::count_eviction() { evictions_->Increment(); }
void SnapshotMetrics::count_error() { errors_->Increment(); }

}  // namespace m3
