// The prefill row kernels (kernels/prefill_rows.cuh) and the cuBLASLt projection wrapper
// (kernels/gemm_lt.cuh) against float64 CPU twins on random odd-sized inputs; outputs
// start as NaN, so every element must be written.
#include <cmath>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/gemm_lt.cuh"
#include "kernels/prefill_rows.cuh"
#include "model/tensor.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

using testing::DeviceArray;

std::vector<float> download_as_float(const DeviceArray<float>& f, const DeviceArray<uint16_t>& b, WeightDType t) {
  if (t == WeightDType::F32) return f.download();
  const std::vector<uint16_t> bits = b.download();
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_to_f32(bits[i]);
  return out;
}

TEST(PrefillRows, GatherCopiesTheRowsOfTheIdsClamped) {
  M3_REQUIRE_CUDA_DEVICE();
  const int V = 37, cols = 72, rows = 9, stride = cols + 5;
  for (WeightDType t : {WeightDType::F32, WeightDType::BF16}) {
    const std::vector<float> table = testing::round_bf16(testing::random_floats(V * cols, 1));
    DeviceArray<float> t32(table);
    DeviceArray<uint16_t> t16(testing::to_bf16(table));
    const std::vector<int32_t> ids = {0, 36, 5, 5, -3, 99, 12, 1, 30};
    DeviceArray<int32_t> dids(ids);
    DeviceArray<float> out(static_cast<size_t>(rows) * stride);
    out.poison();
    kernels::gather_rows(t == WeightDType::F32 ? static_cast<const void*>(t32.get()) : t16.get(), t, V, cols,
                         dids.get(), rows, out.get(), stride, nullptr);
    const std::vector<float> got = out.download();
    for (int r = 0; r < rows; ++r) {
      const int id = std::min(std::max(ids[r], 0), V - 1);
      for (int c = 0; c < cols; ++c) ASSERT_EQ(got[r * stride + c], table[id * cols + c]) << "row " << r << " col " << c;
    }
  }
}

// cols 333 and odd strides take the kernel of a block a row; cols 896 (s2s-14l's d_model)
// with strides a multiple of 4 the one of a warp a row, over a last block of 5 of its 8 rows.
struct RowShape {
  int rows, cols, x_stride, out_stride;
};
class PrefillRowsShapes : public ::testing::TestWithParam<RowShape> {};

TEST_P(PrefillRowsShapes, RmsNormAndGatedSiluMatchTheirTwins) {
  M3_REQUIRE_CUDA_DEVICE();
  const auto [rows, cols, x_stride, out_stride] = GetParam();
  const int F = 150, in_stride = 2 * F + 7;
  const std::vector<float> x = testing::random_floats(static_cast<size_t>(rows) * x_stride, 2, -2.f, 2.f);
  const std::vector<float> wgt = testing::random_floats(cols, 3, 0.5f, 1.5f);
  const std::vector<float> fc1 = testing::random_floats(static_cast<size_t>(rows) * in_stride, 4, -4.f, 4.f);
  DeviceArray<float> dx(x), dw(wgt), dfc1(fc1);
  for (WeightDType t : {WeightDType::F32, WeightDType::BF16}) {
    SCOPED_TRACE(t == WeightDType::F32 ? "fp32 out" : "bf16 out");
    const double tol = t == WeightDType::F32 ? 1e-6 : 4e-3;
    DeviceArray<float> o32(static_cast<size_t>(rows) * out_stride);
    DeviceArray<uint16_t> o16(static_cast<size_t>(rows) * out_stride);
    o32.poison();
    o16.poison();
    void* out = t == WeightDType::F32 ? static_cast<void*>(o32.get()) : static_cast<void*>(o16.get());
    kernels::rmsnorm_rows(dx.get(), x_stride, dw.get(), cols, 1e-5f, out, t, out_stride, rows, nullptr);
    std::vector<float> got = download_as_float(o32, o16, t);
    std::vector<double> expect, got_d;
    for (int r = 0; r < rows; ++r) {
      double ss = 0;
      for (int c = 0; c < cols; ++c) ss += static_cast<double>(x[r * x_stride + c]) * x[r * x_stride + c];
      const double sc = 1.0 / std::sqrt(ss / cols + 1e-5);
      for (int c = 0; c < cols; ++c) {
        expect.push_back(x[r * x_stride + c] * sc * wgt[c]);
        got_d.push_back(got[r * out_stride + c]);
      }
    }
    EXPECT_LE(testing::max_rel_err(std::vector<float>(got_d.begin(), got_d.end()), expect), tol) << "rmsnorm";

    o32.poison();
    o16.poison();
    kernels::gated_silu_rows(dfc1.get(), in_stride, F, out, t, out_stride, rows, nullptr);
    got = download_as_float(o32, o16, t);
    expect.clear();
    got_d.clear();
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < F; ++i) {
        const double a = fc1[r * in_stride + i], g = fc1[r * in_stride + F + i];
        expect.push_back(a * g / (1 + std::exp(-g)));
        got_d.push_back(got[r * out_stride + i]);
      }
    EXPECT_LE(testing::max_rel_err(std::vector<float>(got_d.begin(), got_d.end()), expect), tol) << "gated silu";
  }
}

