// gemv against a float64 CPU twin on random odd sizes: every epilogue, with and without
// the fused RMSNorm prologue, bf16 and fp32 weights, batches that fill partial tiles.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>

#include "gpu_test_util.h"
#include "tests/error_of.h"
#include "kernels/gemv.cuh"
#include "kernels/gemv_mma.cuh"

namespace m3 {
namespace {

using kernels::GemvEpilogue;
using testing::DeviceArray;

struct GemvCase {
  int out_rows, cols, batch;
  GemvEpilogue epilogue;
  bool norm;
  WeightDType type;
  int y_pad = 3;  // y_stride = out_rows + y_pad (3: rows past the first are not 16-byte aligned)
  bool gather = false;  // x rows gathered from an embedding table (GemvGather)
  int rows_per_warp = 0;  // GemvArgs::rows_per_warp (batch 1 on CUDA cores)
  kernels::GemvPolicy policy = {};
};

std::string name_of(const GemvCase& c) {
  return std::to_string(c.out_rows) + "x" + std::to_string(c.cols) + " batch " +
         std::to_string(c.batch) + " epilogue " + std::to_string(static_cast<int>(c.epilogue)) +
         (c.norm ? " norm" : "") + (c.type == WeightDType::BF16 ? " bf16" : " fp32") +
         (c.gather ? " gather" : "") + (c.rows_per_warp ? " rpw " + std::to_string(c.rows_per_warp) : "");
}

// `planned` (when given) sees the plan before it is launched.
std::vector<float> run_case(const GemvCase& c, uint32_t seed,
                            const std::function<void(const kernels::KernelLaunch&)>& planned = {}) {
  SCOPED_TRACE(name_of(c));
  const int w_rows = c.epilogue == GemvEpilogue::GatedSilu ? 2 * c.out_rows : c.out_rows;
  const int x_stride = c.cols + 4, y_stride = c.out_rows + c.y_pad;
  std::vector<float> w = testing::random_floats(static_cast<size_t>(w_rows) * c.cols, seed);
  if (c.type == WeightDType::BF16) w = testing::round_bf16(w);
  std::vector<float> x = testing::random_floats(static_cast<size_t>(c.batch) * x_stride, seed + 1, -2.f, 2.f);
  // Gathering: entry b's row is table[token]: its own token, or (token -1) its slot's last
  // sampled id, or (past the table) the last row. x then holds what must stay in the
  // padding columns, and the gathered rows are what the kernel must write there.
  const int vocab_rows = 23;
  std::vector<float> table = testing::random_floats(static_cast<size_t>(vocab_rows) * c.cols, seed + 4, -2.f, 2.f);
  if (c.type == WeightDType::BF16) table = testing::round_bf16(table);
  std::vector<int32_t> slots(c.batch), tokens(c.batch), last_token(c.batch + 2);
  for (int s = 0; s < c.batch + 2; ++s) last_token[s] = (7 * s + 3) % vocab_rows;
  const std::vector<float> x0 = x;
  if (c.gather) {
    for (int b = 0; b < c.batch; ++b) {
      slots[b] = (b + 2) % (c.batch + 2);
      tokens[b] = b % 3 == 0 ? -1 : b % 5 == 1 ? vocab_rows + 4 : (5 * b) % vocab_rows;
      const int token = tokens[b] < 0 ? last_token[slots[b]] : std::min(tokens[b], vocab_rows - 1);
      for (int k = 0; k < c.cols; ++k) x[b * x_stride + k] = table[static_cast<size_t>(token) * c.cols + k];
    }
  }
  const std::vector<float> nw = testing::random_floats(c.cols, seed + 2, 0.5f, 1.5f);
  const std::vector<float> y0 = testing::random_floats(static_cast<size_t>(c.batch) * y_stride, seed + 3);

  kernels::GemvArgs probe;
  probe.type = c.type;
  probe.cols = c.cols;
  probe.batch = c.batch;
  probe.rows_per_warp = c.rows_per_warp;
  probe.policy = c.policy;
  // The tensor-core path rounds x (times the norm weight) to bf16; the twin does too.
  const bool x_in_bf16 = kernels::gemv_mma_applies(probe);

  // Twin.
  std::vector<double> ref(y0.begin(), y0.end());
  for (int b = 0; b < c.batch; ++b) {
    std::vector<double> xv(c.cols);
    double ss = 0;
    for (int k = 0; k < c.cols; ++k) { xv[k] = x[b * x_stride + k]; ss += xv[k] * xv[k]; }
    const double scale = c.norm ? 1.0 / std::sqrt(ss / c.cols + 1e-5) : 1.0;
    for (int k = 0; k < c.cols; ++k) {
      float v = x[b * x_stride + k] * (c.norm ? nw[k] : 1.f);
      if (x_in_bf16) v = bf16_to_f32(f32_to_bf16(v));
      xv[k] = v * scale;
    }
    auto dot = [&](int row) {
      double s = 0;
      for (int k = 0; k < c.cols; ++k) s += static_cast<double>(w[static_cast<size_t>(row) * c.cols + k]) * xv[k];
      return s;
    };
    for (int r = 0; r < c.out_rows; ++r) {
      double& out = ref[b * y_stride + r];
      if (c.epilogue == GemvEpilogue::Store) out = dot(r);
      if (c.epilogue == GemvEpilogue::Accumulate) out += dot(r);
      if (c.epilogue == GemvEpilogue::GatedSilu) {
        const double a = dot(r), g = dot(r + c.out_rows);
        out = a * g / (1.0 + std::exp(-g));
      }
    }
  }

  DeviceArray<float> dx(c.gather ? x0 : x), dnw(nw), dy(y0);
  DeviceArray<float> dtable32(c.gather && c.type == WeightDType::F32 ? table : std::vector<float>{});
  DeviceArray<uint16_t> dtable16(c.gather && c.type == WeightDType::BF16 ? testing::to_bf16(table)
                                                                       : std::vector<uint16_t>{});
  DeviceArray<int32_t> dslots(slots), dtokens(tokens), dlast(last_token);
  DeviceArray<float> dw32(c.type == WeightDType::F32 ? w : std::vector<float>{});
  DeviceArray<uint16_t> dw16(c.type == WeightDType::BF16 ? testing::to_bf16(w) : std::vector<uint16_t>{});
  kernels::GemvArgs a;
  a.weight = c.type == WeightDType::BF16 ? static_cast<const void*>(dw16.get()) : dw32.get();
  a.type = c.type;
  a.out_rows = c.out_rows;
  a.cols = c.cols;
  a.x = dx.get();
  a.x_stride = x_stride;
  a.norm_weight = c.norm ? dnw.get() : nullptr;
  a.y = dy.get();
  a.y_stride = y_stride;
  a.batch = c.batch;
  a.epilogue = c.epilogue;
  a.rows_per_warp = c.rows_per_warp;
  a.policy = c.policy;
  if (c.gather) {
    a.x = nullptr;
    a.gather.table = c.type == WeightDType::BF16 ? static_cast<const void*>(dtable16.get()) : dtable32.get();
    a.gather.vocab_rows = vocab_rows;
    a.gather.slots = dslots.get();
    a.gather.tokens = dtokens.get();
    a.gather.last_token = dlast.get();
    a.gather.rows_out = dx.get();
  }
  const kernels::KernelLaunch plan = kernels::plan_gemv(a);
  if (planned) planned(plan);
  plan.launch(nullptr, false);
  M3_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = dy.download();
  if (c.gather) {  // the gathered rows, exactly, with the padding columns untouched
    const std::vector<float> rows = dx.download();
    size_t wrong = 0;
    for (size_t i = 0; i < x.size(); ++i) wrong += rows[i] != x[i];
    EXPECT_EQ(wrong, 0u) << "elements of rows_out differ from the gathered rows (or the padding changed)";
  }
  EXPECT_LT(testing::max_rel_err(got, ref), 2e-5);
  // Padding columns of y (past out_rows) are untouched.
  for (int b = 0; b < c.batch; ++b)
    for (int r = c.out_rows; r < y_stride; ++r) EXPECT_EQ(got[b * y_stride + r], y0[b * y_stride + r]);
  return got;
}

TEST(GemvKernel, MatchesTwinOnOddSizes) {
  M3_REQUIRE_CUDA_DEVICE();
  uint32_t seed = 11;
  for (WeightDType type : {WeightDType::BF16, WeightDType::F32}) {
    for (int batch : {1, 2, 3, 4, 5, 8, 11, 17}) {
      run_case({37, 200, batch, GemvEpilogue::Store, true, type}, seed++);
      run_case({301, 904, batch, GemvEpilogue::Accumulate, false, type}, seed++);
      run_case({129, 136, batch, GemvEpilogue::GatedSilu, true, type}, seed++);
    }
  }
}

TEST(GemvKernel, TensorCorePathMatchesTwin) {
  M3_REQUIRE_CUDA_DEVICE();
  uint32_t seed = 900;
  for (int batch : {8, 13, 16, 21, 40}) {
    kernels::GemvArgs probe;
    probe.type = WeightDType::BF16;
    probe.cols = 256;
    probe.batch = batch;
    ASSERT_TRUE(kernels::gemv_mma_applies(probe));
    run_case({45, 256, batch, GemvEpilogue::Store, true, WeightDType::BF16}, seed++);
    run_case({67, 896, batch, GemvEpilogue::Accumulate, false, WeightDType::BF16}, seed++);
    run_case({33, 128, batch, GemvEpilogue::GatedSilu, true, WeightDType::BF16}, seed++);
    run_case({29, 1792, batch, GemvEpilogue::Store, false, WeightDType::BF16}, seed++);
  }
}

// The row-block tensor-core kernel (128 rows a block, columns split over a cluster):
// the model's shapes and odd ones, every epilogue, with and without the norm, batches
// that fill partial tiles, and cluster sizes / batch tiles fixed by the policy
// (row_block_cluster, row_block_batch_tile), which also reach the multi-chunk path (slices
// wider than the held weights); each plan is the tiling asked for.
TEST(GemvKernel, RowBlockPathMatchesTwin) {
  M3_REQUIRE_CUDA_DEVICE();
  uint32_t seed = 2000;
  for (int batch : {4, 8, 16, 33, 64}) {
    run_case({4724, 896, batch, GemvEpilogue::Store, true, WeightDType::BF16}, seed++);
    run_case({896, 1792, batch, GemvEpilogue::Accumulate, false, WeightDType::BF16}, seed++);
    run_case({131, 896, batch, GemvEpilogue::Store, false, WeightDType::BF16}, seed++);
    run_case({75, 512, batch, GemvEpilogue::GatedSilu, true, WeightDType::BF16}, seed++);
    run_case({200, 96, batch, GemvEpilogue::Accumulate, true, WeightDType::BF16}, seed++);
  }
  // 16-byte aligned rows of y (the vector load / store path of the row-block kernel's
  // epilogue), with a partial last group of 4 rows in the odd case.
  for (int batch : {16, 64}) {
    run_case({896, 1792, batch, GemvEpilogue::Accumulate, false, WeightDType::BF16, 0}, seed++);
    run_case({4724, 896, batch, GemvEpilogue::Store, true, WeightDType::BF16, 0}, seed++);
    run_case({131, 896, batch, GemvEpilogue::Accumulate, true, WeightDType::BF16, 1}, seed++);
    run_case({70, 512, batch, GemvEpilogue::GatedSilu, true, WeightDType::BF16, 2}, seed++);
  }
  run_case({300, 32, 9, GemvEpilogue::Store, true, WeightDType::BF16}, seed++);   // one column block
  run_case({257, 896, 70, GemvEpilogue::Store, true, WeightDType::BF16}, seed++);  // two batch tiles
  struct Forced { int ks, bt; };
  for (Forced f : {Forced{2, 64}, Forced{2, 8}, Forced{4, 16}, Forced{8, 32}, Forced{8, 64}}) {
    SCOPED_TRACE("row_block_cluster " + std::to_string(f.ks) + ", row_block_batch_tile " + std::to_string(f.bt));
    kernels::GemvPolicy policy;
    policy.row_block_cluster = f.ks;
    policy.row_block_batch_tile = f.bt;
    const std::string tiling = "128-row blocks, batch tile " + std::to_string(f.bt) + ", cluster " + std::to_string(f.ks);
    auto expect_tiling = [&](const kernels::KernelLaunch& l) {
      EXPECT_NE(l.variant().find(tiling), std::string::npos) << l.variant();
    };
    run_case({300, 896, 40, GemvEpilogue::Store, true, WeightDType::BF16, 3, false, 0, policy}, seed++, expect_tiling);
    run_case({130, 1792, 64, GemvEpilogue::Accumulate, false, WeightDType::BF16, 3, false, 0, policy}, seed++,
             expect_tiling);
    run_case({70, 1024, 17, GemvEpilogue::GatedSilu, true, WeightDType::BF16, 3, false, 0, policy}, seed++,
             expect_tiling);
  }
}

// The step's first projection gathers its input rows from the embedding table: every
// gemv kernel (CUDA cores at batch 1 and for fp32, the 16-row and row-block tensor-core
// kernels), own tokens, the slot's last id, ids past the table; and the batch-1 kernel
// with each rows-per-warp the engine may ask for, gathering or not.
TEST(GemvKernel, GatheredInputMatchesTwin) {
  M3_REQUIRE_CUDA_DEVICE();
  uint32_t seed = 3000;
  for (WeightDType type : {WeightDType::BF16, WeightDType::F32}) {
    for (int batch : {1, 2, 3, 5}) {
      run_case({37, 200, batch, GemvEpilogue::Store, true, type, 3, true}, seed++);
      run_case({4724, 896, batch, GemvEpilogue::Store, true, type, 3, true}, seed++);
    }
  }
  for (int batch : {8, 13, 16, 40, 64}) {
    run_case({4724, 896, batch, GemvEpilogue::Store, true, WeightDType::BF16, 0, true}, seed++);
    run_case({45, 256, batch, GemvEpilogue::Store, true, WeightDType::BF16, 3, true}, seed++);
  }
  for (int rpw : {2, 4}) {  // the batch-1 kernel's rows a warp, as the engine picks them
    run_case({4724, 896, 1, GemvEpilogue::Store, true, WeightDType::BF16, 3, true, rpw}, seed++);
    run_case({301, 904, 1, GemvEpilogue::Accumulate, false, WeightDType::BF16, 3, false, rpw}, seed++);
    run_case({129, 136, 1, GemvEpilogue::GatedSilu, true, WeightDType::F32, 3, false, rpw}, seed++);
  }
  kernels::GemvPolicy two_blocks;  // 14 column blocks a slice: the row-block kernel stages two chunks
  two_blocks.row_block_cluster = 2;
  run_case({300, 896, 40, GemvEpilogue::Store, true, WeightDType::BF16, 3, true, 0, two_blocks}, seed++,
           [](const kernels::KernelLaunch& l) { EXPECT_NE(l.variant().find(", cluster 2,"), std::string::npos) << l.variant(); });
}

// Batch 2 with four rows a warp on CUDA cores (a step variant the engine measures beside
// the fused recurrence): bf16 asks for it instead of tensor cores; every epilogue, the
// norm, the gathered input; the plan is the CUDA-core kernel with one block per 32 rows.
TEST(GemvKernel, BatchTwoWithFourRowsAWarpMatchesTwin) {
  M3_REQUIRE_CUDA_DEVICE();
  uint32_t seed = 3500;
  for (WeightDType type : {WeightDType::BF16, WeightDType::F32}) {
    for (const GemvCase& c : {GemvCase{4724, 896, 2, GemvEpilogue::Store, true, type, 3, true, 4},
                              GemvCase{301, 904, 2, GemvEpilogue::Accumulate, false, type, 3, false, 4},
                              GemvCase{129, 136, 2, GemvEpilogue::GatedSilu, true, type, 3, false, 4},
                              GemvCase{37, 200, 2, GemvEpilogue::Store, true, type, 3, false, 4}}) {
      kernels::GemvArgs probe;
      probe.type = type;
      probe.cols = c.cols;
      probe.batch = 2;
      probe.rows_per_warp = 4;
      EXPECT_FALSE(kernels::gemv_mma_applies(probe));
      run_case(c, seed++, [&](const kernels::KernelLaunch& l) {
        EXPECT_EQ(l.name(), "gemv") << "not the CUDA-core kernel";
        EXPECT_EQ(l.grid().x, 1u);
        EXPECT_EQ(l.grid().y, static_cast<unsigned>((c.out_rows + 31) / 32)) << "not four rows a warp";
      });
    }
  }
}

TEST(GemvKernel, RowBlockPathIsDeterministic) {
  M3_REQUIRE_CUDA_DEVICE();
  for (int batch : {8, 64}) {
    const std::vector<float> a = run_case({4096, 896, batch, GemvEpilogue::Store, true, WeightDType::BF16}, 77);
    const std::vector<float> b = run_case({4096, 896, batch, GemvEpilogue::Store, true, WeightDType::BF16}, 77);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << i;
  }
}

// A one-vector fp32 problem of 4 rows and `cols` columns, every operand in `buf`: for the
// plan's refusals (nothing is launched).
kernels::GemvArgs small_problem(float* buf, int cols) {
  kernels::GemvArgs a;
  a.weight = buf;
  a.type = WeightDType::F32;
  a.out_rows = 4;
  a.cols = cols;
  a.x = buf;
  a.x_stride = cols;
  a.y = buf;
  a.y_stride = 4;
  a.batch = 1;
  return a;
}

// plan_gemv on a one-vector fp32 problem of `cols` columns must refuse with `expected`.
void expect_plan_refused(int cols, const std::string& expected) {
  DeviceArray<float> buf(1024);
  const kernels::GemvArgs a = small_problem(buf.get(), cols);
  const std::string msg = test::error_of<std::invalid_argument>([&] { kernels::plan_gemv(a); });
  EXPECT_NE(msg.find(expected), std::string::npos) << cols << " columns: " << msg;
}

TEST(GemvKernel, RejectsAGatherWithoutWhatItNeeds) {
  M3_REQUIRE_CUDA_DEVICE();
  DeviceArray<float> buf(1024);
  DeviceArray<int32_t> ids(4);
  kernels::GemvArgs a = small_problem(buf.get(), 8);
  a.x = nullptr;  // gathering reads no x
  a.gather = kernels::GemvGather{buf.get(), 4, ids.get(), ids.get(), ids.get(), buf.get()};
  EXPECT_NO_THROW(kernels::plan_gemv(a));
  auto expect_refused = [&](const char* what) {
    const std::string msg = test::error_of<std::invalid_argument>([&] { kernels::plan_gemv(a); });
    EXPECT_NE(msg.find("gathering its input needs"), std::string::npos) << what << ": " << msg;
  };
  a.epilogue = GemvEpilogue::Accumulate;
  expect_refused("Accumulate epilogue");
  a.epilogue = GemvEpilogue::Store;
  a.gather.last_token = nullptr;
  expect_refused("no last tokens");
  a.gather.last_token = ids.get();
  a.gather.rows_out = buf.get() + 1;
  expect_refused("rows_out not 16-byte aligned");
}

// A kernel's dynamic shared-memory limit is the kernel's, not the plan's: planning a
// smaller problem of the same row-block kernel (same batch tile and cluster; 128 columns
// hold fewer weight blocks in shared memory than 1792) after a larger one leaves the
// larger plan launchable and right.
TEST(GemvKernel, ASmallerPlanOfTheSameKernelLeavesALargerOneLaunchable) {
  M3_REQUIRE_CUDA_DEVICE();
  kernels::GemvPolicy policy;
  policy.row_block_cluster = 2;
  policy.row_block_batch_tile = 64;
  DeviceArray<uint16_t> w(4 * 128);
  DeviceArray<float> xy(64 * 128);
  kernels::GemvArgs smaller = small_problem(xy.get(), 128);
  smaller.weight = w.get();
  smaller.type = WeightDType::BF16;
  smaller.batch = 64;
  smaller.y_stride = 4;
  smaller.norm_weight = xy.get();  // as the larger one
  smaller.policy = policy;
  size_t small_smem = 0, large_smem = 0;
  run_case({130, 1792, 64, GemvEpilogue::Store, true, WeightDType::BF16, 3, false, 0, policy}, 4000,
           [&](const kernels::KernelLaunch& l) {
    large_smem = l.dynamic_smem();
    small_smem = kernels::plan_gemv(smaller).dynamic_smem();
  });
  EXPECT_GT(small_smem, 48u * 1024) << "the smaller plan does not raise the limit at all";
  EXPECT_GT(large_smem, small_smem) << "the two plans need the same shared memory";
}

TEST(GemvKernel, RejectsRowsPerWarpItHasNoKernelFor) {
  M3_REQUIRE_CUDA_DEVICE();
  DeviceArray<float> buf(1024);
  kernels::GemvArgs a = small_problem(buf.get(), 8);
  a.rows_per_warp = 4;
  EXPECT_NO_THROW(kernels::plan_gemv(a));
  a.rows_per_warp = 1;  // one row a warp at batch 1 never won a measurement and is gone
  const std::string msg = test::error_of<std::invalid_argument>([&] { kernels::plan_gemv(a); });
  EXPECT_NE(msg.find("rows_per_warp 1 is not 0 (default), 2 or 4"), std::string::npos) << msg;
}

TEST(GemvKernel, RejectsAPolicyItHasNoKernelFor) {
  M3_REQUIRE_CUDA_DEVICE();
  DeviceArray<float> buf(1024);
  kernels::GemvArgs a = small_problem(buf.get(), 8);
  a.policy.row_block_cluster = 3;
  const std::string msg = test::error_of<std::invalid_argument>([&] { kernels::plan_gemv(a); });
  EXPECT_NE(msg.find("gemv 4x8 batch 1: policy row_block_cluster must be 0 (planned), 2, 4 or 8, got 3"),
            std::string::npos)
      << msg;
}

TEST(GemvKernel, RejectsColumnsThatBreakVectorLoads) {
  M3_REQUIRE_CUDA_DEVICE();
  expect_plan_refused(12, "gemv 4x12 batch 1: cols must be a multiple of 8 (16-byte weight loads)");
}

// Batch-1 CUDA-core plans the other tests do not reach: rows wider than 1024 columns at
// two rows a warp take eight 8-weight chunks a lane per pass (s2s-14l's out_proj,
// 896 x 1792, when out_proj is not fused), and the gated epilogue at four rows a warp in
// bf16.
TEST(GemvKernel, BatchOneWideRowsAndGatedFourRowsAWarpMatchTwin) {
  M3_REQUIRE_CUDA_DEVICE();
  run_case({97, 1800, 1, GemvEpilogue::Accumulate, false, WeightDType::BF16, 3, false, 2}, 3600);
  run_case({896, 1792, 1, GemvEpilogue::Accumulate, false, WeightDType::BF16, 3, false, 2}, 3610);
  run_case({97, 1800, 1, GemvEpilogue::Store, true, WeightDType::F32, 3, false, 2}, 3620);
  run_case({129, 136, 1, GemvEpilogue::GatedSilu, true, WeightDType::BF16, 3, false, 4}, 3630);
}

TEST(GemvKernel, TakesASmallerTileWhereStaticSharedMemoryTipsTheLimit) {
  M3_REQUIRE_CUDA_DEVICE();
  // fp32 rows of 3168 columns: an 8-vector tile is exactly the 101,376-byte limit before the
  // kernel's static partial sums, so the plan must take a tile of 4 rather than fail.
  run_case({33, 3168, 8, GemvEpilogue::Store, true, WeightDType::F32}, 5);
}

TEST(GemvKernel, RefusesRowsTooWideForSharedMemory) {
  M3_REQUIRE_CUDA_DEVICE();
  // One fp32 input row and the 8 warps' partial sums in the RTX 5090's 101,376 bytes:
  // 25,336 columns at most. The widest plans and its kernel launches within the limit; the
  // next width the loads allow is refused by the rule engines check models by.
  DeviceArray<float> row(25336), y(4);
  kernels::GemvArgs a = small_problem(row.get(), 25336);
  a.out_rows = 1;
  a.y = y.get();
  EXPECT_EQ(kernels::gemv_cols_refusal(25336), "");
  EXPECT_NO_THROW(kernels::plan_gemv(a).launch(nullptr, false));
  M3_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(kernels::gemv_cols_refusal(25344), "must be at most 25336 (one fp32 input row in shared memory)");
  expect_plan_refused(25344, "gemv 4x25344 batch 1: cols must be at most 25336");
}

}  // namespace
}  // namespace m3
