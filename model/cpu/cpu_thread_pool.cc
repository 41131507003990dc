#include "model/cpu/cpu_thread_pool.h"

#include <algorithm>

namespace m3 {
namespace {

int resolve_threads(int threads) {
  if (threads > 0) return threads;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace

CpuThreadPool::CpuThreadPool(int threads)
    : threads_(resolve_threads(threads)), start_(threads_), done_(threads_) {
  workers_.reserve(static_cast<size_t>(threads_ - 1));
  for (int share = 1; share < threads_; ++share) {
    workers_.emplace_back([this, share] { worker_loop(share); });
  }
}

CpuThreadPool::~CpuThreadPool() {
  if (workers_.empty()) return;
  stopping_ = true;
  start_.arrive_and_wait();  // releases the workers, which see stopping_ and return
  workers_.clear();          // joins
}

void CpuThreadPool::run_erased(int64_t n, void* fn, Trampoline call) {
  job_n_ = n;
  job_fn_ = fn;
  job_call_ = call;
  start_.arrive_and_wait();
  run_share(0);
  done_.arrive_and_wait();
}

void CpuThreadPool::run_share(int share) {
  const int64_t begin = job_n_ * share / threads_;
  const int64_t end = job_n_ * (share + 1) / threads_;
  if (begin < end) job_call_(job_fn_, begin, end, share);
}

void CpuThreadPool::worker_loop(int share) {
  for (;;) {
    start_.arrive_and_wait();
    if (stopping_) return;
    run_share(share);
    done_.arrive_and_wait();
  }
}

}  // namespace m3
