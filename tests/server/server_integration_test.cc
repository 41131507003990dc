// m3serve end to end over 127.0.0.1: the CPU engine, the tiny random model, real gRPC
// streams. What a stream carries must equal what the engine makes on its own.
#include <gtest/gtest.h>

#include <grpcpp/generic/generic_stub.h>

#include <functional>
#include <future>
#include <optional>
#include <regex>
#include <thread>

#include "server/metrics.h"
#include "tests/error_of.h"
#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

const std::vector<int32_t> kPrompt = {17, 3, 250, 99, 4, 411};

// The value of one series in the Prometheus text ("name{labels} value").
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

// Polls until the metric reaches `value` (the stream end is recorded just after the
// client sees it), for at most `limit`.
bool wait_for_requests(ServerApp& app, const std::string& status, double value,
                       std::chrono::milliseconds limit = 5s) {
  for (auto waited = 0ms; waited < limit; waited += 10ms) {
    if (requests_with_status(app, status) >= value) return true;
    std::this_thread::sleep_for(10ms);
  }
  return requests_with_status(app, status) >= value;
}

// Polls until `done` holds (what the server does after the client sees a stream end,
// or before it tells the client anything).
bool eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 500; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

TEST(ServerTest, GreedyStreamEqualsTheEngine) {
  TestServer server;
  GenerateResult r = generate(*server.stub, generate_request(kPrompt, 40));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, engine_generate(kPrompt, 40));
  ASSERT_TRUE(r.finished);
  EXPECT_EQ(r.finish.reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(r.finish.timings().prompt_tokens(), kPrompt.size());
  EXPECT_EQ(r.finish.timings().generated_tokens(), 40u);
  EXPECT_FALSE(r.finish.request_id().empty());
  EXPECT_GE(r.finish.timings().duration_ms(), r.finish.timings().time_to_first_token_ms());
}

TEST(ServerTest, StopTokenEndsTheStream) {
  TestServer server;
  const std::vector<int32_t> greedy = engine_generate(kPrompt, 30);
  const int32_t stop = greedy[5];
  v1::GenerateRequest request = generate_request(kPrompt, 30);
  request.add_stop_token_ids(stop);
  request.set_request_id("stop-test");
  GenerateResult r = generate(*server.stub, request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, engine_generate(kPrompt, 30, {}, {stop}));
  EXPECT_EQ(r.tokens.back(), stop);
  EXPECT_EQ(r.finish.reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(r.finish.request_id(), "stop-test");
}

TEST(ServerTest, SeededSamplingIsReproducible) {
  TestServer server;
  v1::GenerateRequest request = generate_request(kPrompt, 50);
  request.mutable_sampling()->set_temperature(1.3f);
  request.mutable_sampling()->set_top_k(100);
  request.mutable_sampling()->set_top_p(0.95f);
  request.mutable_sampling()->set_seed(1234);
  GenerateResult a = generate(*server.stub, request);
  GenerateResult b = generate(*server.stub, request);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.finish.seed(), 1234u);
  SamplingParams sampling{1.3f, 100, 0.95f, 1234};
  EXPECT_EQ(a.tokens, engine_generate(kPrompt, 50, sampling));
  EXPECT_NE(a.tokens, engine_generate(kPrompt, 50)) << "sampling made the greedy tokens";

  // Without a seed the server draws one and reports it; it reproduces the stream.
  request.mutable_sampling()->clear_seed();
  GenerateResult drawn = generate(*server.stub, request);
  ASSERT_TRUE(drawn.status.ok());
  request.mutable_sampling()->set_seed(drawn.finish.seed());
  EXPECT_EQ(generate(*server.stub, request).tokens, drawn.tokens);
}

struct ConverseTurn {
  std::vector<int32_t> tokens;
  v1::TurnFinished finished;
};

