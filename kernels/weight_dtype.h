// The element type of a model's weight matrices on the device: one type for the engine's
// options (model/engine.h) and the kernels' arguments. Plain C++, so code built without
// CUDA includes it.
#pragma once

namespace m3 {

enum class WeightDType { F32, BF16 };

}  // namespace m3
