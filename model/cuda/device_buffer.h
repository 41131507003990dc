// Owning device and pinned-host allocations. Every allocation the CUDA engine makes goes
// through here, so tests can assert that decode steps allocate nothing.
#pragma once

#include <cstddef>
#include <cstdint>

namespace m3::cuda {

// Number of device and pinned-host allocations made so far in this process.
uint64_t allocation_count();

// Page-locked host memory (cudaMallocHost), counted as above; throws std::runtime_error
// naming `what` when the system refuses it. free_pinned(nullptr) does nothing.
void* allocate_pinned(size_t bytes, const char* what);
void free_pinned(void* ptr) noexcept;
// Whether [ptr, ptr + bytes) lies wholly inside one allocate_pinned() allocation, which the
// device can copy to and from directly.
bool is_page_locked(const void* ptr, size_t bytes);

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes, const char* what);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T> T* as() const { return static_cast<T*>(ptr_); }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes, const char* what);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; o.bytes_ = 0; }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  template <typename T> T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace m3::cuda
