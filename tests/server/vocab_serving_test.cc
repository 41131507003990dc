// A model directory with a vocab.json (text with its SentencePiece model, speech units in
// frames, named controls) served for real: the layout in GetModelInfo, prompts in
// segments mapped to the right ids, bad segments refused saying which, replies as typed
// segments (whole unit frames, text never splitting a character), constrained sampling
// through the API, and the turn rules (end_of_turn fed after a turn, a reply ended by
// end_of_reply, a stop id or its length).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "model/tokenizer.h"
#include "model/vocab_layout.h"
#include "server/prompt_segments.h"
#include "server/reply_segments.h"
#include "server/service_context.h"
#include "server/vocab_serving.h"
#include "server_test_support.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;
namespace v1 = ::m3serve::v1;

const std::string kSpmModel = M3_TEST_SPM_MODEL;
constexpr int kCodebooks = 4, kUnits = 32;

const Tokenizer& tokenizer() {
  static const auto t = Tokenizer::load(kSpmModel, Tokenizer::default_shim_path());
  return *t;
}
int text_size() { return tokenizer().vocab_size(); }

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
int unit_id(int codebook, int unit) { return text_size() + codebook * kUnits + unit; }

// The test server's tiny model with a vocab.json of text (with the tokenizer file when
// `with_tokenizer`), 4 codebooks of 32 units in frame order 2, 0, 3, 1, and `controls`.
fs::path vocab_model(const std::string& tag, const std::string& controls, bool with_tokenizer = true) {
  const fs::path dir = fs::temp_directory_path() / ("m3-vocab-" + tag + "-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const auto& entry : fs::directory_iterator(test::tiny_model_dir()))
    fs::copy_file(entry.path(), dir / entry.path().filename(), fs::copy_options::overwrite_existing);
  std::string text = "{\"size\": " + std::to_string(text_size());
  if (with_tokenizer) {
    fs::copy_file(kSpmModel, dir / "tokenizer.model", fs::copy_options::overwrite_existing);
    text += ", \"tokenizer\": \"tokenizer.model\"";
  }
  std::ofstream(dir / "vocab.json") << "{\"text\": " << text << "}, \"speech_units\": {\"first_id\": " << text_size()
                                    << ", \"codebooks\": 4, \"units_per_codebook\": 32, \"frame_order\": [2, 0, 3, 1]},"
                                    << " \"controls\": " << controls << "}";
  return dir;
}

const char kControls[] = R"({"bos": 500, "end_of_turn": 501, "laugh": 503})";

ServerConfig config_for(const fs::path& dir) {
  ServerConfig c = test::test_config();
  c.model = dir.string();
  return c;
}

v1::Segment text_segment(const std::string& text) {
  v1::Segment s;
  s.set_text(text);
  return s;
}
v1::Segment units_segment(const std::vector<int32_t>& units) {
  v1::Segment s;
  for (int32_t u : units) s.mutable_units()->add_units(u);
  return s;
}
v1::Segment control_segment(const std::string& name) {
  v1::Segment s;
  s.set_control(name);
  return s;
}
v1::Segment ids_segment(const std::vector<int32_t>& ids) {
  v1::Segment s;
  for (int32_t id : ids) s.mutable_ids()->add_ids(id);
  return s;
}

v1::GenerateRequest segments_request(const std::vector<v1::Segment>& segments, uint32_t max_new) {
  v1::GenerateRequest r;
  r.mutable_prompt_segments();  // set even when empty
  for (const auto& s : segments) *r.mutable_prompt_segments()->add_segments() = s;
  r.set_max_new_tokens(max_new);
  return r;
}

// The whole stream of a Generate call: ids, segments joined in order, the end.
struct SegmentedReply {
  std::vector<int32_t> ids;
  std::vector<v1::Segment> segments;
  v1::Finished finished;
  grpc::Status status;
};

SegmentedReply generate_segments(test::TestServer& server, const v1::GenerateRequest& request) {
  SegmentedReply r;
  grpc::ClientContext context;
  auto reader = server.stub->Generate(&context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.has_finished()) r.finished = response.finished();
    if (!response.has_tokens()) continue;
    r.ids.insert(r.ids.end(), response.tokens().ids().begin(), response.tokens().ids().end());
    for (const auto& s : response.tokens().segments()) r.segments.push_back(s);
  }
  r.status = reader->Finish();
  return r;
}

class VocabServing : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = new fs::path(vocab_model("main", kControls)); }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  static fs::path* dir_;
};
fs::path* VocabServing::dir_ = nullptr;

