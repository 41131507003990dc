// Messages to and from the bytes gRPC carries, for the streams that read and write their
// own (M3ServeService's Generate and Converse): a request protobuf cannot parse (broken
// bytes, or a text field that is not UTF-8) is then refused by the server with INVALID_ARGUMENT and counted,
// where gRPC 1.51 failed the call itself with UNIMPLEMENTED and no message.
#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "m3serve.grpc.pb.h"
#include "server/unparsable_message.h"

namespace m3 {

// Parses `bytes` into `message` (emptying `bytes`, as gRPC's reader does). Returns "" or,
// when protobuf cannot, why not: "could not be parsed as this method's request: " and
// what is wrong (unparsable_message.h: bytes that are no protobuf encoding, or the text
// field that is not UTF-8).
template <class Message>
std::string parse_message(grpc::ByteBuffer* bytes, Message* message) {
  const grpc::ByteBuffer kept(*bytes);  // (shares the slices)
  if (grpc::SerializationTraits<Message>::Deserialize(bytes, message).ok()) return "";
  std::vector<grpc::Slice> slices;
  std::string flat;
  if (kept.Valid() && kept.Dump(&slices).ok())
    for (const grpc::Slice& slice : slices) flat.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  return "could not be parsed as this method's request: " + why_unparsable(flat, *Message::descriptor());
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
