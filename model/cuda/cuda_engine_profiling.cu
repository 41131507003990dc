// The CUDA engine's profiling hooks (profiling.h): its plans as reports, replays and
// kernels timed alone, the memory floor of a step.
#include <stdexcept>
#include <string>

#include "kernels/common.cuh"
#include "model/cuda/cuda_engine_impl.h"

namespace m3::cuda {

CudaProfiling* cuda_profiling(Engine& engine) { return dynamic_cast<CudaEngine*>(&engine); }

std::string to_string(const StepPlanReport& r) {
  std::string out = "bucket " + std::to_string(r.bucket) + ": " + std::to_string(r.chains.size()) +
                    (r.chains.size() == 1 ? " chain, " : " chains, ") + to_string(r.variant) + "\n";
  for (size_t c = 0; c < r.chains.size(); ++c) {
    out += "  chain " + std::to_string(c) + ":";
    const std::vector<PlannedKernel>& k = r.chains[c];
    for (size_t i = 0; i < k.size();) {
      size_t j = i + 1;
      while (j < k.size() && k[j].name == k[i].name && k[j].variant == k[i].variant) ++j;
      out += " " + k[i].name + (k[i].variant.empty() ? "" : " [" + k[i].variant + "]") +
             (j - i > 1 ? " x" + std::to_string(j - i) : "") + (j < k.size() ? "," : "");
      i = j;
    }
    out += "\n";
  }
  return out;
}

int CudaEngine::kernels_per_step(int batch) const {
  return static_cast<int>(graph_for_batch(batch).plan.launches.size());
}

StepPlanReport CudaEngine::step_plan(int batch) const {
  if (batch < 1 || batch > max_slots_) {
    throw std::invalid_argument("step_plan: batch " + std::to_string(batch) + " is outside [1, " +
                                std::to_string(max_slots_) + "]");
  }
  const StepGraph& g = graph_for_batch(batch);
  StepPlanReport r = g.plan.report();
  r.measured = g.measured;
  return r;
}

const StepGraph& CudaEngine::graph_to_time(const char* fn, int batch) const {
  if (batch < 1 || batch > max_slots_) {
    throw std::invalid_argument(std::string(fn) + ": batch " + std::to_string(batch) + " is outside [1, " +
                                std::to_string(max_slots_) + "]");
  }
  return graph_for_batch(batch);
}

std::vector<float> CudaEngine::time_replays(int batch, int iters, bool use_graph) {
  const StepGraph& g = graph_to_time("time_replays", batch);
  if (use_graph && !use_graphs_) {
    throw std::invalid_argument("time_replays: the engine was built with use_graphs=false");
  }
  use_device();
  constexpr int kGroup = 10;
  std::vector<float> us;
  us.reserve(iters / kGroup + 1);
  for (int i = 0; i < iters; i += kGroup) us.push_back(launcher_->replay_group_us(g, use_graph, kGroup));
  return us;
}

std::vector<CudaProfiling::KernelTime> CudaEngine::time_kernels(int batch, int reps) {
  if (batch < 1 || batch > max_slots_ || reps < 1) {
    throw std::invalid_argument("time_kernels: batch " + std::to_string(batch) + " or reps " +
                                std::to_string(reps) + " out of range");
  }
  use_device();
  const StepGraph& g = graph_for_batch(batch);
  std::vector<KernelTime> out;
  for (const kernels::KernelLaunch& l : g.plan.launches) {
    l.launch(stream_, false);
    const float us = launcher_->elapsed_us([&] {
      for (int r = 0; r < reps; ++r) l.launch(stream_, false);
    });
    out.push_back({l.name(), us / reps});
  }
  return out;
}

double CudaEngine::floor_bytes(int batch) const {
  const ModelConfig& c = config_;
  const double msize = weights_.type == WeightDType::BF16 ? 2.0 : 4.0;
  // Read and written once a step; a bf16 ssm part is half the bytes of an fp32 one.
  const double ssm_values = static_cast<double>(c.n_heads()) * c.ssm.headdim * c.ssm.d_state;
  const double layer_bytes =
      sizeof(float) * static_cast<double>(c.state_floats_per_layer()) - (layout_.ssm_bf16 ? 2.0 * ssm_values : 0.0);
  const double state = 2.0 * layer_bytes * c.n_layer * batch;
  const double embedding = msize * c.d_model * batch;
  const double logits = 4.0 * c.padded_vocab() * batch;
  return static_cast<double>(weights_.matrix_bytes + weights_.vector_bytes) + state + embedding + logits;
}

}  // namespace m3::cuda
