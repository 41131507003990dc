#include "model/vocab_layout.h"

#include <algorithm>
#include <climits>
#include <set>
#include <stdexcept>
#include <system_error>

#include <nlohmann/json.hpp>

#include "model/json_input.h"

namespace m3 {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxVocabJsonBytes = 4 << 20;
constexpr size_t kMaxControls = 4096;
constexpr size_t kMaxControlNameBytes = 64;

class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& what) const { throw std::runtime_error(source_ + ": " + what); }

  void expect_object(const json& v, const std::string& path) const {
    if (!v.is_object()) fail(path + " must be an object, got " + std::string(v.type_name()) + " " + json_brief(v));
  }

  // Refuses keys the format does not have (a misspelt "frame_ordr" would otherwise be
  // silently ignored and the default used).
  void only_keys(const json& obj, const std::string& path, std::initializer_list<const char*> keys) const {
    for (const auto& [key, value] : obj.items()) {
      if (std::none_of(keys.begin(), keys.end(), [&](const char* k) { return key == k; })) {
        std::string known;
        for (const char* k : keys) known += (known.empty() ? "" : ", ") + std::string(k);
        fail((path.empty() ? "" : path + ": ") + "unknown key \"" + key + "\" (known: " + known + ")");
      }
    }
  }

  int32_t as_int(const json& v, const std::string& path) const {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(INT32_MAX)
                                 : (v.get<int64_t>() >= INT32_MIN && v.get<int64_t>() <= INT32_MAX))
        return static_cast<int32_t>(v.get<int64_t>());
      fail(path + " = " + json_brief(v) + " is out of range");
    }
    fail(path + " must be an integer, got " + std::string(v.type_name()) + " " + json_brief(v));
  }

  int32_t int_key(const json& obj, const char* key, const std::string& path, std::optional<int32_t> fallback) const {
    auto it = obj.find(key);
    if (it == obj.end()) {
      if (fallback) return *fallback;
      fail("missing required key " + path + "." + key);
    }
    return as_int(*it, path + "." + key);
  }

 private:
  std::string source_;
};

bool valid_control_name(const std::string& name) {
  if (name.empty() || name.size() > kMaxControlNameBytes) return false;
  return std::all_of(name.begin(), name.end(), [](unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           c == '.';
  });
}

TextVocab read_text(const Reader& r, const json& v, int32_t vocab_size, const std::filesystem::path& model_dir) {
  r.expect_object(v, "text");
  r.only_keys(v, "text", {"first_id", "size", "tokenizer"});
  TextVocab t;
  t.first_id = r.int_key(v, "first_id", "text", 0);
  t.size = r.int_key(v, "size", "text", std::nullopt);
  if (t.first_id != 0) {
    r.fail("text.first_id " + std::to_string(t.first_id) +
           " is not supported: text ids are the tokenizer's own ids, so they start at 0");
  }
  if (t.size < 1) r.fail("text.size must be at least 1, got " + std::to_string(t.size));
  if (t.size > vocab_size) {
    r.fail("text.size " + std::to_string(t.size) + " runs past vocab_size " + std::to_string(vocab_size));
  }
  if (auto it = v.find("tokenizer"); it != v.end()) {
    if (!it->is_string()) r.fail("text.tokenizer must be a file name, got " + json_brief(*it));
    const std::filesystem::path name = it->get<std::string>();
    // The file belongs to the model directory: a path out of it is a packaging mistake.
    if (name.empty() || name.is_absolute() || name.has_parent_path()) {
      r.fail("text.tokenizer " + json_brief(*it) + " must be a file name inside the model directory");
    }
    t.tokenizer = model_dir / name;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(t.tokenizer, ec)) {
      r.fail("text.tokenizer " + json_brief(*it) + ": no such file " + t.tokenizer.string());
    }
  }
  return t;
}

