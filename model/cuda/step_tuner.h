// Choosing the step of the small buckets by measurement at load. At batch 1 and 2 a step
// is a chain of short dependent kernels, and which of its variants is faster depends on
// the GPU it runs on, not only on its model (the same binary on two H200s of the same
// model chose differently; docs/PERFORMANCE.md). So where several are possible the engine captures
// each variant, replays them in turns, and keeps the fastest, as cuDNN's benchmark mode
// and TensorRT's tactic timing do.
#pragma once

#include <string>
#include <vector>

#include "model/cuda/step_graph.h"
#include "model/cuda_policy.h"

namespace m3::cuda {

// Every combination the policy leaves open for the `batch`-row bucket (measured fields
// both ways in the tuned buckets, one way elsewhere).
std::vector<StepVariant> step_variant_candidates(int batch, const StepVariantPolicy& policy);

// One candidate: taken as it is. Several: each is captured (when graphs are on) and
// replayed in turns on the bucket's rows (the scratch slot at load), the fastest by median
// kept with what was measured, the others released (also when a capture or replay throws).
StepGraph choose_fastest_step(std::vector<StepGraph> candidates, StepLauncher& launcher, bool use_graphs);

// "batch 1: <variant> (<us> us a step, fastest of <n> measured); batch 2: ..." for the
// buckets that measured their variants; empty when none did.
std::string tuner_report(const std::vector<StepGraph>& graphs);

}  // namespace m3::cuda
