// The pieces of one decode step as plain float32 functions over host arrays: what the
// CPU engine composes into a step, and the CPU twins the CUDA kernels are tested
// against. Arithmetic as in ../shared/docs/MAMBA3_MIMO_DECODE.md.
#pragma once

#include <cstdint>

namespace m3::cpu {

// out = v / sqrt(mean(v^2) + eps) * weight, over n values (out may alias v).
void rmsnorm(const float* v, const float* weight, int n, float eps, float* out);

// Sum of a[i] * b[i]; a fixed 8-way split of the sum, so the result does not depend on
// the caller (batch size, thread) and the loop vectorises.
float dot(const float* a, const float* b, int n);

// y[b * out_rows + j] = W[j, :] . x[b * in, :) for rows j in [row_begin, row_end) and
// each of the `batch` input vectors. W is [out_rows, in], row-major.
void matvec_rows(const float* W, int in, int out_rows, int row_begin, int row_end,
                 const float* x, int batch, float* y);

// The same products for many input vectors at once (a prompt's tokens): y[t * out_rows + j]
// = W[j, :] . x[t * in, :) for rows j in [row_begin, row_end) and t < tokens, blocked so
// that a block of inputs stays in cache while the rows stream past. Every element is
// summed exactly as dot() sums it, so it equals what matvec_rows gives token by token.
void matmul_rows(const float* W, int in, int out_rows, int row_begin, int row_end,
                 const float* x, int tokens, float* y);

// out[i] = a[i] * silu(g[i]) with a = fc1_out[0:F), g = fc1_out[F:2F).
void gated_silu(const float* fc1_out, int F, float* out);

inline constexpr float kPi = 3.14159265358979323846f;

// Sizes of one Mamba-3 MIMO mixer (G = 1).
struct MixerDims {
  int H = 0, P = 0, N = 0, R = 0, S = 0;
  bool outproj_norm = false;
  float A_floor = 1e-4f;
  float eps = 1e-5f;
};

// One layer's mixer parameters (fp32), per-head arrays indexed as in the checkpoint.
struct MixerParams {
  const float* dt_bias = nullptr;  // [H]
  const float* D = nullptr;        // [H]
  const float* B_bias = nullptr;   // [H, R, N]
  const float* C_bias = nullptr;   // [H, R, N]
  const float* mimo_x = nullptr;   // [H, R, P]
  const float* mimo_z = nullptr;   // [H, R, P]
  const float* mimo_o = nullptr;   // [H, R, P]
  const float* norm = nullptr;     // [H*P], only when outproj_norm
};

// One sequence's recurrent state in one layer.
struct MixerState {
  float* angle = nullptr;   // [H, S]
  float* ssm = nullptr;     // [H, P, N]
  float* k_prev = nullptr;  // [R, H, N]
  float* x_prev = nullptr;  // [H, P]
};

// Floats of scratch mixer_head_step() needs.
int mixer_head_scratch_floats(const MixerDims& d);

// Where the per-head inputs start in one token's in_proj output
// (ModelConfig::in_proj_layout(); B and C are normed by the caller).
struct InProjOffsets { int z, x, dd_dt, dd_A, trap, ang; };

// Steps head h: reads the in_proj output `w` and the already RMS-normed B and C ([R, N]
// each, shared by all heads), updates the head's state and writes o[h*P : h*P+P].
// `scratch` holds mixer_head_scratch_floats(d) floats.
void mixer_head_step(const MixerDims& d, const MixerParams& p, const InProjOffsets& layout,
                     const float* w, const float* B_normed, const float* C_normed, int h,
                     MixerState& state, float* scratch, float* o);

}  // namespace m3::cpu
