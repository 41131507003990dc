#include "server/library_logs.h"

#include <google/protobuf/stubs/logging.h>
#include <grpc/support/log.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <mutex>
#include <string>

#include "server/request_log.h"

namespace m3 {
namespace {

// The handlers are installed once for the process (protobuf's SetLogHandler is not safe
// against a concurrent log line, so it is never called again); a route only changes where
// they write.
std::mutex route_mu;
RequestLog* route_log = nullptr;  // under route_mu
std::once_flag handlers_installed;

void write_line(const char* library, bool error, const char* file, int line, const std::string& message) {
  std::lock_guard lock(route_mu);
  if (route_log == nullptr) {
    std::fprintf(stderr, "%s %s %s:%d] %s\n", library, error ? "error" : "info", file, line, message.c_str());
    return;
  }
  if (error) {
    route_log->warn(library, std::string(library) + ": " + message);
  } else {
    route_log->logger().info("{}: {}", library, message);
  }
}

void protobuf_line(google::protobuf::LogLevel level, const char* file, int line, const std::string& message) {
  write_line("protobuf", level != google::protobuf::LOGLEVEL_INFO, file, line, message);
}

void grpc_line(gpr_log_func_args* args) {
  write_line("grpc", args->severity == GPR_LOG_SEVERITY_ERROR, args->file, args->line,
             args->message != nullptr ? args->message : "");
}

}  // namespace

LibraryLogRoute::LibraryLogRoute(RequestLog& log) : log_(&log) {
  std::call_once(handlers_installed, [] {
    google::protobuf::SetLogHandler(&protobuf_line);
    gpr_set_log_function(&grpc_line);
  });
  std::lock_guard lock(route_mu);
  route_log = log_;
}

LibraryLogRoute::~LibraryLogRoute() {
  std::lock_guard lock(route_mu);
  if (route_log == log_) route_log = nullptr;
}

}  // namespace m3
