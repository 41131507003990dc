// The one interface every decode backend implements and the server uses. The server
// never knows which backend runs.
//
// An engine owns a fixed number of slots, set at load. A slot holds one sequence's
// whole recurrent state (nothing grows with its length). A step feeds one token to
// each of a set of slots and samples the next token for each of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/weight_dtype.h"
#include "model/config.h"
#include "model/cuda_policy.h"
#include "model/host_state_buffer.h"
#include "model/sampling_mask.h"

namespace m3 {

class ModelWeights;

// In step(): feed the token this engine sampled for the slot at its previous step
// (the device keeps it; nothing crosses to the host and back).
inline constexpr int32_t kContinueToken = -1;

struct SamplingParams {
  float temperature = 0.0f;  // <= 0: greedy (argmax, lowest id on ties)
  int32_t top_k = 0;         // 0: no limit
  float top_p = 1.0f;        // keep the smallest top set whose probability reaches top_p
  uint64_t seed = 0;         // with the slot's step counter, fixes every random draw
  int32_t mask = -1;         // EngineOptions::sampling_masks index; -1: every id
};

std::string_view weight_dtype_name(WeightDType);
bool parse_weight_dtype(std::string_view, WeightDType*);
// How the recurrent state is stored between steps; it is always updated in fp32.
enum class StateDType { F32, BF16 };
std::string_view state_dtype_name(StateDType);
bool parse_state_dtype(std::string_view, StateDType*);

struct EngineOptions {
  int max_slots = 1;
  WeightDType weight_dtype = WeightDType::BF16;  // CUDA; the CPU engine always uses fp32
  int device = 0;                                // CUDA device ordinal
  int cpu_threads = 0;                           // CPU engine; 0 = hardware concurrency
  bool use_graphs = true;                        // CUDA; off only for benchmarks/debugging
  // CUDA: no atomics in the step, so a sequence's logits are bitwise the same from run to
  // run (for the same batch). Off, batches 1 and 2 may add out_proj into the residual with
  // atomics inside the recurrence, where that was measured faster at load (on some GPUs it
  // is, on others not); the last bits then vary. The CPU engine is always deterministic.
  bool deterministic = false;
  CudaPolicy cuda;  // CUDA: how the decode step is built (model/cuda_policy.h)
  // Most prompt tokens one prefill() call takes (all its runs together); engines size
  // their prefill buffers for it at load.
  int max_prefill_tokens = 2048;
  // The masks SamplingParams::mask picks from (token_mask.h), built once at load.
  std::vector<SamplingMask> sampling_masks;
  // BF16: the ssm state (all but a few percent of it; the angles, which grow without bound,
  // and k_prev, x_prev stay fp32) is rounded to nearest even when stored and widened when
  // read: about half the bytes a step streams. The CPU engine only so far; CUDA refuses it.
  StateDType state_dtype = StateDType::F32;
};

// One slot's share of a prefill() call: the tokens to feed it, in order.
struct PrefillRun {
  int32_t slot;
  std::span<const int32_t> tokens;  // at least one; ids < vocab_size (no kContinueToken)
};

struct EngineStats {
  uint64_t steps = 0;          // step() calls
  uint64_t graph_replays = 0;  // CUDA graph launches (0 for the CPU engine)
  uint64_t tokens = 0;         // slot-tokens processed
};

class Engine {
 public:
  virtual ~Engine() = default;

  virtual std::string_view backend() const = 0;  // "cpu", "cuda"
  virtual const ModelConfig& config() const = 0;
  virtual int max_slots() const = 0;
  // How many of EngineOptions::sampling_masks set_sampling accepts (0: it applies none).
  virtual int sampling_mask_count() const { return 0; }

  // Zeroes the slot's state and its random-draw counter: a new sequence.
  virtual void reset(int slot) = 0;
  virtual void set_sampling(int slot, const SamplingParams& params) = 0;

