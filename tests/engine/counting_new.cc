// Counting replacements of the global operator new: see counting_new.h.
#include "counting_new.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {
std::atomic<bool> g_counting{false};
std::atomic<bool> g_only_marked{false};
std::atomic<long> g_allocations{0};
thread_local bool t_marked = false;

bool counts() {
  return g_counting.load(std::memory_order_relaxed) && (t_marked || !g_only_marked.load(std::memory_order_relaxed));
}

void* counted_alloc(std::size_t n) {
  if (counts()) g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}

// The over-aligned forms (types aligned past 16 bytes) are counted too.
void* counted_aligned_alloc(std::size_t n, std::align_val_t alignment) {
  if (counts()) g_allocations.fetch_add(1, std::memory_order_relaxed);
  const auto align = static_cast<std::size_t>(alignment);
  const std::size_t size = (n == 0 ? align : (n + align - 1) / align * align);  // aligned_alloc's rule
  if (void* p = std::aligned_alloc(align, size)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t n) { return counted_alloc(n); }
void* operator new[](std::size_t n) { return counted_alloc(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_alloc(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void* operator new(std::size_t n, std::align_val_t a) { return counted_aligned_alloc(n, a); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted_aligned_alloc(n, a); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace m3::testing {

void start_counting_allocations() {
  g_allocations = 0;
  g_counting = true;
}

long stop_counting_allocations() {
  g_counting = false;
  return g_allocations.load();
}

void count_only_marked_threads(bool only) { g_only_marked = only; }

void mark_this_thread() { t_marked = true; }

}  // namespace m3::testing
