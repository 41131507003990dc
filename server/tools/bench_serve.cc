#include "server/tools/bench_serve.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "m3serve.grpc.pb.h"
#include "server/tools/client_support.h"

namespace m3 {
namespace {

using client::Flags;
using client::UsageError;
using Clock = std::chrono::steady_clock;

const std::string kUsage = R"(usage: m3bench serve [options]
  --server host:port      default 127.0.0.1:50051
  --concurrency N         requests in flight (default 8)
  --requests M            requests in all (default 64)
  --prompt-len L          prompt tokens per request (default 16; random ids)
  --shared-prefix P       P more tokens, the same for every request, before each prompt
                          (default 0): time to first token with and without the server's
                          prefix_cache
  --max-new-tokens K      tokens generated per request (default 64)
  --temperature T         default 0 (greedy); with T > 0 request i uses seed i
  --timeout S             deadline per request in seconds (default 300)
  --connect-timeout S     seconds to wait for the server (default 5)
                          (seconds: more than 0, at most 1000000)
  --json out.json         also write the results as JSON
)" + std::string(client::kSecurityUsage);

struct BenchOptions {
  std::string server;
  int concurrency = 8;
  int requests = 64;
  int prompt_len = 16;
  int shared_prefix = 0;
  int max_new_tokens = 64;
  double temperature = 0;
  std::chrono::milliseconds timeout{300'000};
  std::chrono::milliseconds connect_timeout{5'000};
  std::string json_path;
  client::ConnectionSecurity security;
};

struct RequestResult {
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;
  double ttft_ms = -1;
  double duration_ms = 0;
  int tokens = 0;
  std::vector<double> token_gaps_ms;  // one per token after the first
};

struct Summary {
  double p50 = 0, p99 = 0, mean = 0;
  size_t count = 0;
};

Summary summarize(std::vector<double> values) {
  Summary s;
  s.count = values.size();
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  // Nearest rank: the smallest value with at least q of the samples at or below it.
  auto rank = [&](double q) {
    const size_t index = static_cast<size_t>(std::ceil(q * values.size()));
    return values[std::clamp<size_t>(index, 1, values.size()) - 1];
  };
  s.p50 = rank(0.50);
  s.p99 = rank(0.99);
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / values.size();
  return s;
}

// Deterministic prompts (request i always sends the same ids), spread over the vocabulary.
std::vector<int32_t> make_prompt(int request, int length, uint32_t vocab) {
  std::vector<int32_t> ids(length);
  uint64_t state = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(request + 1);
  for (auto& id : ids) {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    id = static_cast<int32_t>((z ^ (z >> 31)) % vocab);
  }
  return ids;
}

RequestResult run_one(m3serve::v1::M3Serve::Stub& stub, const BenchOptions& options, int index,
                      uint32_t vocab) {
  m3serve::v1::GenerateRequest request;
  request.set_request_id("bench-" + std::to_string(index));
  if (options.shared_prefix > 0) {
    for (int32_t id : make_prompt(-1, options.shared_prefix, vocab)) request.mutable_prompt_ids()->add_ids(id);
  }
  for (int32_t id : make_prompt(index, options.prompt_len, vocab)) {
    request.mutable_prompt_ids()->add_ids(id);
  }
  request.set_max_new_tokens(static_cast<uint32_t>(options.max_new_tokens));
  request.mutable_sampling()->set_temperature(static_cast<float>(options.temperature));
  if (options.temperature > 0) request.mutable_sampling()->set_seed(static_cast<uint64_t>(index));

  RequestResult result;
  result.token_gaps_ms.reserve(options.max_new_tokens);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + options.timeout);
  const auto start = Clock::now();
  auto last = start;
  auto reader = stub.Generate(&context, request);
  m3serve::v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (!response.has_tokens() || response.tokens().ids_size() == 0) continue;
    const auto now = Clock::now();
    const int n = response.tokens().ids_size();
    if (result.tokens == 0) {
      result.ttft_ms = std::chrono::duration<double, std::milli>(now - start).count();
      // Tokens batched behind the first one arrived with it: their gap is 0.
      result.token_gaps_ms.insert(result.token_gaps_ms.end(), n - 1, 0.0);
    } else {
      // A message of n tokens after a gap g: the client saw n tokens in g, so g/n each.
      const double gap = std::chrono::duration<double, std::milli>(now - last).count();
      result.token_gaps_ms.insert(result.token_gaps_ms.end(), n, gap / n);
    }
    result.tokens += n;
    last = now;
  }
  const grpc::Status status = reader->Finish();
  result.duration_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  result.code = status.error_code();
  result.message = status.error_message();
  return result;
}

BenchOptions parse_options(const std::vector<std::string>& args) {
  Flags flags(args,
              {"server", "concurrency", "requests", "prompt-len", "shared-prefix", "max-new-tokens", "temperature",
               "timeout", "connect-timeout", "json", "tls-ca", "tls-cert", "tls-key", "tls-server-name",
               "api-key-file"},
              {});
  if (!flags.positional().empty()) {
    throw UsageError("unexpected argument '" + flags.positional().front() + "'");
  }
  BenchOptions o;
  o.server = flags.get("server", "127.0.0.1:50051");
  o.concurrency = static_cast<int>(flags.get_int("concurrency", 8, 1, 4096));
  o.requests = static_cast<int>(flags.get_int("requests", 64, 1, 10'000'000));
  o.prompt_len = static_cast<int>(flags.get_int("prompt-len", 16, 1, 1'000'000));
  o.shared_prefix = static_cast<int>(flags.get_int("shared-prefix", 0, 0, 1'000'000));
  o.max_new_tokens = static_cast<int>(flags.get_int("max-new-tokens", 64, 1, 1'000'000));
  o.temperature = flags.get_double("temperature", 0.0);
  o.timeout = flags.get_seconds("timeout").value_or(o.timeout);
  o.connect_timeout = flags.get_seconds("connect-timeout").value_or(o.connect_timeout);
  o.json_path = flags.get("json", "");
  o.security = client::connection_security(flags);
  if (o.temperature < 0) throw UsageError("--temperature must not be negative");
  return o;
}

nlohmann::json summary_json(const Summary& s) {
  return {{"p50_ms", s.p50}, {"p99_ms", s.p99}, {"mean_ms", s.mean}, {"samples", s.count}};
}

int run(const BenchOptions& options) {
  auto channel = client::connect(options.server, options.connect_timeout, options.security);
  auto stub = m3serve::v1::M3Serve::NewStub(channel);

  m3serve::v1::ModelInfo info;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const auto status = stub->GetModelInfo(&context, m3serve::v1::GetModelInfoRequest(), &info);
    if (!status.ok()) {
      std::fprintf(stderr, "m3bench serve: GetModelInfo failed: %s\n",
                   client::describe(status).c_str());
      return 1;
    }
  }
  if (info.vocab_size() == 0) {
    std::fprintf(stderr, "m3bench serve: the server reports an empty vocabulary\n");
    return 1;
  }