SpeechUnitVocab read_units(const Reader& r, const json& v, int32_t vocab_size) {
  r.expect_object(v, "speech_units");
  r.only_keys(v, "speech_units", {"first_id", "codebooks", "units_per_codebook", "frame_order"});
  SpeechUnitVocab u;
  u.first_id = r.int_key(v, "first_id", "speech_units", std::nullopt);
  u.codebooks = r.int_key(v, "codebooks", "speech_units", 1);
  u.units_per_codebook = r.int_key(v, "units_per_codebook", "speech_units", std::nullopt);
  if (u.first_id < 0) r.fail("speech_units.first_id must be >= 0, got " + std::to_string(u.first_id));
  if (u.codebooks < 1 || u.codebooks > 64) {
    r.fail("speech_units.codebooks must be in [1, 64], got " + std::to_string(u.codebooks));
  }
  if (u.units_per_codebook < 1) {
    r.fail("speech_units.units_per_codebook must be at least 1, got " + std::to_string(u.units_per_codebook));
  }
  const int64_t end = int64_t{u.first_id} + int64_t{u.codebooks} * u.units_per_codebook;
  if (end > vocab_size) {
    r.fail("speech_units.first_id " + std::to_string(u.first_id) + " + " + std::to_string(u.codebooks) + " x " +
           std::to_string(u.units_per_codebook) + " units runs past vocab_size " + std::to_string(vocab_size));
  }
  if (auto it = v.find("frame_order"); it != v.end()) {
    if (!it->is_array()) r.fail("speech_units.frame_order must be a list of codebooks, got " + json_brief(*it));
    if (it->size() != static_cast<size_t>(u.codebooks)) {
      r.fail("speech_units.frame_order has " + std::to_string(it->size()) + " entries, codebooks is " +
             std::to_string(u.codebooks) + ": it must name every codebook once");
    }
    std::vector<bool> seen(static_cast<size_t>(u.codebooks), false);
    for (size_t p = 0; p < it->size(); ++p) {
      const std::string path = "speech_units.frame_order[" + std::to_string(p) + "]";
      const int32_t c = r.as_int((*it)[p], path);
      if (c < 0 || c >= u.codebooks) {
        r.fail(path + " = " + std::to_string(c) + " is not a codebook in [0, " + std::to_string(u.codebooks) + ")");
      }
      if (seen[static_cast<size_t>(c)]) r.fail(path + " = " + std::to_string(c) + " repeats a codebook");
      seen[static_cast<size_t>(c)] = true;
      u.frame_order.push_back(c);
    }
  } else {
    for (int32_t c = 0; c < u.codebooks; ++c) u.frame_order.push_back(c);
  }
  return u;
}

std::vector<ControlToken> read_controls(const Reader& r, const json& v, int32_t vocab_size,
                                        const std::optional<SpeechUnitVocab>& units) {
  r.expect_object(v, "controls");
  if (v.size() > kMaxControls) {
    r.fail("controls has " + std::to_string(v.size()) + " entries, at most " + std::to_string(kMaxControls));
  }
  std::vector<ControlToken> out;
  for (const auto& [name, value] : v.items()) {
    const std::string path = "controls." + name;
    if (!valid_control_name(name)) {
      r.fail("controls: the name " + json(name).dump() +
             " is not 1 to 64 letters, digits, '_', '-' or '.'");
    }
    const int32_t id = r.as_int(value, path);
    if (id < 0 || id >= vocab_size) {
      r.fail(path + " = " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
    }
    if (units && units->contains(id)) {
      r.fail(path + " = " + std::to_string(id) + " lies inside speech_units [" + std::to_string(units->first_id) +
             ", " + std::to_string(units->end_id()) + ")");
    }
    out.push_back({name, id});
  }
  std::sort(out.begin(), out.end(), [](const ControlToken& a, const ControlToken& b) { return a.id < b.id; });
  for (size_t i = 1; i < out.size(); ++i) {
    if (out[i].id == out[i - 1].id) {
      r.fail("controls." + out[i - 1].name + " and controls." + out[i].name + " are both id " +
             std::to_string(out[i].id));
    }
  }
  return out;
}

}  // namespace

int32_t VocabLayout::control_id(std::string_view name) const {
  for (const ControlToken& c : controls) {
    if (c.name == name) return c.id;
  }
  return -1;
}

const std::string* VocabLayout::control_name(int32_t id) const {
  auto it = std::lower_bound(controls.begin(), controls.end(), id,
                             [](const ControlToken& c, int32_t v) { return c.id < v; });
  return it != controls.end() && it->id == id ? &it->name : nullptr;
}

VocabLayout VocabLayout::parse(std::string_view json_text, const std::string& source, int32_t vocab_size,
                               const std::filesystem::path& model_dir) {
  const Reader r(source);
  const json root = parse_json_bounded(json_text, source, "");
  r.expect_object(root, "the file");
  r.only_keys(root, "", {"text", "speech_units", "controls"});
  VocabLayout layout;
  if (auto it = root.find("text"); it != root.end()) layout.text = read_text(r, *it, vocab_size, model_dir);
  if (auto it = root.find("speech_units"); it != root.end()) layout.speech_units = read_units(r, *it, vocab_size);
  if (layout.text && layout.speech_units && layout.speech_units->first_id < layout.text->size) {
    r.fail("speech_units [" + std::to_string(layout.speech_units->first_id) + ", " +
           std::to_string(layout.speech_units->end_id()) + ") overlaps text [0, " + std::to_string(layout.text->size) +
           ")");
  }
  if (auto it = root.find("controls"); it != root.end()) {
    layout.controls = read_controls(r, *it, vocab_size, layout.speech_units);
  }
  return layout;
}

std::optional<VocabLayout> VocabLayout::load(const std::filesystem::path& model_dir, int32_t vocab_size) {
  const std::filesystem::path path = model_dir / "vocab.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  return parse(read_text_file(path, kMaxVocabJsonBytes), path.string(), vocab_size, model_dir);
}

}  // namespace m3
