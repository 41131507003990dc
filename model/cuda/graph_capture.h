// Capturing a stream's work as a CUDA graph, for the decode step's graphs and the chunked
// prefill's alike.
#pragma once

#include <cuda_runtime.h>

#include "kernels/common.cuh"
#include "model/cuda/cuda_handle.h"

namespace m3::cuda {

// What `work` queues on `stream` (nothing else may queue on it meanwhile), captured into
// `graph`, instantiated into `exec` and uploaded, so that its first launch costs what any
// later one does. When `work` throws, the capture is ended and the exception passed on.
template <typename Work>
void capture_graph(cudaStream_t stream, Work&& work, CudaGraph& graph, CudaGraphExec& exec) {
  M3_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    work();
  } catch (...) {
    CudaGraph broken;  // ends the capture; released on the way out
    cudaStreamEndCapture(stream, broken.out());
    throw;
  }
  M3_CUDA_CHECK(cudaStreamEndCapture(stream, graph.out()));
  M3_CUDA_CHECK(cudaGraphInstantiate(exec.out(), graph, 0));
  M3_CUDA_CHECK(cudaGraphUpload(exec, stream));
}

}  // namespace m3::cuda
