// Where snapshots live (`snapshot_store`): "memory" (this process), "dir:PATH" (one file a
// snapshot, written to a temporary file, fsynced and renamed, so a crash never leaves half
// a snapshot; survives a restart) or "redis://HOST:PORT" (shared by replicas). Over any of
// them SnapshotStore keeps the bytes within `snapshot_capacity_bytes` (least recently used
// out first), drops snapshots older than `snapshot_ttl_s`, and counts what it does.
//
// Thread-safe; called from gRPC's threads and the snapshot worker, never from the engine
// thread (a disk or a network can stall).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace m3 {

class SnapshotMetrics;

// A store that cannot do what was asked: unreachable (UNAVAILABLE) or full
// (RESOURCE_EXHAUSTED). The message says which store and why.
class SnapshotStoreError : public std::runtime_error {
 public:
  enum class Kind { kUnavailable, kResourceExhausted };
  SnapshotStoreError(Kind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

// The bytes' medium. Each call throws SnapshotStoreError(kUnavailable) when the medium fails.
class SnapshotBackend {
 public:
  virtual ~SnapshotBackend() = default;
  virtual std::string describe() const = 0;  // "memory", "dir:/var/lib/m3", "redis://h:p"
  // ttl zero: no expiry of its own.
  virtual void put(const std::string& id, std::span<const std::byte> bytes, std::chrono::milliseconds ttl) = 0;
  virtual std::optional<std::vector<std::byte>> get(const std::string& id) = 0;
  virtual bool remove(const std::string& id) = 0;
  // What the medium holds already (a directory after a restart): id, bytes, age; oldest first.
  struct Entry {
    std::string id;
    uint64_t bytes = 0;
  };
  virtual std::vector<Entry> existing() { return {}; }
};

std::unique_ptr<SnapshotBackend> make_memory_snapshot_backend();
// Creates the directory if needed; throws std::runtime_error when it cannot.
std::unique_ptr<SnapshotBackend> make_dir_snapshot_backend(const std::string& path);
// Connects lazily: an unreachable server is an UNAVAILABLE per call, not a failed start.
std::unique_ptr<SnapshotBackend> make_redis_snapshot_backend(const std::string& host, int port);

// Checks a `snapshot_store` value: empty string when it is valid, else why not.
std::string snapshot_store_spec_error(const std::string& spec);
std::unique_ptr<SnapshotBackend> make_snapshot_backend(const std::string& spec);

class SnapshotStore {
 public:
  // capacity_bytes 0: no limit; ttl zero: none. metrics may be null.
  SnapshotStore(std::unique_ptr<SnapshotBackend> backend, uint64_t capacity_bytes, std::chrono::milliseconds ttl,
                SnapshotMetrics* metrics);

  const std::string& describe() const { return describe_; }
  bool persistent() const { return persistent_; }
  // A new id: "snap-" and 32 random hex digits.
  static std::string new_id();

  // Stores, evicting the least recently used snapshots to make room. Throws
  // SnapshotStoreError: kResourceExhausted when the snapshot alone is over the capacity,
  // kUnavailable when the medium fails.
  void put(const std::string& id, std::vector<std::byte> bytes);
  // nullopt: no such snapshot (or expired). Throws SnapshotStoreError(kUnavailable).
  std::optional<std::vector<std::byte>> get(const std::string& id);
  // false: there was none. Throws SnapshotStoreError(kUnavailable).
  bool remove(const std::string& id);

  uint64_t bytes() const;
  size_t count() const;

 private:
  struct Entry {
    uint64_t bytes;
    std::chrono::steady_clock::time_point stored;
    std::list<std::string>::iterator lru;  // position in lru_ (front: most recent)
  };
  void forget_locked(const std::string& id);
  void publish_locked();
  bool expired_locked(const Entry& e, std::chrono::steady_clock::time_point now) const;

  std::unique_ptr<SnapshotBackend> backend_;
  const std::string describe_;
  const bool persistent_;
  const uint64_t capacity_;
  const std::chrono::milliseconds ttl_;
  SnapshotMetrics* metrics_;

  mutable std::mutex mu_;  // the index; the backend's own calls run outside it
  std::unordered_map<std::string, Entry> index_;
  std::list<std::string> lru_;
  uint64_t bytes_ = 0;
};

}  // namespace m3
