// One Generate stream: parses and validates the request, hands a Sequence to the
// scheduler and writes what its outbox receives (coalesced Tokens messages, then
// Finished). The stream carries bytes (wire_messages.h).
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

class GenerateReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                              public StreamWriter {
 public:
  GenerateReactor(ServiceContext& ctx, grpc::CallbackServerContext* call, const grpc::ByteBuffer* request_bytes);

  void flush() override;
  void cancel_call() override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // Everything after the request is parsed.
  void start(const v1::GenerateRequest& request);
  // The sequence made and handed to the scheduler (after its prefix snapshot is read).
  void submit(SequenceParams params, const std::vector<int32_t>& prompt, uint32_t max_new_tokens);
  // The request's id when it is valid, else one the server makes.
  std::string id_to_log(const v1::GenerateRequest& request);
  // Returns "" or the INVALID_ARGUMENT message.
  std::string read_prompt(const v1::GenerateRequest& request, std::vector<int32_t>* prompt);
  // Finishes the call with this status; OnDone records it (or the client's cancellation).
  void complete(StreamStatus status, const std::string& message);

  ServiceContext& ctx_;
  grpc::CallbackServerContext* call_;
  const Clock::time_point start_;
  std::string request_id_;
  uint64_t seed_ = 0;
  // seq_ is set once, by the thread that submits it (a gRPC thread, or the snapshot worker
  // after reading a prefix snapshot), and read by OnCancel, which may come first.
  std::mutex seq_mu_;
  std::shared_ptr<Sequence> seq_;
  bool call_cancelled_ = false;  // OnCancel ran (under seq_mu_)
  StreamStatus final_status_ = StreamStatus::kOk;
  std::string final_message_;

  OutboxWriter<v1::GenerateResponse> writer_;
};

}  // namespace m3
