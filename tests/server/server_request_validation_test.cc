// Malformed requests (bad fields, protocol errors, bytes protobuf cannot parse) are
// INVALID_ARGUMENT with a message that says what is wrong, and the server keeps serving.
#include <gtest/gtest.h>

#include <grpcpp/generic/generic_stub.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

TEST(RequestValidationTest, MalformedRequestsAreInvalidArgumentAndTheServerKeepsServing) {
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
TEST(RequestValidationTest, APromptOfMaxPromptTokensFitsInAMessage) {
  ServerConfig config = test_config();
  config.max_prompt_tokens = 3'000'000;
  TestServer server(config);
  GenerateResult r = generate(*server.stub, generate_request(std::vector<int32_t>(2'500'000, 300), 0), 30s);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << r.status.error_message();
  EXPECT_EQ(r.status.error_message(), "max_new_tokens must be at least 1");
}

TEST(RequestValidationTest, ConverseProtocolErrorsAreInvalidArgument) {
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
       "message 2 could not be parsed as this method's request: its field input_text is not valid UTF-8 "
       "(protobuf requires text fields to be)"},
      {{not_utf8},  // (before the session started)
       "message 1 could not be parsed as this method's request: its field input_text is not valid UTF-8 "
       "(protobuf requires text fields to be)"},
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

// A request that protobuf cannot parse (text that is not UTF-8) is refused by the server
// (gRPC alone failed it with UNIMPLEMENTED and no message, unseen by the server), and
// protobuf writes a line about each one: those lines reach the server's log, rate-limited
// like its own warnings, instead of stderr one a request.
TEST(RequestValidationTest, UnparsableRequestsAreInvalidArgumentAndProtobufsLinesRateLimited) {
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
              "the request could not be parsed as this method's request: its field prompt_text is not valid UTF-8 "
              "(protobuf requires text fields to be)");
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

}  // namespace
}  // namespace m3::test
