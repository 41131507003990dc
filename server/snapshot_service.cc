#include "server/snapshot_service.h"

#include "server/request_validation.h"

namespace m3 {
namespace {

SnapshotService::Result store_failure(const SnapshotStoreError& e) {
  return {e.kind() == SnapshotStoreError::Kind::kResourceExhausted ? StreamStatus::kResourceExhausted
                                                                   : StreamStatus::kUnavailable,
          e.what()};
}

}  // namespace

SnapshotService::SnapshotService(std::unique_ptr<SnapshotStore> store, ModelFingerprint fingerprint,
                                 std::string unsupported)
    : store_(std::move(store)), fingerprint_(std::move(fingerprint)), unsupported_(std::move(unsupported)) {
  worker_ = std::thread([this] { run(); });
}

SnapshotService::~SnapshotService() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void SnapshotService::post(std::function<void()> work) {
  {
    std::lock_guard lock(mu_);
    work_.push_back(std::move(work));
  }
  cv_.notify_one();
}

void SnapshotService::run() {
  for (;;) {
    std::function<void()> work;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !work_.empty(); });
      if (work_.empty()) return;
      work = std::move(work_.front());
      work_.pop_front();
    }
    work();
  }
}

SnapshotService::Result SnapshotService::fetch(const std::string& id, std::optional<std::vector<std::byte>>* bytes) {
  if (!unsupported_.empty()) return {StreamStatus::kUnimplemented, "snapshots are not available: " + unsupported_};
  if (id.empty()) return {StreamStatus::kInvalidArgument, "snapshot_id is empty"};
  if (auto e = check_request_id(id, "snapshot_id"); !e.empty()) return {StreamStatus::kInvalidArgument, e};
  try {
    *bytes = store_->get(id);
  } catch (const SnapshotStoreError& e) {
    return store_failure(e);
  }
  if (!*bytes) {
    return {StreamStatus::kNotFound, "snapshot " + id + " not found in the snapshot store " + store_->describe() +
                                         " (never stored, deleted, expired or evicted)"};
  }
  return {};
}

SnapshotService::Result SnapshotService::load(const std::string& id, std::shared_ptr<const SequenceState>* state) {
  std::optional<std::vector<std::byte>> bytes;
  if (Result r = fetch(id, &bytes); !r.ok()) return r;
  try {
    const SnapshotView view = decode_snapshot(*bytes, fingerprint_);
    auto s = std::make_shared<SequenceState>();
    s->bytes.assign(view.payload.begin(), view.payload.end());
    s->tokens = view.tokens;
    *state = std::move(s);
  } catch (const SnapshotError& e) {
    return {e.kind() == SnapshotError::Kind::kCorrupt ? StreamStatus::kDataLoss : StreamStatus::kFailedPrecondition,
            "snapshot " + id + ": " + e.what()};
  }
  return {};
}

SnapshotService::Result SnapshotService::store(const SequenceState& state, Info* info) {
  if (!unsupported_.empty()) return {StreamStatus::kUnimplemented, "snapshots are not available: " + unsupported_};
  if (!state.error.empty()) return {StreamStatus::kInternal, "the engine could not save the state: " + state.error};
  std::vector<std::byte> bytes = encode_snapshot(fingerprint_, state.tokens, state.bytes);
  info->id = SnapshotStore::new_id();
  info->tokens = state.tokens;
  info->bytes = bytes.size();
  try {
    store_->put(info->id, std::move(bytes));
  } catch (const SnapshotStoreError& e) {
    return store_failure(e);
  }
  return {};
}

SnapshotService::Result SnapshotService::info(const std::string& id, Info* info) {
  std::optional<std::vector<std::byte>> bytes;
  if (Result r = fetch(id, &bytes); !r.ok()) return r;
  try {
    const SnapshotHeader h = read_snapshot_header(*bytes);
    info->id = id;
    info->tokens = h.tokens;
    info->bytes = bytes->size();
  } catch (const SnapshotError& e) {
    return {e.kind() == SnapshotError::Kind::kCorrupt ? StreamStatus::kDataLoss : StreamStatus::kFailedPrecondition,
            "snapshot " + id + ": " + e.what()};
  }
  return {};
}

SnapshotService::Result SnapshotService::remove(const std::string& id, Info* info) {
  if (!unsupported_.empty()) return {StreamStatus::kUnimplemented, "snapshots are not available: " + unsupported_};
  if (auto e = check_request_id(id, "snapshot_id"); !e.empty() || id.empty())
    return {StreamStatus::kInvalidArgument, id.empty() ? "snapshot_id is empty" : e};
  try {
    if (!store_->remove(id)) {
      return {StreamStatus::kNotFound, "snapshot " + id + " not found in the snapshot store " + store_->describe()};
    }
  } catch (const SnapshotStoreError& e) {
    return store_failure(e);
  }
  info->id = id;
  return {};
}

}  // namespace m3
