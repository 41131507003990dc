#include "server/tools/client_support.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <grpcpp/support/client_interceptor.h>

#include "model/tools/integer_text.h"

namespace m3::client {

Flags::Flags(const std::vector<std::string>& args,
             const std::vector<std::string_view>& value_options,
             const std::vector<std::string_view>& switches) {
  auto known = [](const std::vector<std::string_view>& list, std::string_view name) {
    return std::find(list.begin(), list.end(), name) != list.end();
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0 || arg == "--") {
      positional_.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    if (const auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    if (known(switches, name)) {
      if (value) throw UsageError("--" + name + " takes no value");
      values_[name] = "1";
    } else if (known(value_options, name)) {
      if (!value) {
        if (i + 1 >= args.size()) throw UsageError("--" + name + " needs a value");
        value = args[++i];
      }
      values_[name] = *value;
    } else {
      throw UsageError("unknown option --" + name);
    }
  }
}

bool Flags::has(std::string_view name) const { return values_.find(name) != values_.end(); }

std::optional<std::string> Flags::find(std::string_view name) const {
  const auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::string Flags::get(std::string_view name, const std::string& fallback) const {
  return find(name).value_or(fallback);
}

int64_t Flags::get_int(std::string_view name, int64_t fallback, int64_t min, int64_t max) const {
  const auto text = find(name);
  if (!text) return fallback;
  int64_t value = 0;
  if (std::string refusal = integer_refusal("--" + std::string(name), *text, min, max, &value); !refusal.empty()) {
    throw UsageError(refusal);
  }
  return value;
}

double Flags::get_double(std::string_view name, double fallback) const {
  const auto text = find(name);
  if (!text) return fallback;
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(*text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text->size() || !std::isfinite(value)) {
    throw UsageError("--" + std::string(name) + ": '" + *text + "' is not a number");
  }
  return value;
}

uint64_t Flags::get_uint64(std::string_view name, uint64_t fallback) const {
  const auto text = find(name);
  if (!text) return fallback;
  uint64_t value = 0;
  if (std::string refusal = integer_refusal("--" + std::string(name), *text, uint64_t{0}, UINT64_MAX, &value);
      !refusal.empty()) {
    throw UsageError(refusal);
  }
  return value;
}

std::optional<std::chrono::milliseconds> Flags::get_seconds(std::string_view name) const {
  const auto text = find(name);
  if (!text) return std::nullopt;
  const double seconds = get_double(name, 0.0);
  if (!(seconds > 0 && seconds <= kMaxSeconds)) {
    throw UsageError("--" + std::string(name) + ": " + *text + " is outside (0, " +
                     std::to_string(static_cast<int64_t>(kMaxSeconds)) + "] seconds");
  }
  // Whole microseconds first, so 1.1 s is 1100 ms and not 1101; then up to a millisecond.
  const int64_t us = std::llround(seconds * 1e6);
  return std::chrono::milliseconds(std::max<int64_t>(1, (us + 999) / 1000));
}

std::vector<int32_t> parse_id_list(std::string_view text) {
  const auto blank = [](char c) { return c == ' ' || c == '\t'; };
  const auto empty_item = [&] {
    return UsageError("empty item in the token id list '" + std::string(text) + "'");
  };
  std::vector<int32_t> ids;
  size_t i = 0;
  const auto skip_blanks = [&] {
    while (i < text.size() && blank(text[i])) ++i;
  };
  skip_blanks();
  // Items are separated by blanks, or by one comma with blanks around it.
  while (i < text.size()) {
    if (text[i] == ',') throw empty_item();  // ",1" or "1,,3"
    size_t end = i;
    while (end < text.size() && text[end] != ',' && !blank(text[end])) ++end;
    const std::string_view item = text.substr(i, end - i);
    int32_t id = 0;
    const auto [stop, error] = std::from_chars(item.data(), item.data() + item.size(), id);
    if (error != std::errc() || stop != item.data() + item.size()) {
      throw UsageError("'" + std::string(item) + "' is not a token id");
    }
    ids.push_back(id);
    i = end;
    skip_blanks();
    if (i < text.size() && text[i] == ',') {
      ++i;
      skip_blanks();
      if (i == text.size()) throw empty_item();  // "1,"
    }
  }
  if (ids.empty()) throw UsageError("no token ids in '" + std::string(text) + "'");
  return ids;
}

bool looks_like_id_list(std::string_view text) {
  bool digit = false;
  for (const char c : text) {
    if (c >= '0' && c <= '9') {
      digit = true;
    } else if (c != ',' && c != ' ' && c != '\t' && c != '-') {
      return false;
    }
  }
  return digit;
}

bool valid_utf8(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const auto* end = p + text.size();
  while (p < end) {
    const unsigned char c = *p;
    int extra = 0;
    uint32_t code = 0, min = 0;
    if (c < 0x80) {
      ++p;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      extra = 1, code = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      extra = 2, code = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      extra = 3, code = c & 0x07, min = 0x10000;
    } else {
      return false;  // a continuation byte first, or 0xF8 and up
    }
    if (end - p <= extra) return false;
    for (int i = 1; i <= extra; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      code = (code << 6) | (p[i] & 0x3F);
    }
    if (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return false;
    p += extra + 1;
  }
  return true;
}

std::string TerminalText::feed(std::string_view piece) {
  constexpr unsigned char kC1Lead = 0xC2;  // U+0080-U+009F are C2 80 - C2 9F
  std::string out;
  out.reserve(piece.size() + (held_lead_ ? 1 : 0));
  std::string joined;
  if (held_lead_) {
    joined.reserve(piece.size() + 1);
    joined.push_back(static_cast<char>(kC1Lead));
    joined.append(piece);
    piece = joined;
    held_lead_ = false;
  }
  char escape[8];
  for (size_t i = 0; i < piece.size(); ++i) {
    const auto c = static_cast<unsigned char>(piece[i]);
    if (c == kC1Lead) {
      if (i + 1 == piece.size()) {
        held_lead_ = true;
        break;
      }
      const auto next = static_cast<unsigned char>(piece[i + 1]);
      if (next >= 0x80 && next <= 0x9F) {
        std::snprintf(escape, sizeof escape, "\\u%04x", next);
        out += escape;
        ++i;
        continue;
      }
    } else if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7F) {
      std::snprintf(escape, sizeof escape, "\\x%02x", c);
      out += escape;
      continue;
    }
    out.push_back(static_cast<char>(c));
  }
  return out;
}

std::string TerminalText::finish() {
  if (!held_lead_) return {};
  held_lead_ = false;
  return std::string(1, '\xC2');
}

namespace {

std::string read_flag_file(std::string_view flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("--" + std::string(flag) + ": cannot read '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Adds "authorization: Bearer KEY" to every call of the channel.
class BearerInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(const std::string& value) : value_(value) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA))
      methods->GetSendInitialMetadata()->emplace("authorization", value_);
    methods->Proceed();
  }

 private:
  const std::string& value_;  // (the factory's, which the channel keeps)
};

class BearerInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(const std::string& key) : value_("Bearer " + key) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(value_);
  }

