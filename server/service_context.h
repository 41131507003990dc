// What the gRPC stream handlers share: the scheduler, limits, tokenizer, metrics and
// log, plus the small conversions between gRPC and the scheduler's types.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "m3serve.pb.h"
#include "server/request_log.h"
#include "server/request_validation.h"
#include "server/scheduler.h"
#include "server/unstarted_sessions.h"

namespace m3 {

class ApiKeys;
class ServerMetrics;
class SnapshotService;
class StreamDetokenizer;
class Tokenizer;
struct VocabLayout;

struct ServiceContext {
  explicit ServiceContext(size_t max_unstarted_sessions = 1024) : unstarted_sessions(max_unstarted_sessions) {}

  Scheduler* scheduler = nullptr;
  ServerMetrics* metrics = nullptr;  // may be null
  SnapshotService* snapshots = nullptr;  // null: snapshots refused as unavailable
  RequestLog* log = nullptr;
  const Tokenizer* tokenizer = nullptr;  // null: token ids only
  const VocabLayout* vocab = nullptr;    // null: the model has no vocab.json
  // The engine's sampling mask for each AllowedTokens value (-1: none), with the reason
  // a value cannot be served ("" when it can).
  std::vector<int32_t> allowed_mask;
  std::vector<std::string> allowed_unavailable;
  // Turn rules (the vocabulary's controls; -1: none): fed after each Converse turn; ends a reply.
  int32_t end_of_turn_id = -1;
  int32_t end_of_reply_id = -1;
  const ApiKeys* api_keys = nullptr;     // null: no key needed
  RequestLimits limits;
  size_t stream_buffer_tokens = 1024;
  v1::ModelInfo model_info;
  UnstartedSessions unstarted_sessions;  // Converse streams with no session yet
  std::atomic<uint64_t> request_counter{0};

  std::string make_request_id(const char* prefix) { return prefix + std::to_string(++request_counter); }
};

grpc::Status to_grpc_status(StreamStatus status, const std::string& message);
v1::FinishReason to_proto(FinishReason reason);
void fill_timings(const TurnStats& stats, v1::Timings* out);
// The ids of one outgoing Tokens message, with their text when a detokenizer is given
// (`text` is the caller's reused scratch string).
void fill_tokens(const std::vector<int32_t>& ids, StreamDetokenizer* detokenizer,
                 std::string* text, v1::Tokens* out);
// gRPC deadlines are wall-clock; the scheduler compares steady-clock times.
Clock::time_point steady_deadline(std::chrono::system_clock::time_point deadline);
// The call ended under the stream (client cancel, deadline, broken connection): the
// status that says which (kCancelled or kDeadlineExceeded) and its message.
struct CallEnd {
  StreamStatus status;
  std::string message;
};
CallEnd call_end_reason(const grpc::CallbackServerContext& call);
// A stream's call is done (its reactor's OnDone, where IsCancelled() is certain): detaches
// the stream's writer from `seq` (null: it had none; waits for a cut_stalled_stream() in
// progress) and records the call (record_request_end) as it was finished, unless it was
// finished ok and its call was cancelled first, by the client (or its deadline), or by the
// server because the client read nothing (`seq` was cut: StalledStreams); the client then
// got CANCELLED, not what was sent.
void record_call_done(ServiceContext& ctx, const grpc::CallbackServerContext& call, std::string_view method,
                      std::string_view request_id, Clock::time_point start, Sequence* seq,
                      uint64_t tokens_sent, StreamStatus finished_with, const std::string& message);
// Ends the sequence at the next token boundary with call_end_reason(call).
void request_cancel_for_call_end(Sequence& seq, const grpc::CallbackServerContext& call);
// "" when the call may proceed (no API keys configured, or its authorization metadata
// carries one); else why not, for its UNAUTHENTICATED status. A refusal is also warned
// about (rate-limited, with the peer, never with what the client sent).
std::string unauthenticated_reason(ServiceContext& ctx, const grpc::CallbackServerContext& call,
                                   std::string_view method);
// After a stream ends: the request counter, the duration histogram, the log line.
void record_request_end(ServiceContext& ctx, const RequestRecord& record);

}  // namespace m3
