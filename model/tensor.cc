#include "model/tensor.h"

#include <bit>
#include <cstring>
#include <stdexcept>

namespace m3 {

namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::F32, "F32", 4}, {DType::F16, "F16", 2}, {DType::BF16, "BF16", 2},
    {DType::F64, "F64", 8}, {DType::I64, "I64", 8}, {DType::I32, "I32", 4},
    {DType::I16, "I16", 2}, {DType::I8, "I8", 1},   {DType::U8, "U8", 1},
    {DType::BOOL, "BOOL", 1},
};

const DTypeInfo& info(DType d) {
  for (const auto& i : kDTypes)
    if (i.dtype == d) return i;
  throw std::invalid_argument("unknown DType value " + std::to_string(static_cast<int>(d)));
}

template <typename T>
T load_unaligned(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

std::string_view dtype_name(DType d) { return info(d).name; }

bool parse_dtype(std::string_view s, DType* out) {
  for (const auto& i : kDTypes) {
    if (i.name == s) {
      *out = i.dtype;
      return true;
    }
  }
  return false;
}

size_t dtype_size(DType d) { return info(d).size; }

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

float bf16_to_f32(uint16_t v) { return std::bit_cast<float>(static_cast<uint32_t>(v) << 16); }

uint16_t f32_to_bf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    // Keep sign and top payload bits; force the quiet bit so truncation cannot make Inf.
    return static_cast<uint16_t>((x >> 16) | 0x0040u);
  }
  uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    // Subnormal half: value = mant * 2^-24, exact in float32.
    float v = static_cast<float>(mant) * 0x1p-24f;
    bits = sign | std::bit_cast<uint32_t>(v);
  }
  return std::bit_cast<float>(bits);
}

uint16_t f32_to_f16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {  // Inf or NaN (NaN keeps its top payload bits and stays quiet)
    uint16_t nan_bits = x > 0x7f800000u ? static_cast<uint16_t>(0x200u | ((x >> 13) & 0x3ffu)) : 0;
    return static_cast<uint16_t>(sign | 0x7c00u | nan_bits);
  }
  // 65520 lies halfway between 65504 (odd mantissa) and 2^16: ties-to-even gives Inf.
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  uint32_t exp = x >> 23;
  uint32_t mant = x & 0x7fffffu;
  if (exp < 113) {  // below 2^-14: a half subnormal (units of 2^-24) or zero
    uint32_t shift = 126 - exp;
    if (shift > 24) return sign;
    mant |= 0x800000u;
    uint32_t r = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = ((exp - 112) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;  // a carry may step into the exponent
  return static_cast<uint16_t>(sign | r);
}

void to_f32(const TensorView& t, std::span<float> out) {
  const int64_t n = t.numel();
  if (static_cast<int64_t>(out.size()) != n) {
    throw std::invalid_argument("to_f32: tensor " + t.name + " has " + std::to_string(n) +
                                " elements, output holds " + std::to_string(out.size()));
  }
  if (t.nbytes != static_cast<size_t>(n) * dtype_size(t.dtype)) {
    throw std::invalid_argument("to_f32: tensor " + t.name + " has " + std::to_string(t.nbytes) +
                                " bytes, shape " + t.shape_str() + " needs " +
                                std::to_string(static_cast<size_t>(n) * dtype_size(t.dtype)));
  }
  const std::byte* p = t.data;
  switch (t.dtype) {
    case DType::F32:
      if (n) std::memcpy(out.data(), p, static_cast<size_t>(n) * 4);
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(load_unaligned<uint16_t>(p + 2 * i));
      return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(load_unaligned<uint16_t>(p + 2 * i));
      return;
    case DType::F64:
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(load_unaligned<double>(p + 8 * i));
      return;
    default:
      throw std::invalid_argument("to_f32: tensor " + t.name + " has dtype " +
                                  std::string(dtype_name(t.dtype)) + ", not a float type");
  }
}

std::vector<float> to_f32(const TensorView& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  to_f32(t, out);
  return out;
}

}  // namespace m3
