// The snapshot side of the API: CreateSnapshot (a prompt read into a state by the
// scheduler, then stored), GetSnapshot, DeleteSnapshot, and the pieces Generate and
// Converse use: a snapshot read into the state a sequence starts from, and a sequence's
// saved state stored and handed back to its stream (SaveSnapshot -> SnapshotSaved).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "m3serve.grpc.pb.h"
#include "server/sequence.h"
#include "server/service_context.h"

namespace m3 {

// The state stored under `id` for a sequence to start from; on failure the status
// (NOT_FOUND, FAILED_PRECONDITION, DATA_LOSS, UNAVAILABLE, ...) and *error says why.
// Blocks on the store: callers run it on the snapshot worker (SnapshotService::post), so that
// a slow or unreachable store holds no gRPC thread.
StreamStatus load_snapshot(ServiceContext& ctx, const std::string& id, std::shared_ptr<const SequenceState>* state,
                           std::string* error);

// SequenceParams::on_state_saved of a Converse session: stores the state on the snapshot
// worker, then hands the id to the session's stream (SnapshotSaved), or ends the session
// with the store's error.
std::function<void(const std::shared_ptr<Sequence>&, SequenceState)> saved_state_handler(ServiceContext& ctx);

void create_snapshot(ServiceContext& ctx, grpc::CallbackServerContext* call, const v1::CreateSnapshotRequest* request,
                     v1::SnapshotInfo* response, grpc::ServerUnaryReactor* reactor);
void get_snapshot(ServiceContext& ctx, const v1::SnapshotRef* request, v1::SnapshotInfo* response,
                  grpc::ServerUnaryReactor* reactor);
void delete_snapshot(ServiceContext& ctx, const v1::SnapshotRef* request, v1::SnapshotInfo* response,
                     grpc::ServerUnaryReactor* reactor);

}  // namespace m3
