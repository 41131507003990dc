// One Converse session: reads the client's events (optional config first, then input
// tokens and end_turn markers, as they arrive) and feeds them to its Sequence, which
// keeps one engine slot for the whole session; writes each reply (coalesced Tokens
// messages, then TurnFinished). Protocol errors end the session with INVALID_ARGUMENT;
// input running more than max_prompt_tokens ahead of the engine (turns sent while a reply
// runs) ends it with RESOURCE_EXHAUSTED.
//
// Until its first message starts the session the stream is in ServiceContext's
// UnstartedSessions, so a shutdown can end it (the scheduler does not know it yet).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "m3serve.grpc.pb.h"
#include "model/tokenizer.h"
#include "server/outbox_writer.h"
#include "server/sequence.h"
#include "server/service_context.h"

namespace m3 {

class ConverseReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,  // (wire_messages.h)
      public StreamWriter,
      public UnstartedSessions::Stream {
 public:
  ConverseReactor(ServiceContext& ctx, grpc::CallbackServerContext* call);

  void flush() override;
  void cancel_call() override;
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;
  void end_unstarted(StreamStatus status, const std::string& message) override;

 private:
  // kPaused: the next read starts later (a resume snapshot is being read on the worker).
  enum class Handled { kContinue, kStop, kPaused };
  Handled handle(const v1::ConverseRequest& request);
  Handled add_input(std::vector<int32_t> ids, const char* field);
  // "" or the RESOURCE_EXHAUSTED message when `more` tokens would put the session's input
  // not yet taken by the engine over max_prompt_tokens.
  std::string check_pending_input(size_t more);
  // false: refused or shutting down, and the stream is finished (or being finished).
  bool start_session();
  // start_session's part once the stream is out of UnstartedSessions; resume_reading: also
  // start the next read (off the reader thread, before the scheduler has the session).
  bool start_taken_session(bool resume_reading);
  // The config's resume_snapshot_id read on the snapshot worker, then the session started
  // and reading resumed there.
  Handled resume_on_worker();
  void fail(const std::string& message);  // INVALID_ARGUMENT
  void end_session(StreamStatus status, const std::string& message);
  void end_without_session();  // the client's side ended before it started a session
  void complete(StreamStatus status, const std::string& message);  // Finish (OnDone records)
  std::shared_ptr<Sequence> session();  // seq_, read under seq_mu_ (null before the session)

  ServiceContext& ctx_;
  grpc::CallbackServerContext* call_;
  const Clock::time_point start_;
  std::string session_id_;

  // Reader state (gRPC read callbacks run one at a time).
  grpc::ByteBuffer request_bytes_;
  v1::ConverseRequest request_;
  v1::SessionConfig config_;
  int32_t sampling_mask_ = -1;  // config_.sampling.allowed's engine mask
  uint64_t messages_read_ = 0;
  std::shared_ptr<const SequenceState> resume_state_;  // read by resume_on_worker
  uint32_t turns_ended_ = 0;
  size_t turn_input_tokens_ = 0;

  std::mutex seq_mu_;  // seq_ is set by the reader and read by OnCancel
  std::shared_ptr<Sequence> seq_;
  bool call_cancelled_ = false;  // OnCancel ran (under seq_mu_: it may precede seq_)
  // How the stream was finished; OnDone records it (or the client's cancellation that
  // ended it "ok", see OnDone).
  StreamStatus final_status_ = StreamStatus::kOk;
  std::string final_message_;

  OutboxWriter<v1::ConverseResponse> writer_;
};

}  // namespace m3
