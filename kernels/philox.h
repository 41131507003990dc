// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"), a
// counter-based generator usable on host and device, so the CPU and CUDA engines
// draw the same numbers for a slot: key = seed, counter = the slot's step count.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define M3_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define M3_HOST_DEVICE inline
#endif

namespace m3 {

M3_HOST_DEVICE uint32_t philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// First 32-bit output of Philox4x32-10 at (key, counter).
M3_HOST_DEVICE uint32_t philox4x32_10(uint64_t key, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = philox_mulhilo(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = philox_mulhilo(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// Uniform in [0, 1) with 24 random bits (exactly representable in float).
M3_HOST_DEVICE float philox_uniform(uint64_t seed, uint64_t counter) {
  return static_cast<float>(philox4x32_10(seed, counter) >> 8) * (1.0f / 16777216.0f);
}

}  // namespace m3
