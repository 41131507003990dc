// When the register-fragment chunk kernels (kernels/prefill_chunk_state_tc.cu,
// kernels/prefill_chunk_output_tc.cu) take a prefill scan, and their load-time setup.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/prefill_chunk_tc.cuh"

namespace m3::kernels::prefill_detail {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void set_chunk_kernel_smem_limit(const void* fn, size_t bytes, const char* name) {
  cudaFuncAttributes attr{};
  M3_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
  if (attr.sharedSizeBytes + bytes > kMaxSharedBytesPerBlock) {
    throw std::runtime_error(std::string(name) + " needs " + std::to_string(attr.sharedSizeBytes + bytes) +
                             " bytes of shared memory per block, over the " +
                             std::to_string(kMaxSharedBytesPerBlock) + "-byte limit");
  }
  allow_dynamic_smem(fn, bytes);
  // The whole carveout as shared memory, so that as many blocks fit an SM as it holds.
  M3_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     static_cast<int>(cudaSharedmemCarveoutMaxShared)));
}

bool chunk_tc_applies(const PrefillScanArgs& a) {
  const PrefillScanDims& d = a.dims;
  if (!(d.precision == ScanPrecision::Bf16TensorCores && a.mimo_rotation && d.d_state % 32 == 0 &&
        d.d_state <= kMaxN && d.headdim % 16 == 0 && d.headdim <= kMaxP &&
        (d.rank == 1 || d.rank == 2 || d.rank == 4 || d.rank == 8) && d.n_angles % 2 == 0)) {
    return false;
  }
  // The staged rows are 16-byte cp.async pieces: rows and offsets of x and z a multiple of
  // four floats, the parameter arrays 16-byte aligned; o is written in pairs.
  const bool rows16 = a.w_stride % 4 == 0 && a.off_x % 4 == 0 && a.off_z % 4 == 0 && aligned16(a.w);
  const bool params16 = aligned16(a.B_bias) && aligned16(a.C_bias) && aligned16(a.mimo_x) && aligned16(a.mimo_z) &&
                        aligned16(a.mimo_o) && (a.out_norm == nullptr || aligned16(a.out_norm));
  const int most = std::max(chunk_tc_smem_bytes(d, true), chunk_tc_smem_bytes(d, false));
  return rows16 && params16 && a.o_stride % 2 == 0 && most <= static_cast<int>(kMaxSharedBytesPerBlock);
}

int chunk_tc_smem_bytes(const PrefillScanDims& d, bool output) {
  return output ? tc::chunk_output_tc_smem_bytes(d) : tc::chunk_state_tc_smem_bytes(d);
}

void prepare_chunk_tc() {
  tc::prepare_chunk_state_tc();
  tc::prepare_chunk_output_tc();
}

}  // namespace m3::kernels::prefill_detail
