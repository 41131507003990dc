#include "kernels/sampling.cuh"

#include <cfloat>

#include <stdexcept>
#include <string>

#include "kernels/common.cuh"
#include "kernels/philox.h"

namespace m3::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
static_assert(kWarps * (sizeof(float) + sizeof(int) + sizeof(unsigned long long)) <= kMaxSharedBytesPerBlock,
              "sampling's static shared memory must fit every target GPU");

struct SamplingParams {
  SamplingArgs a;
};

// Monotone map of a float's bits to an unsigned integer (larger float, larger integer).
// NaN maps to 0: it ranks after every number, as on the host.
__device__ __forceinline__ uint32_t ordered_bits(float f) {
  if (isnan(f)) return 0u;  // below every number, -inf included, as in sample_token
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct Reduce {
  float* sums;      // [kWarps]
  int* counts;      // [kWarps]
  unsigned long long* keys;  // [kWarps]
};

// Block-wide (sum, count); every thread gets the result.
__device__ void block_sum_count(float& sum, int& count, const Reduce& red) {
  sum = warp_sum(sum);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) count += __shfl_xor_sync(0xffffffffu, count, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // previous readers of red are done
  if (lane == 0) { red.sums[warp] = sum; red.counts[warp] = count; }
  __syncthreads();
  sum = 0.f;
  count = 0;
  for (int w = 0; w < kWarps; ++w) { sum += red.sums[w]; count += red.counts[w]; }
}

__device__ unsigned long long block_key_max(unsigned long long v, const Reduce& red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, v, o);
    v = other > v ? other : v;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) red.keys[warp] = v;
  __syncthreads();
  v = 0;
  for (int w = 0; w < kWarps; ++w) v = red.keys[w] > v ? red.keys[w] : v;
  return v;
}

__device__ unsigned long long block_key_min(unsigned long long v, const Reduce& red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, v, o);
    v = other < v ? other : v;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) red.keys[warp] = v;
  __syncthreads();
  v = ~0ull;
  for (int w = 0; w < kWarps; ++w) v = red.keys[w] < v ? red.keys[w] : v;
  return v;
}

