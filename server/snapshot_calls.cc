#include "server/snapshot_calls.h"

#include <mutex>

#include "model/tokenizer.h"
#include "server/snapshot_service.h"

namespace m3 {
namespace {

constexpr const char kNoSnapshots[] = "this server has no snapshot service";

void fill(const SnapshotService::Info& info, v1::SnapshotInfo* out) {
  out->set_snapshot_id(info.id);
  out->set_tokens(info.tokens);
  out->set_bytes(info.bytes);
}

void record(ServiceContext& ctx, std::string_view method, std::string_view id, Clock::time_point start,
            StreamStatus status, const std::string& message, const SequenceSummary& summary = {}) {
  RequestRecord r;
  r.method = method;
  r.request_id = id;
  r.status = status;
  r.message = message;
  r.summary = summary;
  r.duration_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  record_request_end(ctx, r);
}

// One CreateSnapshot: its sequence reads the prompt (a session that is saved once fed,
// then closes); the save is stored on the snapshot worker, which answers the call. The
// sequence's outbox closing with an error (shutdown, engine failure, deadline) answers it
// instead when that comes first.
class CreateSnapshotCall final : public StreamWriter, public std::enable_shared_from_this<CreateSnapshotCall> {
 public:
  CreateSnapshotCall(ServiceContext& ctx, grpc::ServerUnaryReactor* reactor, v1::SnapshotInfo* response,
                     std::string id)
      : ctx_(ctx), reactor_(reactor), response_(response), id_(std::move(id)), start_(Clock::now()) {}

  void start(SequenceParams params, const std::vector<int32_t>& prompt) {
    params.on_state_saved = [this](const std::shared_ptr<Sequence>& seq, SequenceState state) {
      std::shared_ptr<CreateSnapshotCall> self = shared_from_this();
      ctx_.snapshots->post([self, seq, state = std::move(state)] {
        SnapshotService::Info info;
        const SnapshotService::Result r = self->ctx_.snapshots->store(state, &info);
        if (r.ok()) {
          fill(info, self->response_);
          seq->deliver_saved(info.id);  // the sequence then closes
        } else {
          seq->request_cancel(r.status, r.message);
        }
        self->ctx_.scheduler->wake();
        SequenceSummary summary;
        summary.prompt_tokens = static_cast<uint32_t>(state.tokens);
        self->finish(r.status, r.message, summary);
      });
    };
    seq_ = std::make_shared<Sequence>(std::move(params), 1, this);
    seq_->add_input(prompt);
    seq_->request_save();
    seq_->close_input();
    self_ = shared_from_this();  // until the outbox is closed
    const Scheduler::Admission admission = ctx_.scheduler->submit(seq_);
    if (admission.status != StreamStatus::kOk) {
      self_.reset();
      finish(admission.status, admission.message, {});
    }
  }

  void flush() override {
    std::vector<int32_t> tokens;
    for (;;) {
      const TokenOutbox::Item item = seq_->outbox().take(&tokens);
      if (item.kind == TokenOutbox::Item::kNothing) return;
      if (item.kind != TokenOutbox::Item::kClosed) continue;
      if (item.status != StreamStatus::kOk) finish(item.status, item.message, seq_->summary);
      seq_->detach_writer();
      self_.reset();  // (the worker's task holds its own reference while it stores)
      return;
    }
  }

 private:
  void finish(StreamStatus status, const std::string& message, const SequenceSummary& summary) {
    {
      std::lock_guard lock(mu_);
      if (finished_) return;
      finished_ = true;
    }
    record(ctx_, "CreateSnapshot", id_, start_, status, message, summary);
    reactor_->Finish(to_grpc_status(status, message));
  }