  // One token for each slot in `slots` (distinct, each < max_slots(), at most
  // max_slots() of them). tokens[i] is the input of slots[i], or kContinueToken.
  // sampled[i] receives the token sampled for slots[i] (ids < config().vocab_size).
  // logits, when not empty, receives slots.size() rows of config().padded_vocab()
  // floats. Throws std::invalid_argument on bad slots or token ids.
  virtual void step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                    std::span<int32_t> sampled, std::span<float> logits = {}) = 0;

  // The same step in two halves, so that the host can prepare the next step while the
  // device runs this one (the server's scheduler does): submit_step() checks its arguments
  // as step() does, queues the step and returns; collect_step() waits for the oldest
  // queued step and writes its samples, in the order of its slots (sampled.size() must be
  // its slot count); a step of no slots queues nothing. At most kMaxQueuedSteps steps are
  // queued; call step() with none queued (the CUDA engine refuses). A slot may be in two
  // queued steps: kContinueToken in the later one feeds what the earlier one samples.
  // reset() and set_sampling() apply to the steps submitted after them; those already
  // queued run as submitted. This default runs step() inside submit_step(); an engine
  // whose device works asynchronously overrides both.
  static constexpr int kMaxQueuedSteps = 2;
  virtual void submit_step(std::span<const int32_t> slots, std::span<const int32_t> tokens);
  virtual void collect_step(std::span<int32_t> sampled);
  int queued_steps() const { return queued_count_; }

  // Feeds each run's tokens to its slot, leaving the slot exactly as tokens.size() step()s
  // would: recurrent state, angles, k_prev, x_prev, the next step's input (the sample after
  // the last token; step() with kContinueToken feeds it) and the random-draw counter.
  // sampled[i]: that sample for runs[i]. logits, when not empty: runs.size() rows of
  // padded_vocab() floats, the last token's. Throws std::invalid_argument on bad slots,
  // tokens, or a total over max_prefill_tokens(). Like step(), it is called with no step
  // queued (std::logic_error otherwise): the scheduler collects its queued step, prefills,
  // then submits the next decode step, so every iteration still steps the running streams.
  // This default feeds the tokens through step(), all runs side by side, one position at a
  // time; an engine with a faster path overrides it.
  virtual void prefill(std::span<const PrefillRun> runs, std::span<int32_t> sampled,
                       std::span<float> logits = {});
  virtual int max_prefill_tokens() const { return max_prefill_tokens_; }  // per call, fixed at load
  // Whether this engine reads a run faster than stepping it (it overrides prefill()). The
  // scheduler feeds prompts through decode steps, beside the decoding streams, where it
  // does not: the default above would hold those streams for a whole chunk of steps.
  virtual bool has_prefill_path() const { return false; }

  virtual EngineStats stats() const = 0;

