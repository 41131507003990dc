// The CUDA engine against the CPU reference engine (the whole step, sampling included),
// its graph replay against direct launches, the bucket padding, reset, argument errors,
// and the promise that a decode step allocates nothing and is one graph replay.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gpu_test_util.h"
#include "tests/error_of.h"
#include "model/cpu/cpu_engine.h"
#include "model/cuda/cuda_engine.h"
#include "model/cuda/device_buffer.h"
#include "model/cuda/profiling.h"
#include "model/cuda/step_gemms.h"
#include "model/weights.h"
#include "test_models.h"

namespace m3 {
namespace {

using testing::ScratchDir;

TEST(CudaEngineNoDevice, FailsClearlyWithoutADevice) {
  if (testing::cuda_device_present()) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_EQ(cuda_device_count(), 0);
  ScratchDir dir("cuda_nodev");
  testing::write_model(testing::small_config(), dir.path());
  const ModelWeights w = ModelWeights::load(dir.path());
  const std::string msg = test::error_of([&] { make_cuda_engine(w, EngineOptions{}); });
  EXPECT_NE(msg.find("device 0 requested, 0 visible"), std::string::npos) << msg;
}

// The plan report as m3bench --plan prints it: consecutive launches of one kernel and
// variant counted once, every chain on its own line. (Host only: runs without a device.)
TEST(StepPlanReport, SaysEachChainsKernelsCountingRepeats) {
  cuda::StepPlanReport r;
  r.bucket = 32;
  r.variant = cuda::StepVariant{false, true, 0, 0};
  const cuda::PlannedKernel in_proj{"in_proj", "tensor cores, 128-row blocks, batch tile 16, cluster 4, chunk 7"};
  const cuda::PlannedKernel rec{"mimo_step_tc", "tensor cores, 2 warps a row tile, plain state loads, trigger 1"};
  const cuda::PlannedKernel sampling{"sampling", ""};
  r.chains = {{in_proj, rec, in_proj, rec, sampling}, {in_proj, in_proj, sampling}};
  EXPECT_EQ(cuda::to_string(r),
            "bucket 32: 2 chains, out_proj separate, embedding gathered\n"
            "  chain 0: in_proj [tensor cores, 128-row blocks, batch tile 16, cluster 4, chunk 7], mimo_step_tc "
            "[tensor cores, 2 warps a row tile, plain state loads, trigger 1], in_proj [tensor cores, 128-row blocks, "
            "batch tile 16, cluster 4, chunk 7], mimo_step_tc [tensor cores, 2 warps a row tile, plain state loads, "
            "trigger 1], sampling\n"
            "  chain 1: in_proj [tensor cores, 128-row blocks, batch tile 16, cluster 4, chunk 7] x2, sampling\n");
}

struct Variant {
  const char* name;
  void (*tweak)(ModelConfig&);
};

// The s2s-14l head shape (64 x 128 state per head, rank 4): where bf16 engines fuse
// out_proj into the recurrence in the batch-1 bucket.
void s2s_head_shape(ModelConfig& c) {
  c.ssm.mimo_rank = 4;
  c.ssm.headdim = 64;
  c.ssm.d_state = 128;
}

const Variant kVariants[] = {
    {"plain", [](ModelConfig&) {}},
    {"mlp_outnorm_untied", [](ModelConfig& c) {
       c.d_intermediate = 100;
       c.ssm.is_outproj_norm = true;
       c.tie_embeddings = false;
     }},
    {"rope_full_rank4", [](ModelConfig& c) {
       c.ssm.rope_fraction = 1.0;
       c.ssm.mimo_rank = 4;
       c.ssm.d_state = 32;
     }},
    {"s2s_head_shape", s2s_head_shape},  // unfused in these buckets of 4
};

class CudaEngineTest : public ::testing::Test {
 protected:
  void load(const ModelConfig& c) {
    dir_ = std::make_unique<ScratchDir>("cuda_engine");
    testing::write_model(c, dir_->path());
    weights_ = std::make_unique<ModelWeights>(ModelWeights::load(dir_->path()));
  }
  std::unique_ptr<Engine> cuda(int slots, WeightDType dtype = WeightDType::F32, bool graphs = true,
                               const CudaPolicy& policy = {}) {
    EngineOptions o;
    o.max_slots = slots;
    o.weight_dtype = dtype;
    o.use_graphs = graphs;
    o.cuda = policy;
    return make_cuda_engine(*weights_, o);
  }
  std::unique_ptr<Engine> cpu(int slots) {
    EngineOptions o;
    o.max_slots = slots;
    o.cpu_threads = 2;
    return make_cpu_engine(*weights_, o);
  }
  int V() const { return weights_->config().padded_vocab(); }

  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<ModelWeights> weights_;
};

double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num = std::max(num, static_cast<double>(std::abs(a[i] - ref[i])));
    if (std::isnan(a[i])) num = INFINITY;
    den = std::max(den, static_cast<double>(std::abs(ref[i])));
  }
  return num / den;
}

