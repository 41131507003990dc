// How fast can the decode recurrence's state stream at all, by the shape of the kernel that
// moves it? Items of 64 x 128 fp32 (one head's state, 32 KB) are read, scaled and written
// back in place, at the item counts of batch 64, 128, 256 and 1024 (28 heads), by: the
// tensor-core recurrence's own grid and register layout, contiguous blocks of 128 to 1024
// threads, grid-stride loops, bulk (TMA) copies into shared memory, and persistent blocks
// with rings of bulk-copied items; a device-to-device memcpy of the same bytes for scale.
// Not part of the build (docs/PERFORMANCE.md, "The projections as GEMMs", has its figures):
//   nvcc -O3 -arch=sm_90 -std=c++17 scripts/probes/state_copy_probe.cu -o state_copy_probe && ./state_copy_probe
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <string>
#include <functional>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

constexpr int P = 64, N = 128, ITEM = P * N, ITEM4 = ITEM / 4;

// The tensor-core kernel's layout: T threads, CS = T / 128 warps share a 16-row tile.
template <int T>
__global__ void __launch_bounds__(T, T == 128 ? 4 : (T == 256 ? 3 : 1)) copy_regs(float* s, float f) {
  constexpr int CS = T / 128, NG = 8 / CS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rt = warp % 4, ch = warp / 4;
  float4* base = reinterpret_cast<float4*>(s + (size_t)blockIdx.x * ITEM);
  float4 v[NG][2];
  const int r0 = rt * 16 + g;
#pragma unroll
  for (int mi = 0; mi < NG; ++mi) {
    const int m = ch * NG + mi;
    v[mi][0] = base[r0 * 32 + 4 * m + t];
    v[mi][1] = base[(r0 + 8) * 32 + 4 * m + t];
  }
#pragma unroll
  for (int mi = 0; mi < NG; ++mi) {
    const int m = ch * NG + mi;
    float4 a = v[mi][0], b = v[mi][1];
    a.x *= f; a.y *= f; a.z *= f; a.w *= f; b.x *= f; b.y *= f; b.z *= f; b.w *= f;
    __stcg(base + r0 * 32 + 4 * m + t, a);
    __stcg(base + (r0 + 8) * 32 + 4 * m + t, b);
  }
}

// Contiguous: T threads, each 2048 / T float4 at stride T.
template <int T, int MINB>
__global__ void __launch_bounds__(T, MINB) copy_contig(float* s, float f) {
  constexpr int PER = ITEM4 / T;
  float4* base = reinterpret_cast<float4*>(s + (size_t)blockIdx.x * ITEM);
  float4 v[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) v[i] = base[threadIdx.x + i * T];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    float4 a = v[i];
    a.x *= f; a.y *= f; a.z *= f; a.w *= f;
    __stcg(base + threadIdx.x + i * T, a);
  }
}

// Grid-stride, U float4 a thread in flight.
template <int U>
__global__ void __launch_bounds__(256) copy_stride(float* s, float f, size_t n4) {
  float4* b = reinterpret_cast<float4*>(s);
  const size_t stride = (size_t)gridDim.x * 256 * U;
  for (size_t i = (size_t)blockIdx.x * 256 * U + threadIdx.x; i < n4; i += stride) {
    float4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = b[i + u * 256];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float4 a = v[u];
      a.x *= f; a.y *= f; a.z *= f; a.w *= f;
      __stcg(b + i + u * 256, a);
    }
  }
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* m, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(m)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* m, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(m)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* m) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(m))
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* m, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(smem_u32(m)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}

// One item a block by bulk copy into shared memory (PIECES copies), threads scale and store.
template <int T, int PIECES, bool kBulkStore>
__global__ void __launch_bounds__(T) copy_bulk(float* s, float f) {
  extern __shared__ float4 sm4[];
  __shared__ uint64_t mbar;
  float4* base = reinterpret_cast<float4*>(s + (size_t)blockIdx.x * ITEM);
  if (threadIdx.x == 0) {
    mbar_init(&mbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbar_expect(&mbar, ITEM * 4);
#pragma unroll
    for (int k = 0; k < PIECES; ++k) bulk_load(sm4 + k * ITEM4 / PIECES, base + k * ITEM4 / PIECES, ITEM * 4 / PIECES, &mbar);
  }
  mbar_wait(&mbar, 0);
  constexpr int PER = ITEM4 / T;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    float4 a = sm4[threadIdx.x + i * T];
    a.x *= f; a.y *= f; a.z *= f; a.w *= f;
    if constexpr (kBulkStore) sm4[threadIdx.x + i * T] = a;
    else __stcg(base + threadIdx.x + i * T, a);
  }
  if constexpr (kBulkStore) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      bulk_store(base, sm4, ITEM * 4);
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
  }
}

