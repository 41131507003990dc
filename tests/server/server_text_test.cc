// m3serve with a SentencePiece tokenizer (through the dlopen'ed shim, in this gRPC
// process): text prompts are the same as their ids, replies stream their text too.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "model/tokenizer.h"
#include "server/outbox_writer.h"
#include "server/sequence.h"
#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

ServerConfig text_config() {
  ServerConfig c = test_config();
  c.tokenizer = M3_TEST_SPM_MODEL;
  return c;
}

TEST(ServerTextTest, TextPromptEqualsItsIdsAndRepliesCarryText) {
  TestServer server(text_config());
  auto tokenizer = Tokenizer::load(M3_TEST_SPM_MODEL);
  const std::string prompt = "the quick brown fox";
  const std::vector<int32_t> ids = tokenizer->encode(prompt);
  ASSERT_FALSE(ids.empty());

  v1::GenerateRequest request;
  request.set_prompt_text(prompt);
  request.set_max_new_tokens(40);
  grpc::ClientContext ctx;
  auto reader = server.stub->Generate(&ctx, request);
  std::vector<int32_t> got;
  std::string text;
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (!response.has_tokens()) continue;
    for (int32_t id : response.tokens().ids()) got.push_back(id);
    text += response.tokens().text();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(got, engine_generate(ids, 40));

  StreamDetokenizer detokenizer(*tokenizer);
  std::string expected;
  for (int32_t id : got) detokenizer.append(id, &expected);
  detokenizer.finish(&expected);  // as the server does at the reply's end
  EXPECT_EQ(text, expected);

  grpc::ClientContext info_ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(server.stub->GetModelInfo(&info_ctx, {}, &info).ok());
  EXPECT_TRUE(info.has_tokenizer());
}

TEST(ServerTextTest, ConverseTextInputEqualsItsIds) {
  TestServer server(text_config());
  auto tokenizer = Tokenizer::load(M3_TEST_SPM_MODEL);
  const std::string turn = "hello there";
  grpc::ClientContext ctx;
  auto stream = server.stub->Converse(&ctx);
  v1::ConverseRequest config, input, end;
  config.mutable_config()->set_max_new_tokens(10);
  input.set_input_text(turn);
  end.mutable_end_turn();
  ASSERT_TRUE(stream->Write(config));
  ASSERT_TRUE(stream->Write(input));
  ASSERT_TRUE(stream->Write(end));
  stream->WritesDone();
  std::vector<int32_t> got;
  v1::ConverseResponse response;
  while (stream->Read(&response))
    for (int32_t id : response.tokens().ids()) got.push_back(id);
  ASSERT_TRUE(stream->Finish().ok());
  EXPECT_EQ(got, engine_generate(tokenizer->encode(turn), 10));
}

// Text longer than 16 bytes a token of max_prompt_tokens is refused before it is
// tokenized (SentencePiece takes memory and time by the byte), and the server goes on.
TEST(ServerTextTest, TextTooLongForTheTokenLimitIsRefusedBeforeEncoding) {
  ServerConfig config = text_config();
  config.max_prompt_tokens = 8;
  TestServer server(config);
  const std::string text(129, 'a');
  const std::string why = " is 129 bytes, more than 16 for each of the 8 tokens this server takes "
                          "(max_prompt_tokens): at most 128";
  v1::GenerateRequest request;
  request.set_prompt_text(text);
  request.set_max_new_tokens(4);
  GenerateResult refused = generate(*server.stub, request, 5s);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(refused.status.error_message(), "prompt_text" + why);

  grpc::ClientContext ctx;
  auto stream = server.stub->Converse(&ctx);
  v1::ConverseRequest input;
  input.set_input_text(text);
  ASSERT_TRUE(stream->Write(input));
  v1::ConverseResponse response;
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "input_text" + why);

  request.set_prompt_text("hello");
  EXPECT_TRUE(generate(*server.stub, request, 5s).status.ok());
}

// Beside this executable lies a shim (as beside m3serve); an operator's M3_SPM_SHIM still
// wins, and a wrong one fails naming it rather than quietly loading the other.
TEST(ServerTextTest, TheShimEnvironmentVariableIsTheOnlyPlaceLookedAtWhenSet) {
  const auto beside = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "libm3_spm.so";
  ASSERT_TRUE(std::filesystem::exists(beside));
  ::setenv("M3_SPM_SHIM", "/nonexistent/libm3_spm.so", 1);
  EXPECT_EQ(Tokenizer::default_shim_path(), "/nonexistent/libm3_spm.so");
  std::string error;
  try {
    Tokenizer::load(M3_TEST_SPM_MODEL);
  } catch (const std::runtime_error& e) {
    error = e.what();
  }
  ::unsetenv("M3_SPM_SHIM");
  EXPECT_EQ(error, "tokenizer: SentencePiece shim /nonexistent/libm3_spm.so (from M3_SPM_SHIM) not found");
  EXPECT_EQ(Tokenizer::default_shim_path(), beside);
}

struct NoFlush : StreamWriter {
  void flush() override {}
};

// A reply cut short after the first two byte pieces of a four-byte character: its text
// ends with U+FFFD in a Tokens message of its own, before the turn's end, and the next
// turn's text starts clean (the held bytes were lost, or began the next reply's text).
TEST(ServerTextTest, AReplyEndingInsideACharacterEndsItsTextWithAReplacementCharacter) {
  auto tokenizer = Tokenizer::load(M3_TEST_SPM_MODEL);
  std::vector<int32_t> bytes;
  for (int32_t id : tokenizer->encode("🙂")) {
    const std::string_view piece = tokenizer->piece_bytes(id);
    if (piece.size() == 1 && static_cast<unsigned char>(piece[0]) >= 0x80) bytes.push_back(id);
  }
  ASSERT_EQ(bytes.size(), 4u) << "expected the emoji as byte pieces";
  ServiceContext ctx;
  ctx.tokenizer = tokenizer.get();
  OutboxWriter<v1::ConverseResponse> writer(ctx);
  NoFlush no_flush;
  Sequence seq(SequenceParams{}, 16, &no_flush);
  seq.outbox().push(bytes[0]);
  seq.outbox().push(bytes[1]);
  seq.outbox().end_turn({0, FinishReason::kLength, {}});
  for (int32_t id : bytes) seq.outbox().push(id);  // the next turn: the whole character
  seq.outbox().end_turn({1, FinishReason::kLength, {}});
  seq.outbox().close(StreamStatus::kOk, "");

  std::vector<std::string> messages;  // "ids:text" or "end <turn>"
  bool closed = false;
  for (int i = 0; i < 16 && !closed; ++i) {
    writer.drain(
        seq, [](const TurnEnd& end, v1::ConverseResponse* r) { r->mutable_turn_finished()->set_turn(end.turn); },
        [&](const grpc::ByteBuffer* bytes) {  // the message as the stream writes it
          grpc::ByteBuffer copy(*bytes);
          v1::ConverseResponse r;
          ASSERT_EQ(parse_message(&copy, &r), "");
          messages.push_back(r.has_tokens() ? std::to_string(r.tokens().ids_size()) + ":" + r.tokens().text()
                                            : "end " + std::to_string(r.turn_finished().turn()));
        },
        [&](StreamStatus, const std::string&) { closed = true; });
  }
  EXPECT_TRUE(closed);
  EXPECT_EQ(messages, (std::vector<std::string>{"2:", "0:\xEF\xBF\xBD", "end 0", "4:🙂", "end 1"}));
}

}  // namespace
}  // namespace m3::test