// The sequences of `slots` side by side, row i fed first_token(i) and then five continue
// tokens, in both engines: fp32 logits within 1e-4 of the CPU engine's, the same ids.
template <typename FirstToken>
void steps_match_cpu(Engine& gpu, Engine& cpu, const std::vector<int32_t>& slots, int V, FirstToken first_token) {
  const int n = static_cast<int>(slots.size());
  std::vector<int32_t> g_ids(n), c_ids(n);
  std::vector<float> g_logits(static_cast<size_t>(n) * V), c_logits(g_logits.size());
  for (int t = 0; t < 6; ++t) {
    std::vector<int32_t> tokens(n, kContinueToken);
    if (t == 0) {
      for (int i = 0; i < n; ++i) tokens[i] = first_token(i);
    }
    gpu.step(slots, tokens, g_ids, g_logits);
    cpu.step(slots, tokens, c_ids, c_logits);
    ASSERT_LT(rel_err(g_logits, c_logits), 1e-4) << "step " << t;
    ASSERT_EQ(g_ids, c_ids) << "step " << t;
  }
}

// Three slots decode side by side (prompt, then continue tokens), greedy and sampled;
// compares logits and ids with the CPU engine step by step. Where ids may differ (bf16)
// and do, both engines are fed the CPU engine's ids from then on, so that all 24 steps'
// logits are compared on the same inputs.
void compare_with_cpu(Engine& gpu, Engine& cpu, int V, double tol, bool expect_same_ids) {
  const std::vector<int32_t> slots = {2, 0, 1};
  const std::vector<std::vector<int32_t>> prompts = {{5, 17, 100, 3}, {9}, {200, 201, 7}};
  const SamplingParams sp[3] = {{0.f, 0, 1.f, 0}, {0.8f, 20, 0.9f, 42}, {1.2f, 0, 1.f, 7}};
  for (int i = 0; i < 3; ++i) {
    gpu.set_sampling(slots[i], sp[i]);
    cpu.set_sampling(slots[i], sp[i]);
  }
  std::vector<int32_t> g_ids(3), c_ids(3);
  std::vector<float> g_logits(3 * V), c_logits(3 * V);
  bool parted = false;
  for (int t = 0; t < 24; ++t) {
    std::vector<int32_t> tokens(3);
    for (int i = 0; i < 3; ++i) {
      const auto& p = prompts[i];
      tokens[i] = t < static_cast<int>(p.size()) ? p[t] : parted ? c_ids[i] : kContinueToken;
    }
    gpu.step(slots, tokens, g_ids, g_logits);
    cpu.step(slots, tokens, c_ids, c_logits);
    ASSERT_LT(rel_err(g_logits, c_logits), tol) << "step " << t;
    if (expect_same_ids) {
      ASSERT_EQ(g_ids, c_ids) << "step " << t;
    } else {
      parted = parted || g_ids != c_ids;
    }
  }
}

TEST_F(CudaEngineTest, MatchesCpuEngineFp32) {
  M3_REQUIRE_CUDA_DEVICE();
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    ModelConfig c = testing::small_config();
    v.tweak(c);
    load(c);
    auto gpu = cuda(4);
    auto ref = cpu(4);
    compare_with_cpu(*gpu, *ref, V(), 1e-4, true);
  }
}

TEST_F(CudaEngineTest, MatchesCpuEngineBf16) {
  M3_REQUIRE_CUDA_DEVICE();
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    ModelConfig c = testing::small_config();
    v.tweak(c);
    load(c);
    auto gpu = cuda(4, WeightDType::BF16);
    auto ref = cpu(4);
    compare_with_cpu(*gpu, *ref, V(), 3e-2, false);
  }
}

TEST_F(CudaEngineTest, GraphReplayEqualsDirectLaunchesAndBucketsAreIndependent) {
  M3_REQUIRE_CUDA_DEVICE();
  load(testing::small_config());
  // fp32 weights: bf16 engines round x to bf16 in the tensor-core gemv (batch >= 2), so a
  // one-slot bf16 engine would not match a batched one to 1e-6.
  auto graphed = cuda(6, WeightDType::F32, true);
  auto direct = cuda(6, WeightDType::F32, false);
  auto single = cuda(1, WeightDType::F32, true);
  const std::vector<int32_t> slots = {4, 1, 5};  // 3 of 6: bucket 4, one padding entry
  std::vector<int32_t> a(3), b(3), s(1);
  std::vector<float> la(3 * V()), lb(3 * V()), ls(V());
  for (int t = 0; t < 10; ++t) {
    const std::vector<int32_t> tokens = t == 0 ? std::vector<int32_t>{1, 2, 3}
                                               : std::vector<int32_t>{kContinueToken, kContinueToken, kContinueToken};
    graphed->step(slots, tokens, a, la);
    direct->step(slots, tokens, b, lb);
    // Same kernels; the fused out_proj adds with atomics, so only rounding may differ.
    ASSERT_LT(rel_err(la, lb), 1e-5) << "step " << t;
    ASSERT_EQ(a, b);
    // Entry 1 alone in a one-slot engine gives the same numbers as inside the batch, up to
    // fp32 rounding: alone, out_proj runs inside the recurrence and adds with atomics in a
    // varying order; in the batch it is a kernel of its own (seen: 1.02e-06 after a few
    // steps). Another entry's rows leaking in would be far larger.
    const std::vector<int32_t> one = {t == 0 ? 2 : kContinueToken};
    single->step(std::vector<int32_t>{0}, one, s, ls);
    ASSERT_EQ(s[0], a[1]);
    ASSERT_LT(rel_err(ls, std::vector<float>(la.begin() + V(), la.begin() + 2 * V())), 1e-5);
  }
  EXPECT_EQ(graphed->stats().graph_replays, 10u);
  EXPECT_EQ(direct->stats().graph_replays, 0u);
  EXPECT_EQ(graphed->stats().tokens, 30u);
}

