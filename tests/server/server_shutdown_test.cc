// Shutdown: what was accepted is served within the grace, what outlives it is cancelled,
// sessions with nothing to finish end at once, and nothing new is accepted.
#include <gtest/gtest.h>

#include <future>
#include <optional>
#include <thread>
#include <vector>

#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

// Shutdown within its grace: the stream in flight runs to its end, the request waiting
// for its slot is then served, and both end ok; afterwards nothing is accepted.
TEST(ShutdownTest, ShutdownServesWhatWasAcceptedWithinTheGrace) {
  ServerConfig config = test_config();
  config.max_batch = 1;
  config.queue_capacity = 1;
  TestServer server(config);
  grpc::ClientContext running_ctx;
  // (Long enough to be decoding still when the second request queues, on a busy machine.)
  auto running = server.stub->Generate(&running_ctx, generate_request(kPrompt, 20000));
  v1::GenerateResponse response;
  ASSERT_TRUE(running->Read(&response));
  std::vector<int32_t> got(response.tokens().ids().begin(), response.tokens().ids().end());
  auto queued = std::async(std::launch::async, [&] { return generate(*server.stub, generate_request(kPrompt, 5)); });
  ASSERT_TRUE(eventually([&] {
    return server.app->metrics().serialize().find("m3serve_queue_depth 1") != std::string::npos;
  })) << "the second request never queued";

  std::thread stopper([&] { server.app->shutdown(300s); });  // a grace no test would wait out
  bool finished_by_length = false;
  while (running->Read(&response)) {
    if (response.has_tokens()) got.insert(got.end(), response.tokens().ids().begin(), response.tokens().ids().end());
    if (response.has_finished()) finished_by_length = response.finished().reason() == v1::FINISH_REASON_LENGTH;
  }
  EXPECT_TRUE(running->Finish().ok());
  EXPECT_TRUE(finished_by_length);
  EXPECT_EQ(got.size(), 20000u);
  const GenerateResult served = queued.get();
  EXPECT_TRUE(served.status.ok()) << served.status.error_message();
  EXPECT_EQ(served.tokens, engine_generate(kPrompt, 5));
  stopper.join();
  EXPECT_TRUE(wait_for_requests(*server.app, "ok", 2));
  EXPECT_FALSE(generate(*server.stub, generate_request(kPrompt, 3), 2s).status.ok());
}

TEST(ShutdownTest, ShutdownCancelsWhatOutlivesTheGracePeriod) {
  TestServer server;
  grpc::ClientContext ctx;
  auto reader = server.stub->Generate(&ctx, generate_request(kPrompt, 100000));
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  // A session between turns: it would wait for input forever.
  grpc::ClientContext session_ctx;
  auto session = server.stub->Converse(&session_ctx);
  v1::ConverseRequest input, end;
  input.mutable_input()->add_ids(5);
  end.mutable_end_turn()->set_max_new_tokens(2);
  ASSERT_TRUE(session->Write(input));
  ASSERT_TRUE(session->Write(end));
  v1::ConverseResponse turn;
  while (session->Read(&turn) && !turn.has_turn_finished()) {
  }

  std::thread stopper([&] { server.app->shutdown(200ms); });
  bool cancelled = false;
  while (reader->Read(&response))
    if (response.has_finished()) cancelled = response.finished().reason() == v1::FINISH_REASON_CANCELLED;
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(cancelled);
  while (session->Read(&turn)) {
  }
  grpc::Status session_status = session->Finish();
  EXPECT_EQ(session_status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(session_status.error_message(), "the server is shutting down");
  stopper.join();
  GenerateResult after = generate(*server.stub, generate_request(kPrompt, 3), 2s);
  EXPECT_FALSE(after.status.ok());
}

// A session replying when the grace runs out gets its reply so far and a TurnFinished
// saying it was cancelled, then UNAVAILABLE (the turn ends were dropped with the tokens).
TEST(ShutdownTest, ShutdownEndsASessionMidReplyWithItsTurnFinished) {
  TestServer server;
  grpc::ClientContext ctx;
  auto stream = server.stub->Converse(&ctx);
  v1::ConverseRequest input, end;
  input.mutable_input()->add_ids(5);
  end.mutable_end_turn()->set_max_new_tokens(100000);
  ASSERT_TRUE(stream->Write(input) && stream->Write(end));
  v1::ConverseResponse response;
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_TRUE(response.has_tokens());
  size_t tokens = response.tokens().ids_size();
  std::thread stopper([&] { server.app->shutdown(0s); });
  std::optional<v1::TurnFinished> finished;
  while (stream->Read(&response)) {
    if (response.has_tokens()) tokens += response.tokens().ids_size();
    if (response.has_turn_finished()) finished = response.turn_finished();
  }
  const grpc::Status status = stream->Finish();
  stopper.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(status.error_message(), "the server is shutting down");
  ASSERT_TRUE(finished.has_value()) << "no TurnFinished before the stream ended";
  EXPECT_EQ(finished->turn(), 0u);
  EXPECT_EQ(finished->reason(), v1::FINISH_REASON_CANCELLED);
  EXPECT_EQ(finished->timings().generated_tokens(), tokens);
}

// A session between turns has nothing to finish: shutdown ends it at once with
// UNAVAILABLE rather than holding on for the grace period (with the image's defaults,
// docker stop's SIGKILL came first).
TEST(ShutdownTest, ShutdownEndsASessionBetweenTurnsAtOnce) {
  TestServer server;
  grpc::ClientContext ctx;
  auto stream = server.stub->Converse(&ctx);
  one_reply_then_idle(*stream);
  const auto start = std::chrono::steady_clock::now();
  server.app->shutdown(300s);  // a grace no test would wait out
  EXPECT_LT(std::chrono::steady_clock::now() - start, 60s) << "shutdown waited for the idle session";
  v1::ConverseResponse response;
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(status.error_message(), "the server is shutting down");
}

// A Converse stream that has sent nothing has no session for the scheduler to cancel:
// shutdown ends it at once, with the status sessions get, without waiting out the grace.
TEST(ShutdownTest, ShutdownEndsAConverseStreamThatSentNothingAtOnce) {
  TestServer server;
  grpc::ClientContext ctx;
  auto stream = server.stub->Converse(&ctx);
  ASSERT_TRUE(eventually([&] { return server.app->sessions_not_started() == 1; }));
  const auto start = std::chrono::steady_clock::now();
  server.app->shutdown(300s);  // a grace no test would wait out
  EXPECT_LT(std::chrono::steady_clock::now() - start, 60s) << "shutdown waited for the stream";
  v1::ConverseResponse response;
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(status.error_message(), "the server is shutting down");
  EXPECT_EQ(requests_with_status(*server.app, "unavailable"), 1);
  EXPECT_EQ(server.app->sessions_not_started(), 0u);
}

}  // namespace
}  // namespace m3::test
