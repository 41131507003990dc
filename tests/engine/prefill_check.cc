#include "prefill_check.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>

namespace m3::testing {

std::vector<int32_t> random_tokens(int count, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
  std::vector<int32_t> out(static_cast<size_t>(count));
  for (int32_t& t : out) t = pick(rng);
  return out;
}

namespace {

void expect_rows_near(std::span<const float> a, std::span<const float> b, size_t rows, int vocab,
                      float tolerance, bool row_relative, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  const size_t V = a.size() / rows;
  for (size_t r = 0; r < rows; ++r) {
    float row_max = 0.0f;
    for (int v = 0; v < vocab; ++v) row_max = std::max(row_max, std::fabs(a[r * V + v]));
    int bad = 0;
    for (int v = 0; v < vocab && bad < 3; ++v) {
      const float x = a[r * V + v], y = b[r * V + v];
      const float scale = row_relative ? row_max : 1.0f + std::fabs(x);
      const bool ok = tolerance == 0.0f ? x == y : std::fabs(x - y) <= tolerance * scale;
      if (!ok) {
        ADD_FAILURE() << what << ": slot " << r << " logit " << v << ": step-by-step " << x
                      << ", prefill " << y;
        ++bad;
      }
    }
  }
}

}  // namespace

void compare_prefill_with_steps(Engine& stepped, Engine& prefilled, const PrefillComparison& c) {
  const int n = static_cast<int>(c.lengths.size());
  const int vocab = stepped.config().vocab_size;
  const size_t V = static_cast<size_t>(stepped.config().padded_vocab());
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n; ++i) {
    prompts.push_back(random_tokens(c.lengths[static_cast<size_t>(i)], vocab, c.seed * 1000 + i));
    SamplingParams p = c.sampling;
    p.seed = c.sampling.seed + static_cast<uint64_t>(i);
    for (Engine* e : {&stepped, &prefilled}) {
      e->reset(i);
      e->set_sampling(i, p);
    }
  }

  // Step by step: every slot that still has prompt left, one position at a time.
  std::vector<float> step_logits(static_cast<size_t>(n) * V);
  std::vector<int32_t> step_sampled(static_cast<size_t>(n));
  const int longest = *std::max_element(c.lengths.begin(), c.lengths.end());
  for (int t = 0; t < longest; ++t) {
    std::vector<int32_t> slots, tokens;
    for (int i = 0; i < n; ++i) {
      if (t < c.lengths[static_cast<size_t>(i)]) {
        slots.push_back(i);
        tokens.push_back(prompts[static_cast<size_t>(i)][static_cast<size_t>(t)]);
      }
    }
    std::vector<int32_t> sampled(slots.size());
    std::vector<float> logits(slots.size() * V);
    stepped.step(slots, tokens, sampled, logits);
    for (size_t k = 0; k < slots.size(); ++k) {
      const size_t i = static_cast<size_t>(slots[k]);
      if (t + 1 == c.lengths[i]) {
        step_sampled[i] = sampled[k];
        std::copy_n(logits.begin() + k * V, V, step_logits.begin() + i * V);
      }
    }
  }

  // Through prefill, each prompt cut into c.pieces pieces at different places per slot.
  std::vector<float> prefill_logits(static_cast<size_t>(n) * V);
  std::vector<int32_t> prefill_sampled(static_cast<size_t>(n), -1);
  std::vector<size_t> fed(static_cast<size_t>(n), 0);
  for (int piece = 0; piece < c.pieces; ++piece) {
    std::vector<PrefillRun> runs;
    std::vector<size_t> run_slot;
    for (int i = 0; i < n; ++i) {
      const size_t len = prompts[static_cast<size_t>(i)].size();
      // Uneven cuts: piece k ends at len * ((k+1)^2 / pieces^2), the last at len.
      const size_t end = piece + 1 == c.pieces
                             ? len
                             : len * static_cast<size_t>((piece + 1) * (piece + 1) + i) /
                                   static_cast<size_t>(c.pieces * c.pieces + i);
      const size_t begin = fed[static_cast<size_t>(i)];
      if (end <= begin) continue;
      runs.push_back({i, std::span<const int32_t>(prompts[static_cast<size_t>(i)]).subspan(begin, end - begin)});
      run_slot.push_back(static_cast<size_t>(i));
      fed[static_cast<size_t>(i)] = end;
    }
    if (runs.empty()) continue;
    std::vector<int32_t> sampled(runs.size());
    std::vector<float> logits(runs.size() * V);
    prefilled.prefill(runs, sampled, logits);
    for (size_t k = 0; k < runs.size(); ++k) {
      const size_t i = run_slot[k];
      prefill_sampled[i] = sampled[k];
      std::copy_n(logits.begin() + k * V, V, prefill_logits.begin() + i * V);
    }
  }
  for (int i = 0; i < n; ++i) ASSERT_EQ(fed[static_cast<size_t>(i)], prompts[static_cast<size_t>(i)].size());

  expect_rows_near(step_logits, prefill_logits, static_cast<size_t>(n), vocab, c.tolerance, c.row_relative,
                   "the prompt's last token");
  if (c.compare_samples) EXPECT_EQ(step_sampled, prefill_sampled) << "the sample after the prompt";

  // The continuation: kContinueToken on both where samples agree; otherwise the stepped
  // engine's samples fed to both, so that one differing sample does not cascade.
  std::vector<int32_t> all(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) all[static_cast<size_t>(i)] = i;
  for (int s = 0; s < c.continue_steps; ++s) {
    std::vector<int32_t> tokens_a(static_cast<size_t>(n), kContinueToken), tokens_b = tokens_a;
    if (!c.compare_samples) tokens_a = tokens_b = step_sampled;
    std::vector<int32_t> sampled_a(static_cast<size_t>(n)), sampled_b(static_cast<size_t>(n));
    std::vector<float> logits_a(static_cast<size_t>(n) * V), logits_b(static_cast<size_t>(n) * V);
    stepped.step(all, tokens_a, sampled_a, logits_a);
    prefilled.step(all, tokens_b, sampled_b, logits_b);
    expect_rows_near(logits_a, logits_b, static_cast<size_t>(n), vocab, c.tolerance, c.row_relative,
                     "continuation step " + std::to_string(s));
    if (c.compare_samples) EXPECT_EQ(sampled_a, sampled_b) << "continuation step " << s;
    step_sampled = sampled_a;
  }
}

}  // namespace m3::testing
