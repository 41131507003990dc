#include "server/server_app.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <thread>

#include "model/engine.h"
#include "model/snapshot_format.h"
#include "model/slot_budget.h"
#include "model/tokenizer.h"
#include "model/vocab_layout.h"
#include "model/weights.h"
#include "server/api_keys.h"
#include "server/demo_model.h"
#include "server/library_logs.h"
#include "server/m3serve_service.h"
#include "server/metrics.h"
#include "server/prefix_cache.h"
#include "server/request_log.h"
#include "server/request_validation.h"
#include "server/scheduler.h"
#include "server/service_context.h"
#include "server/session_metrics.h"
#include "server/snapshot_metrics.h"
#include "server/snapshot_service.h"
#include "server/stalled_streams.h"
#include "server/vocab_serving.h"
#include "server/tls_files.h"

namespace m3 {
namespace {

WeightDType weight_dtype_of(const std::string& name) {
  return name == "fp32" ? WeightDType::F32 : WeightDType::BF16;
}

// Takes server reflection off a server whose RPCs need an API key: reflection would need
// none (gRPC's plugin is one service for every server of the process).
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const auto& p) { return p->name() == "proto_server_reflection"; }),
                   plugins->end());
  }
};

// The health_listen server's every other method: refused (it serves grpc.health.v1 alone).
// (A server with no service of its own does not start; this one is it.)
class NothingButHealth final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* call) override {
    class Refusal final : public grpc::ServerGenericBidiReactor {
     public:
      explicit Refusal(const std::string& method) {
        Finish({grpc::StatusCode::UNIMPLEMENTED, method + ": this port (health_listen) serves only grpc.health.v1"});
      }
      void OnDone() override { delete this; }
    };
    return new Refusal(call->method());
  }
};

