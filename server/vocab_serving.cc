#include "server/vocab_serving.h"

#include "server/service_context.h"

namespace m3 {
namespace {

// The mask each AllowedTokens value stands for (sampling_masks_for's names).
const char* mask_name(int allowed) {
  switch (allowed) {
    case v1::ALLOWED_TOKENS_TEXT: return "text";
    case v1::ALLOWED_TOKENS_TEXT_AND_CONTROLS: return "text_and_controls";
    case v1::ALLOWED_TOKENS_UNITS: return "units";
    case v1::ALLOWED_TOKENS_UNITS_AND_CONTROLS: return "units_and_controls";
    default: return nullptr;
  }
}

// What a vocab.json must name for a mask to exist.
const char* mask_needs(int allowed) {
  switch (allowed) {
    case v1::ALLOWED_TOKENS_TEXT: return "a text range";
    case v1::ALLOWED_TOKENS_TEXT_AND_CONTROLS: return "a text range and controls";
    case v1::ALLOWED_TOKENS_UNITS: return "speech units";
    default: return "speech units and controls";
  }
}

}  // namespace

void fill_vocab_info(const VocabLayout& layout, v1::VocabLayout* out) {
  if (layout.text) {
    auto* t = out->mutable_text();
    t->set_first_id(layout.text->first_id);
    t->set_size(layout.text->size);
    t->set_tokenizer(layout.text->tokenizer.filename().string());
  }
  if (layout.speech_units) {
    auto* u = out->mutable_speech_units();
    u->set_first_id(layout.speech_units->first_id);
    u->set_codebooks(layout.speech_units->codebooks);
    u->set_units_per_codebook(layout.speech_units->units_per_codebook);
    u->mutable_frame_order()->Add(layout.speech_units->frame_order.begin(), layout.speech_units->frame_order.end());
  }
  for (const ControlToken& c : layout.controls) {
    auto* control = out->add_controls();
    control->set_name(c.name);
    control->set_id(c.id);
  }
}

std::string describe_vocab(const VocabLayout& layout) {
  std::string out;
  const auto part = [&](const std::string& text) { out += (out.empty() ? "" : "; ") + text; };
  if (layout.text) {
    part("text [" + std::to_string(layout.text->first_id) + ", " +
         std::to_string(layout.text->first_id + layout.text->size) + ")" +
         (layout.text->tokenizer.empty() ? "" : " with " + layout.text->tokenizer.filename().string()));
  }
  if (const auto& u = layout.speech_units) {
    std::string order;
    for (int32_t c : u->frame_order) order += (order.empty() ? "" : " ") + std::to_string(c);
    part(std::to_string(u->codebooks) + " codebooks x " + std::to_string(u->units_per_codebook) + " units at [" +
         std::to_string(u->first_id) + ", " + std::to_string(u->end_id()) + "), frame order " + order);
  }
  if (!layout.controls.empty()) {
    std::string controls = "controls";
    for (const ControlToken& c : layout.controls) controls += " " + c.name + "=" + std::to_string(c.id);
    part(controls);
  }
  return out.empty() ? "nothing named" : out;
}

void resolve_allowed_tokens(const VocabLayout* layout, const std::vector<SamplingMask>& masks, int engine_masks,
                            const std::string& backend, ServiceContext* ctx) {
  const int n = v1::AllowedTokens_ARRAYSIZE;
  ctx->allowed_mask.assign(n, -1);
  ctx->allowed_unavailable.assign(n, "");
  for (int a = 0; a < n; ++a) {
    const char* name = mask_name(a);
    if (name == nullptr) continue;  // ALL: no mask
    const std::string value = v1::AllowedTokens_Name(a);
    int index = -1;
    for (size_t i = 0; i < masks.size(); ++i) {
      if (masks[i].name == name) index = static_cast<int>(i);
    }
    if (index < 0) {
      ctx->allowed_unavailable[a] = value + " needs " + mask_needs(a) + " in the model's vocab.json" +
                                    (layout == nullptr ? " and the model has none" : ", which names none");
    } else if (index >= engine_masks) {
      ctx->allowed_unavailable[a] = value + ": the " + backend +
                                    " backend does not apply sampling masks yet; serve with --backend cpu for "
                                    "constrained sampling";
    } else {
      ctx->allowed_mask[a] = index;
    }
  }
}

std::string check_allowed_tokens(const v1::SamplingParams& sampling, const ServiceContext& ctx, const char* field,
                                 int32_t* mask) {
  *mask = -1;
  const int a = sampling.allowed();
  if (a == v1::ALLOWED_TOKENS_ALL) return "";
  if (ctx.allowed_mask.empty()) {
    return std::string(field) + ".allowed needs a vocabulary layout (vocab.json) and this server has none";
  }
  if (a < 0 || static_cast<size_t>(a) >= ctx.allowed_mask.size()) {
    return std::string(field) + ".allowed = " + std::to_string(a) + " is not an AllowedTokens value";
  }
  if (!ctx.allowed_unavailable[a].empty()) return std::string(field) + ".allowed = " + ctx.allowed_unavailable[a];
  *mask = ctx.allowed_mask[a];
  return "";
}

}  // namespace m3
