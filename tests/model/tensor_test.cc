#include "model/tensor.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "tests/model/test_util.h"

namespace m3 {
namespace {

using ::testing::HasSubstr;
using test::error_of;

float f(uint32_t bits) { return std::bit_cast<float>(bits); }

TEST(DType, NamesRoundTrip) {
  for (DType d : {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64, DType::I32, DType::I16, DType::I8,
                  DType::U8, DType::BOOL}) {
    DType back;
    ASSERT_TRUE(parse_dtype(dtype_name(d), &back)) << dtype_name(d);
    EXPECT_EQ(back, d);
  }
  DType x;
  EXPECT_FALSE(parse_dtype("F8_E4M3", &x));
  EXPECT_FALSE(parse_dtype("f32", &x));
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_EQ(dtype_size(DType::BOOL), 1u);
}

TEST(TensorView, ShapeHelpers) {
  TensorView t;
  t.shape = {16, 4, 32};
  EXPECT_EQ(t.numel(), 16 * 4 * 32);
  EXPECT_EQ(t.shape_str(), "[16, 4, 32]");
  t.shape = {};
  EXPECT_EQ(t.numel(), 1);
  EXPECT_EQ(t.shape_str(), "[]");
  t.shape = {3, 0};
  EXPECT_EQ(t.numel(), 0);
}

TEST(BF16, RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_bf16(f(0x3f808000)), 0x3f80);  // tie, lower neighbour even
  EXPECT_EQ(f32_to_bf16(f(0x3f818000)), 0x3f82);  // tie, upper neighbour even
  EXPECT_EQ(f32_to_bf16(f(0x3f808001)), 0x3f81);  // just above the tie
  EXPECT_EQ(f32_to_bf16(f(0x3f807fff)), 0x3f80);  // just below
  EXPECT_EQ(f32_to_bf16(f(0x7f7fffff)), 0x7f80);  // FLT_MAX rounds up to Inf
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16(f(0x00010000)), 0x0001);  // subnormals keep their bits
}

TEST(BF16, NaNStaysNaN) {
  // Signalling NaN with payload only in the low bits: plain truncation would give Inf.
  for (uint32_t bits : {0x7f800001u, 0x7fc00000u, 0xff800001u, 0x7fffffffu}) {
    uint16_t h = f32_to_bf16(f(bits));
    EXPECT_TRUE(std::isnan(bf16_to_f32(h))) << std::hex << bits;
    EXPECT_EQ(h & 0x8000, (bits >> 16) & 0x8000);
  }
}

TEST(BF16, EveryValueRoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float v = bf16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(v)) continue;
    ASSERT_EQ(f32_to_bf16(v), h) << std::hex << h;
  }
}

TEST(F16, EveryValueRoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float v = f16_to_f32(static_cast<uint16_t>(h));
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) {
      ASSERT_TRUE(std::isnan(v)) << std::hex << h;
      ASSERT_TRUE(std::isnan(f16_to_f32(f32_to_f16(v))));
      continue;
    }
    ASSERT_EQ(f32_to_f16(v), h) << std::hex << h;
  }
}

TEST(F16, EdgeCases) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // the tie above the max rounds to Inf
  EXPECT_EQ(f32_to_f16(-1e10f), 0xfc00);
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);       // smallest subnormal
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);       // tie with zero: even
  EXPECT_EQ(f32_to_f16(0x1.0002p-25f), 0x0001);  // just above the tie
  EXPECT_EQ(f32_to_f16(0x3p-25f), 0x0002);       // tie between 1 and 2 ulps: even
  EXPECT_EQ(f32_to_f16(0x1p-14f), 0x0400);       // smallest normal
  EXPECT_EQ(f32_to_f16(0x1.ff8p-15f), 0x03ff);   // largest subnormal, 1023 * 2^-24
  EXPECT_EQ(f32_to_f16(0x1.ffcp-15f), 0x0400);   // tie with 2^-14 rounds up into the normals
  EXPECT_EQ(f32_to_f16(0x1.ff4p-15f), 0x03fe);   // tie between 1022 and 1023 ulps: even
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3c00);      // tie, even below
  EXPECT_EQ(f32_to_f16(1.0f + 0x3p-11f), 0x3c02);      // tie, even above
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(1e-30f), 0x0000);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f(0x7f800001)))));
}

