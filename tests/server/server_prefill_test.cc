// The real server on the CPU backend: Generate streams the same tokens whether prompts are
// read through chunked prefill (prefill_chunk_tokens > 0) or one decode step per token
// (0), with requests side by side, greedy and seeded; and the prefill metrics count them.
#include <gtest/gtest.h>

#include <future>
#include <string>
#include <vector>

#include "server/metrics.h"
#include "server_test_support.h"

namespace m3 {
namespace {

struct Request {
  std::vector<int32_t> prompt;
  uint32_t max_new;
  float temperature;
  uint64_t seed;
};

std::vector<int32_t> iota(int32_t first, int count) {
  std::vector<int32_t> v(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) v[static_cast<size_t>(i)] = first + i;
  return v;
}

const std::vector<Request> kRequests = {
    {iota(3, 70), 9, 0.0f, 0}, {iota(10, 5), 12, 0.8f, 42}, {{7}, 6, 1.0f, 5}, {iota(1, 33), 8, 0.0f, 0}};

// Every request of kRequests at once on a server with this chunk size and minimum; their
// tokens.
std::vector<std::vector<int32_t>> serve(int prefill_chunk_tokens, int prefill_min_tokens) {
  ServerConfig config = test::test_config();
  config.prefill_chunk_tokens = prefill_chunk_tokens;
  config.prefill_min_tokens = prefill_min_tokens;
  test::TestServer server(config);
  std::vector<std::future<test::GenerateResult>> results;
  for (const Request& r : kRequests) {
    test::v1::GenerateRequest request = test::generate_request(r.prompt, r.max_new);
    request.mutable_sampling()->set_temperature(r.temperature);
    request.mutable_sampling()->set_seed(r.seed);
    results.push_back(std::async(std::launch::async, [&server, request] {
      return test::generate(*server.stub, request);
    }));
  }
  std::vector<std::vector<int32_t>> out;
  for (auto& f : results) {
    test::GenerateResult r = f.get();
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    out.push_back(r.tokens);
  }
  if (prefill_chunk_tokens > 0 && prefill_min_tokens == 1) {
    // Every prompt token went through prefill.
    size_t prompt_tokens = 0;
    for (const Request& r : kRequests) prompt_tokens += r.prompt.size();
    const std::string text = server.app->metrics().serialize();
    EXPECT_NE(text.find("m3serve_prefill_tokens_total " + std::to_string(prompt_tokens)), std::string::npos)
        << text;
  }
  return out;
}

TEST(PrefillServing, GenerateStreamsTheSameTokensWithAndWithoutPrefill) {
  const auto stepped = serve(0, 1);
  ASSERT_EQ(stepped.size(), kRequests.size());
  for (size_t i = 0; i < kRequests.size(); ++i) {
    SamplingParams sampling;
    sampling.temperature = kRequests[i].temperature;
    sampling.seed = kRequests[i].seed;
    EXPECT_EQ(stepped[i], test::engine_generate(kRequests[i].prompt, static_cast<int>(kRequests[i].max_new), sampling))
        << "request " << i;
  }
  for (const int chunk : {4, 512}) {
    // prefill_min_tokens applies to Converse input only: Generate prompts go by prefill with
    // either.
    for (const int min_tokens : {1, ServerConfig{}.prefill_min_tokens}) {
      SCOPED_TRACE("prefill_chunk_tokens " + std::to_string(chunk) + ", prefill_min_tokens " +
                   std::to_string(min_tokens));
      EXPECT_EQ(serve(chunk, min_tokens), stepped);
    }
  }
}

}  // namespace
}  // namespace m3
