// The CUDA engine's decode step allocates nothing on the host either (the engine tests
// count its device allocations and graph replays): this binary counts the global operator
// new (tests/engine/counting_new.cc) over steps of every bucket, one at a time and
// queued, with resets and new sampling parameters between them.
#include <gtest/gtest.h>

#include <vector>

#include "counting_new.h"
#include "gpu_test_util.h"
#include "model/cuda/cuda_engine.h"
#include "model/weights.h"
#include "test_models.h"

namespace m3 {
namespace {

TEST(CudaEngineAllocation, StepsAllocateNothingOnTheHost) {
  M3_REQUIRE_CUDA_DEVICE();
  ModelConfig c = testing::small_config();
  c.d_intermediate = 64;
  testing::ScratchDir dir("cuda_no_alloc");
  testing::write_model(c, dir.path());
  const ModelWeights weights = ModelWeights::load(dir.path());
  EngineOptions o;
  o.max_slots = 8;
  o.weight_dtype = WeightDType::BF16;
  auto engine = make_cuda_engine(weights, o);
  const SamplingParams greedy{}, topk{0.9f, 20, 1.f, 3}, topp{1.1f, 0, 0.8f, 4};

  std::vector<int32_t> slots(8), tokens(8), sampled(8);
  std::vector<float> logits(8 * static_cast<size_t>(c.padded_vocab()));
  auto run = [&](int n, int t, bool queued) {
    for (int i = 0; i < n; ++i) {
      slots[i] = (i * 3 + t) % 8;
      tokens[i] = t < 2 ? (t + i) % 50 : kContinueToken;
    }
    const std::span<const int32_t> s(slots.data(), n), k(tokens.data(), n);
    const std::span<int32_t> out(sampled.data(), n);
    if (queued) {
      engine->submit_step(s, k);
      engine->collect_step(out);
    } else if (t % 2) {
      engine->step(s, k, out, std::span<float>(logits.data(), static_cast<size_t>(n) * c.padded_vocab()));
    } else {
      engine->step(s, k, out);
    }
  };
  // Every bucket once, both ways (the first steps fill the engine's host-side tables),
  // then every slot fed a token, so that any may continue.
  for (int n = 1; n <= 8; ++n) {
    run(n, 0, false);
    run(n, 1, true);
  }
  run(8, 0, false);

  testing::start_counting_allocations();
  for (int t = 0; t < 60; ++t) {
    const int n = 1 + t % 8;
    if (t % 10 == 0) {  // a slot starts again: its first token given, then it continues
      const int32_t slot = t % 8, token = 7;
      engine->reset(slot);
      engine->step(std::span<const int32_t>(&slot, 1), std::span<const int32_t>(&token, 1),
                   std::span<int32_t>(sampled.data(), 1));
    }
    if (t % 7 == 0) engine->set_sampling(t % 8, t % 3 == 0 ? greedy : t % 3 == 1 ? topk : topp);
    run(n, 2 + t, t % 3 == 0);
  }
  EXPECT_EQ(testing::stop_counting_allocations(), 0);

  // The counter does count here too.
  testing::start_counting_allocations();
  auto* probe = new std::vector<int>(10);
  const long seen = testing::stop_counting_allocations();
  delete probe;
  EXPECT_EQ(seen, 2);
}

// cuda.prefill: chunked: a prefill() call allocates nothing on the host either (its run
// table is pinned and sized at load), with runs of several lengths and slot counts, steps
// continuing between the calls.
TEST(CudaEngineAllocation, ChunkedPrefillAllocatesNothingOnTheHost) {
  M3_REQUIRE_CUDA_DEVICE();
  ModelConfig c = testing::small_config();
  c.d_intermediate = 64;
  testing::ScratchDir dir("cuda_no_alloc_prefill");
  testing::write_model(c, dir.path());
  const ModelWeights weights = ModelWeights::load(dir.path());
  EngineOptions o;
  o.max_slots = 4;
  o.weight_dtype = WeightDType::BF16;
  o.max_prefill_tokens = 1024;
  o.cuda.prefill = PrefillPath::Chunked;
  auto engine = make_cuda_engine(weights, o);
  ASSERT_TRUE(engine->has_prefill_path());

  std::vector<int32_t> prompt(1024);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i * 7 % 200);
  std::vector<int32_t> sampled(4);
  std::vector<float> logits(4 * static_cast<size_t>(c.padded_vocab()));
  std::vector<PrefillRun> runs(4);
  const std::vector<int32_t> all = {0, 1, 2, 3}, cont = {-1, -1, -1, -1};
  auto call = [&](int n, int t) {
    for (int i = 0; i < n; ++i) {
      const size_t len = 1 + static_cast<size_t>((t * 37 + i * 101) % 250);
      runs[i] = PrefillRun{i, std::span<const int32_t>(prompt.data() + i * 250, len)};
    }
    const std::span<const PrefillRun> r(runs.data(), n);
    if (t % 2) {
      engine->prefill(r, std::span<int32_t>(sampled.data(), n),
                      std::span<float>(logits.data(), static_cast<size_t>(n) * c.padded_vocab()));
    } else {
      engine->prefill(r, std::span<int32_t>(sampled.data(), n));
    }
    engine->step(all, cont, sampled);
  };
  for (int n = 4; n >= 1; --n) call(n, n);  // every slot fed first (the steps continue all four)

  testing::start_counting_allocations();
  for (int t = 0; t < 20; ++t) call(1 + t % 4, t);
  EXPECT_EQ(testing::stop_counting_allocations(), 0);
}

}  // namespace
}  // namespace m3
