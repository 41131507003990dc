// The client calls, metric reads and polls declared in server_test_support.h.
#include "tests/server/server_test_support.h"

#include <gtest/gtest.h>

#include <grpcpp/generic/generic_stub.h>

#include <sstream>
#include <thread>

namespace m3::test {

using namespace std::chrono_literals;

double metric_value(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return -1;
}

double requests_with_status(ServerApp& app, const std::string& status) {
  return metric_value(app.metrics().serialize(),
                      "m3serve_requests_total{status=\"" + status + "\"}");
}

bool wait_for_requests(ServerApp& app, const std::string& status, double value,
                       std::chrono::milliseconds limit) {
  for (auto waited = 0ms; waited < limit; waited += 10ms) {
    if (requests_with_status(app, status) >= value) return true;
    std::this_thread::sleep_for(10ms);
  }
  return requests_with_status(app, status) >= value;
}

bool eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 500; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

ConverseTurn read_reply(ConverseStream& stream) {
  ConverseTurn reply;
  v1::ConverseResponse response;
  while (stream.Read(&response)) {
    if (!response.has_tokens()) {
      reply.finished = response.turn_finished();
      break;
    }
    for (int32_t id : response.tokens().ids()) reply.tokens.push_back(id);
  }
  return reply;
}

grpc::Status converse_status(v1::M3Serve::Stub& stub, const std::vector<v1::ConverseRequest>& messages) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  auto stream = stub.Converse(&ctx);
  for (const auto& m : messages)
    if (!stream->Write(m)) break;
  stream->WritesDone();
  v1::ConverseResponse response;
  while (stream->Read(&response)) {
  }
  return stream->Finish();
}

void one_reply_then_idle(ConverseStream& stream) {
  v1::ConverseRequest config, input, end;
  config.mutable_config()->set_max_new_tokens(3);
  for (int32_t id : kPrompt) input.mutable_input()->add_ids(id);
  end.mutable_end_turn();
  ASSERT_TRUE(stream.Write(config) && stream.Write(input) && stream.Write(end));
  EXPECT_EQ(read_reply(stream).tokens.size(), 3u);
}

std::unique_ptr<v1::M3Serve::Stub> small_window_stub(TestServer& server) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt("grpc.http2.lookahead_bytes", 1024);
  args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, 1 << 20);
  return v1::M3Serve::NewStub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server.app->port()),
                                                        grpc::InsecureChannelCredentials(), args));
}

RawCall raw_call(TestServer& server, const std::string& method, const std::string& request_bytes) {
  grpc::GenericStub generic(server.channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  grpc::Slice slice(request_bytes.data(), request_bytes.size());
  grpc::ByteBuffer request(&slice, 1), response;
  auto call = generic.PrepareUnaryCall(&ctx, method, request, &cq);
  call->StartCall();
  RawCall result;
  call->Finish(&response, &result.status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  EXPECT_TRUE(cq.Next(&tag, &ok));
  if (result.status.ok()) {
    std::vector<grpc::Slice> slices;
    EXPECT_TRUE(response.Dump(&slices).ok());
    for (const auto& s : slices) result.bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return result;
}

}  // namespace m3::test
