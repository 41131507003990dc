// The sampling kernel against the host definition (model/cpu/cpu_sampling.h) on random
// logits of an odd vocabulary inside a padded row: greedy, temperature, top-k, top-p and
// their mixes, ties, per-slot seeds and counters, with and without the blocks that pull the
// next step's weights into L2; and the embedding gather with continue tokens.
#include <limits>
#include <string>

#include "gpu_test_util.h"
#include "kernels/embedding.cuh"
#include "kernels/sampling.cuh"
#include "model/cpu/cpu_sampling.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

using testing::DeviceArray;

// Runs the kernel on `batch` rows of `logits` (row b for slots[b]) and expects each
// sampled id, last token and counter to be what sample_token gives; slots not in the
// batch stay untouched. prefetch_blocks > 0 adds the blocks that only pull a buffer into L2.
void expect_host_samples(const std::vector<float>& logits, int stride, int vocab, const std::vector<int32_t>& slots,
                         const std::vector<kernels::SlotSampling>& params, const std::vector<uint64_t>& counters,
                         int prefetch_blocks, const std::string& what) {
  SCOPED_TRACE(what);
  const int batch = static_cast<int>(slots.size()), n_slots = static_cast<int>(params.size());
  DeviceArray<float> dl(logits);
  DeviceArray<int32_t> dslots(slots), dlast(std::vector<int32_t>(n_slots, -5)), dsampled(batch);
  DeviceArray<kernels::SlotSampling> dparams(params);
  DeviceArray<uint64_t> dcounters(counters);
  kernels::SamplingArgs a;
  a.logits = dl.get();
  a.logits_stride = stride;
  a.vocab = vocab;
  a.slots = dslots.get();
  a.params = dparams.get();
  a.counters = dcounters.get();
  a.last_token = dlast.get();
  a.sampled = dsampled.get();
  a.batch = batch;
  DeviceArray<float> prefetched(prefetch_blocks > 0 ? 4099 : 0);
  if (prefetch_blocks > 0) {
    a.prefetch = {prefetched.get(), sizeof(float) * 4096};
    a.prefetch_blocks = prefetch_blocks;
  }
  const kernels::KernelLaunch launch = kernels::plan_sampling(a);
  EXPECT_EQ(launch.grid().x, static_cast<unsigned>(batch + a.prefetch_blocks));
  launch.launch(nullptr, false);
  M3_CUDA_CHECK(cudaDeviceSynchronize());
  const auto sampled = dsampled.download();
  const auto last = dlast.download();
  const auto counters_after = dcounters.download();
  SamplingScratch scratch(vocab);
  std::vector<bool> stepped(n_slots, false);
  for (int b = 0; b < batch; ++b) {
    const int s = slots[b];
    stepped[s] = true;
    SamplingParams hp;
    hp.temperature = params[s].temperature;
    hp.top_k = params[s].top_k;
    hp.top_p = params[s].top_p;
    hp.seed = params[s].seed;
    const int32_t want = sample_token(std::span<const float>(logits.data() + b * stride, stride), vocab, hp,
                                      counters[s], scratch);
    EXPECT_EQ(sampled[b], want) << "entry " << b << " temperature " << hp.temperature << " top_k " << hp.top_k
                                << " top_p " << hp.top_p;
    EXPECT_EQ(last[s], sampled[b]);
    EXPECT_EQ(counters_after[s], counters[s] + 1);
  }
  for (int s = 0; s < n_slots; ++s) {
    if (stepped[s]) continue;
    EXPECT_EQ(last[s], -5);  // slots not in the batch are untouched
    EXPECT_EQ(counters_after[s], counters[s]);
  }
}

TEST(SamplingKernel, MatchesHostDefinition) {
  M3_REQUIRE_CUDA_DEVICE();
  const int vocab = 997, stride = 1003, n_slots = 7;
  const std::vector<SamplingParams> cases = {
      {0.f, 0, 1.f, 1},     {1.f, 0, 1.f, 2},    {0.7f, 40, 1.f, 3},  {1.3f, 0, 0.9f, 4},
      {0.9f, 50, 0.8f, 5},  {2.f, 1, 1.f, 6},    {1.f, 0, 0.f, 7},    {0.5f, 2000, 0.95f, 8},
      {1e-40f, 0, 1.f, 9},  // a denormal temperature: 1 / T overflows, greedy (it drew the worst id)
  };
  for (int round = 0; round < 12; ++round) {
    const int batch = 5;
    std::vector<float> logits = testing::random_floats(static_cast<size_t>(batch) * stride, 1000 + round, -4.f, 4.f);
    // Ties (lowest id first) and a padding tail that must never be picked.
    for (int b = 0; b < batch; ++b) {
      logits[b * stride + 10] = logits[b * stride + 500] = 6.f + round % 3;
      for (int i = vocab; i < stride; ++i) logits[b * stride + i] = 100.f;
    }
    const std::vector<int32_t> slots = {3, 0, 6, 1, 4};
    std::vector<kernels::SlotSampling> params(n_slots);
    std::vector<uint64_t> counters(n_slots);
    for (int s = 0; s < n_slots; ++s) {
      const SamplingParams& c = cases[(s + round) % cases.size()];
      params[s].temperature = c.temperature;
      params[s].top_k = c.top_k;
      params[s].top_p = c.top_p;
      params[s].seed = c.seed * 7919 + round;
      counters[s] = static_cast<uint64_t>(round * 3 + s);
    }
    // Odd rounds add blocks that only pull a buffer into L2: the samples must not change.
    expect_host_samples(logits, stride, vocab, slots, params, counters, round % 2 == 1 ? 3 + round : 0,
                        "round " + std::to_string(round));
  }
}

