// The CUDA engine's policy as text: its defaults (the plan the engine runs unless told
// otherwise) said in full, so a default that changes shows here; every setting read back
// as it was set; bad values refused naming the field.
#include <gtest/gtest.h>

#include "model/cuda_policy.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

TEST(CudaPolicyTest, DefaultsAreThePlannedStep) {
  EXPECT_EQ(to_string(CudaPolicy{}),
            "pdl=true chains=planned next_step_prefetch=true recurrence_tensor_core_min_batch=1 "
            "recurrence_fuse_max_batch=2 projection_gemm_min_batch=planned buckets_per_octave=16 prefill=auto prefill_graph_max_tokens=512 "
            "step_variants.out_proj_fused=measure "
            "step_variants.embedding_gathered=measure step_variants.batch1_gemv_rows_per_warp=measure "
            "step_variants.batch2_gemv=measure step_variants.fused_cluster=measure gemv.trigger=before_wait "
            "gemv.batch1_rows_per_warp=2 gemv.tensor_core_min_batch=2 gemv.row_block_min_batch=2 "
            "gemv.row_block_cluster=planned gemv.row_block_batch_tile=planned recurrence.trigger=planned "
            "recurrence.state_load=planned recurrence.tc_column_split=planned recurrence.small_batch_rows=16 "
            "recurrence.whole_head_min_batch=4 recurrence.streaming_min_batch=never");
  EXPECT_NO_THROW(CudaPolicy{}.validate());
}

TEST(CudaPolicyTest, EverySettingReadsBackWhatWasSet) {
  for (const CudaPolicySetting& s : cuda_policy_settings()) {
    SCOPED_TRACE(s.path);
    CudaPolicy p;
    const std::string before = s.get(p);
    EXPECT_EQ(set_cuda_policy_value(p, s.path, before), "");
    EXPECT_EQ(p, CudaPolicy{});
    EXPECT_FALSE(s.help.empty());
    EXPECT_EQ(cuda_policy_flag(s.path).rfind("--cuda-", 0), 0u);
  }
  CudaPolicy p;
  EXPECT_TRUE(set_cuda_policy_flag(p, "--cuda-recurrence-tensor-core-min-batch", "never"));
  EXPECT_EQ(p.recurrence_tensor_core_min_batch, 0);
  EXPECT_TRUE(set_cuda_policy_flag(p, "--cuda-recurrence-trigger", "after_inputs"));
  EXPECT_EQ(p.recurrence.trigger, kernels::RecurrenceTrigger::AfterInputs);
  EXPECT_FALSE(set_cuda_policy_flag(p, "--cuda-graphs", "false"));  // not a policy flag
  EXPECT_EQ(test::error_of<std::invalid_argument>([&] { set_cuda_policy_flag(p, "--cuda-pdl", "2"); }),
            "--cuda-pdl: expected true or false, got '2'");
}

TEST(CudaPolicyTest, RefusesValuesNoPlannerTakesNamingTheField) {
  auto refusal = [](auto&& change) {
    CudaPolicy p;
    change(p);
    return test::error_of<std::invalid_argument>([&] { p.validate(); });
  };
  EXPECT_EQ(refusal([](CudaPolicy& p) { p.step_variants.fused_cluster = 2; }),
            "cuda.step_variants.fused_cluster must be 0 (measure), 4 or 8, got 2");
  EXPECT_EQ(refusal([](CudaPolicy& p) { p.step_variants.batch1_gemv_rows_per_warp = 1; }),
            "cuda.step_variants.batch1_gemv_rows_per_warp must be 0 (measure), 2 or 4, got 1");
  EXPECT_EQ(refusal([](CudaPolicy& p) { p.gemv.row_block_batch_tile = 12; }),
            "cuda.gemv.row_block_batch_tile must be 0 (planned), 8, 16, 32 or 64, got 12");
  EXPECT_EQ(refusal([](CudaPolicy& p) { p.recurrence.whole_head_min_batch = 0; }),
            "cuda.recurrence.whole_head_min_batch must be at least 1, got 0");
  EXPECT_EQ(refusal([](CudaPolicy& p) { p.recurrence_fuse_max_batch = -1; }),
            "cuda.recurrence_fuse_max_batch must be 0 or more, got -1");
  EXPECT_EQ(refusal([](CudaPolicy& p) { p.buckets_per_octave = 3; }),
            "cuda.buckets_per_octave must be 1, 2, 4, 8 or 16, got 3");
  EXPECT_EQ(refusal([](CudaPolicy& p) { p.prefill_graph_max_tokens = 4096; }),
            "cuda.prefill_graph_max_tokens must be 0 (never) to 2048, got 4096");
  EXPECT_EQ(refusal([](CudaPolicy& p) { p.projection_gemm_min_batch = -2; }),
            "cuda.projection_gemm_min_batch must be -1 (planned), 0 (never) or more, got -2");
}

// projection_gemm_min_batch reads planned, never or a batch, and says so when it is none.
TEST(CudaPolicyTest, ProjectionGemmsArePlannedNeverOrFromABatch) {
  CudaPolicy p;
  EXPECT_EQ(p.projection_gemm_min_batch, -1);
  EXPECT_EQ(set_cuda_policy_value(p, "projection_gemm_min_batch", "never"), "");
  EXPECT_EQ(p.projection_gemm_min_batch, 0);
  EXPECT_TRUE(set_cuda_policy_flag(p, "--cuda-projection-gemm-min-batch", "256"));
  EXPECT_EQ(p.projection_gemm_min_batch, 256);
  EXPECT_NE(to_string(p).find("projection_gemm_min_batch=256"), std::string::npos);
  EXPECT_EQ(set_cuda_policy_value(p, "projection_gemm_min_batch", "planned"), "");
  EXPECT_EQ(p, CudaPolicy{});
  EXPECT_EQ(set_cuda_policy_value(p, "projection_gemm_min_batch", "soon"),
            "expected an integer, never or planned, got 'soon'");
}

}  // namespace
}  // namespace m3
