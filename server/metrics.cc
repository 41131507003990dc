#include "server/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <thread>

namespace m3 {
namespace {

// Doubling bucket bounds from `first` seconds: a decode step takes tens of microseconds
// on a GPU and milliseconds on a CPU, a request up to minutes; doubling keeps the
// quantile error under 2x everywhere with ~20 series per histogram.
prometheus::Histogram::BucketBoundaries doubling_buckets(double first, int count) {
  prometheus::Histogram::BucketBoundaries bounds;
  bounds.reserve(count);
  for (int i = 0; i < count; ++i) bounds.push_back(first * std::ldexp(1.0, i));
  return bounds;
}

// A local address that reaches a listener bound to `host` (wildcards: loopback).
std::string reachable_host(std::string host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

// Opens and at once closes one TCP connection to host:port; failures are ignored.
void connect_once(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
    if (connected) break;
  }
  freeaddrinfo(found);
}

prometheus::Histogram& add_histogram(prometheus::Registry& registry, const std::string& name,
                                     const std::string& help,
                                     const prometheus::Histogram::BucketBoundaries& bounds) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add({}, bounds);
}

}  // namespace

ServerMetrics::ServerMetrics(const std::string& bind_address, BasicAuth basic_auth)
    : registry_(std::make_shared<prometheus::Registry>()) {
  auto& registry = *registry_;
  // 50 us .. ~13 s.
  const auto token_buckets = doubling_buckets(50e-6, 19);
  // 1 ms .. ~262 s.
  const auto request_buckets = doubling_buckets(1e-3, 19);

  time_to_first_token_ = &add_histogram(
      registry, "m3serve_time_to_first_token_seconds",
      "From a request's (or Converse turn's) arrival to its first generated token: queueing "
      "and prefill",
      token_buckets);
  inter_token_latency_ = &add_histogram(
      registry, "m3serve_inter_token_latency_seconds",
      "Time between consecutive generated tokens of one stream", token_buckets);
  request_duration_ = &add_histogram(registry, "m3serve_request_duration_seconds",
                                     "From a call's arrival to its end (a Converse session: all its turns)",
                                     request_buckets);

  tokens_generated_ = &prometheus::BuildCounter()
                           .Name("m3serve_tokens_generated_total")
                           .Help("Tokens generated and sent to clients")
                           .Register(registry)
                           .Add({});
  graph_replays_ = &prometheus::BuildCounter()
                        .Name("m3serve_graph_replays_total")
                        .Help("CUDA graph launches of the decode step (0 on the CPU backend)")
                        .Register(registry)
                        .Add({});
  prefill_tokens_ = &prometheus::BuildCounter()
                         .Name("m3serve_prefill_tokens_total")
                         .Help("Prompt and Converse input tokens read by prefill (in chunks between decode steps)")
                         .Register(registry)
                         .Add({});
  prefill_duration_ = &add_histogram(registry, "m3serve_prefill_seconds",
                                     "Duration of one prefill chunk (all the prompts read in one scheduler "
                                     "iteration)",
                                     token_buckets);
  auto& requests = prometheus::BuildCounter()
                       .Name("m3serve_requests_total")
                       .Help("Finished calls (Generate requests and Converse sessions) by final status")
                       .Register(registry);
  for (size_t i = 0; i < kRequestStatuses.size(); ++i) {
    requests_by_status_[i] = &requests.Add({{"status", std::string(kRequestStatuses[i])}});
  }

  active_sequences_ = &prometheus::BuildGauge()
                           .Name("m3serve_active_sequences")
                           .Help("Sequences holding an engine slot")
                           .Register(registry)
                           .Add({});
  queue_depth_ = &prometheus::BuildGauge()
                      .Name("m3serve_queue_depth")
                      .Help("Requests waiting for a free slot")
                      .Register(registry)
                      .Add({});
  batch_size_ = &prometheus::BuildGauge()
                     .Name("m3serve_batch_size")
                     .Help("Slots fed in the latest engine step")
                     .Register(registry)
                     .Add({});

  if (!bind_address.empty()) {
    try {
      exposer_ = std::make_unique<prometheus::Exposer>(bind_address);
    } catch (const std::exception& e) {
      throw std::runtime_error("metrics: cannot serve /metrics on " + bind_address + ": " +
                               e.what());
    }
    if (basic_auth) exposer_->RegisterAuth(std::move(basic_auth), "m3serve metrics");
    exposer_->RegisterCollectable(registry_);
    exposer_host_ = reachable_host(bind_address.substr(0, bind_address.rfind(':')));
  }
}

// The exposer's web server (civetweb) sees its stop flag only when the poll on its
// listening socket returns, at the latest every 2 s: stopping it took 0-2 s (strace), the
// rest of m3serve's shutdown 16 ms. A connection ends that poll at once, so connections
// are opened until the exposer is gone.
ServerMetrics::~ServerMetrics() {
  if (!exposer_) return;
  const int port = exposer_port();
  std::atomic<bool> gone{false};
  std::thread waker([&] {
    while (!gone.load()) {
      connect_once(exposer_host_, port);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  exposer_.reset();
  gone = true;
  waker.join();
}

void ServerMetrics::observe_time_to_first_token(double seconds) {
  time_to_first_token_->Observe(seconds);
}
void ServerMetrics::observe_inter_token_latency(double seconds) {
  inter_token_latency_->Observe(seconds);
}
void ServerMetrics::observe_request_duration(double seconds) { request_duration_->Observe(seconds); }

void ServerMetrics::add_tokens_generated(uint64_t n) {
  tokens_generated_->Increment(static_cast<double>(n));
}

void ServerMetrics::count_request(std::string_view final_status) {
  size_t index = kRequestStatuses.size() - 1;  // "unknown"
  for (size_t i = 0; i < kRequestStatuses.size(); ++i) {
    if (kRequestStatuses[i] == final_status) {
      index = i;
      break;
    }
  }
  requests_by_status_[index]->Increment();
}

void ServerMetrics::observe_prefill(uint64_t tokens, double seconds) {
  prefill_tokens_->Increment(static_cast<double>(tokens));
  prefill_duration_->Observe(seconds);
}

void ServerMetrics::add_graph_replays(uint64_t n) {
  graph_replays_->Increment(static_cast<double>(n));
}

void ServerMetrics::set_active_sequences(int n) { active_sequences_->Set(n); }
void ServerMetrics::set_queue_depth(int n) { queue_depth_->Set(n); }
void ServerMetrics::set_batch_size(int n) { batch_size_->Set(n); }

std::string ServerMetrics::serialize() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

int ServerMetrics::exposer_port() const {
  if (!exposer_) return 0;
  const auto ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

}  // namespace m3
