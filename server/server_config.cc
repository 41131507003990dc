#include "server/server_config.h"

#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <variant>

#include "server/snapshot_store.h"

namespace m3 {
namespace {

using Member = std::variant<std::string ServerConfig::*, int ServerConfig::*, int64_t ServerConfig::*,
                            double ServerConfig::*, bool ServerConfig::*>;

struct Setting {
  const char* key;
  Member member;
  const char* help;
  // Where the value may be "auto": the number it is stored as (outside the numbers a user may
  // write, so that one written out is refused), and the least number a user may write.
  struct Auto {
    int stored;
    int least;
  };
  std::optional<Auto> auto_as;
};

// The one list of settings: YAML keys, flags and help all come from it.
const std::vector<Setting>& settings() {
  static const std::vector<Setting> kSettings = {
      {"listen", &ServerConfig::listen, "gRPC address host:port (port 0: any free port)"},
      {"metrics_listen", &ServerConfig::metrics_listen,
       "Prometheus /metrics address host:port, or \"\" for none"},
      {"model", &ServerConfig::model, "model directory (config.json + safetensors); empty: demo model"},
      {"demo_model_dir", &ServerConfig::demo_model_dir,
       "where the demo model is written; empty: $XDG_CACHE_HOME/m3serve, else ~/.cache/m3serve, else /tmp/m3serve"},
      {"tokenizer", &ServerConfig::tokenizer, "SentencePiece .model for text in/out; empty: ids only"},
      {"backend", &ServerConfig::backend, "auto | cuda | cpu"},
      {"weight_dtype", &ServerConfig::weight_dtype, "bf16 | fp32 (CUDA weights)"},
      {"device", &ServerConfig::device, "CUDA device ordinal"},
      {"cpu_threads", &ServerConfig::cpu_threads, "CPU engine threads; 0: all cores"},
      {"cuda_graphs", &ServerConfig::cuda_graphs, "replay the decode step as a CUDA graph"},
      {"deterministic", &ServerConfig::deterministic,
       "CUDA: no atomics in the decode step, so runs repeat bit for bit (batch 1 up to ~18% slower, batch 2 ~3%)"},
      {"max_batch", &ServerConfig::max_batch,
       "sequences decoded together (engine slots), 1..4096, or auto: from the GPU's free memory "
       "and the state a slot holds, on the CPU from its cores",
       Setting::Auto{0, 1}},
      {"state_dtype", &ServerConfig::state_dtype,
       "fp32 | bf16: the recurrent state stored in bf16 (updated in fp32) halves its bytes; "
       "on cuda it needs weight_dtype bf16"},
      {"queue_capacity", &ServerConfig::queue_capacity,
       "requests that may wait for a slot; beyond: RESOURCE_EXHAUSTED"},
      {"pipelined_steps", &ServerConfig::pipelined_steps,
       "submit each decode step before handing out the previous step's tokens (false: one at a time)"},
      {"prefill_chunk_tokens", &ServerConfig::prefill_chunk_tokens,
       "prompt and Converse input tokens read by prefill per scheduler iteration, between the "
       "decode steps of the running streams; 0: one decode step per input token; auto: 2048 "
       "on cuda (a pass there is short beside the step), 512 on the CPU",
       Setting::Auto{ServerConfig::kAutoPrefillChunkTokens, 0}},
      {"prefill_alone_tokens", &ServerConfig::prefill_alone_tokens,
       "input tokens read by prefill per scheduler iteration while no stream is replying (no "
       "inter-token latency to hold); the larger of it and prefill_chunk_tokens applies, and "
       "the engine's prefill buffers are sized for it"},
      {"prefill_min_tokens", &ServerConfig::prefill_min_tokens,
       "Converse input shorter than this (a frame of speech units) is read by decode steps "
       "beside the replying streams instead of by prefill; 1: all input by prefill (Generate "
       "and CreateSnapshot prompts always are)"},
      {"max_new_tokens_limit", &ServerConfig::max_new_tokens_limit,
       "largest max_new_tokens a request may ask"},
      {"max_prompt_tokens", &ServerConfig::max_prompt_tokens,
       "longest prompt (and pending Converse input) in tokens"},
      {"stream_buffer_tokens", &ServerConfig::stream_buffer_tokens,
       "tokens a stream may hold unread before it is cancelled (slow reader); at most 65536"},
      {"shutdown_grace_s", &ServerConfig::shutdown_grace_s,
       "seconds in-flight streams get to finish on SIGTERM/SIGINT"},
      {"session_idle_timeout_s", &ServerConfig::session_idle_timeout_s,
       "seconds a Converse session may wait for its next input before it ends (DEADLINE_EXCEEDED) "
       "and frees its slot, and a Converse stream for its first message; 0: never"},
      {"stalled_stream_timeout_s", &ServerConfig::stalled_stream_timeout_s,
       "seconds a stream the server has ended may wait for its client to read what is in flight "
       "before its call is cancelled"},
      {"log_level", &ServerConfig::log_level, "trace | debug | info | warn | error | off"},
      {"snapshot_store", &ServerConfig::snapshot_store,
       "where snapshots live: memory | dir:PATH | redis://HOST:PORT"},
      {"snapshot_capacity_bytes", &ServerConfig::snapshot_capacity_bytes,
       "bytes of snapshots kept, least recently used out first; 0: no limit"},
      {"snapshot_ttl_s", &ServerConfig::snapshot_ttl_s, "seconds a snapshot is kept; 0: until evicted or deleted"},
      {"prefix_cache", &ServerConfig::prefix_cache,
       "keep states at prompt boundaries; a prompt starting with a kept prefix reads only the rest"},
      {"prefix_cache_interval", &ServerConfig::prefix_cache_interval,
       "tokens between the states the prefix cache keeps (and one at each prompt's end)"},
      {"prefix_cache_capacity_bytes", &ServerConfig::prefix_cache_capacity_bytes,
       "bytes of states the prefix cache keeps in host memory, least recently used out first"},
      {"session_swap_after_s", &ServerConfig::session_swap_after_s,
       "seconds a Converse session waits between turns before its state leaves its slot for host memory; 0: never"},
      {"max_sessions", &ServerConfig::max_sessions, "Converse sessions open at once; 0: no limit"},
      // Production: drain, TLS, API keys, /metrics access.
      {"drain_delay_s", &ServerConfig::drain_delay_s,
       "seconds the health service reports NOT_SERVING on SIGTERM while requests are still served, "
       "before the server stops accepting (so load balancers see it first)"},
      {"health_listen", &ServerConfig::health_listen,
       "host:port of a second, plaintext gRPC port serving only grpc.health.v1 (probes that cannot speak TLS, "
       "such as the kubelet's); \"\" for none"},
      {"tls_cert", &ServerConfig::tls_cert, "PEM certificate chain: serve gRPC over TLS (needs tls_key; re-read on SIGHUP)"},
      {"tls_key", &ServerConfig::tls_key, "PEM private key of tls_cert"},
      {"tls_client_ca", &ServerConfig::tls_client_ca,
       "PEM CA certificates: require client certificates signed by them (mutual TLS; needs tls_cert)"},
      {"api_keys", &ServerConfig::api_keys,
       "file of API keys, one a line: every RPC but health needs 'authorization: Bearer KEY' (re-read on SIGHUP)"},
      {"metrics_auth", &ServerConfig::metrics_auth,
       "file of user:password lines: /metrics needs HTTP basic auth with one of them (re-read on SIGHUP)"},
  };
  return kSettings;
}

const Setting* find_setting(const std::string& key) {
  for (const auto& s : settings())
    if (key == s.key) return &s;
  return nullptr;
}

std::string known_keys() {
  std::string out;
  for (const auto& s : settings()) {
    if (!out.empty()) out += ", ";
    out += s.key;
  }
  return out;
}

std::string flag_name(const char* key) {
  std::string f = std::string("--") + key;
  for (char& c : f)
    if (c == '_') c = '-';
  return f;
}

// Parses `text` into the setting; returns "" or what was wrong ("expected an integer").
std::string assign(ServerConfig& config, const Setting& setting, const std::string& text) {
  const Member& member = setting.member;
  if (setting.auto_as) {
    int& value = config.*std::get<int ServerConfig::*>(member);
    if (text == "auto") {
      value = setting.auto_as->stored;
      return "";
    }
    const int least = setting.auto_as->least;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size() || value < least)
      return std::string("expected auto or ") + (least == 1 ? "a positive integer" : "an integer >= " + std::to_string(least)) +
             ", got '" + text + "'";
    return "";
  }
  return std::visit(
      [&](auto ptr) -> std::string {
        using T = std::remove_reference_t<decltype(config.*ptr)>;
        if constexpr (std::is_same_v<T, std::string>) {
          config.*ptr = text;
          return "";
        } else if constexpr (std::is_same_v<T, int> || std::is_same_v<T, int64_t>) {
          T v = 0;
          auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
          if (text.empty() || ec != std::errc() || end != text.data() + text.size())
            return "expected an integer, got '" + text + "'";
          config.*ptr = v;
          return "";
        } else if constexpr (std::is_same_v<T, double>) {
          char* end = nullptr;
          double v = std::strtod(text.c_str(), &end);
          if (text.empty() || end != text.c_str() + text.size())
            return "expected a number, got '" + text + "'";
          config.*ptr = v;
          return "";
        } else {
          if (text == "true" || text == "yes" || text == "on") {
            config.*ptr = true;
          } else if (text == "false" || text == "no" || text == "off") {
            config.*ptr = false;
          } else {
            return "expected true or false, got '" + text + "'";
          }
          return "";
        }
      },
      member);
}

void check_int(const char* key, int value, int lo, int hi) {
  if (value < lo || value > hi)
    throw std::invalid_argument(std::string(key) + " must be between " + std::to_string(lo) +
                                " and " + std::to_string(hi) + ", got " + std::to_string(value));
}

void check_one_of(const char* key, const std::string& value,
                  std::initializer_list<const char*> allowed) {
  std::string list;
  for (const char* a : allowed) {
    if (value == a) return;
    if (!list.empty()) list += ", ";
    list += a;
  }
  throw std::invalid_argument(std::string(key) + " must be one of " + list + ", got '" + value +
                              "'");
}

void check_address(const char* key, const std::string& value) {
  auto colon = value.rfind(':');
  bool ok = colon != std::string::npos && colon > 0 && colon + 1 < value.size();
  if (ok) {
    int port = -1;
    const char* b = value.data() + colon + 1;
    const char* e = value.data() + value.size();
    auto [end, ec] = std::from_chars(b, e, port);
    ok = ec == std::errc() && end == e && port >= 0 && port <= 65535;
  }
  if (!ok)
    throw std::invalid_argument(std::string(key) + " must be host:port (port 0..65535), got '" +
                                value + "'");
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(path + ": cannot open the config file");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The file's one YAML document (null when the file is empty). A second document (after
// a "---" line) is refused rather than ignored: its settings would silently not apply.
YAML::Node load_one_document(const std::string& yaml_text, const std::string& source) {
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(yaml_text);
  } catch (const YAML::Exception& e) {
    throw std::invalid_argument(source + ": not valid YAML: " + e.what());
  }
  if (documents.size() > 1)
    throw std::invalid_argument(source + ": holds " + std::to_string(documents.size()) +
                                " YAML documents (separated by '---'); a config file is one "
                                "mapping of settings");
  return documents.empty() ? YAML::Node() : documents.front();
}

// A key of the top-level mapping as a setting name. A list or mapping as a key (e.g.
// "[a, b]: 1") is named by its line and its text, not converted (yaml-cpp's "bad
// conversion" would name neither the file nor the key).
std::string setting_name(const YAML::Node& key, const std::string& source) {
  if (key.IsScalar()) return key.Scalar();
  if (key.IsNull()) return "";  // "~: 1" or ": 1": refused below as an unknown key ''
  YAML::Emitter text;
  text << YAML::Flow << key;
  std::string shown = text.c_str();
  if (shown.size() > 40) shown = shown.substr(0, 40) + "...";
  throw std::invalid_argument(source + ": line " + std::to_string(key.Mark().line + 1) + ": key " +
                              shown + " is a list or mapping; keys are setting names (known: " +
                              known_keys() + ")");
}

// The `cuda:` section: nested mappings down to values, each at its key path
// ("gemv.row_block_cluster"), set in `policy` (model/cuda_policy.h names the keys).
void read_cuda_section(const YAML::Node& node, const std::string& path, const std::string& source,
                       CudaPolicy& policy) {
  const std::string where = path.empty() ? "cuda" : "cuda." + path;
  if (node.IsNull()) return;  // "cuda:" with nothing under it
  if (!node.IsMap())
    throw std::invalid_argument(source + ": key '" + where + "': expected a mapping of settings");
  std::map<std::string, int> line_of_key;
  for (const auto& item : node) {
    const std::string key = setting_name(item.first, source);
    const std::string key_path = path.empty() ? key : path + "." + key;
    const int line = item.first.Mark().line + 1;
    if (auto [seen, first] = line_of_key.emplace(key, line); !first)
      throw std::invalid_argument(source + ": key 'cuda." + key_path + "' is given twice (lines " +
                                  std::to_string(seen->second) + " and " + std::to_string(line) + ")");
    if (item.second.IsMap()) {
      read_cuda_section(item.second, key_path, source, policy);
      continue;
    }
    if (!item.second.IsScalar())
      throw std::invalid_argument(source + ": key 'cuda." + key_path + "': expected a single value, got a list");
    if (std::string err = set_cuda_policy_value(policy, key_path, item.second.Scalar()); !err.empty()) {
      // (An unknown key's message names it already.)
      throw std::invalid_argument(source + ": " +
                                  (err.rfind("unknown key", 0) == 0 ? err : "key 'cuda." + key_path + "': " + err));
    }
  }
}

}  // namespace