  ServiceContext& ctx_;
  grpc::ServerUnaryReactor* reactor_;
  v1::SnapshotInfo* response_;
  const std::string id_;
  const Clock::time_point start_;
  std::shared_ptr<Sequence> seq_;
  std::shared_ptr<CreateSnapshotCall> self_;
  std::mutex mu_;
  bool finished_ = false;
};

// The prompt of a CreateSnapshot, checked as Generate's; "" or why not.
std::string read_prompt(ServiceContext& ctx, const v1::CreateSnapshotRequest& r, std::vector<int32_t>* prompt) {
  const RequestLimits& limits = ctx.limits;
  if (r.prompt_case() == v1::CreateSnapshotRequest::kPromptText) {
    if (!ctx.tokenizer) {
      return "prompt_text needs a tokenizer and this server has none (start it with --tokenizer FILE); send "
             "prompt_ids instead";
    }
    if (auto e = check_text_size(r.prompt_text(), "prompt_text", limits.max_prompt_tokens); !e.empty()) return e;
    try {
      *prompt = ctx.tokenizer->encode(r.prompt_text());
    } catch (const std::exception& e) {
      return std::string("prompt_text could not be tokenized: ") + e.what();
    }
  } else if (r.prompt_case() == v1::CreateSnapshotRequest::kPromptIds) {
    prompt->assign(r.prompt_ids().ids().begin(), r.prompt_ids().ids().end());
  }
  if (prompt->empty() && r.base_snapshot_id().empty()) {
    return "the prompt is empty and there is no base_snapshot_id: a snapshot needs at least one token";
  }
  if (prompt->size() > static_cast<size_t>(limits.max_prompt_tokens)) {
    return "the prompt has " + std::to_string(prompt->size()) + " tokens, this server's limit is " +
           std::to_string(limits.max_prompt_tokens) + " (max_prompt_tokens)";
  }
  return check_token_ids(*prompt, "the prompt's token ids", limits.vocab_size);
}

}  // namespace

StreamStatus load_snapshot(ServiceContext& ctx, const std::string& id, std::shared_ptr<const SequenceState>* state,
                           std::string* error) {
  if (ctx.snapshots == nullptr) {
    *error = kNoSnapshots;
    return StreamStatus::kUnimplemented;
  }
  const SnapshotService::Result r = ctx.snapshots->load(id, state);
  *error = r.message;
  return r.status;
}

std::function<void(const std::shared_ptr<Sequence>&, SequenceState)> saved_state_handler(ServiceContext& ctx) {
  return [&ctx](const std::shared_ptr<Sequence>& seq, SequenceState state) {
    if (ctx.snapshots == nullptr) {
      seq->request_cancel(StreamStatus::kUnimplemented, std::string("save_snapshot: ") + kNoSnapshots);
      ctx.scheduler->wake();
      return;
    }
    ctx.snapshots->post([&ctx, seq, state = std::move(state)] {
      SnapshotService::Info info;
      const SnapshotService::Result r = ctx.snapshots->store(state, &info);
      if (state.for_shutdown) {
        // The session ends either way; saved, the client can resume it on another replica.
        if (r.ok()) {
          seq->set_shutdown_snapshot(info.id);
          seq->request_cancel(StreamStatus::kUnavailable,
                              std::string(kShuttingDownMessage) + "; the session was saved as snapshot " + info.id +
                                  " (trailing metadata m3-snapshot-id): resume it with "
                                  "SessionConfig.resume_snapshot_id");
        } else {
          seq->request_cancel(StreamStatus::kUnavailable,
                              std::string(kShuttingDownMessage) + "; saving the session failed: " + r.message);
        }
      } else if (r.ok()) {
        seq->deliver_saved(info.id);
      } else {
        seq->request_cancel(r.status, "save_snapshot: " + r.message);
      }
      ctx.scheduler->wake();
    });
  };
}

void create_snapshot(ServiceContext& ctx, grpc::CallbackServerContext* call, const v1::CreateSnapshotRequest* request,
                     v1::SnapshotInfo* response, grpc::ServerUnaryReactor* reactor) {
  const Clock::time_point start = Clock::now();
  std::string id = request->request_id();
  if (id.empty() || !check_request_id(id, "request_id").empty()) id = ctx.make_request_id("snap-req-");
  // (By value: the snapshot worker refuses with it too, after this call has returned.)
  const auto refuse = [&ctx, reactor, id, start](StreamStatus status, const std::string& message) {
    record(ctx, "CreateSnapshot", id, start, status, message);
    reactor->Finish(to_grpc_status(status, message));
  };
  if (auto e = check_request_id(request->request_id(), "request_id"); !e.empty()) {
    refuse(StreamStatus::kInvalidArgument, e);
    return;
  }
  if (ctx.snapshots == nullptr) {
    refuse(StreamStatus::kUnimplemented, kNoSnapshots);
    return;
  }
  std::vector<int32_t> prompt;
  if (std::string e = read_prompt(ctx, *request, &prompt); !e.empty()) {
    refuse(StreamStatus::kInvalidArgument, e);
    return;
  }
  SequenceParams params;
  params.request_id = id;
  params.session = true;  // it reads its input, stays idle for the save, then closes
  params.deadline = steady_deadline(call->deadline());
  auto c = std::make_shared<CreateSnapshotCall>(ctx, reactor, response, id);
  if (request->base_snapshot_id().empty()) {
    c->start(std::move(params), prompt);
    return;
  }
  // The base is read on the snapshot worker, so that no gRPC thread waits on the store.
  ctx.snapshots->post([&ctx, c, refuse, params = std::move(params), prompt = std::move(prompt),
                       base = request->base_snapshot_id()]() mutable {
    std::string error;
    const StreamStatus status = load_snapshot(ctx, base, &params.start_state, &error);
    if (status != StreamStatus::kOk) {
      refuse(status, "base_snapshot_id: " + error);
      return;
    }
    c->start(std::move(params), prompt);
  });
}

namespace {

// GetSnapshot and DeleteSnapshot: `op` (SnapshotService::info or remove) on the snapshot
// service's worker, the answer filled from what it found.
void answer_by_ref(ServiceContext& ctx, const v1::SnapshotRef* request, v1::SnapshotInfo* response,
                   grpc::ServerUnaryReactor* reactor,
                   SnapshotService::Result (SnapshotService::*op)(const std::string&, SnapshotService::Info*)) {
  if (ctx.snapshots == nullptr) {
    reactor->Finish(to_grpc_status(StreamStatus::kUnimplemented, kNoSnapshots));
    return;
  }
  const std::string id = request->snapshot_id();
  ctx.snapshots->post([&ctx, id, response, reactor, op] {
    SnapshotService::Info info;
    const SnapshotService::Result r = (ctx.snapshots->*op)(id, &info);
    if (r.ok()) fill(info, response);
    reactor->Finish(to_grpc_status(r.status, r.message));
  });
}

}  // namespace

void get_snapshot(ServiceContext& ctx, const v1::SnapshotRef* request, v1::SnapshotInfo* response,
                  grpc::ServerUnaryReactor* reactor) {
  answer_by_ref(ctx, request, response, reactor, &SnapshotService::info);
}

void delete_snapshot(ServiceContext& ctx, const v1::SnapshotRef* request, v1::SnapshotInfo* response,
                     grpc::ServerUnaryReactor* reactor) {
  answer_by_ref(ctx, request, response, reactor, &SnapshotService::remove);
}

}  // namespace m3
