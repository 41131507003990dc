// libFuzzer target for the safetensors parser: any bytes as a file must give either a
// parsed file whose views lie inside the mapping, or a std::runtime_error.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "model/safetensors.h"

namespace {

// One in-memory file for the whole run, rewritten per input; the parser opens it by path.
int memory_fd() {
  static int fd = [] {
    int f = ::memfd_create("fuzz.safetensors", 0);
    if (f < 0) std::abort();
    return f;
  }();
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memory_fd();
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) std::abort();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    auto f = m3::SafetensorsFile::open(path);
    volatile unsigned sink = 0;
    for (const auto& [name, view] : f->tensors()) {
      if (view.nbytes != static_cast<size_t>(view.numel()) * m3::dtype_size(view.dtype)) std::abort();
      // Touch the first and last byte so AddressSanitizer / a fault catches a bad view.
      if (view.nbytes) sink = sink + static_cast<unsigned>(view.data[0]) + static_cast<unsigned>(view.data[view.nbytes - 1]);
      if (view.dtype == m3::DType::F32 || view.dtype == m3::DType::BF16 || view.dtype == m3::DType::F16)
        if (view.numel() < (1 << 16)) (void)m3::to_f32(view);
    }
  } catch (const std::runtime_error&) {
  }
  return 0;
}