// From batch 32 a bucket's step runs as two chains of kernels side by side, each for half
// the rows (CudaEngine::chains_for_batch): every row must still get what the CPU engine
// gives it, sampled rows included, in both halves.
TEST_F(CudaEngineTest, SplitBucketsMatchCpuEngine) {
  M3_REQUIRE_CUDA_DEVICE();
  load(testing::small_config());
  constexpr int kSlots = 40;  // buckets ..., 32, 40: 33 sequences take the 40 bucket
  auto gpu = cuda(kSlots);
  auto ref = cpu(kSlots);
  auto* impl = cuda::cuda_profiling(*gpu);
  ASSERT_NE(impl, nullptr);
  constexpr int n = 33;
  ASSERT_EQ(impl->bucket_for(n), 40);
  // Bucket 16 runs one chain of the same kernel kinds (the small buckets' variants differ).
  ASSERT_EQ(impl->kernels_per_step(n), 2 * impl->kernels_per_step(16)) << "the 40 bucket is not split";
  ASSERT_EQ(impl->step_plan(n).chains.size(), 2u) << cuda::to_string(impl->step_plan(n));
  std::vector<int32_t> slots(n);
  for (int i = 0; i < n; ++i) {
    slots[i] = (i * 7) % kSlots;  // scattered slots, rows of both halves
    if (i % 3 == 1) {
      const SamplingParams sp{0.9f, 10, 0.95f, static_cast<uint64_t>(100 + i)};
      gpu->set_sampling(slots[i], sp);
      ref->set_sampling(slots[i], sp);
    }
  }
  steps_match_cpu(*gpu, *ref, slots, V(), [](int i) { return (i * 13 + 1) % 200; });
}

// Above batch 64 the buckets step by a sixteenth of the octave (model/decode_buckets.h): 70
// sequences of a 100-slot engine run at the 72 bucket, two chains, as the CPU engine does.
TEST_F(CudaEngineTest, FineBucketsAbove64MatchCpuEngine) {
  M3_REQUIRE_CUDA_DEVICE();
  load(testing::small_config());
  constexpr int kSlots = 100;
  auto gpu = cuda(kSlots);
  auto ref = cpu(kSlots);
  auto* impl = cuda::cuda_profiling(*gpu);
  ASSERT_NE(impl, nullptr);
  EXPECT_EQ(impl->bucket_sizes(), (std::vector<int>{1, 2, 4, 8, 16, 32, 64, 68, 72, 76, 80, 84, 88, 92, 96, 100}));
  constexpr int n = 70;
  ASSERT_EQ(impl->bucket_for(n), 72);
  std::vector<int32_t> slots(n);
  for (int i = 0; i < n; ++i) slots[i] = (i * 3) % kSlots;
  steps_match_cpu(*gpu, *ref, slots, V(), [](int i) { return (i * 11 + 3) % 200; });
}

// The sequences of `slots` side by side (the prompt {5, 17, 100} plus each one's index,
// then continue tokens; greedy, then sampled) in both engines; logits within `tol` of the
// CPU engine's until the ids part (bf16 trajectories may). Returns every step's logits.
std::vector<float> decode_against_cpu(Engine& gpu, Engine& cpu, int V, double tol,
                                      const std::vector<int32_t>& slots) {
  const size_t n = slots.size();
  std::vector<float> all;
  for (const SamplingParams& sp : {SamplingParams{0.f, 0, 1.f, 0}, SamplingParams{0.9f, 20, 0.95f, 5}}) {
    for (int32_t s : slots) {
      gpu.reset(s);
      cpu.reset(s);
      gpu.set_sampling(s, sp);
      cpu.set_sampling(s, sp);
    }
    const std::vector<int32_t> prompt = {5, 17, 100};
    std::vector<int32_t> g_ids(n), c_ids(n);
    std::vector<float> g_logits(n * V), c_logits(n * V);
    for (int t = 0; t < 16; ++t) {
      std::vector<int32_t> tokens(n);
      for (size_t i = 0; i < n; ++i) tokens[i] = t < 3 ? prompt[t] + static_cast<int32_t>(i) : kContinueToken;
      gpu.step(slots, tokens, g_ids, g_logits);
      cpu.step(slots, tokens, c_ids, c_logits);
      all.insert(all.end(), g_logits.begin(), g_logits.end());
      EXPECT_LT(rel_err(g_logits, c_logits), tol) << "step " << t << ", temperature " << sp.temperature;
      if (g_ids != c_ids) break;
    }
  }
  return all;
}

