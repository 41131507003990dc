#include "server/tools/bench_realtime.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "m3serve.grpc.pb.h"
#include "server/tools/client_support.h"

namespace m3 {
namespace {

namespace v1 = ::m3serve::v1;
using client::Flags;
using client::UsageError;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage = R"(usage: m3bench realtime --streams N[,N...] [options]
  --server host:port      default 127.0.0.1:50051
  --streams N[,N...]      streams run at once, one measurement per N (each 1..8192)
  --rate R                tokens/s each stream plays (default 100: 12.5 frames/s x 8 codebooks)
  --slack-ms S            token k must arrive by start + k/R + S (default 100)
  --reply-tokens K        tokens of each reply (default 500: 5 s at 100 tokens/s)
  --prompt-len L          Generate: prompt tokens (default 8; random ids)
  --duplex                each stream a Converse session: --turns turns of --turn-tokens
                          input tokens sent at the rate in 8-token frames, then a reply
  --turns T               duplex: turns per session (default 3)
  --turn-tokens I         duplex: input tokens per turn (default 64)
  --streams-per-channel C streams sharing one HTTP/2 connection (default 128)
  --timeout S             deadline per stream in seconds (default 600)
  --connect-timeout S     seconds to wait for the server (default 5)
  --json out.json         also write the results as JSON

A reply's start is when its request was sent (Generate) or its turn ended (--duplex):
the first token has the slack to arrive, then one token each 1/R s. A stream that ends
in an error does not hold. Turn latency: end of turn to the reply's first token. A server
that runs ahead of the readers holds the tokens they have not read yet: a reply longer
than its stream_buffer_tokens may be cut (RESOURCE_EXHAUSTED) where it runs far ahead.
)";

constexpr int kFrameTokens = 8;  // a codec frame: 8 codebook tokens

struct Options {
  std::string server;
  std::vector<int> streams;
  double rate = 100;
  double slack_ms = 100;
  int reply_tokens = 500;
  int prompt_len = 8;
  bool duplex = false;
  int turns = 3;
  int turn_tokens = 64;
  int streams_per_channel = 128;
  std::chrono::milliseconds timeout{600'000};
  std::chrono::milliseconds connect_timeout{5'000};
  std::string json_path;
};

// What one stream saw.
struct StreamResult {
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;
  std::vector<double> lag_ms;           // per reply token: arrival - due (negative: early)
  std::vector<double> turn_latency_ms;  // duplex: per turn
  std::vector<double> first_token_ms;   // per reply: its start to its first token
  int tokens = 0;
};

double ms_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// Ids spread over the vocabulary, different per stream and turn.
int32_t token_id(uint64_t stream, uint64_t i, uint32_t vocab) {
  uint64_t z = 0x9E3779B97F4A7C15ull * (stream + 1) + 0xBF58476D1CE4E5B9ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<int32_t>((z ^ (z >> 31)) % vocab);
}

// Reads one reply at the rate: each message's tokens get their lag against
// `start` + k/rate; before the next read the client waits until the next token is due
// (it plays what it has). Returns false when the stream ended before the reply did.
template <typename Read>
bool read_paced(const Options& o, Clock::time_point start, StreamResult& r, Read&& read) {
  int k = 0;
  for (;;) {
    const auto next_due = start + seconds(k / o.rate);
    std::this_thread::sleep_until(next_due);
    int n = 0;
    bool finished = false;
    if (!read(&n, &finished)) return false;
    const auto now = Clock::now();
    if (k == 0 && n > 0) r.first_token_ms.push_back(ms_between(start, now));
    for (int i = 0; i < n; ++i, ++k) r.lag_ms.push_back(ms_between(start + seconds(k / o.rate), now));
    r.tokens += n;
    if (finished) return true;
  }
}

StreamResult run_generate_stream(v1::M3Serve::Stub& stub, const Options& o, int stream, uint32_t vocab,
                                 Clock::time_point begin) {
  v1::GenerateRequest request;
  request.set_request_id("realtime-" + std::to_string(stream));
  for (int i = 0; i < o.prompt_len; ++i) request.mutable_prompt_ids()->add_ids(token_id(stream, i, vocab));
  request.set_max_new_tokens(static_cast<uint32_t>(o.reply_tokens));
  StreamResult r;
  r.lag_ms.reserve(o.reply_tokens);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + o.timeout);
  std::this_thread::sleep_until(begin);
  const auto start = Clock::now();
  auto reader = stub.Generate(&context, request);
  v1::GenerateResponse response;
  read_paced(
      o, start, r,
      [&](int* n, bool* finished) {
        if (!reader->Read(&response)) return false;
        *n = response.has_tokens() ? response.tokens().ids_size() : 0;
        *finished = response.has_finished();
        return true;
      });
  const grpc::Status status = reader->Finish();
  r.code = status.error_code();
  r.message = status.error_message();
  return r;
}

StreamResult run_duplex_stream(v1::M3Serve::Stub& stub, const Options& o, int stream, uint32_t vocab,
                               Clock::time_point begin) {
  StreamResult r;
  r.lag_ms.reserve(static_cast<size_t>(o.turns) * o.reply_tokens);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + o.timeout);
  std::this_thread::sleep_until(begin);
  auto session = stub.Converse(&context);
  v1::ConverseRequest config;
  config.mutable_config()->set_session_id("realtime-" + std::to_string(stream));
  config.mutable_config()->set_max_new_tokens(static_cast<uint32_t>(o.reply_tokens));
  bool open = session->Write(config);
  uint64_t sent = 0;
  for (int turn = 0; open && turn < o.turns; ++turn) {
    // The speaker's input: each 8-token frame goes out once it has been spoken.
    const auto turn_start = Clock::now();
    for (int f = 0; open && f * kFrameTokens < o.turn_tokens; ++f) {
      const int count = std::min(kFrameTokens, o.turn_tokens - f * kFrameTokens);
      std::this_thread::sleep_until(turn_start + seconds((f * kFrameTokens + count) / o.rate));
      v1::ConverseRequest frame;
      for (int i = 0; i < count; ++i) frame.mutable_input()->add_ids(token_id(stream, sent++, vocab));
      open = session->Write(frame);
    }
    v1::ConverseRequest end_turn;
    end_turn.mutable_end_turn();
    if (!open || !session->Write(end_turn)) break;
    const auto turn_end = Clock::now();
    const size_t before = r.first_token_ms.size();
    v1::ConverseResponse response;
    open = read_paced(
        o, turn_end, r,
        [&](int* n, bool* finished) {
          if (!session->Read(&response)) return false;
          *n = response.has_tokens() ? response.tokens().ids_size() : 0;
          *finished = response.has_turn_finished();
          return true;
        });
    if (r.first_token_ms.size() > before) r.turn_latency_ms.push_back(r.first_token_ms.back());
  }
  if (open) session->WritesDone();
  const grpc::Status status = session->Finish();
  r.code = status.error_code();
  r.message = status.error_message();
  if (r.code == grpc::StatusCode::OK && !open) {
    r.code = grpc::StatusCode::UNKNOWN;
    r.message = "the session ended before its last turn finished";
  }
  return r;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * v.size()));  // nearest rank
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