// Persistent blocks, a ring of STAGES item buffers filled by bulk copies ahead.
template <int T, int STAGES>
__global__ void __launch_bounds__(T) copy_ring(float* s, float f, int items) {
  extern __shared__ float4 sm4[];
  __shared__ uint64_t mbar[STAGES];
  if (threadIdx.x == 0) {
    for (int k = 0; k < STAGES; ++k) mbar_init(&mbar[k], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int first = blockIdx.x, step = gridDim.x;
  if (threadIdx.x == 0) {
    for (int k = 0; k < STAGES; ++k) {
      const int it = first + k * step;
      if (it < items) {
        mbar_expect(&mbar[k], ITEM * 4);
        bulk_load(sm4 + k * ITEM4, s + (size_t)it * ITEM, ITEM * 4, &mbar[k]);
      }
    }
  }
  int n = 0;
  for (int it = first; it < items; it += step, ++n) {
    const int k = n % STAGES;
    mbar_wait(&mbar[k], (n / STAGES) & 1);
    float4* base = reinterpret_cast<float4*>(s + (size_t)it * ITEM);
    float4* buf = sm4 + k * ITEM4;
    constexpr int PER = ITEM4 / T;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      float4 a = buf[threadIdx.x + i * T];
      a.x *= f; a.y *= f; a.z *= f; a.w *= f;
      __stcg(base + threadIdx.x + i * T, a);
    }
    __syncthreads();  // the buffer is free
    const int nx = it + STAGES * step;
    if (threadIdx.x == 0 && nx < items) {
      mbar_expect(&mbar[k], ITEM * 4);
      bulk_load(buf, s + (size_t)nx * ITEM, ITEM * 4, &mbar[k]);
    }
  }
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int max_items = 28 * 1024;
  float* d = nullptr;
  CK(cudaMalloc(&d, (size_t)max_items * ITEM * 4));
  CK(cudaMemset(d, 0, (size_t)max_items * ITEM * 4));
  float* d2 = nullptr;
  CK(cudaMalloc(&d2, (size_t)max_items * ITEM * 4));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaFuncSetAttribute(copy_bulk<128, 1, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, ITEM * 4));
  CK(cudaFuncSetAttribute(copy_bulk<128, 4, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, ITEM * 4));
  CK(cudaFuncSetAttribute(copy_bulk<256, 4, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, ITEM * 4));
  CK(cudaFuncSetAttribute(copy_bulk<128, 1, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, ITEM * 4));
  CK(cudaFuncSetAttribute(copy_ring<256, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * ITEM * 4));
  CK(cudaFuncSetAttribute(copy_ring<256, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * ITEM * 4));
  CK(cudaFuncSetAttribute(copy_ring<512, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * ITEM * 4));
  for (int batch : {64, 128, 256, 1024}) {
    const int items = 28 * batch;
    const size_t bytes = (size_t)items * ITEM * 4;
    std::vector<std::pair<std::string, std::function<void()>>> vs = {
        {"memcpy d2d (other buffer)", [&] { CK(cudaMemcpyAsync(d2, d, bytes, cudaMemcpyDeviceToDevice)); }},
        {"regs tc 128 thr (today)", [&] { copy_regs<128><<<items, 128>>>(d, 0.999f); }},
        {"regs tc 256 thr", [&] { copy_regs<256><<<items, 256>>>(d, 0.999f); }},
        {"regs tc 512 thr", [&] { copy_regs<512><<<items, 512>>>(d, 0.999f); }},
        {"contig 128 thr", [&] { copy_contig<128, 4><<<items, 128>>>(d, 0.999f); }},
        {"contig 256 thr", [&] { copy_contig<256, 4><<<items, 256>>>(d, 0.999f); }},
        {"contig 512 thr", [&] { copy_contig<512, 2><<<items, 512>>>(d, 0.999f); }},
        {"contig 1024 thr", [&] { copy_contig<1024, 1><<<items, 1024>>>(d, 0.999f); }},
        {"stride U4 x8/SM", [&] { copy_stride<4><<<sms * 8, 256>>>(d, 0.999f, bytes / 16); }},
        {"stride U8 x4/SM", [&] { copy_stride<8><<<sms * 4, 256>>>(d, 0.999f, bytes / 16); }},
        {"bulk 1x32K 128thr", [&] { copy_bulk<128, 1, false><<<items, 128, ITEM * 4>>>(d, 0.999f); }},
        {"bulk 4x8K 128thr", [&] { copy_bulk<128, 4, false><<<items, 128, ITEM * 4>>>(d, 0.999f); }},
        {"bulk 4x8K 256thr", [&] { copy_bulk<256, 4, false><<<items, 256, ITEM * 4>>>(d, 0.999f); }},
        {"bulk 1x32K +bulk store", [&] { copy_bulk<128, 1, true><<<items, 128, ITEM * 4>>>(d, 0.999f); }},
        {"ring 256thr 2 stages x3/SM", [&] { copy_ring<256, 2><<<sms * 3, 256, 2 * ITEM * 4>>>(d, 0.999f, items); }},
        {"ring 256thr 3 stages x2/SM", [&] { copy_ring<256, 3><<<sms * 2, 256, 3 * ITEM * 4>>>(d, 0.999f, items); }},
        {"ring 512thr 3 stages x2/SM", [&] { copy_ring<512, 3><<<sms * 2, 512, 3 * ITEM * 4>>>(d, 0.999f, items); }},
    };
    printf("batch %d: %d items, %.1f MB read and written\n", batch, items, bytes / 1e6);
    for (int rep = 0; rep < 2; ++rep) {
      for (auto& [name, fn] : vs) {
        for (int i = 0; i < 3; ++i) fn();
        CK(cudaGetLastError());
        const int iters = batch >= 1024 ? 10 : 40;
        CK(cudaEventRecord(e0));
        for (int i = 0; i < iters; ++i) fn();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        const double us = ms * 1e3 / iters;
        printf("  %-30s %9.1f us  %6.2f TB/s  (%.1f us per 1792 items)\n", name.c_str(), us, 2.0 * bytes / us / 1e6,
               us * 1792 / items);
      }
    }
  }
  return 0;
}