  std::vector<RequestResult> results(options.requests);
  std::atomic<int> next{0};
  const auto start = Clock::now();
  std::vector<std::thread> workers;
  const int threads = std::min(options.concurrency, options.requests);
  workers.reserve(threads);
  for (int w = 0; w < threads; ++w) {
    workers.emplace_back([&] {
      for (int i; (i = next.fetch_add(1)) < options.requests;) {
        results[i] = run_one(*stub, options, i, info.vocab_size());
      }
    });
  }
  for (auto& worker : workers) worker.join();
  const double wall_s = std::chrono::duration<double>(Clock::now() - start).count();

  std::vector<double> ttft, gaps, durations;
  std::map<std::string, int> errors;
  std::map<std::string, std::string> first_error_message;
  int ok = 0;
  uint64_t tokens = 0;
  for (const auto& r : results) {
    tokens += r.tokens;
    if (r.code != grpc::StatusCode::OK) {
      const std::string name(client::status_code_name(r.code));
      if (errors[name]++ == 0) first_error_message[name] = r.message;
      continue;
    }
    ++ok;
    if (r.ttft_ms >= 0) ttft.push_back(r.ttft_ms);
    gaps.insert(gaps.end(), r.token_gaps_ms.begin(), r.token_gaps_ms.end());
    durations.push_back(r.duration_ms);
  }
  const Summary ttft_s = summarize(ttft), gap_s = summarize(gaps), dur_s = summarize(durations);
  const int failed = options.requests - ok;

  std::printf("m3bench serve: %s (%s, %s), %d requests, concurrency %d, prompt %d (+ %d shared), max new "
              "tokens %d\n",
              options.server.c_str(), info.model_name().c_str(), info.backend().c_str(), options.requests,
              options.concurrency, options.prompt_len, options.shared_prefix, options.max_new_tokens);
  std::printf("ok %d, errors %d\n", ok, failed);
  std::printf("wall %.3f s, %llu tokens, %.1f tokens/s, %.2f requests/s\n", wall_s,
              static_cast<unsigned long long>(tokens), tokens / wall_s, ok / wall_s);
  auto line = [](const char* name, const Summary& s) {
    std::printf("%-22s p50 %9.3f ms   p99 %9.3f ms   mean %9.3f ms   (%zu samples)\n", name,
                s.p50, s.p99, s.mean, s.count);
  };
  line("time to first token", ttft_s);
  line("inter-token latency", gap_s);
  line("request duration", dur_s);
  for (const auto& [name, count] : errors) {
    std::printf("error %s x%d (first: %s)\n", name.c_str(), count,
                first_error_message[name].c_str());
  }

  if (!options.json_path.empty()) {
    nlohmann::json out = {
        {"server", options.server},
        {"model", info.model_name()},
        {"backend", info.backend()},
        {"concurrency", options.concurrency},
        {"requests", options.requests},
        {"prompt_len", options.prompt_len},
        {"shared_prefix", options.shared_prefix},
        {"max_new_tokens", options.max_new_tokens},
        {"temperature", options.temperature},
        {"ok", ok},
        {"errors", failed},
        {"errors_by_status", errors},
        {"wall_s", wall_s},
        {"tokens", tokens},
        {"tokens_per_second", tokens / wall_s},
        {"time_to_first_token", summary_json(ttft_s)},
        {"inter_token_latency", summary_json(gap_s)},
        {"request_duration", summary_json(dur_s)},
    };
    std::ofstream file(options.json_path);
    file << out.dump(2) << "\n";
    if (!file) {
      std::fprintf(stderr, "m3bench serve: cannot write %s\n", options.json_path.c_str());
      return 1;
    }
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace

int run_bench_serve(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    if (i == 1 && std::string(argv[i]) == "serve") continue;
    args.emplace_back(argv[i]);
  }
  if (std::find(args.begin(), args.end(), "--help") != args.end()) {
    std::fputs(kUsage.c_str(), stdout);
    return 0;
  }
  try {
    return run(parse_options(args));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "m3bench serve: %s\n\n%s", e.what(), kUsage.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3bench serve: %s\n", e.what());
    return 1;
  }
}

}  // namespace m3
