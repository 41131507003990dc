// Idle Converse sessions off the slots (session_swap_after_s): with 8 slots, 100 sessions
// stay open, and each answers its next turn exactly as the engine does for the whole
// conversation; the host buffers of swapped states are reused; max_sessions bounds the
// sessions open.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "server/metrics.h"
#include "server_test_support.h"

namespace m3::test {
namespace {

using ::testing::HasSubstr;

using Stream = grpc::ClientReaderWriter<v1::ConverseRequest, v1::ConverseResponse>;

struct OpenSession {
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream;
  std::vector<int32_t> history;  // every token of the conversation so far, replies included
};

std::vector<int32_t> turn(OpenSession& s, const std::vector<int32_t>& input) {
  v1::ConverseRequest in, end;
  for (int32_t t : input) in.mutable_input()->add_ids(t);
  end.mutable_end_turn();
  s.stream->Write(in);
  s.stream->Write(end);
  std::vector<int32_t> reply;
  v1::ConverseResponse response;
  while (s.stream->Read(&response) && !response.has_turn_finished())
    for (int32_t t : response.tokens().ids()) reply.push_back(t);
  s.history.insert(s.history.end(), input.begin(), input.end());
  s.history.insert(s.history.end(), reply.begin(), reply.end());
  return reply;
}

void start(OpenSession& s, v1::M3Serve::Stub& stub, uint64_t seed) {
  s.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  s.stream = stub.Converse(&s.ctx);
  v1::ConverseRequest config;
  config.mutable_config()->set_max_new_tokens(5);
  config.mutable_config()->mutable_sampling()->set_temperature(0.8f);
  config.mutable_config()->mutable_sampling()->set_seed(seed);
  s.stream->Write(config);
}

TEST(SessionSwap, EightSlotsHoldAHundredOpenSessionsThatEachAnswerExactly) {
  ServerConfig config = test_config();
  config.max_batch = 8;
  config.queue_capacity = 8;
  config.session_swap_after_s = 0.001;
  config.max_sessions = 100;
  TestServer server(config);
  constexpr int kSessions = 100;
  std::vector<std::unique_ptr<OpenSession>> sessions;
  for (int k = 0; k < kSessions; ++k) {
    sessions.push_back(std::make_unique<OpenSession>());
    start(*sessions.back(), *server.stub, 1000 + k);
    const std::vector<int32_t> input = {k % 200, (k * 7) % 200, 3};
    SamplingParams sampling;
    sampling.temperature = 0.8f;
    sampling.seed = 1000 + k;
    EXPECT_EQ(turn(*sessions.back(), input), engine_generate(input, 5, sampling)) << "session " << k;
  }
  // All open at once, at most 8 of them in a slot.
  for (int k = 0; k < kSessions; ++k) {
    OpenSession& s = *sessions[k];
    const std::vector<int32_t> input = {(k * 3) % 200, 9};
    std::vector<int32_t> whole = s.history;
    whole.insert(whole.end(), input.begin(), input.end());
    SamplingParams sampling;
    sampling.temperature = 0.8f;
    sampling.seed = 1000 + k;
    EXPECT_EQ(turn(s, input), engine_generate(whole, 5, sampling)) << "session " << k;
  }
  const std::string metrics = server.app->metrics().serialize();
  EXPECT_THAT(metrics, HasSubstr("m3serve_sessions_open 100"));
  // Every second turn but those of the (at most 8) sessions still in a slot came back in.
  const std::string series = "\nm3serve_session_swap_ins_total ";
  const size_t at = metrics.find(series);
  ASSERT_NE(at, std::string::npos) << metrics;
  EXPECT_GE(std::stod(metrics.substr(at + series.size())), kSessions - 8) << metrics;
  for (auto& s : sessions) {
    s->stream->WritesDone();
    v1::ConverseResponse response;
    while (s->stream->Read(&response)) {
    }
    EXPECT_TRUE(s->stream->Finish().ok());
  }
}

double metric_value(const std::string& metrics, const std::string& name) {
  const std::string series = "\n" + name + " ";
  const size_t at = metrics.find(series);
  if (at == std::string::npos) ADD_FAILURE() << name << " not in:\n" << metrics;
  return at == std::string::npos ? -1 : std::stod(metrics.substr(at + series.size()));
}

TEST(SessionSwap, StateBuffersAreReusedFromOneSwapToTheNext) {
  ServerConfig config = test_config();
  config.max_batch = 8;
  config.session_swap_after_s = 0.001;
  TestServer server(config);
  constexpr int kSessions = 3, kTurns = 6;
  std::vector<std::unique_ptr<OpenSession>> sessions;
  for (int k = 0; k < kSessions; ++k) {
    sessions.push_back(std::make_unique<OpenSession>());
    start(*sessions.back(), *server.stub, 50 + k);
  }
  // Round robin: each session idles while the others take their turns, so it leaves its
  // slot and comes back every turn.
  for (int t = 0; t < kTurns; ++t) {
    for (int k = 0; k < kSessions; ++k) {
      OpenSession& s = *sessions[k];
      const std::vector<int32_t> input = {(t * 11 + k) % 200, 4};
      std::vector<int32_t> whole = s.history;
      whole.insert(whole.end(), input.begin(), input.end());
      SamplingParams sampling;
      sampling.temperature = 0.8f;
      sampling.seed = 50 + k;
      ASSERT_EQ(turn(s, input), engine_generate(whole, 5, sampling)) << "session " << k << " turn " << t;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // past session_swap_after_s
    }
  }
  const std::string metrics = server.app->metrics().serialize();
  EXPECT_GE(metric_value(metrics, "m3serve_session_swap_ins_total"), kSessions * (kTurns - 1)) << metrics;
  // One buffer a session at most, however many swaps: none is made per swap.
  const double buffers = metric_value(metrics, "m3serve_session_state_buffers");
  EXPECT_GE(buffers, 1);
  EXPECT_LE(buffers, kSessions);
  EXPECT_EQ(metric_value(metrics, "m3serve_session_state_buffer_bytes"),
            buffers * static_cast<double>(server.app->engine().slot_state_bytes()));
  for (auto& s : sessions) {
    s->stream->WritesDone();
    v1::ConverseResponse response;
    while (s->stream->Read(&response)) {
    }
    EXPECT_TRUE(s->stream->Finish().ok());
  }
}

TEST(SessionSwap, MaxSessionsBoundsTheSessionsOpen) {
  ServerConfig config = test_config();
  config.session_swap_after_s = 0.001;
  config.max_sessions = 3;
  TestServer server(config);
  std::vector<std::unique_ptr<OpenSession>> sessions;
  for (int k = 0; k < 3; ++k) {
    sessions.push_back(std::make_unique<OpenSession>());
    start(*sessions.back(), *server.stub, k);
    turn(*sessions.back(), {1, 2});
  }
  OpenSession extra;
  start(extra, *server.stub, 9);
  v1::ConverseRequest in;
  in.mutable_input()->add_ids(4);
  extra.stream->Write(in);
  v1::ConverseResponse response;
  while (extra.stream->Read(&response)) {
  }
  const grpc::Status status = extra.stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(status.error_message(),
            "server at capacity: 3 Converse sessions are open (max_sessions); retry later");
  for (auto& s : sessions) {
    s->stream->WritesDone();
    while (s->stream->Read(&response)) {
    }
    EXPECT_TRUE(s->stream->Finish().ok());
  }
}

}  // namespace
}  // namespace m3::test
