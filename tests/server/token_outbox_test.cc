// The per-stream buffer between the engine thread and a stream's writer.
#include <gtest/gtest.h>

#include "server/token_outbox.h"

namespace m3 {
namespace {

TEST(TokenOutboxTest, TokensMadeDuringAWriteAreCoalesced) {
  TokenOutbox box(8);
  std::vector<int32_t> got;
  EXPECT_EQ(box.push(1), TokenOutbox::Push::kWakeWriter);  // the writer was idle
  EXPECT_EQ(box.push(2), TokenOutbox::Push::kQueued);      // it is woken once
  TokenOutbox::Item item = box.take(&got);
  ASSERT_EQ(item.kind, TokenOutbox::Item::kTokens);
  EXPECT_EQ(got, (std::vector<int32_t>{1, 2}));
  // While that write is in flight, three more arrive: one message next time.
  EXPECT_EQ(box.push(3), TokenOutbox::Push::kQueued);
  EXPECT_EQ(box.push(4), TokenOutbox::Push::kQueued);
  EXPECT_EQ(box.push(5), TokenOutbox::Push::kQueued);
  ASSERT_EQ(box.take(&got).kind, TokenOutbox::Item::kTokens);
  EXPECT_EQ(got, (std::vector<int32_t>{3, 4, 5}));
  EXPECT_EQ(box.take(&got).kind, TokenOutbox::Item::kNothing);  // the writer goes idle
  EXPECT_EQ(box.push(6), TokenOutbox::Push::kWakeWriter);
}

TEST(TokenOutboxTest, OverflowWhenTheReaderFallsBehind) {
  TokenOutbox box(3);
  box.push(1);
  box.push(2);
  box.push(3);
  EXPECT_EQ(box.push(4), TokenOutbox::Push::kOverflow);
  std::vector<int32_t> got;
  box.take(&got);
  EXPECT_EQ(got, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(box.push(4), TokenOutbox::Push::kQueued);  // the ring wrapped around
  box.take(&got);
  EXPECT_EQ(got, (std::vector<int32_t>{4}));
}

TEST(TokenOutboxTest, TurnEndsSplitTheTokensInOrder) {
  TokenOutbox box(16);
  std::vector<int32_t> got;
  box.push(1);
  box.push(2);
  box.end_turn({0, FinishReason::kStop, {}});
  box.push(3);
  box.end_turn({1, FinishReason::kLength, {}});
  EXPECT_FALSE(box.close(StreamStatus::kOk, ""));  // the writer is already awake
  ASSERT_EQ(box.take(&got).kind, TokenOutbox::Item::kTokens);
  EXPECT_EQ(got, (std::vector<int32_t>{1, 2}));
  TokenOutbox::Item end = box.take(&got);
  ASSERT_EQ(end.kind, TokenOutbox::Item::kTurnEnd);
  EXPECT_EQ(end.turn_end.turn, 0u);
  EXPECT_EQ(end.turn_end.reason, FinishReason::kStop);
  ASSERT_EQ(box.take(&got).kind, TokenOutbox::Item::kTokens);
  EXPECT_EQ(got, (std::vector<int32_t>{3}));
  EXPECT_EQ(box.take(&got).kind, TokenOutbox::Item::kTurnEnd);
  EXPECT_EQ(box.take(&got).kind, TokenOutbox::Item::kClosed);
  EXPECT_EQ(box.take(&got).kind, TokenOutbox::Item::kNothing);
  EXPECT_EQ(box.push(9), TokenOutbox::Push::kQueued);  // closed: nothing more, no wake
}

TEST(TokenOutboxTest, AnErrorDropsWhatWasNotSent) {
  TokenOutbox box(16);
  std::vector<int32_t> got;
  box.push(1);
  box.end_turn({0, FinishReason::kLength, {}});
  box.close(StreamStatus::kCancelled, "cancelled by the client");
  TokenOutbox::Item item = box.take(&got);
  ASSERT_EQ(item.kind, TokenOutbox::Item::kClosed);
  EXPECT_EQ(item.status, StreamStatus::kCancelled);
  EXPECT_EQ(item.message, "cancelled by the client");
  EXPECT_FALSE(box.close(StreamStatus::kOk, ""));  // the first close wins
}

TEST(TokenOutboxTest, AnErrorCanDeliverWhatWasQueuedFirst) {
  TokenOutbox box(16);
  std::vector<int32_t> got;
  box.push(1);
  box.push(2);
  box.end_turn({3, FinishReason::kCancelled, {}});
  box.close(StreamStatus::kUnavailable, "the server is shutting down", TokenOutbox::Unsent::kDeliver);
  TokenOutbox::Item item = box.take(&got);
  ASSERT_EQ(item.kind, TokenOutbox::Item::kTokens);
  EXPECT_EQ(got, (std::vector<int32_t>{1, 2}));
  item = box.take(&got);
  ASSERT_EQ(item.kind, TokenOutbox::Item::kTurnEnd);
  EXPECT_EQ(item.turn_end.turn, 3u);
  EXPECT_EQ(item.turn_end.reason, FinishReason::kCancelled);
  item = box.take(&got);
  ASSERT_EQ(item.kind, TokenOutbox::Item::kClosed);
  EXPECT_EQ(item.status, StreamStatus::kUnavailable);
  EXPECT_EQ(item.message, "the server is shutting down");
}

}  // namespace
}  // namespace m3
