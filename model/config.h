// Model configuration in mamba-ssm's MambaConfig layout (config.json), with the
// sizes the engines derive from it. See docs in ../shared/docs/MAMBA3_MIMO_DECODE.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace m3 {

struct SsmConfig {
  std::string layer = "Mamba3";
  bool is_mimo = false;
  int mimo_rank = 4;   // R
  int d_state = 128;   // N
  int headdim = 64;    // P
  int expand = 2;
  int ngroups = 1;     // G
  double rope_fraction = 0.5;
  bool is_outproj_norm = false;
  double A_floor = 1e-4;
};

struct ModelConfig {
  int d_model = 0;
  int n_layer = 0;
  int vocab_size = 0;              // unpadded; ids >= vocab_size are never sampled
  int d_intermediate = 0;          // 0: no gated MLP
  int pad_vocab_size_multiple = 8;
  bool tie_embeddings = true;
  bool rms_norm = true;
  bool residual_in_fp32 = true;
  bool fused_add_norm = true;
  std::vector<int> attn_layer_idx;
  SsmConfig ssm;

  static constexpr float kNormEps = 1e-5f;  // block, final, B/C and grouped norms

  // Parses and validates; errors name `source` (a file path or "<string>").
  static ModelConfig parse(std::string_view json_text, const std::string& source);
  static ModelConfig load(const std::filesystem::path& config_json);
  std::string to_json() const;  // round-trips through parse()

  // Throws std::runtime_error naming `source` for anything the engines cannot run.
  void validate(const std::string& source) const;

  int d_inner() const { return ssm.expand * d_model; }
  int n_heads() const { return d_inner() / ssm.headdim; }                     // H
  int rope_split() const;                                                    // int(N*rope_fraction), even
  int n_angles() const { return rope_split() / 2; }                          // S
  int padded_vocab() const;                                                  // V
  int mlp_width() const { return (d_intermediate + 127) / 128 * 128; }       // F (0 when no MLP)
  bool has_mlp() const { return d_intermediate > 0; }
  int bc_width() const { return ssm.mimo_rank * ssm.ngroups * ssm.d_state; } // R*G*N
  int in_proj_rows() const {
    return 2 * d_inner() + 2 * bc_width() + 3 * n_heads() + n_angles();
  }
  // in_proj's rows padded to a multiple of 64, as the CUDA engine stores the matrix (zero
  // rows) and lays out its output: cuBLASLt's heuristic picks a slower kernel for a row
  // count that is not one, and a second product for the rest cost a launch and its gap.
  int padded_in_proj_rows() const { return (in_proj_rows() + 63) / 64 * 64; }
  // Offsets of the in_proj output split, in this order: z, x, B, C, dd_dt, dd_A, trap, ang.
  struct InProjLayout { int z, x, B, C, dd_dt, dd_A, trap, ang, total; };
  InProjLayout in_proj_layout() const;
  // Floats of recurrent state per sequence per layer (angle, ssm, k_prev, x_prev; fp32).
  int64_t state_floats_per_layer() const;
  int64_t parameter_count() const;
};

}  // namespace m3
