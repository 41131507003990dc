// Shared by the server tests: a tiny random model on disk, an in-process server on an
// ephemeral 127.0.0.1 port (CPU backend), a log sink that counts lines, the engine's own
// output for a prompt (what a stream must equal), and the client calls, metric reads and
// polls the end-to-end tests share (defined in server_test_support.cc, library
// m3_server_test_support).
#pragma once

#include <grpcpp/grpcpp.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "m3serve.grpc.pb.h"
#include "model/engine.h"
#include "model/random_model.h"
#include "model/weights.h"
#include "server/demo_model.h"
#include "server/metrics.h"
#include "server/server_app.h"
#include "server/server_config.h"

namespace m3::test {

namespace v1 = ::m3serve::v1;

// Counts the lines logged (and keeps them, to show on failure).
class CountingSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  size_t count() {
    std::lock_guard lock(mutex_);
    return lines_.size();
  }
  std::vector<std::string> lines() {
    std::lock_guard lock(mutex_);
    return lines_;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    lines_.emplace_back(msg.payload.data(), msg.payload.size());
  }
  void flush_() override {}

 private:
  std::vector<std::string> lines_;
};

// The tiny model, written once per test binary.
inline const std::filesystem::path& tiny_model_dir() {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() /
             ("m3serve-server-test-" + std::to_string(::getpid()));
    write_random_model(demo_model_config(), 7, DType::F32, d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(std::filesystem::temp_directory_path() /
                                      ("m3serve-server-test-" + std::to_string(::getpid())),
                                  ec);
    });
    return d;
  }();
  return dir;
}

inline ServerConfig test_config() {
  ServerConfig c;
  c.listen = "127.0.0.1:0";
  c.metrics_listen = "";
  c.model = tiny_model_dir().string();
  c.backend = "cpu";
  c.cpu_threads = 1;
  c.max_batch = 4;
  c.queue_capacity = 8;
  c.max_new_tokens_limit = 100000;
  c.shutdown_grace_s = 1;
  return c;
}

// One slot and no queue: a request is refused unless the slot is free, so a test can
// tell that a stream gave its slot back.
inline ServerConfig one_slot_config() {
  ServerConfig c = test_config();
  c.max_batch = 1;
  c.queue_capacity = 0;
  return c;
}

struct TestServer {
  std::shared_ptr<CountingSink> sink = std::make_shared<CountingSink>();
  std::shared_ptr<spdlog::logger> logger = std::make_shared<spdlog::logger>("m3serve-test", sink);
  std::unique_ptr<ServerApp> app;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::M3Serve::Stub> stub;

  explicit TestServer(const ServerConfig& config = test_config()) {
    logger->set_level(spdlog::level::info);
    // M3_TEST_LOG=1 shows the server's log on stderr too.
    if (const char* show = std::getenv("M3_TEST_LOG"); show && *show == '1')
      logger->sinks().push_back(std::make_shared<spdlog::sinks::stderr_sink_mt>());
    app = std::make_unique<ServerApp>(config, logger);
    channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(app->port()),
                                  grpc::InsecureChannelCredentials());
    stub = v1::M3Serve::NewStub(channel);
  }
};

// What the engine itself makes for `prompt` in one slot: prompt fed one token per step,
// then max_new tokens, each fed back (stops after a stop id). None for max_new 0: the
// prefix of a stream whose client received nothing.
inline std::vector<int32_t> engine_generate(const std::vector<int32_t>& prompt, int max_new,
                                            SamplingParams sampling = {},
                                            const std::vector<int32_t>& stops = {}) {
  if (max_new <= 0) return {};
  static const ModelWeights weights = ModelWeights::load(tiny_model_dir());
  EngineOptions options;
  options.max_slots = 1;
  options.cpu_threads = 1;
  auto engine = make_engine("cpu", weights, options);
  engine->reset(0);
  engine->set_sampling(0, sampling);
  const int32_t slot = 0;
  int32_t sampled = 0;
  for (int32_t t : prompt) engine->step({&slot, 1}, {&t, 1}, {&sampled, 1});
  std::vector<int32_t> out;
  for (;;) {
    out.push_back(sampled);
    if (static_cast<int>(out.size()) == max_new) break;
    if (std::find(stops.begin(), stops.end(), sampled) != stops.end()) break;
    const int32_t next = sampled;
    engine->step({&slot, 1}, {&next, 1}, {&sampled, 1});
  }
  return out;
}

struct GenerateResult {
  std::vector<int32_t> tokens;
  int token_messages = 0;
  bool finished = false;
  v1::Finished finish;
  grpc::Status status;
};

inline GenerateResult generate(v1::M3Serve::Stub& stub, const v1::GenerateRequest& request,
                               std::chrono::milliseconds deadline = std::chrono::seconds(60)) {
  GenerateResult r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  auto reader = stub.Generate(&ctx, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.has_tokens()) {
      ++r.token_messages;
      for (int32_t id : response.tokens().ids()) r.tokens.push_back(id);
    } else if (response.has_finished()) {
      r.finished = true;
      r.finish = response.finished();
    }
  }
  r.status = reader->Finish();
  return r;
}

inline v1::GenerateRequest generate_request(const std::vector<int32_t>& prompt, uint32_t max_new) {
  v1::GenerateRequest request;
  request.mutable_prompt_ids();  // set even when empty
  for (int32_t id : prompt) request.mutable_prompt_ids()->add_ids(id);
  request.set_max_new_tokens(max_new);
  return request;
}

// The prompt most tests send.
inline const std::vector<int32_t> kPrompt = {17, 3, 250, 99, 4, 411};

// The value of one series in the Prometheus text ("name{labels} value"), -1 if absent.
double metric_value(const std::string& text, const std::string& series);

// m3serve_requests_total for one status.
double requests_with_status(ServerApp& app, const std::string& status);

// Polls until the metric reaches `value` (the stream end is recorded just after the
// client sees it), for at most `limit`.
bool wait_for_requests(ServerApp& app, const std::string& status, double value,
                       std::chrono::milliseconds limit = std::chrono::seconds(5));

// Polls until `done` holds (what the server does after the client sees a stream end,
// or before it tells the client anything), for at most about 5 s.
bool eventually(const std::function<bool()>& done);

using ConverseStream = grpc::ClientReaderWriter<v1::ConverseRequest, v1::ConverseResponse>;

struct ConverseTurn {
  std::vector<int32_t> tokens;
  v1::TurnFinished finished;
};

// The next reply on a Converse stream: its tokens up to its TurnFinished (left empty when
// the stream ends first).
ConverseTurn read_reply(ConverseStream& stream);

// Runs a Converse session with the given messages (no reads in between) and returns the
// final status.
grpc::Status converse_status(v1::M3Serve::Stub& stub, const std::vector<v1::ConverseRequest>& messages);

// Starts a session on `stream` that replies once (3 tokens to kPrompt) and is then
// between turns.
void one_reply_then_idle(ConverseStream& stream);

// A stub whose channel has a receive window of about 1 KB: a client that reads nothing
// stalls the server's writes once the window is full.
std::unique_ptr<v1::M3Serve::Stub> small_window_stub(TestServer& server);

// One request of `method` as raw bytes through a generic stub, as a unary call: the
// call's status and, when it is OK, the response's bytes.
struct RawCall {
  grpc::Status status;
  std::string bytes;
};
RawCall raw_call(TestServer& server, const std::string& method, const std::string& request_bytes);

}  // namespace m3::test