// The small buckets' step has variants (out_proj inside the recurrence or not, summed
// over clusters of 4 or 8 blocks; the embedding gathered by the first in_proj or its own
// kernel; at batch 1 two or four rows a warp in the CUDA-core gemvs, at batch 2 the
// tensor-core gemvs or the CUDA-core ones with four rows a warp): the engine measures
// them at load and keeps the fastest. Buckets 1 and 2 of a bf16 engine with the s2s-14l
// head shape have twelve each, bucket 4 none. Forced one by one, each variant decodes
// what the CPU engine decodes, alone and in pairs, and the two embedding ways give the
// same logits bit for bit.
TEST_F(CudaEngineTest, SmallBucketVariantsAreMeasuredAtLoadAndAllMatchCpuEngine) {
  M3_REQUIRE_CUDA_DEVICE();
  ModelConfig c = testing::small_config();
  s2s_head_shape(c);
  load(c);
  {
    auto gpu = cuda(4, WeightDType::BF16);
    auto* impl = cuda::cuda_profiling(*gpu);
    ASSERT_NE(impl, nullptr);
    for (const int batch : {1, 2}) {
      const auto& measured = impl->step_variant_timings(batch);
      ASSERT_EQ(measured.size(), 12u) << "batch " << batch;
      auto fastest = measured.begin();
      for (auto it = measured.begin(); it != measured.end(); ++it) {
        EXPECT_GT(it->second, 0.f) << "batch " << batch << ": " << cuda::to_string(it->first);
        if (it->second < fastest->second) fastest = it;
      }
      EXPECT_EQ(impl->step_variant(batch), fastest->first) << "batch " << batch;
    }
    const cuda::StepVariant chosen = impl->step_variant(1);
    EXPECT_TRUE(impl->step_variant_timings(4).empty());
    EXPECT_EQ(impl->step_variant(4), (cuda::StepVariant{false, true}));
    // The plan is the chosen variant: n_layer out_proj kernels fewer when fused, one
    // embedding kernel more when not gathered.
    EXPECT_EQ(impl->kernels_per_step(1), impl->kernels_per_step(4) - (chosen.out_proj_fused ? c.n_layer : 0) +
                                             (chosen.embedding_gathered ? 0 : 1));
    // What the server logs at start.
    const std::string report = gpu->load_report();
    EXPECT_NE(report.find("batch 1: " + cuda::to_string(chosen) + " ("), std::string::npos) << report;
    EXPECT_NE(report.find("fastest of 12 measured); batch 2: "), std::string::npos) << report;
  }
  auto ref = cpu(3);
  std::vector<float> by_embedding[2];
  for (const bool fused : {true, false}) {
    for (const bool gathered : {true, false}) {
      for (const int rows_per_warp : {2, 4}) {
        for (const int cluster : {8, 4}) {
          if (!fused && cluster == 4) continue;  // no clusters without the fused out_proj
          SCOPED_TRACE("out_proj fused " + std::to_string(fused) + ", embedding gathered " +
                       std::to_string(gathered) + ", gemv rows a warp " + std::to_string(rows_per_warp) +
                       ", clusters of " + std::to_string(cluster));
          CudaPolicy policy;
          policy.step_variants.out_proj_fused = fused ? Tuned::On : Tuned::Off;
          policy.step_variants.embedding_gathered = gathered ? Tuned::On : Tuned::Off;
          policy.step_variants.batch1_gemv_rows_per_warp = rows_per_warp;
          policy.step_variants.batch2_gemv = rows_per_warp == 4 ? Batch2Gemv::CudaCores : Batch2Gemv::TensorCores;
          policy.step_variants.fused_cluster = cluster;
          auto gpu = cuda(3, WeightDType::BF16, true, policy);
          auto* impl = cuda::cuda_profiling(*gpu);
          ASSERT_NE(impl, nullptr);
          const cuda::StepVariant want{fused, gathered, rows_per_warp, fused ? cluster : 0};
          EXPECT_EQ(impl->step_variant(1), want) << cuda::to_string(impl->step_variant(1));
          EXPECT_TRUE(impl->step_variant_timings(1).empty()) << "a fixed variant is not measured";
          // Batch 2: the CUDA-core gemvs with four rows a warp, or the tensor-core ones.
          const cuda::StepVariant want2{want.out_proj_fused, want.embedding_gathered, rows_per_warp == 4 ? 4 : 0,
                                        want.fused_cluster};
          EXPECT_EQ(impl->step_variant(2), want2) << cuda::to_string(impl->step_variant(2));
          EXPECT_TRUE(impl->step_variant_timings(2).empty()) << "a fixed variant is not measured";
          EXPECT_EQ(gpu->load_report(), "");
          // The plan says so kernel by kernel: at batch 1 the fused recurrence with its
          // clusters (no out_proj kernel) or out_proj as its own kernel, the embedding
          // kernel or none, the CUDA-core gemvs with the rows a warp asked for.
          const cuda::StepPlanReport plan = impl->step_plan(1);
          ASSERT_EQ(plan.chains.size(), 1u);
          int out_proj = 0, embedding = 0, fused_recurrences = 0, gemvs = 0;
          for (const cuda::PlannedKernel& k : plan.chains[0]) {
            out_proj += k.name == "out_proj";
            embedding += k.name == "embedding";
            fused_recurrences += k.variant.find("out_proj fused, clusters of " + std::to_string(cluster)) !=
                                 std::string::npos;
            if (k.name == "in_proj" || k.name == "lm_head") {
              ++gemvs;
              EXPECT_NE(k.variant.find("cuda cores, batch tile 1, rows a warp " + std::to_string(rows_per_warp)),
                        std::string::npos)
                  << k.name << ": " << k.variant;
            }
          }
          EXPECT_EQ(out_proj, fused ? 0 : c.n_layer) << cuda::to_string(plan);
          EXPECT_EQ(fused_recurrences, fused ? c.n_layer : 0) << cuda::to_string(plan);
          EXPECT_EQ(embedding, gathered ? 0 : 1) << cuda::to_string(plan);
          EXPECT_EQ(gemvs, c.n_layer + 1) << cuda::to_string(plan);
          decode_against_cpu(*gpu, *ref, V(), 3e-2, {2, 0});  // batch 2
          const std::vector<float> logits = decode_against_cpu(*gpu, *ref, V(), 3e-2, {2});
          if (!fused && rows_per_warp == 2) by_embedding[gathered] = logits;  // no atomics
        }
      }
    }
  }
  ASSERT_FALSE(by_embedding[0].empty());
  EXPECT_EQ(by_embedding[0], by_embedding[1]) << "the gathered embedding rows differ from the kernel's";
}

