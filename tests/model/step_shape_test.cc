// The planned shape of a decode bucket's step (model/step_shape.h): where the projections
// move to GEMMs and how many chains a bucket splits into, and what explicit settings do.
#include "model/step_shape.h"

#include <gtest/gtest.h>

#include <vector>

namespace m3 {
namespace {

TEST(StepShapeTest, PlannedGemmsFrom128WithEitherStateDtype) {
  const CudaPolicy planned;
  EXPECT_EQ(projection_gemm_min_batch(planned), 128);
  EXPECT_FALSE(step_uses_gemms(planned, 120));
  EXPECT_TRUE(step_uses_gemms(planned, 128));
  CudaPolicy never;
  never.projection_gemm_min_batch = 0;
  EXPECT_FALSE(step_uses_gemms(never, 4096));
  CudaPolicy from8;
  from8.projection_gemm_min_batch = 8;
  EXPECT_FALSE(step_uses_gemms(from8, 4));
  EXPECT_TRUE(step_uses_gemms(from8, 8));
}

TEST(StepShapeTest, PlannedChainsTwoOnTheGemvsOneOnTheGemms) {
  const CudaPolicy planned;
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 state" : "fp32 state");
    EXPECT_EQ(step_chains(planned, bf16, 1), 1);
    EXPECT_EQ(step_chains(planned, bf16, 16), 1);
    EXPECT_EQ(step_chains(planned, bf16, 32), 2);
    EXPECT_EQ(step_chains(planned, bf16, 120), 2);  // still the gemvs
    EXPECT_EQ(step_chains(planned, bf16, 128), 1);  // the GEMMs from here
    EXPECT_EQ(step_chains(planned, bf16, 1024), 1);
  }
  // Above 1024 rows bf16 state's shorter recurrence hides the GEMMs of another chain.
  EXPECT_EQ(step_chains(planned, false, 1152), 1);
  EXPECT_EQ(step_chains(planned, true, 1152), 2);
  EXPECT_EQ(step_chains(planned, true, 4096), 2);
  // Without GEMMs every bucket from 32 is split, whatever its size.
  CudaPolicy never;
  never.projection_gemm_min_batch = 0;
  EXPECT_EQ(step_chains(never, false, 4096), 2);
}

TEST(StepShapeTest, ExplicitChainsApplyEverywhereUpToTheRows) {
  CudaPolicy p;
  p.chains = 4;
  EXPECT_EQ(step_chains(p, false, 2), 2);  // never more chains than rows
  EXPECT_EQ(step_chains(p, false, 8), 4);
  EXPECT_EQ(step_chains(p, true, 4096), 4);
  p.chains = 1;
  EXPECT_EQ(step_chains(p, false, 64), 1);
}

// Each chain's GEMM rows, bucket by bucket: only the buckets on GEMMs, every chain's rows
// exact (no padding into the next chain's), and a chain that only some buckets have gets
// rows only from those.
TEST(StepShapeTest, GemmChainRowsListEachChainsExactRows) {
  const CudaPolicy planned;
  EXPECT_EQ(step_gemm_chain_rows(planned, false, {1, 32, 64, 128, 144, 1024, 1152}),
            (std::vector<std::vector<int>>{{128, 144, 1024, 1152}}));
  EXPECT_EQ(step_gemm_chain_rows(planned, true, {64, 128, 1024, 1152, 1281}),
            (std::vector<std::vector<int>>{{128, 1024, 576, 640}, {576, 641}}));
  CudaPolicy never;
  never.projection_gemm_min_batch = 0;
  EXPECT_TRUE(step_gemm_chain_rows(never, false, {128, 4096}).empty());
}

}  // namespace
}  // namespace m3
