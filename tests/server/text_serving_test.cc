// Text in and out of the real server: m3serve loads the SentencePiece tokenizer through
// libm3_spm.so (found beside this executable, as beside m3serve) in a process that
// serves gRPC, tokenizes text prompts and streams the replies' text.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/tokenizer.h"
#include "server_test_support.h"

namespace m3 {
namespace {

const std::string kModel = M3_TEST_SPM_MODEL;

ServerConfig text_config() {
  ServerConfig config = test::test_config();
  config.tokenizer = kModel;
  return config;
}

// What the server streams for a reply of `ids`: the detokenizer's text (checked on its
// own in tokenizer_test), with what it holds at the reply's end flushed as the server
// flushes it.
std::string expected_text(const Tokenizer& tokenizer, const std::vector<int32_t>& ids) {
  StreamDetokenizer stream(tokenizer);
  std::string text;
  for (int32_t id : ids) stream.append(id, &text);
  stream.finish(&text);
  return text;
}

TEST(TextServing, ATextPromptIsTokenizedAndTheReplyCarriesItsText) {
  test::TestServer server(text_config());
  const auto tokenizer = Tokenizer::load(kModel, Tokenizer::default_shim_path());

  grpc::ClientContext info_context;
  test::v1::ModelInfo info;
  ASSERT_TRUE(server.stub->GetModelInfo(&info_context, {}, &info).ok());
  EXPECT_TRUE(info.has_tokenizer());

  const std::string prompt = "hello world, the server streams tokens";
  test::v1::GenerateRequest request;
  request.set_prompt_text(prompt);
  request.set_max_new_tokens(48);
  grpc::ClientContext context;
  auto reader = server.stub->Generate(&context, request);
  std::vector<int32_t> ids;
  std::string text;
  test::v1::GenerateResponse response;
  uint32_t prompt_tokens = 0;
  while (reader->Read(&response)) {
    if (response.has_tokens()) {
      ids.insert(ids.end(), response.tokens().ids().begin(), response.tokens().ids().end());
      text += response.tokens().text();
    } else if (response.has_finished()) {
      prompt_tokens = response.finished().timings().prompt_tokens();
    }
  }
  const grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();

  const auto prompt_ids = tokenizer->encode(prompt);
  EXPECT_EQ(prompt_tokens, prompt_ids.size());
  EXPECT_EQ(ids, test::engine_generate(prompt_ids, 48));
  EXPECT_EQ(text, expected_text(*tokenizer, ids));
}

TEST(TextServing, ConverseTakesATextTurn) {
  test::TestServer server(text_config());
  const auto tokenizer = Tokenizer::load(kModel, Tokenizer::default_shim_path());

  grpc::ClientContext context;
  auto stream = server.stub->Converse(&context);
  test::v1::ConverseRequest config;
  config.mutable_config()->set_max_new_tokens(12);
  test::v1::ConverseRequest input;
  input.set_input_text("hello client");
  test::v1::ConverseRequest end_turn;
  end_turn.mutable_end_turn();
  ASSERT_TRUE(stream->Write(config) && stream->Write(input) && stream->Write(end_turn));

  std::vector<int32_t> ids;
  std::string text;
  test::v1::ConverseResponse response;
  while (stream->Read(&response) && !response.has_turn_finished()) {
    ids.insert(ids.end(), response.tokens().ids().begin(), response.tokens().ids().end());
    text += response.tokens().text();
  }
  stream->WritesDone();
  const grpc::Status status = stream->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();

  EXPECT_EQ(ids, test::engine_generate(tokenizer->encode("hello client"), 12));
  EXPECT_EQ(text, expected_text(*tokenizer, ids));
}

}  // namespace
}  // namespace m3