// A setting in seconds as the scheduler's and the sweeper's clock duration.
Clock::duration from_seconds(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

ServerApp::ServerApp(const ServerConfig& config, std::shared_ptr<spdlog::logger> logger)
    : config_(config), logger_(logger ? std::move(logger) : spdlog::default_logger()) {
  config_.validate();

  std::filesystem::path model_dir = config_.model;
  if (model_dir.empty()) {
    model_dir = ensure_demo_model(config_.demo_model_dir);
    demo_model_ = true;
    logger_->warn("no --model given: serving a DEMO model with random weights from {} "
                  "(its output is meaningless)", model_dir.string());
  }
  weights_ = std::make_unique<ModelWeights>(ModelWeights::load(model_dir));
  if (auto vocab = VocabLayout::load(model_dir, weights_->config().vocab_size)) {
    vocab_ = std::make_unique<VocabLayout>(std::move(*vocab));
    logger_->info("vocabulary (vocab.json): {}", describe_vocab(*vocab_));
  }

  EngineOptions engine_options;
  engine_options.max_slots = config_.max_batch;
  engine_options.weight_dtype = weight_dtype_of(config_.weight_dtype);
  engine_options.device = config_.device;
  engine_options.cpu_threads = config_.cpu_threads;
  engine_options.use_graphs = config_.cuda_graphs;
  engine_options.deterministic = config_.deterministic;
  engine_options.cuda = config_.cuda;
  if (config_.prefill_chunk_tokens == ServerConfig::kAutoPrefillChunkTokens) {
    const bool cuda = config_.backend == "cuda" || (config_.backend == "auto" && cuda_backend_available());
    config_.prefill_chunk_tokens = resolve_prefill_chunk_tokens(config_.prefill_chunk_tokens, cuda);
    logger_->info("prefill_chunk_tokens auto: {} (for the {} backend)", config_.prefill_chunk_tokens,
                  cuda ? "cuda" : "cpu");
  }
  if (config_.prefill_chunk_tokens > 0) {
    engine_options.max_prefill_tokens = std::max(config_.prefill_chunk_tokens, config_.prefill_alone_tokens);
  }
  if (vocab_) engine_options.sampling_masks = sampling_masks_for(*vocab_);
  parse_state_dtype(config_.state_dtype, &engine_options.state_dtype);
  if (config_.max_batch == 0) {
    const MaxBatchChoice choice = choose_auto_max_batch(config_.backend, weights_->config(), engine_options);
    logger_->info("max_batch auto: {} ({})", choice.max_batch, choice.reason);
    config_.max_batch = engine_options.max_slots = choice.max_batch;
  }
  engine_ = make_engine(config_.backend, *weights_, engine_options);
  const ModelConfig& mc = engine_->config();
  logger_->info("model {}: {} layers, d_model {}, vocab {}, {} parameters; backend {} with {} slots",
                model_dir.string(), mc.n_layer, mc.d_model, mc.vocab_size, mc.parameter_count(),
                engine_->backend(), engine_->max_slots());
  if (engine_->backend() == "cuda") logger_->info("cuda policy: {}", to_string(config_.cuda));
  if (config_.prefill_chunk_tokens > 0 && !engine_->has_prefill_path()) {
    logger_->info("prompts are read one decode step per token: the {} engine has no prefill path "
                  "(prefill_chunk_tokens applies to engines that do)", engine_->backend());
  }
  if (const std::string report = engine_->load_report(); !report.empty()) {
    logger_->info("engine step variants measured at load: {}", report);
  }

  // --tokenizer, else the model directory's own (vocab.json's text.tokenizer).
  std::filesystem::path tokenizer_path = config_.tokenizer;
  if (tokenizer_path.empty() && vocab_ && vocab_->text) tokenizer_path = vocab_->text->tokenizer;
  if (!tokenizer_path.empty()) {
    tokenizer_ = Tokenizer::load(tokenizer_path);
    if (tokenizer_->vocab_size() > mc.vocab_size) {
      logger_->warn("tokenizer {} has {} pieces but the model's vocabulary has {}: text that "
                    "encodes to larger ids is refused",
                    tokenizer_path.string(), tokenizer_->vocab_size(), mc.vocab_size);
    }
    if (vocab_ && vocab_->text && tokenizer_->vocab_size() != vocab_->text->size) {
      throw std::runtime_error((model_dir / "vocab.json").string() + ": text.size " +
                               std::to_string(vocab_->text->size) + " but the tokenizer " + tokenizer_path.string() +
                               " has " + std::to_string(tokenizer_->vocab_size()) + " pieces");
    }
  }

  if (!config_.api_keys.empty()) api_keys_ = std::make_unique<ApiKeys>(config_.api_keys);
  if (!config_.tls_cert.empty())
    tls_ = std::make_unique<TlsFiles>(config_.tls_cert, config_.tls_key, config_.tls_client_ca);
  ServerMetrics::BasicAuth metrics_auth;
  if (!config_.metrics_auth.empty()) {
    metrics_users_ = std::make_unique<ApiKeys>(config_.metrics_auth, "metrics_auth");
    metrics_auth = [users = metrics_users_.get()](const std::string& user, const std::string& password) {
      return users->accepts(user + ":" + password);
    };
  }
  metrics_ = std::make_unique<ServerMetrics>(config_.metrics_listen, std::move(metrics_auth));
  request_log_ = std::make_unique<RequestLog>(logger_);
  library_log_route_ = std::make_unique<LibraryLogRoute>(*request_log_);
  SchedulerOptions scheduler_options;
  scheduler_options.queue_capacity = config_.queue_capacity;
  scheduler_options.pipelined = config_.pipelined_steps;
  scheduler_options.prefill_chunk_tokens = config_.prefill_chunk_tokens;
  scheduler_options.prefill_alone_tokens = config_.prefill_alone_tokens;
  scheduler_options.prefill_min_tokens = config_.prefill_min_tokens;
  scheduler_options.session_idle_timeout = from_seconds(config_.session_idle_timeout_s);
  scheduler_options.on_engine_unusable = [this](const std::string&) { report_not_serving(); };
  stalled_streams_ = std::make_unique<StalledStreams>();
  scheduler_options.stalled_streams = stalled_streams_.get();
  scheduler_options.session_swap_after = from_seconds(config_.session_swap_after_s);
  scheduler_options.max_sessions = config_.max_sessions;
  session_metrics_ = std::make_unique<SessionMetrics>(metrics_->registry());
  scheduler_options.session_metrics = session_metrics_.get();
  if (config_.prefix_cache) {
    try {
      engine_->slot_state_bytes();
      prefix_cache_ = std::make_unique<PrefixStateCache>(static_cast<uint64_t>(config_.prefix_cache_capacity_bytes),
                                                         config_.prefix_cache_interval);
      scheduler_options.prefix_cache = prefix_cache_.get();
    } catch (const std::exception& e) {
      logger_->warn("prefix_cache is on but this engine cannot copy its state ({}): serving without it", e.what());
    }
  }
  scheduler_ = std::make_unique<Scheduler>(*engine_, scheduler_options, metrics_.get(), logger_);

  context_ = std::make_unique<ServiceContext>(static_cast<size_t>(config_.max_batch + config_.queue_capacity));
  context_->scheduler = scheduler_.get();
  context_->metrics = metrics_.get();
  context_->log = request_log_.get();
  context_->tokenizer = tokenizer_.get();
  context_->api_keys = api_keys_.get();
  context_->limits.vocab_size = mc.vocab_size;
  context_->limits.max_new_tokens_limit = config_.max_new_tokens_limit;
  context_->limits.max_prompt_tokens = config_.max_prompt_tokens;
  context_->limits.has_tokenizer = tokenizer_ != nullptr;
  context_->vocab = vocab_.get();
  resolve_allowed_tokens(vocab_.get(), engine_options.sampling_masks, engine_->sampling_mask_count(),
                         std::string(engine_->backend()), context_.get());
  if (vocab_) {
    context_->end_of_turn_id = vocab_->control_id("end_of_turn");
    context_->end_of_reply_id = vocab_->control_id("end_of_reply");
  }
  context_->stream_buffer_tokens = static_cast<size_t>(config_.stream_buffer_tokens);
  v1::ModelInfo& info = context_->model_info;
  info.set_model_name(demo_model_ ? "demo-tiny (random weights)" : model_dir.filename().string());
  info.set_backend(std::string(engine_->backend()));
  info.set_weight_dtype(engine_->backend() == "cpu" ? "fp32" : config_.weight_dtype);
  info.set_n_layer(mc.n_layer);
  info.set_d_model(mc.d_model);
  info.set_vocab_size(mc.vocab_size);
  info.set_padded_vocab_size(mc.padded_vocab());
  info.set_d_state(mc.ssm.d_state);
  info.set_headdim(mc.ssm.headdim);
  info.set_mimo_rank(mc.ssm.mimo_rank);
  info.set_max_batch(engine_->max_slots());
  info.set_has_tokenizer(tokenizer_ != nullptr);
  info.set_demo_model(demo_model_);
  if (vocab_) fill_vocab_info(*vocab_, info.mutable_vocab());
  start_snapshots();
  service_ = std::make_unique<M3ServeService>(*context_);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC binds with SO_REUSEPORT by default on Linux: a second server on the same port
  // would start without error and take half of the new connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // A request of max_prompt_tokens ids (at most 5 bytes each) or of the text the server
  // takes for them (kMaxTextBytesPerToken each) fits, whatever the setting (gRPC's default
  // of 4 MiB holds about 800,000 ids; a larger message is refused by gRPC with
  // RESOURCE_EXHAUSTED before the service sees it).
  const int64_t per_token = std::max<int64_t>(5, kMaxTextBytesPerToken);
  const int64_t max_message = std::max<int64_t>(4 << 20, per_token * config_.max_prompt_tokens + (64 << 10));
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(max_message, INT32_MAX)));
  // The health-only plaintext port first: when it cannot listen, nothing has started.
  if (!config_.health_listen.empty()) {
    grpc::ServerBuilder health_builder;
    health_builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    health_builder.SetOption(std::make_unique<WithoutReflection>());
    health_only_service_ = std::make_unique<NothingButHealth>();
    health_builder.RegisterCallbackGenericService(health_only_service_.get());
    health_builder.AddListeningPort(config_.health_listen, grpc::InsecureServerCredentials(), &health_port_);
    health_server_ = health_builder.BuildAndStart();
    if (!health_server_ || health_port_ == 0)
      throw std::runtime_error("cannot listen for health checks on " + config_.health_listen +
                               " (health_listen: address in use, or not an address of this machine?)");
  }
  if (api_keys_) builder.SetOption(std::make_unique<WithoutReflection>());
  builder.AddListeningPort(config_.listen, tls_ ? tls_->credentials() : grpc::InsecureServerCredentials(), &port_);
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0)
    throw std::runtime_error("cannot listen for gRPC on " + config_.listen +
                             " (address in use, or not an address of this machine?)");
  // By service name too: probes that name it (grpc_health_probe -service, Kubernetes)
  // got NOT_FOUND. SetServingStatus(bool) in set_serving covers every name set.
  for (grpc::Server* s : {server_.get(), health_server_.get()})
    if (s) s->GetHealthCheckService()->SetServingStatus(v1::M3Serve::service_full_name(), true);
  set_serving(true);
  if (health_server_)
    logger_->info("health checks (grpc.health.v1 only, plaintext) on {}:{}",
                  config_.health_listen.substr(0, config_.health_listen.rfind(':')), health_port_);
  logger_->info("serving m3serve.v1.M3Serve on {} ({}; {}) (metrics: {}{})", address(),
                !tls_ ? "plaintext, no TLS" : tls_->mutual() ? "mutual TLS" : "TLS",
                api_keys_ ? fmt::format("{} API keys", api_keys_->size()) : std::string("no API key needed"),
                config_.metrics_listen.empty()
                    ? std::string("off")
                    : "http://" + config_.metrics_listen.substr(0, config_.metrics_listen.rfind(':')) +
                          ":" + std::to_string(metrics_->exposer_port()) + "/metrics",
                metrics_users_ ? ", basic auth" : "");
  // Last: nothing after it may throw (a joinable thread's destructor would terminate).
  stream_sweeper_ = std::thread([this] { sweep_streams(); });
}

