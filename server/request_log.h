// The server's log: one info line per finished request (never per token) and warnings
// that are rate-limited per kind, so a misbehaving client cannot flood the log.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "server/sequence.h"

namespace spdlog {
class logger;
}

namespace m3 {

struct RequestRecord {
  std::string_view method;  // "Generate", "Converse"
  std::string_view request_id;
  StreamStatus status = StreamStatus::kOk;
  std::string_view message;  // the error message, if any
  SequenceSummary summary;
  uint64_t tokens_sent = 0;  // written to the stream: summary's generated tokens less those dropped
  double duration_ms = 0;
  std::string_view peer;     // the client's address ("ipv4:10.0.0.7:51234"); "" if unknown
};

class RequestLog {
 public:
  // At most `burst` warnings of one kind per `window`; the next one after that says
  // how many were suppressed.
  explicit RequestLog(std::shared_ptr<spdlog::logger> logger, int burst = 5,
                      std::chrono::seconds window = std::chrono::seconds(10));

  void request_done(const RequestRecord& record);
  void warn(std::string_view kind, std::string_view message);

  spdlog::logger& logger() { return *logger_; }
  const std::shared_ptr<spdlog::logger>& logger_ptr() const { return logger_; }

 private:
  struct WarnWindow {
    std::chrono::steady_clock::time_point start;
    int emitted = 0;
    uint64_t suppressed = 0;
  };
  std::shared_ptr<spdlog::logger> logger_;
  const int burst_;
  const std::chrono::seconds window_;
  std::mutex mu_;
  std::map<std::string, WarnWindow, std::less<>> windows_;
};

}  // namespace m3
