#include "kernels/prefill_rows.cuh"

#include "kernels/common.cuh"
#include "kernels/gemm_lt.cuh"

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

// The same, a warp a row in 16-byte pieces, for rows whose columns, strides and pointers
// allow them (d_model a multiple of 4): a block a row left a 896-column row to 256 threads
// of 3 or 4 scalar loads each and a barrier; the second read of the row comes from L1.
template <typename T>
__global__ void __launch_bounds__(kThreads) rmsnorm_rows_vec4_kernel(const float* x, int x_stride,
                                                                     const float* weight, int cols, float eps,
                                                                     T* out, int out_stride, int rows) {
  const int t = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (t >= rows) return;
  const float4* row = reinterpret_cast<const float4*>(x + static_cast<int64_t>(t) * x_stride);
  const float4* w4 = reinterpret_cast<const float4*>(weight);
  const int n4 = cols / 4;
  float ss = 0.f;
#pragma unroll 4
  for (int i = lane; i < n4; i += 32) {
    const float4 v = row[i];
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  const float scale = rsqrtf(warp_sum(ss) / cols + eps);
  T* dst = out + static_cast<int64_t>(t) * out_stride;
#pragma unroll 4
  for (int i = lane; i < n4; i += 32) {
    const float4 v = row[i], g = w4[i];
    store4(dst + 4 * i, make_float4(v.x * scale * g.x, v.y * scale * g.y, v.z * scale * g.z, v.w * scale * g.w));
  }
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

__global__ void advance_run_counters_kernel(uint64_t* counters, const int32_t* slot, const int32_t* token_begin,
                                            int runs) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < runs) counters[slot[i]] += static_cast<uint64_t>(token_begin[i + 1] - token_begin[i] - 1);
}

void advance_run_counters(uint64_t* counters, const int32_t* slot, const int32_t* token_begin, int runs,
                          cudaStream_t stream) {
  if (runs <= 0) return;
  advance_run_counters_kernel<<<(runs + 127) / 128, 128, 0, stream>>>(counters, slot, token_begin, runs);
  M3_CUDA_CHECK(cudaGetLastError());
}

void last_rows_of_runs(const float* x, int x_stride, const int32_t* token_begin, int runs, int cols, float* out,
                       int out_stride, cudaStream_t stream) {
  if (runs <= 0) return;
  last_rows_kernel<<<runs, kThreads, 0, stream>>>(x, x_stride, token_begin, cols, out, out_stride);
  M3_CUDA_CHECK(cudaGetLastError());
}

void gather_rows(const void* table, WeightDType table_type, int vocab_rows, int cols, const int32_t* ids, int rows,
                 float* out, int out_stride, cudaStream_t stream) {
  if (rows <= 0) return;
  if (table_type == WeightDType::BF16) {
    gather_rows_kernel<<<rows, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(table), vocab_rows, cols, ids,
                                                      out, out_stride);
  } else {
    gather_rows_kernel<<<rows, kThreads, 0, stream>>>(static_cast<const float*>(table), vocab_rows, cols, ids, out,
                                                      out_stride);
  }
  M3_CUDA_CHECK(cudaGetLastError());
}

void rmsnorm_rows(const float* x, int x_stride, const float* weight, int cols, float eps, void* out,
                  WeightDType out_type, int out_stride, int rows, cudaStream_t stream) {
  if (rows <= 0) return;
  auto launch = [&]<typename T>(T* o) {
    const bool vec4 = cols % 4 == 0 && x_stride % 4 == 0 && out_stride % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(o) % (4 * sizeof(T)) == 0;
    if (vec4) {
      const int blocks = (rows + kThreads / 32 - 1) / (kThreads / 32);
      rmsnorm_rows_vec4_kernel<<<blocks, kThreads, 0, stream>>>(x, x_stride, weight, cols, eps, o, out_stride, rows);
    } else {
      rmsnorm_rows_kernel<<<rows, kThreads, 0, stream>>>(x, x_stride, weight, cols, eps, o, out_stride);
    }
  };
  if (out_type == WeightDType::BF16) {
    launch(static_cast<__nv_bfloat16*>(out));
  } else {
    launch(static_cast<float*>(out));
  }
  M3_CUDA_CHECK(cudaGetLastError());
}

void gated_silu_rows(const float* in, int in_stride, int F, void* out, WeightDType out_type, int out_stride, int rows,
                     cudaStream_t stream) {
  if (rows <= 0) return;
  if (out_type == WeightDType::BF16) {
    gated_silu_rows_kernel<<<rows, kThreads, 0, stream>>>(in, in_stride, F, static_cast<__nv_bfloat16*>(out),
                                                          out_stride);
  } else {
    gated_silu_rows_kernel<<<rows, kThreads, 0, stream>>>(in, in_stride, F, static_cast<float*>(out), out_stride);
  }
  M3_CUDA_CHECK(cudaGetLastError());
}

}  // namespace m3::kernels

namespace m3::kernels {
namespace {

int round8(int v) { return (v + 7) / 8 * 8; }
size_t round256(size_t v) { return (v + 255) & ~size_t{255}; }

// Lays the buffers out from `base` (nullptr: only counts); returns the bytes used.
size_t lay_out(const PrefillRowSizes& s, char* base, PrefillRowBuffers* out) {
  PrefillRowBuffers b;
  b.rows = lt_gemm_padded_rows(s.max_tokens);
  const size_t act = s.act == WeightDType::BF16 ? 2 : 4;
  b.res_stride = round8(s.d_model);
  b.u_stride = round8(s.d_model);
  b.w_stride = round8(s.in_proj_rows);
  b.o_stride = round8(s.d_inner);
  b.fc1_stride = s.mlp_width > 0 ? round8(2 * s.mlp_width) : 0;
  b.mlp_act_stride = s.mlp_width > 0 ? round8(s.mlp_width) : 0;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    char* p = base != nullptr ? base + at : nullptr;
    at += round256(bytes);
    return p;
  };
  const size_t rows = b.rows;
  b.res = reinterpret_cast<float*>(take(4 * rows * b.res_stride));
  b.u = take(act * rows * b.u_stride);
  b.w = reinterpret_cast<float*>(take(4 * rows * b.w_stride));
  b.o = take(act * rows * b.o_stride);
  if (s.mlp_width > 0) {
    b.fc1_out = reinterpret_cast<float*>(take(4 * rows * b.fc1_stride));
    b.mlp_act = take(act * rows * b.mlp_act_stride);
  }
  b.last = reinterpret_cast<float*>(take(4 * rows * b.res_stride));
  if (out != nullptr) *out = b;
  return at;
}

}  // namespace

size_t prefill_row_buffer_bytes(const PrefillRowSizes& s) { return lay_out(s, nullptr, nullptr); }

PrefillRowBuffers prefill_row_buffers(const PrefillRowSizes& s, void* base) {
  PrefillRowBuffers b;
  lay_out(s, static_cast<char*>(base), &b);
  return b;
}

}  // namespace m3::kernels