TEST_F(VocabServing, ModelInfoReportsTheLayoutAndTheDirectorysTokenizerIsUsed) {
  test::TestServer server(config_for(*dir_));
  grpc::ClientContext context;
  v1::ModelInfo info;
  ASSERT_TRUE(server.stub->GetModelInfo(&context, {}, &info).ok());
  EXPECT_TRUE(info.has_tokenizer());  // no --tokenizer: the directory's tokenizer.model
  ASSERT_TRUE(info.has_vocab());
  EXPECT_EQ(info.vocab().text().size(), text_size());
  EXPECT_EQ(info.vocab().text().tokenizer(), "tokenizer.model");
  EXPECT_EQ(info.vocab().speech_units().first_id(), text_size());
  EXPECT_EQ(info.vocab().speech_units().codebooks(), 4);
  EXPECT_EQ(info.vocab().speech_units().units_per_codebook(), 32);
  EXPECT_EQ(std::vector<int32_t>(info.vocab().speech_units().frame_order().begin(),
                                 info.vocab().speech_units().frame_order().end()),
            (std::vector<int32_t>{2, 0, 3, 1}));
  ASSERT_EQ(info.vocab().controls_size(), 3);
  EXPECT_EQ(info.vocab().controls(1).name(), "end_of_turn");
  EXPECT_EQ(info.vocab().controls(1).id(), 501);

  // Without a vocab.json: no layout, as before.
  test::TestServer plain;
  grpc::ClientContext plain_context;
  v1::ModelInfo plain_info;
  ASSERT_TRUE(plain.stub->GetModelInfo(&plain_context, {}, &plain_info).ok());
  EXPECT_FALSE(plain_info.has_vocab());
}

TEST_F(VocabServing, AMixedPromptMapsToTheRightIds) {
  const VocabLayout layout = *VocabLayout::load(*dir_, 512);
  SegmentVocabulary vocab{&layout, &tokenizer(), 512, 1000};
  v1::Segments segments;
  *segments.add_segments() = control_segment("bos");
  *segments.add_segments() = text_segment("hello world");
  // Two frames, units by codebook 0..3; they go out in frame order 2, 0, 3, 1.
  *segments.add_segments() = units_segment({1, 2, 3, 4, 31, 0, 7, 9});
  *segments.add_segments() = control_segment("laugh");
  *segments.add_segments() = ids_segment({7, 8});
  std::vector<int32_t> ids;
  ASSERT_EQ(segments_to_ids(segments, vocab, "prompt_segments", &ids), "");
  std::vector<int32_t> want = {500};
  for (int32_t id : tokenizer().encode("hello world")) want.push_back(id);
  for (int32_t id : {unit_id(2, 3), unit_id(0, 1), unit_id(3, 4), unit_id(1, 2), unit_id(2, 7), unit_id(0, 31),
                     unit_id(3, 9), unit_id(1, 0), 503, 7, 8})
    want.push_back(id);
  EXPECT_EQ(ids, want);

  // Through the server: the prompt the model is fed is exactly those ids.
  test::TestServer server(config_for(*dir_));
  v1::GenerateRequest request;
  *request.mutable_prompt_segments() = segments;
  request.set_max_new_tokens(12);
  const SegmentedReply reply = generate_segments(server, request);
  ASSERT_TRUE(reply.status.ok()) << reply.status.error_message();
  EXPECT_EQ(reply.finished.timings().prompt_tokens(), want.size());
  EXPECT_EQ(reply.ids, test::engine_generate(want, 12));
}

