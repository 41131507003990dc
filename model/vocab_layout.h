// What the model's token ids mean: the optional vocab.json of a model directory.
//
//   {
//     "text": {"first_id": 0, "size": 4000, "tokenizer": "tokenizer.model"},
//     "speech_units": {"first_id": 4000, "codebooks": 8, "units_per_codebook": 1024,
//                      "frame_order": [0, 1, 2, 3, 4, 5, 6, 7]},
//     "controls": {"bos": 4096, "end_of_turn": 4097, "end_of_reply": 4098, "pad": 4099}
//   }
//
// Every part is optional. Text ids are the SentencePiece model's own ids, so the text
// range starts at 0; "tokenizer" names the .model file inside the model directory. Unit u
// of codebook c is id first_id + c * units_per_codebook + u; a frame holds one unit of
// every codebook, flattened in frame_order (default 0, 1, ..., codebooks - 1). Controls
// are named ids: bos, end_of_turn, end_of_reply and pad have roles in the server, any
// other name (letters, digits, '_', '-', '.') is only a name. A control may be a text
// piece (SentencePiece's own control pieces are), never a unit.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace m3 {

struct TextVocab {
  int32_t first_id = 0;
  int32_t size = 0;
  std::filesystem::path tokenizer;  // absolute (the model directory's file); empty: none
};

struct SpeechUnitVocab {
  int32_t first_id = 0;
  int32_t codebooks = 0;
  int32_t units_per_codebook = 0;
  std::vector<int32_t> frame_order;  // frame position -> codebook

  int32_t end_id() const { return first_id + codebooks * units_per_codebook; }
  bool contains(int32_t id) const { return id >= first_id && id < end_id(); }
  int32_t id_of(int32_t codebook, int32_t unit) const { return first_id + codebook * units_per_codebook + unit; }
  int32_t codebook_of(int32_t id) const { return (id - first_id) / units_per_codebook; }
  int32_t unit_of(int32_t id) const { return (id - first_id) % units_per_codebook; }
};

struct ControlToken {
  std::string name;
  int32_t id = 0;
};

struct VocabLayout {
  std::optional<TextVocab> text;
  std::optional<SpeechUnitVocab> speech_units;
  std::vector<ControlToken> controls;  // in id order

  // -1 when there is no such control.
  int32_t control_id(std::string_view name) const;
  // The control's name, or nullptr when `id` is no control.
  const std::string* control_name(int32_t id) const;
  bool is_text(int32_t id) const { return text && id >= text->first_id && id < text->first_id + text->size; }

  // Parses vocab.json text; `source` prefixes every error ("vocab.json: ..."), and the
  // tokenizer file is looked up in `model_dir`. Throws std::runtime_error naming the field.
  static VocabLayout parse(std::string_view json_text, const std::string& source, int32_t vocab_size,
                           const std::filesystem::path& model_dir);
  // model_dir/vocab.json when it exists (nullopt when not), parsed as above.
  static std::optional<VocabLayout> load(const std::filesystem::path& model_dir, int32_t vocab_size);
};

}  // namespace m3
