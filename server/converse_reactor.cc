#include "server/converse_reactor.h"

#include "server/prompt_segments.h"
#include "server/vocab_serving.h"
#include "server/snapshot_calls.h"
#include "server/snapshot_service.h"

namespace m3 {

ConverseReactor::ConverseReactor(ServiceContext& ctx, grpc::CallbackServerContext* call)
    : ctx_(ctx), call_(call), start_(Clock::now()), writer_(ctx) {
  session_id_ = ctx.make_request_id("conv-");
  if (std::string why = unauthenticated_reason(ctx_, *call_, "Converse"); !why.empty()) {
    complete(StreamStatus::kUnauthenticated, why);
    return;
  }
  switch (ctx.unstarted_sessions.add(this)) {
    case UnstartedSessions::Added::kYes:
      break;
    case UnstartedSessions::Added::kShuttingDown:
      complete(StreamStatus::kUnavailable, kShuttingDownMessage);
      return;
    case UnstartedSessions::Added::kFull:
      complete(StreamStatus::kResourceExhausted,
               "server at capacity: " + std::to_string(ctx.unstarted_sessions.limit()) +
                   " Converse streams are open and have sent nothing yet (max_batch + queue_capacity); "
                   "retry later");
      return;
  }
  StartRead(&request_bytes_);
}

void ConverseReactor::OnReadDone(bool ok) {
  if (!ok) {  // the client closed its side (or the call ended)
    const std::shared_ptr<Sequence> seq = session();
    if (!seq) {
      end_without_session();
      return;
    }
    seq->close_input();
    ctx_.scheduler->wake();
    return;
  }
  ++messages_read_;
  if (std::string why = parse_message(&request_bytes_, &request_); !why.empty()) {
    fail("message " + std::to_string(messages_read_) + " " + why);
    return;
  }
  if (handle(request_) == Handled::kContinue) StartRead(&request_bytes_);
}

ConverseReactor::Handled ConverseReactor::handle(const v1::ConverseRequest& r) {
  switch (r.event_case()) {
    case v1::ConverseRequest::kConfig: {
      if (messages_read_ != 1) {
        fail("config must be the first message of a session; it came as message " +
             std::to_string(messages_read_));
        return Handled::kStop;
      }
      std::string e = check_session_config(r.config(), ctx_.limits);
      if (e.empty()) e = check_allowed_tokens(r.config().sampling(), ctx_, "config.sampling", &sampling_mask_);
      if (!e.empty()) {
        fail(e);
        return Handled::kStop;
      }
      config_ = r.config();
      if (!config_.resume_snapshot_id().empty() && ctx_.snapshots != nullptr) return resume_on_worker();
      return start_session() ? Handled::kContinue : Handled::kStop;
    }
    case v1::ConverseRequest::kInput:
      return add_input({r.input().ids().begin(), r.input().ids().end()}, "input.ids");
    case v1::ConverseRequest::kInputText: {
      if (!ctx_.tokenizer) {
        fail("input_text needs a tokenizer and this server has none (start it with --tokenizer "
             "FILE); send input token ids instead");
        return Handled::kStop;
      }
      if (auto e = check_text_size(r.input_text(), "input_text", ctx_.limits.max_prompt_tokens); !e.empty()) {
        fail(e);
        return Handled::kStop;
      }
      std::vector<int32_t> ids;
      try {
        ids = ctx_.tokenizer->encode(r.input_text());
      } catch (const std::exception& e) {
        fail(std::string("input_text could not be tokenized: ") + e.what());
        return Handled::kStop;
      }
      return add_input(std::move(ids), "input_text's token ids");
    }
    case v1::ConverseRequest::kInputSegments: {
      std::vector<int32_t> ids;
      if (auto e = segments_to_ids(r.input_segments(), segment_vocabulary(ctx_), "input_segments", &ids); !e.empty()) {
        fail(e);
        return Handled::kStop;
      }
      return add_input(std::move(ids), "input_segments' token ids");
    }
    case v1::ConverseRequest::kEndTurn: {
      uint32_t max_new = r.end_turn().max_new_tokens();
      if (max_new == 0) max_new = config_.max_new_tokens();
      if (max_new == 0) {
        fail("end_turn.max_new_tokens is 0 and the session config sets no max_new_tokens: one "
             "of them must bound the reply");
        return Handled::kStop;
      }
      if (auto e = check_max_new_tokens(max_new, "end_turn.max_new_tokens",
                                        ctx_.limits.max_new_tokens_limit);
          !e.empty()) {
        fail(e);
        return Handled::kStop;
      }
      if (turns_ended_ == 0 && turn_input_tokens_ == 0) {
        fail("end_turn before any input: the first turn needs at least one input token");
        return Handled::kStop;
      }
      // The turn rule: the model hears the end of the client's turn as its own control.
      if (ctx_.end_of_turn_id >= 0 && add_input({ctx_.end_of_turn_id}, "end_of_turn") == Handled::kStop) {
        return Handled::kStop;
      }
      if (!seq_ && !start_session()) return Handled::kStop;
      if (turn_input_tokens_ == 0) {  // a turn of end_turn alone still waits its turn
        if (auto e = check_pending_input(1); !e.empty()) {
          end_session(StreamStatus::kResourceExhausted, e);
          return Handled::kStop;
        }
      }
      seq_->end_turn(max_new);
      ++turns_ended_;
      turn_input_tokens_ = 0;
      ctx_.scheduler->wake();
      return Handled::kContinue;
    }
    case v1::ConverseRequest::kSaveSnapshot: {
      if (!seq_) {
        fail("save_snapshot before the session has any input: there is no state to save");
        return Handled::kStop;
      }
      seq_->request_save();
      ctx_.scheduler->wake();
      return Handled::kContinue;
    }
    case v1::ConverseRequest::EVENT_NOT_SET:
      break;
  }
  fail("message " + std::to_string(messages_read_) +
       " has no event set: send config, input, input_text or end_turn");
  return Handled::kStop;
}

ConverseReactor::Handled ConverseReactor::add_input(std::vector<int32_t> ids, const char* field) {
  if (auto e = check_token_ids(ids, field, ctx_.limits.vocab_size); !e.empty()) {
    fail(e);
    return Handled::kStop;
  }
  turn_input_tokens_ += ids.size();
  if (turn_input_tokens_ > static_cast<size_t>(ctx_.limits.max_prompt_tokens)) {
    fail("turn " + std::to_string(turns_ended_) + " has " + std::to_string(turn_input_tokens_) +
         " input tokens, this server's limit is " + std::to_string(ctx_.limits.max_prompt_tokens) +
         " (max_prompt_tokens)");
    return Handled::kStop;
  }
  if (!seq_ && !start_session()) return Handled::kStop;
  if (auto e = check_pending_input(ids.size()); !e.empty()) {
    end_session(StreamStatus::kResourceExhausted, e);
    return Handled::kStop;
  }
  seq_->add_input(ids);
  ctx_.scheduler->wake();
  return Handled::kContinue;
}

std::string ConverseReactor::check_pending_input(size_t more) {
  // Input sent while a reply runs waits for it (it belongs to the next turn); without a
  // bound, a client streaming turns faster than the replies would grow it without end.
  // Only this thread adds input and the engine only takes it, so the check holds.
  const size_t pending = seq_->pending_input_tokens() + more;
  const auto limit = static_cast<size_t>(ctx_.limits.max_prompt_tokens);
  if (pending <= limit) return "";
  return "the session's input runs ahead of its replies: " + std::to_string(pending) +
         " input tokens would wait to be fed to the model, this server's limit is " +
         std::to_string(limit) + " (max_prompt_tokens); wait for a reply before sending more turns";
}

ConverseReactor::Handled ConverseReactor::resume_on_worker() {
  // The store may be slow or unreachable: it is read on the snapshot worker, so that no
  // gRPC thread waits on it. The stream leaves UnstartedSessions first, so that a shutdown
  // meanwhile cannot finish it under the worker; the scheduler refuses it then instead.
  if (!ctx_.unstarted_sessions.take(this)) return Handled::kStop;  // the shutdown finishes it
  ctx_.snapshots->post([this] {
    std::string error;
    const StreamStatus status = load_snapshot(ctx_, config_.resume_snapshot_id(), &resume_state_, &error);
    if (status != StreamStatus::kOk) {
      complete(status, "resume_snapshot_id: " + error);
      return;
    }
    start_taken_session(/*resume_reading=*/true);  // nothing of this reactor's is touched after it
  });
  return Handled::kPaused;
}

bool ConverseReactor::start_session() {
  // From here the scheduler (or the refusal below) ends the stream; when a shutdown took
  // it first, the shutdown finishes it.
  if (!ctx_.unstarted_sessions.take(this)) return false;
  return start_taken_session(/*resume_reading=*/false);
}

bool ConverseReactor::start_taken_session(bool resume_reading) {
  if (!config_.session_id().empty()) session_id_ = config_.session_id();
  SequenceParams params;
  params.request_id = session_id_;
  params.session = true;
  params.streamed_input = true;
  params.sampling = engine_sampling(config_.sampling());
  params.sampling.mask = sampling_mask_;
  params.end_of_reply_id = ctx_.end_of_reply_id;
  params.stop_token_ids.assign(config_.stop_token_ids().begin(), config_.stop_token_ids().end());
  params.deadline = steady_deadline(call_->deadline());
  if (resume_state_) {
    params.start_state = std::move(resume_state_);
  } else if (!config_.resume_snapshot_id().empty()) {  // no snapshot service: refused at once
    std::string error;
    const StreamStatus status = load_snapshot(ctx_, config_.resume_snapshot_id(), &params.start_state, &error);
    if (status != StreamStatus::kOk) {
      complete(status, "resume_snapshot_id: " + error);
      return false;
    }
  }
  params.on_state_saved = saved_state_handler(ctx_);
  params.save_on_shutdown = ctx_.snapshots != nullptr && ctx_.snapshots->persistent();
  auto seq = std::make_shared<Sequence>(std::move(params), ctx_.stream_buffer_tokens, this);
  bool cancelled = false;
  {
    std::lock_guard lock(seq_mu_);
    seq_ = seq;
    cancelled = call_cancelled_;
  }
  // A cancellation that came while the session was being made found no sequence to end:
  // this one starts ended (the scheduler closes it at admission), not prefilling its input.
  if (cancelled) request_cancel_for_call_end(*seq, *call_);
  // Off the reader (on the snapshot worker), reading resumes before the scheduler has the
  // session: once it has it, it may end the stream, and the reactor with it, at any time.
  // The reader may use seq_ from then on, so it stays set even if refused.
  if (resume_reading) StartRead(&request_bytes_);
  Scheduler::Admission admission = ctx_.scheduler->submit(seq);
  if (admission.status == StreamStatus::kOk) return true;
  if (!resume_reading) {
    std::lock_guard lock(seq_mu_);
    seq_.reset();
  }
  complete(admission.status, admission.message);
  return false;
}

void ConverseReactor::fail(const std::string& message) {
  end_session(StreamStatus::kInvalidArgument, message);
}

void ConverseReactor::end_session(StreamStatus status, const std::string& message) {
  const std::shared_ptr<Sequence> seq = session();
  if (!seq) {
    if (ctx_.unstarted_sessions.take(this)) complete(status, message);
    return;  // else a shutdown took the stream and finishes it
  }
  // The scheduler owns the stream's end: it frees the slot, then the writer finishes.
  seq->request_cancel(status, message);
  ctx_.scheduler->wake();
}

void ConverseReactor::end_without_session() {
  if (!ctx_.unstarted_sessions.take(this)) return;  // a shutdown finishes it
  complete(StreamStatus::kOk, "");  // OnDone tells a cancellation from a closed side
}

void ConverseReactor::end_unstarted(StreamStatus status, const std::string& message) {
  complete(status, message);
}

void ConverseReactor::flush() {
  const uint64_t seed = seq_->params().sampling.seed;  // drawn at the start when none was given
  const auto fill_turn_finished = [seed](const TurnEnd& end, v1::ConverseResponse* response) {
    v1::TurnFinished* f = response->mutable_turn_finished();
    f->set_turn(end.turn);
    f->set_reason(to_proto(end.reason));
    fill_timings(end.stats, f->mutable_timings());
    f->set_seed(seed);
  };
  writer_.drain(*seq_, fill_turn_finished, [this](const grpc::ByteBuffer* bytes) { StartWrite(bytes); },
                [this](StreamStatus status, const std::string& message) { complete(status, message); });
}

void ConverseReactor::OnWriteDone(bool ok) {
  seq_->note_write_done();
  if (writer_.first_failure(ok)) {
    request_cancel_for_call_end(*seq_, *call_);
    ctx_.scheduler->wake();
  }
  flush();
}

void ConverseReactor::OnCancel() {
  std::shared_ptr<Sequence> seq;
  {
    std::lock_guard lock(seq_mu_);
    call_cancelled_ = true;
    seq = seq_;
  }
  if (!seq) return;  // the pending read fails and finishes the stream (OnDone records it)
  request_cancel_for_call_end(*seq, *call_);
  ctx_.scheduler->wake();
}

void ConverseReactor::cancel_call() { call_->TryCancel(); }

std::shared_ptr<Sequence> ConverseReactor::session() {
  std::lock_guard lock(seq_mu_);
  return seq_;
}

void ConverseReactor::OnDone() {
  // A client's cancellation ends its side of the stream too, and the failed read can reach
  // the session before OnCancel does: an idle session (or a stream with none) then ends
  // "ok". Only now, with the call done, is IsCancelled() certain; such an end is the
  // cancellation it was.
  const std::shared_ptr<Sequence> seq = session();
  record_call_done(ctx_, *call_, "Converse", session_id_, start_, seq.get(), writer_.tokens_sent(), final_status_,
                   final_message_);
  delete this;
}

void ConverseReactor::complete(StreamStatus status, const std::string& message) {
  final_status_ = status;  // recorded in OnDone
  final_message_ = message;
  if (const std::shared_ptr<Sequence> seq = session()) {
    if (std::string id = seq->shutdown_snapshot(); !id.empty()) call_->AddTrailingMetadata("m3-snapshot-id", id);
  }
  Finish(to_grpc_status(status, message));
}

}  // namespace m3
