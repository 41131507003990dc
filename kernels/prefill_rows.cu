#include "kernels/prefill_rows.cuh"

#include "kernels/common.cuh"

namespace m3::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ void store_as(T* p, float v);
template <>
__device__ __forceinline__ void store_as<float>(float* p, float v) { *p = v; }
template <>
__device__ __forceinline__ void store_as<__nv_bfloat16>(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <typename W>
__global__ void __launch_bounds__(kThreads) gather_rows_kernel(const W* table, int vocab_rows, int cols,
                                                               const int32_t* ids, float* out, int out_stride) {
  const int t = blockIdx.x;
  const int id = min(max(ids[t], 0), vocab_rows - 1);
  const W* src = table + static_cast<int64_t>(id) * cols;
  float* dst = out + static_cast<int64_t>(t) * out_stride;
  for (int i = threadIdx.x; i < cols; i += kThreads) dst[i] = load1(src + i);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rmsnorm_rows_kernel(const float* x, int x_stride, const float* weight,
                                                                int cols, float eps, T* out, int out_stride) {
  __shared__ float partial[kThreads / 32];
  const int t = blockIdx.x;
  const float* row = x + static_cast<int64_t>(t) * x_stride;
  float ss = 0.f;
  for (int i = threadIdx.x; i < cols; i += kThreads) ss += row[i] * row[i];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += partial[w];
  const float scale = rsqrtf(total / cols + eps);
  T* dst = out + static_cast<int64_t>(t) * out_stride;
  for (int i = threadIdx.x; i < cols; i += kThreads) store_as(dst + i, row[i] * scale * weight[i]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) gated_silu_rows_kernel(const float* in, int in_stride, int F, T* out,
                                                                   int out_stride) {
  const int t = blockIdx.x;
  const float* row = in + static_cast<int64_t>(t) * in_stride;
  T* dst = out + static_cast<int64_t>(t) * out_stride;
  for (int i = threadIdx.x; i < F; i += kThreads) store_as(dst + i, row[i] * silu(row[F + i]));
}

__global__ void __launch_bounds__(kThreads) last_rows_kernel(const float* x, int x_stride, const int32_t* token_begin,
                                                             int cols, float* out, int out_stride) {
  const int i = blockIdx.x;
  const float* src = x + static_cast<int64_t>(token_begin[i + 1] - 1) * x_stride;
  float* dst = out + static_cast<int64_t>(i) * out_stride;
  for (int c = threadIdx.x; c < cols; c += kThreads) dst[c] = src[c];
}

}  // namespace

void last_rows_of_runs(const float* x, int x_stride, const int32_t* token_begin, int runs, int cols, float* out,
                       int out_stride, cudaStream_t stream) {
  if (runs <= 0) return;
  last_rows_kernel<<<runs, kThreads, 0, stream>>>(x, x_stride, token_begin, cols, out, out_stride);
  M3_CUDA_CHECK(cudaGetLastError());
}

void gather_rows(const void* table, WeightType table_type, int vocab_rows, int cols, const int32_t* ids, int rows,
                 float* out, int out_stride, cudaStream_t stream) {
  if (rows <= 0) return;
  if (table_type == WeightType::BF16) {
    gather_rows_kernel<<<rows, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(table), vocab_rows, cols, ids,
                                                      out, out_stride);
  } else {
    gather_rows_kernel<<<rows, kThreads, 0, stream>>>(static_cast<const float*>(table), vocab_rows, cols, ids, out,
                                                      out_stride);
  }
  M3_CUDA_CHECK(cudaGetLastError());
}

void rmsnorm_rows(const float* x, int x_stride, const float* weight, int cols, float eps, void* out,
                  WeightType out_type, int out_stride, int rows, cudaStream_t stream) {
  if (rows <= 0) return;
  if (out_type == WeightType::BF16) {
    rmsnorm_rows_kernel<<<rows, kThreads, 0, stream>>>(x, x_stride, weight, cols, eps,
                                                       static_cast<__nv_bfloat16*>(out), out_stride);
  } else {
    rmsnorm_rows_kernel<<<rows, kThreads, 0, stream>>>(x, x_stride, weight, cols, eps, static_cast<float*>(out),
                                                       out_stride);
  }
  M3_CUDA_CHECK(cudaGetLastError());
}

void gated_silu_rows(const float* in, int in_stride, int F, void* out, WeightType out_type, int out_stride, int rows,
                     cudaStream_t stream) {
  if (rows <= 0) return;
  if (out_type == WeightType::BF16) {
    gated_silu_rows_kernel<<<rows, kThreads, 0, stream>>>(in, in_stride, F, static_cast<__nv_bfloat16*>(out),
                                                          out_stride);
  } else {
    gated_silu_rows_kernel<<<rows, kThreads, 0, stream>>>(in, in_stride, F, static_cast<float*>(out), out_stride);
  }
  M3_CUDA_CHECK(cudaGetLastError());
}

}  // namespace m3::kernels
