// Continuous batching over the engine's slots, on one engine thread.
//
// Every sequence holding a slot advances one token per engine step: a sequence being
// prefilled feeds its next prompt token (its sample is ignored), a replying sequence
// feeds kContinueToken and emits what was sampled. Sequences join (slot reset) and leave
// (finished, cancelled, past their deadline) between steps, so one step later their slot
// serves the next waiting request. When all slots are taken, requests wait in a bounded
// queue; past it, submit() refuses with RESOURCE_EXHAUSTED.
//
// A Converse session keeps its slot between turns (the recurrent state is the whole
// context) and takes no step while it waits for input, for up to the session idle
// timeout. The last token of each reply is fed at the start of the next turn, so a
// session equals one Generate of the concatenated turns and replies.
//
// Steps are pipelined: the engine thread submits step N+1 before it collects step N, so
// the device does not wait while the host hands out step N's tokens (docs/PERFORMANCE.md:
// a shorter inter-token latency at every concurrency). Step N+1 is built from what is
// certain before N's samples are known: a sequence feeding its prompt feeds its next
// token; a replying one continues unless N's token is its last by length. If N's token
// is a stop token, the continuation in N+1 is wasted (a Generate: its sample is dropped)
// or is the next turn's first input anyway (a session: the reply's last token). A
// sequence whose next move depends on N's sample (a prompt fed to its end without the
// turn's end in sight) sits N+1 out. A stream receives the same tokens as with steps one
// at a time (SchedulerOptions::pipelined = false).
//
// Prompts are read through Engine::prefill() when prefill_chunk_tokens > 0 and the engine
// has a prefill path of its own (chunked prefill, as vLLM does it): each iteration reads up to that many input tokens of the
// sequences that have input to feed (the oldest turn first), then submits the decode step
// of the replying streams, so their tokens keep coming while a long prompt is read. A
// Converse turn's input is read as it arrives, in the pieces it comes in. prefill() runs
// with no step queued: such an iteration collects the queued step first (the next step is
// built meanwhile, as in the pipelined order). A stream receives the same tokens as when
// its prompt is fed one step per token.
//
// Per step the engine thread reads the clock twice (at the token boundary and when the
// step is collected), touches only preallocated arrays and each stream's ring buffer,
// and never logs or calls into gRPC.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model/engine.h"
#include "server/prefix_cache.h"
#include "server/sequence.h"
#include "server/stalled_streams.h"
#include "server/stream_flusher.h"

namespace spdlog {
class logger;
}

namespace m3 {

class ServerMetrics;
class SessionMetrics;

struct SchedulerOptions {
  int queue_capacity = 64;
  // A Converse session that waits this long for its next input (no turn pending or being
  // generated) ends with DEADLINE_EXCEEDED and frees its slot; zero: never.
  Clock::duration session_idle_timeout = Clock::duration::zero();
  // Submit each step before collecting the previous one (above); false: one at a time.
  bool pipelined = true;
  // Input tokens read through Engine::prefill() per scheduler iteration (the engine's
  // max_prefill_tokens() where that is less); 0, or an engine without a prefill path of
  // its own (Engine::has_prefill_path()): every input token is one decode step.
  int prefill_chunk_tokens = 0;
  // With prefill on: the input tokens a pass reads when no stream is replying (nobody's
  // inter-token latency to hold): one large pass reads a prompt faster than several small
  // ones with a round trip each (the engine's max_prefill_tokens() where that is less).
  // At most prefill_chunk_tokens (0): always prefill_chunk_tokens.
  int prefill_alone_tokens = 0;
  // With prefill on: a sequence with streamed input (Converse) whose unread input is
  // shorter than this reads it by decode steps instead, one token a step beside the
  // replying streams (input that arrives a frame at a time costs them nothing that way,
  // where each prefill() call holds every stream for a round trip); 1: all input through
  // prefill(). A prompt given whole (Generate, CreateSnapshot) is read by prefill, so that
  // a prompt and a stored prefix of it plus the rest take the same arithmetic.
  int prefill_min_tokens = 1;
  // Called once, on the engine thread, when a failed step leaves the engine unable to run
  // more (Engine::failure()); the server then reports NOT_SERVING. From then on requests
  // are refused with UNAVAILABLE.
  std::function<void(const std::string& why)> on_engine_unusable;
  // Where every stream the scheduler closes is handed over until its call is done (may be
  // null).
  StalledStreams* stalled_streams = nullptr;
  // States kept at token boundaries of first inputs, to start later prompts from (null:
  // none; engine thread only).
  PrefixStateCache* prefix_cache = nullptr;
  // A Converse session idle this long between turns gives up its slot, its state kept in
  // host memory until its next input (scheduler_swap.cc); zero: never. Sessions idle for
  // less also give theirs up when requests or other sessions wait for a slot.
  Clock::duration session_swap_after = Clock::duration::zero();
  int max_sessions = 0;  // Converse sessions open at once (in a slot or swapped out); 0: no limit
  SessionMetrics* session_metrics = nullptr;  // may be null
};

class Scheduler {
 public:
  // metrics may be null. The engine thread starts here.
  Scheduler(Engine& engine, SchedulerOptions options, ServerMetrics* metrics,
            std::shared_ptr<spdlog::logger> log);
  ~Scheduler();  // cancels what is left (UNAVAILABLE) and joins the engine thread