void ServerConfig::validate() const {
  check_address("listen", listen);
  if (!metrics_listen.empty()) check_address("metrics_listen", metrics_listen);
  check_one_of("backend", backend, {"auto", "cuda", "cpu"});
  check_one_of("weight_dtype", weight_dtype, {"bf16", "fp32"});
  check_one_of("log_level", log_level, {"trace", "debug", "info", "warn", "error", "off"});
  check_int("device", device, 0, 63);
  check_int("cpu_threads", cpu_threads, 0, 1024);
  if (max_batch < 0 || max_batch > 4096)
    throw std::invalid_argument("max_batch must be auto or between 1 and 4096, got " +
                                std::to_string(max_batch));
  check_one_of("state_dtype", state_dtype, {"fp32", "bf16"});
  check_int("queue_capacity", queue_capacity, 0, 1'000'000);
  // (The engine sizes its prefill buffers for one chunk at load.)
  if (prefill_chunk_tokens != kAutoPrefillChunkTokens) check_int("prefill_chunk_tokens", prefill_chunk_tokens, 0, 65536);
  check_int("prefill_alone_tokens", prefill_alone_tokens, 1, 65536);
  check_int("prefill_min_tokens", prefill_min_tokens, 1, 65536);
  check_int("max_new_tokens_limit", max_new_tokens_limit, 1, 1 << 24);
  check_int("max_prompt_tokens", max_prompt_tokens, 1, 1 << 24);
  // (Every stream holds a ring of this many tokens, allocated when it starts.)
  check_int("stream_buffer_tokens", stream_buffer_tokens, 1, 1 << 16);
  if (!std::isfinite(shutdown_grace_s) || shutdown_grace_s < 0 || shutdown_grace_s > 3600)
    throw std::invalid_argument("shutdown_grace_s must be between 0 and 3600 seconds, got " +
                                std::to_string(shutdown_grace_s));
  // (Below a millisecond a timeout would round to zero, which means never.)
  if (!std::isfinite(session_idle_timeout_s) || session_idle_timeout_s < 0 || session_idle_timeout_s > 86400 ||
      (session_idle_timeout_s > 0 && session_idle_timeout_s < 0.001))
    throw std::invalid_argument("session_idle_timeout_s must be 0 (never) or between 0.001 and 86400 seconds, got " +
                                std::to_string(session_idle_timeout_s));
  // (Shorter would cut clients that merely pause between reads.)
  if (!std::isfinite(stalled_stream_timeout_s) || stalled_stream_timeout_s < 0.1 || stalled_stream_timeout_s > 3600)
    throw std::invalid_argument("stalled_stream_timeout_s must be between 0.1 and 3600 seconds, got " +
                                std::to_string(stalled_stream_timeout_s));
  if (const std::string why = snapshot_store_spec_error(snapshot_store); !why.empty())
    throw std::invalid_argument("snapshot_store '" + snapshot_store + "': " + why);
  if (snapshot_capacity_bytes < 0)
    throw std::invalid_argument("snapshot_capacity_bytes must be 0 (no limit) or more, got " +
                                std::to_string(snapshot_capacity_bytes));
  if (!std::isfinite(snapshot_ttl_s) || snapshot_ttl_s < 0 || snapshot_ttl_s > 365 * 86400.0 ||
      (snapshot_ttl_s > 0 && snapshot_ttl_s < 0.001))
    throw std::invalid_argument("snapshot_ttl_s must be 0 (none) or between 0.001 s and a year, got " +
                                std::to_string(snapshot_ttl_s));
  check_int("prefix_cache_interval", prefix_cache_interval, 1, 1 << 24);
  if (!std::isfinite(session_swap_after_s) || session_swap_after_s < 0 || session_swap_after_s > 86400 ||
      (session_swap_after_s > 0 && session_swap_after_s < 0.001))
    throw std::invalid_argument("session_swap_after_s must be 0 (never) or between 0.001 and 86400 seconds, got " +
                                std::to_string(session_swap_after_s));
  check_int("max_sessions", max_sessions, 0, 10'000'000);
  if (prefix_cache_capacity_bytes < 1)
    throw std::invalid_argument("prefix_cache_capacity_bytes must be at least 1, got " +
                                std::to_string(prefix_cache_capacity_bytes));
  if (!health_listen.empty()) check_address("health_listen", health_listen);
  if (!std::isfinite(drain_delay_s) || drain_delay_s < 0 || drain_delay_s > 3600)
    throw std::invalid_argument("drain_delay_s must be between 0 and 3600 seconds, got " +
                                std::to_string(drain_delay_s));
  if (tls_cert.empty() != tls_key.empty())
    throw std::invalid_argument(tls_cert.empty() ? "tls_key is set but tls_cert is not: TLS needs both"
                                                 : "tls_cert is set but tls_key is not: TLS needs both");
  if (!tls_client_ca.empty() && tls_cert.empty())
    throw std::invalid_argument("tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS first)");
  for (const auto& [key, path] : {std::pair{"tls_cert", &tls_cert}, std::pair{"tls_key", &tls_key},
                                  std::pair{"tls_client_ca", &tls_client_ca}, std::pair{"api_keys", &api_keys},
                                  std::pair{"metrics_auth", &metrics_auth}})
    if (!path->empty() && !std::filesystem::is_regular_file(*path))
      throw std::invalid_argument(std::string(key) + ": '" + *path + "' is not a file");
  if (!model.empty() && !std::filesystem::is_directory(model))
    throw std::invalid_argument("model: '" + model + "' is not a directory");
  if (!tokenizer.empty() && !std::filesystem::is_regular_file(tokenizer))
    throw std::invalid_argument("tokenizer: '" + tokenizer + "' is not a file");
  cuda.validate();
}

