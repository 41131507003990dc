// Owning CUDA streams, events, graphs and graph executables: released with their owner,
// also when the engine's constructor throws halfway through its load.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace m3::cuda {

template <typename Handle, cudaError_t (*Destroy)(Handle)>
class CudaHandle {
 public:
  CudaHandle() = default;
  ~CudaHandle() { reset(); }
  CudaHandle(CudaHandle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  CudaHandle& operator=(CudaHandle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  CudaHandle(const CudaHandle&) = delete;
  CudaHandle& operator=(const CudaHandle&) = delete;

  operator Handle() const { return h_; }  // NOLINT: passed straight to the runtime API
  // For the runtime's create calls: releases what this held, then takes the new handle.
  Handle* out() {
    reset();
    return &h_;
  }
  void reset() {
    if (h_ != nullptr) Destroy(h_);
    h_ = nullptr;
  }

 private:
  Handle h_ = nullptr;
};

using CudaStream = CudaHandle<cudaStream_t, cudaStreamDestroy>;
using CudaEvent = CudaHandle<cudaEvent_t, cudaEventDestroy>;
using CudaGraph = CudaHandle<cudaGraph_t, cudaGraphDestroy>;
using CudaGraphExec = CudaHandle<cudaGraphExec_t, cudaGraphExecDestroy>;

}  // namespace m3::cuda