ServerApp::~ServerApp() { shutdown(std::chrono::seconds(0)); }

void ServerApp::start_snapshots() {
  std::string unsupported;
  uint64_t state_bytes = 0;
  try {
    state_bytes = engine_->slot_state_bytes();
  } catch (const std::exception& e) {
    unsupported = e.what();
  }
  const auto t0 = Clock::now();
  ModelFingerprint fingerprint =
      fingerprint_model(*weights_, context_->model_info.weight_dtype(), engine_->backend(), state_bytes);
  snapshot_metrics_ = std::make_unique<SnapshotMetrics>(metrics_->registry());
  auto store = std::make_unique<SnapshotStore>(
      make_snapshot_backend(config_.snapshot_store), static_cast<uint64_t>(config_.snapshot_capacity_bytes),
      std::chrono::milliseconds(static_cast<int64_t>(config_.snapshot_ttl_s * 1000.0)), snapshot_metrics_.get());
  logger_->info("snapshots: store {} ({} snapshots already there), model fingerprint [{}] (hashed in {:.0f} ms){}",
                store->describe(), store->count(), fingerprint.to_string(),
                std::chrono::duration<double, std::milli>(Clock::now() - t0).count(),
                unsupported.empty() ? "" : "; refused on this engine: " + unsupported);
  snapshots_ = std::make_unique<SnapshotService>(std::move(store), std::move(fingerprint), unsupported);
  context_->snapshots = snapshots_.get();
}

