// The API keys a server accepts (the api_keys file) and the check every RPC but the
// health service makes: the metadata "authorization: Bearer KEY" must carry one of them.
// Keys are kept as SHA-256 digests and compared in constant time (every key, every time),
// so neither the comparison's timing nor a memory dump gives a key away. The file is
// re-read on SIGHUP; a file that cannot be used leaves the keys in force unchanged.
#pragma once

#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace m3 {

class ApiKeys {
 public:
  using Digest = std::array<unsigned char, 32>;

  // Reads the file (one key a line; blank lines and lines starting with '#' are skipped,
  // surrounding spaces trimmed). Throws std::invalid_argument naming the file and line
  // when it cannot be read, holds no key, or a key holds a space or control character.
  // `setting` names the file's setting in errors (metrics_auth reuses this class for its
  // user:password lines).
  explicit ApiKeys(std::string path, std::string setting = "api_keys");

  // Re-reads the file; on an error throws (as above) and keeps the keys in force.
  // Returns how many keys are now accepted.
  size_t reload();
  size_t size() const;
  const std::string& path() const { return path_; }

  // "" when `authorization` (the metadata's value; nullopt: none sent) is "Bearer KEY"
  // with a key of the file; otherwise why not, for the client and the log. The reason
  // never contains what the client sent.
  std::string check(std::optional<std::string_view> authorization) const;
  // Whether `key` is one of the file's (constant time).
  bool accepts(std::string_view key) const;

  // The file's keys as digests (what the constructor and reload read).
  static std::vector<Digest> read_file(const std::string& path, const std::string& setting);

 private:
  std::string path_;
  std::string setting_;
  mutable std::mutex mu_;
  std::shared_ptr<const std::vector<Digest>> digests_;
};

}  // namespace m3