ServerConfig parse_server_config_yaml(const std::string& yaml_text, const std::string& source,
                                      ServerConfig base) {
  const YAML::Node root = load_one_document(yaml_text, source);
  if (root.IsNull()) return base;  // an empty file: all defaults
  if (!root.IsMap())
    throw std::invalid_argument(source + ": expected a mapping of settings at the top level");
  std::map<std::string, int> line_of_key;  // keys seen so far (a repeated key is refused)
  for (const auto& item : root) {
    const std::string key = setting_name(item.first, source);
    const int line = item.first.Mark().line + 1;
    if (auto [seen, first] = line_of_key.emplace(key, line); !first)
      throw std::invalid_argument(source + ": key '" + key + "' is given twice (lines " +
                                  std::to_string(seen->second) + " and " + std::to_string(line) +
                                  "); give each setting once");
    if (key == "cuda") {
      read_cuda_section(item.second, "", source, base.cuda);
      continue;
    }
    const Setting* setting = find_setting(key);
    if (!setting)
      throw std::invalid_argument(source + ": unknown key '" + key + "' (known: " + known_keys() +
                                  ", cuda)");
    const YAML::Node& value = item.second;
    std::string text;
    if (value.IsNull()) {
      text = "";
    } else if (value.IsScalar()) {
      text = value.Scalar();
    } else {
      throw std::invalid_argument(source + ": key '" + key +
                                  "': expected a single value, got a list or mapping");
    }
    if (std::string err = assign(base, *setting, text); !err.empty())
      throw std::invalid_argument(source + ": key '" + key + "': " + err);
  }
  return base;
}

