// Host memory for one slot's state bytes (Engine::slot_state_bytes() long), made by the
// engine that copies to and from it (Engine::allocate_host_state): page-locked where the
// engine is a GPU's, so save_slot and load_slot move it with one DMA and no staging copy;
// plain memory elsewhere. Making one is slow (page locking takes milliseconds, and the GPU's
// streams do not overlap across it): keep it and reuse it.
#pragma once

#include <cstddef>
#include <span>
#include <utility>

namespace m3 {

class HostStateBuffer {
 public:
  using Release = void (*)(std::byte*) noexcept;

  HostStateBuffer() = default;
  // Takes `data` (`size` bytes), which `release` frees.
  HostStateBuffer(std::byte* data, size_t size, Release release) noexcept
      : data_(data), size_(size), release_(release) {}
  // Plain heap memory, not initialized.
  static HostStateBuffer plain(size_t size) {
    return HostStateBuffer(new std::byte[size], size, [](std::byte* p) noexcept { delete[] p; });
  }

  ~HostStateBuffer() { reset(); }
  HostStateBuffer(HostStateBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)),
        release_(std::exchange(o.release_, nullptr)) {}
  HostStateBuffer& operator=(HostStateBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      release_ = std::exchange(o.release_, nullptr);
    }
    return *this;
  }
  HostStateBuffer(const HostStateBuffer&) = delete;
  HostStateBuffer& operator=(const HostStateBuffer&) = delete;

  std::span<std::byte> bytes() { return {data_, size_}; }
  std::span<const std::byte> bytes() const { return {data_, size_}; }
  size_t size() const { return size_; }
  bool empty() const { return data_ == nullptr; }

 private:
  void reset() noexcept {
    if (data_ != nullptr && release_ != nullptr) release_(data_);
    data_ = nullptr;
    size_ = 0;
  }
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  Release release_ = nullptr;
};

}  // namespace m3
