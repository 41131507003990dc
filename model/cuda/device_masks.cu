#include "model/cuda/device_masks.h"

#include <vector>

#include "kernels/common.cuh"

namespace m3::cuda {
namespace {

template <typename T>
DeviceBuffer upload(const std::vector<T>& host, const char* what) {
  DeviceBuffer buffer(sizeof(T) * host.size(), what);
  if (!host.empty()) M3_CUDA_CHECK(cudaMemcpy(buffer.get(), host.data(), buffer.bytes(), cudaMemcpyHostToDevice));
  return buffer;
}

}  // namespace

DeviceMaskTable::DeviceMaskTable(const SamplingMaskTable& table) {
  if (table.size() == 0) return;
  first_position_ = upload(table.first_position(), "sampling masks (positions)");
  period_ = upload(table.period(), "sampling masks (periods)");
  range_begin_ = upload(table.range_begin(), "sampling masks (range index)");
  ranges_ = upload(table.flat_ranges(), "sampling masks (ranges)");
  view_.first_position = first_position_.as<int32_t>();
  view_.period = period_.as<int32_t>();
  view_.range_begin = range_begin_.as<int32_t>();
  view_.ranges = ranges_.as<TokenRange>();
  view_.n_masks = table.size();
}

}  // namespace m3::cuda
