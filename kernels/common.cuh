// What every kernel file needs: error checks that throw with context, warp reductions,
// bf16 widening, 16-byte vector loads, four-value stores, the programmatic-dependent-launch barrier, and
// the shared-memory ceiling every kernel must respect (the RTX 5090's per-block limit).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace m3::kernels {

// RTX 5090 (sm_120) opt-in shared memory per block; H200 allows more, we never ask for it.
inline constexpr size_t kMaxSharedBytesPerBlock = 101376;

// A byte range a kernel asks the L2 to fetch ahead (the weights of a kernel that runs
// later in the step), so that later kernel reads from L2 while this one is latency-bound.
struct L2Prefetch {
  const void* ptr = nullptr;
  uint64_t bytes = 0;
};

inline void check_cuda(cudaError_t err, const char* what, const char* file, int line) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error in ") + what + " (" + file + ":" +
                             std::to_string(line) + "): " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

}  // namespace m3::kernels

#define M3_CUDA_CHECK(expr) ::m3::kernels::check_cuda((expr), #expr, __FILE__, __LINE__)

#if defined(__CUDACC__)
namespace m3::kernels {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sums each of N values (N a power of two <= 32) over the warp in N - 1 + 5 - log2(N)
// shuffles instead of 5 N: halves of the array are exchanged (a transposed butterfly).
// Afterwards lane L holds the total of value L % N in v[0].
namespace detail {
// One exchange stage of warp_sum_many (distance n), then the next; recursion rather than
// a halving loop so that every index is a compile-time constant at any N (a loop left
// the 32-wide array in local memory).
template <int N, int n>
__device__ __forceinline__ void warp_sum_many_stage(float (&v)[N], int lane) {
  if constexpr (n >= 1) {
    const bool upper = lane & n;
#pragma unroll
    for (int j = 0; j < n; ++j) {
      const float send = upper ? v[j] : v[j + n];
      const float keep = upper ? v[j + n] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, n);
    }
    warp_sum_many_stage<N, n / 2>(v, lane);
  }
}
}  // namespace detail

template <int N>
__device__ __forceinline__ float warp_sum_many(float (&v)[N]) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N must be a power of two <= 32");
  const int lane = threadIdx.x & 31;
  detail::warp_sum_many_stage<N, N / 2>(v, lane);
  float t = v[0];
#pragma unroll
  for (int o = 16; o >= N; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

// RMSNorm across a block, in two halves around a __syncthreads: each warp's lane 0 stores
// the warp's sums of squares (one per vector of the batch tile), then every thread turns
// the stored partials of vector b into 1 / rms.
template <int kWarps, int BT>
__device__ __forceinline__ void store_warp_sums(const float (&ss)[BT], float (&partial)[kWarps][BT]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int b = 0; b < BT; ++b) {
    const float t = warp_sum(ss[b]);
    if (lane == 0) partial[warp][b] = t;
  }
}
template <int kWarps, int BT>
__device__ __forceinline__ float inverse_rms(const float (&partial)[kWarps][BT], int b, int cols, float eps) {
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += partial[w][b];
  return rsqrtf(s / cols + eps);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// 16 bytes of data a step reads once (weights), in the two load forms that beat a plain
// __ldg somewhere, each used only where it won (docs/PERFORMANCE.md):
// - not kept in L1 (`.L1::no_allocate`): the CUDA-core gemvs of batch 1 and 2 and the
//   fused recurrence's out_proj columns (in every gemv from batch 4 it lost);
// - fetched from DRAM in 256-byte pieces (`.L2::256B`): the tensor-core gemvs (batch 2 and
//   up; in the batch-1 gemv it lost).
// asm volatile keeps them in program order with the PDL wait, so those issued before it
// stay before it (scripts/check_pdl_sass.sh).
enum class ReadOnce { NoL1, L2Pieces256 };
template <ReadOnce kForm>
__device__ __forceinline__ uint4 load16_read_once(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint4 v;
  if constexpr (kForm == ReadOnce::NoL1) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    asm volatile("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  }
  return v;
#else
  return __ldg(static_cast<const uint4*>(p));
#endif
}
__device__ __forceinline__ uint4 load16_no_l1(const void* p) { return load16_read_once<ReadOnce::NoL1>(p); }
__device__ __forceinline__ uint4 load16_l2_256(const void* p) { return load16_read_once<ReadOnce::L2Pieces256>(p); }

// Eight consecutive weights widened to float. W is 16-byte aligned at element i.
__device__ __forceinline__ void load8(const __nv_bfloat16* w, float (&out)[8]) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(w));
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    out[2 * j] = __uint_as_float(words[j] << 16);
    out[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
  }
}

