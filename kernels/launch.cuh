// A kernel launch resolved once (kernel variant, grid, block, shared memory, parameter
// block) and replayed any number of times: the engine plans every launch of a step at
// load, so nothing is selected per token, graph or no graph.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
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
// cudaErrorInvalidValue (seen on branch experiment/persistent-step-v3,
// PERFORMANCE_NOTES.md run 143).
void allow_dynamic_smem(const void* kernel, size_t bytes);

// An integer environment switch for A/B measurements, or `fallback` when unset.
int env_int(const char* name, int fallback);

// Where a kernel lets the next one in the stream launch (programmatic dependent launch):
// 0 after its main work, 1 right after its own wait, 2 before it, so the next kernel's
// blocks issue their weight loads while this one computes. Default: the gemvs trigger
// before their wait, the recurrence right after it (H200, PERFORMANCE_NOTES.md runs
// 66-68: the step 174 -> 151 us at batch 1, 821 -> 794 at batch 64; the recurrence
// triggering before its wait was slower at batch 2; from batch 16 it triggers later
// still, see recurrence_trigger_point in mimo_step_tc.cu). M3_PDL_EARLY (bits 1 and 2:
// recurrence, gemvs trigger after their wait; default 3) and M3_PDL_FIRST (same bits:
// before it; default 2) override, for A/B measurements.
enum class PdlStage { Recurrence = 1, Gemv = 2 };
int pdl_trigger_point(PdlStage stage);

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

  // pdl: let this kernel start while the previous one in the stream drains (programmatic
  // dependent launch); the kernels themselves wait before reading dependent data.
  void launch(cudaStream_t stream, bool pdl) const;
  const std::string& name() const { return name_; }
  // A label for reports (e.g. which matrix a gemv multiplies).
  KernelLaunch& named(std::string name) {
    name_ = std::move(name);
    return *this;
  }
  dim3 grid() const { return grid_; }
  // How many blocks of this launch one multiprocessor holds at once.
  int resident_blocks_per_sm(int threads_per_block) const;
  size_t dynamic_smem() const { return smem_; }

 private:
  void check_resources() const;

  std::string name_;
  const void* func_ = nullptr;
  dim3 grid_, block_;
  size_t smem_ = 0;
  alignas(16) unsigned char params_[kMaxParamBytes] = {};
};

}  // namespace m3::kernels
