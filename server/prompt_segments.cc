#include "server/prompt_segments.h"

#include <exception>

#include "model/tokenizer.h"
#include "model/vocab_layout.h"
#include "server/request_validation.h"
#include "server/service_context.h"

namespace m3 {
namespace {

std::string control_names(const VocabLayout& layout) {
  std::string names;
  for (const ControlToken& c : layout.controls) names += (names.empty() ? "" : ", ") + c.name;
  return names.empty() ? "it names none" : names;
}

bool printable(const std::string& name) {
  if (name.size() > 64) return false;
  for (unsigned char c : name) {
    if (c < 0x20 || c > 0x7e || c == '"') return false;
  }
  return true;
}

std::string too_many(const std::string& field, size_t count, int limit) {
  return field + " maps to more than " + std::to_string(limit) + " tokens (" + std::to_string(count) +
         " so far), this server's limit (max_prompt_tokens)";
}

std::string append_text(const v1::Segment& s, const SegmentVocabulary& vocab, const std::string& at,
                        std::vector<int32_t>* ids) {
  if (vocab.tokenizer == nullptr) {
    return at + ".text needs a tokenizer and this server has none (a vocab.json text.tokenizer, or "
                "--tokenizer FILE); send units, controls or ids instead";
  }
  if (auto e = check_text_size(s.text(), (at + ".text").c_str(), vocab.max_tokens); !e.empty()) return e;
  std::vector<int32_t> text_ids;
  try {
    text_ids = vocab.tokenizer->encode(s.text());
  } catch (const std::exception& e) {
    return at + ".text could not be tokenized: " + e.what();
  }
  if (auto e = check_token_ids(text_ids, (at + ".text's token ids").c_str(), vocab.vocab_size); !e.empty()) return e;
  ids->insert(ids->end(), text_ids.begin(), text_ids.end());
  return "";
}

std::string append_units(const v1::Segment& s, const SegmentVocabulary& vocab, const std::string& at,
                         std::vector<int32_t>* ids) {
  if (vocab.layout == nullptr || !vocab.layout->speech_units) {
    return at + ".units: this model's vocabulary has no speech units (" +
           (vocab.layout == nullptr ? "the model has no vocab.json" : "its vocab.json has no speech_units") + ")";
  }
  const SpeechUnitVocab& u = *vocab.layout->speech_units;
  const auto& units = s.units().units();
  const int n = units.size();
  if (n == 0 || n % u.codebooks != 0) {
    return at + ".units has " + std::to_string(n) + " unit numbers, not a whole number (at least one) of frames of " +
           std::to_string(u.codebooks) + " codebooks";
  }
  if (ids->size() + static_cast<size_t>(n) > static_cast<size_t>(vocab.max_tokens)) {
    return too_many(at, ids->size() + static_cast<size_t>(n), vocab.max_tokens);
  }
  for (int i = 0; i < n; ++i) {
    if (units[i] < 0 || units[i] >= u.units_per_codebook) {
      return at + ".units[" + std::to_string(i) + "] = " + std::to_string(units[i]) + " is outside codebook " +
             std::to_string(i % u.codebooks) + "'s units [0, " + std::to_string(u.units_per_codebook) + ")";
    }
  }
  for (int frame = 0; frame < n / u.codebooks; ++frame) {
    for (int32_t codebook : u.frame_order) ids->push_back(u.id_of(codebook, units[frame * u.codebooks + codebook]));
  }
  return "";
}

}  // namespace

SegmentVocabulary segment_vocabulary(const ServiceContext& ctx) {
  SegmentVocabulary v;
  v.layout = ctx.vocab;
  v.tokenizer = ctx.tokenizer;
  v.vocab_size = ctx.limits.vocab_size;
  v.max_tokens = ctx.limits.max_prompt_tokens;
  return v;
}

std::string segments_to_ids(const v1::Segments& segments, const SegmentVocabulary& vocab, const std::string& field,
                            std::vector<int32_t>* ids) {
  const size_t start = ids->size();
  for (int i = 0; i < segments.segments_size(); ++i) {
    const v1::Segment& s = segments.segments(i);
    const std::string at = field + ".segments[" + std::to_string(i) + "]";
    std::string error;
    switch (s.kind_case()) {
      case v1::Segment::kText:
        error = append_text(s, vocab, at, ids);
        break;
      case v1::Segment::kUnits:
        error = append_units(s, vocab, at, ids);
        break;
      case v1::Segment::kControl: {
        if (vocab.layout == nullptr) {
          return at + ".control \"" + s.control() + "\": this model has no vocab.json, so no named controls";
        }
        const int32_t id = vocab.layout->control_id(s.control());
        if (id < 0) {
          // The client's name is quoted only when short and printable (the message is logged).
          const std::string shown = printable(s.control()) ? "\"" + s.control() + "\"" : "(a name of other characters)";
          return at + ".control " + shown + " is not one of this model's controls (" +
                 control_names(*vocab.layout) + ")";
        }
        ids->push_back(id);
        break;
      }
      case v1::Segment::kIds: {
        const auto& raw = s.ids().ids();
        error = check_token_ids({raw.data(), static_cast<size_t>(raw.size())}, (at + ".ids").c_str(), vocab.vocab_size);
        if (error.empty()) ids->insert(ids->end(), raw.begin(), raw.end());
        break;
      }
      case v1::Segment::KIND_NOT_SET:
        return at + " has no kind set: text, units, control or ids";
    }
    if (!error.empty()) return error;
    if (ids->size() - start > static_cast<size_t>(vocab.max_tokens)) {
      return too_many(field, ids->size() - start, vocab.max_tokens);
    }
  }
  if (ids->size() == start) return field + " holds no tokens: a prompt needs at least one";
  return "";
}

}  // namespace m3
