// Clients that read too slowly or not at all: their streams are cut (for the buffer, then
// for the stall) without holding up the others, and counted and logged for what they were.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

TEST(SlowReaderTest, SlowReaderIsCancelledAndOthersGoOn) {
  ServerConfig config = test_config();
  config.stream_buffer_tokens = 64;
  config.max_new_tokens_limit = 10'000'000;
  TestServer server(config);
  auto slow_stub = small_window_stub(server);  // and its client reads nothing
  grpc::ClientContext slow_ctx;
  auto slow = slow_stub->Generate(&slow_ctx, generate_request(kPrompt, 10'000'000));
  // It reads nothing: once 64 tokens are unread the server lets go of its slot (the
  // stream's status waits behind the messages already in flight).
  bool released = false;
  for (int i = 0; i < 500 && !released; ++i) {
    std::this_thread::sleep_for(10ms);
    const std::string text = server.app->metrics().serialize();
    released = metric_value(text, "m3serve_time_to_first_token_seconds_count") >= 1 &&
               metric_value(text, "m3serve_active_sequences") == 0;
  }
  ASSERT_TRUE(released);
  GenerateResult other = generate(*server.stub, generate_request(kPrompt, 30));
  EXPECT_TRUE(other.status.ok());
  EXPECT_EQ(other.tokens, engine_generate(kPrompt, 30));

  // When the slow client reads at last, it gets what was sent, then the reason.
  std::vector<int32_t> got;
  v1::GenerateResponse response;
  while (slow->Read(&response))
    for (int32_t id : response.tokens().ids()) got.push_back(id);
  grpc::Status status = slow->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(status.error_message(),
            "the client reads too slowly: 64 generated tokens were left unread "
            "(stream_buffer_tokens); stream cancelled");
  const std::vector<int32_t> expected = engine_generate(kPrompt, static_cast<int>(got.size()));
  EXPECT_EQ(got, expected) << "what did arrive is the stream's prefix";
  EXPECT_TRUE(wait_for_requests(*server.app, "resource_exhausted", 1));
  // Tokens "generated and sent to clients": what the clients got, not the slow stream's
  // unread tokens that were dropped, nor the one that overflowed its buffer.
  EXPECT_EQ(metric_value(server.app->metrics().serialize(), "m3serve_tokens_generated_total"),
            static_cast<double>(got.size() + other.tokens.size()));
  // Its log line (written just after the request counter): the tokens generated for it,
  // and the fewer that were sent.
  std::string line;
  EXPECT_TRUE(eventually([&] {
    for (const std::string& l : server.sink->lines())
      if (l.find("status=resource_exhausted") != std::string::npos) line = l;
    return !line.empty();
  }));
  EXPECT_NE(line.find(" tokens_sent=" + std::to_string(got.size()) + " "), std::string::npos) << line;
  const size_t out_at = line.find(" tokens_out=");
  ASSERT_NE(out_at, std::string::npos) << line;
  EXPECT_GT(std::stoul(line.substr(out_at + 12)), got.size()) << line;
}

// A client that never reads again: once the server has ended its stream (here for
// reading too slowly), the message in flight can never complete, so after
// stalled_stream_timeout_s the call is cancelled and the stream is over for the server too
// (recorded; before, it lived until the connection died).
TEST(SlowReaderTest, AStreamWhoseClientReadsNothingIsCutAfterTheStallTimeout) {
  ServerConfig config = test_config();
  config.stream_buffer_tokens = 64;
  config.max_new_tokens_limit = 10'000'000;
  config.stalled_stream_timeout_s = 0.5;
  TestServer server(config);
  auto stub = small_window_stub(server);
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, generate_request(kPrompt, 10'000'000));
  // (30 s: the stream's tokens, the stall and the sweep, on a slow machine.) Recorded as
  // what the client got: CANCELLED when cut, else RESOURCE_EXHAUSTED.
  const auto ended = [&] {
    return requests_with_status(*server.app, "resource_exhausted") + requests_with_status(*server.app, "cancelled");
  };
  for (auto waited = 0ms; waited < 30s && ended() < 1; waited += 10ms) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(ended(), 1) << "the stream was never cut";
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
  }
  // Cut (CANCELLED), unless its status still fitted in the client's window when it ended
  // (a busy machine's flusher can fall behind the engine, so the buffer overflows before
  // the window is full): then the client gets it.
  const grpc::StatusCode code = reader->Finish().error_code();
  EXPECT_TRUE(code == grpc::StatusCode::CANCELLED || code == grpc::StatusCode::RESOURCE_EXHAUSTED) << code;
  EXPECT_EQ(requests_with_status(*server.app, code == grpc::StatusCode::CANCELLED ? "cancelled" : "resource_exhausted"), 1);
  if (code == grpc::StatusCode::CANCELLED) {
    // (The sweeper logs after the cut, which may come after the call's end is recorded.)
    EXPECT_TRUE(eventually([&] {
      const auto lines = server.sink->lines();
      return std::any_of(lines.begin(), lines.end(), [](const std::string& line) {
        return line.find("cancelled 1 streams whose clients read nothing for 0.5s") != std::string::npos;
      });
    }));
  }
}

// The same for a stream the engine finished (every token made, the last ones in flight):
// the cut is the server's, and the log says so rather than blaming the client.
TEST(SlowReaderTest, AFinishedStreamWhoseClientReadsNothingIsCutAsTheServers) {
  ServerConfig config = test_config();
  config.stream_buffer_tokens = 4000;
  config.stalled_stream_timeout_s = 0.5;
  TestServer server(config);
  auto stub = small_window_stub(server);
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, generate_request(kPrompt, 4000));
  ASSERT_TRUE(wait_for_requests(*server.app, "cancelled", 1, 30s)) << "the stream was never cut";
  EXPECT_EQ(requests_with_status(*server.app, "ok"), 0);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(eventually([&] {
    const auto lines = server.sink->lines();
    return std::any_of(lines.begin(), lines.end(), [](const std::string& line) {
      return line.find("status=cancelled") != std::string::npos &&
             line.find("cancelled by the server: the client read nothing") != std::string::npos;
    });
  }));
}

}  // namespace
}  // namespace m3::test