  struct Admission {
    StreamStatus status = StreamStatus::kOk;  // kOk: queued or running
    std::string message;
  };
  // Any thread. On refusal the sequence is not touched (the caller finishes its stream).
  Admission submit(std::shared_ptr<Sequence> sequence);
  // Any thread: a sequence got input, was cancelled or closed its input.
  void wake();

  // Shutdown: refuse new requests (UNAVAILABLE), let running ones go on; sessions between
  // turns (nothing to finish) end at once with UNAVAILABLE.
  void stop_accepting();
  // Waits until no sequence is left or `deadline`; returns true when none is left.
  bool wait_until_idle(Clock::time_point deadline);
  // Ends every sequence now: replies end with FinishReason::kCancelled (after the tokens
  // made so far); Generate streams then close OK, sessions and queued requests with
  // UNAVAILABLE. Waits until done.
  void cancel_all();

  int in_flight() const;  // queued + holding a slot

 private:
  enum class Phase { kFree, kFeeding, kIdle, kReplying };
  // What a step's sample for a slot is for: only the state (a prompt token's), or a reply.
  enum class SampleUse : uint8_t { kKeep, kEmit };
  struct StepEntry {
    int slot;
    uint32_t generation;  // the slot's sequence when submitted (the sample is dropped if it left)
    SampleUse use;
  };
  // A submitted step: its entries, slots and tokens as passed to the engine, and its samples.
  struct SubmittedStep {
    std::vector<StepEntry> entries;
    std::vector<int32_t> slots, tokens, sampled;
    size_t size() const { return entries.size(); }
    void clear() {
      entries.clear();
      slots.clear();
      tokens.clear();
    }
  };
  struct Slot {
    std::shared_ptr<Sequence> seq;
    Phase phase = Phase::kFree;
    std::vector<int32_t> feed;  // this turn's input; feed[fed] is the next to feed
    size_t fed = 0;
    bool reply_requested = false;
    bool save_requested = false;  // a request_save() marker was taken: save once fed
    bool save_pending = false;     // saved; its input waits until the store answers (take_saved)
    bool shutdown_saving = false;  // saved for a shutdown: its handler ends it
    bool cacheable = false;  // the state is feed[0, fed) read from a fresh state (prefix cache)
    uint64_t state_tokens = 0;    // tokens the slot's state covers (snapshots)
    uint32_t reply_max_new = 0;
    bool has_sample = false;  // last_sample was sampled after the last fed token
    int32_t last_sample = 0;
    int32_t last_emitted = 0;  // carried into the next turn of a session
    uint32_t generated = 0;  // in this reply
    uint32_t scheduled = 0;  // reply tokens emitted or submitted (>= generated)
    uint32_t generation = 0;  // advances when a sequence leaves the slot
    int in_flight = 0;        // submitted steps with this sequence not yet collected
    uint32_t turn = 0;
    uint32_t turn_prompt_tokens = 0;
    Clock::time_point turn_start;  // arrival (turn 0) or end_turn
    Clock::time_point idle_since;  // when the phase last became kIdle
    Clock::time_point first_token_time;
    Clock::time_point last_token_time;
    // A swapped-in session's state buffer while the engine still copies it into the slot
    // (Engine::load_slot_async): the slot sits out steps and prefill until slot_ready(),
    // so the other slots' steps never wait for the copy.
    HostStateBuffer loading;
    Clock::time_point swap_wanted_since;  // its input's arrival (the swap-in's latency)
  };

  void run();
  // UNAVAILABLE's message once the engine failed for good (engine_failure_; mu_ held or
  // on the engine thread, which alone writes it).
  std::string engine_unusable_message() const;
  // Adds the slot's next token to `step` when it is certain (above), and advances the
  // slot as far as that is known before the sample comes back.
  void schedule(int slot, SubmittedStep& step, Clock::time_point now);
  void submit(SubmittedStep& step);
  // Waits for `step`'s samples and hands them out; `next` is the step submitted after it.
  void collect(SubmittedStep& step, SubmittedStep* next);
  void fail_step(SubmittedStep& step, const std::exception& e);
  // Whether a sequence has input to read through prefill now.
  bool wants_prefill(const Slot& s) const;
  // Reads up to prefill_chunk_tokens input tokens of the slots that want prefill; a slot
  // whose input ends starts its reply (joining `step`) or waits for more.
  void prefill(SubmittedStep& step);
  void admit_waiting(Clock::time_point now);
  void service_slot(int slot, Clock::time_point now);
  void pull_input(Slot& s);
  // Hands the slot's state to its sequence's on_state_saved (snapshots).
  void save_state(int slot, bool for_shutdown = false);
  // Prefix cache: a fresh slot's input starts from the longest kept prefix; the states at
  // the boundaries the last submitted step reached are kept.
  void start_from_cached_prefix(int slot);
  void keep_prefix_states();
  static void become_idle(Slot& s, Clock::time_point now);
  // When this slot's session runs out of idle time; max() when it is not an idle session.
  Clock::time_point idle_deadline(const Slot& s) const;
  void emit(int slot, int32_t token, Clock::time_point now);
  void end_reply(int slot, FinishReason reason, Clock::time_point now);
  void finish(int slot, StreamStatus status, std::string message,
              TokenOutbox::Unsent unsent = TokenOutbox::Unsent::kDrop);
  void close_unadmitted(const std::shared_ptr<Sequence>& seq, StreamStatus status,
                        std::string message);
  void wake_writer(const std::shared_ptr<Sequence>& seq);
  void shutdown_all_slots();
  // "session idle: no input within ..." after `turns` finished turns.
  std::string session_idle_message(uint32_t turns) const;

