// The m3serve.v1.M3Serve service on gRPC's callback API: each stream is a reactor
// (GenerateReactor, ConverseReactor) and holds no thread while it waits. The two streams
// read and write bytes (gRPC's raw methods) and parse and serialize the messages
// themselves, so that a request protobuf cannot parse is refused by the server
// (wire_messages.h).
#pragma once

#include "m3serve.grpc.pb.h"
#include "server/service_context.h"

namespace m3 {

using M3ServeServiceBase = v1::M3Serve::WithRawCallbackMethod_Generate<
    v1::M3Serve::WithRawCallbackMethod_Converse<v1::M3Serve::WithCallbackMethod_GetModelInfo<v1::M3Serve::Service>>>;

class M3ServeService final : public M3ServeServiceBase {
 public:
  explicit M3ServeService(ServiceContext& context) : context_(context) {}

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(grpc::CallbackServerContext* call,
                                                       const grpc::ByteBuffer* request) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Converse(grpc::CallbackServerContext* call) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* call,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;

 private:
  ServiceContext& context_;
};

}  // namespace m3
