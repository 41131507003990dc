// The Mamba-3 MIMO mixer between in_proj and out_proj for a run of tokens per slot at once
// (chunked prefill, ../shared/docs/MAMBA3_MIMO_PREFILL.md): it leaves each slot's state as
// the same tokens fed one decode step at a time would, in the decode step's layout
// (MimoStateLayout, angle and k_prev double-buffered by step parity), and writes o for
// out_proj for every token.
//
// The arithmetic. Token s's input xv_s k_s^T (summed over the rank) reaches the state twice
// in the step recurrence: at step s with weight gamma_s and at step s+1 with weight
// beta_{s+1} = (1-trap_{s+1}) dt_{s+1} alpha_{s+1}. Both are folded into one weight, so one
// masked product carries both input terms: with L_t the running sum of a = A*dt inside a
// chunk and u_s = gamma_s + (1-trap_{s+1}) dt_{s+1} (the second term 0 for the run's last
// token),
//     S_t = exp(L_t) S~ + sum_{s<t} exp(L_t - L_s) u_s xv_s k_s^T + gamma_t xv_t k_t^T
// where S~ is the state entering the chunk with its last token's next-step term already
// added (S~ = S + (1-trap_c) dt_c xv_{c-1} k_{c-1}^T; for the run's first chunk that is the
// slot's state plus its x_prev/k_prev term). Every exponent is <= 0.
//
// Kernels, in stream order (launch_prefill_scan runs all five, or four):
//   1. token params (per token): dt, a = A*dt, gamma, (1-trap)*dt per head; B and C
//      RMSNorm (head-independent with one group) into the workspace, in fp32 and fp16.
//   2. angles (per run, head, angle): theta_t as a running sum from the slot's angle state
//      (segment sums, then warp scans; for calls of short runs only, a thread walking a
//      run's angle token by token); writes cos and sin of theta_t for every token (the
//      chunk kernels rotate with them) and the slot's final angle (parity (p + T) & 1).
//   3. chunk state (per chunk, head): dS = Xv^T diag(exp(L_e - L_s) u_s) K on tensor cores.
//   4. state pass (per run, head, state tile): S~ entering every chunk, in chunk order;
//      reads the slot's ssm, x_prev and k_prev (parity p) and writes the final ssm. Not
//      launched for a call whose runs are one chunk each, where kernel 3 (register-fragment
//      form) does the same for its chunk (PrefillScanPlan::single_chunk_runs_in_state_kernel).
//   5. chunk output (per chunk, head): y = exp(L) .* (Q S~^T) + ((Q K^T) .* M) Xv + D Xv on
//      tensor cores, then the gate, the optional grouped RMSNorm and mimo_o into o; the
//      run's last chunk writes k_prev (parity (p + T) & 1) and x_prev.
// Kernels 3 and 5 run in their register-fragment forms (kernels/prefill_chunk_*_tc.cu) for
// bf16 operands, MIMO heads and d_state a multiple of 32; the forms here take every shape.
// Only kernel 4 (or 3 in its place) reads ssm/x_prev/k_prev and only kernel 5 writes
// k_prev/x_prev, so runs of even length (old and new parity the same buffer) are safe:
// stream order separates them.
//
// Precision: Bf16TensorCores rounds the products' operands (q, k, xv, the masked Q K^T and
// the incoming state) to bf16 with fp32 accumulation, for bf16-weight engines (logits
// within 3e-2), and stores each chunk's dS in bf16 too (the state pass sums them into the
// slot's state in fp32: one rounding of 2^-9 a chunk, where the bf16 state option rounds at
// every step); Fp32 computes the same products with fp32 FMAs in the same fragment layout
// (tf32 operands would lose 2^-11 per term, too close to the fp32 engine's 1e-3 budget once
// summed over hundreds of tokens), with smaller chunks to fit shared memory.
//
// How the engine calls it (all on the engine's stream; runs concatenated in one token-row
// matrix, each run on its own slot, no slot twice in a call):
//   once at load: prepare_prefill_scan(dims) (shape and shared-memory checks, limits
//     raised); one allocation of prefill_scan_workspace_bytes(dims, max_tokens, max_runs)
//     carved by prefill_scan_workspace(), one of prefill_row_buffer_bytes() carved by
//     prefill_row_buffers() (kernels/prefill_rows.cuh); an LtContext and one LtGemm per
//     projection shape (in_proj, out_proj accumulating, fc1, fc2 accumulating;
//     kernels/gemm_lt.cuh), each for max_tokens rows;
//   per call (host): fill_prefill_runs() from the runs' lengths into a pinned run table
//     with each run's slot and parity (steps the slot took & 1), copied to the device;
//   then: gather_rows (the tokens' embedding rows into res); per layer i:
//     rmsnorm_rows(res, norm_i) -> u; in_proj.run(W_in, u) -> w;
//     launch_prefill_scan(w, state at layer i) -> o;  out_proj.run(W_out, o) -> res (+=);
//     with an MLP: rmsnorm_rows(res, norm2_i) -> u; fc1.run -> fc1_out;
//       gated_silu_rows -> mlp_act; fc2.run -> res (+=);
//   then last_rows_of_runs(res) -> last, and the decode gemv with norm_f for lm_head at
//   batch n_runs, and sampling; the slots' step counters advance by their runs' lengths
//   (the parity the next decode step reads is (p + T) & 1).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "kernels/common.cuh"

