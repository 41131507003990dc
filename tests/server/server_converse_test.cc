// Converse sessions: turns that continue one sequence, input sent while a reply runs, the
// seed a session reports, and the bound on input that runs ahead of the replies.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

TEST(ConverseSessionTest, ThreeTurnConverseEqualsTheConcatenatedGenerate) {
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

TEST(ConverseSessionTest, ConverseInputSentDuringAReplyBelongsToTheNextTurn) {
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
TEST(ConverseSessionTest, ConverseReportsTheSeedItDrew) {
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
TEST(ConverseSessionTest, ConverseInputRunningAheadOfTheRepliesIsBounded) {
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

}  // namespace
}  // namespace m3::test