__device__ __forceinline__ void load8(const float* w, float (&out)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(w));
  const float4 b = __ldg(reinterpret_cast<const float4*>(w) + 1);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ float load1(const __nv_bfloat16* w) { return __bfloat162float(*w); }
__device__ __forceinline__ float load1(const float* w) { return *w; }

// Four consecutive values in one store: 16 bytes of fp32, or 8 of bf16 or fp16 (rounded to
// nearest even).
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  *reinterpret_cast<uint2*>(p) =
      make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}
__device__ __forceinline__ void store4(__half* p, float4 v) {
  const __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
  *reinterpret_cast<uint2*>(p) =
      make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

// One 16-byte piece from global to shared memory by cp.async (L2 only), in flight until a
// cp.async wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

// Four bytes from global to shared memory by cp.async (through L1), for arrays whose rows
// are not 16-byte aligned.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gmem) : "memory");
}
// Closes this thread's group of cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Programmatic dependent launch: wait until the previous kernel in the stream finished
// and its writes are visible. Every kernel calls this before touching data another
// kernel wrote, so the chain stays ordered when launches overlap. A no-op when the
// kernel was launched without the attribute.
//
// ptxas moves a plain griddepcontrol.wait to the top of the kernel, above every load the
// source issues before it (even asm volatile ones), so the weights a kernel fetches "before
// the wait" would only be requested after the previous kernel finished. Predicating the wait
// on the clock, which ptxas cannot know in advance, keeps it where it is written (checked in
// the SASS with cuobjdump); both branches wait.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned now;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(now));
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %0, 0;\n\t@p griddepcontrol.wait;\n\t@!p griddepcontrol.wait;\n\t}" ::"r"(now)
      : "memory");
#endif
}

// Lets the next kernel's blocks start their prologue (they still wait for our completion
// in wait_for_previous_kernel before reading what we write).
__device__ __forceinline__ void allow_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// wait_for_previous_kernel, letting the next kernel launch before the wait (trigger_point
// 2) or right after it (1); with 0 the caller triggers later (PdlTrigger, plan_policy.h).
__device__ __forceinline__ void wait_for_previous_kernel(int trigger_point) {
  if (trigger_point == 2) allow_next_kernel();
  wait_for_previous_kernel();
  if (trigger_point == 1) allow_next_kernel();
}

// Pulls `r` into L2 without waiting for it. From sm_90 one thread per block asks the copy
// engine for the block's share in one bulk prefetch (a per-line prefetch loop put
// thousands of instructions in front of the kernel's own loads: +10% at batch 1);
// older chips spread 128-byte line prefetches over all threads.
// This block's share is the `block`-th of `blocks` (by default its place in the grid).
__device__ __forceinline__ void prefetch_l2(const L2Prefetch& r, uint64_t block, uint64_t blocks) {
  if (r.ptr == nullptr) return;
  const char* base = static_cast<const char*>(r.ptr);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x != 0) return;
  const uint64_t share = ((r.bytes + blocks - 1) / blocks + 15) & ~uint64_t{15};
  const uint64_t off = block * share;
  if (off >= r.bytes) return;
  const uint32_t size = static_cast<uint32_t>(min(share, r.bytes - off)) & ~15u;
  if (size > 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + off), "r"(size) : "memory");
#else
  const uint64_t threads = blocks * blockDim.x;
  for (uint64_t off = (block * blockDim.x + threadIdx.x) * 128; off < r.bytes; off += threads * 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off));
  }
#endif
}
__device__ __forceinline__ void prefetch_l2(const L2Prefetch& r) {
  prefetch_l2(r, ((uint64_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x,
              (uint64_t)gridDim.x * gridDim.y * gridDim.z);
}

// One output value at element i of `out`: fp32, or bf16 (to nearest) when `bf16`.
__device__ __forceinline__ void store_output(void* out, bool bf16, int64_t i, float v) {
  if (bf16) {
    static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<float*>(out)[i] = v;
  }
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }
__device__ __forceinline__ float softplus(float v) { return v > 20.f ? v : log1pf(expf(v)); }

}  // namespace m3::kernels
#endif