TEST_F(VocabServing, BadSegmentsAreRefusedSayingWhich) {
  test::TestServer server(config_for(*dir_));
  const std::vector<std::pair<std::vector<v1::Segment>, std::string>> cases = {
      {{units_segment({1, 40, 3, 4})}, "prompt_segments.segments[0].units[1] = 40 is outside codebook 1's units [0, 32)"},
      {{units_segment({1, 2, 3, -1})}, "prompt_segments.segments[0].units[3] = -1 is outside codebook 3's units [0, 32)"},
      {{control_segment("bos"), units_segment({1, 2, 3})},
       "prompt_segments.segments[1].units has 3 unit numbers, not a whole number (at least one) of frames of 4 codebooks"},
      {{control_segment("eot")},
       "prompt_segments.segments[0].control \"eot\" is not one of this model's controls (bos, end_of_turn, laugh)"},
      {{ids_segment({1, 512})},
       "prompt_segments.segments[0].ids[1] = 512 is outside the model's vocabulary [0, 512)"},
      {{v1::Segment{}}, "prompt_segments.segments[0] has no kind set: text, units, control or ids"},
      {{}, "prompt_segments holds no tokens: a prompt needs at least one"},
  };
  for (const auto& [segments, message] : cases) {
    SCOPED_TRACE(message);
    const SegmentedReply r = generate_segments(server, segments_request(segments, 4));
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(r.status.error_message(), message);
  }
  // The same checks for a Converse turn's input.
  grpc::ClientContext context;
  auto stream = server.stub->Converse(&context);
  v1::ConverseRequest input;
  *input.mutable_input_segments()->add_segments() = control_segment("nope");
  ASSERT_TRUE(stream->Write(input));
  v1::ConverseResponse response;
  while (stream->Read(&response)) {
  }
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "input_segments.segments[0].control \"nope\" is not one of this model's controls (bos, end_of_turn, laugh)");

  // Text without a tokenizer, and named parts without a vocab.json.
  const fs::path no_tokenizer = vocab_model("no-tokenizer", kControls, false);
  {
    test::TestServer bare(config_for(no_tokenizer));
    const SegmentedReply r = generate_segments(bare, segments_request({text_segment("hello")}, 4));
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(r.status.error_message(),
              "prompt_segments.segments[0].text needs a tokenizer and this server has none (a vocab.json "
              "text.tokenizer, or --tokenizer FILE); send units, controls or ids instead");
  }
  fs::remove_all(no_tokenizer);
  test::TestServer plain;
  SegmentedReply r = generate_segments(plain, segments_request({control_segment("bos")}, 4));
  EXPECT_EQ(r.status.error_message(),
            "prompt_segments.segments[0].control \"bos\": this model has no vocab.json, so no named controls");
  r = generate_segments(plain, segments_request({units_segment({1, 2, 3, 4})}, 4));
  EXPECT_EQ(r.status.error_message(),
            "prompt_segments.segments[0].units: this model's vocabulary has no speech units (the model has no "
            "vocab.json)");
  v1::GenerateRequest constrained = test::generate_request({1, 2}, 4);
  constrained.mutable_sampling()->set_allowed(v1::ALLOWED_TOKENS_UNITS);
  r = generate_segments(plain, constrained);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(),
            "sampling.allowed = ALLOWED_TOKENS_UNITS needs speech units in the model's vocab.json and the model has "
            "none");
}

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (int k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return false;
    i += static_cast<size_t>(n);
  }
  return true;
}

TEST_F(VocabServing, ReplyTextIsDecodedIncrementallyAndExactlyForMultiByteText) {
  const VocabLayout layout = *VocabLayout::load(*dir_, 512);
  // Characters outside the tiny model's pieces come as byte pieces, 2 to 4 per character.
  const std::string text = "héllo wörld, 日本語 and 🎉 ok ñ";
  const std::vector<int32_t> ids = tokenizer().encode(text);
  int byte_pieces = 0;
  for (int32_t id : ids) byte_pieces += tokenizer().piece_bytes(id).size() == 1 &&
                                        static_cast<unsigned char>(tokenizer().piece_bytes(id)[0]) >= 0x80;
  ASSERT_GE(byte_pieces, 8) << "the test needs characters split across byte pieces";

  ReplySegmenter segmenter(layout, &tokenizer());
  std::string joined;
  for (int32_t id : ids) {  // one id at a time, as the slowest stream sends them
    ReplySegmenter::Out out;
    segmenter.append({&id, 1}, &out);
    for (const auto& s : out) {
      ASSERT_TRUE(s.has_text()) << s.DebugString();
      EXPECT_TRUE(valid_utf8(s.text())) << "a segment split a character";
      joined += s.text();
    }
  }
  ReplySegmenter::Out rest;
  segmenter.finish(&rest);
  EXPECT_TRUE(rest.empty());
  EXPECT_EQ(joined, " " + text);  // the word-boundary space of a continued text is kept

  // Mixed with units and controls: each part in order, frames whole.
  ReplySegmenter mixed(layout, &tokenizer());
  std::vector<int32_t> reply = tokenizer().encode("日本");
  for (int32_t id : {unit_id(2, 5), unit_id(0, 6), unit_id(3, 7), unit_id(1, 8), 503, unit_id(2, 1)}) reply.push_back(id);
  ReplySegmenter::Out out;
  for (int32_t id : reply) mixed.append({&id, 1}, &out);
  mixed.finish(&out);
  ASSERT_EQ(out.size(), 4);
  EXPECT_EQ(out[0].text(), " 日本");
  EXPECT_EQ(std::vector<int32_t>(out[1].units().units().begin(), out[1].units().units().end()),
            (std::vector<int32_t>{6, 8, 5, 7}));  // by codebook
  EXPECT_EQ(out[2].control(), "laugh");
  EXPECT_EQ(std::vector<int32_t>(out[3].ids().ids().begin(), out[3].ids().ids().end()),
            (std::vector<int32_t>{unit_id(2, 1)}));  // a frame broken off by the reply's end
}

