// One decode step of the Mamba-3 MIMO mixer between in_proj and out_proj, for a batch of
// sequences, fused into one kernel: the in_proj epilogue (dt, A, trap, B/C RMSNorm,
// biases, rotary with the angle state), the exponential-trapezoidal state update, the
// D skip, the gate, the optional grouped RMSNorm and the mimo_o reduction.
//
// Block (p-chunk, head, batch entry). The state rows of a head split over p-chunks
// (independent rows of ssm), each block re-deriving the head's k and q. The per-head
// angle and k_prev are double-buffered by the slot's step parity (counter & 1): every
// chunk reads the old copy, chunk 0 writes the new one, so no block reads what another
// block of the same launch writes. The host, which counts every slot's steps, passes the
// parity per batch entry, so no block waits on a counter load before loading its state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kernels/common.cuh"
#include "kernels/launch.cuh"
#include "kernels/plan_policy.h"
#include "kernels/weight_dtype.h"

namespace m3::kernels {

// Float offsets of one layer's recurrent state of one sequence. With ssm_bf16 the ssm
// part holds bf16 values (two a float's room, the same [H][P][N] order; state_dtype bf16),
// the other parts stay fp32: they are a few percent of the bytes.
struct MimoStateLayout {
  int64_t ssm = 0;     // [H][P][N]
  int64_t x_prev = 0;  // [H][P]
  int64_t angle = 0;   // [2][H][S] (by parity)
  int64_t k_prev = 0;  // [2][H][R][N] (by parity)
  int64_t floats = 0;  // total
  bool ssm_bf16 = false;
};
MimoStateLayout mimo_state_layout(int H, int P, int N, int R, int S, bool ssm_bf16 = false);

struct MimoStepArgs {
  int heads = 0, headdim = 0, d_state = 0, rank = 0, n_angles = 0;  // H, P, N, R, S
  bool mimo_rotation = true;  // rotate halves (i, i+N/2); false: adjacent pairs (SISO)
  float a_floor = 1e-4f;
  // State update and y projection on tensor cores (tf32 operands, fp32 accumulation and
  // state; mimo_step_tc.cu), where mimo_step_tc_applies: for bf16-weight engines.
  bool tensor_cores = false;
  float norm_eps = 1e-5f;
  // in_proj output [batch, w_stride] and the offsets of its split.
  const float* w = nullptr;
  int w_stride = 0;
  int off_z = 0, off_x = 0, off_B = 0, off_C = 0, off_dt = 0, off_A = 0, off_trap = 0, off_ang = 0;
  // Parameters (fp32).
  const float* dt_bias = nullptr;  // [H]
  const float* D = nullptr;        // [H]
  const float* B_bias = nullptr;   // [H, R, N]
  const float* C_bias = nullptr;   // [H, R, N]
  const float* B_norm = nullptr;   // [N]
  const float* C_norm = nullptr;   // [N]
  const float* mimo_x = nullptr;   // [H, R, P]
  const float* mimo_z = nullptr;   // [H, R, P]
  const float* mimo_o = nullptr;   // [H, R, P]
  const float* out_norm = nullptr; // [H*P] or nullptr (is_outproj_norm off)
  // State: slot s, this layer at state + s * slot_stride + layer_offset (MimoStateLayout).
  // state_bf16: its ssm part is bf16 (the tensor-core kernel only; updated in fp32).
  float* state = nullptr;
  bool state_bf16 = false;
  int64_t slot_stride = 0;
  int64_t layer_offset = 0;
  const int32_t* slots = nullptr;      // [batch]
  const int32_t* parities = nullptr;   // [batch] steps the slot took since reset, & 1
  // [batch, o_stride], o[b, h*P + p]: fp32, or bf16 when o_bf16 (the input of an out_proj
  // GEMM on bf16 weights, rounded to nearest as the tensor-core gemvs round their input).
  void* o = nullptr;
  int o_stride = 0;
  bool o_bf16 = false;
  int batch = 0;
  // This step's rows run beside another chain's (the engine's split buckets): the next
  // kernel is then let launch right after the wait at every batch (recurrence_trigger_point,
  // unless MimoStepPolicy::trigger fixes a point).
  bool beside_other_chains = false;
  L2Prefetch prefetch[2];  // weights of later kernels to pull into L2 meanwhile

