// What the server records: metrics that add up to what the clients got, one log line a
// request whatever its length, and no client-chosen text that could forge a line.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

// A refused request_id is not what the log line names: a newline in it would forge a
// line, a huge one would write a huge line. The server's own id stands in for it.
TEST(MetricsAndLogTest, ARefusedRequestIdIsNotLogged) {
  TestServer server;
  v1::GenerateRequest forged = generate_request(kPrompt, 3);
  forged.set_request_id("x status=ok\nGenerate id=forged status=ok tokens_in=6");
  v1::GenerateRequest spaced = generate_request(kPrompt, 3);  // fields, not lines
  spaced.set_request_id("forged status=ok tokens_in=6 tokens_out=3");
  v1::GenerateRequest huge = generate_request(kPrompt, 3);
  huge.set_request_id(std::string(1 << 20, 'a'));
  for (const auto* request : {&forged, &spaced, &huge}) {
    const size_t before = server.sink->count();
    GenerateResult bad = generate(*server.stub, *request, 5s);
    EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    // (Logged as the call ends, just after the client sees its status.)
    ASSERT_TRUE(eventually([&] { return server.sink->count() > before; }));
    const auto lines = server.sink->lines();
    ASSERT_EQ(lines.size(), before + 1);
    const std::string& line = lines.back();
    EXPECT_EQ(line.find("Generate id=gen-"), 0u) << line.substr(0, 200);
    EXPECT_EQ(line.find('\n'), std::string::npos) << line.substr(0, 200);
    EXPECT_EQ(line.find("forged"), std::string::npos) << line.substr(0, 200);
    EXPECT_LT(line.size(), 300u);
    EXPECT_NE(line.find("status=invalid_argument"), std::string::npos) << line.substr(0, 200);
  }
}

TEST(MetricsAndLogTest, MetricsAddUp) {
  TestServer server;
  uint64_t tokens = 0;
  for (int n : {3, 7, 11, 1, 20}) {
    GenerateResult r = generate(*server.stub, generate_request(kPrompt, n));
    ASSERT_TRUE(r.status.ok());
    tokens += r.tokens.size();
  }
  generate(*server.stub, generate_request({}, 5));
  generate(*server.stub, generate_request(kPrompt, 0));
  ASSERT_TRUE(wait_for_requests(*server.app, "invalid_argument", 2));
  ASSERT_TRUE(wait_for_requests(*server.app, "ok", 5));
  // (A request is counted, then its duration observed: wait for the last observation.)
  ASSERT_TRUE(eventually([&] {
    return metric_value(server.app->metrics().serialize(), "m3serve_request_duration_seconds_count") == 7;
  }));
  const std::string text = server.app->metrics().serialize();
  EXPECT_EQ(metric_value(text, "m3serve_requests_total{status=\"ok\"}"), 5) << text;
  EXPECT_EQ(metric_value(text, "m3serve_requests_total{status=\"invalid_argument\"}"), 2);
  EXPECT_EQ(metric_value(text, "m3serve_tokens_generated_total"), static_cast<double>(tokens));
  // Every accepted request had one first token; every later token one inter-token gap.
  EXPECT_EQ(metric_value(text, "m3serve_time_to_first_token_seconds_count"), 5) << text;
  EXPECT_EQ(metric_value(text, "m3serve_inter_token_latency_seconds_count"),
            static_cast<double>(tokens - 5));
  EXPECT_EQ(metric_value(text, "m3serve_request_duration_seconds_count"), 7);
  EXPECT_EQ(metric_value(text, "m3serve_active_sequences"), 0);
  EXPECT_EQ(metric_value(text, "m3serve_queue_depth"), 0);
}

TEST(MetricsAndLogTest, LogLinesDoNotGrowWithTokens) {
  TestServer server;
  auto lines_for = [&](uint32_t max_new) {
    const size_t before = server.sink->count();
    GenerateResult r = generate(*server.stub, generate_request(kPrompt, max_new));
    EXPECT_TRUE(r.status.ok());
    EXPECT_EQ(r.tokens.size(), max_new);
    // The line is written as the stream ends; give the server a moment.
    for (int i = 0; i < 200 && server.sink->count() == before; ++i) std::this_thread::sleep_for(5ms);
    std::this_thread::sleep_for(20ms);
    return server.sink->count() - before;
  };
  const size_t short_lines = lines_for(10);
  const size_t long_lines = lines_for(200);
  EXPECT_EQ(short_lines, 1u);
  EXPECT_EQ(long_lines, short_lines);
  const auto lines = server.sink->lines();
  EXPECT_NE(lines.back().find("tokens_out=200"), std::string::npos) << lines.back();
  EXPECT_NE(lines.back().find("status=ok"), std::string::npos) << lines.back();
}

}  // namespace
}  // namespace m3::test