// Against a brute-force definition: the result is the nearest representable value, ties
// to the even encoding.
// Values are drawn with float exponents in [exp_lo, exp_hi] so that subnormal, normal and
// overflowing ranges of the target type are all hit.
template <typename ToHalf, typename FromHalf>
void check_nearest(ToHalf to, FromHalf from, float max_finite, uint32_t exp_lo, uint32_t exp_hi) {
  std::mt19937 gen(12345);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_int_distribution<uint32_t> exps(exp_lo, exp_hi);
  for (int i = 0; i < 200000; ++i) {
    uint32_t b = (bits(gen) & 0x807fffffu) | (exps(gen) << 23);
    if (i % 8 == 0) b &= 0xffffe000u | (bits(gen) & 0x1000u);  // exact ties are rare otherwise
    float v = f(b);
    if (!std::isfinite(v) || std::fabs(v) >= max_finite) continue;
    uint16_t h = to(v);
    double got = from(h);
    ASSERT_TRUE(std::isfinite(got)) << v;
    double err = std::fabs(got - v);
    for (int step : {-1, 1}) {
      uint16_t n = static_cast<uint16_t>(h + step);
      double other = from(n);
      if (!std::isfinite(other) || std::signbit(other) != std::signbit(got)) continue;
      double e2 = std::fabs(other - v);
      ASSERT_LE(err, e2) << "value " << v << " encoded " << std::hex << h;
      if (err == e2) {
        ASSERT_EQ(h & 1, 0) << "tie not to even for " << v;
      }
    }
  }
}

TEST(BF16, NearestOnRandomValues) { check_nearest(f32_to_bf16, bf16_to_f32, 3.38e38f, 0, 254); }
TEST(F16, NearestOnRandomValues) { check_nearest(f32_to_f16, f16_to_f32, 65504.0f, 127 - 26, 127 + 16); }

TEST(ToF32, WidensEveryFloatType) {
  const std::vector<float> values = {0.0f, 1.0f, -2.5f, 3.140625f, 1e-3f};
  auto view_of = [](DType dt, std::vector<std::byte>& buf, size_t n) {
    TensorView t;
    t.name = "t";
    t.dtype = dt;
    t.shape = {static_cast<int64_t>(n)};
    t.data = buf.data();
    t.nbytes = buf.size();
    return t;
  };
  std::vector<std::byte> f32(values.size() * 4), bf(values.size() * 2), hf(values.size() * 2),
      f64(values.size() * 8);
  for (size_t i = 0; i < values.size(); ++i) {
    std::memcpy(&f32[4 * i], &values[i], 4);
    uint16_t b = f32_to_bf16(values[i]), h = f32_to_f16(values[i]);
    std::memcpy(&bf[2 * i], &b, 2);
    std::memcpy(&hf[2 * i], &h, 2);
    double d = values[i];
    std::memcpy(&f64[8 * i], &d, 8);
  }
  EXPECT_EQ(to_f32(view_of(DType::F32, f32, values.size())), values);
  EXPECT_EQ(to_f32(view_of(DType::F64, f64, values.size())), values);
  std::vector<float> b = to_f32(view_of(DType::BF16, bf, values.size()));
  std::vector<float> h = to_f32(view_of(DType::F16, hf, values.size()));
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(b[i], bf16_to_f32(f32_to_bf16(values[i])));
    EXPECT_EQ(h[i], f16_to_f32(f32_to_f16(values[i])));
    EXPECT_NEAR(b[i], values[i], std::fabs(values[i]) / 128);
  }
}

TEST(ToF32, RejectsIntegersAndWrongSizes) {
  std::vector<std::byte> buf(16);
  TensorView t;
  t.name = "prompt_ids";
  t.dtype = DType::I64;
  t.shape = {2};
  t.data = buf.data();
  t.nbytes = 16;
  EXPECT_THAT(error_of<std::invalid_argument>([&] { to_f32(t); }),
              testing::AllOf(HasSubstr("prompt_ids"), HasSubstr("I64")));
  t.dtype = DType::F32;
  std::vector<float> out(3);
  EXPECT_THAT(error_of<std::invalid_argument>([&] { to_f32(t, out); }), HasSubstr("output holds 3"));
  t.shape = {5};  // 20 bytes needed, 16 held
  EXPECT_THAT(error_of<std::invalid_argument>([&] { to_f32(t); }), HasSubstr("needs 20"));
}

}  // namespace
}  // namespace m3
