// The host sampling definition: greedy, temperature, top-k, top-p, seeded draws.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

#include "kernels/philox.h"
#include "model/cpu/cpu_sampling.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

std::vector<float> random_logits(int n, uint32_t seed, float spread = 3.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, spread);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(gen);
  return v;
}

SamplingParams hot(float temperature, int top_k = 0, float top_p = 1.0f, uint64_t seed = 1234) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

// Frequencies of each id over `draws` consecutive counters.
std::vector<double> frequencies(const std::vector<float>& logits, int vocab, const SamplingParams& p,
                                int draws) {
  SamplingScratch scratch(vocab);
  std::vector<double> f(static_cast<size_t>(vocab), 0.0);
  for (int c = 0; c < draws; ++c) f[static_cast<size_t>(sample_token(logits, vocab, p, c, scratch))] += 1;
  for (double& x : f) x /= draws;
  return f;
}

TEST(Sampling, GreedyTakesLowestIdOnTies) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, 3.0f};
  SamplingScratch scratch(5);
  EXPECT_EQ(greedy_token(logits, 5), 1);
  EXPECT_EQ(sample_token(logits, 5, SamplingParams{}, 0, scratch), 1);
  EXPECT_EQ(sample_token(logits, 5, hot(-1.0f), 0, scratch), 1);  // temperature <= 0: greedy
}

TEST(Sampling, DenormalTemperatureIsGreedy) {
  // 1 / 1e-40 overflows a float; the CUDA kernel scales by it, so both take the argmax.
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, 3.0f};
  SamplingScratch scratch(5);
  for (uint64_t counter = 0; counter < 16; ++counter)
    EXPECT_EQ(sample_token(logits, 5, hot(1e-40f), counter, scratch), 1) << "counter " << counter;
}

TEST(Sampling, GreedySkipsNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> logits = {nan, -5.0f, nan, -1.0f};
  EXPECT_EQ(greedy_token(logits, 4), 3);
}

TEST(Sampling, TopKOneIsGreedy) {
  SamplingScratch scratch(300);
  for (uint32_t s = 0; s < 20; ++s) {
    std::vector<float> logits = random_logits(300, s);
    logits[17] = logits[250] = 50.0f;  // a tie at the top: the lower id wins
    for (uint64_t c = 0; c < 50; ++c) {
      ASSERT_EQ(sample_token(logits, 300, hot(2.0f, 1), c, scratch), 17);
    }
  }
}

TEST(Sampling, TinyTopPIsGreedy) {
  SamplingScratch scratch(300);
  for (uint32_t s = 0; s < 20; ++s) {
    const std::vector<float> logits = random_logits(300, s, 0.1f);  // flat: many plausible ids
    const int32_t best = greedy_token(logits, 300);
    for (uint64_t c = 0; c < 50; ++c) {
      ASSERT_EQ(sample_token(logits, 300, hot(1.0f, 0, 1e-6f), c, scratch), best);
      ASSERT_EQ(sample_token(logits, 300, hot(1.0f, 0, 0.0f), c, scratch), best);
    }
  }
}

TEST(Sampling, SameSeedAndCounterSameToken) {
  const std::vector<float> logits = random_logits(1000, 3, 0.5f);
  SamplingScratch a(1000), b(1000);
  std::vector<int32_t> first, again, other_seed;
  for (uint64_t c = 0; c < 200; ++c) {
    first.push_back(sample_token(logits, 1000, hot(1.0f, 0, 1.0f, 42), c, a));
    again.push_back(sample_token(logits, 1000, hot(1.0f, 0, 1.0f, 42), c, b));
    other_seed.push_back(sample_token(logits, 1000, hot(1.0f, 0, 1.0f, 43), c, b));
  }
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other_seed);
  // Flat logits over 1000 ids: 200 counters should not keep drawing the same id.
  EXPECT_GT(std::set<int32_t>(first.begin(), first.end()).size(), 100u);
}

TEST(Sampling, FollowsSoftmaxOverManyCounters) {
  // Probabilities 0.1, 0.2, 0.3, 0.4 at temperature 1; then sharpened at temperature 0.5.
  const std::vector<float> logits = {std::log(0.1f), std::log(0.2f), std::log(0.3f), std::log(0.4f)};
  const int draws = 40000;
  const std::vector<double> f = frequencies(logits, 4, hot(1.0f), draws);
  const double want[] = {0.1, 0.2, 0.3, 0.4};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(f[i], want[i], 0.01) << "id " << i;

  const std::vector<double> sharp = frequencies(logits, 4, hot(0.5f), draws);
  const double z = 0.01 + 0.04 + 0.09 + 0.16;  // p^2, renormalised
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(sharp[i], want[i] * want[i] / z, 0.01) << "id " << i;
}

TEST(Sampling, TopKKeepsOnlyTheBestKRenormalised) {
  const std::vector<float> logits = {std::log(0.1f), std::log(0.4f), std::log(0.2f), std::log(0.3f)};
  const std::vector<double> f = frequencies(logits, 4, hot(1.0f, 2), 40000);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_EQ(f[2], 0.0);
  EXPECT_NEAR(f[1], 0.4 / 0.7, 0.01);
  EXPECT_NEAR(f[3], 0.3 / 0.7, 0.01);
}