// The next reply on a Converse stream: its tokens up to its TurnFinished (left empty when
// the stream ends first).
template <class Stream>
ConverseTurn read_reply(Stream& stream) {
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

TEST(ServerTest, ThreeTurnConverseEqualsTheConcatenatedGenerate) {
  TestServer server;
  const std::vector<std::vector<int32_t>> turns = {{5, 6, 7, 8}, {100, 200}, {300, 301, 302}};
  for (float temperature : {0.0f, 0.9f}) {
    grpc::ClientContext ctx;
    auto stream = server.stub->Converse(&ctx);
    v1::ConverseRequest config;
    config.mutable_config()->set_max_new_tokens(12);
    config.mutable_config()->mutable_sampling()->set_temperature(temperature);
    config.mutable_config()->mutable_sampling()->set_seed(99);
    ASSERT_TRUE(stream->Write(config));
    std::vector<ConverseTurn> replies;
    for (const auto& turn : turns) {
      // Input arrives in pieces, as from a speech encoder.
      for (size_t i = 0; i < turn.size(); i += 2) {
        v1::ConverseRequest input;
        for (size_t j = i; j < std::min(turn.size(), i + 2); ++j) input.mutable_input()->add_ids(turn[j]);
        ASSERT_TRUE(stream->Write(input));
      }
      v1::ConverseRequest end;
      end.mutable_end_turn();
      ASSERT_TRUE(stream->Write(end));
      const ConverseTurn reply = read_reply(*stream);
      EXPECT_EQ(reply.finished.turn(), replies.size());
      EXPECT_EQ(reply.finished.seed(), 99u);
      EXPECT_EQ(reply.tokens.size(), 12u);
      replies.push_back(reply);
    }
    stream->WritesDone();
    grpc::Status status = stream->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();

    std::vector<int32_t> prompt;
    for (int k = 0; k < 3; ++k) {
      prompt.insert(prompt.end(), turns[k].begin(), turns[k].end());
      if (k < 2) prompt.insert(prompt.end(), replies[k].tokens.begin(), replies[k].tokens.end());
    }
    v1::GenerateRequest request = generate_request(prompt, 12);
    request.mutable_sampling()->set_temperature(temperature);
    request.mutable_sampling()->set_seed(99);
    GenerateResult whole = generate(*server.stub, request);
    ASSERT_TRUE(whole.status.ok());
    EXPECT_EQ(whole.tokens, replies[2].tokens) << "temperature " << temperature;
  }
}

TEST(ServerTest, ConverseInputSentDuringAReplyBelongsToTheNextTurn) {
  TestServer server;
  const std::vector<int32_t> t1 = {11, 12, 13}, t2 = {21, 22};
  grpc::ClientContext ctx;
  auto stream = server.stub->Converse(&ctx);
  v1::ConverseRequest config, in1, in2, end;
  config.mutable_config()->set_max_new_tokens(300);
  for (int32_t id : t1) in1.mutable_input()->add_ids(id);
  for (int32_t id : t2) in2.mutable_input()->add_ids(id);
  end.mutable_end_turn()->set_max_new_tokens(8);
  // Both turns are sent before any reply is read, and the client then closes its side:
  // the first reply is long enough to still be running when turn 2 arrives.
  v1::ConverseRequest long_end;
  long_end.mutable_end_turn();  // the session's 300
  for (const auto* m : {&config, &in1, &long_end, &in2, &end}) ASSERT_TRUE(stream->Write(*m));
  stream->WritesDone();
  std::vector<std::vector<int32_t>> replies(1);
  v1::ConverseResponse response;
  while (stream->Read(&response)) {
    if (response.has_tokens()) {
      for (int32_t id : response.tokens().ids()) replies.back().push_back(id);
    } else {
      replies.emplace_back();
    }
  }
  ASSERT_TRUE(stream->Finish().ok());
  ASSERT_EQ(replies.size(), 3u);  // two replies, then nothing after the last TurnFinished
  EXPECT_TRUE(replies[2].empty());
  EXPECT_EQ(replies[0], engine_generate(t1, 300));
  std::vector<int32_t> whole = t1;
  whole.insert(whole.end(), replies[0].begin(), replies[0].end());
  whole.insert(whole.end(), t2.begin(), t2.end());
  EXPECT_EQ(replies[1], engine_generate(whole, 8));
}

// One turn of a new session: `config`, then kPrompt and the turn's end; the reply.
ConverseTurn one_turn_session(v1::M3Serve::Stub& stub, const v1::ConverseRequest& config) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 30s);
  auto stream = stub.Converse(&ctx);
  v1::ConverseRequest input, end;
  for (int32_t id : kPrompt) input.mutable_input()->add_ids(id);
  end.mutable_end_turn();
  EXPECT_TRUE(stream->Write(config));
  EXPECT_TRUE(stream->Write(input));
  EXPECT_TRUE(stream->Write(end));
  stream->WritesDone();
  const ConverseTurn reply = read_reply(*stream);
  v1::ConverseResponse after;
  EXPECT_FALSE(stream->Read(&after)) << "a message after the session's one turn";
  const grpc::Status status = stream->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  return reply;
}

