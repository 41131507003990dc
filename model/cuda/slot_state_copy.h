// One slot's device state copied to and from host bytes beside the decode steps: the
// copies run on their own stream, ordered after every step already queued on the step
// stream (a step still queued may write the slot), and a load makes the step stream wait
// for it, so the next step reads what was loaded. The other slots' steps go on meanwhile;
// a save waits only for the steps queued before it. Host bytes in page-locked memory
// (allocate_pinned: Engine::allocate_host_state) are copied by one DMA; other bytes pass
// through a page-locked staging buffer and a host copy of their whole length, which the
// GPU waits for when no step is queued.
//
// The bytes (host order): the slot's whole state region as the engine keeps it (both
// halves of the double-buffered angles and k_prev), the random-draw counter (u64), the
// last sampled token (i32), whether there is one (u8), the parity that picks the current
// half (u8), two zero bytes, the frame position of the slot's next sample (i32, what
// constrained sampling's codebook order reads). Loading the parity back keeps the current half current, so
// the bytes go into any slot.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "model/cuda/cuda_handle.h"
#include "model/cuda/device_buffer.h"

namespace m3::cuda {

// One slot's device regions and the host bookkeeping that goes with them.
struct SlotDeviceState {
  float* state = nullptr;  // slot_state_floats floats
  uint64_t* counter = nullptr;
  int32_t* last_token = nullptr;
  int32_t* frame_position = nullptr;
};
struct SlotHostFlags {
  bool has_sample = false;
  uint32_t parity = 0;  // 0 or 1
};

class SlotStateCopier {
 public:
  SlotStateCopier() = default;
  // Allocates the pinned staging buffer and the side stream (at load, never per step).
  explicit SlotStateCopier(size_t slot_state_floats);

  size_t bytes() const { return bytes_; }

  // Copies the slot into `out` (bytes() long) as the steps queued on `step_stream` so far
  // leave it; returns when the bytes are in `out`.
  void save(cudaStream_t step_stream, const SlotDeviceState& slot, SlotHostFlags flags,
            std::span<std::byte> out);
  // Page-locked `out` only (is_page_locked): queues the copy into `out` after what
  // `step_stream` has queued and records `copied` once the bytes are there; returns at once.
  // The caller orders the slot's next writer after `copied` and reads `out` only then.
  void save_async(cudaStream_t step_stream, const SlotDeviceState& slot, SlotHostFlags flags,
                  std::span<std::byte> out, cudaEvent_t copied);
  // Throws std::invalid_argument unless `in` is bytes() long with a token below
  // `vocab_size`, flags of 0 or 1, zero spare bytes and a frame position not below 0 (no
  // CUDA call: a refusal leaves the engine usable).
  void check(std::span<const std::byte> in, int vocab_size) const;
  // Checks `in` (check()), then queues its copy into
  // the slot after what `step_stream` has queued and makes `step_stream` wait for it.
  // Page-locked `in` is copied from where it lies, so the call returns once that copy is
  // done; other bytes are staged and the call returns at once. Returns the flags the
  // engine's host side takes for the slot.
  SlotHostFlags load(cudaStream_t step_stream, const SlotDeviceState& slot, std::span<const std::byte> in,
                     int vocab_size);
  // Checks page-locked `in` (is_page_locked), then queues its copy into the slot after what
  // `step_stream` has queued and records `copied` once it is in; returns at once, without
  // making `step_stream` wait: the caller orders the slot's next use after `copied`, and
  // keeps `in` unchanged until then.
  SlotHostFlags load_async(cudaStream_t step_stream, const SlotDeviceState& slot, std::span<const std::byte> in,
                           int vocab_size, cudaEvent_t copied);

 private:
  // The copies of `source` (bytes() long, page-locked) into the slot, on copy_stream_ after
  // what `step_stream` has queued; records copied_.
  void queue_load(cudaStream_t step_stream, const SlotDeviceState& slot, const std::byte* source);
  // The copies of the slot into `target` (bytes() long, page-locked), likewise; the tail's
  // host flags are written by the caller (the device writes the bytes around them).
  void queue_save(cudaStream_t step_stream, const SlotDeviceState& slot, std::byte* target);
  void write_flags(std::byte* target, SlotHostFlags flags) const;
  static SlotHostFlags flags_of(std::span<const std::byte> in, size_t state_floats);

  size_t state_floats_ = 0;
  size_t bytes_ = 0;
  PinnedBuffer staging_;
  CudaStream copy_stream_;
  CudaEvent steps_queued_;  // recorded on the step stream: what the copy waits for
  CudaEvent copied_;        // recorded on the copy stream: what the staging buffer waits for
  bool load_pending_ = false;  // staging_ is still the source of a queued load
};

}  // namespace m3::cuda
