// What m3cli and m3bench serve share: command-line flags, token id lists, connecting to
// a server with a clear error, and naming gRPC statuses.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace m3::client {

// A mistake on the command line: the tools print it with their usage and exit 2.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// "--name value" / "--name=value" options and bare words, checked against the options a
// command knows (value options take a value; switches do not).
class Flags {
 public:
  Flags(const std::vector<std::string>& args, const std::vector<std::string_view>& value_options,
        const std::vector<std::string_view>& switches);

  const std::vector<std::string>& positional() const { return positional_; }
  bool has(std::string_view name) const;
  std::string get(std::string_view name, const std::string& fallback) const;
  int64_t get_int(std::string_view name, int64_t fallback, int64_t min, int64_t max) const;
  // Any value of [0, 2^64 - 1] (a seed); a sign or anything else is refused.
  uint64_t get_uint64(std::string_view name, uint64_t fallback) const;
  double get_double(std::string_view name, double fallback) const;
  // A duration in seconds, within (0, kMaxSeconds], rounded up to whole milliseconds (so
  // never 0); nullopt when the flag is absent.
  std::optional<std::chrono::milliseconds> get_seconds(std::string_view name) const;
  static constexpr double kMaxSeconds = 1e6;
  std::optional<std::string> find(std::string_view name) const;

 private:
  std::map<std::string, std::string, std::less<>> values_;
  std::vector<std::string> positional_;
};

// "1,2,3" or "1 2 3" (commas and/or spaces). Throws UsageError naming the bad item; an
// empty item ("1,,3", "1,", ",1") is refused, not skipped.
std::vector<int32_t> parse_id_list(std::string_view text);
// True when `text` holds only digits, commas, spaces and minus signs, and a digit.
bool looks_like_id_list(std::string_view text);
// Whether `text` is well-formed UTF-8 (no overlong forms, surrogates or code points past
// U+10FFFF), which protobuf requires of string fields: a request with text that is not
// never reaches the server's service.
bool valid_utf8(std::string_view text);

// Model text made safe to show on a terminal: control characters other than newline and
// tab (C0 and DEL, written \x1b, and C1, U+0080-U+009F, which terminals may take as the
// start of an escape sequence, written \u009b) become visible escapes; everything else
// passes unchanged. Fed a stream's text pieces in order: a piece that ends inside a C1
// character's UTF-8 form leaves its first byte held until the next piece.
class TerminalText {
 public:
  std::string feed(std::string_view piece);
  // What is still held (a lone lead byte when the stream ended there), unchanged.
  std::string finish();

 private:
  bool held_lead_ = false;
};

// How a client reaches a server that wants TLS or an API key: the flags --tls-ca FILE
// (TLS, trusting these CA certificates), --tls-cert FILE and --tls-key FILE (a client
// certificate, for mutual TLS), --tls-server-name NAME (the name the server's certificate
// must carry, when --server gives another, such as an IP address) and --api-key-file FILE
// (its first key, sent as "authorization: Bearer KEY" with every call).
struct ConnectionSecurity {
  std::string tls_ca_pem;  // "": plaintext
  std::string tls_cert_pem, tls_key_pem;
  std::string tls_server_name;
  std::string api_key;  // "": none sent
};
inline const std::vector<std::string_view> kSecurityOptions = {"tls-ca", "tls-cert", "tls-key", "tls-server-name",
                                                               "api-key-file"};
inline constexpr const char* kSecurityUsage =
    "  --tls-ca FILE             TLS: trust the server certificates these PEM CA certificates sign\n"
    "  --tls-cert FILE --tls-key FILE   a client certificate and key (PEM), for mutual TLS\n"
    "  --tls-server-name NAME    the name the server's certificate must carry (default: --server's host)\n"
    "  --api-key-file FILE       send the file's first key (one a line, # comments) as 'authorization: Bearer KEY'\n";
// Reads the files the flags name; throws UsageError naming the flag and file.
ConnectionSecurity connection_security(const Flags& flags);

// A channel to `address` (plaintext, or TLS as `security` says, with its API key on every
// call), connected within `wait`; otherwise throws std::runtime_error "cannot reach the
// server at <address> (...)".
std::shared_ptr<grpc::Channel> connect(const std::string& address,
                                       std::chrono::milliseconds wait,
                                       const ConnectionSecurity& security = {});

std::string_view status_code_name(grpc::StatusCode code);  // "UNAVAILABLE"
// "UNAVAILABLE: <message>".
std::string describe(const grpc::Status& status);

}  // namespace m3::client
