// m3cli: a command-line client for m3serve. Streams tokens as they arrive and prints
// timings (to stderr, so stdout holds only the model's output).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <iostream>
#include <optional>
#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include "m3serve.grpc.pb.h"
#include "server/tools/client_support.h"

namespace {

using m3::client::Flags;
using m3::client::UsageError;
using Clock = std::chrono::steady_clock;

const std::string kUsage = R"(usage: m3cli [--server host:port] <command> [options]

commands:
  generate --ids 1,2,3 | --text "..."   stream one continuation
      [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
      [--stop 7,8] [--request-id ID] [--print auto|ids|text]
      [--allowed all|text|text_and_controls|units|units_and_controls]  (needs the model's vocab.json)
      [--prefix-snapshot-id ID]  start from a stored state (then the prompt may be left out)
  create-snapshot --ids 1,2,3 | --text "..." [--base-snapshot-id ID] [--request-id ID]
      read the prompt into a state (from the base's when given) and store it; prints
      "snapshot_id ID tokens N bytes B"
  get-snapshot --id ID | delete-snapshot --id ID   the same line for a stored state
  converse [same sampling options] [--session-id ID] [--print auto|ids|text]
      [--input auto|ids|text]
      each stdin line is one turn; the reply streams back
  --input: what a line is; auto: token ids when it is only numbers ("1,2,3", "4 5"),
      else text (--input text sends "2024" as text)
  --print: the reply as text or ids; auto: text for text input, ids for ids
  text must be valid UTF-8 (a line that is not is not sent); text printed to a terminal
      shows its control characters as escapes (\x1b), piped it is written as received
  info                                   the served model
  health [--service NAME]                grpc.health.v1 Check; exit 0 only when SERVING

common options:
  --server host:port        default 127.0.0.1:50051
  --connect-timeout S       seconds to wait for a connection (default 5)
  --timeout S               deadline of the call in seconds (default: none; info: 10; health: 5)
  seconds: more than 0, at most 1000000, rounded up to whole milliseconds
)" + std::string(m3::client::kSecurityUsage);

const std::vector<std::string_view> kCommonOptions = {"server", "connect-timeout", "timeout", "tls-ca", "tls-cert",
                                                      "tls-key", "tls-server-name", "api-key-file"};
const std::vector<std::string_view> kSamplingOptions = {
    "max-new-tokens", "temperature", "top-k", "top-p", "seed", "stop", "allowed"};

std::vector<std::string_view> options(std::vector<std::string_view> extra,
                                      const std::vector<std::string_view>& more = {}) {
  extra.insert(extra.end(), kCommonOptions.begin(), kCommonOptions.end());
  extra.insert(extra.end(), more.begin(), more.end());
  return extra;
}

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// How long to wait for the connection, and the call's deadline (none: no deadline); read,
// and so checked, before connecting, as every other flag is.
struct CallSettings {
  std::string server;
  std::chrono::milliseconds connect_wait;
  std::optional<std::chrono::milliseconds> timeout;
  m3::client::ConnectionSecurity security;
};

CallSettings call_settings(const Flags& flags,
                           std::optional<std::chrono::milliseconds> default_timeout) {
  return {flags.get("server", "127.0.0.1:50051"),
          flags.get_seconds("connect-timeout").value_or(std::chrono::seconds(5)),
          flags.has("timeout") ? flags.get_seconds("timeout") : default_timeout,
          m3::client::connection_security(flags)};
}

void set_deadline(grpc::ClientContext* context, const CallSettings& call) {
  if (call.timeout) context->set_deadline(std::chrono::system_clock::now() + *call.timeout);
}

std::shared_ptr<grpc::Channel> connect(const CallSettings& call) {
  return m3::client::connect(call.server, call.connect_wait, call.security);
}

void fill_sampling(const Flags& flags, m3serve::v1::SamplingParams* sampling) {
  sampling->set_temperature(static_cast<float>(flags.get_double("temperature", 0.0)));
  sampling->set_top_k(static_cast<int32_t>(flags.get_int("top-k", 0, 0, INT32_MAX)));
  if (flags.has("top-p")) sampling->set_top_p(static_cast<float>(flags.get_double("top-p", 1.0)));
  if (flags.has("seed")) sampling->set_seed(flags.get_uint64("seed", 0));
  if (const auto allowed = flags.find("allowed")) {
    std::string name = "ALLOWED_TOKENS_" + *allowed;
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::toupper(c); });
    m3serve::v1::AllowedTokens value;
    if (!m3serve::v1::AllowedTokens_Parse(name, &value)) {
      throw UsageError("--allowed: '" + *allowed + "' is not all, text, text_and_controls, units or units_and_controls");
    }
    sampling->set_allowed(value);
  }
}

template <typename Repeated>
void add_stop_ids(const Flags& flags, Repeated* stop_ids) {
  if (const auto stop = flags.find("stop")) {
    for (int32_t id : m3::client::parse_id_list(*stop)) stop_ids->Add(id);
  }
}

std::string_view finish_reason_name(m3serve::v1::FinishReason reason) {
  switch (reason) {
    case m3serve::v1::FINISH_REASON_LENGTH: return "length";
    case m3serve::v1::FINISH_REASON_STOP: return "stop";
    case m3serve::v1::FINISH_REASON_CANCELLED: return "cancelled (server shutting down)";
    case m3serve::v1::FINISH_REASON_END_OF_REPLY: return "end_of_reply";
    default: return "unspecified";
  }
}

// What stdout shows of the streamed tokens: "text" (the server's decoded text; needs a
// tokenizer on the server) or "ids". "auto" follows the input: text for a text prompt or
// turn, ids for ids. Never a mix: a speech unit with no text must not print as a number
// inside the text.
enum class PrintMode { kAuto, kIds, kText };

PrintMode print_mode(const Flags& flags) {
  const std::string mode = flags.get("print", "auto");
  if (mode == "auto") return PrintMode::kAuto;
  if (mode == "ids") return PrintMode::kIds;
  if (mode == "text") return PrintMode::kText;
  throw UsageError("--print: '" + mode + "' is not auto, ids or text");
}

// Text goes to a terminal with its control characters shown as escapes (model output must
// not move the cursor, clear the screen or retitle the window); piped, as the server sent it.
class TokenPrinter {
 public:
  TokenPrinter(PrintMode mode, bool input_was_text)
      : text_(mode == PrintMode::kText || (mode == PrintMode::kAuto && input_was_text)) {
    if (text_ && isatty(STDOUT_FILENO)) terminal_.emplace();
  }

