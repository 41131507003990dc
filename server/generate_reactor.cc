#include "server/generate_reactor.h"

#include <algorithm>

#include "server/prompt_segments.h"
#include "server/vocab_serving.h"
#include "server/snapshot_calls.h"
#include "server/snapshot_service.h"

namespace m3 {

GenerateReactor::GenerateReactor(ServiceContext& ctx, grpc::CallbackServerContext* call,
                                 const grpc::ByteBuffer* request_bytes)
    : ctx_(ctx), call_(call), start_(Clock::now()), writer_(ctx) {
  if (std::string why = unauthenticated_reason(ctx_, *call_, "Generate"); !why.empty()) {
    request_id_ = ctx_.make_request_id("gen-");
    complete(StreamStatus::kUnauthenticated, why);
    return;
  }
  v1::GenerateRequest request;
  std::string refusal;
  if (!request_bytes->Valid()) {
    refusal = "the call carried no GenerateRequest message";
  } else {
    grpc::ByteBuffer bytes(*request_bytes);  // (shares the slices; parsing empties it)
    if (std::string why = parse_message(&bytes, &request); !why.empty()) refusal = "the request " + why;
  }
  if (!refusal.empty()) {
    request_id_ = ctx_.make_request_id("gen-");
    complete(StreamStatus::kInvalidArgument, refusal);
    return;
  }
  start(request);
}

void GenerateReactor::start(const v1::GenerateRequest& request) {
  request_id_ = id_to_log(request);
  std::vector<int32_t> prompt;
  std::string error = check_generate_request(request, ctx_.limits);
  int32_t mask = -1;
  if (error.empty()) error = check_allowed_tokens(request.sampling(), ctx_, "sampling", &mask);
  if (error.empty()) error = read_prompt(request, &prompt);
  if (!error.empty()) {
    complete(StreamStatus::kInvalidArgument, error);
    return;
  }

  SequenceParams params;
  params.request_id = request_id_;
  params.sampling = engine_sampling(request.sampling());
  params.sampling.mask = mask;
  params.end_of_reply_id = ctx_.end_of_reply_id;
  seed_ = params.sampling.seed;
  params.stop_token_ids.assign(request.stop_token_ids().begin(), request.stop_token_ids().end());
  params.deadline = steady_deadline(call_->deadline());
  if (request.prefix_snapshot_id().empty()) {
    submit(std::move(params), prompt, request.max_new_tokens());
    return;
  }
  if (ctx_.snapshots == nullptr) {  // no store to wait on: refused at once, saying why
    const StreamStatus status = load_snapshot(ctx_, request.prefix_snapshot_id(), &params.start_state, &error);
    complete(status, "prefix_snapshot_id: " + error);
    return;
  }
  // The store may be slow or unreachable: it is read on the snapshot worker, so that no
  // gRPC thread waits on it (the call stays open until the worker finishes or submits it).
  ctx_.snapshots->post([this, params = std::move(params), prompt = std::move(prompt),
                        id = request.prefix_snapshot_id(), max_new = request.max_new_tokens()]() mutable {
    std::string why;
    const StreamStatus status = load_snapshot(ctx_, id, &params.start_state, &why);
    if (status != StreamStatus::kOk) {
      complete(status, "prefix_snapshot_id: " + why);
      return;
    }
    submit(std::move(params), prompt, max_new);
  });
}

void GenerateReactor::submit(SequenceParams params, const std::vector<int32_t>& prompt, uint32_t max_new_tokens) {
  // It never holds more unread tokens than it may generate.
  const size_t buffer = std::min<size_t>(ctx_.stream_buffer_tokens, max_new_tokens);
  auto seq = std::make_shared<Sequence>(std::move(params), buffer, this);
  seq->add_input(prompt);
  seq->end_turn(max_new_tokens);
  seq->close_input();
  bool cancelled = false;
  {
    std::lock_guard lock(seq_mu_);
    seq_ = seq;
    cancelled = call_cancelled_;
  }
  // A cancellation that came before the sequence existed found nothing to end: this one
  // starts ended (the scheduler closes it at admission).
  if (cancelled) request_cancel_for_call_end(*seq, *call_);
  Scheduler::Admission admission = ctx_.scheduler->submit(seq);
  if (admission.status != StreamStatus::kOk) complete(admission.status, admission.message);
}

std::string GenerateReactor::id_to_log(const v1::GenerateRequest& request) {
  // A client's id is logged and echoed only once it is known to be short and of the id
  // alphabet: a space or newline in it would forge log fields or lines. A refused one is replaced
  // (the refusal's message says what was wrong with it).
  if (request.request_id().empty() || !check_request_id(request.request_id(), "request_id").empty())
    return ctx_.make_request_id("gen-");
  return request.request_id();
}

std::string GenerateReactor::read_prompt(const v1::GenerateRequest& request,
                                         std::vector<int32_t>* prompt) {
  if (request.prompt_case() == v1::GenerateRequest::kPromptIds) {
    prompt->assign(request.prompt_ids().ids().begin(), request.prompt_ids().ids().end());
    return "";
  }
  if (request.prompt_case() == v1::GenerateRequest::kPromptSegments) {
    return segments_to_ids(request.prompt_segments(), segment_vocabulary(ctx_), "prompt_segments", prompt);
  }
  try {
    *prompt = ctx_.tokenizer->encode(request.prompt_text());
  } catch (const std::exception& e) {
    return std::string("prompt_text could not be tokenized: ") + e.what();
  }
  if (prompt->empty()) return "prompt_text encodes to no tokens";
  if (prompt->size() > static_cast<size_t>(ctx_.limits.max_prompt_tokens)) {
    return "prompt_text encodes to " + std::to_string(prompt->size()) +
           " tokens, this server's limit is " + std::to_string(ctx_.limits.max_prompt_tokens) +
           " (max_prompt_tokens)";
  }
  return check_token_ids(*prompt, "prompt_text's token ids", ctx_.limits.vocab_size);
}

void GenerateReactor::flush() {
  const auto fill_finished = [this](const TurnEnd& end, v1::GenerateResponse* response) {
    v1::Finished* f = response->mutable_finished();
    f->set_request_id(request_id_);
    f->set_reason(to_proto(end.reason));
    fill_timings(end.stats, f->mutable_timings());
    f->set_seed(seed_);
  };
  writer_.drain(*seq_, fill_finished, [this](const grpc::ByteBuffer* bytes) { StartWrite(bytes); },
                [this](StreamStatus status, const std::string& message) { complete(status, message); });
}

void GenerateReactor::OnWriteDone(bool ok) {
  seq_->note_write_done();
  if (writer_.first_failure(ok)) {
    request_cancel_for_call_end(*seq_, *call_);
    ctx_.scheduler->wake();
  }
  flush();
}

void GenerateReactor::OnCancel() {
  std::shared_ptr<Sequence> seq;
  {
    std::lock_guard lock(seq_mu_);
    call_cancelled_ = true;
    seq = seq_;
  }
  if (!seq) return;
  request_cancel_for_call_end(*seq, *call_);
  ctx_.scheduler->wake();
}

void GenerateReactor::cancel_call() { call_->TryCancel(); }

void GenerateReactor::OnDone() {
  // A stream the engine finished can still be cancelled by its client (or its deadline)
  // while its last messages are on their way.
  record_call_done(ctx_, *call_, "Generate", request_id_, start_, seq_.get(), writer_.tokens_sent(), final_status_,
                   final_message_);
  delete this;
}

void GenerateReactor::complete(StreamStatus status, const std::string& message) {
  final_status_ = status;  // recorded in OnDone
  final_message_ = message;
  Finish(to_grpc_status(status, message));
}

}  // namespace m3
