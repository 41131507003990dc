#include "server/snapshot_store.h"

#include <cstdio>
#include <random>

#include "server/snapshot_metrics.h"

namespace m3 {
namespace {

class MemoryBackend final : public SnapshotBackend {
 public:
  std::string describe() const override { return "memory"; }
  void put(const std::string& id, std::span<const std::byte> bytes, std::chrono::milliseconds) override {
    std::lock_guard lock(mu_);
    map_[id].assign(bytes.begin(), bytes.end());
  }
  std::optional<std::vector<std::byte>> get(const std::string& id) override {
    std::lock_guard lock(mu_);
    const auto it = map_.find(id);
    if (it == map_.end()) return std::nullopt;
    return it->second;
  }
  bool remove(const std::string& id) override {
    std::lock_guard lock(mu_);
    return map_.erase(id) > 0;
  }

 private:
  std::mutex mu_;
  std::unordered_map<std::string, std::vector<std::byte>> map_;
};

bool parse_port(const std::string& s, int* port) {
  if (s.empty() || s.size() > 5) return false;
  int v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  if (v < 1 || v > 65535) return false;
  *port = v;
  return true;
}

// "redis://HOST:PORT" -> host, port; false when it is not of that form.
bool parse_redis(const std::string& spec, std::string* host, int* port) {
  const std::string prefix = "redis://";
  if (spec.rfind(prefix, 0) != 0) return false;
  const std::string rest = spec.substr(prefix.size());
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  *host = rest.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  return parse_port(rest.substr(colon + 1), port);
}

}  // namespace

std::unique_ptr<SnapshotBackend> make_memory_snapshot_backend() { return std::make_unique<MemoryBackend>(); }

std::string snapshot_store_spec_error(const std::string& spec) {
  if (spec == "memory") return "";
  if (spec.rfind("dir:", 0) == 0) return spec.size() > 4 ? "" : "dir: needs a path (dir:/var/lib/m3serve/snapshots)";
  std::string host;
  int port = 0;
  if (spec.rfind("redis://", 0) == 0) {
    return parse_redis(spec, &host, &port) ? "" : "redis:// needs HOST:PORT with a port in 1..65535 (redis://127.0.0.1:6379)";
  }
  return "must be memory, dir:PATH or redis://HOST:PORT";
}

std::unique_ptr<SnapshotBackend> make_snapshot_backend(const std::string& spec) {
  if (const std::string why = snapshot_store_spec_error(spec); !why.empty()) {
    throw std::invalid_argument("snapshot_store '" + spec + "': " + why);
  }
  if (spec == "memory") return make_memory_snapshot_backend();
  if (spec.rfind("dir:", 0) == 0) return make_dir_snapshot_backend(spec.substr(4));
  std::string host;
  int port = 0;
  parse_redis(spec, &host, &port);
  return make_redis_snapshot_backend(host, port);
}

SnapshotStore::SnapshotStore(std::unique_ptr<SnapshotBackend> backend, uint64_t capacity_bytes,
                             std::chrono::milliseconds ttl, SnapshotMetrics* metrics)
    : backend_(std::move(backend)),
      describe_(backend_->describe()),
      persistent_(describe_ != "memory"),
      capacity_(capacity_bytes),
      ttl_(ttl),
      metrics_(metrics) {
  // A directory's snapshots from before a restart count against the capacity, oldest
  // first out; their age is unknown, so their TTL starts now.
  const auto now = std::chrono::steady_clock::now();
  for (const SnapshotBackend::Entry& e : backend_->existing()) {
    lru_.push_front(e.id);
    index_[e.id] = Entry{e.bytes, now, lru_.begin()};
    bytes_ += e.bytes;
  }
  std::lock_guard lock(mu_);
  publish_locked();
}

std::string SnapshotStore::new_id() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char b[40];
  std::snprintf(b, sizeof b, "snap-%016llx%016llx", static_cast<unsigned long long>(rng()),
                static_cast<unsigned long long>(rng()));
  return b;
}

