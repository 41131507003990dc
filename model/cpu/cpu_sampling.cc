#include "model/cpu/cpu_sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/philox.h"

namespace m3 {
namespace {

// NaN ranks below every number so the ordering stays a strict weak order.
float rank_key(float v) { return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v; }

}  // namespace

SamplingScratch::SamplingScratch(int vocab_size) {
  if (vocab_size <= 0) {
    throw std::invalid_argument("SamplingScratch: vocab_size must be positive, got " +
                                std::to_string(vocab_size));
  }
  order_.resize(static_cast<size_t>(vocab_size));
  mass_.resize(static_cast<size_t>(vocab_size));
}

int32_t greedy_token(std::span<const float> logits, int vocab_size) {
  const int n = std::min<int>(vocab_size, static_cast<int>(logits.size()));
  int32_t best = 0;
  float best_key = -std::numeric_limits<float>::infinity();
  bool found = false;
  for (int i = 0; i < n; ++i) {
    const float v = logits[static_cast<size_t>(i)];
    if (std::isnan(v)) continue;
    if (!found || v > best_key) {
      best = i;
      best_key = v;
      found = true;
    }
  }
  return best;
}

int32_t greedy_token(std::span<const float> logits, std::span<const TokenRange> allowed) {
  int32_t best = allowed.empty() ? 0 : allowed[0].lo;
  float best_key = -std::numeric_limits<float>::infinity();
  bool found = false;
  for (const TokenRange& r : allowed) {  // ascending ids: the lowest wins ties
    for (int32_t i = r.lo; i < r.hi; ++i) {
      const float v = logits[static_cast<size_t>(i)];
      if (std::isnan(v)) continue;
      if (!found || v > best_key) {
        best = i;
        best_key = v;
        found = true;
      }
    }
  }
  return best;
}

int32_t sample_token(std::span<const float> logits, int vocab_size, const SamplingParams& params,
                     uint64_t counter, SamplingScratch& scratch, std::span<const TokenRange> allowed) {
  if (vocab_size <= 0 || logits.size() < static_cast<size_t>(vocab_size)) {
    throw std::invalid_argument("sample_token: " + std::to_string(logits.size()) +
                                " logits for vocab_size " + std::to_string(vocab_size));
  }
  for (const TokenRange& r : allowed) {
    if (r.lo < 0 || r.hi <= r.lo || r.hi > vocab_size) {
      throw std::invalid_argument("sample_token: allowed range [" + std::to_string(r.lo) + ", " +
                                  std::to_string(r.hi) + ") is empty or outside [0, " +
                                  std::to_string(vocab_size) + ")");
    }
  }
  // Below FLT_MIN 1 / temperature overflows (the CUDA kernel scales by it): greedy too.
  if (!(params.temperature >= std::numeric_limits<float>::min())) {
    return allowed.empty() ? greedy_token(logits, vocab_size) : greedy_token(logits, allowed);
  }
  if (scratch.capacity() < vocab_size) {
    throw std::invalid_argument("sample_token: scratch sized for " +
                                std::to_string(scratch.capacity()) + " ids, vocab_size is " +
                                std::to_string(vocab_size));
  }

  int32_t* order = scratch.order_.data();
  float* mass = scratch.mass_.data();
  int n = 0;  // candidates: the allowed ids (disjoint ranges: each once), else all
  if (allowed.empty()) {
    for (int i = 0; i < vocab_size; ++i) order[n++] = i;
  } else {
    for (const TokenRange& r : allowed) {
      for (int32_t i = r.lo; i < r.hi && n < vocab_size; ++i) order[n++] = i;
    }
  }
  // NaN ranks below every number, -inf included (greedy_token skips it); ties: lower id.
  const auto before = [&](int32_t a, int32_t b) {
    const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
    const bool nan_a = std::isnan(la), nan_b = std::isnan(lb);
    if (nan_a != nan_b) return nan_b;
    if (!nan_a && la != lb) return la > lb;
    return a < b;
  };
  const int kept_k = params.top_k > 0 ? std::min(params.top_k, n) : n;
  if (kept_k < n) {
    std::partial_sort(order, order + kept_k, order + n, before);
  } else {
    std::sort(order, order + n, before);
  }

  const float top = rank_key(logits[static_cast<size_t>(order[0])]);
  if (!std::isfinite(top)) return order[0];  // nothing to weigh: all NaN/-inf, or +inf wins

  float cumulative = 0.0f;
  for (int j = 0; j < kept_k; ++j) {
    const float l = rank_key(logits[static_cast<size_t>(order[j])]);
    cumulative += std::exp((l - top) / params.temperature);
    mass[j] = cumulative;
  }

  int kept = kept_k;
  if (params.top_p < 1.0f) {
    const float target = params.top_p * mass[kept_k - 1];
    kept = 1;
    while (kept < kept_k && mass[kept - 1] < target) ++kept;
  }

  const float threshold = philox_uniform(params.seed, counter) * mass[kept - 1];
  for (int j = 0; j < kept; ++j) {
    if (mass[j] > threshold) return order[j];
  }
  return order[kept - 1];  // only reachable through rounding at the very top of the range
}

std::string sampling_params_error(const SamplingParams& params, int mask_count) {
  if (!std::isfinite(params.temperature)) {
    return "temperature must be finite, got " + std::to_string(params.temperature);
  }
  if (params.top_k < 0) return "top_k must be >= 0 (0 = no limit), got " + std::to_string(params.top_k);
  if (!(params.top_p >= 0.0f && params.top_p <= 1.0f)) {
    return "top_p must be in [0, 1], got " + std::to_string(params.top_p);
  }
  if (params.mask != -1 && (params.mask < 0 || params.mask >= mask_count)) {
    return "mask " + std::to_string(params.mask) + " is not -1 (none) or one of this engine's " +
           std::to_string(mask_count) + " sampling masks";
  }
  return {};
}

}  // namespace m3
