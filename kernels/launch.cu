#include "kernels/launch.cuh"

#include <stdexcept>

#include "kernels/common.cuh"

namespace m3::kernels {

int multiprocessor_count() {
  int device = 0, n = 0;
  M3_CUDA_CHECK(cudaGetDevice(&device));
  M3_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

bool cluster_launch_supported() {
  static const bool value = [] {
    int device = 0, v = 0;
    M3_CUDA_CHECK(cudaGetDevice(&device));
    return cudaDeviceGetAttribute(&v, cudaDevAttrClusterLaunch, device) == cudaSuccess && v != 0;
  }();
  return value;
}

namespace {
// `attr`: the kernel's attributes as queried before (its limit as it stood then).
void raise_dynamic_smem_limit(const void* kernel, size_t bytes, const cudaFuncAttributes& attr) {
  if (bytes <= 48 * 1024 || bytes <= static_cast<size_t>(attr.maxDynamicSharedSizeBytes)) return;
  M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}
}  // namespace

void allow_dynamic_smem(const void* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return;
  cudaFuncAttributes attr{};
  M3_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  raise_dynamic_smem_limit(kernel, bytes, attr);
}

cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream, bool pdl,
                                 cudaLaunchAttribute& attr) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = dynamic_smem;
  config.stream = stream;
  if (pdl) {
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attr;
    config.numAttrs = 1;
  }
  return config;
}

void KernelLaunch::check_resources() const {
  cudaFuncAttributes attr{};
  M3_CUDA_CHECK(cudaFuncGetAttributes(&attr, func_));
  const size_t total = attr.sharedSizeBytes + smem_;
  if (total > kMaxSharedBytesPerBlock) {
    throw std::runtime_error("kernel " + name_ + " needs " + std::to_string(total) +
                             " bytes of shared memory per block (static " +
                             std::to_string(attr.sharedSizeBytes) + " + dynamic " +
                             std::to_string(smem_) + "), over the " +
                             std::to_string(kMaxSharedBytesPerBlock) +
                             "-byte limit every target GPU (RTX 5090) allows");
  }
  const unsigned threads = block_.x * block_.y * block_.z;
  if (threads > static_cast<unsigned>(attr.maxThreadsPerBlock)) {
    throw std::runtime_error("kernel " + name_ + " launched with " + std::to_string(threads) +
                             " threads per block; its registers allow " +
                             std::to_string(attr.maxThreadsPerBlock));
  }
  raise_dynamic_smem_limit(func_, smem_, attr);
}

int KernelLaunch::resident_blocks_per_sm(int threads_per_block) const {
  if (func_ == nullptr) throw std::logic_error("resident_blocks_per_sm: " + name_ + " is no kernel launch");
  int n = 0;
  M3_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, func_, threads_per_block, smem_));
  return n;
}

void KernelLaunch::launch(cudaStream_t stream, bool pdl) const {
  if (call_) {
    call_(stream);
    return;
  }
  cudaLaunchAttribute attr{};
  const cudaLaunchConfig_t config = launch_config(grid_, block_, smem_, stream, pdl, attr);
  void* args[1] = {const_cast<unsigned char*>(params_)};
  M3_CUDA_CHECK(cudaLaunchKernelExC(&config, func_, args));
}

}  // namespace m3::kernels
