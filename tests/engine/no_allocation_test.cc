// The CPU engine's decode step allocates nothing: this binary counts the global operator
// new (counting_new.cc: on every thread, the engine's workers included) and asserts that
// steps after the first allocate zero times, with prefill, continue tokens, every
// sampling mode and queued (submitted, then collected) steps in the mix.
#include <gtest/gtest.h>

#include <vector>

#include "counting_new.h"
#include "model/cpu/cpu_engine.h"
#include "model/weights.h"
#include "test_models.h"

namespace m3 {
namespace {

TEST(CpuEngineAllocation, StepsAllocateNothing) {
  ModelConfig c = testing::small_config();
  c.d_intermediate = 64;
  c.ssm.is_outproj_norm = true;
  c.tie_embeddings = false;
  testing::ScratchDir dir("no_alloc");
  testing::write_model(c, dir.path());
  const ModelWeights weights = ModelWeights::load(dir.path());
  EngineOptions o;
  o.max_slots = 4;
  o.cpu_threads = 2;
  auto engine = make_cpu_engine(weights, o);
  SamplingParams topk, topp, plain;
  topk.temperature = 0.9f;
  topk.top_k = 20;
  topp.temperature = 1.1f;
  topp.top_p = 0.8f;
  plain.temperature = 1.0f;
  engine->set_sampling(1, topk);
  engine->set_sampling(2, topp);
  engine->set_sampling(3, plain);

  std::vector<int32_t> all = {0, 1, 2, 3}, first = {5, 6, 7, 8}, cont = {-1, -1, -1, -1};
  std::vector<int32_t> sampled(4);
  std::vector<float> logits(4 * static_cast<size_t>(c.padded_vocab()));
  engine->step(all, first, sampled, logits);  // warm-up
  // ... and the queue of submitted steps (the server's way): its sample buffers grow to
  // the batch once, at each of its two places.
  for (int i = 0; i < 2; ++i) {
    engine->submit_step(all, cont);
    engine->collect_step(sampled);
  }

  const std::vector<int32_t> pair = {3, 1}, pair_tokens = {-1, 100};
  testing::start_counting_allocations();
  for (int i = 0; i < 30; ++i) {
    engine->step(all, cont, sampled, logits);
    engine->step(pair, pair_tokens, std::span<int32_t>(sampled.data(), 2));
    engine->reset(0);
    engine->set_sampling(0, i % 2 ? topk : plain);  // once a request in a server
    engine->step(std::span<const int32_t>(all.data(), 1), std::span<const int32_t>(first.data(), 1),
                 std::span<int32_t>(sampled.data(), 1));
    engine->submit_step(all, cont);
    engine->submit_step(pair, pair_tokens);
    engine->collect_step(sampled);
    engine->collect_step(std::span<int32_t>(sampled.data(), 2));
  }
  EXPECT_EQ(testing::stop_counting_allocations(), 0);

  // The counter does count: a std::vector in the window is seen.
  testing::start_counting_allocations();
  std::vector<int>* probe = new std::vector<int>(10);
  const long seen = testing::stop_counting_allocations();
  delete probe;
  EXPECT_EQ(seen, 2);
}

}  // namespace
}  // namespace m3