TEST_F(VocabServing, AUnitsOnlyReplyStreamsWholeFramesInOrder) {
  test::TestServer server(config_for(*dir_));
  v1::GenerateRequest request = segments_request({control_segment("bos"), text_segment("hello")}, 4 * 50 + 2);
  request.mutable_sampling()->set_temperature(1.5f);
  request.mutable_sampling()->set_seed(11);
  request.mutable_sampling()->set_allowed(v1::ALLOWED_TOKENS_UNITS);
  const SegmentedReply r = generate_segments(server, request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.ids.size(), 202u);
  const int order[] = {2, 0, 3, 1};
  for (size_t t = 0; t < r.ids.size(); ++t) {
    ASSERT_GE(r.ids[t], unit_id(0, 0)) << t;
    ASSERT_LT(r.ids[t], unit_id(3, 32)) << t;
    ASSERT_EQ((r.ids[t] - text_size()) / kUnits, order[t % 4]) << "step " << t;
  }
  // The segments: 50 whole frames, then the 2 units of the frame the length cut off.
  std::vector<int32_t> units, raw;
  for (const auto& s : r.segments) {
    if (s.has_units()) units.insert(units.end(), s.units().units().begin(), s.units().units().end());
    if (s.has_ids()) raw.insert(raw.end(), s.ids().ids().begin(), s.ids().ids().end());
    EXPECT_FALSE(s.has_text() || s.has_control());
  }
  ASSERT_EQ(units.size(), 200u);
  for (size_t f = 0; f < 50; ++f)
    for (int p = 0; p < 4; ++p)
      EXPECT_EQ(unit_id(order[p], units[f * 4 + static_cast<size_t>(order[p])]), r.ids[f * 4 + static_cast<size_t>(p)]);
  EXPECT_EQ(raw, (std::vector<int32_t>{r.ids[200], r.ids[201]}));

  // Text only: no unit or control.
  request.mutable_sampling()->set_allowed(v1::ALLOWED_TOKENS_TEXT);
  const SegmentedReply text = generate_segments(server, request);
  ASSERT_TRUE(text.status.ok()) << text.status.error_message();
  for (int32_t id : text.ids) ASSERT_LT(id, text_size());
}

TEST_F(VocabServing, TurnRulesEndOfTurnIsFedAndEndOfReplyEndsTheReply) {
  // Greedy, the tiny model's reply to [5, 6, 7, end_of_turn]: name one of its tokens
  // end_of_reply, and the reply must end right there.
  const std::vector<int32_t> input = {5, 6, 7};
  const std::vector<int32_t> fed = {5, 6, 7, 501};
  const std::vector<int32_t> free_reply = test::engine_generate(fed, 24);
  size_t k = 1;
  auto usable = [&](size_t i) {
    const int32_t id = free_reply[i];
    if (id == 501 || (id >= unit_id(0, 0) && id < unit_id(3, 32))) return false;
    for (size_t j = 0; j < i; ++j)
      if (free_reply[j] == id) return false;
    return true;
  };
  while (k < free_reply.size() && !usable(k)) ++k;
  ASSERT_LT(k, free_reply.size()) << "no token of the greedy reply can be named end_of_reply";
  const int32_t end_of_reply = free_reply[k];
  const fs::path dir = vocab_model("turns", "{\"end_of_turn\": 501, \"end_of_reply\": " + std::to_string(end_of_reply) + "}");
  test::TestServer server(config_for(dir));

  grpc::ClientContext context;
  auto stream = server.stub->Converse(&context);
  v1::ConverseRequest config, in, end_turn;
  config.mutable_config()->set_max_new_tokens(24);
  for (int32_t id : input) in.mutable_input()->add_ids(id);
  end_turn.mutable_end_turn();
  ASSERT_TRUE(stream->Write(config) && stream->Write(in) && stream->Write(end_turn));
  std::vector<int32_t> ids;
  std::vector<v1::Segment> segments;
  v1::ConverseResponse response;
  v1::TurnFinished finished;
  while (stream->Read(&response)) {
    if (response.has_turn_finished()) {
      finished = response.turn_finished();
      break;
    }
    ids.insert(ids.end(), response.tokens().ids().begin(), response.tokens().ids().end());
    for (const auto& s : response.tokens().segments()) segments.push_back(s);
  }
  stream->WritesDone();
  const grpc::Status status = stream->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(ids, std::vector<int32_t>(free_reply.begin(), free_reply.begin() + static_cast<long>(k) + 1));
  EXPECT_EQ(finished.reason(), v1::FINISH_REASON_END_OF_REPLY);
  EXPECT_EQ(finished.timings().prompt_tokens(), 4u);  // the client's 3 and end_of_turn
  ASSERT_FALSE(segments.empty());
  EXPECT_EQ(segments.back().control(), "end_of_reply");

  // Generate: a stop id ends it with STOP, a short length with LENGTH (the first token
  // of this prompt's greedy reply is not end_of_reply, or the reply ends there first).
  const std::vector<int32_t> gen = test::engine_generate(input, 24);
  v1::GenerateRequest stop = test::generate_request(input, 24);
  stop.add_stop_token_ids(gen[0]);
  const v1::FinishReason first = gen[0] == end_of_reply ? v1::FINISH_REASON_END_OF_REPLY : v1::FINISH_REASON_STOP;
  EXPECT_EQ(test::generate(*server.stub, stop).finish.reason(), first);
  EXPECT_EQ(test::generate(*server.stub, test::generate_request(input, 1)).finish.reason(),
            gen[0] == end_of_reply ? v1::FINISH_REASON_END_OF_REPLY : v1::FINISH_REASON_LENGTH);
  fs::remove_all(dir);
}

