#include "model/cuda/device_buffer.h"

#include <atomic>
#include <cstddef>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/common.cuh"

namespace m3::cuda {
namespace {
std::atomic<uint64_t> g_allocations{0};

std::string size_text(size_t bytes) { return std::to_string(bytes) + " bytes"; }

// Every page-locked allocation of the process (base address -> bytes), so that a copy can
// tell whether a host span lies wholly inside one.
std::mutex g_pinned_mu;
std::map<uintptr_t, size_t> g_pinned;
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

void* allocate_pinned(size_t bytes, const char* what) {
  void* ptr = nullptr;
  const cudaError_t err = cudaMallocHost(&ptr, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();  // a refused allocation leaves no error for the engine's next call
    throw std::runtime_error(std::string("cudaMallocHost of ") + size_text(bytes) + " for " +
                             what + " failed: " + cudaGetErrorString(err));
  }
  ++g_allocations;
  std::lock_guard lock(g_pinned_mu);
  g_pinned[reinterpret_cast<uintptr_t>(ptr)] = bytes;
  return ptr;
}

void free_pinned(void* ptr) noexcept {
  if (ptr == nullptr) return;
  {
    std::lock_guard lock(g_pinned_mu);
    g_pinned.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  cudaFreeHost(ptr);
}

bool is_page_locked(const void* ptr, size_t bytes) {
  if (ptr == nullptr || bytes == 0) return false;
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard lock(g_pinned_mu);
  auto it = g_pinned.upper_bound(begin);  // the first allocation starting after ptr
  if (it == g_pinned.begin()) return false;
  --it;
  return begin - it->first <= it->second && bytes <= it->second - (begin - it->first);
}

PinnedBuffer::PinnedBuffer(size_t bytes, const char* what) : bytes_(bytes) {
  if (bytes == 0) return;
  ptr_ = allocate_pinned(bytes, what);
}

PinnedBuffer::~PinnedBuffer() { free_pinned(ptr_); }

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    free_pinned(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

}  // namespace m3::cuda