namespace m3::kernels {

enum class ScanPrecision { Bf16TensorCores, Fp32 };

struct PrefillScanDims {
  int heads = 0, headdim = 0, d_state = 0, rank = 0, n_angles = 0;  // H, P, N, R, S
  ScanPrecision precision = ScanPrecision::Bf16TensorCores;
};

// (token, rank) rows of one chunk: the masked product is [kRows x kRows].
inline constexpr int kPrefillRowsBf16 = 128;
inline constexpr int kPrefillRowsFp32 = 64;
// Tokens per chunk: the rows over the rank (32 at rank 4 in bf16, 16 in fp32).
inline int prefill_chunk_tokens(const PrefillScanDims& d) {
  return (d.precision == ScanPrecision::Fp32 ? kPrefillRowsFp32 : kPrefillRowsBf16) / d.rank;
}

// Why the prefill kernels cannot run a head shape (nullopt: they can): headdim a multiple
// of 16 up to 64, d_state a multiple of 16 up to 128, rank 1, 2, 4 or 8, at most N/2 angles.
std::optional<std::string> prefill_scan_shape_refusal(const PrefillScanDims& d);

// The runs of one call on the device. Runs are consecutive blocks of token rows: run i is
// rows [token_begin[i], token_begin[i+1]) (at least one token) and chunks
// [chunk_begin[i], chunk_begin[i+1]).
struct PrefillRuns {
  const int32_t* slot = nullptr;         // [n_runs]
  const int32_t* parity = nullptr;       // [n_runs] decode steps the slot took before the run, & 1
  const int32_t* token_begin = nullptr;  // [n_runs + 1]
  const int32_t* chunk_begin = nullptr;  // [n_runs + 1]
  int n_runs = 0, n_tokens = 0, n_chunks = 0;
  int max_run_tokens = 0;  // the longest run's tokens (the host knows them; picks the angles kernel)
};

// Host side of the run table: token_begin and chunk_begin (n_runs + 1 each) from the runs'
// lengths; returns the number of chunks. Throws on an empty run.
int fill_prefill_runs(std::span<const int32_t> lengths, int chunk_tokens, int32_t* token_begin,
                      int32_t* chunk_begin);
// Most chunks max_tokens tokens in at most max_runs runs can take.
inline int prefill_max_chunks(int max_tokens, int max_runs, int chunk_tokens) {
  return max_tokens / chunk_tokens + max_runs;
}

// Scratch of one call, carved from one allocation made at load.
struct PrefillScanWorkspace {
  float* tok_a = nullptr;      // [T][H] A*dt
  float* tok_gamma = nullptr;  // [T][H] trap*dt
  float* tok_bterm = nullptr;  // [T][H] (1-trap)*dt
  float* tok_dt = nullptr;     // [T][H]
  float* b_norm = nullptr;     // [T][R][N] RMS-normed B (before bias and rotation)
  float* c_norm = nullptr;     // [T][R][N]
  // The same in fp16, the form the bf16 chunk kernels stage (2^-11 relative, against the
  // 2^-8 of the bf16 operands they become).
  __half* b_norm_h = nullptr;  // [T][R][N]
  __half* c_norm_h = nullptr;  // [T][R][N]
  float2* rot = nullptr;       // [T][H][S] cos, sin of theta_t
  float* chunk_decay = nullptr;  // [chunks][H] exp of the sum of a over the chunk
  // [chunks][H][P][N], both in the operand type (bf16 or fp32):
  void* chunk_delta = nullptr;     // the chunk's own contribution
  void* chunk_state_in = nullptr;  // S~ entering the chunk
};
size_t prefill_scan_workspace_bytes(const PrefillScanDims& d, int max_tokens, int max_runs);
PrefillScanWorkspace prefill_scan_workspace(const PrefillScanDims& d, int max_tokens, int max_runs, void* base);

// What prepare_prefill_scan finds of the device once, for every launch after it.
struct PrefillScanPlan {
  // Calls of up to this many runs take the state pass that keeps 256 bytes a thread in
  // flight, the rest the one that keeps 128: while the deep pass's whole grid is resident
  // at once, its depth hides the latency a run's chain of chunks leaves exposed; past
  // that, the shallow pass, with half its registers, holds twice the blocks an SM and
  // finishes in fewer waves.
  int deep_state_pass_max_runs = 0;
  // Calls whose longest run has at most this many tokens walk each (run, head, angle) in
  // one thread, token by token; longer runs take the kernel that splits a run into
  // segments. That one launches a 1,024-thread block per (head, run, 8 angles) whatever
  // the run's length, which for many short runs (a burst of short prompts) cost more than
  // the rest of the scan.
  int serial_angles_max_tokens = 64;
  // A run of one chunk (a short prompt) has nothing for the state pass to chain. In a call
  // whose runs are all one chunk, where the chunk state kernel runs on register fragments,
  // that kernel also does the pass's work (the slot's state plus the previous token's term
  // is the chunk's S~; the new state is S~ decayed plus the chunk's delta, in the same
  // roundings): the deltas are never stored and read back, and no pass is launched.
  bool single_chunk_runs_in_state_kernel = true;
};

struct PrefillScanArgs {
  PrefillScanDims dims;
  PrefillScanPlan plan;  // prepare_prefill_scan's
  bool mimo_rotation = true;  // rotate halves (i, i+N/2); false: adjacent pairs (SISO)
  float a_floor = 1e-4f;
  float norm_eps = 1e-5f;
  // in_proj output [n_tokens, w_stride] (fp32) and the offsets of its split.
  const float* w = nullptr;
  int w_stride = 0;
  int off_z = 0, off_x = 0, off_B = 0, off_C = 0, off_dt = 0, off_A = 0, off_trap = 0, off_ang = 0;
  // Parameters (fp32), as MimoStepArgs.
  const float* dt_bias = nullptr;   // [H]
  const float* D = nullptr;         // [H]
  const float* B_bias = nullptr;    // [H, R, N]
  const float* C_bias = nullptr;    // [H, R, N]
  const float* B_norm = nullptr;    // [N]
  const float* C_norm = nullptr;    // [N]
  const float* mimo_x = nullptr;    // [H, R, P]
  const float* mimo_z = nullptr;    // [H, R, P]
  const float* mimo_o = nullptr;    // [H, R, P]
  const float* out_norm = nullptr;  // [H*P] or nullptr (is_outproj_norm off)
  // State: slot s, this layer at state + s * slot_stride + layer_offset (MimoStateLayout);
  // state 16-byte aligned, slot_stride and layer_offset multiples of 4 (launch checks);
  // state_bf16: its ssm part is bf16 (MimoStateLayout::ssm_bf16).
  float* state = nullptr;
  bool state_bf16 = false;
  int64_t slot_stride = 0;
  int64_t layer_offset = 0;
  PrefillRuns runs;
  PrefillScanWorkspace ws;
  // o[t, h*P + p] for out_proj: bf16 (o_bf16) or fp32, rows o_stride elements apart.
  void* o = nullptr;
  int o_stride = 0;
  bool o_bf16 = false;
  // Kernels 2 to 5 by programmatic dependent launch (CudaPolicy::pdl): each one's blocks
  // start, and read what the kernels before the previous one wrote, while that one
  // finishes; they wait for it before reading its own outputs, and let the next kernel
  // start only after that wait, so everything two kernels back is complete. Only for calls
  // of at least 8 chunks (launch_prefill_scan says why).
  bool pdl = false;
};

// Load time: checks the shape (throws with the reason) and every kernel's shared memory
// against kMaxSharedBytesPerBlock, raises their dynamic shared-memory limits, and plans
// the launches by the current device's multiprocessors.
PrefillScanPlan prepare_prefill_scan(const PrefillScanDims& d);

// The five kernels on `stream` (sizes from args.runs, variants by args.plan; nothing
// allocated or measured).
void launch_prefill_scan(const PrefillScanArgs& args, cudaStream_t stream);

}  // namespace m3::kernels