// The policy's fields reach the plan, as the plan reports it: chains fixed at one (the
// 40 bucket unsplit), the row-block gemv's cluster and batch tile, the recurrence's state
// loads, column split and trigger point; and a policy the planners refuse stops the load
// naming the field.
TEST_F(CudaEngineTest, PolicyFieldsShapeTheReportedPlan) {
  M3_REQUIRE_CUDA_DEVICE();
  ModelConfig c = testing::small_config();
  s2s_head_shape(c);
  load(c);
  CudaPolicy policy;
  policy.chains = 1;
  policy.gemv.row_block_cluster = 2;
  policy.gemv.row_block_batch_tile = 16;
  policy.recurrence.state_load = kernels::StateLoad::Plain;
  policy.recurrence.tc_column_split = 1;
  policy.recurrence.trigger = kernels::RecurrenceTrigger::AfterNorms;
  auto gpu = cuda(40, WeightDType::BF16, true, policy);
  auto* impl = cuda::cuda_profiling(*gpu);
  ASSERT_NE(impl, nullptr);
  EXPECT_EQ(impl->policy(), policy);
  const cuda::StepPlanReport plan = impl->step_plan(33);
  ASSERT_EQ(plan.chains.size(), 1u) << cuda::to_string(plan);
  int in_proj = 0, recurrence = 0;
  for (const cuda::PlannedKernel& k : plan.chains[0]) {
    if (k.name == "in_proj") {
      ++in_proj;
      EXPECT_NE(k.variant.find("128-row blocks, batch tile 16, cluster 2,"), std::string::npos) << k.variant;
    }
    if (k.name == "mimo_step_tc") {
      ++recurrence;
      EXPECT_EQ(k.variant, "tensor cores, 1 warp a row tile, plain state loads, trigger 4");
    }
  }
  EXPECT_EQ(in_proj, c.n_layer);
  EXPECT_EQ(recurrence, c.n_layer);
  auto ref = cpu(40);
  decode_against_cpu(*gpu, *ref, V(), 3e-2, {3, 0, 17, 39});

  CudaPolicy bad;
  bad.recurrence.small_batch_rows = 12;
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { cuda(2, WeightDType::BF16, true, bad); }),
            "cuda.recurrence.small_batch_rows must be 8 or 16, got 12");
}

// recurrence.streaming_min_batch puts the streaming recurrence into every bucket from that
// batch (both chains of a split one), and the engine decodes as the CPU engine does there
// and below it.
TEST_F(CudaEngineTest, StreamingRecurrenceFromItsBatchDecodesAsTheCpuEngine) {
  M3_REQUIRE_CUDA_DEVICE();
  ModelConfig c = testing::small_config();
  s2s_head_shape(c);
  load(c);
  CudaPolicy policy;
  policy.recurrence.streaming_min_batch = 8;
  auto gpu = cuda(40, WeightDType::BF16, true, policy);
  auto* impl = cuda::cuda_profiling(*gpu);
  ASSERT_NE(impl, nullptr);
  for (const int batch : {4, 16, 40}) {
    const cuda::StepPlanReport plan = impl->step_plan(batch);
    int streaming = 0, per_head = 0;
    for (const auto& chain : plan.chains) {
      for (const cuda::PlannedKernel& k : chain) {
        streaming += k.name == "mimo_step_stream";
        per_head += k.name == "mimo_step_tc";
      }
    }
    const int chain_batch = batch / static_cast<int>(plan.chains.size());
    EXPECT_EQ(streaming, chain_batch >= 8 ? c.n_layer * static_cast<int>(plan.chains.size()) : 0) << cuda::to_string(plan);
    EXPECT_EQ(per_head, chain_batch >= 8 ? 0 : c.n_layer * static_cast<int>(plan.chains.size())) << cuda::to_string(plan);
  }
  auto ref = cpu(40);
  decode_against_cpu(*gpu, *ref, V(), 3e-2, {3, 0, 17, 39});
  std::vector<int32_t> sixteen(16);
  std::iota(sixteen.begin(), sixteen.end(), 20);
  decode_against_cpu(*gpu, *ref, V(), 3e-2, sixteen);
}

