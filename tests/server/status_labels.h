// The label m3serve_requests_total{status=...} carries for a call that ended with `code`,
// as a client sees the code (the statuses these tests can meet).
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

namespace m3::test {

inline std::string status_label(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "ok";
    case grpc::StatusCode::CANCELLED: return "cancelled";
    case grpc::StatusCode::INVALID_ARGUMENT: return "invalid_argument";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "resource_exhausted";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "deadline_exceeded";
    case grpc::StatusCode::INTERNAL: return "internal";
    case grpc::StatusCode::UNAVAILABLE: return "unavailable";
    case grpc::StatusCode::UNAUTHENTICATED: return "unauthenticated";
    default: return "unknown";
  }
}

}  // namespace m3::test
