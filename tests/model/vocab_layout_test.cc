// vocab.json: a full layout read back, the defaults, absence, and a corpus of bad files
// whose messages name the field.
#include "model/vocab_layout.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "model/sampling_mask.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;
using test::error_of;

class VocabLayoutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("m3_vocab_layout_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    std::ofstream(dir_ / "tokenizer.model") << "not read by the parser";
  }
  void TearDown() override { fs::remove_all(dir_); }
  VocabLayout parse(const std::string& text, int32_t vocab = 4096) {
    return VocabLayout::parse(text, "vocab.json", vocab, dir_);
  }
  fs::path dir_;
};

TEST_F(VocabLayoutTest, ReadsEveryPart) {
  const VocabLayout v = parse(R"({
    "text": {"first_id": 0, "size": 3000, "tokenizer": "tokenizer.model"},
    "speech_units": {"first_id": 3000, "codebooks": 4, "units_per_codebook": 256, "frame_order": [2, 0, 3, 1]},
    "controls": {"end_of_reply": 4090, "bos": 1, "end_of_turn": 4089, "laugh": 4095}
  })");
  ASSERT_TRUE(v.text);
  EXPECT_EQ(v.text->size, 3000);
  EXPECT_EQ(v.text->tokenizer, dir_ / "tokenizer.model");
  ASSERT_TRUE(v.speech_units);
  EXPECT_EQ(v.speech_units->end_id(), 3000 + 4 * 256);
  EXPECT_EQ(v.speech_units->frame_order, (std::vector<int32_t>{2, 0, 3, 1}));
  EXPECT_EQ(v.speech_units->id_of(3, 5), 3000 + 3 * 256 + 5);
  EXPECT_EQ(v.speech_units->codebook_of(3000 + 3 * 256 + 5), 3);
  EXPECT_EQ(v.speech_units->unit_of(3000 + 3 * 256 + 5), 5);
  ASSERT_EQ(v.controls.size(), 4u);  // in id order
  EXPECT_EQ(v.controls.front().name, "bos");
  EXPECT_EQ(v.control_id("end_of_turn"), 4089);
  EXPECT_EQ(v.control_id("nope"), -1);
  ASSERT_NE(v.control_name(4095), nullptr);
  EXPECT_EQ(*v.control_name(4095), "laugh");
  EXPECT_EQ(v.control_name(4094), nullptr);
  EXPECT_TRUE(v.is_text(2999));
  EXPECT_FALSE(v.is_text(3000));
}

TEST_F(VocabLayoutTest, DefaultsAndOptionalParts) {
  const VocabLayout v = parse(R"({"speech_units": {"first_id": 0, "units_per_codebook": 4096}})");
  EXPECT_FALSE(v.text);
  EXPECT_TRUE(v.controls.empty());
  ASSERT_TRUE(v.speech_units);
  EXPECT_EQ(v.speech_units->codebooks, 1);
  EXPECT_EQ(v.speech_units->frame_order, (std::vector<int32_t>{0}));
  EXPECT_FALSE(parse("{}").speech_units);
}

TEST_F(VocabLayoutTest, LoadWithoutTheFileIsIdsOnly) {
  EXPECT_FALSE(VocabLayout::load(dir_, 4096));
  std::ofstream(dir_ / "vocab.json") << R"({"controls": {"bos": 4096}})";
  EXPECT_EQ(error_of([&] { VocabLayout::load(dir_, 4096); }),
            (dir_ / "vocab.json").string() + ": controls.bos = 4096 is outside the vocabulary [0, 4096)");
}

