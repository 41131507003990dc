#include "server/m3serve_service.h"

#include "model/tokenizer.h"
#include <optional>

#include "server/api_keys.h"
#include "server/converse_reactor.h"
#include "server/generate_reactor.h"
#include "server/metrics.h"
#include "server/snapshot_calls.h"

namespace m3 {

grpc::Status to_grpc_status(StreamStatus status, const std::string& message) {
  switch (status) {
    case StreamStatus::kOk: return grpc::Status::OK;
    case StreamStatus::kCancelled: return {grpc::StatusCode::CANCELLED, message};
    case StreamStatus::kInvalidArgument: return {grpc::StatusCode::INVALID_ARGUMENT, message};
    case StreamStatus::kResourceExhausted: return {grpc::StatusCode::RESOURCE_EXHAUSTED, message};
    case StreamStatus::kDeadlineExceeded: return {grpc::StatusCode::DEADLINE_EXCEEDED, message};
    case StreamStatus::kInternal: return {grpc::StatusCode::INTERNAL, message};
    case StreamStatus::kUnavailable: return {grpc::StatusCode::UNAVAILABLE, message};
    case StreamStatus::kNotFound: return {grpc::StatusCode::NOT_FOUND, message};
    case StreamStatus::kFailedPrecondition: return {grpc::StatusCode::FAILED_PRECONDITION, message};
    case StreamStatus::kDataLoss: return {grpc::StatusCode::DATA_LOSS, message};
    case StreamStatus::kUnimplemented: return {grpc::StatusCode::UNIMPLEMENTED, message};
    case StreamStatus::kUnauthenticated: return {grpc::StatusCode::UNAUTHENTICATED, message};
  }
  return {grpc::StatusCode::UNKNOWN, message};
}

v1::FinishReason to_proto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop: return v1::FINISH_REASON_STOP;
    case FinishReason::kCancelled: return v1::FINISH_REASON_CANCELLED;
    case FinishReason::kEndOfReply: return v1::FINISH_REASON_END_OF_REPLY;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

void fill_timings(const TurnStats& s, v1::Timings* out) {
  out->set_prompt_tokens(s.prompt_tokens);
  out->set_generated_tokens(s.generated_tokens);
  out->set_queue_ms(s.queue_ms);
  out->set_time_to_first_token_ms(s.time_to_first_token_ms);
  out->set_duration_ms(s.duration_ms);
  out->set_tokens_per_second(s.tokens_per_second);
}

void fill_tokens(const std::vector<int32_t>& ids, StreamDetokenizer* detokenizer,
                 std::string* text, v1::Tokens* out) {
  out->mutable_ids()->Clear();
  out->mutable_ids()->Add(ids.begin(), ids.end());
  if (detokenizer == nullptr) return;
  text->clear();
  for (int32_t id : ids) detokenizer->append(id, text);
  out->set_text(*text);
}

Clock::time_point steady_deadline(std::chrono::system_clock::time_point deadline) {
  if (deadline == std::chrono::system_clock::time_point::max()) return Clock::time_point::max();
  const auto left = deadline - std::chrono::system_clock::now();
  if (left > std::chrono::hours(24 * 365)) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(left);
}

CallEnd call_end_reason(const grpc::CallbackServerContext& call) {
  // The client's own deadline fires first and its cancellation reaches us slightly before
  // ours (one network delay): a call that ends this close to its deadline ran out of time.
  constexpr auto kDeadlineSlack = std::chrono::milliseconds(50);
  if (call.deadline() <= std::chrono::system_clock::now() + kDeadlineSlack)
    return {StreamStatus::kDeadlineExceeded, "deadline exceeded"};
  return {StreamStatus::kCancelled, "cancelled by the client"};
}

void request_cancel_for_call_end(Sequence& seq, const grpc::CallbackServerContext& call) {
  CallEnd end = call_end_reason(call);
  seq.request_cancel(end.status, std::move(end.message));
}

void record_call_done(ServiceContext& ctx, const grpc::CallbackServerContext& call, std::string_view method,
                      std::string_view request_id, Clock::time_point start, Sequence* seq,
                      uint64_t tokens_sent, StreamStatus finished_with, const std::string& message) {
  if (seq != nullptr) seq->detach_writer();
  CallEnd end{finished_with, message};
  // A cut call never delivered the status it was finished with (its client read nothing,
  // so the status waited behind the unread messages): the client got CANCELLED.
  if (seq != nullptr && seq->was_cut()) {
    end = {StreamStatus::kCancelled,
           "cancelled by the server: the client read nothing of the stream's last messages for "
           "stalled_stream_timeout_s"};
    if (finished_with != StreamStatus::kOk)
      end.message += std::string(" (the stream had ended with ") + stream_status_name(finished_with) + ": " +
                     message + ")";
  } else if (call.IsCancelled()) {
    // Cancelled (by the client, its deadline or a broken connection) before the status it
    // was finished with, if any, reached the client: what the client got is the cancellation.
    end = call_end_reason(call);
  }
  RequestRecord record;
  record.method = method;
  record.request_id = request_id;
  record.status = end.status;
  record.message = end.message;
  if (seq != nullptr) record.summary = seq->summary;
  record.tokens_sent = tokens_sent;
  record.duration_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  const std::string peer = call.peer();
  record.peer = peer;
  record_request_end(ctx, record);
}

std::string unauthenticated_reason(ServiceContext& ctx, const grpc::CallbackServerContext& call,
                                   std::string_view method) {
  if (ctx.api_keys == nullptr) return "";
  const auto& metadata = call.client_metadata();
  std::optional<std::string_view> authorization;
  if (auto it = metadata.find("authorization"); it != metadata.end())
    authorization = std::string_view(it->second.data(), it->second.size());
  std::string why = ctx.api_keys->check(authorization);
  if (!why.empty()) ctx.log->warn("unauthenticated", std::string(method) + " from " + call.peer() + " refused: " + why);
  return why;
}

void record_request_end(ServiceContext& ctx, const RequestRecord& record) {
  if (ctx.metrics) {
    ctx.metrics->count_request(stream_status_name(record.status));
    ctx.metrics->observe_request_duration(record.duration_ms / 1000.0);
  }
  ctx.log->request_done(record);
  if (record.status == StreamStatus::kResourceExhausted || record.status == StreamStatus::kInternal) {
    ctx.log->warn(stream_status_name(record.status),
                  std::string(record.method) + " id=" + std::string(record.request_id) + ": " +
                      std::string(record.message));
  }
}

// A unary call without a valid API key: recorded (log line, counter) as UNAUTHENTICATED and
// finished; false when the call may go on.
static bool refused_without_key(ServiceContext& ctx, grpc::CallbackServerContext* call, grpc::ServerUnaryReactor* reactor,
                                std::string_view method, const char* id_prefix) {
  const std::string why = unauthenticated_reason(ctx, *call, method);
  if (why.empty()) return false;
  const std::string id = ctx.make_request_id(id_prefix);
  RequestRecord record;
  record.method = method;
  record.request_id = id;
  record.status = StreamStatus::kUnauthenticated;
  record.message = why;
  const std::string peer = call->peer();
  record.peer = peer;
  record_request_end(ctx, record);
  reactor->Finish(to_grpc_status(StreamStatus::kUnauthenticated, why));
  return true;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* M3ServeService::Generate(grpc::CallbackServerContext* call,
                                                                     const grpc::ByteBuffer* request) {
  return new GenerateReactor(context_, call, request);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* M3ServeService::Converse(grpc::CallbackServerContext* call) {
  return new ConverseReactor(context_, call);
}

grpc::ServerUnaryReactor* M3ServeService::GetModelInfo(grpc::CallbackServerContext* call,
                                                       const v1::GetModelInfoRequest*,
                                                       v1::ModelInfo* response) {
  auto* reactor = call->DefaultReactor();
  if (refused_without_key(context_, call, reactor, "GetModelInfo", "info-")) return reactor;
  *response = context_.model_info;
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* M3ServeService::CreateSnapshot(grpc::CallbackServerContext* call,
                                                         const v1::CreateSnapshotRequest* request,
                                                         v1::SnapshotInfo* response) {
  auto* reactor = call->DefaultReactor();
  if (refused_without_key(context_, call, reactor, "CreateSnapshot", "snap-")) return reactor;
  create_snapshot(context_, call, request, response, reactor);
  return reactor;
}

grpc::ServerUnaryReactor* M3ServeService::GetSnapshot(grpc::CallbackServerContext* call, const v1::SnapshotRef* request,
                                                      v1::SnapshotInfo* response) {
  auto* reactor = call->DefaultReactor();
  if (refused_without_key(context_, call, reactor, "GetSnapshot", "snap-")) return reactor;
  get_snapshot(context_, request, response, reactor);
  return reactor;
}

grpc::ServerUnaryReactor* M3ServeService::DeleteSnapshot(grpc::CallbackServerContext* call,
                                                         const v1::SnapshotRef* request, v1::SnapshotInfo* response) {
  auto* reactor = call->DefaultReactor();
  if (refused_without_key(context_, call, reactor, "DeleteSnapshot", "snap-")) return reactor;
  delete_snapshot(context_, request, response, reactor);
  return reactor;
}

}  // namespace m3
