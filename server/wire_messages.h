// Messages to and from the bytes gRPC carries, for the streams that read and write their
// own (M3ServeService's Generate and Converse): a request protobuf cannot parse (a text
// field that is not UTF-8) is then refused by the server with INVALID_ARGUMENT and counted,
// where gRPC 1.51 failed the call itself with UNIMPLEMENTED and no message.
#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <cstdio>
#include <cstdlib>

#include "m3serve.grpc.pb.h"

namespace m3 {

// Why a request that parse_message refused is refused (INVALID_ARGUMENT).
inline constexpr const char* kUnparsableMessage =
    "could not be parsed as this method's request (protobuf requires its text fields to be valid UTF-8)";

// Parses `bytes` into `message` (emptying `bytes`, as gRPC's reader does); false when
// protobuf cannot.
template <class Message>
bool parse_message(grpc::ByteBuffer* bytes, Message* message) {
  return grpc::SerializationTraits<Message>::Deserialize(bytes, message).ok();
}

// `message` as bytes for StartWrite, replacing what `bytes` held. Protobuf refuses only
// messages over 2 GiB; the server's are bounded by stream_buffer_tokens (at most 65536
// tokens and their text), so a failure is a defect, not an input.
template <class Message>
void serialize_message(const Message& message, grpc::ByteBuffer* bytes) {
  bytes->Clear();  // gRPC's writer asserts on a buffer that still holds the previous message
  bool own_buffer = false;
  if (!grpc::SerializationTraits<Message>::Serialize(message, bytes, &own_buffer).ok()) {
    std::fprintf(stderr, "m3serve: a %s of %zu bytes could not be serialized\n",
                 message.GetTypeName().c_str(), message.ByteSizeLong());
    std::abort();
  }
}

}  // namespace m3