TEST_F(VocabLayoutTest, BadFilesNameTheField) {
  const std::vector<std::pair<std::string, std::string>> corpus = {
      {R"({"speech_units": {"first_id": 4000, "codebooks": 8, "units_per_codebook": 1024}})",
       "vocab.json: speech_units.first_id 4000 + 8 x 1024 units runs past vocab_size 4096"},
      {R"([1, 2])", "vocab.json: the file must be an object, got array [1,2]"},
      {R"({"text": {"size": 10}, "units": {}})",
       "vocab.json: unknown key \"units\" (known: text, speech_units, controls)"},
      {R"({"speech_units": {"first_id": 0, "units_per_codebook": 8, "frame_ordr": [0]}})",
       "vocab.json: speech_units: unknown key \"frame_ordr\" (known: first_id, codebooks, units_per_codebook, "
       "frame_order)"},
      {R"({"text": {"size": 5000}})", "vocab.json: text.size 5000 runs past vocab_size 4096"},
      {R"({"text": {"size": 0}})", "vocab.json: text.size must be at least 1, got 0"},
      {R"({"text": {}})", "vocab.json: missing required key text.size"},
      {R"({"text": {"first_id": 5, "size": 10}})",
       "vocab.json: text.first_id 5 is not supported: text ids are the tokenizer's own ids, so they start at 0"},
      {R"({"text": {"size": "10"}})", "vocab.json: text.size must be an integer, got string \"10\""},
      {R"({"text": {"size": 10.5}})", "vocab.json: text.size must be an integer, got number 10.5"},
      {R"({"text": {"size": 10, "tokenizer": "missing.model"}})",
       "vocab.json: text.tokenizer \"missing.model\": no such file " + (dir_ / "missing.model").string()},
      {R"({"text": {"size": 10, "tokenizer": "../tokenizer.model"}})",
       "vocab.json: text.tokenizer \"../tokenizer.model\" must be a file name inside the model directory"},
      {R"({"text": {"size": 10, "tokenizer": 3}})", "vocab.json: text.tokenizer must be a file name, got 3"},
      {R"({"speech_units": {"codebooks": 2, "units_per_codebook": 8}})",
       "vocab.json: missing required key speech_units.first_id"},
      {R"({"speech_units": {"first_id": -1, "units_per_codebook": 8}})",
       "vocab.json: speech_units.first_id must be >= 0, got -1"},
      {R"({"speech_units": {"first_id": 0, "codebooks": 0, "units_per_codebook": 8}})",
       "vocab.json: speech_units.codebooks must be in [1, 64], got 0"},
      {R"({"speech_units": {"first_id": 0, "units_per_codebook": 0}})",
       "vocab.json: speech_units.units_per_codebook must be at least 1, got 0"},
      {R"({"speech_units": {"first_id": 0, "codebooks": 3, "units_per_codebook": 8, "frame_order": [0, 1]}})",
       "vocab.json: speech_units.frame_order has 2 entries, codebooks is 3: it must name every codebook once"},
      {R"({"speech_units": {"first_id": 0, "codebooks": 3, "units_per_codebook": 8, "frame_order": [0, 3, 1]}})",
       "vocab.json: speech_units.frame_order[1] = 3 is not a codebook in [0, 3)"},
      {R"({"speech_units": {"first_id": 0, "codebooks": 3, "units_per_codebook": 8, "frame_order": [0, 1, 0]}})",
       "vocab.json: speech_units.frame_order[2] = 0 repeats a codebook"},
      {R"({"speech_units": {"first_id": 0, "codebooks": 2, "units_per_codebook": 8, "frame_order": "01"}})",
       "vocab.json: speech_units.frame_order must be a list of codebooks, got \"01\""},
      {R"({"text": {"size": 100}, "speech_units": {"first_id": 64, "codebooks": 2, "units_per_codebook": 8}})",
       "vocab.json: speech_units [64, 80) overlaps text [0, 100)"},
      {R"({"speech_units": {"first_id": 64, "codebooks": 2, "units_per_codebook": 8}, "controls": {"eos": 70}})",
       "vocab.json: controls.eos = 70 lies inside speech_units [64, 80)"},
      {R"({"controls": {"bos": 1, "end_of_turn": 1}})", "vocab.json: controls.bos and controls.end_of_turn are both id 1"},
      {R"({"controls": {"bos": -3}})", "vocab.json: controls.bos = -3 is outside the vocabulary [0, 4096)"},
      {R"({"controls": {"end of turn": 3}})",
       "vocab.json: controls: the name \"end of turn\" is not 1 to 64 letters, digits, '_', '-' or '.'"},
      {R"({"controls": [1, 2]})", "vocab.json: controls must be an object, got array [1,2]"},
      {R"({"controls": {"bos": 99999999999}})", "vocab.json: controls.bos = 99999999999 is out of range"},
      {R"({"text": )", ""},  // the JSON parser's own message, checked by prefix below
  };
  for (const auto& [text, message] : corpus) {
    SCOPED_TRACE(text);
    const std::string got = error_of([&] { parse(text); });
    if (message.empty()) {
      EXPECT_EQ(got.rfind("vocab.json: not valid JSON", 0), 0u) << got;
    } else {
      EXPECT_EQ(got, message);
    }
  }
}