TEST_F(VocabServing, ABadVocabularyStopsTheStartNamingTheField) {
  // A control outside the vocabulary.
  const fs::path bad = vocab_model("bad", R"({"bos": 512})");
  EXPECT_EQ(test::error_of([&] { test::TestServer server(config_for(bad)); }),
            (bad / "vocab.json").string() + ": controls.bos = 512 is outside the vocabulary [0, 512)");
  fs::remove_all(bad);
  // A tokenizer whose pieces are not the text range.
  const fs::path dir = vocab_model("mismatch", kControls);
  std::string text = read_file(dir / "vocab.json");
  const std::string size = "\"size\": " + std::to_string(text_size());
  text.replace(text.find(size), size.size(), "\"size\": " + std::to_string(text_size() - 1));
  std::ofstream(dir / "vocab.json") << text;
  EXPECT_EQ(test::error_of([&] { test::TestServer server(config_for(dir)); }),
            (dir / "vocab.json").string() + ": text.size " + std::to_string(text_size() - 1) + " but the tokenizer " +
                (dir / "tokenizer.model").string() + " has " + std::to_string(text_size()) + " pieces");
  fs::remove_all(dir);
}

TEST_F(VocabServing, ABackendWithoutMasksRefusesConstrainedSamplingNamingItself) {
  const VocabLayout layout = *VocabLayout::load(*dir_, 512);
  const std::vector<SamplingMask> masks = sampling_masks_for(layout);
  ServiceContext ctx;
  int32_t mask = 7;
  v1::SamplingParams sampling;
  sampling.set_allowed(v1::ALLOWED_TOKENS_UNITS);
  EXPECT_EQ(check_allowed_tokens(sampling, ctx, "sampling", &mask),
            "sampling.allowed needs a vocabulary layout (vocab.json) and this server has none");
  resolve_allowed_tokens(&layout, masks, 0, "cuda", &ctx);  // a backend that applies no masks
  EXPECT_EQ(check_allowed_tokens(sampling, ctx, "config.sampling", &mask),
            "config.sampling.allowed = ALLOWED_TOKENS_UNITS: the cuda backend does not apply sampling masks yet; "
            "serve with --backend cpu for constrained sampling");
  EXPECT_EQ(mask, -1);
  sampling.set_allowed(v1::ALLOWED_TOKENS_ALL);
  EXPECT_EQ(check_allowed_tokens(sampling, ctx, "sampling", &mask), "");
  resolve_allowed_tokens(&layout, masks, static_cast<int>(masks.size()), "cpu", &ctx);
  sampling.set_allowed(v1::ALLOWED_TOKENS_UNITS_AND_CONTROLS);
  EXPECT_EQ(check_allowed_tokens(sampling, ctx, "sampling", &mask), "");
  EXPECT_EQ(masks[static_cast<size_t>(mask)].name, "units_and_controls");
  EXPECT_EQ(describe_vocab(layout), "text [0, " + std::to_string(text_size()) + ") with tokenizer.model; 4 codebooks x 32 units at [" +
                                        std::to_string(text_size()) + ", " + std::to_string(text_size() + 128) +
                                        "), frame order 2 0 3 1; controls bos=500 end_of_turn=501 laugh=503");
}

}  // namespace
}  // namespace m3