void ServerApp::sweep_streams() {
  using Duration = Clock::duration;
  const Duration idle = from_seconds(config_.session_idle_timeout_s);  // zero: never
  const Duration stall = from_seconds(config_.stalled_stream_timeout_s);
  // A stream is ended within about a quarter of its timeout after it ran out.
  Duration period = stall / 4;
  if (idle > Duration::zero()) period = std::min(period, idle / 4);
  period = std::clamp<Duration>(period, std::chrono::milliseconds(1), std::chrono::seconds(1));
  // (%g, as the scheduler words an idle session's end.)
  const std::string idle_message = fmt::format(
      "no message within {:g} s of opening the stream (the server's session_idle_timeout_s); the stream was ended",
      config_.session_idle_timeout_s);
  std::unique_lock lock(sweep_mu_);
  while (!sweep_cv_.wait_for(lock, period, [this] { return sweep_stop_; })) {
    lock.unlock();
    const auto now = Clock::now();
    if (idle > Duration::zero())
      context_->unstarted_sessions.end_idle(now - idle, StreamStatus::kDeadlineExceeded, idle_message);
    if (const size_t cut = stalled_streams_->cut(now, stall); cut > 0)
      logger_->warn("cancelled {} streams whose clients read nothing for {:.1f}s after the server ended them "
                    "(stalled_stream_timeout_s)", cut, config_.stalled_stream_timeout_s);
    lock.lock();
  }
}

