// Float64 CPU twins of the chunked prefill (kernels/prefill_scan.cuh): the decode step's
// recurrence run token by token (the contract, ../shared/docs/MAMBA3_MIMO_DECODE.md) and
// the chunked algorithm exactly as the kernels decompose it (token terms, angle scan,
// chunk states, the state pass with the folded next-token term, chunk outputs), so the
// algorithm is checked on the CPU and each CUDA kernel against its twin.
#pragma once

#include <cstdint>
#include <vector>

namespace m3::twin {

struct ScanDims {
  int H = 0, P = 0, N = 0, R = 0, S = 0;
  bool mimo_rotation = true;
  bool out_norm = false;
  double a_floor = 1e-4, eps = 1e-5;
};

// Where one token's in_proj outputs sit in its row of `stride` floats.
struct InProjSplit {
  int z = 0, x = 0, B = 0, C = 0, dt = 0, A = 0, trap = 0, ang = 0, stride = 0;
};
// The checkpoint's order (z, x, B, C, dd_dt, dd_A, trap, ang), plus `extra` unused floats a row.
InProjSplit in_proj_split(const ScanDims& d, int extra);

struct ScanParams {
  std::vector<float> dt_bias, D, B_bias, C_bias, B_norm, C_norm, mimo_x, mimo_z, mimo_o, out_norm;
};
ScanParams random_params(const ScanDims& d, uint32_t seed);

// One slot's state in one layer: angle [H][S], ssm [H][P][N], k_prev [H][R][N], x_prev [H][P].
struct HeadStates {
  std::vector<double> angle, ssm, k_prev, x_prev;
};
HeadStates random_state(const ScanDims& d, uint32_t seed);

// The run's tokens one decode step at a time: o [T][H*P], state advanced by T tokens.
void step_run(const ScanDims& d, const ScanParams& p, const InProjSplit& s, const float* w, int T, HeadStates& st,
              std::vector<double>& o);

// What the chunked algorithm computes on the way, in the kernels' workspace layout
// (PrefillScanWorkspace), for locating a kernel that disagrees.
struct ChunkTrace {
  std::vector<double> tok_a, tok_gamma, tok_bterm, tok_dt;  // [T][H]
  std::vector<double> theta;                                // [T][H][S]
  std::vector<double> b_norm, c_norm;                       // [T][R][N]
  std::vector<double> chunk_decay;                          // [chunks][H] exp of the chunk's sum of a
  std::vector<double> chunk_state_in;                       // [chunks][H][P][N] S~ entering each chunk
};

// The chunked algorithm with `chunk_tokens` tokens a chunk; same outputs as step_run.
void chunked_run(const ScanDims& d, const ScanParams& p, const InProjSplit& s, const float* w, int T,
                 int chunk_tokens, HeadStates& st, std::vector<double>& o, ChunkTrace* trace = nullptr);

// max |a - b| over max |b| (NaN in a counts as infinite).
double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace m3::twin
