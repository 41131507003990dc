// A full server (every slot busy, the queue full) refuses with RESOURCE_EXHAUSTED, and what
// waits in the queue leaves it when its client gives up.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/server/server_test_support.h"

namespace m3::test {
namespace {

using namespace std::chrono_literals;

// Streams that have sent nothing are bounded by the server's capacity (max_batch +
// queue_capacity); one that starts its session makes room.
TEST(CapacityTest, ConverseStreamsThatSentNothingAreBounded) {
  TestServer server(one_slot_config());
  grpc::ClientContext first_ctx;
  auto first = server.stub->Converse(&first_ctx);
  ASSERT_TRUE(eventually([&] { return server.app->sessions_not_started() == 1; }));
  v1::ConverseRequest input, end;
  for (int32_t id : kPrompt) input.mutable_input()->add_ids(id);
  end.mutable_end_turn()->set_max_new_tokens(3);
  const grpc::Status refused = converse_status(*server.stub, {input, end});
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(refused.error_message(),
            "server at capacity: 1 Converse streams are open and have sent nothing yet (max_batch + "
            "queue_capacity); retry later");
  ASSERT_TRUE(first->Write(input) && first->Write(end));
  EXPECT_EQ(read_reply(*first).tokens.size(), 3u);
  first->WritesDone();
  EXPECT_TRUE(first->Finish().ok());
  EXPECT_TRUE(converse_status(*server.stub, {input, end}).ok());
}

TEST(CapacityTest, OverCapacityIsResourceExhausted) {
  ServerConfig config = test_config();
  config.max_batch = 1;
  config.queue_capacity = 1;
  TestServer server(config);
  grpc::ClientContext running_ctx, waiting_ctx;
  auto running = server.stub->Generate(&running_ctx, generate_request(kPrompt, 100000));
  v1::GenerateResponse response;
  ASSERT_TRUE(running->Read(&response));  // it holds the slot
  auto waiting = server.stub->Generate(&waiting_ctx, generate_request(kPrompt, 4));
  // Let the second one reach the queue before the third arrives.
  ASSERT_TRUE(eventually([&] {
    return server.app->metrics().serialize().find("m3serve_queue_depth 1") != std::string::npos;
  })) << "the second request never queued";

  GenerateResult refused = generate(*server.stub, generate_request(kPrompt, 4), 5s);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.status.error_message().find("server at capacity"), std::string::npos)
      << refused.status.error_message();

  running_ctx.TryCancel();
  while (running->Read(&response)) {
  }
  running->Finish();
  // The queued request gets the slot and completes.
  std::vector<int32_t> got;
  while (waiting->Read(&response))
    for (int32_t id : response.tokens().ids()) got.push_back(id);
  EXPECT_TRUE(waiting->Finish().ok());
  EXPECT_EQ(got, engine_generate(kPrompt, 4));
}

// With every slot busy and no queue, a new session is refused as a Generate would be,
// and the server goes on.
TEST(CapacityTest, AConverseAtCapacityIsResourceExhausted) {
  TestServer server(one_slot_config());
  grpc::ClientContext running_ctx;
  auto running = server.stub->Generate(&running_ctx, generate_request(kPrompt, 100000));
  v1::GenerateResponse response;
  ASSERT_TRUE(running->Read(&response));  // it holds the slot
  v1::ConverseRequest input, end;
  for (int32_t id : kPrompt) input.mutable_input()->add_ids(id);
  end.mutable_end_turn()->set_max_new_tokens(3);
  const grpc::Status refused = converse_status(*server.stub, {input, end});
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("server at capacity"), std::string::npos) << refused.error_message();
  running_ctx.TryCancel();
  while (running->Read(&response)) {
  }
  running->Finish();
  ASSERT_TRUE(wait_for_requests(*server.app, "cancelled", 1));
  EXPECT_TRUE(converse_status(*server.stub, {input, end}).ok());
}

// Requests waiting for the one slot: one whose deadline passes and one its client cancels
// leave the queue with their own status, having streamed nothing; the slot then serves
// the next request.
TEST(CapacityTest, AQueuedRequestItsClientGivesUpOnLeavesTheQueue) {
  ServerConfig config = test_config();
  config.max_batch = 1;
  config.queue_capacity = 2;
  TestServer server(config);
  auto queue_depth_is = [&](int depth) {
    return eventually([&] {
      return server.app->metrics().serialize().find("m3serve_queue_depth " + std::to_string(depth)) !=
             std::string::npos;
    });
  };
  grpc::ClientContext running_ctx;
  auto running = server.stub->Generate(&running_ctx, generate_request(kPrompt, 100000));
  v1::GenerateResponse response;
  ASSERT_TRUE(running->Read(&response));  // it holds the slot

  grpc::ClientContext timed_ctx, cancelled_ctx;
  timed_ctx.set_deadline(std::chrono::system_clock::now() + 4s);  // (both must queue before it)
  auto timed = server.stub->Generate(&timed_ctx, generate_request(kPrompt, 4));
  auto cancelled = server.stub->Generate(&cancelled_ctx, generate_request(kPrompt, 4));
  ASSERT_TRUE(queue_depth_is(2)) << "the two requests never queued";
  cancelled_ctx.TryCancel();
  EXPECT_FALSE(cancelled->Read(&response));
  EXPECT_EQ(cancelled->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_FALSE(timed->Read(&response));  // nothing streamed before its deadline
  EXPECT_EQ(timed->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ASSERT_TRUE(queue_depth_is(0));
  EXPECT_TRUE(wait_for_requests(*server.app, "cancelled", 1));
  EXPECT_TRUE(wait_for_requests(*server.app, "deadline_exceeded", 1));

  running_ctx.TryCancel();
  while (running->Read(&response)) {
  }
  running->Finish();
  GenerateResult next = generate(*server.stub, generate_request(kPrompt, 3), 5s);
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.tokens, engine_generate(kPrompt, 3));
}

}  // namespace
}  // namespace m3::test
