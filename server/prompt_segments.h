// A prompt (or a Converse turn's input) given in the model's terms, as segments of text,
// speech unit frames, named controls and raw ids, mapped to token ids through the
// model's vocabulary layout (model/vocab_layout.h) and tokenizer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "m3serve.pb.h"

namespace m3 {

namespace v1 = ::m3serve::v1;

class Tokenizer;
struct VocabLayout;

struct SegmentVocabulary {
  const VocabLayout* layout = nullptr;   // null: the model has no vocab.json
  const Tokenizer* tokenizer = nullptr;  // null: no text
  int vocab_size = 0;
  int max_tokens = 0;  // the most ids the segments may map to (max_prompt_tokens)
};

struct ServiceContext;
SegmentVocabulary segment_vocabulary(const ServiceContext& ctx);

// Appends the ids of `segments` to *ids. Returns "" or the INVALID_ARGUMENT message,
// naming the segment by `field` ("prompt_segments.segments[2].units[5] = 1030 is outside
// codebook 1's units [0, 1024)").
std::string segments_to_ids(const v1::Segments& segments, const SegmentVocabulary& vocab, const std::string& field,
                            std::vector<int32_t>* ids);

}  // namespace m3
