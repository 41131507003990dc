#include "server/metrics.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <set>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>

#include "server/session_metrics.h"
#include "server/snapshot_metrics.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

// The value of the sample line `series` (name plus labels exactly as exposed), or NaN.
double sample(const std::string& exposition, const std::string& series) {
  std::istringstream lines(exposition);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return std::nan("");
}

std::string http_get(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket failed");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    throw std::runtime_error("cannot connect to 127.0.0.1:" + std::to_string(port));
  }
  const std::string request = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    throw std::runtime_error("short write");
  }
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
  close(fd);
  return response;
}

TEST(ServerMetrics, CountsAddUp) {
  ServerMetrics metrics("");
  EXPECT_EQ(metrics.exposer_port(), 0);
  for (int i = 0; i < 5; ++i) metrics.count_request("ok");
  metrics.count_request("cancelled");
  metrics.count_request("resource_exhausted");
  metrics.count_request("resource_exhausted");
  metrics.count_request("no_such_status");
  metrics.add_tokens_generated(30);
  metrics.add_tokens_generated(12);
  metrics.add_graph_replays(7);
  metrics.set_active_sequences(3);
  metrics.set_queue_depth(2);
  metrics.set_batch_size(4);
  metrics.set_batch_size(5);  // a gauge: the latest value

  const std::string text = metrics.serialize();
  EXPECT_EQ(sample(text, "m3serve_requests_total{status=\"ok\"}"), 5);
  EXPECT_EQ(sample(text, "m3serve_requests_total{status=\"cancelled\"}"), 1);
  EXPECT_EQ(sample(text, "m3serve_requests_total{status=\"resource_exhausted\"}"), 2);
  EXPECT_EQ(sample(text, "m3serve_requests_total{status=\"unknown\"}"), 1);
  EXPECT_EQ(sample(text, "m3serve_requests_total{status=\"internal\"}"), 0);
  EXPECT_EQ(sample(text, "m3serve_tokens_generated_total"), 42);
  EXPECT_EQ(sample(text, "m3serve_graph_replays_total"), 7);
  EXPECT_EQ(sample(text, "m3serve_active_sequences"), 3);
  EXPECT_EQ(sample(text, "m3serve_queue_depth"), 2);
  EXPECT_EQ(sample(text, "m3serve_batch_size"), 5);
}

TEST(ServerMetrics, EveryStatusIsExposedBeforeItIsCounted) {
  ServerMetrics metrics("");
  const std::string text = metrics.serialize();
  // Every status a stream can end with (stream_status_name), written out here rather than
  // read from the list under test.
  for (const char* status : {"ok", "cancelled", "invalid_argument", "resource_exhausted", "deadline_exceeded",
                             "internal", "unavailable"}) {
    EXPECT_EQ(sample(text, "m3serve_requests_total{status=\"" + std::string(status) + "\"}"), 0)
        << status;
  }
}

TEST(ServerMetrics, HistogramsBucketLatenciesFromMicrosecondsToSeconds) {
  ServerMetrics metrics("");
  metrics.observe_inter_token_latency(60e-6);   // a GPU step
  metrics.observe_inter_token_latency(0.004);   // a CPU step
  metrics.observe_inter_token_latency(2.0);     // a stall
  metrics.observe_time_to_first_token(0.020);
  metrics.observe_request_duration(1.5);
  metrics.observe_request_duration(30.0);

  const std::string text = metrics.serialize();
  const std::string itl = "m3serve_inter_token_latency_seconds";
  EXPECT_EQ(sample(text, itl + "_count"), 3);
  EXPECT_NEAR(sample(text, itl + "_sum"), 2.00406, 1e-9);
  EXPECT_EQ(sample(text, itl + "_bucket{le=\"5e-05\"}"), 0);
  EXPECT_EQ(sample(text, itl + "_bucket{le=\"0.0001\"}"), 1);
  EXPECT_EQ(sample(text, itl + "_bucket{le=\"0.0064\"}"), 2);
  EXPECT_EQ(sample(text, itl + "_bucket{le=\"+Inf\"}"), 3);
  EXPECT_EQ(sample(text, "m3serve_time_to_first_token_seconds_count"), 1);
  EXPECT_EQ(sample(text, "m3serve_request_duration_seconds_count"), 2);
  EXPECT_EQ(sample(text, "m3serve_request_duration_seconds_bucket{le=\"1.024\"}"), 0);
  EXPECT_EQ(sample(text, "m3serve_request_duration_seconds_bucket{le=\"32.768\"}"), 2);

  // Enough buckets between 50 us and 10 s to tell a step from a stall.
  std::regex bucket(itl + "_bucket\\{le=\"([0-9.e+-]+)\"\\}");
  int finite_buckets = 0;
  double largest = 0;
  for (std::sregex_iterator it(text.begin(), text.end(), bucket), end; it != end; ++it) {
    ++finite_buckets;
    largest = std::max(largest, std::stod((*it)[1]));
  }
  EXPECT_GE(finite_buckets, 15);
  EXPECT_GE(largest, 10.0);
}