bool SnapshotStore::expired_locked(const Entry& e, std::chrono::steady_clock::time_point now) const {
  return ttl_ > std::chrono::milliseconds::zero() && now - e.stored >= ttl_;
}

void SnapshotStore::forget_locked(const std::string& id) {
  const auto it = index_.find(id);
  if (it == index_.end()) return;
  bytes_ -= it->second.bytes;
  lru_.erase(it->second.lru);
  index_.erase(it);
}

void SnapshotStore::publish_locked() {
  if (metrics_) metrics_->set_stored(index_.size(), bytes_);
}

void SnapshotStore::put(const std::string& id, std::vector<std::byte> bytes) {
  const uint64_t size = bytes.size();
  if (capacity_ > 0 && size > capacity_) {
    if (metrics_) metrics_->count_error();
    throw SnapshotStoreError(SnapshotStoreError::Kind::kResourceExhausted,
                             "snapshot store " + describe_ + " is full: a snapshot of " + std::to_string(size) +
                                 " bytes is over the whole snapshot_capacity_bytes (" + std::to_string(capacity_) +
                                 ")");
  }
  try {
    backend_->put(id, bytes, ttl_);
  } catch (const SnapshotStoreError&) {
    if (metrics_) metrics_->count_error();
    throw;
  }
  std::vector<std::string> evicted;
  {
    std::lock_guard lock(mu_);
    forget_locked(id);
    const auto now = std::chrono::steady_clock::now();
    lru_.push_front(id);
    index_[id] = Entry{size, now, lru_.begin()};
    bytes_ += size;
    while (capacity_ > 0 && bytes_ > capacity_ && lru_.size() > 1) {
      const std::string victim = lru_.back();
      forget_locked(victim);
      evicted.push_back(victim);
    }
    publish_locked();
  }
  for (const std::string& victim : evicted) {
    if (metrics_) metrics_->count_eviction();
    try {
      backend_->remove(victim);
    } catch (const SnapshotStoreError&) {
      if (metrics_) metrics_->count_error();  // its bytes stay; the index no longer counts them
    }
  }
}

std::optional<std::vector<std::byte>> SnapshotStore::get(const std::string& id) {
  bool expired = false;
  {
    std::lock_guard lock(mu_);
    const auto it = index_.find(id);
    if (it != index_.end()) {
      if (expired_locked(it->second, std::chrono::steady_clock::now())) {
        forget_locked(id);
        publish_locked();
        expired = true;
      } else {
        lru_.splice(lru_.begin(), lru_, it->second.lru);
      }
    }
  }
  if (expired) {
    if (metrics_) metrics_->count_miss();
    try {
      backend_->remove(id);
    } catch (const SnapshotStoreError&) {
      if (metrics_) metrics_->count_error();
    }
    return std::nullopt;
  }
  std::optional<std::vector<std::byte>> bytes;
  try {
    bytes = backend_->get(id);  // a shared store may hold what another replica stored
  } catch (const SnapshotStoreError&) {
    if (metrics_) metrics_->count_error();
    throw;
  }
  if (metrics_) bytes ? metrics_->count_hit() : metrics_->count_miss();
  if (!bytes) {
    std::lock_guard lock(mu_);
    forget_locked(id);
    publish_locked();
  }
  return bytes;
}

bool SnapshotStore::remove(const std::string& id) {
  bool removed = false;
  try {
    removed = backend_->remove(id);
  } catch (const SnapshotStoreError&) {
    if (metrics_) metrics_->count_error();
    throw;
  }
  std::lock_guard lock(mu_);
  forget_locked(id);
  publish_locked();
  return removed;
}

uint64_t SnapshotStore::bytes() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

size_t SnapshotStore::count() const {
  std::lock_guard lock(mu_);
  return index_.size();
}

}  // namespace m3
