// The snapshot and prefix-cache settings: read from YAML and flags, refused with a
// message naming the setting.
#include <gtest/gtest.h>

#include "server/server_config.h"
#include "tests/server/config_test_support.h"

namespace m3 {
namespace {

template <typename F>
std::string error_of(F&& f) {
  return test::config_error_of(f);
}
using test::from_yaml;

TEST(SnapshotConfig, DefaultsKeepSnapshotsInMemoryAndTheCacheOff) {
  const ServerConfig c;
  EXPECT_EQ(c.snapshot_store, "memory");
  EXPECT_EQ(c.snapshot_capacity_bytes, 0);
  EXPECT_EQ(c.snapshot_ttl_s, 0);
  EXPECT_FALSE(c.prefix_cache);
}

TEST(SnapshotConfig, ReadsYamlAndFlags) {
  const ServerConfig y = from_yaml(
      "snapshot_store: dir:/var/lib/m3/snapshots\nsnapshot_capacity_bytes: 8589934592\nsnapshot_ttl_s: 3600\n"
      "prefix_cache: true\nprefix_cache_interval: 128\nprefix_cache_capacity_bytes: 4294967296\n"
      "session_swap_after_s: 2.5\nmax_sessions: 1000\n");
  EXPECT_EQ(y.session_swap_after_s, 2.5);
  EXPECT_EQ(y.max_sessions, 1000);
  EXPECT_EQ(y.snapshot_store, "dir:/var/lib/m3/snapshots");
  EXPECT_EQ(y.snapshot_capacity_bytes, int64_t{8} << 30);  // past 32 bits
  EXPECT_EQ(y.snapshot_ttl_s, 3600);
  EXPECT_TRUE(y.prefix_cache);
  EXPECT_EQ(y.prefix_cache_interval, 128);
  EXPECT_EQ(y.prefix_cache_capacity_bytes, int64_t{4} << 30);
  const CommandLine cl = parse_command_line(
      {"--snapshot-store", "redis://127.0.0.1:6379", "--snapshot-capacity-bytes", "1000", "--prefix-cache", "true"},
      "/nonexistent.yaml");
  EXPECT_EQ(cl.config.snapshot_store, "redis://127.0.0.1:6379");
  EXPECT_EQ(cl.config.snapshot_capacity_bytes, 1000);
  EXPECT_TRUE(cl.config.prefix_cache);
}

TEST(SnapshotConfig, BadValuesAreRefusedNamingTheSetting) {
  EXPECT_EQ(error_of([] { from_yaml("snapshot_store: s3://bucket\n"); }),
            "snapshot_store 's3://bucket': must be memory, dir:PATH or redis://HOST:PORT");
  EXPECT_EQ(error_of([] { from_yaml("snapshot_store: \"dir:\"\n"); }),
            "snapshot_store 'dir:': dir: needs a path (dir:/var/lib/m3serve/snapshots)");
  EXPECT_EQ(error_of([] { from_yaml("snapshot_store: redis://localhost\n"); }),
            "snapshot_store 'redis://localhost': redis:// needs HOST:PORT with a port in 1..65535 "
            "(redis://127.0.0.1:6379)");
  EXPECT_EQ(error_of([] { from_yaml("snapshot_capacity_bytes: -1\n"); }),
            "snapshot_capacity_bytes must be 0 (no limit) or more, got -1");
  EXPECT_EQ(error_of([] { from_yaml("snapshot_capacity_bytes: lots\n"); }),
            "server.yaml: key 'snapshot_capacity_bytes': expected an integer, got 'lots'");
  EXPECT_EQ(error_of([] { from_yaml("snapshot_ttl_s: -5\n"); }),
            "snapshot_ttl_s must be 0 (none) or between 0.001 s and a year, got -5.000000");
  EXPECT_EQ(error_of([] { from_yaml("prefix_cache_interval: 0\n"); }),
            "prefix_cache_interval must be between 1 and 16777216, got 0");
  EXPECT_EQ(error_of([] { from_yaml("prefix_cache_capacity_bytes: 0\n"); }),
            "prefix_cache_capacity_bytes must be at least 1, got 0");
  EXPECT_EQ(error_of([] { from_yaml("session_swap_after_s: -1\n"); }),
            "session_swap_after_s must be 0 (never) or between 0.001 and 86400 seconds, got -1.000000");
  EXPECT_EQ(error_of([] { from_yaml("max_sessions: -2\n"); }), "max_sessions must be between 0 and 10000000, got -2");
}

}  // namespace
}  // namespace m3
