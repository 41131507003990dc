// Thread-block cluster helpers (sm_90 and later) shared by kernels that reduce partial
// results through distributed shared memory. With KS == 1 (no cluster) they fall back to
// the block barrier and the block's own shared memory.
#pragma once

#include <cstdint>

namespace m3::kernels {

// Split cluster barrier: arrive with release semantics once this block's part is written
// and wait with acquire just before reading the others' parts, with independent work
// between the two.
template <int KS>
__device__ __forceinline__ void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (KS > 1) { asm volatile("barrier.cluster.arrive.release;" ::: "memory"); return; }
#endif
}
template <int KS>
__device__ __forceinline__ void cluster_wait_acquire() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (KS > 1) { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); return; }
#endif
  __syncthreads();
}
// The address of `p` (this block's shared memory) in the shared memory of cluster block `rank`.
template <int KS>
__device__ __forceinline__ const float* map_cluster_rank(const float* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (KS > 1) {
    uint64_t out;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(reinterpret_cast<uint64_t>(p)), "r"(rank));
    return reinterpret_cast<const float*>(out);
  }
#endif
  return p;
}

}  // namespace m3::kernels
