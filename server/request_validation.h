// Checks of client input against the model and the server's limits. Each returns ""
// when the input is fine, else the message the client gets with INVALID_ARGUMENT.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "m3serve.pb.h"
#include "model/engine.h"

namespace m3 {

namespace v1 = ::m3serve::v1;

struct RequestLimits {
  int vocab_size = 0;
  int max_new_tokens_limit = 0;
  int max_prompt_tokens = 0;
  bool has_tokenizer = false;
};

inline constexpr int kMaxStopTokens = 64;
inline constexpr size_t kMaxRequestIdBytes = 128;

std::string check_token_ids(std::span<const int32_t> ids, const char* field, int vocab_size);
std::string check_max_new_tokens(uint32_t value, const char* field, int limit);
std::string check_sampling(const v1::SamplingParams& sampling);
std::string check_stop_tokens(std::span<const int32_t> ids, const char* field, int vocab_size);
std::string check_request_id(const std::string& id, const char* field);
// Text longer than kMaxTextBytesPerToken bytes for each token of max_tokens is refused
// before it is tokenized: SentencePiece spends memory and time by the byte (about 200
// bytes of memory a byte: a 4 MiB message took 0.8 GB and 2 s, then was refused anyway).
inline constexpr size_t kMaxTextBytesPerToken = 16;
std::string check_text_size(const std::string& text, const char* field, int max_tokens);

// Everything but a text prompt's encoding (the caller encodes and checks the ids).
std::string check_generate_request(const v1::GenerateRequest& request, const RequestLimits& limits);
std::string check_session_config(const v1::SessionConfig& config, const RequestLimits& limits);

// The engine's sampling parameters; a seed is drawn when the request has none.
SamplingParams engine_sampling(const v1::SamplingParams& sampling);

}  // namespace m3
