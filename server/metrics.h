// The server's Prometheus metrics: what an operator watches (latency, throughput,
// errors, load). Served as text on `/metrics` by an HTTP exposer on its own port.
//
// All methods are thread-safe and allocation-free after construction; the label values
// of m3serve_requests_total are created up front.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace prometheus {
class Counter;
class Exposer;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace m3 {

class ServerMetrics {
 public:
  // The final statuses count_request() knows; any other string counts as "unknown".
  static constexpr std::array<std::string_view, 13> kRequestStatuses = {
      "ok",          "cancelled",   "invalid_argument", "resource_exhausted",  "deadline_exceeded",
      "internal",    "unavailable", "not_found",        "failed_precondition", "data_loss",
      "unimplemented", "unauthenticated", "unknown"};

  // bind_address: "host:port" for the /metrics exposer (port 0: any free port), or "" for
  // none. Throws std::runtime_error when it cannot listen there. basic_auth: when set,
  // /metrics answers only requests whose HTTP basic auth it accepts (user, password).
  using BasicAuth = std::function<bool(const std::string& user, const std::string& password)>;
  explicit ServerMetrics(const std::string& bind_address, BasicAuth basic_auth = nullptr);
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  void observe_time_to_first_token(double seconds);
  void observe_inter_token_latency(double seconds);
  void observe_request_duration(double seconds);

  // Tokens written to clients' streams (what they receive; not tokens a stream dropped).
  void add_tokens_generated(uint64_t n);
  void count_request(std::string_view final_status);
  void add_graph_replays(uint64_t n);
  // Prompt tokens read by one Engine::prefill() call, and how long the call took.
  void observe_prefill(uint64_t tokens, double seconds);

  void set_active_sequences(int n);
  void set_queue_depth(int n);
  void set_batch_size(int n);

  // Everything in the Prometheus text exposition format (what /metrics returns).
  std::string serialize() const;

  // The port the exposer listens on (the real one when 0 was asked); 0 without one.
  int exposer_port() const;

  // Where other parts register their series (the snapshot store's).
  prometheus::Registry& registry() { return *registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Histogram* time_to_first_token_;
  prometheus::Histogram* inter_token_latency_;
  prometheus::Histogram* request_duration_;
  prometheus::Counter* tokens_generated_;
  prometheus::Counter* graph_replays_;
  prometheus::Counter* prefill_tokens_;
  prometheus::Histogram* prefill_duration_;
  std::array<prometheus::Counter*, kRequestStatuses.size()> requests_by_status_;
  prometheus::Gauge* active_sequences_;
  prometheus::Gauge* queue_depth_;
  prometheus::Gauge* batch_size_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string exposer_host_;  // where the destructor connects to wake the exposer
};

}  // namespace m3
