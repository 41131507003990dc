// make_engine(): the one place that knows which backends exist.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <thread>

#include "model/cpu/cpu_engine.h"
#include "model/engine.h"
#include "model/slot_budget.h"
#if defined(M3_WITH_CUDA)
#include <cuda_runtime.h>

#include "model/cuda/cuda_engine.h"
#endif

namespace m3 {

std::string_view weight_dtype_name(WeightDType dtype) {
  switch (dtype) {
    case WeightDType::F32: return "fp32";
    case WeightDType::BF16: return "bf16";
  }
  return "unknown";
}

bool parse_weight_dtype(std::string_view name, WeightDType* out) {
  if (name == "fp32") {
    *out = WeightDType::F32;
  } else if (name == "bf16") {
    *out = WeightDType::BF16;
  } else {
    return false;
  }
  return true;
}

bool cuda_backend_built() {
#if defined(M3_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

bool cuda_backend_available() {
#if defined(M3_WITH_CUDA)
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

uint64_t cuda_free_memory(int device) {
#if defined(M3_WITH_CUDA)
  size_t free = 0, total = 0;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaMemGetInfo(&free, &total);
  if (err != cudaSuccess) {
    throw std::runtime_error("cuda device " + std::to_string(device) +
                             ": cannot read its free memory: " + cudaGetErrorString(err));
  }
  return free;
#else
  (void)device;
  throw std::runtime_error("cuda_free_memory: this build has no CUDA support");
#endif
}

MaxBatchChoice choose_auto_max_batch(std::string_view backend, const ModelConfig& config,
                                     const EngineOptions& options) {
  const bool cuda = backend == "cuda" || (backend == "auto" && cuda_backend_available());
  if (cuda) {
    return cuda_auto_max_batch(cuda_free_memory(options.device), config, options.weight_dtype,
                               options.state_dtype);
  }
  const int cores = options.cpu_threads > 0
                        ? options.cpu_threads
                        : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return cpu_auto_max_batch(cores);
}

namespace {

std::unique_ptr<Engine> make_backend(std::string_view backend, const ModelWeights& weights,
                                     const EngineOptions& options) {
  if (backend == "cpu") return make_cpu_engine(weights, options);
  if (backend == "cuda" || backend == "auto") {
#if defined(M3_WITH_CUDA)
    if (cuda_device_count() > 0) return make_cuda_engine(weights, options);
    if (backend == "cuda") {
      throw std::runtime_error("make_engine: backend \"cuda\" requested but no CUDA device is visible");
    }
#else
    if (backend == "cuda") {
      throw std::runtime_error(
          "make_engine: backend \"cuda\" requested but this build has no CUDA support "
          "(nvcc was not found at configure time)");
    }
#endif
    return make_cpu_engine(weights, options);
  }
  throw std::invalid_argument("make_engine: unknown backend \"" + std::string(backend) +
                              "\" (expected cpu, cuda or auto)");
}

}  // namespace

std::unique_ptr<Engine> make_engine(std::string_view backend, const ModelWeights& weights,
                                    const EngineOptions& options) {
  if (options.max_prefill_tokens < 1) {
    throw std::invalid_argument("make_engine: max_prefill_tokens must be >= 1, got " +
                                std::to_string(options.max_prefill_tokens));
  }
  std::unique_ptr<Engine> engine = make_backend(backend, weights, options);
  engine->max_prefill_tokens_ = options.max_prefill_tokens;  // the default prefill's limit
  return engine;
}

}  // namespace m3
