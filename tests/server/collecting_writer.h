// A StreamWriter for scheduler tests: drains its sequence's outbox as a stream whose writes
// complete at once, keeping the tokens, and the status and message it was closed with.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "server/sequence.h"

namespace m3::testing {

class CollectingWriter final : public StreamWriter {
 public:
  std::shared_ptr<Sequence> seq;
  void flush() override {
    std::vector<int32_t> tokens;
    for (;;) {
      TokenOutbox::Item item = seq->outbox().take(&tokens);
      std::lock_guard lock(mu_);
      if (item.kind == TokenOutbox::Item::kNothing) return;
      if (item.kind == TokenOutbox::Item::kTokens) got_.insert(got_.end(), tokens.begin(), tokens.end());
      if (item.kind == TokenOutbox::Item::kClosed) {
        status_ = item.status;
        message_ = item.message;
        closed_ = true;
        cv_.notify_all();
        return;  // like a reactor after Finish(): the stream may be gone now
      }
    }
  }
  // The status it was closed with (a test failure if that takes over 20 s).
  StreamStatus wait_closed() {
    std::unique_lock lock(mu_);
    EXPECT_TRUE(cv_.wait_for(lock, std::chrono::seconds(20), [&] { return closed_; }));
    return status_;
  }
  std::string message() {
    std::lock_guard lock(mu_);
    return message_;
  }
  size_t count() {
    std::lock_guard lock(mu_);
    return got_.size();
  }
  std::vector<int32_t> got() {
    std::lock_guard lock(mu_);
    return got_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int32_t> got_;
  bool closed_ = false;
  StreamStatus status_ = StreamStatus::kOk;
  std::string message_;
};

}  // namespace m3::testing