__global__ void __launch_bounds__(kThreads) sampling_kernel(const SamplingParams prm) {
  const SamplingArgs& a = prm.a;
  __shared__ float red_sums[kWarps];
  __shared__ int red_counts[kWarps];
  __shared__ unsigned long long red_keys[kWarps];
  const Reduce red{red_sums, red_counts, red_keys};

  const int b = blockIdx.x;
  if (b >= a.batch) {
    wait_for_previous_kernel();
    prefetch_l2(a.prefetch, b - a.batch, a.prefetch_blocks);
    return;
  }
  // The slot table, parameters and counters are the step's inputs, not the previous
  // kernel's outputs (sampling.cuh): their two dependent loads go before the wait.
  const int slot = a.slots[b];
  const SlotSampling sp = a.params[slot];
  const uint64_t counter = a.counters[slot];
  // The candidates: the mask's ranges at the slot's frame position (ascending, disjoint:
  // SamplingMaskTable), or the whole vocabulary as one range.
  const bool masked = sp.mask >= 0 && sp.mask < a.masks.n_masks && a.frame_positions != nullptr && a.tokens != nullptr;
  int position = 0, range_begin = 0, range_end = 1;
  const TokenRange whole{0, a.vocab, 0};
  const TokenRange* ranges = &whole;
  if (masked) {
    position = a.tokens[b] == -1 ? a.frame_positions[slot] : 0;  // -1: kContinueToken
    mask_ranges(a.masks, sp.mask, position, &range_begin, &range_end);
    ranges = a.masks.ranges;
  }
  wait_for_previous_kernel();
  const float* l = a.logits + (int64_t)b * a.logits_stride;
  const int V = a.vocab;
  const int id_bits = V > 1 ? 32 - __clz(V - 1) : 0;
  const unsigned long long id_mask = (1ull << id_bits) - 1;
  const int key_bits = 32 + id_bits;
  auto key_of = [&](int i) -> unsigned long long {
    return ((unsigned long long)ordered_bits(l[i]) << id_bits) | (unsigned long long)(V - 1 - i);
  };
  auto id_of = [&](unsigned long long key) { return V - 1 - (int)(key & id_mask); };
  // Calls f(i) for this thread's share of the candidate ids.
  auto for_candidates = [&](auto&& f) {
    for (int r = range_begin; r < range_end; ++r) {
      const int lo = max(ranges[r].lo, 0), hi = min(ranges[r].hi, V);
      for (int i = lo + (int)threadIdx.x; i < hi; i += kThreads) f(i);
    }
  };

  unsigned long long best = 0;
  for_candidates([&](int i) {
    const unsigned long long kk = key_of(i);
    best = kk > best ? kk : best;
  });
  best = block_key_max(best, red);
  int chosen = id_of(best);

  // Below FLT_MIN 1 / T overflows: greedy, as sample_token; so is a non-finite top logit
  // (a +inf, or nothing but NaN and -inf): there is nothing to weigh.
  if (sp.temperature >= FLT_MIN && isfinite(l[chosen])) {
    const float lmax = l[chosen];
    const float inv_t = 1.f / sp.temperature;
    // Mass (sum of exp((l - lmax)/T)) and count of the kept ids (key >= floor) whose key
    // is >= t.
    unsigned long long floor_key = 0;
    auto mass_from = [&](unsigned long long t, float& mass, int& count) {
      const unsigned long long from = t > floor_key ? t : floor_key;
      mass = 0.f;
      count = 0;
      for_candidates([&](int i) {
        if (key_of(i) >= from) {
          const float li = l[i];
          mass += isnan(li) ? 0.f : expf((li - lmax) * inv_t);  // NaN weighs nothing, as -inf
          ++count;
        }
      });
      block_sum_count(mass, count, red);
    };
    // Each cut is the largest key t with a monotone property, built bit by bit from the
    // top; t below the floor behaves as the floor, so the result is never under it.
    // Top-k: the k-th largest key.
    const int k_eff = sp.top_k > 0 && sp.top_k < V ? sp.top_k : V;
    if (k_eff < V) {
      unsigned long long t = 0;
      for (int bit = key_bits - 1; bit >= 0; --bit) {
        const unsigned long long cand = t | (1ull << bit);
        int count = 0;
        for_candidates([&](int i) { count += key_of(i) >= cand; });
        float unused = 0.f;
        block_sum_count(unused, count, red);
        if (count >= k_eff) t = cand;
      }
      floor_key = t;
    }
    float total;
    int total_count;
    mass_from(floor_key, total, total_count);
    // Top-p: the shortest prefix whose probability reaches top_p (at least one id).
    if (sp.top_p < 1.f) {
      const float need = sp.top_p * total;
      unsigned long long t = 0;
      for (int bit = key_bits - 1; bit >= 0; --bit) {
        const unsigned long long cand = t | (1ull << bit);
        float mass;
        int count;
        mass_from(cand, mass, count);
        if (count >= 1 && mass >= need) t = cand;
      }
      floor_key = t > floor_key ? t : floor_key;
      mass_from(floor_key, total, total_count);
    }
    // The draw: the first id (in key order) whose cumulative mass exceeds u * total.
    const float target = philox_uniform(sp.seed, counter) * total;
    unsigned long long t = 0;
    for (int bit = key_bits - 1; bit >= 0; --bit) {
      const unsigned long long cand = t | (1ull << bit);
      float mass;
      int count;
      mass_from(cand, mass, count);
      if (count >= 1 && mass > target) t = cand;
    }
    // The kept id with the smallest key >= t (t is such a key unless rounding broke
    // monotonicity; this keeps the pick inside the kept set either way).
    unsigned long long pick = ~0ull;
    for_candidates([&](int i) {
      const unsigned long long kk = key_of(i);
      if (kk >= t && kk >= floor_key && kk < pick) pick = kk;
    });
    pick = block_key_min(pick, red);
    if (pick != ~0ull) chosen = id_of(pick);
  }
  allow_next_kernel();
  if (threadIdx.x == 0) {
    a.sampled[b] = chosen;
    a.last_token[slot] = chosen;
    a.counters[slot] = counter + 1;
    if (masked) a.frame_positions[slot] = next_frame_position(a.masks, sp.mask, position, chosen);
  }
}

}  // namespace

KernelLaunch plan_sampling(const SamplingArgs& a) {
  if (a.batch <= 0 || a.vocab <= 0 || a.logits_stride < a.vocab || a.prefetch_blocks < 0) {
    throw std::invalid_argument("plan_sampling: batch " + std::to_string(a.batch) + ", vocab " +
                                std::to_string(a.vocab) + ", logits stride " +
                                std::to_string(a.logits_stride) + ", prefetch blocks " +
                                std::to_string(a.prefetch_blocks) + " are inconsistent");
  }
  const int extra = a.prefetch.ptr != nullptr ? a.prefetch_blocks : 0;
  return KernelLaunch::make("sampling", sampling_kernel, dim3(a.batch + extra), dim3(kThreads), 0,
                            SamplingParams{a});
}

}  // namespace m3::kernels
