// A bounded soak over loopback: an m3serve child process serves a mix of clients for about
// 45 s (normal streams, clients that cancel, slow readers, malformed requests, bursts over
// capacity, calls out of time, Converse sessions), each client keeping count of the status
// every call ended with. Asserted: after a warm-up the server's resident memory and open
// file descriptors stop growing, and m3serve_requests_total counts exactly the calls the
// clients saw end, status by status.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <map>
#include <mutex>
#include <random>

#include "tests/server/m3serve_child.h"
#include "tests/server/security_test_support.h"
#include "tests/server/server_test_support.h"
#include "tests/server/status_labels.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;
using SteadyClock = std::chrono::steady_clock;

constexpr auto kWarmUp = 15s;  // (gRPC's and malloc's pools reach their size)
constexpr auto kWindow = 15s;  // two windows after the warm-up are compared

using test::status_label;

struct Sample {
  double rss_kib = 0;
  size_t fds = 0;
};

Sample sample(pid_t pid) {
  Sample s;
  std::istringstream status(read_text("/proc/" + std::to_string(pid) + "/status"));
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) s.rss_kib = std::stod(line.substr(6));
  if (DIR* dir = opendir(("/proc/" + std::to_string(pid) + "/fd").c_str())) {
    while (dirent* e = readdir(dir))
      if (e->d_name[0] != '.') ++s.fds;
    closedir(dir);
  }
  return s;
}

std::string http_get(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
    const std::string request = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
    }
  }
  close(fd);
  return response;
}

class Tallies {
 public:
  void add(grpc::StatusCode code) {
    std::lock_guard lock(mu_);
    ++by_status_[status_label(code)];
  }
  std::map<std::string, double> get() {
    std::lock_guard lock(mu_);
    return by_status_;
  }

 private:
  std::mutex mu_;
  std::map<std::string, double> by_status_;
};

const std::vector<int32_t> kPrompt = {17, 3, 250, 99, 4, 411};

