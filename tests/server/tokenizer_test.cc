// The tokenizer through libm3_spm.so, in a binary that also links gRPC and protobuf: the
// combination that crashes before main() when SentencePiece is linked plainly
// (DEPENDENCY_NOTES.md). The model is trained by spm_train when the tests run.
#include "model/tokenizer.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "m3serve.grpc.pb.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

const std::string kShim = M3_TEST_SPM_SHIM;
const std::string kModel = M3_TEST_SPM_MODEL;
const std::string kVocab = M3_TEST_SPM_VOCAB;  // spm_train's piece list, one per line

std::string load_error(const std::filesystem::path& model, const std::filesystem::path& shim) {
  return test::error_of([&] { Tokenizer::load(model, shim); });
}

std::string stream_text(const Tokenizer& tokenizer, const std::vector<int32_t>& ids) {
  StreamDetokenizer stream(tokenizer);
  std::string text;
  for (int32_t id : ids) stream.append(id, &text);
  stream.finish(&text);
  return text;
}

// Answers GetModelInfo with the tokenizer's vocabulary size: a gRPC round trip whose
// payload came from SentencePiece.
class TokenizerInfoService final : public m3serve::v1::M3Serve::Service {
 public:
  explicit TokenizerInfoService(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  grpc::Status GetModelInfo(grpc::ServerContext*, const m3serve::v1::GetModelInfoRequest*,
                            m3serve::v1::ModelInfo* info) override {
    info->set_vocab_size(static_cast<uint32_t>(tokenizer_.vocab_size()));
    info->set_has_tokenizer(true);
    return grpc::Status::OK;
  }

 private:
  const Tokenizer& tokenizer_;
};

TEST(Tokenizer, RunsInAProcessThatServesGrpc) {
  const auto tokenizer = Tokenizer::load(kModel, kShim);
  TokenizerInfoService service(*tokenizer);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);

  auto stub = m3serve::v1::M3Serve::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  m3serve::v1::ModelInfo info;
  const grpc::Status status = stub->GetModelInfo(&context, {}, &info);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(info.vocab_size(), static_cast<uint32_t>(tokenizer->vocab_size()));
  EXPECT_TRUE(info.has_tokenizer());

  const std::string text = "Hello world, the server streams tokens.";
  const auto ids = tokenizer->encode(text);
  ASSERT_FALSE(ids.empty());
  // The ids travel in this process's (system) protobuf and come back intact.
  m3serve::v1::GenerateRequest request;
  request.mutable_prompt_ids()->mutable_ids()->Add(ids.begin(), ids.end());
  m3serve::v1::GenerateRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(request.SerializeAsString()));
  const std::vector<int32_t> round_trip(parsed.prompt_ids().ids().begin(),
                                        parsed.prompt_ids().ids().end());
  EXPECT_EQ(tokenizer->decode(round_trip), text);
  server->Shutdown();
}

TEST(Tokenizer, VocabSizeIsTheTrainedPieceCount) {
  std::ifstream vocab(kVocab);
  ASSERT_TRUE(vocab) << kVocab;
  int lines = 0;
  for (std::string line; std::getline(vocab, line);) ++lines;
  const auto tokenizer = Tokenizer::load(kModel, kShim);
  EXPECT_EQ(tokenizer->vocab_size(), lines);
}

TEST(Tokenizer, EncodeDecodeRoundTripsIncludingByteFallback) {
  const auto tokenizer = Tokenizer::load(kModel, kShim);
  for (const std::string text :
       {"The quick brown fox jumps over the lazy dog.", "Café naïve Größe",
        "unseen script: 日本語 and 🙂 via bytes", "a", ""}) {
    const auto ids = tokenizer->encode(text);
    for (int32_t id : ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, tokenizer->vocab_size());
    }
    EXPECT_EQ(tokenizer->decode(ids), text) << text;
  }
  EXPECT_TRUE(tokenizer->encode("").empty());
}

TEST(Tokenizer, StreamedTextEqualsDecodedText) {
  const auto tokenizer = Tokenizer::load(kModel, kShim);
  for (const std::string text : {"Hello server, hello client.", "crème brûlée 🙂 한국어 end"}) {
    const auto ids = tokenizer->encode(text);
    // A continuation keeps the leading word-boundary space that whole-text decoding drops.
    EXPECT_EQ(stream_text(*tokenizer, ids), " " + tokenizer->decode(ids)) << text;
  }
}

