// Snapshots for the request handlers: reading a stored snapshot into the state a sequence
// starts from, and storing the state a sequence saved, with the status and message each
// failure maps to (NOT_FOUND, FAILED_PRECONDITION, DATA_LOSS, UNAVAILABLE,
// RESOURCE_EXHAUSTED, UNIMPLEMENTED). Store calls block (a disk, a network): they run on
// gRPC's threads or on this service's worker, never on the engine thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "model/snapshot_format.h"
#include "server/sequence.h"
#include "server/snapshot_store.h"

namespace m3 {

class SnapshotService {
 public:
  // `unsupported`: why this engine cannot copy its state ("" when it can); then every
  // call is refused with UNIMPLEMENTED saying so.
  SnapshotService(std::unique_ptr<SnapshotStore> store, ModelFingerprint fingerprint, std::string unsupported);
  ~SnapshotService();  // runs what was posted, then joins the worker
  SnapshotService(const SnapshotService&) = delete;
  SnapshotService& operator=(const SnapshotService&) = delete;

  struct Result {
    StreamStatus status = StreamStatus::kOk;
    std::string message;
    bool ok() const { return status == StreamStatus::kOk; }
  };
  struct Info {
    std::string id;
    uint64_t tokens = 0;
    uint64_t bytes = 0;
  };

  // The state stored under `id`, checked against this server's model and engine.
  Result load(const std::string& id, std::shared_ptr<const SequenceState>* state);
  // Stores a saved state under a new id.
  Result store(const SequenceState& state, Info* info);
  Result info(const std::string& id, Info* info);
  Result remove(const std::string& id, Info* info);

  // Runs `work` on the worker thread (storing a state the engine thread saved).
  void post(std::function<void()> work);

  const ModelFingerprint& fingerprint() const { return fingerprint_; }
  // Snapshots outlive this process (dir:, redis://) and the engine can make them.
  bool persistent() const { return unsupported_.empty() && store_->persistent(); }
  SnapshotStore& snapshot_store() { return *store_; }

 private:
  Result fetch(const std::string& id, std::optional<std::vector<std::byte>>* bytes);
  void run();

  std::unique_ptr<SnapshotStore> store_;
  const ModelFingerprint fingerprint_;
  const std::string unsupported_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> work_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace m3