INSTANTIATE_TEST_SUITE_P(Rows, PrefillRowsShapes,
                         ::testing::Values(RowShape{13, 333, 341, 336}, RowShape{21, 896, 900, 904}),
                         [](const ::testing::TestParamInfo<RowShape>& info) {
                           return "cols" + std::to_string(info.param.cols);
                         });

TEST(PrefillRows, LastRowsOfRunsPacksEachRunsLastToken) {
  M3_REQUIRE_CUDA_DEVICE();
  const int cols = 45, stride = 50, out_stride = 47;
  const std::vector<int32_t> token_begin = {0, 1, 18, 19, 83};
  const int runs = 4, T = token_begin.back();
  const std::vector<float> x = testing::random_floats(static_cast<size_t>(T) * stride, 9);
  DeviceArray<float> dx(x), out(static_cast<size_t>(runs) * out_stride);
  DeviceArray<int32_t> dtb(token_begin);
  out.poison();
  kernels::last_rows_of_runs(dx.get(), stride, dtb.get(), runs, cols, out.get(), out_stride, nullptr);
  const std::vector<float> got = out.download();
  for (int i = 0; i < runs; ++i)
    for (int c = 0; c < cols; ++c)
      ASSERT_EQ(got[i * out_stride + c], x[(token_begin[i + 1] - 1) * stride + c]) << "run " << i << " col " << c;
}

// No device needed: the layout only does arithmetic on the base address.
TEST(PrefillRowBuffers, DisjointAlignedAndSizedForThePaddedRows) {
  for (int mlp : {0, 1152}) {
    const kernels::PrefillRowSizes sizes{896, 4724, 1792, mlp, WeightDType::BF16, 2000};
    const size_t bytes = kernels::prefill_row_buffer_bytes(sizes);
    void* fake = reinterpret_cast<void*>(uintptr_t{1} << 20);  // an aligned address, never dereferenced
    const auto b = kernels::prefill_row_buffers(sizes, fake);
    EXPECT_EQ(b.rows, kernels::lt_gemm_padded_rows(2000));
    EXPECT_GE(b.rows, 2000);
    struct Range {
      const void* p;
      size_t bytes;
      const char* name;
    };
    std::vector<Range> ranges = {{b.res, 4ul * b.rows * b.res_stride, "res"}, {b.u, 2ul * b.rows * b.u_stride, "u"},
                                 {b.w, 4ul * b.rows * b.w_stride, "w"},       {b.o, 2ul * b.rows * b.o_stride, "o"},
                                 {b.last, 4ul * b.rows * b.res_stride, "last"}};
    if (mlp > 0) {
      ranges.push_back({b.fc1_out, 4ul * b.rows * b.fc1_stride, "fc1_out"});
      ranges.push_back({b.mlp_act, 2ul * b.rows * b.mlp_act_stride, "mlp_act"});
    } else {
      EXPECT_EQ(b.fc1_out, nullptr);
      EXPECT_EQ(b.mlp_act, nullptr);
    }
    const auto* base = static_cast<const unsigned char*>(fake);
    for (size_t i = 0; i < ranges.size(); ++i) {
      const size_t off = static_cast<const unsigned char*>(ranges[i].p) - base;
      EXPECT_EQ(off % 256, 0u) << ranges[i].name;
      EXPECT_LE(off + ranges[i].bytes, bytes) << ranges[i].name;
      for (size_t j = 0; j < i; ++j) {
        const size_t oj = static_cast<const unsigned char*>(ranges[j].p) - base;
        EXPECT_TRUE(off >= oj + ranges[j].bytes || oj >= off + ranges[i].bytes)
            << ranges[i].name << " overlaps " << ranges[j].name;
      }
    }
    EXPECT_EQ(b.res_stride % 8, 0);
    EXPECT_EQ(b.u_stride % 8, 0);
    EXPECT_EQ(b.o_stride % 8, 0);
    EXPECT_GE(b.w_stride, 4724);
  }
}

// The first `rows` rows of a GEMM of shape `s` (`got`) against the twin in double: y (+)=
// x W^T over Y0 (accumulating) or zeros, W [out_features][in_features], rows at their strides.
double gemm_rel_err(const std::vector<float>& got, const std::vector<float>& W, const std::vector<float>& X,
                    const std::vector<float>& Y0, const kernels::LtGemmShape& s, int rows) {
  std::vector<float> g;
  std::vector<double> e;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < s.out_features; ++j) {
      double acc = s.accumulate ? Y0[r * s.y_stride + j] : 0.0;
      for (int k = 0; k < s.in_features; ++k) acc += static_cast<double>(X[r * s.x_stride + k]) * W[j * s.in_features + k];
      e.push_back(acc);
      g.push_back(got[r * s.y_stride + j]);
    }
  return testing::max_rel_err(g, e);
}

