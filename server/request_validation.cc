#include "server/request_validation.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>

namespace m3 {
namespace {

std::string format_float(float v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

uint64_t draw_seed() {
  static thread_local std::mt19937_64 gen{std::random_device{}()};
  return gen();
}

}  // namespace

std::string check_token_ids(std::span<const int32_t> ids, const char* field, int vocab_size) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      return std::string(field) + "[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
             " is outside the model's vocabulary [0, " + std::to_string(vocab_size) + ")";
    }
  }
  return "";
}

std::string check_max_new_tokens(uint32_t value, const char* field, int limit) {
  if (value == 0) return std::string(field) + " must be at least 1";
  if (value > static_cast<uint32_t>(limit)) {
    return std::string(field) + " = " + std::to_string(value) + " is above this server's limit of " +
           std::to_string(limit) + " (max_new_tokens_limit)";
  }
  return "";
}

std::string check_sampling(const v1::SamplingParams& s) {
  if (!std::isfinite(s.temperature()) || s.temperature() < 0) {
    return "sampling.temperature must be a finite number >= 0 (0 = greedy), got " +
           format_float(s.temperature());
  }
  if (s.top_k() < 0)
    return "sampling.top_k must be >= 0 (0 = no limit), got " + std::to_string(s.top_k());
  if (s.has_top_p() && !(s.top_p() > 0.0f && s.top_p() <= 1.0f))
    return "sampling.top_p must be in (0, 1], got " + format_float(s.top_p());
  return "";
}

std::string check_stop_tokens(std::span<const int32_t> ids, const char* field, int vocab_size) {
  if (ids.size() > static_cast<size_t>(kMaxStopTokens)) {
    return std::string(field) + " has " + std::to_string(ids.size()) + " ids, at most " +
           std::to_string(kMaxStopTokens) + " are allowed";
  }
  return check_token_ids(ids, field, vocab_size);
}

std::string check_request_id(const std::string& id, const char* field) {
  if (id.size() > kMaxRequestIdBytes) {
    return std::string(field) + " is " + std::to_string(id.size()) + " bytes long, at most " +
           std::to_string(kMaxRequestIdBytes) + " are allowed";
  }
  // Ids go into log lines as key=value words: a space, quote, '=' or line break in one
  // could forge fields or lines, so only a plain identifier alphabet is taken.
  for (unsigned char c : id) {
    const bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    if (alnum || (c != 0 && std::strchr("._:@/+-", c) != nullptr)) continue;
    char code[8];
    std::snprintf(code, sizeof code, "0x%02x", c);
    return std::string(field) + " contains the byte " + code + ": ids may use letters, digits and . _ : @ / + - only";
  }
  return "";
}

std::string check_text_size(const std::string& text, const char* field, int max_tokens) {
  const size_t limit = kMaxTextBytesPerToken * static_cast<size_t>(max_tokens);
  if (text.size() <= limit) return "";
  return std::string(field) + " is " + std::to_string(text.size()) + " bytes, more than " +
         std::to_string(kMaxTextBytesPerToken) + " for each of the " + std::to_string(max_tokens) +
         " tokens this server takes (max_prompt_tokens): at most " + std::to_string(limit);
}

std::string check_generate_request(const v1::GenerateRequest& r, const RequestLimits& limits) {
  if (auto e = check_request_id(r.request_id(), "request_id"); !e.empty()) return e;
  switch (r.prompt_case()) {
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return "the prompt is empty: set prompt_ids or prompt_text";
    case v1::GenerateRequest::kPromptIds: {
      const auto& ids = r.prompt_ids().ids();
      if (ids.empty()) return "prompt_ids is empty: a prompt needs at least one token";
      if (ids.size() > limits.max_prompt_tokens) {
        return "the prompt has " + std::to_string(ids.size()) + " tokens, this server's limit is " +
               std::to_string(limits.max_prompt_tokens) + " (max_prompt_tokens)";
      }
      if (auto e = check_token_ids({ids.data(), static_cast<size_t>(ids.size())}, "prompt_ids",
                                   limits.vocab_size);
          !e.empty())
        return e;
      break;
    }
    case v1::GenerateRequest::kPromptSegments:
      break;  // checked as it is mapped to ids (prompt_segments.h)
    case v1::GenerateRequest::kPromptText:
      if (!limits.has_tokenizer)
        return "prompt_text needs a tokenizer and this server has none (start it with "
               "--tokenizer FILE); send prompt_ids instead";
      if (r.prompt_text().empty()) return "prompt_text is empty: a prompt needs at least one token";
      if (auto e = check_text_size(r.prompt_text(), "prompt_text", limits.max_prompt_tokens); !e.empty()) return e;
      break;
  }
  if (auto e = check_max_new_tokens(r.max_new_tokens(), "max_new_tokens", limits.max_new_tokens_limit);
      !e.empty())
    return e;
  if (auto e = check_sampling(r.sampling()); !e.empty()) return e;
  return check_stop_tokens({r.stop_token_ids().data(), static_cast<size_t>(r.stop_token_ids_size())},
                           "stop_token_ids", limits.vocab_size);
}

std::string check_session_config(const v1::SessionConfig& c, const RequestLimits& limits) {
  if (auto e = check_request_id(c.session_id(), "config.session_id"); !e.empty()) return e;
  if (c.max_new_tokens() != 0) {
    if (auto e = check_max_new_tokens(c.max_new_tokens(), "config.max_new_tokens",
                                      limits.max_new_tokens_limit);
        !e.empty())
      return e;
  }
  if (auto e = check_sampling(c.sampling()); !e.empty()) return "config." + e;
  return check_stop_tokens({c.stop_token_ids().data(), static_cast<size_t>(c.stop_token_ids_size())},
                           "config.stop_token_ids", limits.vocab_size);
}

SamplingParams engine_sampling(const v1::SamplingParams& s) {
  SamplingParams p;
  p.temperature = s.temperature();
  p.top_k = s.top_k();
  p.top_p = s.has_top_p() ? s.top_p() : 1.0f;
  p.seed = s.has_seed() ? s.seed() : draw_seed();
  return p;
}

}  // namespace m3
