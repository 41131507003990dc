#include "server/stream_flusher.h"

namespace m3 {

StreamFlusher::StreamFlusher(size_t expected_streams) {
  queued_.reserve(expected_streams);
  thread_ = std::thread([this] { run(); });
}

StreamFlusher::~StreamFlusher() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void StreamFlusher::wake(std::shared_ptr<Sequence> sequence) {
  {
    std::lock_guard lock(mu_);
    queued_.push_back(std::move(sequence));
  }
  cv_.notify_one();
}

void StreamFlusher::wake_all(std::vector<std::shared_ptr<Sequence>>* sequences) {
  if (sequences->empty()) return;
  {
    std::lock_guard lock(mu_);
    for (auto& s : *sequences) queued_.push_back(std::move(s));
  }
  sequences->clear();
  cv_.notify_one();
}

void StreamFlusher::run() {
  std::vector<std::shared_ptr<Sequence>> batch;
  batch.reserve(queued_.capacity());
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queued_.empty(); });
    if (queued_.empty() && stop_) return;
    batch.swap(queued_);
    lock.unlock();
    for (auto& s : batch) s->writer()->flush();
    batch.clear();  // drops the references outside the lock
    lock.lock();
  }
}

}  // namespace m3
