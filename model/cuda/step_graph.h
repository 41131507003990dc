// A planned step captured as a CUDA graph, and the launcher that runs plans on the
// engine's stream: chain 0 on it, chain k on a stream of its own forked off it and joined
// back into it, PDL inside each chain (a chain's first kernel follows an event or a host
// copy, not a kernel). The engine replays one graph per bucket and queue place.
#pragma once

#include <cuda_runtime.h>

#include <utility>
#include <vector>

#include "kernels/common.cuh"
#include "model/cuda/cuda_handle.h"
#include "model/cuda/step_plan.h"

namespace m3::cuda {

struct StepGraph {
  StepPlan plan;
  CudaGraph graph;
  CudaGraphExec exec;  // null until captured
  // Every candidate measured at load, us per step (empty where there was one).
  std::vector<std::pair<StepVariant, float>> measured;
};

class StepLauncher {
 public:
  static constexpr int kMaxChains = 4;

  // `stream`: the engine's, which outlives the launcher. pdl: programmatic dependent
  // launch between the kernels of a chain.
  StepLauncher(cudaStream_t stream, bool pdl);

  // The plan's kernels, launched one by one (what a graph captures).
  void launch(const StepPlan& plan);
  // Captures the plan into g.graph and uploads its executable.
  void capture(StepGraph& g);
  // One step: the graph's replay, or the plan's launches.
  void run(const StepGraph& g, bool use_graph);

  // Device time of what `work` queues on the stream, between two events, in us.
  template <typename Work>
  float elapsed_us(Work&& work) {
    M3_CUDA_CHECK(cudaEventRecord(timing_[0], stream_));
    work();
    M3_CUDA_CHECK(cudaEventRecord(timing_[1], stream_));
    M3_CUDA_CHECK(cudaEventSynchronize(timing_[1]));
    float ms = 0.f;
    M3_CUDA_CHECK(cudaEventElapsedTime(&ms, timing_[0], timing_[1]));
    return ms * 1000.f;
  }
  // `group` steps back to back, so the host's launch latency is hidden as it is in a
  // serving loop; the group's mean us per step.
  float replay_group_us(const StepGraph& g, bool use_graph, int group);

  cudaStream_t stream() const { return stream_; }
  bool pdl() const { return pdl_; }

 private:
  cudaStream_t stream_;
  bool pdl_;
  // Streams and events that fork the step's chains off stream_ and join them back.
  std::vector<CudaStream> chain_streams_;
  CudaEvent fork_event_;
  std::vector<CudaEvent> join_events_;
  CudaEvent timing_[2];
};

}  // namespace m3::cuda
