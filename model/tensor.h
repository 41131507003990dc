// A named, typed, read-only view of tensor bytes (typically inside a mapped file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace m3 {

enum class DType { F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL };

std::string_view dtype_name(DType);        // safetensors spelling: "F32", "BF16", ...
bool parse_dtype(std::string_view, DType*);
size_t dtype_size(DType);

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
  std::string shape_str() const;  // "[16, 4, 32]"
};

// Widens F32/F16/BF16 (and F64) data to float32. Throws for integer dtypes.
void to_f32(const TensorView& t, std::span<float> out);
std::vector<float> to_f32(const TensorView& t);

float bf16_to_f32(uint16_t v);
uint16_t f32_to_bf16(float v);  // round to nearest even, NaN stays NaN
float f16_to_f32(uint16_t v);
uint16_t f32_to_f16(float v);

}  // namespace m3