  void print(const m3serve::v1::Tokens& tokens) {
    if (text_) {
      write(terminal_ ? terminal_->feed(tokens.text()) : tokens.text());
      printed_ = printed_ || !tokens.text().empty();
    } else {
      for (int32_t id : tokens.ids()) {
        std::printf(printed_ ? " %d" : "%d", id);
        printed_ = true;
      }
    }
    std::fflush(stdout);
  }
  // Ends the output line, if anything was printed on it (or always: one line per turn).
  void end_line(bool always = false) {
    if (terminal_) write(terminal_->finish());
    if (printed_ || always) std::fputc('\n', stdout);
    std::fflush(stdout);
    printed_ = false;
  }

 private:
  static void write(const std::string& text) { std::fwrite(text.data(), 1, text.size(), stdout); }

  bool text_;
  std::optional<m3::client::TerminalText> terminal_;
  bool printed_ = false;
};

void print_timings(const m3serve::v1::Timings& t, double client_ttft_ms, double client_total_ms) {
  std::fprintf(stderr,
               "prompt %u tokens, generated %u tokens\n"
               "server: queue %.2f ms, time to first token %.2f ms, duration %.2f ms, %.1f tokens/s\n",
               t.prompt_tokens(), t.generated_tokens(), t.queue_ms(), t.time_to_first_token_ms(),
               t.duration_ms(), t.tokens_per_second());
  if (client_ttft_ms >= 0) {
    std::fprintf(stderr, "client: time to first token %.2f ms, total %.2f ms\n", client_ttft_ms,
                 client_total_ms);
  } else {
    std::fprintf(stderr, "client: no tokens, total %.2f ms\n", client_total_ms);
  }
}

int fail_rpc(std::string_view what, const grpc::Status& status) {
  std::fprintf(stderr, "m3cli: %.*s failed: %s\n", static_cast<int>(what.size()), what.data(),
               m3::client::describe(status).c_str());
  return 1;
}

// The prompt of --ids or --text into a request's prompt_ids or prompt_text; a prompt may
// be left out only where `optional` (a request starting from a stored state).
template <typename Request>
void fill_prompt(const Flags& flags, const char* command, bool optional, Request* request) {
  if ((flags.has("ids") && flags.has("text")) || (!optional && !flags.has("ids") && !flags.has("text"))) {
    throw UsageError(std::string(command) + " needs exactly one of --ids or --text" +
                     (optional ? "" : " (or neither, starting from a snapshot)"));
  }
  if (const auto ids = flags.find("ids")) {
    for (int32_t id : m3::client::parse_id_list(*ids)) request->mutable_prompt_ids()->add_ids(id);
  } else if (const auto text = flags.find("text")) {
    request->set_prompt_text(std::string(*text));
    if (!m3::client::valid_utf8(request->prompt_text())) throw UsageError("--text is not valid UTF-8");
  }
}

int run_generate(const Flags& flags) {
  m3serve::v1::GenerateRequest request;
  request.set_prefix_snapshot_id(flags.get("prefix-snapshot-id", ""));
  fill_prompt(flags, "generate", !request.prefix_snapshot_id().empty(), &request);
  request.set_max_new_tokens(static_cast<uint32_t>(flags.get_int("max-new-tokens", 64, 1, UINT32_MAX)));
  request.set_request_id(flags.get("request-id", ""));
  fill_sampling(flags, request.mutable_sampling());
  add_stop_ids(flags, request.mutable_stop_token_ids());
  TokenPrinter printer(print_mode(flags), request.has_prompt_text());
  const CallSettings call = call_settings(flags, std::nullopt);

  auto stub = m3serve::v1::M3Serve::NewStub(connect(call));
  grpc::ClientContext context;
  set_deadline(&context, call);
  const auto start = Clock::now();
  auto reader = stub->Generate(&context, request);

  double first_token_ms = -1;
  m3serve::v1::GenerateResponse response;
  std::optional<m3serve::v1::Finished> finished;
  while (reader->Read(&response)) {
    if (response.has_tokens()) {
      if (first_token_ms < 0) first_token_ms = ms_since(start);
      printer.print(response.tokens());
    } else if (response.has_finished()) {
      finished = response.finished();
    }
  }
  const grpc::Status status = reader->Finish();
  const double total_ms = ms_since(start);
  printer.end_line();
  if (!status.ok()) return fail_rpc("Generate", status);
  if (!finished) {
    std::fprintf(stderr, "m3cli: the stream ended without a Finished message\n");
    return 1;
  }
  std::fprintf(stderr, "finished: %s, request %s, seed %llu\n",
               std::string(finish_reason_name(finished->reason())).c_str(),
               finished->request_id().c_str(), static_cast<unsigned long long>(finished->seed()));
  print_timings(finished->timings(), first_token_ms, total_ms);
  return 0;
}

int run_converse(const Flags& flags) {
  m3serve::v1::ConverseRequest config;
  auto* session = config.mutable_config();
  session->set_session_id(flags.get("session-id", ""));
  session->set_max_new_tokens(static_cast<uint32_t>(flags.get_int("max-new-tokens", 64, 1, UINT32_MAX)));
  fill_sampling(flags, session->mutable_sampling());
  add_stop_ids(flags, session->mutable_stop_token_ids());
  const PrintMode mode = print_mode(flags);
  const std::string input_mode = flags.get("input", "auto");
  if (input_mode != "auto" && input_mode != "ids" && input_mode != "text")
    throw UsageError("--input: '" + input_mode + "' is not auto, ids or text");
  const CallSettings call = call_settings(flags, std::nullopt);

  auto stub = m3serve::v1::M3Serve::NewStub(connect(call));
  grpc::ClientContext context;
  set_deadline(&context, call);
  auto stream = stub->Converse(&context);
  const bool interactive = isatty(STDIN_FILENO);

  bool open = stream->Write(config);
  std::string line;
  while (open) {
    if (interactive) std::fprintf(stderr, "> ");
    if (!std::getline(std::cin, line)) break;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (!line.empty() && line.back() == '\r') line.pop_back();

    m3serve::v1::ConverseRequest input;
    bool as_ids = input_mode == "ids" || (input_mode == "auto" && m3::client::looks_like_id_list(line));
    if (as_ids) {
      try {
        for (int32_t id : m3::client::parse_id_list(line)) input.mutable_input()->add_ids(id);
      } catch (const UsageError& e) {
        if (input_mode == "ids") {  // not sent; the session goes on
          std::fprintf(stderr, "m3cli: not sent: %s\n", e.what());
          continue;
        }
        as_ids = false;  // e.g. "-" between words: it is text
      }
    }
    if (!as_ids) {
      if (!m3::client::valid_utf8(line)) {
        std::fprintf(stderr, "m3cli: not sent: the line is not valid UTF-8\n");
        continue;
      }
      input.set_input_text(line);
    }
    TokenPrinter printer(mode, !as_ids);
    m3serve::v1::ConverseRequest end_turn;
    end_turn.mutable_end_turn();
    const auto start = Clock::now();
    if (!stream->Write(input) || !stream->Write(end_turn)) {
      open = false;
      break;
    }

    double first_token_ms = -1;
    m3serve::v1::ConverseResponse response;
    bool turn_done = false;
    while (!turn_done && stream->Read(&response)) {
      if (response.has_tokens()) {
        if (first_token_ms < 0) first_token_ms = ms_since(start);
        printer.print(response.tokens());
      } else if (response.has_turn_finished()) {
        printer.end_line(/*always=*/true);
        const auto& finished = response.turn_finished();
        std::fprintf(stderr, "turn %u finished: %s, seed %llu\n", finished.turn(),
                     std::string(finish_reason_name(finished.reason())).c_str(),
                     static_cast<unsigned long long>(finished.seed()));
        print_timings(finished.timings(), first_token_ms, ms_since(start));
        turn_done = true;
      }
    }
    if (!turn_done) open = false;  // the server ended the stream; Finish() says why
  }
  if (open) stream->WritesDone();
  const grpc::Status status = stream->Finish();
  if (!status.ok()) return fail_rpc("Converse", status);
  if (!open) {
    std::fprintf(stderr, "m3cli: the server closed the session before the turn finished\n");
    return 1;
  }
  return 0;
}

// The model's vocab.json as GetModelInfo reports it, on one line.
std::string describe_vocab(const m3serve::v1::ModelInfo& info) {
  if (!info.has_vocab()) return "ids only (no vocab.json)";
  const auto& v = info.vocab();
  std::string out;
  const auto part = [&](const std::string& text) { out += (out.empty() ? "" : "; ") + text; };
  if (v.has_text()) {
    part("text [" + std::to_string(v.text().first_id()) + ", " + std::to_string(v.text().first_id() + v.text().size()) +
         ")" + (v.text().tokenizer().empty() ? "" : " with " + v.text().tokenizer()));
  }
  if (v.has_speech_units()) {
    const auto& u = v.speech_units();
    std::string order;
    for (int32_t c : u.frame_order()) order += (order.empty() ? "" : " ") + std::to_string(c);
    part(std::to_string(u.codebooks()) + " codebooks x " + std::to_string(u.units_per_codebook()) + " units at [" +
         std::to_string(u.first_id()) + ", " + std::to_string(u.first_id() + u.codebooks() * u.units_per_codebook()) +
         "), frame order " + order);
  }
  if (v.controls_size() > 0) {
    std::string controls = "controls";
    for (const auto& c : v.controls()) controls += " " + c.name() + "=" + std::to_string(c.id());
    part(controls);
  }
  return out.empty() ? "nothing named" : out;
}

void print_snapshot(const m3serve::v1::SnapshotInfo& info) {
  std::printf("snapshot_id %s tokens %llu bytes %llu\n", info.snapshot_id().c_str(),
              static_cast<unsigned long long>(info.tokens()), static_cast<unsigned long long>(info.bytes()));
}

int run_create_snapshot(const Flags& flags) {
  m3serve::v1::CreateSnapshotRequest request;
  request.set_base_snapshot_id(flags.get("base-snapshot-id", ""));
  request.set_request_id(flags.get("request-id", ""));
  fill_prompt(flags, "create-snapshot", !request.base_snapshot_id().empty(), &request);
  const CallSettings call = call_settings(flags, std::nullopt);
  auto stub = m3serve::v1::M3Serve::NewStub(connect(call));
  grpc::ClientContext context;
  set_deadline(&context, call);
  m3serve::v1::SnapshotInfo info;
  const grpc::Status status = stub->CreateSnapshot(&context, request, &info);
  if (!status.ok()) return fail_rpc("CreateSnapshot", status);
  print_snapshot(info);
  return 0;
}

// get-snapshot and delete-snapshot: one snapshot by its id.
int run_snapshot_ref(const Flags& flags, bool remove) {
  m3serve::v1::SnapshotRef ref;
  ref.set_snapshot_id(flags.get("id", ""));
  if (ref.snapshot_id().empty()) throw UsageError(std::string(remove ? "delete" : "get") + "-snapshot needs --id");
  const CallSettings call = call_settings(flags, std::chrono::seconds(10));
  auto stub = m3serve::v1::M3Serve::NewStub(connect(call));
  grpc::ClientContext context;
  set_deadline(&context, call);
  m3serve::v1::SnapshotInfo info;
  const grpc::Status status =
      remove ? stub->DeleteSnapshot(&context, ref, &info) : stub->GetSnapshot(&context, ref, &info);
  if (!status.ok()) return fail_rpc(remove ? "DeleteSnapshot" : "GetSnapshot", status);
  print_snapshot(info);
  return 0;
}

int run_info(const Flags& flags) {
  const CallSettings call = call_settings(flags, std::chrono::seconds(10));
  auto stub = m3serve::v1::M3Serve::NewStub(connect(call));
  grpc::ClientContext context;
  set_deadline(&context, call);
  m3serve::v1::ModelInfo info;
  const grpc::Status status = stub->GetModelInfo(&context, m3serve::v1::GetModelInfoRequest(), &info);
  if (!status.ok()) return fail_rpc("GetModelInfo", status);
  std::printf(
      "model:         %s\nbackend:       %s\nweight dtype:  %s\nlayers:        %u\n"
      "d_model:       %u\nvocab:         %u (padded %u)\nd_state:       %u\nheaddim:       %u\n"
      "mimo rank:     %u\nmax batch:     %u\ntokenizer:     %s\ndemo model:    %s\n",
      info.model_name().c_str(),
      info.backend().c_str(), info.weight_dtype().c_str(), info.n_layer(), info.d_model(),
      info.vocab_size(), info.padded_vocab_size(), info.d_state(), info.headdim(),
      info.mimo_rank(), info.max_batch(), info.has_tokenizer() ? "yes" : "no",
      info.demo_model() ? "yes (random weights)" : "no");
  std::printf("vocabulary:    %s\n", describe_vocab(info).c_str());
  return 0;
}

// grpc.health.v1 is not shipped as generated code with gRPC, and its two messages are
// one field each, so they are written and read by hand over a generic stub.
std::string encode_health_request(const std::string& service) {
  std::string bytes;
  if (service.empty()) return bytes;
  bytes.push_back(0x0A);  // field 1 (service), length-delimited
  for (size_t n = service.size(); ; n >>= 7) {
    if (n < 0x80) { bytes.push_back(static_cast<char>(n)); break; }
    bytes.push_back(static_cast<char>((n & 0x7F) | 0x80));
  }
  return bytes + service;
}

// HealthCheckResponse.status (field 1, varint); absent means 0 (UNKNOWN).
int decode_health_status(const std::string& bytes) {
  if (bytes.size() >= 2 && bytes[0] == 0x08) return static_cast<unsigned char>(bytes[1]) & 0x7F;
  return 0;
}

int run_health(const Flags& flags) {
  const std::string service = flags.get("service", "");
  const CallSettings call = call_settings(flags, std::chrono::seconds(5));
  auto channel = connect(call);
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  set_deadline(&context, call);

  const std::string request_bytes = encode_health_request(service);
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                 &response, [&done](grpc::Status status) { done.set_value(std::move(status)); });
  const grpc::Status status = done.get_future().get();
  if (!status.ok()) return fail_rpc("health check", status);

  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Dump(&slices).ok()) {
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  static constexpr const char* kNames[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
  const int code = decode_health_status(bytes);
  std::printf("%s\n", code < 4 ? kNames[code] : "UNRECOGNIZED");
  return code == 1 ? 0 : 1;
}

// A command's flags; a stray bare word is a mistake, not something to ignore.
Flags command_flags(const std::vector<std::string>& args,
                    const std::vector<std::string_view>& value_options,
                    const std::vector<std::string_view>& switches) {
  Flags flags(args, value_options, switches);
  if (!flags.positional().empty()) {
    throw UsageError("unexpected argument '" + flags.positional().front() + "'");
  }
  return flags;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  // The command is the first bare word that is not the value of --server & co.
  std::string command;
  size_t command_at = args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "-h" || arg == "--help" || arg == "help") {
      std::fputs(kUsage.c_str(), stdout);
      return 0;
    }
    if (arg.rfind("--", 0) == 0) {
      if (arg.find('=') == std::string::npos) ++i;  // skip its value (every option before the command takes one)
      continue;
    }
    command = arg;
    command_at = i;
    break;
  }
  if (command_at < args.size()) args.erase(args.begin() + static_cast<std::ptrdiff_t>(command_at));

  try {
    if (command == "generate") {
      return run_generate(command_flags(
          args, options({"ids", "text", "request-id", "print", "prefix-snapshot-id"}, kSamplingOptions), {}));
    }
    if (command == "create-snapshot") {
      return run_create_snapshot(
          command_flags(args, options({"ids", "text", "request-id", "base-snapshot-id"}), {}));
    }
    if (command == "get-snapshot") return run_snapshot_ref(command_flags(args, options({"id"}), {}), false);
    if (command == "delete-snapshot") return run_snapshot_ref(command_flags(args, options({"id"}), {}), true);
    if (command == "converse") {
      return run_converse(
          command_flags(args, options({"session-id", "print", "input"}, kSamplingOptions), {}));
    }
    if (command == "info") return run_info(command_flags(args, options({}), {}));
    if (command == "health") return run_health(command_flags(args, options({"service"}), {}));
    throw UsageError(command.empty() ? "no command given" : "unknown command '" + command + "'");
  } catch (const UsageError& e) {
    std::fprintf(stderr, "m3cli: %s\n\n%s", e.what(), kUsage.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3cli: %s\n", e.what());
    return 1;
  }
}
