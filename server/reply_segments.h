// A reply's ids as typed segments (Tokens.segments), assembled as they stream: unit
// frames once all their codebooks are out, text decoded incrementally (never splitting a
// UTF-8 character), controls by name, anything else as raw ids. One per stream; not
// thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "m3serve.pb.h"
#include "model/tokenizer.h"
#include "model/vocab_layout.h"

namespace m3 {

namespace v1 = ::m3serve::v1;

class ReplySegmenter {
 public:
  using Out = google::protobuf::RepeatedPtrField<v1::Segment>;

  // `tokenizer` may be null: text ids then go out as raw ids.
  ReplySegmenter(const VocabLayout& layout, const Tokenizer* tokenizer);

  // Appends the segments `ids` complete to *out (a unit frame still missing codebooks,
  // or bytes of an unfinished character, wait for the next ids).
  void append(std::span<const int32_t> ids, Out* out);
  // The reply ended: appends what waits (a broken-off frame's units as raw ids, an
  // unfinished character as U+FFFD).
  void finish(Out* out);

 private:
  void flush_text(Out* out);
  void flush_frame(Out* out);  // the units of an unfinished frame, as raw ids
  void add_text(const std::string& text, Out* out);
  void add_raw(int32_t id, Out* out);

  const VocabLayout* layout_;
  std::unique_ptr<StreamDetokenizer> detokenizer_;
  std::string text_;             // scratch
  std::vector<int32_t> frame_;   // ids of the frame under way, in frame order
  std::vector<int32_t> units_;   // scratch: one frame's unit numbers by codebook
};

}  // namespace m3
