// The model's vocabulary layout as the service uses it: ModelInfo's description of it,
// the engine's sampling mask for each AllowedTokens value, and the check of a request's
// choice.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "m3serve.pb.h"
#include "model/sampling_mask.h"
#include "model/vocab_layout.h"

namespace m3 {

namespace v1 = ::m3serve::v1;

struct ServiceContext;

void fill_vocab_info(const VocabLayout& layout, v1::VocabLayout* out);
// One line for the start log: "text [0, 320) with tokenizer.model; 4 codebooks x 32
// units at [320, 448), frame order 2 0 3 1; controls bos=500 end_of_turn=501".
std::string describe_vocab(const VocabLayout& layout);

// Fills ctx.allowed_mask and ctx.allowed_unavailable for every AllowedTokens value from
// the masks the engine was given (`masks`, by name) and how many it applies
// (`engine_masks`: 0 where the backend has no constrained sampling); `backend` names it in
// the refusals.
void resolve_allowed_tokens(const VocabLayout* layout, const std::vector<SamplingMask>& masks, int engine_masks,
                            const std::string& backend, ServiceContext* ctx);

// The engine mask for `sampling.allowed` into *mask, or the INVALID_ARGUMENT message
// (`field` names the sampling message: "sampling", "config.sampling").
std::string check_allowed_tokens(const v1::SamplingParams& sampling, const ServiceContext& ctx, const char* field,
                                 int32_t* mask);

}  // namespace m3
