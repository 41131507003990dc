// Protobuf's and gRPC's own log lines go to stderr in their formats, one per event, and
// some events are a client's doing: each request whose text is not UTF-8 made protobuf
// write a line ("String field ... contains invalid UTF-8 data"), so a client could flood
// the log. While a LibraryLogRoute lives they go into the server's log instead, as
// warnings rate-limited per library like the server's own (RequestLog::warn); gRPC's
// debug and info lines (only written when GRPC_VERBOSITY asks for them) as info lines;
// the lines before an abort (protobuf's FATAL, gRPC's failed assertions) as critical
// lines, never rate-limited, and flushed.
#pragma once

namespace m3 {

class RequestLog;

class LibraryLogRoute {
 public:
  // Routes both libraries' lines into `log` until destroyed (then they go to stderr again,
  // in a format of our own). With several routes alive, the newest one's log gets them.
  explicit LibraryLogRoute(RequestLog& log);
  ~LibraryLogRoute();
  LibraryLogRoute(const LibraryLogRoute&) = delete;
  LibraryLogRoute& operator=(const LibraryLogRoute&) = delete;

 private:
  RequestLog* log_;
};

}  // namespace m3