TEST(ServerMetrics, ScrapeOverHttpReturnsTheSeries) {
  ServerMetrics metrics("127.0.0.1:0");
  const int port = metrics.exposer_port();
  ASSERT_GT(port, 0);
  metrics.count_request("ok");
  metrics.count_request("ok");
  metrics.count_request("invalid_argument");
  metrics.add_tokens_generated(17);
  metrics.observe_time_to_first_token(0.003);

  const std::string response = http_get(port, "/metrics");
  ASSERT_EQ(response.rfind("HTTP/1.1 200", 0), 0u) << response.substr(0, 200);
  const std::string body = response.substr(response.find("\r\n\r\n") + 4);
  EXPECT_EQ(sample(body, "m3serve_requests_total{status=\"ok\"}"), 2);
  EXPECT_EQ(sample(body, "m3serve_requests_total{status=\"invalid_argument\"}"), 1);
  EXPECT_EQ(sample(body, "m3serve_tokens_generated_total"), 17);
  EXPECT_EQ(sample(body, "m3serve_time_to_first_token_seconds_count"), 1);
  EXPECT_NE(body.find("# TYPE m3serve_inter_token_latency_seconds histogram"), std::string::npos);
  EXPECT_NE(body.find("# TYPE m3serve_active_sequences gauge"), std::string::npos);
}

TEST(ServerMetrics, AnAddressInUseIsReportedWithTheAddress) {
  ServerMetrics first("127.0.0.1:0");
  const std::string taken = "127.0.0.1:" + std::to_string(first.exposer_port());
  const std::string msg = test::error_of([&] { ServerMetrics second(taken); });
  EXPECT_NE(msg.find("metrics: cannot serve /metrics on " + taken), std::string::npos) << msg;
}

// The dashboard charts exactly the series the server exports: every m3serve_* name it
// queries exists, and every exported family is charted.
TEST(ServerMetrics, TheGrafanaDashboardUsesTheExportedSeries) {
  std::ifstream file(M3_TEST_DASHBOARD);
  ASSERT_TRUE(file) << M3_TEST_DASHBOARD;
  const std::string dashboard(std::istreambuf_iterator<char>(file), {});
  ServerMetrics metrics("");
  const SessionMetrics sessions(metrics.registry());
  const SnapshotMetrics snapshots(metrics.registry());
  const std::string exposition = metrics.serialize();

  std::set<std::string> exported;
  const std::regex type_line("# TYPE (m3serve_[a-z_]+) ");
  for (std::sregex_iterator it(exposition.begin(), exposition.end(), type_line), end; it != end; ++it) {
    exported.insert((*it)[1]);
  }
  EXPECT_EQ(exported.size(), 11u + 6u + 6u);  // the server's, the sessions', the snapshots'

  std::set<std::string> charted;
  const std::regex name("m3serve_[a-z_]+");
  for (std::sregex_iterator it(dashboard.begin(), dashboard.end(), name), end; it != end; ++it) {
    std::string series = it->str();
    for (const std::string suffix : {"_bucket", "_sum", "_count"}) {
      if (series.size() > suffix.size() && series.ends_with(suffix) &&
          exported.count(series.substr(0, series.size() - suffix.size()))) {
        series.resize(series.size() - suffix.size());
      }
    }
    EXPECT_TRUE(exported.count(series)) << "the dashboard queries " << series << ", not exported";
    charted.insert(series);
  }
  for (const auto& family : exported) EXPECT_TRUE(charted.count(family)) << family << " not charted";
}

}  // namespace
}  // namespace m3