// cuda.projection_gemm_min_batch puts the projections of every bucket from that batch on
// cuBLASLt GEMMs (RMSNorm before in_proj, fc1 and lm_head in kernels of their own); below
// it the gemvs stay. Planned, a bucket on GEMMs is one chain; with two chains forced, each
// chain has GEMM plans of its own for its rows. Each way the engine decodes as the CPU
// engine does, with bf16 and fp32 weights, with and without the MLP, alone and side by
// side with other slots.
TEST_F(CudaEngineTest, ProjectionGemmsFromTheirBatchDecodeAsTheCpuEngine) {
  M3_REQUIRE_CUDA_DEVICE();
  for (const bool mlp : {false, true}) {
    ModelConfig c = testing::small_config();
    s2s_head_shape(c);
    if (mlp) {
      c.d_intermediate = 100;
      c.ssm.is_outproj_norm = true;
      c.tie_embeddings = false;
    }
    load(c);
    for (const auto& [dtype, forced_chains] : {std::pair{WeightDType::BF16, 0}, std::pair{WeightDType::F32, 0},
                                               std::pair{WeightDType::BF16, 2}}) {
      SCOPED_TRACE(std::string(mlp ? "mlp, " : "") + (dtype == WeightDType::BF16 ? "bf16" : "fp32") +
                   (forced_chains ? ", two chains" : ""));
      CudaPolicy policy;
      policy.projection_gemm_min_batch = 8;
      policy.chains = forced_chains;
      auto gpu = cuda(40, dtype, true, policy);
      auto* impl = cuda::cuda_profiling(*gpu);
      ASSERT_NE(impl, nullptr);
      for (const int batch : {4, 16, 40}) {
        const cuda::StepPlanReport plan = impl->step_plan(batch);
        int gemms = 0, norms = 0, gemvs = 0;
        for (const auto& chain : plan.chains) {
          for (const cuda::PlannedKernel& k : chain) {
            gemms += k.variant.rfind("cuBLASLt GEMM", 0) == 0;
            norms += k.name.ends_with("_norm");
            gemvs += (k.name == "in_proj" || k.name == "out_proj" || k.name == "lm_head" || k.name == "fc1" ||
                      k.name == "fc2") &&
                     k.variant.rfind("cuBLASLt GEMM", 0) != 0;
          }
        }
        const int chains = static_cast<int>(plan.chains.size());
        if (batch == 40) EXPECT_EQ(chains, forced_chains ? forced_chains : 1) << cuda::to_string(plan);
        const int per_layer = mlp ? 4 : 2;  // in_proj, out_proj (+ fc1, fc2)
        EXPECT_EQ(gemms, batch >= 8 ? chains * (c.n_layer * per_layer + 1) : 0) << cuda::to_string(plan);
        EXPECT_EQ(norms, batch >= 8 ? chains * (c.n_layer * (mlp ? 2 : 1) + 1) : 0) << cuda::to_string(plan);
        if (batch < 8) EXPECT_GT(gemvs, 0) << cuda::to_string(plan);
        if (batch >= 8) EXPECT_EQ(gemvs, 0) << cuda::to_string(plan);
      }
      auto ref = cpu(40);
      const double tol = dtype == WeightDType::BF16 ? 3e-2 : 1e-3;
      decode_against_cpu(*gpu, *ref, V(), tol, {3, 0, 17, 39});
      std::vector<int32_t> many(33);
      std::iota(many.begin(), many.end(), 5);
      decode_against_cpu(*gpu, *ref, V(), tol, many);
    }
  }
}

// A model whose projection rows are not whole 16-byte pieces cannot take the step's GEMMs:
// the refusal names the projection, its shape and the rule (the engine then keeps the
// gemvs). Host code only: runs without a GPU.
TEST(StepGemmRefusal, NamesTheProjectionItsShapeAndTheRule) {
  ModelConfig c = testing::small_config();
  EXPECT_EQ(cuda::step_gemm_refusal(c), "");
  c.d_model = 68;  // in_proj's inputs: not a multiple of 8
  c.ssm.headdim = 8;  // (17 heads of d_inner 136)
  EXPECT_EQ(cuda::step_gemm_refusal(c),
            "in_proj (" + std::to_string(c.padded_in_proj_rows()) +
                " x 68): in_features and x_stride must be multiples of 8, y_stride of 4 (16-byte rows)");
}

// EngineOptions::deterministic keeps atomics out of the step (out_proj is not fused at
// batch 1 or 2, bf16 or fp32), so a sequence decoded again from reset, sampled, gets the
// same logits bit for bit.
TEST_F(CudaEngineTest, DeterministicStepsRepeatBitForBit) {
  M3_REQUIRE_CUDA_DEVICE();
  ModelConfig c = testing::small_config();
  s2s_head_shape(c);
  load(c);
  for (const WeightDType dtype : {WeightDType::BF16, WeightDType::F32}) {
    SCOPED_TRACE(dtype == WeightDType::BF16 ? "bf16" : "fp32");
    EngineOptions o;
    o.max_slots = 2;
    o.weight_dtype = dtype;
    o.deterministic = true;
    auto e = make_cuda_engine(*weights_, o);
    auto* impl = cuda::cuda_profiling(*e);
    ASSERT_NE(impl, nullptr);
    ASSERT_FALSE(impl->step_variant(1).out_proj_fused);
    ASSERT_FALSE(impl->step_variant(2).out_proj_fused);
    auto run = [&] {
      e->reset(1);
      e->set_sampling(1, SamplingParams{0.9f, 20, 0.95f, 3});
      std::vector<float> all, logits(V());
      std::vector<int32_t> id(1);
      for (int t = 0; t < 12; ++t) {
        const std::vector<int32_t> token = {t < 2 ? 7 + t : kContinueToken};
        e->step(std::vector<int32_t>{1}, token, id, logits);
        all.insert(all.end(), logits.begin(), logits.end());
      }
      return all;
    };
    const std::vector<float> first = run();
    EXPECT_EQ(run(), first);
  }
}

