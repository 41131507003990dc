// SnapshotStore over its three media: LRU eviction within the capacity, TTL, a directory
// that survives a new store object (a restart), a real redis-server shared by two stores,
// and an unreachable Redis reported as UNAVAILABLE.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "server/snapshot_store.h"
#include "snapshot_test_support.h"

namespace m3 {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
using namespace std::chrono_literals;

std::vector<std::byte> blob(size_t n, uint8_t v) { return std::vector<std::byte>(n, std::byte{v}); }

SnapshotStore memory_store(uint64_t capacity, std::chrono::milliseconds ttl = 0ms) {
  return SnapshotStore(make_memory_snapshot_backend(), capacity, ttl, nullptr);
}

TEST(SnapshotStore, GetsWhatWasPutAndForgetsWhatWasRemoved) {
  SnapshotStore s = memory_store(0);
  s.put("a", blob(10, 1));
  EXPECT_EQ(s.get("a"), blob(10, 1));
  EXPECT_EQ(s.get("b"), std::nullopt);
  EXPECT_TRUE(s.remove("a"));
  EXPECT_FALSE(s.remove("a"));
  EXPECT_EQ(s.get("a"), std::nullopt);
  EXPECT_EQ(s.bytes(), 0u);
}

TEST(SnapshotStore, EvictsTheLeastRecentlyUsedToStayWithinCapacity) {
  SnapshotStore s = memory_store(30);
  s.put("a", blob(10, 1));
  s.put("b", blob(10, 2));
  s.put("c", blob(10, 3));
  ASSERT_TRUE(s.get("a"));  // a is now the most recent; b the least
  s.put("d", blob(10, 4));
  EXPECT_EQ(s.get("b"), std::nullopt);
  EXPECT_TRUE(s.get("a") && s.get("c") && s.get("d"));
  EXPECT_EQ(s.bytes(), 30u);
  EXPECT_EQ(s.count(), 3u);
}

TEST(SnapshotStore, ASnapshotOverTheWholeCapacityIsRefused) {
  SnapshotStore s = memory_store(30);
  s.put("a", blob(10, 1));
  try {
    s.put("big", blob(31, 1));
    FAIL() << "no error";
  } catch (const SnapshotStoreError& e) {
    EXPECT_EQ(e.kind(), SnapshotStoreError::Kind::kResourceExhausted);
    EXPECT_STREQ(e.what(),
                 "snapshot store memory is full: a snapshot of 31 bytes is over the whole "
                 "snapshot_capacity_bytes (30)");
  }
  EXPECT_TRUE(s.get("a"));  // nothing was evicted for it
}

TEST(SnapshotStore, ExpiresAfterItsTtl) {
  SnapshotStore s = memory_store(0, 50ms);
  s.put("a", blob(3, 1));
  EXPECT_TRUE(s.get("a"));
  std::this_thread::sleep_for(80ms);
  EXPECT_EQ(s.get("a"), std::nullopt);
  EXPECT_EQ(s.count(), 0u);
}

TEST(SnapshotStore, SpecsAreCheckedWithReasons) {
  EXPECT_EQ(snapshot_store_spec_error("memory"), "");
  EXPECT_EQ(snapshot_store_spec_error("dir:/tmp/x"), "");
  EXPECT_EQ(snapshot_store_spec_error("redis://127.0.0.1:6379"), "");
  EXPECT_EQ(snapshot_store_spec_error("dir:"), "dir: needs a path (dir:/var/lib/m3serve/snapshots)");
  EXPECT_THAT(snapshot_store_spec_error("redis://host"), HasSubstr("needs HOST:PORT"));
  EXPECT_THAT(snapshot_store_spec_error("redis://host:99999"), HasSubstr("port in 1..65535"));
  EXPECT_EQ(snapshot_store_spec_error("s3://bucket"), "must be memory, dir:PATH or redis://HOST:PORT");
}

TEST(SnapshotStore, ADirectorySurvivesANewStoreAndKeepsItsLruOrder) {
  test::TempDir dir("snapshots");
  {
    SnapshotStore s(make_dir_snapshot_backend(dir.path()), 0, 0ms, nullptr);
    s.put("old", blob(10, 1));
    std::this_thread::sleep_for(20ms);  // distinct modification times
    s.put("new", blob(10, 2));
    EXPECT_TRUE(s.persistent());
  }
  // No temporary file is left behind.
  for (const auto& f : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(f.path().extension(), ".m3snap") << f.path();
  SnapshotStore again(make_dir_snapshot_backend(dir.path()), 25, 0ms, nullptr);
  EXPECT_EQ(again.count(), 2u);
  EXPECT_EQ(again.bytes(), 20u);
  again.put("third", blob(10, 3));  // over 25: the oldest goes
  EXPECT_EQ(again.get("old"), std::nullopt);
  EXPECT_EQ(again.get("new"), blob(10, 2));
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(dir.path()) / "old.m3snap"));
  // Ids that would leave the directory are no snapshot.
  EXPECT_EQ(again.get("../new"), std::nullopt);
}

