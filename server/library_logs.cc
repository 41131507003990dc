#include "server/library_logs.h"

#include <google/protobuf/stubs/logging.h>
#include <grpc/support/log.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "server/request_log.h"

namespace m3 {
namespace {

// The handlers are installed once for the process (protobuf's SetLogHandler is not safe
// against a concurrent log line, so it is never called again); a route only changes where
// they write.
std::mutex route_mu;
// Under route_mu: the live routes' logs, newest last; lines go to the newest.
std::vector<RequestLog*> route_logs;
std::once_flag handlers_installed;

enum class Severity { kInfo, kError, kFatal };

void write_line(const char* library, Severity severity, const char* file, int line, const std::string& message) {
  std::lock_guard lock(route_mu);
  RequestLog* const route_log = route_logs.empty() ? nullptr : route_logs.back();
  if (route_log == nullptr) {
    static constexpr const char* kNames[] = {"info", "error", "fatal"};
    std::fprintf(stderr, "%s %s %s:%d] %s\n", library, kNames[static_cast<int>(severity)], file, line,
                 message.c_str());
    return;
  }
  switch (severity) {
    case Severity::kInfo:
      route_log->logger().info("{}: {}", library, message);
      break;
    case Severity::kError:
      route_log->warn(library, std::string(library) + ": " + message);
      break;
    case Severity::kFatal:  // the process aborts next: never rate-limited, never left in a buffer
      route_log->logger().critical("{}: {} ({}:{})", library, message, file, line);
      route_log->logger().flush();
      break;
  }
}

void protobuf_line(google::protobuf::LogLevel level, const char* file, int line, const std::string& message) {
  const Severity severity = level == google::protobuf::LOGLEVEL_FATAL ? Severity::kFatal
                            : level == google::protobuf::LOGLEVEL_INFO ? Severity::kInfo
                                                                        : Severity::kError;
  write_line("protobuf", severity, file, line, message);
}

void grpc_line(gpr_log_func_args* args) {
  const std::string message = args->message != nullptr ? args->message : "";
  // GPR_ASSERT logs "assertion failed: ..." at ERROR, then aborts.
  const Severity severity = args->severity != GPR_LOG_SEVERITY_ERROR  ? Severity::kInfo
                            : message.rfind("assertion failed", 0) == 0 ? Severity::kFatal
                                                                       : Severity::kError;
  write_line("grpc", severity, args->file, args->line, message);
}

}  // namespace

LibraryLogRoute::LibraryLogRoute(RequestLog& log) : log_(&log) {
  std::call_once(handlers_installed, [] {
    google::protobuf::SetLogHandler(&protobuf_line);
    gpr_set_log_function(&grpc_line);
  });
  std::lock_guard lock(route_mu);
  route_logs.push_back(log_);
}

LibraryLogRoute::~LibraryLogRoute() {
  std::lock_guard lock(route_mu);
  route_logs.erase(std::find(route_logs.begin(), route_logs.end(), log_));
}

}  // namespace m3
