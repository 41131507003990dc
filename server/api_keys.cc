#include "server/api_keys.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <fstream>
#include <sstream>
#include <stdexcept>

namespace m3 {
namespace {

ApiKeys::Digest digest_of(std::string_view text) {
  ApiKeys::Digest d{};
  unsigned int size = 0;
  if (EVP_Digest(text.data(), text.size(), d.data(), &size, EVP_sha256(), nullptr) != 1 || size != d.size())
    throw std::runtime_error("api_keys: OpenSSL could not compute a SHA-256 digest");
  return d;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

}  // namespace

std::vector<ApiKeys::Digest> ApiKeys::read_file(const std::string& path, const std::string& setting) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(setting + ": cannot read '" + path + "'");
  std::vector<Digest> digests;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    const std::string_view key = trim(line);
    if (key.empty() || key.front() == '#') continue;
    for (unsigned char c : key)
      if (c <= ' ' || c == 0x7f)
        throw std::invalid_argument(setting + ": '" + path + "' line " + std::to_string(number) +
                                    ": a key may not contain spaces or control characters");
    digests.push_back(digest_of(key));
  }
  if (in.bad()) throw std::invalid_argument(setting + ": error reading '" + path + "'");
  if (digests.empty())
    throw std::invalid_argument(setting + ": '" + path + "' holds no key (one key a line; '#' starts a comment)");
  return digests;
}

ApiKeys::ApiKeys(std::string path, std::string setting)
    : path_(std::move(path)),
      setting_(std::move(setting)),
      digests_(std::make_shared<const std::vector<Digest>>(read_file(path_, setting_))) {}

size_t ApiKeys::reload() {
  auto fresh = std::make_shared<const std::vector<Digest>>(read_file(path_, setting_));
  std::lock_guard lock(mu_);
  digests_ = std::move(fresh);
  return digests_->size();
}

size_t ApiKeys::size() const {
  std::lock_guard lock(mu_);
  return digests_->size();
}

std::string ApiKeys::check(std::optional<std::string_view> authorization) const {
  if (!authorization) return "missing API key: send the metadata 'authorization: Bearer <key>'";
  constexpr std::string_view kScheme = "Bearer ";
  if (authorization->size() <= kScheme.size() || authorization->substr(0, kScheme.size()) != kScheme)
    return "the 'authorization' metadata is not of the form 'Bearer <key>'";
  return accepts(authorization->substr(kScheme.size())) ? "" : "invalid API key";
}

bool ApiKeys::accepts(std::string_view key) const {
  const Digest sent = digest_of(key);
  std::shared_ptr<const std::vector<Digest>> digests;
  {
    std::lock_guard lock(mu_);
    digests = digests_;
  }
  // Every key is compared, whichever matches.
  int matched = 0;
  for (const Digest& d : *digests) matched |= CRYPTO_memcmp(d.data(), sent.data(), d.size()) == 0;
  return matched != 0;
}

}  // namespace m3
