#include "model/cuda/slot_state_copy.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/common.cuh"

namespace m3::cuda {
namespace {
constexpr size_t kTailBytes = sizeof(uint64_t) + sizeof(int32_t) + 4 + sizeof(int32_t);
constexpr size_t kFramePositionAt = sizeof(uint64_t) + sizeof(int32_t) + 4;  // within the tail
}  // namespace

SlotStateCopier::SlotStateCopier(size_t slot_state_floats)
    : state_floats_(slot_state_floats),
      bytes_(sizeof(float) * slot_state_floats + kTailBytes),
      staging_(bytes_, "slot state staging") {
  M3_CUDA_CHECK(cudaStreamCreateWithFlags(copy_stream_.out(), cudaStreamNonBlocking));
  M3_CUDA_CHECK(cudaEventCreateWithFlags(steps_queued_.out(), cudaEventDisableTiming));
  M3_CUDA_CHECK(cudaEventCreateWithFlags(copied_.out(), cudaEventDisableTiming));
}

void SlotStateCopier::queue_save(cudaStream_t step_stream, const SlotDeviceState& slot, std::byte* target) {
  M3_CUDA_CHECK(cudaEventRecord(steps_queued_, step_stream));
  M3_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, steps_queued_, 0));
  M3_CUDA_CHECK(cudaMemcpyAsync(target, slot.state, sizeof(float) * state_floats_, cudaMemcpyDeviceToHost,
                                copy_stream_));
  std::byte* tail = target + sizeof(float) * state_floats_;
  M3_CUDA_CHECK(cudaMemcpyAsync(tail, slot.counter, sizeof(uint64_t), cudaMemcpyDeviceToHost, copy_stream_));
  M3_CUDA_CHECK(cudaMemcpyAsync(tail + sizeof(uint64_t), slot.last_token, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                copy_stream_));
  M3_CUDA_CHECK(cudaMemcpyAsync(tail + kFramePositionAt, slot.frame_position, sizeof(int32_t),
                                cudaMemcpyDeviceToHost, copy_stream_));
  M3_CUDA_CHECK(cudaEventRecord(copied_, copy_stream_));
}

void SlotStateCopier::write_flags(std::byte* target, SlotHostFlags flags) const {
  std::byte* flag_bytes = target + sizeof(float) * state_floats_ + sizeof(uint64_t) + sizeof(int32_t);
  flag_bytes[0] = std::byte{flags.has_sample ? uint8_t{1} : uint8_t{0}};
  flag_bytes[1] = std::byte{static_cast<uint8_t>(flags.parity & 1)};
  flag_bytes[2] = std::byte{0};
  flag_bytes[3] = std::byte{0};
}

void SlotStateCopier::save(cudaStream_t step_stream, const SlotDeviceState& slot, SlotHostFlags flags,
                           std::span<std::byte> out) {
  if (out.size() != bytes_) {
    throw std::invalid_argument("save_slot: " + std::to_string(out.size()) + " bytes given, a slot's state is " +
                                std::to_string(bytes_));
  }
  // Page-locked memory takes the device's copy itself; pageable memory goes through staging_.
  const bool direct = is_page_locked(out.data(), out.size());
  std::byte* target = direct ? out.data() : staging_.as<std::byte>();
  queue_save(step_stream, slot, target);
  M3_CUDA_CHECK(cudaEventSynchronize(copied_));  // also ends a pending load's use of staging_
  load_pending_ = false;
  write_flags(target, flags);
  if (!direct) std::memcpy(out.data(), target, bytes_);
}

void SlotStateCopier::save_async(cudaStream_t step_stream, const SlotDeviceState& slot, SlotHostFlags flags,
                                 std::span<std::byte> out, cudaEvent_t copied) {
  if (out.size() != bytes_) {
    throw std::invalid_argument("save_slot_async: " + std::to_string(out.size()) +
                                " bytes given, a slot's state is " + std::to_string(bytes_));
  }
  if (!is_page_locked(out.data(), out.size())) {
    throw std::invalid_argument("save_slot_async: the bytes are not in page-locked memory this process allocated");
  }
  write_flags(out.data(), flags);  // bytes no copy of the device's writes
  queue_save(step_stream, slot, out.data());
  M3_CUDA_CHECK(cudaEventRecord(copied, copy_stream_));
}

