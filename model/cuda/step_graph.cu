#include "model/cuda/step_graph.h"

#include "model/cuda/graph_capture.h"

namespace m3::cuda {

StepLauncher::StepLauncher(cudaStream_t stream, bool pdl) : stream_(stream), pdl_(pdl) {
  chain_streams_.resize(kMaxChains - 1);
  join_events_.resize(kMaxChains - 1);
  for (auto& s : chain_streams_) M3_CUDA_CHECK(cudaStreamCreateWithFlags(s.out(), cudaStreamNonBlocking));
  for (auto& e : join_events_) M3_CUDA_CHECK(cudaEventCreateWithFlags(e.out(), cudaEventDisableTiming));
  M3_CUDA_CHECK(cudaEventCreateWithFlags(fork_event_.out(), cudaEventDisableTiming));
  for (auto& e : timing_) M3_CUDA_CHECK(cudaEventCreate(e.out()));
}

void StepLauncher::launch(const StepPlan& g) {
  const size_t chains = g.chain_begin.size();
  if (chains > 1) {
    M3_CUDA_CHECK(cudaEventRecord(fork_event_, stream_));
    for (size_t k = 1; k < chains; ++k) M3_CUDA_CHECK(cudaStreamWaitEvent(chain_streams_[k - 1], fork_event_, 0));
  }
  for (size_t i = 0; i < g.chain_end(0); ++i) g.launches[i].launch(stream_, pdl_ && i > 0);
  for (size_t k = 1; k < chains; ++k) {
    const size_t begin = g.chain_begin[k];
    for (size_t i = begin; i < g.chain_end(k); ++i) g.launches[i].launch(chain_streams_[k - 1], pdl_ && i > begin);
  }
  for (size_t k = 1; k < chains; ++k) {
    M3_CUDA_CHECK(cudaEventRecord(join_events_[k - 1], chain_streams_[k - 1]));
    M3_CUDA_CHECK(cudaStreamWaitEvent(stream_, join_events_[k - 1], 0));
  }
}

void StepLauncher::capture(StepGraph& g) {
  capture_graph(stream_, [&] { launch(g.plan); }, g.graph, g.exec);
}

void StepLauncher::run(const StepGraph& g, bool use_graph) {
  if (use_graph) {
    M3_CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
    return;
  }
  launch(g.plan);
}

float StepLauncher::replay_group_us(const StepGraph& g, bool use_graph, int group) {
  return elapsed_us([&] {
           for (int j = 0; j < group; ++j) run(g, use_graph);
         }) /
         group;
}

}  // namespace m3::cuda
