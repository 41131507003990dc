// The engine's sampling masks (SamplingMaskTable) copied to the device once at load, as
// the sampling kernel reads them (kernels/token_mask.h).
#pragma once

#include "kernels/token_mask.h"
#include "model/cuda/device_buffer.h"
#include "model/sampling_mask.h"

namespace m3::cuda {

class DeviceMaskTable {
 public:
  DeviceMaskTable() = default;
  explicit DeviceMaskTable(const SamplingMaskTable& table);

  int size() const { return view_.n_masks; }
  const TokenMaskView& view() const { return view_; }  // device pointers; no masks: n_masks 0

 private:
  DeviceBuffer first_position_, period_, range_begin_, ranges_;
  TokenMaskView view_;
};

}  // namespace m3::cuda