TEST(Sampling, TopPKeepsTheShortestPrefixReachingP) {
  const std::vector<float> logits = {std::log(0.15f), std::log(0.5f), std::log(0.05f), std::log(0.3f)};
  // Sorted: 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05). top_p 0.7: 0.5 < 0.7 <= 0.8 -> {1, 3}.
  const std::vector<double> f = frequencies(logits, 4, hot(1.0f, 0, 0.7f), 40000);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_EQ(f[2], 0.0);
  EXPECT_NEAR(f[1], 0.5 / 0.8, 0.01);
  EXPECT_NEAR(f[3], 0.3 / 0.8, 0.01);
  // top_p 0.9 reaches into id 0 but not id 2.
  const std::vector<double> g = frequencies(logits, 4, hot(1.0f, 0, 0.9f), 40000);
  EXPECT_GT(g[0], 0.1);
  EXPECT_EQ(g[2], 0.0);
}

TEST(Sampling, IsTheInverseCdfAtThePhiloxUniform) {
  // The definition spelled out independently: sorted order, float cumulative mass,
  // first id whose cumulative mass exceeds u * total.
  const int vocab = 97;
  const std::vector<float> logits = random_logits(vocab, 11, 1.0f);
  SamplingScratch scratch(vocab);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  const float temperature = 0.8f;
  std::vector<float> cumulative(vocab);
  float sum = 0.0f;
  for (int j = 0; j < vocab; ++j) {
    sum += std::exp((logits[order[j]] - logits[order[0]]) / temperature);
    cumulative[j] = sum;
  }
  for (uint64_t c = 0; c < 500; ++c) {
    const float threshold = philox_uniform(99, c) * sum;
    const int j = static_cast<int>(std::upper_bound(cumulative.begin(), cumulative.end(), threshold) -
                                   cumulative.begin());
    ASSERT_EQ(sample_token(logits, vocab, hot(temperature, 0, 1.0f, 99), c, scratch),
              order[std::min(j, vocab - 1)])
        << "counter " << c;
  }
}

TEST(Sampling, NeverPicksPaddedIds) {
  // Logits of the padded vocabulary: ids >= vocab_size carry huge values.
  const int vocab = 203, padded = 208;
  std::vector<float> logits = random_logits(padded, 5);
  for (int i = vocab; i < padded; ++i) logits[static_cast<size_t>(i)] = 1e4f;
  SamplingScratch scratch(vocab);
  EXPECT_LT(greedy_token(logits, vocab), vocab);
  for (uint64_t c = 0; c < 2000; ++c) {
    ASSERT_LT(sample_token(logits, vocab, hot(5.0f), c, scratch), vocab);
    ASSERT_LT(sample_token(logits, vocab, hot(1.0f, 3, 0.5f), c, scratch), vocab);
  }
}

TEST(Sampling, ARowWithNoFiniteLogitIsTakenAsGreedyTakesIt) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  SamplingScratch scratch(4);
  const std::vector<float> no_finite = {nan, -inf, nan, -inf};  // NaN ranks below -inf
  const std::vector<float> plus_inf = {1.0f, inf, nan, 2.0f};
  for (uint64_t counter = 0; counter < 8; ++counter) {
    EXPECT_EQ(sample_token(no_finite, 4, hot(1.0f), counter, scratch), greedy_token(no_finite, 4));
    EXPECT_EQ(sample_token(plus_inf, 4, hot(0.7f, 0, 0.9f), counter, scratch), 1);
  }
  EXPECT_EQ(greedy_token(no_finite, 4), 1);
}

TEST(Sampling, NaNLogitsAreNeverDrawn) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> logits = {nan, 0.0f, nan, 0.0f, nan};
  SamplingScratch scratch(5);
  for (uint64_t c = 0; c < 200; ++c) {
    const int32_t id = sample_token(logits, 5, hot(1.0f), c, scratch);
    ASSERT_TRUE(id == 1 || id == 3) << id;
  }
}

TEST(Sampling, RejectsShortLogitsAndSmallScratch) {
  const std::vector<float> logits(10, 0.0f);
  SamplingScratch small(5), fine(20);
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { sample_token(logits, 10, hot(1.0f), 0, small); }),
            "sample_token: scratch sized for 5 ids, vocab_size is 10");
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { sample_token(logits, 11, hot(1.0f), 0, fine); }),
            "sample_token: 10 logits for vocab_size 11");
}

TEST(Sampling, ParamsErrorNamesTheBadParameter) {
  EXPECT_EQ(sampling_params_error(hot(0.7f, 40, 0.9f)), "");
  EXPECT_EQ(sampling_params_error(hot(0.0f, 0, 0.0f)), "");
  EXPECT_EQ(sampling_params_error(hot(std::numeric_limits<float>::infinity())), "temperature must be finite, got inf");
  EXPECT_EQ(sampling_params_error(hot(1.0f, -1)), "top_k must be >= 0 (0 = no limit), got -1");
  EXPECT_EQ(sampling_params_error(hot(1.0f, 0, 1.5f)), "top_p must be in [0, 1], got 1.500000");
  EXPECT_EQ(sampling_params_error(hot(1.0f, 0, std::numeric_limits<float>::quiet_NaN())),
            "top_p must be in [0, 1], got nan");
}

}  // namespace
}  // namespace m3