TEST_F(CudaEngineTest, DecodeStepsAllocateNothingAndReplayOneGraph) {
  M3_REQUIRE_CUDA_DEVICE();
  ModelConfig c = testing::small_config();
  c.d_intermediate = 64;
  load(c);
  auto e = cuda(8, WeightDType::BF16);
  const uint64_t before = cuda::allocation_count();
  std::vector<int32_t> ids(8);
  std::vector<float> logits(8 * V());
  for (int t = 0; t < 100; ++t) {
    const int n = 1 + t % 8;
    std::vector<int32_t> slots(n), tokens(n);
    for (int i = 0; i < n; ++i) {
      slots[i] = (i * 3 + t) % 8;
      tokens[i] = (t + i) % 50;
    }
    if (t % 10 == 3) e->set_sampling(slots[0], {0.9f, 5, 0.9f, static_cast<uint64_t>(t)});
    std::span<int32_t> out(ids.data(), n);
    if (t % 2) {
      e->step(slots, tokens, out, std::span<float>(logits.data(), static_cast<size_t>(n) * V()));
    } else {
      e->step(slots, tokens, out);
    }
  }
  EXPECT_EQ(cuda::allocation_count(), before);
  EXPECT_EQ(e->stats().steps, 100u);
  EXPECT_EQ(e->stats().graph_replays, 100u);
  auto* impl = cuda::cuda_profiling(*e);
  ASSERT_NE(impl, nullptr);
  EXPECT_EQ(impl->bucket_sizes(), (std::vector<int>{1, 2, 4, 8}));
}

// submit_step / collect_step with the next step submitted before the previous one is
// collected (as the server runs them) sample what step() one at a time does: slots in two
// queued steps continue from the earlier one's sample; reset and set_sampling between
// submits apply from the next submitted step on. No allocation either way.
TEST_F(CudaEngineTest, PipelinedStepsSampleWhatStepsOneAtATimeDo) {
  M3_REQUIRE_CUDA_DEVICE();
  ModelConfig c = testing::small_config();
  s2s_head_shape(c);
  load(c);
  EngineOptions o;
  o.max_slots = 4;
  o.weight_dtype = WeightDType::BF16;
  o.deterministic = true;
  auto e = make_cuda_engine(*weights_, o);
  // Step t: slots and tokens; at step 6 slot 3 restarts (reset, new sampling) first.
  auto plan = [](int t, std::vector<int32_t>& slots, std::vector<int32_t>& tokens) {
    slots.clear();
    tokens.clear();
    for (int s = 0; s < 4; ++s) {
      if (s == 2 && t % 3 == 1) continue;  // sits some steps out
      slots.push_back(s);
      const bool fresh = t == 0 || (s == 3 && t == 6);
      tokens.push_back(fresh ? 5 + s + t : (s == 1 && t < 4 ? 40 + t : kContinueToken));
    }
  };
  auto restart = [&](int t) {
    if (t == 0) {
      for (int s = 0; s < 4; ++s) {
        e->reset(s);
        e->set_sampling(s, SamplingParams{s % 2 ? 0.8f : 0.f, 30, 0.9f, 11u + s});
      }
    }
    if (t == 6) {
      e->reset(3);
      e->set_sampling(3, SamplingParams{1.1f, 0, 0.95f, 77});
    }
  };
  constexpr int kSteps = 14;
  std::vector<int32_t> slots, tokens;
  std::vector<std::vector<int32_t>> one_at_a_time(kSteps), pipelined(kSteps);
  for (int t = 0; t < kSteps; ++t) {
    restart(t);
    plan(t, slots, tokens);
    one_at_a_time[t].resize(slots.size());
    e->step(slots, tokens, one_at_a_time[t]);
  }
  const uint64_t allocations = cuda::allocation_count();
  for (int t = 0; t <= kSteps; ++t) {
    if (t < kSteps) {
      restart(t);
      plan(t, slots, tokens);
      pipelined[t].resize(slots.size());
      e->submit_step(slots, tokens);
    }
    if (t > 0) e->collect_step(pipelined[t - 1]);
    EXPECT_EQ(e->queued_steps(), t < kSteps ? 1 : 0);
  }
  EXPECT_EQ(cuda::allocation_count(), allocations);
  EXPECT_EQ(pipelined, one_at_a_time);

  // The queue's limits.
  plan(1, slots, tokens);
  std::vector<int32_t> out(slots.size());
  e->submit_step(slots, tokens);
  e->submit_step(slots, tokens);
  EXPECT_EQ(test::error_of<std::logic_error>([&] { e->submit_step(slots, tokens); }),
            "submit_step: 2 steps are queued already; collect_step() one first");
  EXPECT_EQ(test::error_of<std::logic_error>([&] { e->step(slots, tokens, out); }),
            "step: 2 submitted steps are not collected yet; collect_step() them first");
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { e->collect_step(std::span<int32_t>(out.data(), 1)); }),
            "collect_step: the step has " + std::to_string(slots.size()) + " slots but 1 sampled entries");
  e->collect_step(out);
  e->collect_step(out);
  EXPECT_EQ(test::error_of<std::logic_error>([&] { e->collect_step(out); }), "collect_step: no step is queued");
}

TEST_F(CudaEngineTest, ResetStartsTheSequenceAgain) {
  M3_REQUIRE_CUDA_DEVICE();
  load(testing::small_config());
  auto e = cuda(2);
  e->set_sampling(1, {1.0f, 0, 1.f, 99});
  auto run = [&] {
    std::vector<int32_t> ids;
    std::vector<int32_t> out(1);
    for (int t = 0; t < 8; ++t) {
      e->step(std::vector<int32_t>{1}, std::vector<int32_t>{t == 0 ? 11 : kContinueToken}, out);
      ids.push_back(out[0]);
    }
    return ids;
  };
  const auto first = run();
  e->reset(1);
  EXPECT_EQ(run(), first);  // state, counter and last token all back to zero
}

