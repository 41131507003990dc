// m3serve with a SentencePiece tokenizer (through the dlopen'ed shim, in this gRPC
// process): text prompts are the same as their ids, replies stream their text too.
#include <gtest/gtest.h>

#include "model/tokenizer.h"
#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

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

}  // namespace
}  // namespace m3::test
