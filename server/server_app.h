// The whole server assembled from a ServerConfig: model (or the demo model), engine,
// tokenizer, metrics, scheduler and the gRPC server with health and reflection.
// m3serve's main() and the integration tests both run it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "server/server_config.h"

namespace grpc {
class CallbackGenericService;
class Server;
}
namespace spdlog {
class logger;
}

namespace m3 {

class Engine;
class ModelWeights;
class Tokenizer;
struct VocabLayout;
class ServerMetrics;
class Scheduler;
class StalledStreams;
class RequestLog;
class LibraryLogRoute;
class M3ServeService;
class PrefixStateCache;
class SessionMetrics;
class SnapshotMetrics;
class SnapshotService;
struct ServiceContext;
class ApiKeys;
class TlsFiles;

class ServerApp {
 public:
  // Loads everything and starts serving; throws std::runtime_error / std::invalid_argument
  // with context when something cannot start. logger: null = spdlog's default.
  explicit ServerApp(const ServerConfig& config, std::shared_ptr<spdlog::logger> logger = nullptr);
  ~ServerApp();  // shutdown(0) when still serving

  int port() const { return port_; }  // the bound gRPC port
  int health_port() const { return health_port_; }  // health_listen's bound port; 0: none
  std::string address() const;        // "host:port" as bound
  ServerMetrics& metrics() { return *metrics_; }
  const Engine& engine() const { return *engine_; }
  SnapshotService* snapshots() { return snapshots_.get(); }
  bool demo_model() const { return demo_model_; }
  // Converse streams open without a session yet (nothing sent); shutdown ends them at once.
  size_t sessions_not_started() const;

  // The first step of a drain (SIGTERM): the health service reports NOT_SERVING, so load
  // balancers stop sending new work, while calls are still accepted and served; shutdown()
  // follows after drain_delay_s. Idempotent.
  void begin_drain();
  // SIGHUP: re-reads the API keys, the metrics_auth users and the TLS files. Each that
  // cannot be used is logged and left as it was; returns false when any failed.
  bool reload();

  // Stops accepting; in-flight streams get `grace` to finish, then are cancelled
  // (Generate: Finished with reason CANCELLED; Converse: UNAVAILABLE). Idempotent.
  void shutdown(std::chrono::duration<double> grace);

 private:
  // Health NOT_SERVING for every name (the engine can run no more steps); on the engine
  // thread, so under health_mu_ against shutdown, after which server_ is not touched.
  void report_not_serving();
  // Every name's status on both servers (under health_mu_, or before serving starts).
  void set_serving(bool serving);
  // Its own thread, a few times a second at most: ends Converse streams that sent nothing
  // for session_idle_timeout_s (as the scheduler ends idle sessions; those streams are not
  // the scheduler's) and cancels the calls of stalled streams (StalledStreams).
  void sweep_streams();
  // The snapshot store and service (ServiceContext::snapshots).
  void start_snapshots();

  ServerConfig config_;
  std::shared_ptr<spdlog::logger> logger_;
  bool demo_model_ = false;
  std::unique_ptr<ModelWeights> weights_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<VocabLayout> vocab_;  // the model's vocab.json; null: ids only
  std::unique_ptr<ApiKeys> api_keys_;       // null: no key needed
  std::unique_ptr<ApiKeys> metrics_users_;  // metrics_auth's user:password lines; null: open
  std::unique_ptr<TlsFiles> tls_;           // null: plaintext gRPC
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<RequestLog> request_log_;
  // Protobuf's and gRPC's lines into request_log_ (rate-limited) until after server_ is gone.
  std::unique_ptr<LibraryLogRoute> library_log_route_;
  std::unique_ptr<StalledStreams> stalled_streams_;  // (outlives the scheduler, which fills it)
  std::unique_ptr<PrefixStateCache> prefix_cache_;   // (outlives the scheduler, which uses it)
  std::unique_ptr<SessionMetrics> session_metrics_;  // (likewise)
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<ServiceContext> context_;
  // Snapshots: after the scheduler and the context, which its worker's tasks use.
  std::unique_ptr<SnapshotMetrics> snapshot_metrics_;
  std::unique_ptr<SnapshotService> snapshots_;
  std::unique_ptr<M3ServeService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  // health_listen: a second, plaintext server with only the health service (for probes
  // that cannot speak TLS, such as the kubelet's); null: none.
  std::unique_ptr<grpc::CallbackGenericService> health_only_service_;
  std::unique_ptr<grpc::Server> health_server_;
  int health_port_ = 0;
  bool stopped_ = false;
  std::mutex health_mu_;
  bool health_final_ = false;  // shutdown set NOT_SERVING; nothing touches server_ after it
  bool draining_ = false;      // begin_drain ran (under health_mu_)
  std::mutex sweep_mu_;
  std::condition_variable sweep_cv_;
  bool sweep_stop_ = false;
  std::thread stream_sweeper_;
};

}  // namespace m3
