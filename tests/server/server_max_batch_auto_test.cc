// max_batch auto on the CPU backend: one slot per engine thread, at least 8, said in the
// start log; state_dtype bf16 serves on the CPU backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

uint32_t served_max_batch(TestServer& server) {
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  EXPECT_TRUE(server.stub->GetModelInfo(&ctx, {}, &info).ok());
  return info.max_batch();
}

bool logged(TestServer& server, const std::string& line) {
  const auto lines = server.sink->lines();
  return std::find(lines.begin(), lines.end(), line) != lines.end();
}

TEST(MaxBatchAutoTest, CpuTakesOneSlotPerThreadAtLeastEight) {
  ServerConfig config = test_config();
  config.max_batch = 0;  // auto
  config.cpu_threads = 2;
  TestServer few(config);
  EXPECT_EQ(served_max_batch(few), 8u);
  EXPECT_TRUE(logged(few, "max_batch auto: 8 (cpu engine, 2 cores; at least 8)"));

  config.cpu_threads = 12;
  TestServer many(config);
  EXPECT_EQ(served_max_batch(many), 12u);
  EXPECT_TRUE(logged(many, "max_batch auto: 12 (cpu engine, 12 cores)"));
}

TEST(MaxBatchAutoTest, AGivenMaxBatchIsKeptAndNotExplained) {
  TestServer server;  // max_batch 4
  EXPECT_EQ(served_max_batch(server), 4u);
  for (const std::string& line : server.sink->lines()) EXPECT_EQ(line.find("max_batch auto"), std::string::npos) << line;
}

TEST(MaxBatchAutoTest, Bf16StateServesOnTheCpuBackend) {
  ServerConfig config = test_config();
  config.state_dtype = "bf16";
  TestServer server(config);
  const auto result = generate(*server.stub, generate_request(kPrompt, 12), 10s);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.tokens.size(), 12u);
}

}  // namespace
}  // namespace m3::test
