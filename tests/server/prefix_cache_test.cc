// The prefix-state cache: the longest kept prefix shorter than the prompt, compared token
// by token; LRU within its bytes; and over gRPC, a second request sharing a 2048-token
// prefix feeds only its own tokens to the engine and gets the tokens of the whole prompt.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "model/engine.h"
#include "server/prefix_cache.h"
#include "server/tools/bench_serve.h"
#include "server_test_support.h"

namespace m3::test {
namespace {

std::vector<std::byte> state(uint8_t v) { return std::vector<std::byte>(100, std::byte{v}); }

TEST(PrefixStateCache, FindsTheLongestKeptPrefixShorterThanThePrompt) {
  PrefixStateCache cache(1 << 20, 2);
  cache.insert(std::vector<int32_t>{1, 2}, state(1));
  cache.insert(std::vector<int32_t>{1, 2, 3, 4}, state(2));
  cache.insert(std::vector<int32_t>{9, 9, 9}, state(3));
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
  const auto* e = cache.longest_prefix(prompt);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->tokens, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(e->state, state(2));
  // The whole prompt is never its own prefix: its next token must be fed.
  const std::vector<int32_t> exact = {1, 2, 3, 4};
  EXPECT_EQ(cache.longest_prefix(exact)->tokens, (std::vector<int32_t>{1, 2}));
  // Same lengths, other tokens: no match (tokens are compared, not only hashes).
  const std::vector<int32_t> other = {1, 3, 3, 4, 5};
  EXPECT_EQ(cache.longest_prefix(other), nullptr);
  EXPECT_EQ(cache.hits(), 2u);
  EXPECT_EQ(cache.tokens_skipped(), 6u);
}

TEST(PrefixStateCache, EvictsTheLeastRecentlyUsedWithinItsBytes) {
  // Each entry: 100 state bytes + 4 bytes a token.
  PrefixStateCache cache(2 * 108, 1);
  cache.insert(std::vector<int32_t>{1}, state(1));
  cache.insert(std::vector<int32_t>{2}, state(2));
  ASSERT_NE(cache.longest_prefix(std::vector<int32_t>{1, 0}), nullptr);  // {1} is now the most recent
  cache.insert(std::vector<int32_t>{3}, state(3));
  EXPECT_TRUE(cache.contains(std::vector<int32_t>{1}));
  EXPECT_FALSE(cache.contains(std::vector<int32_t>{2}));
  EXPECT_TRUE(cache.contains(std::vector<int32_t>{3}));
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.bytes(), 2 * 104u);
  cache.insert(std::vector<int32_t>{4}, std::vector<std::byte>(1000));  // over the whole capacity: not kept
  EXPECT_FALSE(cache.contains(std::vector<int32_t>{4}));
}

TEST(PrefixCacheServing, ASecondRequestSharingA2048TokenPrefixFeedsOnlyItsOwnTokens) {
  ServerConfig config = test_config();
  config.prefix_cache = true;
  config.prefix_cache_interval = 256;
  config.max_prompt_tokens = 4096;
  TestServer server(config);
  std::vector<int32_t> prefix;
  for (int i = 0; i < 2048; ++i) prefix.push_back((i * 37 + 11) % 200);
  const std::vector<int32_t> a = {1, 2, 3}, b = {7, 8, 9, 10, 11};
  const auto whole = [&](const std::vector<int32_t>& own) {
    std::vector<int32_t> p = prefix;
    p.insert(p.end(), own.begin(), own.end());
    return p;
  };
  const int max_new = 6;
  const uint64_t t0 = server.app->engine().stats().tokens;
  const GenerateResult first = generate(*server.stub, generate_request(whole(a), max_new));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  const uint64_t t1 = server.app->engine().stats().tokens;
  EXPECT_EQ(t1 - t0, whole(a).size() + max_new - 1);  // nothing kept yet: all of it read
  const GenerateResult second = generate(*server.stub, generate_request(whole(b), max_new));
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  const uint64_t t2 = server.app->engine().stats().tokens;
  EXPECT_EQ(t2 - t1, b.size() + max_new - 1);  // only its own tokens, then the reply's
  EXPECT_EQ(second.tokens, engine_generate(whole(b), max_new));
  EXPECT_EQ(first.tokens, engine_generate(whole(a), max_new));
  // Sampled, with its own seed: the kept state carries no sampling parameters.
  v1::GenerateRequest sampled = generate_request(whole(b), max_new);
  sampled.mutable_sampling()->set_temperature(1.0f);
  sampled.mutable_sampling()->set_seed(5);
  SamplingParams params;
  params.temperature = 1.0f;
  params.seed = 5;
  EXPECT_EQ(generate(*server.stub, sampled).tokens, engine_generate(whole(b), max_new, params));
}

TEST(PrefixCacheServing, BenchServeSendsASharedPrefixThatTheCacheServes) {
  ServerConfig config = test_config();
  config.prefix_cache = true;
  config.prefix_cache_interval = 100;
  TestServer server(config);
  const std::string json = (std::filesystem::temp_directory_path() /
                            ("m3-bench-prefix-" + std::to_string(::getpid()) + ".json")).string();
  std::vector<std::string> args = {"m3bench", "serve", "--server", "127.0.0.1:" + std::to_string(server.app->port()),
                                   "--concurrency", "1", "--requests", "4", "--prompt-len", "4",
                                   "--shared-prefix", "300", "--max-new-tokens", "2", "--json", json};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  const uint64_t before = server.app->engine().stats().tokens;
  ASSERT_EQ(run_bench_serve(static_cast<int>(argv.size()), argv.data()), 0);
  // The first request reads all 304 tokens; the others start from the state kept at 300.
  EXPECT_EQ(server.app->engine().stats().tokens - before, 304u + 3 * 4 + 4 * (2 - 1));
  std::ifstream file(json);
  const auto report = nlohmann::json::parse(file);
  EXPECT_EQ(report["shared_prefix"], 300);
  EXPECT_EQ(report["ok"], 4);
  std::filesystem::remove(json);
}

}  // namespace
}  // namespace m3::test