TEST_F(VocabLayoutTest, MasksFollowTheLayout) {
  const VocabLayout v = parse(R"({
    "text": {"size": 100},
    "speech_units": {"first_id": 200, "codebooks": 3, "units_per_codebook": 10, "frame_order": [1, 2, 0]},
    "controls": {"bos": 5, "end_of_turn": 300, "end_of_reply": 301, "pad": 400}
  })");
  const std::vector<SamplingMask> masks = sampling_masks_for(v);
  ASSERT_EQ(masks.size(), 4u);
  const SamplingMaskTable table(masks, 4096);
  EXPECT_EQ(masks[0].name, "text");
  EXPECT_EQ(masks[1].name, "text_and_controls");
  EXPECT_EQ(masks[2].name, "units");
  EXPECT_EQ(masks[3].name, "units_and_controls");
  auto ranges = [&](int mask, int position) {
    std::vector<std::pair<int32_t, int32_t>> out;
    for (const TokenRange& r : table.ranges(mask, position)) out.emplace_back(r.lo, r.hi);
    return out;
  };
  using R = std::vector<std::pair<int32_t, int32_t>>;
  EXPECT_EQ(ranges(0, 0), (R{{0, 100}}));
  EXPECT_EQ(ranges(1, 0), (R{{0, 100}, {300, 302}, {400, 401}}));  // bos is a text piece already
  EXPECT_EQ(ranges(2, 0), (R{{210, 220}}));                         // frame order 1, 2, 0
  EXPECT_EQ(ranges(2, 1), (R{{220, 230}}));
  EXPECT_EQ(ranges(2, 2), (R{{200, 210}}));
  EXPECT_EQ(ranges(2, 3), (R{{210, 220}}));  // modulo the period
  EXPECT_EQ(ranges(3, 0), (R{{5, 6}, {210, 220}, {300, 302}, {400, 401}}));
  EXPECT_EQ(ranges(3, 1), (R{{220, 230}}));
  // A control restarts the frame; a unit moves it on.
  EXPECT_EQ(next_frame_position(table.view(), 3, 0, 301), 0);
  EXPECT_EQ(next_frame_position(table.view(), 3, 0, 215), 1);
  EXPECT_EQ(next_frame_position(table.view(), 3, 2, 205), 0);
}

TEST(SamplingMaskTable, RefusesMasksNoDrawCouldUse) {
  auto error = [](std::vector<SamplingMask> masks) {
    return error_of<std::invalid_argument>([&] { SamplingMaskTable(masks, 50); });
  };
  EXPECT_EQ(error({{"m", {}}}), "sampling mask \"m\" has no frame position");
  EXPECT_EQ(error({{"m", {{}}}}), "sampling mask \"m\" position 0 allows no token");
  EXPECT_EQ(error({{"m", {{{0, 10, 0}}, {{40, 60, 0}}}}}),
            "sampling mask \"m\" position 1: range [40, 60) is empty or leaves the vocabulary [0, 50)");
  EXPECT_EQ(error({{"m", {{{5, 5, 0}}}}}),
            "sampling mask \"m\" position 0: range [5, 5) is empty or leaves the vocabulary [0, 50)");
  EXPECT_EQ(error({{"m", {{{20, 30, 0}, {0, 21, 0}}}}}), "sampling mask \"m\" position 0: ranges [0, 21) and [20, 30) overlap");
}

}  // namespace
}  // namespace m3