  // A slot's whole state as bytes: recurrent state, angles, k_prev, x_prev, the next step's
  // input token (and whether there is one) and the random-draw counter; not the sampling
  // parameters. load_slot(s, bytes saved from any slot of an engine with the same model,
  // backend and state format) leaves s bit-identical to the saved slot. Both apply in
  // order with the steps: save_slot sees what the steps submitted before it wrote, a load
  // is what the steps submitted after it read. Throw std::invalid_argument on a bad slot
  // or a span of another size.
  virtual size_t slot_state_bytes() const = 0;
  virtual void save_slot(int slot, std::span<std::byte> out) = 0;
  virtual void load_slot(int slot, std::span<const std::byte> in) = 0;
  // Host memory for one slot's state that save_slot and load_slot copy fastest (the CUDA
  // engine: page-locked, copied by one DMA with no staging; it falls back to plain memory
  // when the system refuses to lock more). Slow to make: callers that copy states often
  // (the scheduler's idle sessions) keep theirs for reuse. This default: plain memory.
  virtual HostStateBuffer allocate_host_state() const { return HostStateBuffer::plain(slot_state_bytes()); }
  // load_slot from a buffer allocate_host_state() made, without holding the steps of other
  // slots for the copy: the call may return before the copy is done, and the buffer must
  // then stay alive and unchanged until slot_ready(slot). A step, prefill or reset that
  // includes the slot before then waits for the copy (correct, but every slot of that
  // step waits with it), so a caller that steps other slots meanwhile leaves this one out
  // until slot_ready(). This default loads as load_slot does.
  virtual void load_slot_async(int slot, const HostStateBuffer& in) { load_slot(slot, in.bytes()); }
  // save_slot into a buffer allocate_host_state() made, without holding the steps: the call
  // may return before the bytes are in `out`, which must stay alive until slot_ready(slot)
  // (then it holds them). Work that uses the slot meanwhile (a step, prefill, reset or
  // load) waits for the copy on the device, so the slot may be given to another sequence
  // at once; a later load from `out` is ordered after the save. This default saves as
  // save_slot does.
  virtual void save_slot_async(int slot, HostStateBuffer& out) { save_slot(slot, out.bytes()); }
  // Whether no load_slot_async or save_slot_async copy of the slot is still running (then
  // their buffers are free, and a saved one holds its bytes).
  virtual bool slot_ready(int slot) const { (void)slot; return true; }

  // Choices the engine made at load that operators may want to see (the CUDA engine: the
  // batch-1 and batch-2 step variants it measured fastest); empty when there are none.
  virtual std::string load_report() const { return {}; }

  // Why the engine can run no more steps (a device error it cannot recover from: the CUDA
  // engine after a failed CUDA call); empty while it can. Read on the thread that steps it.
  virtual std::string failure() const { return {}; }

 protected:
  // The queue of submitted, not yet collected steps, for every implementation of
  // submit_step / collect_step: the position a step submitted now takes (throws when the
  // queue is full) and recording it there with its slot count; the position of the step
  // collect_step() gives out (throws when there is none, or when `sampled` does not fit
  // its slot count) and dropping it.
  int queue_position_for_submit() const;
  void queue_push(size_t slots);
  int queue_position_for_collect(std::span<int32_t> sampled) const;
  void queue_pop();
  // Checks prefill()'s arguments as its contract says (throws as it does); returns the
  // tokens of all runs together.
  size_t validate_prefill(std::span<const PrefillRun> runs, std::span<int32_t> sampled,
                          std::span<float> logits);

 private:
  friend std::unique_ptr<Engine> make_engine(std::string_view, const ModelWeights&,
                                             const EngineOptions&);
  int max_prefill_tokens_ = EngineOptions{}.max_prefill_tokens;  // set by make_engine
  std::vector<int32_t> prefill_slots_, prefill_tokens_, prefill_samples_;  // the default's
  std::vector<float> prefill_logits_;
  std::vector<char> prefill_seen_;

  int queued_head_ = 0, queued_count_ = 0;
  size_t queued_slots_[kMaxQueuedSteps] = {};              // slot count, per queued step
  std::vector<int32_t> queued_samples_[kMaxQueuedSteps];  // the default's samples, per queued step
};

// backend: "cpu", "cuda", or "auto" (CUDA when built with it and a GPU is present).
std::unique_ptr<Engine> make_engine(std::string_view backend, const ModelWeights& weights,
                                    const EngineOptions& options);
bool cuda_backend_built();      // this build has the CUDA engine
bool cuda_backend_available();  // built with CUDA and a device is visible
// Bytes free on the CUDA device (cudaMemGetInfo); throws when it cannot be asked.
uint64_t cuda_free_memory(int device);

// max_batch `auto` for `backend` (cpu, cuda, auto: as make_engine() resolves it) and
// these options (their max_slots is ignored); see model/slot_budget.h.
struct MaxBatchChoice;
MaxBatchChoice choose_auto_max_batch(std::string_view backend, const ModelConfig& config,
                                     const EngineOptions& options);

}  // namespace m3
