// A kernel launch resolved once (kernel variant, grid, block, shared memory, parameter
// block) and replayed any number of times: the engine plans every launch of a step at
// load, so nothing is selected per token, graph or no graph.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <functional>
#include <string>
#include <utility>

namespace m3::kernels {

// Multiprocessors of the current device (launch planning: waves, grid sizes).
int multiprocessor_count();

// Whether the current device launches thread-block clusters (sm_90 and later do; where it
// does not, planners pick a kernel without them instead of failing at the first launch).
bool cluster_launch_supported();

// Lets `kernel` take `bytes` of dynamic shared memory (above the default 48 KB). The limit
// belongs to the kernel, not to one launch, so it is only ever raised: lowering it for a
// smaller plan made an earlier, larger plan of the same kernel fail at launch with
// cudaErrorInvalidValue.
void allow_dynamic_smem(const void* kernel, size_t bytes);

// The configuration of one launch on `stream`, by programmatic dependent launch when `pdl`
// (the kernel then waits before reading what the previous one in the stream writes). `attr`
// holds the attribute the configuration points at: it must outlive the launch call.
cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream, bool pdl,
                                 cudaLaunchAttribute& attr);

class KernelLaunch {
 public:
  static constexpr size_t kMaxParamBytes = 512;

  KernelLaunch() = default;

  // `kernel` takes exactly one argument of type Params, by value. Checks the kernel's
  // static + dynamic shared memory against kMaxSharedBytesPerBlock (cudaFuncGetAttributes)
  // and raises its dynamic limit when above 48 KB; throws naming `name` otherwise.
  template <typename Params>
  static KernelLaunch make(const char* name, void (*kernel)(Params), dim3 grid, dim3 block,
                           size_t dynamic_smem, const Params& params) {
    static_assert(sizeof(Params) <= kMaxParamBytes, "parameter block too large");
    KernelLaunch l;
    l.name_ = name;
    l.func_ = reinterpret_cast<const void*>(kernel);
    l.grid_ = grid;
    l.block_ = block;
    l.smem_ = dynamic_smem;
    std::memcpy(l.params_, &params, sizeof(Params));
    l.check_resources();
    return l;
  }

  // A library's launches (a cuBLASLt GEMM, a row kernel with its own launcher), planned
  // at load like a kernel: `call` issues them on the stream it is given, in the same
  // order and with nothing chosen or allocated per call, so a graph can capture it. They
  // launch without programmatic dependent launch; a kernel after them still may use it.
  static KernelLaunch library(std::string name, std::function<void(cudaStream_t)> call) {
    KernelLaunch l;
    l.name_ = std::move(name);
    l.call_ = std::move(call);
    return l;
  }

  // pdl: let this kernel start while the previous one in the stream drains (programmatic
  // dependent launch); the kernels themselves wait before reading dependent data.
  void launch(cudaStream_t stream, bool pdl) const;
  bool is_library_call() const { return static_cast<bool>(call_); }
  const std::string& name() const { return name_; }
  // A label for reports (e.g. which matrix a gemv multiplies).
  KernelLaunch& named(std::string name) {
    name_ = std::move(name);
    return *this;
  }
  // What the planner chose for this launch beyond its kernel (tile, cluster, rows a warp,
  // ...), for the step plan's report.
  KernelLaunch& described(std::string variant) {
    variant_ = std::move(variant);
    return *this;
  }
  const std::string& variant() const { return variant_; }
  dim3 grid() const { return grid_; }
  dim3 block() const { return block_; }
  // How many blocks of this launch one multiprocessor holds at once (a kernel's launch only).
  int resident_blocks_per_sm(int threads_per_block) const;
  size_t dynamic_smem() const { return smem_; }

 private:
  void check_resources() const;

  std::string name_;
  std::string variant_;
  const void* func_ = nullptr;
  std::function<void(cudaStream_t)> call_;  // a library call instead of func_
  dim3 grid_, block_;
  size_t smem_ = 0;
  alignas(16) unsigned char params_[kMaxParamBytes] = {};
};

}  // namespace m3::kernels