  // Sessions off the slots (scheduler_swap.cc).
  struct SwappedSession {
    Slot slot;  // as it left its slot (seq included)
    HostStateBuffer state;  // from spare_states_ (Engine::allocate_host_state)
    int saved_from = -1;    // the slot it was saved from (save_slot_async: in `state` once that slot is ready)
    bool wants_in = false;  // its next input arrived
    Clock::time_point wanted_since;
    bool shutdown_saving = false;
  };
  bool swappable(const Slot& s) const;
  void swap_out_idle_sessions(Clock::time_point now);
  void swap_out(int slot);
  // Swapped sessions: ends, shutdown saves, and swap-ins into free slots (before new
  // requests take them).
  void service_swapped(Clock::time_point now);
  void swap_in(size_t k);
  void close_swapped(size_t k, StreamStatus status, std::string message);
  // When the next swap-out or swapped session's idle end is due (max(): none).
  Clock::time_point next_swap_due() const;
  void note_session_closed_locked(const Sequence& seq);  // mu_ held

  Engine& engine_;
  const SchedulerOptions options_;
  ServerMetrics* metrics_;
  std::shared_ptr<spdlog::logger> log_;
  StreamFlusher flusher_;

  // Engine-thread state.
  std::vector<Slot> slots_;
  std::vector<int> free_slots_;
  // The step being built or last submitted, and the one submitted before it (queued).
  SubmittedStep steps_[2];
  int newest_ = 0;       // index in steps_ of the step built next
  bool queued_ = false;  // steps_[1 - newest_] is submitted and not collected
  SubmittedStep* submitted_after_ = nullptr;  // while collecting: the step submitted after it
  // Input tokens per iteration through prefill(); 0: through decode steps.
  const int prefill_chunk_;
  // Input tokens per iteration through prefill() when no stream is replying (>= prefill_chunk_).
  const int prefill_alone_;
  // The slot's unread input goes through prefill() (prefill on, and for streamed input at
  // least prefill_min_tokens of it), not through decode steps.
  bool reads_by_prefill(const Slot& s) const {
    return prefill_chunk_ > 0 && (!s.seq->params().streamed_input ||
                                  s.feed.size() - s.fed >= static_cast<size_t>(options_.prefill_min_tokens));
  }
  // prefill(): the slots in the order they are served, the runs and their samples; and
  // the runs as a step's entries, for fail_step().
  std::vector<int> prefill_order_;
  std::vector<PrefillRun> prefill_runs_;
  std::vector<int32_t> prefill_sampled_;
  SubmittedStep prefill_entries_;
  std::vector<std::shared_ptr<Sequence>> wake_list_;  // writers to wake after this step
  std::vector<std::shared_ptr<Sequence>> admitted_, rejected_;
  std::vector<std::pair<int, size_t>> prefix_saves_;  // slot, tokens: states to keep after submit
  std::vector<SwappedSession> swapped_;
  // Host buffers for swapped states no session holds now, reused by the next swap-out:
  // making one (page locking, on the CUDA engine) takes longer than the copy it serves.
  // Together with swapped_'s they number the most sessions ever swapped out at once.
  std::vector<HostStateBuffer> spare_states_;
  size_t state_buffers_ = 0;  // spare and in use
  HostStateBuffer take_state_buffer();
  void give_back_state_buffer(HostStateBuffer buffer);
  // Whether slot i's swap-in copy is done (true when there is none); once it is, its
  // buffer goes back to spare_states_ and the swap-in's latency is recorded.
  bool loaded(int i);
  // Waits for slot i's swap-in copy (a slot leaving before it ends).
  void wait_loaded(int i);
  bool swap_refused_ = false;  // the engine cannot copy its state
  uint64_t graph_replays_seen_ = 0;
  int active_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;       // the engine thread waits here when nothing runs
  std::condition_variable idle_cv_;  // wait_until_idle / cancel_all
  std::deque<std::shared_ptr<Sequence>> waiting_;
  int in_flight_ = 0;     // queued, in a slot or swapped out
  int swapped_count_ = 0;  // swapped_.size(), for submit()
  int sessions_open_ = 0;
  bool wake_ = false;
  bool accepting_ = true;
  std::string engine_failure_;  // Engine::failure() once a step failed for good
  bool draining_ = false;  // the engine thread's copy of !accepting_, taken each boundary
  bool cancel_all_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace m3