TEST(Tokenizer, StreamHoldsBackASplitCharacterUntilItIsWhole) {
  const auto tokenizer = Tokenizer::load(kModel, kShim);
  const auto ids = tokenizer->encode("🙂");  // not in the tiny vocabulary: 4 byte pieces
  std::vector<int32_t> bytes;
  for (int32_t id : ids) {
    if (tokenizer->piece_bytes(id).size() == 1 &&
        static_cast<unsigned char>(tokenizer->piece_bytes(id)[0]) >= 0x80) {
      bytes.push_back(id);
    }
  }
  ASSERT_EQ(bytes.size(), 4u) << "expected the emoji as byte pieces";
  StreamDetokenizer stream(*tokenizer);
  std::string text;
  for (size_t i = 0; i + 1 < bytes.size(); ++i) {
    stream.append(bytes[i], &text);
    EXPECT_EQ(text, "") << "after byte " << i;
  }
  stream.append(bytes.back(), &text);
  EXPECT_EQ(text, "🙂");

  // Cut short, the partial character comes out as U+FFFD at the end of the stream.
  StreamDetokenizer cut(*tokenizer);
  std::string cut_text;
  cut.append(bytes[0], &cut_text);
  cut.append(bytes[1], &cut_text);
  EXPECT_EQ(cut_text, "");
  cut.finish(&cut_text);
  EXPECT_EQ(cut_text, "\xEF\xBF\xBD");
}