 private:
  const std::string value_;
};

}  // namespace

ConnectionSecurity connection_security(const Flags& flags) {
  ConnectionSecurity s;
  if (auto path = flags.find("tls-ca")) s.tls_ca_pem = read_flag_file("tls-ca", *path);
  const auto cert = flags.find("tls-cert"), key = flags.find("tls-key");
  if (cert.has_value() != key.has_value()) throw UsageError("--tls-cert and --tls-key go together");
  if (cert && !flags.has("tls-ca")) throw UsageError("--tls-cert needs --tls-ca (a client certificate is for TLS)");
  if (cert) {
    s.tls_cert_pem = read_flag_file("tls-cert", *cert);
    s.tls_key_pem = read_flag_file("tls-key", *key);
  }
  s.tls_server_name = flags.get("tls-server-name", "");
  if (!s.tls_server_name.empty() && !flags.has("tls-ca")) throw UsageError("--tls-server-name needs --tls-ca");
  if (auto path = flags.find("api-key-file")) {
    std::istringstream lines(read_flag_file("api-key-file", *path));
    for (std::string line; s.api_key.empty() && std::getline(lines, line);) {
      const size_t b = line.find_first_not_of(" \t\r"), e = line.find_last_not_of(" \t\r");
      if (b != std::string::npos && line[b] != '#') s.api_key = line.substr(b, e - b + 1);
    }
    if (s.api_key.empty()) throw UsageError("--api-key-file: '" + *path + "' holds no key");
  }
  return s;
}

std::shared_ptr<grpc::Channel> connect(const std::string& address,
                                       std::chrono::milliseconds wait,
                                       const ConnectionSecurity& security) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  if (!security.tls_ca_pem.empty()) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = security.tls_ca_pem;
    tls.pem_cert_chain = security.tls_cert_pem;
    tls.pem_private_key = security.tls_key_pem;
    credentials = grpc::SslCredentials(tls);
    if (!security.tls_server_name.empty()) args.SetSslTargetNameOverride(security.tls_server_name);
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!security.api_key.empty()) interceptors.push_back(std::make_unique<BearerInterceptorFactory>(security.api_key));
  auto channel = grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials, args,
                                                                          std::move(interceptors));
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + wait)) {
    throw std::runtime_error("cannot reach the server at " + address + " (no connection within " +
                             std::to_string(wait.count()) + " ms; is m3serve running there" +
                             (security.tls_ca_pem.empty() ? ", without TLS?" : ", with TLS, with a certificate --tls-ca trusts?") +
                             ")");
  }
  return channel;
}

std::string_view status_code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNRECOGNIZED";
  }
}

std::string describe(const grpc::Status& status) {
  std::string text(status_code_name(status.error_code()));
  if (!status.error_message().empty()) text += ": " + status.error_message();
  return text;
}

}  // namespace m3::client
