#include "server/reply_segments.h"

namespace m3 {

ReplySegmenter::ReplySegmenter(const VocabLayout& layout, const Tokenizer* tokenizer) : layout_(&layout) {
  if (tokenizer != nullptr && layout.text) detokenizer_ = std::make_unique<StreamDetokenizer>(*tokenizer);
  if (layout.speech_units) {
    frame_.reserve(static_cast<size_t>(layout.speech_units->codebooks));
    units_.resize(static_cast<size_t>(layout.speech_units->codebooks));
  }
}

void ReplySegmenter::append(std::span<const int32_t> ids, Out* out) {
  for (const int32_t id : ids) {
    if (const std::string* name = layout_->control_name(id)) {
      flush_text(out);
      flush_frame(out);
      out->Add()->set_control(*name);
      continue;
    }
    if (detokenizer_ && layout_->is_text(id)) {
      flush_frame(out);
      text_.clear();
      detokenizer_->append(id, &text_);
      add_text(text_, out);
      continue;
    }
    flush_text(out);
    const SpeechUnitVocab* u = layout_->speech_units ? &*layout_->speech_units : nullptr;
    if (u == nullptr || !u->contains(id)) {
      flush_frame(out);
      add_raw(id, out);
      continue;
    }
    // A unit of another codebook than the frame's next position breaks the frame off; it
    // starts the next one when it is a frame's first codebook.
    if (u->codebook_of(id) != u->frame_order[frame_.size()]) {
      flush_frame(out);
      if (u->codebook_of(id) != u->frame_order[0]) {
        add_raw(id, out);
        continue;
      }
    }
    frame_.push_back(id);
    if (frame_.size() < static_cast<size_t>(u->codebooks)) continue;
    for (const int32_t unit_id : frame_) units_[static_cast<size_t>(u->codebook_of(unit_id))] = u->unit_of(unit_id);
    frame_.clear();
    // Frames one after another join one units segment.
    v1::Segment* last = out->empty() ? nullptr : out->Mutable(out->size() - 1);
    if (last == nullptr || !last->has_units()) last = out->Add();
    last->mutable_units()->mutable_units()->Add(units_.begin(), units_.end());
  }
}

void ReplySegmenter::finish(Out* out) {
  flush_text(out);
  flush_frame(out);
}

void ReplySegmenter::flush_text(Out* out) {
  if (!detokenizer_) return;
  text_.clear();
  detokenizer_->finish(&text_);
  add_text(text_, out);
}

void ReplySegmenter::flush_frame(Out* out) {
  const std::vector<int32_t> broken = std::move(frame_);
  frame_.clear();
  for (const int32_t id : broken) add_raw(id, out);
}

void ReplySegmenter::add_text(const std::string& text, Out* out) {
  if (text.empty()) return;
  v1::Segment* last = out->empty() ? nullptr : out->Mutable(out->size() - 1);
  if (last == nullptr || !last->has_text()) {
    out->Add()->set_text(text);
  } else {
    last->mutable_text()->append(text);
  }
}

void ReplySegmenter::add_raw(int32_t id, Out* out) {
  v1::Segment* last = out->empty() ? nullptr : out->Mutable(out->size() - 1);
  if (last == nullptr || !last->has_ids()) last = out->Add();
  last->mutable_ids()->add_ids(id);
}

}  // namespace m3