// y (+)= x W^T at several row counts (inside one bucket, at a bucket's edge, past 128 and
// 1024), both weight types, storing and accumulating.
TEST(PrefillGemm, MatchesTheTwinAtEveryRowBucket) {
  M3_REQUIRE_CUDA_DEVICE();
  const int out_f = 200, in_f = 136, max_rows = 1100;
  const int x_stride = 144, y_stride = 204;
  const int padded = kernels::lt_gemm_padded_rows(max_rows);
  ASSERT_GE(padded, max_rows);
  kernels::LtContext ctx;
  const std::vector<float> W = testing::round_bf16(testing::random_floats(static_cast<size_t>(out_f) * in_f, 5));
  const std::vector<float> X = testing::round_bf16(testing::random_floats(static_cast<size_t>(padded) * x_stride, 6));
  const std::vector<float> Y0 = testing::random_floats(static_cast<size_t>(padded) * y_stride, 7);
  DeviceArray<float> w32(W), x32(X);
  DeviceArray<uint16_t> w16(testing::to_bf16(W)), x16(testing::to_bf16(X));
  for (WeightDType t : {WeightDType::F32, WeightDType::BF16}) {
    for (bool accumulate : {false, true}) {
      kernels::LtGemmShape shape{out_f, in_f, max_rows, t, x_stride, y_stride, accumulate};
      const kernels::LtGemm gemm(ctx, shape);
      for (int rows : {1, 16, 17, 130, 1024, 1100}) {
        SCOPED_TRACE(std::string(t == WeightDType::F32 ? "fp32" : "bf16") + (accumulate ? " accumulate" : " store") +
                     " rows " + std::to_string(rows));
        DeviceArray<float> y(Y0);
        if (!accumulate) y.poison();
        gemm.run(t == WeightDType::F32 ? static_cast<const void*>(w32.get()) : w16.get(),
                 t == WeightDType::F32 ? static_cast<const void*>(x32.get()) : x16.get(), y.get(), rows, nullptr);
        M3_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<float> got = y.download();
        EXPECT_LE(gemm_rel_err(got, W, X, Y0, shape, rows), 1e-5);
        // Columns past out_features in each row are not the GEMM's.
        for (int r = 0; r < rows; ++r)
          for (int j = out_f; j < y_stride && accumulate; ++j) ASSERT_EQ(got[r * y_stride + j], Y0[r * y_stride + j]);
      }
      EXPECT_NE(test::error_of<std::invalid_argument>([&] { gemm.run(w32.get(), x32.get(), nullptr, 0, nullptr); })
                    .find("called with 0 rows"),
                std::string::npos);
      EXPECT_NE(test::error_of<std::invalid_argument>([&] {
                  kernels::LtGemm(ctx, kernels::LtGemmShape{out_f, in_f, max_rows, t, x_stride, 203, accumulate});
                }).find("y_stride of 4"),
                std::string::npos);
    }
  }
}

// With its row counts listed (the decode step's chains, whose rows lie next to each other)
// a GEMM computes exactly the rows it is called with: the rows after them keep what they
// held, and a count it was not planned for is refused.
TEST(PrefillGemm, ListedRowCountsTouchOnlyTheirRows) {
  M3_REQUIRE_CUDA_DEVICE();
  const int out_f = 200, in_f = 136, x_stride = 144, y_stride = 204, max_rows = 100;
  kernels::LtContext ctx(4u << 20);
  const std::vector<float> W = testing::round_bf16(testing::random_floats(static_cast<size_t>(out_f) * in_f, 8));
  const std::vector<float> X = testing::round_bf16(testing::random_floats(static_cast<size_t>(max_rows) * x_stride, 9));
  const std::vector<float> Y0 = testing::random_floats(static_cast<size_t>(max_rows) * y_stride, 10);
  DeviceArray<uint16_t> w16(testing::to_bf16(W)), x16(testing::to_bf16(X));
  kernels::LtGemmShape shape{out_f, in_f, max_rows, WeightDType::BF16, x_stride, y_stride, true};
  shape.row_counts = {40, 3, 100, 40};
  const kernels::LtGemm gemm(ctx, shape);
  for (int rows : {3, 40, 100}) {
    SCOPED_TRACE("rows " + std::to_string(rows));
    DeviceArray<float> y(Y0);
    gemm.run(w16.get(), x16.get(), y.get(), rows, nullptr);
    M3_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = y.download();
    EXPECT_LE(gemm_rel_err(got, W, X, Y0, shape, rows), 1e-5);
    for (size_t i = static_cast<size_t>(rows) * y_stride; i < got.size(); ++i) ASSERT_EQ(got[i], Y0[i]) << i;
  }
  EXPECT_NE(test::error_of<std::invalid_argument>([&] { gemm.run(w16.get(), x16.get(), nullptr, 41, nullptr); })
                .find("not one of the row counts"),
            std::string::npos);
  shape.row_counts = {101};
  EXPECT_NE(test::error_of<std::invalid_argument>([&] { kernels::LtGemm(ctx, shape); }).find("outside 1 to max_rows"),
            std::string::npos);
}

}  // namespace
}  // namespace m3
