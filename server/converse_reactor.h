// One Converse session: reads the client's events (optional config first, then input
// tokens and end_turn markers, as they arrive) and feeds them to its Sequence, which
// keeps one engine slot for the whole session; writes each reply (coalesced Tokens
// messages, then TurnFinished). Protocol errors end the session with INVALID_ARGUMENT.
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
    : public grpc::ServerBidiReactor<v1::ConverseRequest, v1::ConverseResponse>,
      public StreamWriter {
 public:
  ConverseReactor(ServiceContext& ctx, grpc::CallbackServerContext* call);

  void flush() override;
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  enum class Handled { kContinue, kStop };
  Handled handle(const v1::ConverseRequest& request);
  Handled add_input(std::vector<int32_t> ids, const char* field);
  bool start_session();  // false: refused, and the stream is finished
  void fail(const std::string& message);  // INVALID_ARGUMENT
  void complete(StreamStatus status, const std::string& message);

  ServiceContext& ctx_;
  grpc::CallbackServerContext* call_;
  const Clock::time_point start_;
  std::string session_id_;

  // Reader state (gRPC read callbacks run one at a time).
  v1::ConverseRequest request_;
  v1::SessionConfig config_;
  uint64_t messages_read_ = 0;
  uint32_t turns_ended_ = 0;
  size_t turn_input_tokens_ = 0;

  std::mutex seq_mu_;  // seq_ is set by the reader and read by OnCancel
  std::shared_ptr<Sequence> seq_;

  OutboxWriter<v1::ConverseResponse> writer_;
};

}  // namespace m3