// Logits a broken model can produce: NaN ranks below -inf and weighs nothing; a +inf, or
// a row of nothing but NaN and -inf, is taken as greedy takes it (the kernel drew the
// wrong id: its mass was NaN).
TEST(SamplingKernel, NonFiniteLogitsAsTheHostDefinition) {
  M3_REQUIRE_CUDA_DEVICE();
  const int vocab = 301, stride = 304, batch = 4;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits = testing::random_floats(static_cast<size_t>(batch) * stride, 77, -3.f, 3.f);
  for (int i = 0; i < vocab; i += 7) logits[i] = nan;   // row 0: NaNs among finite logits
  logits[stride + 40] = inf;                             // row 1: one +inf
  logits[stride + 41] = nan;
  for (int i = 0; i < vocab; ++i) logits[2 * stride + i] = i % 2 ? nan : -inf;  // row 2: no finite logit
  for (int i = 0; i < vocab; ++i) logits[3 * stride + i] = nan;                 // row 3: all NaN
  for (int b = 0; b < batch; ++b)
    for (int i = vocab; i < stride; ++i) logits[b * stride + i] = 50.f;  // padding, never picked
  const std::vector<int32_t> slots = {0, 1, 2, 3};
  for (const SamplingParams& c : {SamplingParams{1.f, 0, 1.f, 5}, SamplingParams{0.7f, 0, 0.9f, 6},
                                  SamplingParams{1.2f, 20, 1.f, 7}, SamplingParams{0.f, 0, 1.f, 8}}) {
    std::vector<kernels::SlotSampling> params(batch);
    std::vector<uint64_t> counters(batch);
    for (int s = 0; s < batch; ++s) {
      params[s] = {c.temperature, c.top_k, c.top_p, -1, c.seed + static_cast<uint64_t>(s)};
      counters[s] = static_cast<uint64_t>(3 * s + 1);
    }
    expect_host_samples(logits, stride, vocab, slots, params, counters, 0,
                        "temperature " + std::to_string(c.temperature) + " top_k " + std::to_string(c.top_k) +
                            " top_p " + std::to_string(c.top_p));
  }
}

// Refused before anything touches a device, so this runs without one too.
TEST(SamplingKernel, RejectsInconsistentArguments) {
  kernels::SamplingArgs a;
  a.logits_stride = 10;
  a.vocab = 10;
  a.batch = 0;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { kernels::plan_sampling(a); }),
            "plan_sampling: batch 0, vocab 10, logits stride 10, prefetch blocks 0 are inconsistent");
  a.batch = 2;
  a.prefetch_blocks = -1;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { kernels::plan_sampling(a); }),
            "plan_sampling: batch 2, vocab 10, logits stride 10, prefetch blocks -1 are inconsistent");
}

TEST(EmbeddingKernel, GathersTokensAndContinues) {
  M3_REQUIRE_CUDA_DEVICE();
  const int vocab = 37, dim = 40;
  const std::vector<float> table = testing::random_floats(vocab * dim, 5);
  const std::vector<int32_t> slots = {2, 0, 1}, tokens = {7, -1, 36}, last = {11, 3, 4};
  DeviceArray<float> dtable(table), dout(3 * dim);
  DeviceArray<uint16_t> dtable16(testing::to_bf16(table));
  DeviceArray<int32_t> dslots(slots), dtokens(tokens), dlast(last);
  for (WeightDType type : {WeightDType::F32, WeightDType::BF16}) {
    dout.poison();
    kernels::EmbeddingArgs a;
    a.table = type == WeightDType::F32 ? static_cast<const void*>(dtable.get()) : dtable16.get();
    a.type = type;
    a.vocab_rows = vocab;
    a.dim = dim;
    a.slots = dslots.get();
    a.tokens = dtokens.get();
    a.last_token = dlast.get();
    a.out = dout.get();
    a.batch = 3;
    kernels::plan_embedding(a).launch(nullptr, false);
    M3_CUDA_CHECK(cudaDeviceSynchronize());
    const auto out = dout.download();
    const int expect_token[3] = {7, 11, 36};  // entry 1 continues slot 0's last token
    for (int b = 0; b < 3; ++b)
      for (int i = 0; i < dim; ++i) {
        float want = table[expect_token[b] * dim + i];
        if (type == WeightDType::BF16) want = bf16_to_f32(f32_to_bf16(want));
        ASSERT_EQ(out[b * dim + i], want) << "entry " << b << " element " << i;
      }
  }
}

}  // namespace
}  // namespace m3