TEST(SnapshotStore, AnUnreachableRedisIsUnavailableWithItsAddress) {
  const int port = test::free_loopback_port();
  SnapshotStore s(make_snapshot_backend("redis://127.0.0.1:" + std::to_string(port)), 0, 0ms, nullptr);
  try {
    s.get("a");
    FAIL() << "no error";
  } catch (const SnapshotStoreError& e) {
    EXPECT_EQ(e.kind(), SnapshotStoreError::Kind::kUnavailable);
    EXPECT_THAT(e.what(), HasSubstr("snapshot store redis://127.0.0.1:" + std::to_string(port) + " is unreachable"));
  }
}

TEST(SnapshotStore, AfterARedisFailureCallsFailAtOnceForASecondThenTryAgain) {
  const int port = test::free_loopback_port();
  SnapshotStore s(make_snapshot_backend("redis://127.0.0.1:" + std::to_string(port)), 0, 0ms, nullptr);
  const auto message_of_get = [&] {
    try {
      s.get("a");
    } catch (const SnapshotStoreError& e) {
      EXPECT_EQ(e.kind(), SnapshotStoreError::Kind::kUnavailable);
      return std::string(e.what());
    }
    ADD_FAILURE() << "no error";
    return std::string();
  };
  const std::string first = message_of_get();
  EXPECT_THAT(first, Not(HasSubstr("not tried again")));
  const std::string soon = message_of_get();
  EXPECT_THAT(soon, StartsWith(first));
  EXPECT_THAT(soon, HasSubstr("(not tried again until 1 s after a failure)"));
  std::this_thread::sleep_for(1100ms);
  EXPECT_EQ(message_of_get(), first);  // tried: refused again, as the first time
}

TEST(SnapshotStore, TwoStoresShareOneRedis) {
  test::RedisServer redis;
  if (!redis.running()) GTEST_SKIP() << redis.why_not();
  SnapshotStore a(make_snapshot_backend(redis.url()), 0, 0ms, nullptr);
  SnapshotStore b(make_snapshot_backend(redis.url()), 0, 0ms, nullptr);
  std::vector<std::byte> bytes = blob(100000, 7);
  bytes[5] = std::byte{0};  // binary safe
  a.put("shared", bytes);
  EXPECT_EQ(b.get("shared"), bytes);
  EXPECT_TRUE(b.remove("shared"));
  EXPECT_EQ(a.get("shared"), std::nullopt);
  // TTL is Redis's own too.
  SnapshotStore c(make_snapshot_backend(redis.url()), 0, 100ms, nullptr);
  c.put("brief", blob(3, 1));
  std::this_thread::sleep_for(250ms);
  EXPECT_EQ(b.get("brief"), std::nullopt);
}

}  // namespace
}  // namespace m3
