// Helpers for the GPU tests: skip without a device, environment switches, device arrays,
// random inputs.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/common.cuh"
#include "model/tensor.h"

namespace m3::testing {

inline bool cuda_device_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define M3_REQUIRE_CUDA_DEVICE() \
  if (!::m3::testing::cuda_device_present()) GTEST_SKIP() << "no CUDA device"

template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) { M3_CUDA_CHECK(cudaMalloc(&ptr_, sizeof(T) * (n ? n : 1))); }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void upload(const std::vector<T>& host) {
    M3_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> out(n_);
    M3_CUDA_CHECK(cudaMemcpy(out.data(), ptr_, sizeof(T) * n_, cudaMemcpyDeviceToHost));
    return out;
  }
  // Every byte 0xFF: a NaN for floats, so an unwritten output cannot pass.
  void poison() { M3_CUDA_CHECK(cudaMemset(ptr_, 0xFF, sizeof(T) * n_)); }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// bf16 bits of v, and v rounded through bf16 (what the kernel sees).
inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}
inline std::vector<float> round_bf16(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_f32(f32_to_bf16(v[i]));
  return out;
}

// max |a - b| / max |b|
inline double max_rel_err(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - b[i]);
    num = std::isnan(d) ? INFINITY : std::max(num, d);
    den = std::max(den, std::abs(b[i]));
  }
  return num / den;
}

}  // namespace m3::testing