TEST(SoakTest, MemoryAndDescriptorsStopGrowingAndEveryCallIsCounted) {
  TempDir dir("m3-soak");
  M3serveChild server(M3_TEST_M3SERVE,
                      {"--backend", "cpu", "--cpu-threads", "1", "--model", tiny_model_dir().string(), "--listen",
                       "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--max-batch", "4", "--queue-capacity", "4",
                       "--stream-buffer-tokens", "64", "--stalled-stream-timeout-s", "0.5",
                       "--session-idle-timeout-s", "2", "--max-new-tokens-limit", "1000000", "--drain-delay-s", "0",
                       "--shutdown-grace-s", "1"},
                      dir / "m3serve.log");
  ASSERT_TRUE(server.ok()) << server.log();
  ASSERT_GT(server.metrics_port(), 0) << server.log();
  const std::string target = server.address();
  Tallies tallies;
  std::atomic<bool> stop{false};
  const auto stub = [&] { return v1::M3Serve::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials())); };
  // Each client kind in its own thread, looping until the end; its own channel (a new
  // connection now and then too, so connections come and go).
  const auto client = [&](auto&& one_call) {
    return std::thread([&, one_call] {
      int calls = 0;
      auto s = stub();
      while (!stop.load()) {
        if (++calls % 25 == 0) s = stub();
        tallies.add(one_call(*s));
      }
    });
  };
  std::vector<std::thread> clients;
  // Normal: a short stream read to its end.
  clients.push_back(client([](v1::M3Serve::Stub& s) { return generate(s, generate_request(kPrompt, 16)).status.error_code(); }));
  // Cancelling: reads a little of a long stream, then cancels it.
  clients.push_back(client([](v1::M3Serve::Stub& s) {
    grpc::ClientContext ctx;
    auto reader = s.Generate(&ctx, generate_request(kPrompt, 1'000'000));
    v1::GenerateResponse response;
    if (reader->Read(&response)) ctx.TryCancel();  // (else the server ended it: over capacity)
    while (reader->Read(&response)) {
    }
    return reader->Finish().error_code();
  }));
  // Slow: reads a message every 20 ms; the server ends it for falling behind.
  clients.push_back(client([](v1::M3Serve::Stub& s) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 30s);
    auto reader = s.Generate(&ctx, generate_request(kPrompt, 1'000'000));
    v1::GenerateResponse response;
    while (reader->Read(&response)) std::this_thread::sleep_for(20ms);
    return reader->Finish().error_code();
  }));
  // Malformed: bytes protobuf cannot parse, and a request that breaks the rules.
  clients.push_back(client([&](v1::M3Serve::Stub& s) {
    static thread_local int n = 0;
    if (++n % 2 == 0) return generate(s, generate_request({}, 5)).status.error_code();
    grpc::GenericStub generic(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    grpc::Slice slice(std::string("\x1a\x05" "ab", 4));
    grpc::ByteBuffer request(&slice, 1), response;
    std::promise<grpc::Status> done;
    generic.UnaryCall(&ctx, "/m3serve.v1.M3Serve/Generate", grpc::StubOptions(), &request, &response,
                      [&done](grpc::Status status) { done.set_value(std::move(status)); });
    return done.get_future().get().error_code();
  }));
  // Over capacity: bursts of 8 more streams than slots and queue hold together.
  clients.push_back(std::thread([&] {
    auto s = stub();
    while (!stop.load()) {
      std::vector<std::future<grpc::StatusCode>> burst;
      for (int i = 0; i < 16; ++i)
        burst.push_back(std::async(std::launch::async, [&] {
          return generate(*s, generate_request(kPrompt, 64)).status.error_code();
        }));
      for (auto& f : burst) tallies.add(f.get());
    }
  }));
  // Out of time: a long stream with a short deadline.
  clients.push_back(client([](v1::M3Serve::Stub& s) {
    return generate(s, generate_request(kPrompt, 1'000'000), 100ms).status.error_code();
  }));
  // Sessions: two turns, then the client closes.
  clients.push_back(client([](v1::M3Serve::Stub& s) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 30s);
    auto session = s.Converse(&ctx);
    v1::ConverseResponse response;
    for (int turn = 0; turn < 2; ++turn) {
      v1::ConverseRequest input, end;
      input.mutable_input()->add_ids(5 + turn);
      end.mutable_end_turn()->set_max_new_tokens(8);
      if (!session->Write(input) || !session->Write(end)) break;
      while (session->Read(&response) && !response.has_turn_finished()) {
      }
    }
    session->WritesDone();
    while (session->Read(&response)) {
    }
    return session->Finish().error_code();
  }));

  // Samples once a second: warm-up, then two windows.
  std::vector<std::pair<SteadyClock::duration, Sample>> samples;
  const auto start = SteadyClock::now();
  while (SteadyClock::now() - start < kWarmUp + 2 * kWindow && !server.exited()) {
    std::this_thread::sleep_for(1s);
    samples.emplace_back(SteadyClock::now() - start, sample(server.pid()));
    if (std::getenv("M3_SOAK_TRACE")) std::cerr << samples.back().second.rss_kib << " KiB, " << samples.back().second.fds << " fds\n";
  }
  stop = true;
  for (auto& t : clients) t.join();
  ASSERT_FALSE(server.exited()) << server.log();

  Sample first_peak, second_peak;
  for (const auto& [when, s] : samples) {
    if (when < kWarmUp) continue;
    Sample& peak = when < kWarmUp + kWindow ? first_peak : second_peak;
    peak.rss_kib = std::max(peak.rss_kib, s.rss_kib);
    peak.fds = std::max(peak.fds, s.fds);
  }
  ASSERT_GT(first_peak.rss_kib, 0);
  // (Tens of thousands of calls a window: a leak of 150 bytes a call would show.)
  EXPECT_LE(second_peak.rss_kib, first_peak.rss_kib * 1.02 + 4096)
      << "RSS grew from " << first_peak.rss_kib << " KiB to " << second_peak.rss_kib << " KiB";
  EXPECT_LE(second_peak.fds, first_peak.fds + 2) << "open descriptors grew from " << first_peak.fds << " to "
                                                 << second_peak.fds;

  // Every call the clients saw end is counted once, under the status they saw. (A client
  // that cancels, or whose deadline passes, just as the server's status arrives sees its
  // own CANCELLED or DEADLINE_EXCEEDED where the server sent, and counted, another status:
  // those three may trade a few calls.)
  const auto seen = tallies.get();
  const auto seen_as = [&](const std::string& status) { return seen.count(status) ? seen.at(status) : 0.0; };
  double total = 0;
  for (const auto& [status, n] : seen) total += n;
  EXPECT_GT(total, 500) << "too few calls to call it a soak";
  for (const char* status : {"ok", "cancelled", "invalid_argument", "resource_exhausted", "deadline_exceeded"})
    EXPECT_GT(seen_as(status), 0) << "no call ended " << status;
  const std::vector<std::string> exact = {"ok", "invalid_argument", "internal", "unavailable", "unauthenticated", "unknown"};
  const std::vector<std::string> racing = {"cancelled", "deadline_exceeded", "resource_exhausted"};
  std::map<std::string, double> counted;
  const auto sum = [](const std::map<std::string, double>& by, const std::vector<std::string>& of, auto&& value) {
    double s = 0;
    for (const auto& status : of) s += value(status);
    return s;
  };
  const bool agree = eventually_true(
      [&] {
        const std::string metrics = http_get(server.metrics_port(), "/metrics");
        for (const auto& status : exact) counted[status] = prometheus_value(metrics, requests_series(status));
        for (const auto& status : racing) counted[status] = prometheus_value(metrics, requests_series(status));
        for (const auto& status : exact)
          if (counted[status] != seen_as(status)) return false;
        return sum(counted, racing, [&](const std::string& s) { return counted[s]; }) ==
               sum(seen, racing, seen_as);
      },
      10s);
  EXPECT_TRUE(agree);
  for (const auto& status : exact)
    EXPECT_EQ(counted[status], seen_as(status)) << "m3serve_requests_total{status=\"" << status << "\"}";
  EXPECT_EQ(sum(counted, racing, [&](const std::string& s) { return counted[s]; }), sum(seen, racing, seen_as))
      << "cancelled + deadline_exceeded + resource_exhausted";
  for (const auto& status : racing)
    EXPECT_NEAR(counted[status], seen_as(status), 0.01 * total + 5)
        << "m3serve_requests_total{status=\"" << status << "\"}: more than a few calls differ";
  std::cerr << "soak: " << total << " calls; RSS " << first_peak.rss_kib << " -> " << second_peak.rss_kib
            << " KiB; fds " << first_peak.fds << " -> " << second_peak.fds << "\n";
  server.signal(SIGTERM);
  EXPECT_EQ(server.wait_exit(30s), 0) << server.log();
}

}  // namespace
}  // namespace m3::test
