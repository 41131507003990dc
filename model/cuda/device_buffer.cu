#include "model/cuda/device_buffer.h"

#include <atomic>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/common.cuh"

namespace m3::cuda {
namespace {
std::atomic<uint64_t> g_allocations{0};

std::string size_text(size_t bytes) { return std::to_string(bytes) + " bytes"; }
}  // namespace

uint64_t allocation_count() { return g_allocations.load(); }

DeviceBuffer::DeviceBuffer(size_t bytes, const char* what) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t err = cudaMalloc(&ptr_, bytes);
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("cudaMalloc of ") + size_text(bytes) + " for " + what +
                             " failed: " + cudaGetErrorString(err));
  }
  ++g_allocations;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

PinnedBuffer::PinnedBuffer(size_t bytes, const char* what) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t err = cudaMallocHost(&ptr_, bytes);
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("cudaMallocHost of ") + size_text(bytes) + " for " +
                             what + " failed: " + cudaGetErrorString(err));
  }
  ++g_allocations;
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_ != nullptr) cudaFreeHost(ptr_);
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

}  // namespace m3::cuda
