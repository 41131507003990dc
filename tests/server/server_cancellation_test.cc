// Clients that give up (cancel, pass their deadline, fall silent, never send): the call
// ends with its own status, is counted so, and its slot serves the next request.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

TEST(CancellationAndTimeoutTest, CancellationFreesTheSlot) {
  TestServer server(one_slot_config());
  {
    grpc::ClientContext ctx;
    auto reader = server.stub->Generate(&ctx, generate_request(kPrompt, 100000));
    v1::GenerateResponse response;
    ASSERT_TRUE(reader->Read(&response));
    ASSERT_TRUE(response.has_tokens());
    ctx.TryCancel();
    while (reader->Read(&response)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(wait_for_requests(*server.app, "cancelled", 1));
  // With one slot and no queue, this is refused unless the slot was freed.
  GenerateResult next = generate(*server.stub, generate_request(kPrompt, 5), 5s);
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.tokens, engine_generate(kPrompt, 5));
}

// A Converse call cancelled before it sent anything (so before it had a session) is a
// cancellation in the metrics and the log; one the client closes having sent nothing is ok.
TEST(CancellationAndTimeoutTest, AConverseCancelledBeforeItsFirstMessageCountsAsCancelled) {
  TestServer server;
  {
    grpc::ClientContext ctx;
    auto stream = server.stub->Converse(&ctx);
    ASSERT_TRUE(eventually([&] { return server.app->sessions_not_started() == 1; }));
    ctx.TryCancel();
    v1::ConverseResponse response;
    while (stream->Read(&response)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(wait_for_requests(*server.app, "cancelled", 1));
  EXPECT_EQ(requests_with_status(*server.app, "ok"), 0);
  EXPECT_TRUE(eventually([&] {
    const auto lines = server.sink->lines();
    return !lines.empty() && lines.back().find("Converse id=conv-1 status=cancelled") == 0;
  })) << "last log line: " << (server.sink->count() ? server.sink->lines().back() : "");

  EXPECT_TRUE(converse_status(*server.stub, {}).ok());
  ASSERT_TRUE(wait_for_requests(*server.app, "ok", 1));
  EXPECT_EQ(requests_with_status(*server.app, "cancelled"), 1);
}

// A client that cancels an idle session (between turns) also ends its side of the
// stream; whichever of the two reaches the session first, the call counts as cancelled.
TEST(CancellationAndTimeoutTest, AnIdleConverseCancelledByItsClientCountsAsCancelled) {
  TestServer server;
  constexpr int kSessions = 8;
  for (int i = 0; i < kSessions; ++i) {
    grpc::ClientContext ctx;
    auto stream = server.stub->Converse(&ctx);
    one_reply_then_idle(*stream);
    ctx.TryCancel();
    v1::ConverseResponse response;
    while (stream->Read(&response)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(wait_for_requests(*server.app, "cancelled", kSessions));
  EXPECT_EQ(requests_with_status(*server.app, "ok"), 0);
}

TEST(CancellationAndTimeoutTest, DeadlineFreesTheSlot) {
  TestServer server(one_slot_config());
  // Long enough for the first tokens to stream on a busy machine, then the deadline.
  GenerateResult r = generate(*server.stub, generate_request(kPrompt, 100000), 1500ms);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_FALSE(r.tokens.empty());
  ASSERT_TRUE(wait_for_requests(*server.app, "deadline_exceeded", 1));
  GenerateResult next = generate(*server.stub, generate_request(kPrompt, 3), 5s);
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
}

// A Converse client that stops talking without closing its stream: after its reply it
// has session_idle_timeout_s to send the next turn, then the session ends with
// DEADLINE_EXCEEDED and the one slot serves the next request.
TEST(CancellationAndTimeoutTest, AnIdleConverseSessionEndsAndFreesTheSlot) {
  ServerConfig config = one_slot_config();
  // (The idle clock also runs between the client's input and end_turn messages, so not
  // much shorter: a stalled test thread there would end the session before its turn.)
  config.session_idle_timeout_s = 1.0;
  TestServer server(config);
  grpc::ClientContext ctx;
  auto stream = server.stub->Converse(&ctx);
  v1::ConverseRequest input, end;
  for (int32_t id : kPrompt) input.mutable_input()->add_ids(id);
  end.mutable_end_turn()->set_max_new_tokens(4);
  ASSERT_TRUE(stream->Write(input));
  ASSERT_TRUE(stream->Write(end));
  std::vector<int32_t> reply;
  v1::ConverseResponse response;
  bool turn_finished = false;
  while (stream->Read(&response)) {
    if (response.has_tokens()) {
      for (int32_t id : response.tokens().ids()) reply.push_back(id);
    } else {
      turn_finished = response.has_turn_finished();
    }
  }
  const grpc::Status status = stream->Finish();
  EXPECT_TRUE(turn_finished);
  EXPECT_EQ(reply, engine_generate(kPrompt, 4));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_NE(status.error_message().find("session_idle_timeout_s"), std::string::npos)
      << status.error_message();
  GenerateResult next = generate(*server.stub, generate_request(kPrompt, 3), 5s);
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
}

// A Converse stream that never sends a message ends after the idle timeout as an idle
// session does (it held a reactor and a buffer with no end but shutdown).
TEST(CancellationAndTimeoutTest, AConverseStreamThatSendsNothingEndsAfterTheIdleTimeout) {
  ServerConfig config = test_config();
  config.session_idle_timeout_s = 0.5;
  TestServer server(config);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 20s);  // (the client's own: a different message)
  auto stream = server.stub->Converse(&ctx);
  v1::ConverseResponse response;
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(status.error_message(),
            "no message within 0.5 s of opening the stream (the server's session_idle_timeout_s); the stream "
            "was ended");
  EXPECT_TRUE(wait_for_requests(*server.app, "deadline_exceeded", 1));
  EXPECT_EQ(server.app->sessions_not_started(), 0u);
}

// A Converse client that cancels while its reply streams: the session ends as cancelled
// and its slot serves the next request.
TEST(CancellationAndTimeoutTest, AConverseCancelledMidReplyFreesTheSlot) {
  TestServer server(one_slot_config());
  {
    grpc::ClientContext ctx;
    auto stream = server.stub->Converse(&ctx);
    v1::ConverseRequest input, end;
    for (int32_t id : kPrompt) input.mutable_input()->add_ids(id);
    end.mutable_end_turn()->set_max_new_tokens(100000);
    ASSERT_TRUE(stream->Write(input) && stream->Write(end));
    v1::ConverseResponse response;
    ASSERT_TRUE(stream->Read(&response));
    ASSERT_TRUE(response.has_tokens());
    ctx.TryCancel();
    while (stream->Read(&response)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(wait_for_requests(*server.app, "cancelled", 1));
  GenerateResult next = generate(*server.stub, generate_request(kPrompt, 3), 5s);
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_TRUE(wait_for_requests(*server.app, "ok", 1));
  EXPECT_EQ(requests_with_status(*server.app, "cancelled"), 1);
}

// A client that stops reading, then cancels after the engine made its last token (the
// tokens still waiting to be sent): it got CANCELLED, and that is what is recorded.
TEST(CancellationAndTimeoutTest, AGenerateCancelledAfterItsLastTokenWasMadeCountsAsCancelled) {
  ServerConfig config = test_config();
  config.stream_buffer_tokens = 4000;
  TestServer server(config);
  auto stub = small_window_stub(server);
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, generate_request(kPrompt, 4000));
  bool made = false;  // (up to 30 s: a busy machine)
  for (int i = 0; i < 3000 && !made; ++i) {
    const std::string text = server.app->metrics().serialize();
    made = metric_value(text, "m3serve_time_to_first_token_seconds_count") == 1 &&
           metric_value(text, "m3serve_active_sequences") == 0;
    if (!made) std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(made) << "the engine did not finish the stream";
  ctx.TryCancel();
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(wait_for_requests(*server.app, "cancelled", 1));
  EXPECT_EQ(requests_with_status(*server.app, "ok"), 0);
}

}  // namespace
}  // namespace m3::test
