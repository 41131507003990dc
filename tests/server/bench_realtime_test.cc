// m3bench realtime as a program against a real server (CPU engine, the tiny model):
// small N at a rate the tiny model keeps up with holds, paced at that rate; a rate no
// engine keeps up with does not; duplex sessions report their turns' latency.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

struct ToolRun {
  int exit_code = -1;
  std::string out;
  nlohmann::json report;
};

ToolRun m3bench_realtime(TestServer& server, const std::string& args) {
  const auto dir = std::filesystem::temp_directory_path() / ("m3bench-realtime-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto json = dir / "report.json";
  std::filesystem::remove(json);
  const std::string cmd = std::string(M3_TEST_M3BENCH) + " realtime --server 127.0.0.1:" +
                          std::to_string(server.app->port()) + " " + args + " --json " + json.string() + " 2>&1";
  ToolRun run;
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) run.out.append(buf, n);
  const int status = pclose(p);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (std::ifstream in(json); in) run.report = nlohmann::json::parse(in, nullptr, false);
  std::filesystem::remove_all(dir);
  return run;
}

TEST(BenchRealtime, SmallNHoldsAtARateTheEngineKeepsUpWithAndIsPacedByIt) {
  TestServer server;  // 4 slots
  const ToolRun run = m3bench_realtime(server, "--streams 1,3 --rate 50 --reply-tokens 40 --prompt-len 4 --slack-ms 300");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  ASSERT_TRUE(run.report.is_object()) << run.out;
  EXPECT_EQ(run.report["mode"], "generate");
  ASSERT_EQ(run.report["results"].size(), 2u);
  for (const auto& r : run.report["results"]) {
    SCOPED_TRACE(r.dump());
    EXPECT_TRUE(r["held"].get<bool>());
    EXPECT_EQ(r["streams_failed"], 0);
    EXPECT_EQ(r["tokens"], 40 * r["streams"].get<int>());
    EXPECT_LE(r["lag_p99_ms"].get<double>(), 300.0);
    // The reader plays 40 tokens at 50/s: the last one is not read before 39/50 s.
    EXPECT_GE(r["wall_s"].get<double>(), 39.0 / 50);
  }
  EXPECT_EQ(run.report["largest_held"], 3);
  EXPECT_NE(run.out.find("largest N held: 3"), std::string::npos) << run.out;
}

// 100,000 tokens/s a stream with no slack: token k is due k x 10 us after the request.
TEST(BenchRealtime, ARateNoEngineKeepsUpWithIsLate) {
  TestServer server;
  const ToolRun run = m3bench_realtime(server, "--streams 2 --rate 100000 --slack-ms 0 --reply-tokens 200");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto& r = run.report["results"][0];
  EXPECT_FALSE(r["held"].get<bool>()) << r.dump();
  EXPECT_GT(r["late_tokens"].get<int>(), 0);
  EXPECT_GT(r["lag_p99_ms"].get<double>(), 0.0);
  EXPECT_EQ(run.report["largest_held"], 0);
}

TEST(BenchRealtime, DuplexSessionsReportTheirTurnLatency) {
  TestServer server;
  const ToolRun run = m3bench_realtime(
      server, "--duplex --streams 2 --turns 2 --turn-tokens 20 --reply-tokens 16 --rate 100 --slack-ms 300");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  EXPECT_EQ(run.report["mode"], "duplex");
  const auto& r = run.report["results"][0];
  SCOPED_TRACE(r.dump());
  EXPECT_TRUE(r["held"].get<bool>());
  EXPECT_EQ(r["turns"], 4);  // 2 sessions x 2 turns
  EXPECT_EQ(r["tokens"], 2 * 2 * 16);
  EXPECT_GT(r["turn_latency_p50_ms"].get<double>(), 0.0);
  EXPECT_LE(r["turn_latency_p50_ms"].get<double>(), r["turn_latency_p99_ms"].get<double>());
  // Each turn's 20 input tokens arrive at 100/s (the last frame at 0.2 s), then 16 reply
  // tokens are played at 100/s: two turns take at least 2 x (0.2 + 0.15) s.
  EXPECT_GE(r["wall_s"].get<double>(), 0.7);
}

TEST(BenchRealtime, UsageErrorsExitTwo) {
  TestServer server;
  EXPECT_EQ(m3bench_realtime(server, "--rate 100").exit_code, 2);  // no --streams
  const ToolRun zero = m3bench_realtime(server, "--streams 0");
  EXPECT_EQ(zero.exit_code, 2);
  EXPECT_NE(zero.out.find("--streams: 0 is not in [1, 8192]"), std::string::npos) << zero.out;
}

}  // namespace
}  // namespace m3::test
