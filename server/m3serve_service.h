// The m3serve.v1.M3Serve service on gRPC's callback API: each stream is a reactor
// (GenerateReactor, ConverseReactor) and holds no thread while it waits.
#pragma once

#include "m3serve.grpc.pb.h"
#include "server/service_context.h"

namespace m3 {

class M3ServeService final : public v1::M3Serve::CallbackService {
 public:
  explicit M3ServeService(ServiceContext& context) : context_(context) {}

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* call,
                                                           const v1::GenerateRequest* request) override;
  grpc::ServerBidiReactor<v1::ConverseRequest, v1::ConverseResponse>* Converse(
      grpc::CallbackServerContext* call) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* call,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;

 private:
  ServiceContext& context_;
};

}  // namespace m3