Options parse_options(const std::vector<std::string>& args) {
  Flags flags(args,
              {"server", "streams", "rate", "slack-ms", "reply-tokens", "prompt-len", "turns", "turn-tokens",
               "streams-per-channel", "timeout", "connect-timeout", "json"},
              {"duplex"});
  if (!flags.positional().empty()) throw UsageError("unexpected argument '" + flags.positional().front() + "'");
  Options o;
  o.server = flags.get("server", "127.0.0.1:50051");
  const auto streams = flags.find("streams");
  if (!streams) throw UsageError("--streams N[,N...] is required");
  for (int32_t n : client::parse_id_list(*streams)) {
    if (n < 1 || n > 8192) throw UsageError("--streams: " + std::to_string(n) + " is not in [1, 8192]");
    o.streams.push_back(n);
  }
  o.rate = flags.get_double("rate", 100);
  if (!(o.rate > 0 && o.rate <= 100'000)) throw UsageError("--rate must be in (0, 100000] tokens/s");
  o.slack_ms = flags.get_double("slack-ms", 100);
  if (!(o.slack_ms >= 0 && o.slack_ms <= 60'000)) throw UsageError("--slack-ms must be in [0, 60000]");
  o.reply_tokens = static_cast<int>(flags.get_int("reply-tokens", 500, 1, 1'000'000));
  o.prompt_len = static_cast<int>(flags.get_int("prompt-len", 8, 1, 1'000'000));
  o.duplex = flags.has("duplex");
  o.turns = static_cast<int>(flags.get_int("turns", 3, 1, 10'000));
  o.turn_tokens = static_cast<int>(flags.get_int("turn-tokens", 64, 1, 1'000'000));
  o.streams_per_channel = static_cast<int>(flags.get_int("streams-per-channel", 128, 1, 8192));
  o.timeout = flags.get_seconds("timeout").value_or(o.timeout);
  o.connect_timeout = flags.get_seconds("connect-timeout").value_or(o.connect_timeout);
  o.json_path = flags.get("json", "");
  return o;
}

// Several connections, so that thousands of streams do not share one HTTP/2 connection's
// flow control and its one reading thread (each channel gets its own subchannel pool).
std::vector<std::shared_ptr<grpc::Channel>> open_channels(const Options& o, int count) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < count; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto channel = grpc::CreateCustomChannel(o.server, grpc::InsecureChannelCredentials(), args);
    if (!channel->WaitForConnected(std::chrono::system_clock::now() + o.connect_timeout)) {
      throw std::runtime_error("cannot reach the server at " + o.server + " (no connection within " +
                               std::to_string(o.connect_timeout.count()) + " ms; is m3serve running there?)");
    }
    channels.push_back(std::move(channel));
  }
  return channels;
}

nlohmann::json measure(const Options& o, int n, uint32_t vocab) {
  const int channel_count = (n + o.streams_per_channel - 1) / o.streams_per_channel;
  const auto channels = open_channels(o, channel_count);
  std::vector<std::unique_ptr<v1::M3Serve::Stub>> stubs;
  for (const auto& c : channels) stubs.push_back(v1::M3Serve::NewStub(c));
  std::vector<StreamResult> results(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  // Every stream starts at the same moment, once all threads exist.
  const auto begin = Clock::now() + std::chrono::milliseconds(200 + n / 8);
  for (int s = 0; s < n; ++s) {
    threads.emplace_back([&, s] {
      auto& stub = *stubs[s % stubs.size()];
      results[s] = o.duplex ? run_duplex_stream(stub, o, s, vocab, begin) : run_generate_stream(stub, o, s, vocab, begin);
    });
  }
  for (auto& t : threads) t.join();
  const double wall_s = std::chrono::duration<double>(Clock::now() - begin).count();

  std::vector<double> lag, turn_latency, first_token;
  std::map<std::string, int> errors;
  int held = 0, failed = 0;
  int64_t tokens = 0, late_tokens = 0;
  double worst_lag = -1e300;
  for (const auto& r : results) {
    bool stream_held = r.code == grpc::StatusCode::OK;
    if (!stream_held) {
      ++failed;
      ++errors[std::string(client::status_code_name(r.code)) + ": " + r.message];
    }
    for (double l : r.lag_ms) {
      lag.push_back(std::max(0.0, l));
      worst_lag = std::max(worst_lag, l);
      if (l > o.slack_ms) {
        ++late_tokens;
        stream_held = false;
      }
    }
    tokens += r.tokens;
    held += stream_held ? 1 : 0;
    turn_latency.insert(turn_latency.end(), r.turn_latency_ms.begin(), r.turn_latency_ms.end());
    first_token.insert(first_token.end(), r.first_token_ms.begin(), r.first_token_ms.end());
  }
  nlohmann::json j = {{"streams", n},
                      {"held", held == n},
                      {"streams_held", held},
                      {"streams_failed", failed},
                      {"tokens", tokens},
                      {"wall_s", wall_s},
                      {"late_tokens", late_tokens},
                      {"lag_p50_ms", percentile(lag, 0.50)},
                      {"lag_p99_ms", percentile(lag, 0.99)},
                      {"lag_max_ms", lag.empty() ? 0.0 : std::max(0.0, worst_lag)},
                      {"errors", errors}};
  if (o.duplex) {
    j["turns"] = turn_latency.size();
    j["turn_latency_p50_ms"] = percentile(turn_latency, 0.50);
    j["turn_latency_p99_ms"] = percentile(turn_latency, 0.99);
  } else {
    j["first_token_p50_ms"] = percentile(first_token, 0.50);
    j["first_token_p99_ms"] = percentile(first_token, 0.99);
  }
  return j;
}

int run(const Options& o) {
  auto stub = v1::M3Serve::NewStub(client::connect(o.server, o.connect_timeout));
  v1::ModelInfo info;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status status = stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &info);
    if (!status.ok()) {
      std::fprintf(stderr, "m3bench realtime: GetModelInfo failed: %s\n", client::describe(status).c_str());
      return 1;
    }
  }
  if (info.vocab_size() == 0) {
    std::fprintf(stderr, "m3bench realtime: the server reports an empty vocabulary\n");
    return 1;
  }
  std::printf("m3bench realtime: %s (%s, %s, max_batch %u), %s, %.0f tokens/s a stream, slack %.0f ms, "
              "replies of %d tokens\n",
              o.server.c_str(), info.model_name().c_str(), info.backend().c_str(), info.max_batch(),
              o.duplex ? "duplex (Converse)" : "Generate", o.rate, o.slack_ms, o.reply_tokens);
  nlohmann::json out = {{"server", o.server},
                        {"model", info.model_name()},
                        {"backend", info.backend()},
                        {"weight_dtype", info.weight_dtype()},
                        {"max_batch", info.max_batch()},
                        {"mode", o.duplex ? "duplex" : "generate"},
                        {"rate_tokens_per_s", o.rate},
                        {"slack_ms", o.slack_ms},
                        {"reply_tokens", o.reply_tokens},
                        {"results", nlohmann::json::array()}};
  if (o.duplex) {
    out["turns"] = o.turns;
    out["turn_tokens"] = o.turn_tokens;
  } else {
    out["prompt_len"] = o.prompt_len;
  }
  int largest_held = 0;
  for (int n : o.streams) {
    const nlohmann::json r = measure(o, n, info.vocab_size());
    if (r["held"].get<bool>()) largest_held = std::max(largest_held, n);
    std::printf("%6d streams: %s  (%d held, %d failed)  lag p50 %.1f ms  p99 %.1f ms  max %.1f ms", n,
                r["held"].get<bool>() ? "HELD" : "LATE", r["streams_held"].get<int>(), r["streams_failed"].get<int>(),
                r["lag_p50_ms"].get<double>(), r["lag_p99_ms"].get<double>(), r["lag_max_ms"].get<double>());
    if (o.duplex) {
      std::printf("  turn latency p50 %.1f ms  p99 %.1f ms", r["turn_latency_p50_ms"].get<double>(),
                  r["turn_latency_p99_ms"].get<double>());
    }
    std::printf("\n");
    for (const auto& [what, count] : r["errors"].items()) std::printf("         error x%d: %s\n", count.get<int>(), what.c_str());
    out["results"].push_back(r);
  }
  out["largest_held"] = largest_held;
  std::printf("largest N held: %d\n", largest_held);
  if (!o.json_path.empty()) {
    std::ofstream file(o.json_path);
    file << out.dump(2) << "\n";
    if (!file) {
      std::fprintf(stderr, "m3bench realtime: cannot write %s\n", o.json_path.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace

int run_bench_realtime(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    if (i == 1 && std::string(argv[i]) == "realtime") continue;
    args.emplace_back(argv[i]);
  }
  if (std::find(args.begin(), args.end(), "--help") != args.end()) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  try {
    return run(parse_options(args));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "m3bench realtime: %s\n\n%s", e.what(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3bench realtime: %s\n", e.what());
    return 1;
  }
}

}  // namespace m3
