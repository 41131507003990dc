// The m3serve.v1.M3Serve service on gRPC's callback API: each stream is a reactor
// (GenerateReactor, ConverseReactor) and holds no thread while it waits. The two streams
// read and write bytes (gRPC's raw methods) and parse and serialize the messages
// themselves, so that a request protobuf cannot parse is refused by the server
// (wire_messages.h).
#pragma once

#include "m3serve.grpc.pb.h"
#include "server/service_context.h"

namespace m3 {

// Snapshot methods (snapshot_calls.h).
using M3ServeSnapshotMethods = v1::M3Serve::WithCallbackMethod_CreateSnapshot<
    v1::M3Serve::WithCallbackMethod_GetSnapshot<v1::M3Serve::WithCallbackMethod_DeleteSnapshot<v1::M3Serve::Service>>>;
using M3ServeServiceBase = v1::M3Serve::WithRawCallbackMethod_Generate<
    v1::M3Serve::WithRawCallbackMethod_Converse<v1::M3Serve::WithCallbackMethod_GetModelInfo<M3ServeSnapshotMethods>>>;

class M3ServeService final : public M3ServeServiceBase {
 public:
  explicit M3ServeService(ServiceContext& context) : context_(context) {}

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(grpc::CallbackServerContext* call,
                                                       const grpc::ByteBuffer* request) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Converse(grpc::CallbackServerContext* call) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* call,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* CreateSnapshot(grpc::CallbackServerContext* call, const v1::CreateSnapshotRequest* request,
                                           v1::SnapshotInfo* response) override;
  grpc::ServerUnaryReactor* GetSnapshot(grpc::CallbackServerContext* call, const v1::SnapshotRef* request,
                                        v1::SnapshotInfo* response) override;
  grpc::ServerUnaryReactor* DeleteSnapshot(grpc::CallbackServerContext* call, const v1::SnapshotRef* request,
                                           v1::SnapshotInfo* response) override;

 private:
  ServiceContext& context_;
};

}  // namespace m3