TEST_F(CudaEngineTest, RejectsBadArguments) {
  M3_REQUIRE_CUDA_DEVICE();
  load(testing::small_config());
  auto e = cuda(3);
  std::vector<int32_t> out(2);
  auto expect_call_error = [](auto&& call, const std::string& text) {
    const std::string msg = test::error_of<std::invalid_argument>(call);
    EXPECT_NE(msg.find(text), std::string::npos) << msg;
  };
  auto expect_error = [&](std::vector<int32_t> slots, std::vector<int32_t> tokens, const std::string& text) {
    std::vector<int32_t> o(slots.size());
    expect_call_error([&] { e->step(slots, tokens, o); }, text);
  };
  expect_error({3}, {1}, "step: slot 3 is out of range [0, 3)");
  expect_error({1, 1}, {1, 2}, "step: slot 1 is listed twice");
  expect_error({0}, {203}, "step: slot 0: token 203 is outside [0, 203)");
  expect_error({0}, {kContinueToken}, "step: slot 0: kContinueToken but the slot has no sampled token yet");
  expect_error({0, 1, 2, 0}, {1, 1, 1, 1}, "step: 4 slots, more than max_slots 3");
  expect_call_error([&] { e->step(std::vector<int32_t>{0, 1}, std::vector<int32_t>{1}, out); },
                    "2 slots but 1 tokens");
  // The same through the pipelined entry point; a refused step queues nothing.
  expect_call_error([&] { e->submit_step(std::vector<int32_t>{0, 1}, std::vector<int32_t>{1}); },
                    "submit_step: 2 slots but 1 tokens");
  expect_call_error([&] { e->submit_step(std::vector<int32_t>{3}, std::vector<int32_t>{1}); },
                    "step: slot 3 is out of range [0, 3)");
  expect_call_error([&] { e->submit_step(std::vector<int32_t>{0, 1, 2, 0}, std::vector<int32_t>{1, 1, 1, 1}); },
                    "step: 4 slots, more than max_slots 3");
  EXPECT_EQ(e->queued_steps(), 0);
  expect_call_error([&] { e->reset(-1); }, "reset: slot -1 is out of range");
  expect_call_error([&] { e->set_sampling(0, {1.f, -1, 1.f, 0}); }, "set_sampling: slot 0");
}

TEST_F(CudaEngineTest, RefusesAShapeItsKernelsCannotRunInTheConfigsTerms) {
  M3_REQUIRE_CUDA_DEVICE();
  // d_state 260 validates (the CPU engine runs it); the recurrence kernels take at most 256.
  // Refused before any weight is uploaded, naming the config key rather than a kernel.
  ModelConfig c = testing::small_config();
  c.ssm.d_state = 260;
  load(c);
  std::string msg = test::error_of<std::invalid_argument>([&] { cuda(1); });
  EXPECT_NE(msg.find("cuda engine: cannot run this model: ssm_cfg.d_state = 260 must be a multiple of 4, at "
                     "most 256 (the cpu backend can)"),
            std::string::npos)
      << msg;
  // d_model 68 (17 heads of 8): the projections' rows break the gemvs' 16-byte loads.
  c = testing::small_config();
  c.d_model = 68;
  c.ssm.headdim = 8;
  load(c);
  msg = test::error_of<std::invalid_argument>([&] { cuda(1); });
  EXPECT_NE(msg.find("cuda engine: cannot run this model: d_model = 68 must be a multiple of 8 (16-byte weight "
                     "loads) (the cpu backend can)"),
            std::string::npos)
      << msg;
}

// A server builds its engine on one thread and steps it on its scheduler's, whose current
// device is 0 unless set: stepping device 1's engine from there must work, graphs or not.
// (With CUDA 13 it did before the engine made its device current too: the runtime sends
// stream-ordered calls to their stream's device. The test guards the arrangement, not
// that one call.)
TEST_F(CudaEngineTest, StepsFromAnotherThreadOnItsOwnDevice) {
  M3_REQUIRE_CUDA_DEVICE();
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices (" << cuda_device_count() << " visible)";
  load(testing::small_config());
  for (bool graphs : {true, false}) {  // without graphs every launch names a stream of device 1
    SCOPED_TRACE(graphs ? "graphs" : "direct launches");
    EngineOptions o;
    o.max_slots = 2;
    o.device = 1;
    o.use_graphs = graphs;
    auto e = make_cuda_engine(*weights_, o);
    auto reference = cpu(2);
    const std::vector<int32_t> slots = {1, 0}, tokens = {11, 42};
    std::vector<int32_t> got(2), want(2);
    reference->step(slots, tokens, want);
    std::string error;
    std::thread scheduler([&] {
      try {
        M3_CUDA_CHECK(cudaSetDevice(0));
        e->step(slots, tokens, got);
        e->reset(0);
        e->submit_step(slots, std::vector<int32_t>{kContinueToken, 7});
        std::vector<int32_t> next(2);
        e->collect_step(next);
      } catch (const std::exception& ex) {
        error = ex.what();
      }
    });
    scheduler.join();
    EXPECT_EQ(error, "");
    EXPECT_EQ(got, want);
    M3_CUDA_CHECK(cudaSetDevice(0));
    e.reset();  // destroyed from a thread whose current device is 0 as well
  }
}

}  // namespace
}  // namespace m3