// A session that sets no seed gets one the server draws, reported at every turn's end
// (as Generate's Finished reports it): given back, it makes the same reply.
TEST(ServerTest, ConverseReportsTheSeedItDrew) {
  TestServer server;
  v1::ConverseRequest config;
  config.mutable_config()->set_max_new_tokens(20);
  config.mutable_config()->mutable_sampling()->set_temperature(1.0f);
  const ConverseTurn drawn = one_turn_session(*server.stub, config);
  ASSERT_EQ(drawn.tokens.size(), 20u);
  const SamplingParams sampling{1.0f, 0, 1.0f, drawn.finished.seed()};
  EXPECT_EQ(drawn.tokens, engine_generate(kPrompt, 20, sampling))
      << "seed " << drawn.finished.seed();

  config.mutable_config()->mutable_sampling()->set_seed(drawn.finished.seed());
  const ConverseTurn replayed = one_turn_session(*server.stub, config);
  EXPECT_EQ(replayed.finished.seed(), drawn.finished.seed());
  EXPECT_EQ(replayed.tokens, drawn.tokens);
}

// Starts a session whose first reply runs long (8 input tokens, max_new_tokens 100000),
// sends `ahead` once it runs (before reading any more of it), and returns the status.
grpc::Status send_turns_during_a_reply(v1::M3Serve::Stub& stub,
                                       const std::vector<v1::ConverseRequest>& ahead) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  auto stream = stub.Converse(&ctx);
  v1::ConverseRequest session, eight, end;
  session.mutable_config()->set_max_new_tokens(100000);
  for (int32_t id = 1; id <= 8; ++id) eight.mutable_input()->add_ids(id);
  end.mutable_end_turn();
  EXPECT_TRUE(stream->Write(session) && stream->Write(eight) && stream->Write(end));
  v1::ConverseResponse response;
  EXPECT_TRUE(stream->Read(&response));  // the reply runs: turn 0's input was all taken
  EXPECT_TRUE(response.has_tokens());
  for (const auto& m : ahead)
    if (!stream->Write(m)) break;
  stream->WritesDone();
  while (stream->Read(&response)) {
  }
  return stream->Finish();
}

// Turns sent while a reply runs wait for it; a client that keeps sending them is stopped
// once max_prompt_tokens of input wait (a turn with no input counts the one token it will
// feed), and its slot serves the next request.
TEST(ServerTest, ConverseInputRunningAheadOfTheRepliesIsBounded) {
  ServerConfig config = one_slot_config();
  config.max_prompt_tokens = 8;
  TestServer server(config);
  v1::ConverseRequest eight, end;
  for (int32_t id = 1; id <= 8; ++id) eight.mutable_input()->add_ids(id);
  end.mutable_end_turn();
  const std::string limit_message =
      " input tokens would wait to be fed to the model, this server's limit is 8 "
      "(max_prompt_tokens); wait for a reply before sending more turns";
  // Each turn is within the limit; the second one waiting is not.
  grpc::Status status = send_turns_during_a_reply(*server.stub, {eight, end, eight, end, eight, end});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_EQ(status.error_message(), "the session's input runs ahead of its replies: 16" + limit_message);
  ASSERT_TRUE(wait_for_requests(*server.app, "resource_exhausted", 1));
  // With one slot and no queue, this is refused unless the session gave its slot back.
  GenerateResult next = generate(*server.stub, generate_request(kPrompt, 3), 5s);
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();

  // Turns of end_turn alone: eight may wait, the ninth may not.
  status = send_turns_during_a_reply(*server.stub, std::vector<v1::ConverseRequest>(12, end));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_EQ(status.error_message(), "the session's input runs ahead of its replies: 9" + limit_message);
  next = generate(*server.stub, generate_request(kPrompt, 3), 5s);
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
}

