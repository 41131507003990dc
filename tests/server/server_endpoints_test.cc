// The server's other endpoints: the health service, GetModelInfo, and its listening port
// (a second server on it is refused).
#include <gtest/gtest.h>

#include <string>

#include "tests/error_of.h"
#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

// grpc.health.v1.Health/Check (its messages are tiny: field 1 = the service name in the
// request, field 1 = status in the response). The response's bytes, or the call's status
// when it fails.
std::string health_check(TestServer& server, const std::string& service) {
  std::string request_bytes;
  if (!service.empty()) request_bytes = std::string("\x0a", 1) + static_cast<char>(service.size()) + service;
  const RawCall call = raw_call(server, "/grpc.health.v1.Health/Check", request_bytes);
  return call.status.ok() ? call.bytes : "status " + std::to_string(call.status.error_code());
}

TEST(ServerEndpointsTest, HealthServiceSaysServing) {
  TestServer server;
  EXPECT_EQ(health_check(server, ""), std::string("\x08\x01", 2)) << "status SERVING";
  // By the service's name too (probes that name it got NOT_FOUND).
  EXPECT_EQ(health_check(server, "m3serve.v1.M3Serve"), std::string("\x08\x01", 2));
}

// gRPC would share the port (SO_REUSEPORT) and split the connections between the two.
TEST(ServerEndpointsTest, ASecondServerOnTheSamePortIsRefused) {
  TestServer first;
  ServerConfig config = test_config();
  config.listen = "127.0.0.1:" + std::to_string(first.app->port());
  const std::string msg = test::error_of([&] { ServerApp second(config, first.logger); });
  EXPECT_NE(msg.find("cannot listen for gRPC on " + config.listen), std::string::npos) << msg;
  EXPECT_TRUE(generate(*first.stub, generate_request(kPrompt, 3), 5s).status.ok());
}

TEST(ServerEndpointsTest, ModelInfo) {
  TestServer server;
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(server.stub->GetModelInfo(&ctx, {}, &info).ok());
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_EQ(info.vocab_size(), 512u);
  EXPECT_EQ(info.padded_vocab_size(), 512u);
  EXPECT_EQ(info.n_layer(), 2u);
  EXPECT_EQ(info.max_batch(), 4u);
  EXPECT_FALSE(info.has_tokenizer());
  EXPECT_FALSE(info.demo_model());
}

}  // namespace
}  // namespace m3::test