// Strict UTF-8 (RFC 3629): what protobuf demands of a string field.
bool is_valid_utf8(const std::string& text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto b = static_cast<unsigned char>(text[i]);
    int n = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b < 0x80) n = 1;
    else if (b >= 0xC2 && b <= 0xDF) n = 2;
    else if (b >= 0xE0 && b <= 0xEF) n = 3, lo = b == 0xE0 ? 0xA0 : 0x80, hi = b == 0xED ? 0x9F : 0xBF;
    else if (b >= 0xF0 && b <= 0xF4) n = 4, lo = b == 0xF0 ? 0x90 : 0x80, hi = b == 0xF4 ? 0x8F : 0xBF;
    else return false;
    if (i + n > text.size()) return false;
    for (int k = 1; k < n; ++k) {
      const auto c = static_cast<unsigned char>(text[i + k]);
      if (k == 1 ? (c < lo || c > hi) : (c & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

// The id of the byte piece <0xNN>.
int32_t byte_piece(const Tokenizer& tokenizer, unsigned char byte) {
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const auto bytes = tokenizer.piece_bytes(id);
    if (bytes.size() == 1 && static_cast<unsigned char>(bytes[0]) == byte && byte >= 0x80) return id;
  }
  return -1;
}

TEST(Tokenizer, StreamReplacesBytesThatFormNoCharacter) {
  const auto tokenizer = Tokenizer::load(kModel, kShim);
  auto ids = [&](std::initializer_list<unsigned char> bytes) {
    std::vector<int32_t> out;
    for (unsigned char b : bytes) {
      out.push_back(byte_piece(*tokenizer, b));
      EXPECT_GE(out.back(), 0) << "no byte piece for " << int(b);
    }
    return out;
  };
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(stream_text(*tokenizer, ids({0xE0, 0x80})), fffd + fffd);        // overlong
  EXPECT_EQ(stream_text(*tokenizer, ids({0xED, 0xA0, 0x80})), fffd + fffd + fffd);  // surrogate
  EXPECT_EQ(stream_text(*tokenizer, ids({0xF4, 0x90})), fffd + fffd);        // past U+10FFFF
  EXPECT_EQ(stream_text(*tokenizer, ids({0xC3, 0xA9})), "\xC3\xA9");       // é is fine
  EXPECT_EQ(stream_text(*tokenizer, ids({0xC3, 0xC3, 0xA9})), fffd + "\xC3\xA9");
}

TEST(Tokenizer, StreamOfRandomIdsIsAlwaysValidUtf8) {
  // What a random-weight model emits: any ids in any order, byte pieces included.
  const auto tokenizer = Tokenizer::load(kModel, kShim);
  uint64_t state = 12345;
  for (int trial = 0; trial < 200; ++trial) {
    StreamDetokenizer stream(*tokenizer);
    std::string text;
    for (int i = 0; i < 64; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      stream.append(static_cast<int32_t>((state >> 33) % (tokenizer->vocab_size() + 16)), &text);
      ASSERT_TRUE(is_valid_utf8(text)) << "trial " << trial << " step " << i;
    }
    stream.finish(&text);
    ASSERT_TRUE(is_valid_utf8(text)) << "trial " << trial;
  }
}

TEST(Tokenizer, PieceBytesShowTheWordBoundaryAsASpace) {
  const auto tokenizer = Tokenizer::load(kModel, kShim);
  std::string joined;
  for (int32_t id : tokenizer->encode("hello world")) joined += tokenizer->piece_bytes(id);
  EXPECT_EQ(joined, " hello world");
}

TEST(Tokenizer, OutOfRangeIdsAreRejectedWithTheId) {
  const auto tokenizer = Tokenizer::load(kModel, kShim);
  const std::vector<int32_t> ids = {5, tokenizer->vocab_size()};
  const std::string msg = test::error_of<std::invalid_argument>([&] { tokenizer->decode(ids); });
  EXPECT_NE(msg.find("token id " + std::to_string(tokenizer->vocab_size()) + " at position 1 is outside the vocabulary"),
            std::string::npos)
      << msg;
  EXPECT_THROW(tokenizer->piece_bytes(-1), std::invalid_argument);
}

TEST(Tokenizer, StreamSkipsIdsBeyondTheTokenizerVocabulary) {
  // A speech model's vocabulary may run past the text pieces: those ids carry no text.
  const auto tokenizer = Tokenizer::load(kModel, kShim);
  auto ids = tokenizer->encode("hello world");
  ids.insert(ids.begin() + 1, tokenizer->vocab_size() + 7);
  ids.push_back(tokenizer->vocab_size());
  EXPECT_EQ(stream_text(*tokenizer, ids), " hello world");
}

TEST(TokenizerErrors, MissingShimIsNamed) {
  const std::string error = load_error(kModel, "/nonexistent/libm3_spm.so");
  EXPECT_NE(error.find("SentencePiece shim /nonexistent/libm3_spm.so not found"), std::string::npos)
      << error;
}

TEST(TokenizerErrors, AShimWithoutTheInterfaceIsRefused) {
  // A real shared object exporting only m3_spm_abi_version.
  const std::string error = load_error(kModel, M3_TEST_PARTIAL_SHIM);
  EXPECT_NE(error.find("has no symbol m3_spm_load"), std::string::npos) << error;
}

TEST(TokenizerErrors, AShimOfAnotherInterfaceVersionIsRefused) {
  const std::string error = load_error(kModel, M3_TEST_FUTURE_SHIM);
  EXPECT_NE(error.find("has interface version 999, this program needs 1"), std::string::npos)
      << error;
}

TEST(TokenizerErrors, AFileThatIsNotALibraryIsRefused) {
  const std::string error = load_error(kModel, kVocab);
  EXPECT_NE(error.find("cannot load SentencePiece shim " + kVocab), std::string::npos) << error;
}

TEST(TokenizerErrors, MissingModelIsNamed) {
  const std::string error = load_error("/nonexistent/tiny.model", kShim);
  EXPECT_NE(error.find("SentencePiece model /nonexistent/tiny.model not found"), std::string::npos)
      << error;
}

TEST(TokenizerErrors, AFileThatIsNotAModelIsRefused) {
  const std::string error = load_error(kVocab, kShim);
  EXPECT_NE(error.find("cannot load SentencePiece model " + kVocab + ": "), std::string::npos)
      << error;
}

TEST(TokenizerErrors, AMissingDefaultShimNamesEveryPlaceLookedIn) {
  // Nothing beside this test executable or in ../lib: the error lists both.
  const auto exe_dir = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  ASSERT_FALSE(std::filesystem::exists(exe_dir / "libm3_spm.so"));
  ::unsetenv("M3_SPM_SHIM");
  const std::string error = load_error(kModel, {});
  EXPECT_NE(error.find("SentencePiece shim libm3_spm.so not found (looked for " +
                       (exe_dir / "libm3_spm.so").string() + ", " +
                       (exe_dir.parent_path() / "lib" / "libm3_spm.so").string()),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("set M3_SPM_SHIM"), std::string::npos) << error;
}

TEST(TokenizerErrors, TheShimEnvironmentVariableIsLookedAtFirst) {
  ::setenv("M3_SPM_SHIM", kShim.c_str(), 1);
  EXPECT_EQ(Tokenizer::default_shim_path(), kShim);
  EXPECT_GT(Tokenizer::load(kModel)->vocab_size(), 0);
  ::setenv("M3_SPM_SHIM", "/nonexistent/libm3_spm.so", 1);
  const std::string error = load_error(kModel, {});
  EXPECT_NE(error.find("tokenizer: SentencePiece shim /nonexistent/libm3_spm.so (from M3_SPM_SHIM) not found"),
            std::string::npos)
      << error;
  ::unsetenv("M3_SPM_SHIM");
}

TEST(TokenizerErrors, DefaultShimPathIsBesideTheExecutable) {
  ::unsetenv("M3_SPM_SHIM");
  const auto path = Tokenizer::default_shim_path();
  EXPECT_EQ(path.filename(), "libm3_spm.so");
  const auto exe_dir = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  EXPECT_TRUE(path.parent_path() == exe_dir || path.parent_path() == exe_dir.parent_path() / "lib")
      << path;
}

}  // namespace
}  // namespace m3