void ServerApp::begin_drain() {
  {
    std::lock_guard lock(health_mu_);
    if (draining_ || health_final_) return;
    draining_ = true;
    set_serving(false);
  }
  logger_->info("draining: health reports NOT_SERVING for {:g}s (drain_delay_s) while requests are still served",
                config_.drain_delay_s);
}

bool ServerApp::reload() {
  bool ok = true;
  const auto attempt = [&](const char* what, auto&& load) {
    try {
      load();
    } catch (const std::exception& e) {
      ok = false;
      logger_->error("SIGHUP: {} not reloaded, the old ones stay in force: {}", what, e.what());
    }
  };
  if (api_keys_) attempt("API keys", [&] { logger_->info("SIGHUP: {} API keys from {}", api_keys_->reload(), config_.api_keys); });
  if (metrics_users_)
    attempt("metrics_auth users",
            [&] { logger_->info("SIGHUP: {} metrics_auth users from {}", metrics_users_->reload(), config_.metrics_auth); });
  if (tls_)
    attempt("TLS certificates", [&] {
      tls_->reload();
      logger_->info("SIGHUP: TLS certificate {} and key re-read; new connections use them", config_.tls_cert);
    });
  if (!api_keys_ && !metrics_users_ && !tls_) logger_->info("SIGHUP: no API keys, metrics_auth or TLS files to re-read");
  return ok;
}

void ServerApp::set_serving(bool serving) {
  server_->GetHealthCheckService()->SetServingStatus(serving);
  if (health_server_) health_server_->GetHealthCheckService()->SetServingStatus(serving);
}

void ServerApp::report_not_serving() {
  std::lock_guard lock(health_mu_);
  if (server_ && !health_final_) set_serving(false);
}

size_t ServerApp::sessions_not_started() const { return context_->unstarted_sessions.size(); }

std::string ServerApp::address() const {
  return config_.listen.substr(0, config_.listen.rfind(':')) + ":" + std::to_string(port_);
}

void ServerApp::shutdown(std::chrono::duration<double> grace) {
  if (stopped_) return;
  stopped_ = true;
  {
    std::lock_guard lock(health_mu_);
    set_serving(false);
    health_final_ = true;
  }
  scheduler_->stop_accepting();
  // Converse streams that have sent nothing are not the scheduler's: end them now, as
  // sessions are ended (they have nothing to finish, and a first message would be refused).
  if (const size_t unstarted = context_->unstarted_sessions.end_all(StreamStatus::kUnavailable,
                                                                    kShuttingDownMessage);
      unstarted > 0)
    logger_->info("shutting down: ended {} Converse streams that had started no session",
                  unstarted);
  const auto grace_steady = std::chrono::duration_cast<std::chrono::steady_clock::duration>(grace);
  const auto deadline = std::chrono::steady_clock::now() + grace_steady;
  // gRPC stops listening at once and waits for the streams (we end them below).
  std::thread stop_listening([&] {
    server_->Shutdown(std::chrono::system_clock::now() + grace_steady + std::chrono::seconds(5));
  });
  const int running = scheduler_->in_flight();
  if (running > 0)
    logger_->info("shutting down: {} streams in flight, {:.1f}s to finish", running, grace.count());
  if (!scheduler_->wait_until_idle(deadline)) {
    logger_->warn("shutting down: cancelling {} streams still running after the grace period",
                  scheduler_->in_flight());
  }
  scheduler_->cancel_all();
  stop_listening.join();
  server_->Wait();
  if (health_server_) {  // (last: probes saw NOT_SERVING until the end)
    health_server_->Shutdown(std::chrono::system_clock::now());
    health_server_->Wait();
  }
  if (stream_sweeper_.joinable()) {  // (it cut stalled streams while gRPC waited for them)
    {
      std::lock_guard lock(sweep_mu_);
      sweep_stop_ = true;
    }
    sweep_cv_.notify_all();
    stream_sweeper_.join();
  }
  logger_->info("server stopped");
}

}  // namespace m3