  // Optional fused out_proj (small batches): instead of writing o, each block multiplies
  // its o values by its columns of out_proj [d_model, H*P] and adds the products into
  // residual[b] with fp32 atomics (summation order varies run to run, within rounding).
  // The tensor-core variant (mimo_step_tc_can_fuse_out_proj) takes bf16 columns, d_state
  // 128, d_model a multiple of 16 up to 1024, heads * headdim / 16 a multiple of 4, and a
  // residual stride that is a multiple of 4 from a 16-byte aligned start (it adds four
  // outputs with one vector atomic).
  const void* out_proj = nullptr;
  WeightDType out_proj_type = WeightDType::BF16;
  float* residual = nullptr;  // [batch, residual_stride]
  int residual_stride = 0;
  int d_model = 0;
  // Tensor-core variant: blocks a cluster sums over before its atomics (4 or 8); 0: 8
  // where the shape allows, else 4.
  int fused_cluster = 0;
};

// A head shape the recurrence kernels cannot run: the dimension (its ssm_cfg key) and
// the rule it breaks.
struct MimoShapeRefusal {
  std::string dimension;  // "d_state", "headdim" or "mimo_rank"
  int value = 0;          // the dimension's value
  std::string rule;       // e.g. "must be at most 64"
};
// The planner's limits on a head's shape (plan_mimo_step refuses by this same rule),
// which an engine checks a model by before it uploads anything.
std::optional<MimoShapeRefusal> mimo_step_shape_refusal(int headdim, int d_state, int rank);

// Whether plan_mimo_step can fuse out_proj for these sizes (the block's out_proj columns
// must fit in shared memory next to the rest), in the kernel args.tensor_cores picks.
bool mimo_step_can_fuse_out_proj(const MimoStepArgs& args, const MimoStepPolicy& policy = {});

// MimoStepArgs is the kernels' parameter block as it is, so the planner's policy comes
// beside it rather than in it.
KernelLaunch plan_mimo_step(const MimoStepArgs& args, const MimoStepPolicy& policy = {});

// The tensor-core variant (picked by plan_mimo_step when args.tensor_cores is set and it
// applies): rank 1, 2 or 4, headdim a multiple of 16 up to 64, d_state a multiple of 16
// up to 128; with out_proj fused, also what mimo_step_tc_can_fuse_out_proj needs.
bool mimo_step_tc_applies(const MimoStepArgs& args);
bool mimo_step_tc_can_fuse_out_proj(const MimoStepArgs& args);
// The cluster size the tensor-core variant sums out_proj over for these args (0: it cannot
// fuse out_proj).
int mimo_step_tc_fused_cluster(const MimoStepArgs& args);
KernelLaunch plan_mimo_step_tc(const MimoStepArgs& args, const MimoStepPolicy& policy = {});

// The streaming variant (mimo_step_stream.cu; plan_mimo_step_tc picks it from
// MimoStepPolicy::streaming_min_batch): rank 1, 2 or 4, headdim a multiple of 16 up to 64,
// d_state a multiple of 32 up to 128, state rows on 16 bytes, out_proj not fused.
bool mimo_step_stream_applies(const MimoStepArgs& args);
// The shared memory its plan asks for (applies only within kMaxSharedBytesPerBlock).
size_t mimo_step_stream_smem_bytes(const MimoStepArgs& args);
KernelLaunch plan_mimo_step_stream(const MimoStepArgs& args, const MimoStepPolicy& policy = {});

}  // namespace m3::kernels