void SlotStateCopier::check(std::span<const std::byte> in, int vocab_size) const {
  if (in.size() != bytes_) {
    throw std::invalid_argument("load_slot: " + std::to_string(in.size()) + " bytes given, a slot's state is " +
                                std::to_string(bytes_));
  }
  const std::byte* tail = in.data() + sizeof(float) * state_floats_;
  int32_t last = 0;
  std::memcpy(&last, tail + sizeof(uint64_t), sizeof last);
  const auto has_sample = static_cast<uint8_t>(tail[sizeof(uint64_t) + sizeof(int32_t)]);
  const auto parity = static_cast<uint8_t>(tail[sizeof(uint64_t) + sizeof(int32_t) + 1]);
  const bool spare_zero = tail[sizeof(uint64_t) + sizeof(int32_t) + 2] == std::byte{0} &&
                          tail[sizeof(uint64_t) + sizeof(int32_t) + 3] == std::byte{0};
  int32_t frame_position = 0;
  std::memcpy(&frame_position, tail + kFramePositionAt, sizeof frame_position);
  if (has_sample > 1 || parity > 1 || !spare_zero || last < 0 || last >= vocab_size || frame_position < 0) {
    throw std::invalid_argument("load_slot: not a slot state of this engine (token " + std::to_string(last) +
                                ", flags " + std::to_string(has_sample) + "/" + std::to_string(parity) +
                                ", frame position " + std::to_string(frame_position) + ")");
  }
}

SlotHostFlags SlotStateCopier::flags_of(std::span<const std::byte> in, size_t state_floats) {
  const std::byte* tail = in.data() + sizeof(float) * state_floats;
  const auto has_sample = static_cast<uint8_t>(tail[sizeof(uint64_t) + sizeof(int32_t)]);
  const auto parity = static_cast<uint8_t>(tail[sizeof(uint64_t) + sizeof(int32_t) + 1]);
  return {has_sample == 1, parity};
}

void SlotStateCopier::queue_load(cudaStream_t step_stream, const SlotDeviceState& slot, const std::byte* source) {
  M3_CUDA_CHECK(cudaEventRecord(steps_queued_, step_stream));
  M3_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, steps_queued_, 0));
  M3_CUDA_CHECK(cudaMemcpyAsync(slot.state, source, sizeof(float) * state_floats_, cudaMemcpyHostToDevice,
                                copy_stream_));
  const std::byte* source_tail = source + sizeof(float) * state_floats_;
  M3_CUDA_CHECK(cudaMemcpyAsync(slot.counter, source_tail, sizeof(uint64_t), cudaMemcpyHostToDevice, copy_stream_));
  M3_CUDA_CHECK(cudaMemcpyAsync(slot.last_token, source_tail + sizeof(uint64_t), sizeof(int32_t),
                                cudaMemcpyHostToDevice, copy_stream_));
  M3_CUDA_CHECK(cudaMemcpyAsync(slot.frame_position, source_tail + kFramePositionAt, sizeof(int32_t),
                                cudaMemcpyHostToDevice, copy_stream_));
  M3_CUDA_CHECK(cudaEventRecord(copied_, copy_stream_));
}

SlotHostFlags SlotStateCopier::load(cudaStream_t step_stream, const SlotDeviceState& slot,
                                    std::span<const std::byte> in, int vocab_size) {
  check(in, vocab_size);
  const bool direct = is_page_locked(in.data(), in.size());
  const std::byte* source = in.data();
  if (!direct) {
    // The staging buffer may still feed the previous load's copy.
    if (load_pending_) M3_CUDA_CHECK(cudaEventSynchronize(copied_));
    std::memcpy(staging_.as<std::byte>(), in.data(), bytes_);
    source = staging_.as<std::byte>();
  }
  queue_load(step_stream, slot, source);
  M3_CUDA_CHECK(cudaStreamWaitEvent(step_stream, copied_, 0));
  if (direct) {
    // The caller's memory is the copy's source: it is theirs again only once the copy is done.
    M3_CUDA_CHECK(cudaEventSynchronize(copied_));
  } else {
    load_pending_ = true;
  }
  return flags_of(in, state_floats_);
}

SlotHostFlags SlotStateCopier::load_async(cudaStream_t step_stream, const SlotDeviceState& slot,
                                          std::span<const std::byte> in, int vocab_size, cudaEvent_t copied) {
  check(in, vocab_size);
  if (!is_page_locked(in.data(), in.size())) {
    throw std::invalid_argument("load_slot_async: the bytes are not in page-locked memory this process allocated");
  }
  queue_load(step_stream, slot, in.data());
  // copied_ now marks this copy; a staged load before it was ordered ahead on copy_stream_.
  M3_CUDA_CHECK(cudaEventRecord(copied, copy_stream_));
  return flags_of(in, state_floats_);
}

}  // namespace m3::cuda