ServerConfig load_server_config_file(const std::string& path, ServerConfig base) {
  return parse_server_config_yaml(read_file(path), path, std::move(base));
}

CommandLine parse_command_line(const std::vector<std::string>& args,
                               const std::string& default_config_path) {
  CommandLine out;
  // The file first, so flags override it wherever --config appears.
  std::string config_path;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config") {
      if (i + 1 >= args.size()) throw std::invalid_argument("--config needs a file argument");
      config_path = args[i + 1];
    } else if (args[i].rfind("--config=", 0) == 0) {
      config_path = args[i].substr(9);
    }
  }
  if (!config_path.empty()) {
    out.config = load_server_config_file(config_path);
  } else if (!default_config_path.empty() && std::filesystem::exists(default_config_path)) {
    out.config = load_server_config_file(default_config_path);
  }

  for (size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i];
    if (arg == "--help" || arg == "-h") {
      out.help = true;
      continue;
    }
    std::string value;
    bool has_inline_value = false;
    if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_inline_value = true;
    }
    if (arg == "--config") {
      if (!has_inline_value) ++i;
      continue;
    }
    const Setting* setting = nullptr;
    for (const auto& s : settings())
      if (arg == flag_name(s.key)) setting = &s;
    const bool cuda_flag = !setting && arg.rfind("--cuda-", 0) == 0;
    if (!setting && !cuda_flag)
      throw std::invalid_argument("unknown flag '" + args[i] + "' (see --help)");
    if (!has_inline_value) {
      if (i + 1 >= args.size()) throw std::invalid_argument(arg + " needs a value");
      value = args[++i];
    }
    if (cuda_flag) {
      if (!set_cuda_policy_flag(out.config.cuda, arg, value))
        throw std::invalid_argument("unknown flag '" + arg + "' (see --help)");
      continue;
    }
    if (std::string err = assign(out.config, *setting, value); !err.empty())
      throw std::invalid_argument(arg + ": " + err);
  }
  if (!out.help) out.config.validate();
  return out;
}

std::string command_line_help() {
  std::string out =
      "m3serve: serves a Mamba-3 MIMO decoder over gRPC.\n\n"
      "usage: m3serve [--config FILE] [--FLAG VALUE ...]\n\n"
      "  --config FILE  YAML settings (default: configs/server.yaml when it exists);\n"
      "                 flags override it. Each YAML key some_key is the flag --some-key.\n";
  for (const auto& s : settings()) {
    std::string f = flag_name(s.key);
    out += "  " + f + std::string(f.size() < 24 ? 24 - f.size() : 1, ' ') + s.help + "\n";
  }
  out += "\nThe CUDA engine's policy (YAML section cuda:, key path joined with '-'):\n" + cuda_policy_flags_help();
  return out;
}

int resolve_prefill_chunk_tokens(int configured, bool cuda) {
  if (configured != ServerConfig::kAutoPrefillChunkTokens) return configured;
  return cuda ? 2048 : 512;
}

}  // namespace m3