TEST(ServerTest, CancellationFreesTheSlot) {
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

// Runs a Converse session with the given messages (no reads in between) and returns the
// final status.
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

// A Converse call cancelled before it sent anything (so before it had a session) is a
// cancellation in the metrics and the log; one the client closes having sent nothing is ok.
TEST(ServerTest, AConverseCancelledBeforeItsFirstMessageCountsAsCancelled) {
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

// Starts a session on `stream` that replies once (3 tokens to kPrompt) and is then
// between turns.
template <class Stream>
void one_reply_then_idle(Stream& stream) {
  v1::ConverseRequest config, input, end;
  config.mutable_config()->set_max_new_tokens(3);
  for (int32_t id : kPrompt) input.mutable_input()->add_ids(id);
  end.mutable_end_turn();
  ASSERT_TRUE(stream.Write(config) && stream.Write(input) && stream.Write(end));
  EXPECT_EQ(read_reply(stream).tokens.size(), 3u);
}

// A client that cancels an idle session (between turns) also ends its side of the
// stream; whichever of the two reaches the session first, the call counts as cancelled.
TEST(ServerTest, AnIdleConverseCancelledByItsClientCountsAsCancelled) {
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

TEST(ServerTest, DeadlineFreesTheSlot) {
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
TEST(ServerTest, AnIdleConverseSessionEndsAndFreesTheSlot) {
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
TEST(ServerTest, AConverseStreamThatSendsNothingEndsAfterTheIdleTimeout) {
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

// Streams that have sent nothing are bounded by the server's capacity (max_batch +
// queue_capacity); one that starts its session makes room.
TEST(ServerTest, ConverseStreamsThatSentNothingAreBounded) {
  TestServer server(one_slot_config());
  grpc::ClientContext first_ctx;
  auto first = server.stub->Converse(&first_ctx);
  ASSERT_TRUE(eventually([&] { return server.app->sessions_not_started() == 1; }));
  v1::ConverseRequest input, end;
  for (int32_t id : kPrompt) input.mutable_input()->add_ids(id);
  end.mutable_end_turn()->set_max_new_tokens(3);
  const grpc::Status refused = converse_status(*server.stub, {input, end});
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(refused.error_message(),
            "server at capacity: 1 Converse streams are open and have sent nothing yet (max_batch + "
            "queue_capacity); retry later");
  ASSERT_TRUE(first->Write(input) && first->Write(end));
  EXPECT_EQ(read_reply(*first).tokens.size(), 3u);
  first->WritesDone();
  EXPECT_TRUE(first->Finish().ok());
  EXPECT_TRUE(converse_status(*server.stub, {input, end}).ok());
}

TEST(ServerTest, OverCapacityIsResourceExhausted) {
  ServerConfig config = test_config();
  config.max_batch = 1;
  config.queue_capacity = 1;
  TestServer server(config);
  grpc::ClientContext running_ctx, waiting_ctx;
  auto running = server.stub->Generate(&running_ctx, generate_request(kPrompt, 100000));
  v1::GenerateResponse response;
  ASSERT_TRUE(running->Read(&response));  // it holds the slot
  auto waiting = server.stub->Generate(&waiting_ctx, generate_request(kPrompt, 4));
  // Let the second one reach the queue before the third arrives.
  ASSERT_TRUE(eventually([&] {
    return server.app->metrics().serialize().find("m3serve_queue_depth 1") != std::string::npos;
  })) << "the second request never queued";

  GenerateResult refused = generate(*server.stub, generate_request(kPrompt, 4), 5s);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.status.error_message().find("server at capacity"), std::string::npos)
      << refused.status.error_message();

  running_ctx.TryCancel();
  while (running->Read(&response)) {
  }
  running->Finish();
  // The queued request gets the slot and completes.
  std::vector<int32_t> got;
  while (waiting->Read(&response))
    for (int32_t id : response.tokens().ids()) got.push_back(id);
  EXPECT_TRUE(waiting->Finish().ok());
  EXPECT_EQ(got, engine_generate(kPrompt, 4));
}

// A Converse client that cancels while its reply streams: the session ends as cancelled
// and its slot serves the next request.
TEST(ServerTest, AConverseCancelledMidReplyFreesTheSlot) {
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

// A stub whose channel has a receive window of about 1 KB: a client that reads nothing
// stalls the server's writes once the window is full.
std::unique_ptr<v1::M3Serve::Stub> small_window_stub(TestServer& server) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt("grpc.http2.lookahead_bytes", 1024);
  args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, 1 << 20);
  return v1::M3Serve::NewStub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server.app->port()),
                                                        grpc::InsecureChannelCredentials(), args));
}

// A client that stops reading, then cancels after the engine made its last token (the
// tokens still waiting to be sent): it got CANCELLED, and that is what is recorded.
TEST(ServerTest, AGenerateCancelledAfterItsLastTokenWasMadeCountsAsCancelled) {
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

// With every slot busy and no queue, a new session is refused as a Generate would be,
// and the server goes on.
TEST(ServerTest, AConverseAtCapacityIsResourceExhausted) {
  TestServer server(one_slot_config());
  grpc::ClientContext running_ctx;
  auto running = server.stub->Generate(&running_ctx, generate_request(kPrompt, 100000));
  v1::GenerateResponse response;
  ASSERT_TRUE(running->Read(&response));  // it holds the slot
  v1::ConverseRequest input, end;
  for (int32_t id : kPrompt) input.mutable_input()->add_ids(id);
  end.mutable_end_turn()->set_max_new_tokens(3);
  const grpc::Status refused = converse_status(*server.stub, {input, end});
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("server at capacity"), std::string::npos) << refused.error_message();
  running_ctx.TryCancel();
  while (running->Read(&response)) {
  }
  running->Finish();
  ASSERT_TRUE(wait_for_requests(*server.app, "cancelled", 1));
  EXPECT_TRUE(converse_status(*server.stub, {input, end}).ok());
}

// Requests waiting for the one slot: one whose deadline passes and one its client cancels
// leave the queue with their own status, having streamed nothing; the slot then serves
// the next request.
TEST(ServerTest, AQueuedRequestItsClientGivesUpOnLeavesTheQueue) {
  ServerConfig config = test_config();
  config.max_batch = 1;
  config.queue_capacity = 2;
  TestServer server(config);
  auto queue_depth_is = [&](int depth) {
    return eventually([&] {
      return server.app->metrics().serialize().find("m3serve_queue_depth " + std::to_string(depth)) !=
             std::string::npos;
    });
  };
  grpc::ClientContext running_ctx;
  auto running = server.stub->Generate(&running_ctx, generate_request(kPrompt, 100000));
  v1::GenerateResponse response;
  ASSERT_TRUE(running->Read(&response));  // it holds the slot

  grpc::ClientContext timed_ctx, cancelled_ctx;
  timed_ctx.set_deadline(std::chrono::system_clock::now() + 4s);  // (both must queue before it)
  auto timed = server.stub->Generate(&timed_ctx, generate_request(kPrompt, 4));
  auto cancelled = server.stub->Generate(&cancelled_ctx, generate_request(kPrompt, 4));
  ASSERT_TRUE(queue_depth_is(2)) << "the two requests never queued";
  cancelled_ctx.TryCancel();
  EXPECT_FALSE(cancelled->Read(&response));
  EXPECT_EQ(cancelled->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_FALSE(timed->Read(&response));  // nothing streamed before its deadline
  EXPECT_EQ(timed->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ASSERT_TRUE(queue_depth_is(0));
  EXPECT_TRUE(wait_for_requests(*server.app, "cancelled", 1));
  EXPECT_TRUE(wait_for_requests(*server.app, "deadline_exceeded", 1));

  running_ctx.TryCancel();
  while (running->Read(&response)) {
  }
  running->Finish();
  GenerateResult next = generate(*server.stub, generate_request(kPrompt, 3), 5s);
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.tokens, engine_generate(kPrompt, 3));
}

// Shutdown within its grace: the stream in flight runs to its end, the request waiting
// for its slot is then served, and both end ok; afterwards nothing is accepted.
TEST(ServerTest, ShutdownServesWhatWasAcceptedWithinTheGrace) {
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

TEST(ServerTest, MalformedRequestsAreInvalidArgumentAndTheServerKeepsServing) {
  TestServer server;
  struct Case {
    std::string name;
    v1::GenerateRequest request;
    std::string message;
  };
  std::vector<Case> cases;
  auto add = [&](std::string name, v1::GenerateRequest r, std::string message) {
    cases.push_back({std::move(name), std::move(r), std::move(message)});
  };
  v1::GenerateRequest no_prompt;
  no_prompt.set_max_new_tokens(4);
  add("no prompt", no_prompt, "the prompt is empty: set prompt_ids or prompt_text");
  add("empty ids", generate_request({}, 4), "prompt_ids is empty: a prompt needs at least one token");
  add("id too large", generate_request({1, 512}, 4),
      "prompt_ids[1] = 512 is outside the model's vocabulary [0, 512)");
  add("negative id", generate_request({-3}, 4),
      "prompt_ids[0] = -3 is outside the model's vocabulary [0, 512)");
  add("zero max_new_tokens", generate_request(kPrompt, 0), "max_new_tokens must be at least 1");
  add("huge max_new_tokens", generate_request(kPrompt, 100001),
      "max_new_tokens = 100001 is above this server's limit of 100000 (max_new_tokens_limit)");
  auto r = generate_request(kPrompt, 4);
  r.mutable_sampling()->set_temperature(-0.5f);
  add("negative temperature", r, "sampling.temperature must be a finite number >= 0 (0 = greedy), got -0.5");
  r = generate_request(kPrompt, 4);
  r.mutable_sampling()->set_temperature(std::nanf(""));
  add("NaN temperature", r, "sampling.temperature must be a finite number >= 0 (0 = greedy), got nan");
  r = generate_request(kPrompt, 4);
  r.mutable_sampling()->set_top_k(-1);
  add("negative top_k", r, "sampling.top_k must be >= 0 (0 = no limit), got -1");
  r = generate_request(kPrompt, 4);
  r.mutable_sampling()->set_top_p(0.0f);
  add("zero top_p", r, "sampling.top_p must be in (0, 1], got 0");
  r = generate_request(kPrompt, 4);
  r.mutable_sampling()->set_top_p(1.5f);
  add("top_p above 1", r, "sampling.top_p must be in (0, 1], got 1.5");
  r = generate_request(kPrompt, 4);
  r.add_stop_token_ids(9999);
  add("stop id out of range", r, "stop_token_ids[0] = 9999 is outside the model's vocabulary [0, 512)");
  add("prompt over max_prompt_tokens", generate_request(std::vector<int32_t>(8193, 1), 4),
      "the prompt has 8193 tokens, this server's limit is 8192 (max_prompt_tokens)");
  r = generate_request(kPrompt, 4);
  for (int i = 0; i < 65; ++i) r.add_stop_token_ids(i);
  add("too many stop ids", r, "stop_token_ids has 65 ids, at most 64 are allowed");
  r = generate_request(kPrompt, 4);
  r.set_request_id(std::string(129, 'r'));
  add("long request_id", r, "request_id is 129 bytes long, at most 128 are allowed");
  r = generate_request(kPrompt, 4);
  r.set_request_id("tab\there");
  add("control character in request_id", r,
      "request_id contains the byte 0x09: ids may use letters, digits and . _ : @ / + - only");
  r = generate_request(kPrompt, 4);
  r.set_request_id("x status=ok");
  add("space in request_id", r, "request_id contains the byte 0x20: ids may use letters, digits and . _ : @ / + - only");
  v1::GenerateRequest text;
  text.set_prompt_text("hello");
  text.set_max_new_tokens(4);
  add("text without tokenizer", text,
      "prompt_text needs a tokenizer and this server has none (start it with --tokenizer FILE); "
      "send prompt_ids instead");

  for (const Case& c : cases) {
    GenerateResult bad = generate(*server.stub, c.request, 5s);
    EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
    EXPECT_EQ(bad.status.error_message(), c.message) << c.name;
    EXPECT_TRUE(bad.tokens.empty()) << c.name;
    GenerateResult good = generate(*server.stub, generate_request(kPrompt, 3), 5s);
    EXPECT_TRUE(good.status.ok()) << "after " << c.name << ": " << good.status.error_message();
  }
}


// The server takes a request as large as max_prompt_tokens allows, past gRPC's default
// of 4 MiB: 2.5 million ids in 5 MB reach the service, which refuses them for what they
// ask (no tokens to generate), not for their size.
TEST(ServerTest, APromptOfMaxPromptTokensFitsInAMessage) {
  ServerConfig config = test_config();
  config.max_prompt_tokens = 3'000'000;
  TestServer server(config);
  GenerateResult r = generate(*server.stub, generate_request(std::vector<int32_t>(2'500'000, 300), 0), 30s);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << r.status.error_message();
  EXPECT_EQ(r.status.error_message(), "max_new_tokens must be at least 1");
}

// A refused request_id is not what the log line names: a newline in it would forge a
// line, a huge one would write a huge line. The server's own id stands in for it.
TEST(ServerTest, ARefusedRequestIdIsNotLogged) {
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

TEST(ServerTest, ConverseProtocolErrorsAreInvalidArgument) {
  TestServer server;
  v1::ConverseRequest config, input, bad_input, end, empty, text, long_reply, end_no_limit;
  v1::ConverseRequest bad_id, huge_limit, bad_top_p, bad_stop, long_turn, not_utf8;
  config.mutable_config()->set_max_new_tokens(4);
  bad_id.mutable_config()->set_session_id("line\nbreak");
  huge_limit.mutable_config()->set_max_new_tokens(200000);
  bad_top_p.mutable_config()->mutable_sampling()->set_top_p(0.0f);
  bad_stop.mutable_config()->add_stop_token_ids(600);
  for (int i = 0; i < 8193; ++i) long_turn.mutable_input()->add_ids(1);
  input.mutable_input()->add_ids(10);
  bad_input.mutable_input()->add_ids(600);
  end.mutable_end_turn();
  text.set_input_text("hi");
  not_utf8.set_input_text("caf\xe9");  // (the client's protobuf sends it, saying so in its log)
  long_reply.mutable_end_turn()->set_max_new_tokens(200000);
  end_no_limit.mutable_end_turn();
  struct Case {
    std::vector<v1::ConverseRequest> messages;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{input, config}, "config must be the first message of a session; it came as message 2"},
      {{config, end}, "end_turn before any input: the first turn needs at least one input token"},
      {{config, empty}, "message 2 has no event set: send config, input, input_text or end_turn"},
      {{config, bad_input}, "input.ids[0] = 600 is outside the model's vocabulary [0, 512)"},
      {{config, text},
       "input_text needs a tokenizer and this server has none (start it with --tokenizer FILE); "
       "send input token ids instead"},
      {{config, input, long_reply},
       "end_turn.max_new_tokens = 200000 is above this server's limit of 100000 (max_new_tokens_limit)"},
      {{input, end_no_limit},
       "end_turn.max_new_tokens is 0 and the session config sets no max_new_tokens: one of them "
       "must bound the reply"},
      {{bad_id, input, end},
       "config.session_id contains the byte 0x0a: ids may use letters, digits and . _ : @ / + - only"},
      {{huge_limit, input, end},
       "config.max_new_tokens = 200000 is above this server's limit of 100000 (max_new_tokens_limit)"},
      {{bad_top_p, input, end}, "config.sampling.top_p must be in (0, 1], got 0"},
      {{bad_stop, input, end}, "config.stop_token_ids[0] = 600 is outside the model's vocabulary [0, 512)"},
      // (Turns count from 0, as TurnFinished.turn does.)
      {{config, long_turn, end}, "turn 0 has 8193 input tokens, this server's limit is 8192 (max_prompt_tokens)"},
      {{config, not_utf8},
       "message 2 could not be parsed as this method's request (protobuf requires its text fields to be valid UTF-8)"},
      {{not_utf8},  // (before the session started)
       "message 1 could not be parsed as this method's request (protobuf requires its text fields to be valid UTF-8)"},
  };
  for (const Case& c : cases) {
    grpc::Status status = converse_status(*server.stub, c.messages);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.message;
    EXPECT_EQ(status.error_message(), c.message);
  }
  // Still serving, and a correct session works.
  EXPECT_TRUE(converse_status(*server.stub, {config, input, end}).ok());
  EXPECT_TRUE(generate(*server.stub, generate_request(kPrompt, 3)).status.ok());
}

TEST(ServerTest, MetricsAddUp) {
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

TEST(ServerTest, LogLinesDoNotGrowWithTokens) {
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

TEST(ServerTest, ThirtyTwoConcurrentStreamsLoseNothing) {
  ServerConfig config = test_config();
  config.max_batch = 8;
  config.queue_capacity = 32;
  TestServer server(config);
  std::vector<std::future<GenerateResult>> results;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 32; ++i) prompts.push_back({i, (i * 37) % 512, 5, (i * 11) % 512});
  for (int i = 0; i < 32; ++i) {
    results.push_back(std::async(std::launch::async, [&, i] {
      return generate(*server.stub, generate_request(prompts[i], 24 + i));
    }));
  }
  for (int i = 0; i < 32; ++i) {
    GenerateResult r = results[i].get();
    ASSERT_TRUE(r.status.ok()) << i << ": " << r.status.error_message();
    EXPECT_EQ(r.tokens, engine_generate(prompts[i], 24 + i)) << "stream " << i;
    EXPECT_EQ(r.finish.timings().generated_tokens(), static_cast<uint32_t>(24 + i));
  }
}

TEST(ServerTest, SlowReaderIsCancelledAndOthersGoOn) {
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
TEST(ServerTest, AStreamWhoseClientReadsNothingIsCutAfterTheStallTimeout) {
  ServerConfig config = test_config();
  config.stream_buffer_tokens = 64;
  config.max_new_tokens_limit = 10'000'000;
  config.stalled_stream_timeout_s = 0.5;
  TestServer server(config);
  auto stub = small_window_stub(server);
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, generate_request(kPrompt, 10'000'000));
  // (30 s: the stream's tokens, the stall and the sweep, on a slow machine.)
  ASSERT_TRUE(wait_for_requests(*server.app, "resource_exhausted", 1, 30s)) << "the stream was never cut";
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
  }
  // Cut (CANCELLED), unless its status still fitted in the client's window when it ended
  // (a busy machine's flusher can fall behind the engine, so the buffer overflows before
  // the window is full): then the client gets it.
  const grpc::StatusCode code = reader->Finish().error_code();
  EXPECT_TRUE(code == grpc::StatusCode::CANCELLED || code == grpc::StatusCode::RESOURCE_EXHAUSTED) << code;
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
TEST(ServerTest, AFinishedStreamWhoseClientReadsNothingIsCutAsTheServers) {
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

TEST(ServerTest, ConcurrentStreamsShareEngineSteps) {
  ServerConfig config = test_config();
  config.max_batch = 4;
  TestServer server(config);
  const uint64_t steps_before = server.app->engine().stats().steps;
  std::vector<std::future<GenerateResult>> results;
  for (int i = 0; i < 4; ++i)
    results.push_back(std::async(std::launch::async, [&, i] {
      return generate(*server.stub, generate_request({i + 1, 2, 3}, 1500));
    }));
  for (auto& r : results) ASSERT_TRUE(r.get().status.ok());
  // One step per token for the whole batch: 4 streams of 3 + 1500 tokens need far
  // fewer steps than 4 * 1503 when they run together.
  const uint64_t steps = server.app->engine().stats().steps - steps_before;
  // (At least 1500 steps shared: a bound that holds however the four client threads are
  // scheduled, short of one finishing before another starts.)
  EXPECT_LT(steps, 4u * 1503u - 1500u) << "the streams did not share steps";
  EXPECT_GE(steps, 1502u);
}

// One request of `method` as raw bytes through a generic stub, as a unary call: the
// call's status and, when it is OK, the response's bytes.
struct RawCall {
  grpc::Status status;
  std::string bytes;
};
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

// A call of `method` that sends no message at all (the client half-closes at once): its
// status.
grpc::Status call_without_message(TestServer& server, const std::string& method) {
  grpc::GenericStub generic(server.channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  auto call = generic.PrepareCall(&ctx, method, &cq);
  void* tag = nullptr;
  bool ok = false;
  call->StartCall(reinterpret_cast<void*>(1));
  EXPECT_TRUE(cq.Next(&tag, &ok));
  call->WritesDone(reinterpret_cast<void*>(2));
  EXPECT_TRUE(cq.Next(&tag, &ok));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(3));
  EXPECT_TRUE(cq.Next(&tag, &ok));
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

// grpc.health.v1.Health/Check (its messages are tiny: field 1 = the service name in the
// request, field 1 = status in the response). The response's bytes, or the call's status
// when it fails.
std::string health_check(TestServer& server, const std::string& service) {
  std::string request_bytes;
  if (!service.empty()) request_bytes = std::string("\x0a", 1) + static_cast<char>(service.size()) + service;
  const RawCall call = raw_call(server, "/grpc.health.v1.Health/Check", request_bytes);
  return call.status.ok() ? call.bytes : "status " + std::to_string(call.status.error_code());
}

// A request that protobuf cannot parse (text that is not UTF-8) is refused by the server
// (gRPC alone failed it with UNIMPLEMENTED and no message, unseen by the server), and
// protobuf writes a line about each one: those lines reach the server's log, rate-limited
// like its own warnings, instead of stderr one a request.
TEST(ServerTest, UnparsableRequestsAreInvalidArgumentAndProtobufsLinesRateLimited) {
  TestServer server;
  // GenerateRequest{prompt_text: "a\xff", max_new_tokens: 2}
  const std::string not_utf8("\x1a\x02"
                             "a\xff"
                             "\x20\x02",
                             6);
  for (int i = 0; i < 20; ++i) {
    const grpc::Status status = raw_call(server, "/m3serve.v1.M3Serve/Generate", not_utf8).status;
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << i;
    EXPECT_EQ(status.error_message(),
              "the request could not be parsed as this method's request (protobuf requires its text fields "
              "to be valid UTF-8)");
  }
  EXPECT_TRUE(wait_for_requests(*server.app, "invalid_argument", 20));
  const grpc::Status none = call_without_message(server, "/m3serve.v1.M3Serve/Generate");
  EXPECT_EQ(none.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(none.error_message(), "the call carried no GenerateRequest message");
  size_t routed = 0;
  for (const std::string& line : server.sink->lines())
    if (line.rfind("protobuf: String field 'm3serve.v1.GenerateRequest.prompt_text' contains invalid UTF-8", 0) == 0)
      ++routed;
  EXPECT_GE(routed, 1u);
  EXPECT_LE(routed, 5u);  // RequestLog's burst a kind
  const GenerateResult after = generate(*server.stub, generate_request(kPrompt, 3));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.tokens, engine_generate(kPrompt, 3));
}

TEST(ServerTest, HealthServiceSaysServing) {
  TestServer server;
  EXPECT_EQ(health_check(server, ""), std::string("\x08\x01", 2)) << "status SERVING";
  // By the service's name too (probes that name it got NOT_FOUND).
  EXPECT_EQ(health_check(server, "m3serve.v1.M3Serve"), std::string("\x08\x01", 2));
}

// gRPC would share the port (SO_REUSEPORT) and split the connections between the two.
TEST(ServerTest, ASecondServerOnTheSamePortIsRefused) {
  TestServer first;
  ServerConfig config = test_config();
  config.listen = "127.0.0.1:" + std::to_string(first.app->port());
  const std::string msg = test::error_of([&] { ServerApp second(config, first.logger); });
  EXPECT_NE(msg.find("cannot listen for gRPC on " + config.listen), std::string::npos) << msg;
  EXPECT_TRUE(generate(*first.stub, generate_request(kPrompt, 3), 5s).status.ok());
}

TEST(ServerTest, ModelInfo) {
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

TEST(ServerTest, ShutdownCancelsWhatOutlivesTheGracePeriod) {
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
TEST(ServerTest, ShutdownEndsASessionMidReplyWithItsTurnFinished) {
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
TEST(ServerTest, ShutdownEndsASessionBetweenTurnsAtOnce) {
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
TEST(ServerTest, ShutdownEndsAConverseStreamThatSentNothingAtOnce) {
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
