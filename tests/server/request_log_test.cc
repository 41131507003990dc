// The request log: one line per request, warnings limited per kind.
#include <google/protobuf/stubs/logging.h>
#include <grpc/grpc.h>
#include <grpc/support/log.h>
#include <gtest/gtest.h>

#include <thread>

#include "server/library_logs.h"
#include "server/request_log.h"
#include "tests/server/server_test_support.h"

namespace m3 {
namespace {

TEST(RequestLogTest, WarningsAreRateLimitedPerKind) {
  auto sink = std::make_shared<test::CountingSink>();
  auto logger = std::make_shared<spdlog::logger>("rate-test", sink);
  RequestLog log(logger, /*burst=*/2, std::chrono::seconds(1));
  for (int i = 0; i < 50; ++i) log.warn("slow_client", "client too slow " + std::to_string(i));
  log.warn("internal", "engine error");  // another kind has its own budget
  ASSERT_EQ(sink->count(), 3u);
  EXPECT_EQ(sink->lines()[0], "client too slow 0");
  EXPECT_EQ(sink->lines()[1], "client too slow 1");
  EXPECT_EQ(sink->lines()[2], "engine error");
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  log.warn("slow_client", "client too slow again");
  ASSERT_EQ(sink->count(), 4u);
  EXPECT_EQ(sink->lines()[3],
            "client too slow again (48 similar warnings suppressed in the last 1s)");
}

TEST(RequestLogTest, OneLinePerRequestWithItsNumbers) {
  auto sink = std::make_shared<test::CountingSink>();
  RequestLog log(std::make_shared<spdlog::logger>("line-test", sink));
  RequestRecord r;
  r.method = "Generate";
  r.request_id = "abc";
  r.status = StreamStatus::kInvalidArgument;
  r.message = "max_new_tokens must be at least 1";
  r.summary.prompt_tokens = 3;
  r.duration_ms = 1.25;
  log.request_done(r);
  ASSERT_EQ(sink->count(), 1u);
  EXPECT_EQ(sink->lines()[0],
            "Generate id=abc status=invalid_argument tokens_in=3 tokens_out=0 tokens_sent=0 turns=0 "
            "queue_ms=0.0 ttft_ms=-1.0 duration_ms=1.2 finish=none peer=- error=\"max_new_tokens must be at least 1\"");

  RequestRecord done;
  done.method = "Converse";
  done.request_id = "s1";
  done.summary = {.prompt_tokens = 4, .generated_tokens = 9, .turns = 2, .time_to_first_token_ms = 2.5,
                  .queue_ms = 0.5, .last_finish = "stop"};
  done.tokens_sent = 7;
  done.duration_ms = 40;
  done.peer = "ipv4:10.0.0.7:51234";
  log.request_done(done);
  ASSERT_EQ(sink->count(), 2u);
  EXPECT_EQ(sink->lines()[1],
            "Converse id=s1 status=ok tokens_in=4 tokens_out=9 tokens_sent=7 turns=2 queue_ms=0.5 ttft_ms=2.5 "
            "duration_ms=40.0 finish=stop peer=ipv4:10.0.0.7:51234");
}

// Protobuf's and gRPC's lines reach the newest live route's log (several ServerApps in one
// process each hold one), as warnings rate-limited per library.
TEST(LibraryLogRouteTest, LinesGoToTheNewestLiveRoute) {
  grpc_init();  // (gRPC writes no line before it)
  auto first_sink = std::make_shared<test::CountingSink>();
  auto second_sink = std::make_shared<test::CountingSink>();
  RequestLog first(std::make_shared<spdlog::logger>("route-1", first_sink));
  RequestLog second(std::make_shared<spdlog::logger>("route-2", second_sink), /*burst=*/2);
  auto older = std::make_unique<LibraryLogRoute>(first);
  {
    LibraryLogRoute newer(second);
    for (int i = 0; i < 4; ++i) GOOGLE_LOG(ERROR) << "protobuf line " << i;
    gpr_log(GPR_ERROR, "grpc line %d", 7);
    EXPECT_EQ(first_sink->count(), 0u);
    ASSERT_EQ(second_sink->count(), 3u);  // two protobuf lines (the burst), one gRPC line
    EXPECT_EQ(second_sink->lines()[0], "protobuf: protobuf line 0");
    EXPECT_EQ(second_sink->lines()[1], "protobuf: protobuf line 1");
    EXPECT_EQ(second_sink->lines()[2], "grpc: grpc line 7");
  }
  GOOGLE_LOG(WARNING) << "after the newer route ended";
  ASSERT_EQ(first_sink->count(), 1u);
  EXPECT_EQ(first_sink->lines()[0], "protobuf: after the newer route ended");
  older.reset();
  GOOGLE_LOG(ERROR) << "no route: to stderr";
  EXPECT_EQ(first_sink->count(), 1u);
  EXPECT_EQ(second_sink->count(), 3u);
  grpc_shutdown();
}

}  // namespace
}  // namespace m3
