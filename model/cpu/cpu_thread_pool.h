// A fixed set of worker threads that run one index range at a time, split into equal
// contiguous shares (the caller takes share 0). Threads start once, in the constructor;
// a run() allocates nothing and creates no thread, so the decode step can use it per
// token. The split depends only on the range and the thread count, so every element is
// computed by the same code path whatever the batch: results do not depend on timing.
#pragma once

#include <barrier>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace m3 {

class CpuThreadPool {
 public:
  // threads <= 0: std::thread::hardware_concurrency() (at least 1).
  explicit CpuThreadPool(int threads);
  ~CpuThreadPool();
  CpuThreadPool(const CpuThreadPool&) = delete;
  CpuThreadPool& operator=(const CpuThreadPool&) = delete;

  int threads() const { return threads_; }

  // Calls fn(begin, end, share) on disjoint sub-ranges covering [0, n), in parallel, and
  // returns when all are done; share in [0, threads()) tells a call which per-thread
  // scratch it owns. fn must not throw. Not reentrant: one run() at a time.
  template <typename Fn>
  void run(int64_t n, Fn&& fn) {
    if (n <= 0) return;
    if (threads_ == 1 || n == 1) {
      fn(int64_t{0}, n, 0);
      return;
    }
    run_erased(n, const_cast<void*>(static_cast<const void*>(std::addressof(fn))),
               [](void* f, int64_t b, int64_t e, int share) {
      (*static_cast<std::remove_reference_t<Fn>*>(f))(b, e, share);
    });
  }

 private:
  using Trampoline = void (*)(void*, int64_t, int64_t, int);
  void run_erased(int64_t n, void* fn, Trampoline call);
  void run_share(int share);
  void worker_loop(int share);

  int threads_ = 1;
  // The job of the current run(), published to workers by the start barrier.
  int64_t job_n_ = 0;
  void* job_fn_ = nullptr;  // points at the caller's callable, alive for the run
  Trampoline job_call_ = nullptr;
  bool stopping_ = false;
  std::barrier<> start_;
  std::barrier<> done_;
  std::vector<std::jthread> workers_;
};

}  // namespace m3
