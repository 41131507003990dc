#include "server/server_app.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <thread>

#include "model/engine.h"
#include "model/slot_budget.h"
#include "model/tokenizer.h"
#include "model/vocab_layout.h"
#include "model/weights.h"
#include "server/demo_model.h"
#include "server/library_logs.h"
#include "server/m3serve_service.h"
#include "server/metrics.h"
#include "server/request_log.h"
#include "server/request_validation.h"
#include "server/scheduler.h"
#include "server/service_context.h"
#include "server/stalled_streams.h"
#include "server/vocab_serving.h"

namespace m3 {
namespace {

WeightDType weight_dtype_of(const std::string& name) {
  return name == "fp32" ? WeightDType::F32 : WeightDType::BF16;
}

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
  if (config_.prefill_chunk_tokens > 0) engine_options.max_prefill_tokens = config_.prefill_chunk_tokens;
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

  metrics_ = std::make_unique<ServerMetrics>(config_.metrics_listen);
  request_log_ = std::make_unique<RequestLog>(logger_);
  library_log_route_ = std::make_unique<LibraryLogRoute>(*request_log_);
  SchedulerOptions scheduler_options;
  scheduler_options.queue_capacity = config_.queue_capacity;
  scheduler_options.pipelined = config_.pipelined_steps;
  scheduler_options.prefill_chunk_tokens = config_.prefill_chunk_tokens;
  scheduler_options.session_idle_timeout = from_seconds(config_.session_idle_timeout_s);
  scheduler_options.on_engine_unusable = [this](const std::string&) { report_not_serving(); };
  stalled_streams_ = std::make_unique<StalledStreams>();
  scheduler_options.stalled_streams = stalled_streams_.get();
  scheduler_ = std::make_unique<Scheduler>(*engine_, scheduler_options, metrics_.get(), logger_);

  context_ = std::make_unique<ServiceContext>(static_cast<size_t>(config_.max_batch + config_.queue_capacity));
  context_->scheduler = scheduler_.get();
  context_->metrics = metrics_.get();
  context_->log = request_log_.get();
  context_->tokenizer = tokenizer_.get();
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
  builder.AddListeningPort(config_.listen, grpc::InsecureServerCredentials(), &port_);
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0)
    throw std::runtime_error("cannot listen for gRPC on " + config_.listen +
                             " (address in use, or not an address of this machine?)");
  // By service name too: probes that name it (grpc_health_probe -service, Kubernetes)
  // got NOT_FOUND. SetServingStatus(bool) below and in shutdown covers every name set.
  server_->GetHealthCheckService()->SetServingStatus(v1::M3Serve::service_full_name(), true);
  server_->GetHealthCheckService()->SetServingStatus(true);
  logger_->info("serving m3serve.v1.M3Serve on {} (metrics: {})", address(),
                config_.metrics_listen.empty()
                    ? std::string("off")
                    : "http://" + config_.metrics_listen.substr(0, config_.metrics_listen.rfind(':')) +
                          ":" + std::to_string(metrics_->exposer_port()) + "/metrics");
  // Last: nothing after it may throw (a joinable thread's destructor would terminate).
  stream_sweeper_ = std::thread([this] { sweep_streams(); });
}

ServerApp::~ServerApp() { shutdown(std::chrono::seconds(0)); }

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

void ServerApp::report_not_serving() {
  std::lock_guard lock(health_mu_);
  if (server_ && !health_final_) server_->GetHealthCheckService()->SetServingStatus(false);
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
    server_->GetHealthCheckService()->SetServingStatus(false);
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
