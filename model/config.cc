#include "model/config.h"

#include <climits>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "model/json_input.h"

namespace m3 {

namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw std::runtime_error(source + ": " + what);
}

std::string type_of(const json& v) { return v.type_name(); }

// Reads an integer key if present. Integral floats (2.0) are accepted since some
// exporters write every number as a float.
void read_int(const json& obj, const char* key, const std::string& path, const std::string& source,
              int* out, bool required) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) fail(source, "missing required key " + path);
    return;
  }
  const json& v = *it;
  double d;
  if (v.is_number_integer()) {
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT_MAX)) fail(source, path + " = " + json_brief(v) + " is too large");
      *out = static_cast<int>(u);
      return;
    }
    int64_t i = v.get<int64_t>();
    if (i > INT_MAX || i < INT_MIN) fail(source, path + " = " + json_brief(v) + " is out of range");
    *out = static_cast<int>(i);
    return;
  }
  if (v.is_number_float()) {
    d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) <= INT_MAX) {
      *out = static_cast<int>(d);
      return;
    }
  }
  fail(source, path + " must be an integer, got " + type_of(v) + " " + json_brief(v));
}

void read_bool(const json& obj, const char* key, const std::string& path, const std::string& source,
               bool* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return;
  if (!it->is_boolean()) fail(source, path + " must be true or false, got " + type_of(*it) + " " + json_brief(*it));
  *out = it->get<bool>();
}

void read_double(const json& obj, const char* key, const std::string& path, const std::string& source,
                 double* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return;
  if (!it->is_number()) fail(source, path + " must be a number, got " + type_of(*it) + " " + json_brief(*it));
  *out = it->get<double>();
}

void read_string(const json& obj, const char* key, const std::string& path, const std::string& source,
                 std::string* out, bool required) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) fail(source, "missing required key " + path);
    return;
  }
  if (!it->is_string()) fail(source, path + " must be a string, got " + type_of(*it) + " " + json_brief(*it));
  *out = it->get<std::string>();
}

std::string int_list(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

ModelConfig ModelConfig::parse(std::string_view json_text, const std::string& source) {
  const json root = parse_json_bounded(json_text, source, "");
  if (!root.is_object()) fail(source, "config must be a JSON object, got " + type_of(root));

  ModelConfig c;
  read_int(root, "d_model", "d_model", source, &c.d_model, true);
  read_int(root, "n_layer", "n_layer", source, &c.n_layer, true);
  read_int(root, "vocab_size", "vocab_size", source, &c.vocab_size, true);
  read_int(root, "d_intermediate", "d_intermediate", source, &c.d_intermediate, false);
  read_int(root, "pad_vocab_size_multiple", "pad_vocab_size_multiple", source,
           &c.pad_vocab_size_multiple, false);
  read_bool(root, "tie_embeddings", "tie_embeddings", source, &c.tie_embeddings);
  read_bool(root, "rms_norm", "rms_norm", source, &c.rms_norm);
  read_bool(root, "residual_in_fp32", "residual_in_fp32", source, &c.residual_in_fp32);
  read_bool(root, "fused_add_norm", "fused_add_norm", source, &c.fused_add_norm);

  if (auto it = root.find("attn_layer_idx"); it != root.end() && !it->is_null()) {
    if (!it->is_array()) fail(source, "attn_layer_idx must be a list, got " + type_of(*it));
    for (const json& v : *it) {
      if (!v.is_number_integer()) fail(source, "attn_layer_idx must hold integers, got " + json_brief(v));
      c.attn_layer_idx.push_back(static_cast<int>(v.get<int64_t>()));
    }
  }

  auto ssm_it = root.find("ssm_cfg");
  if (ssm_it == root.end() || ssm_it->is_null()) {
    fail(source, "missing ssm_cfg (mamba-ssm would build Mamba1 layers); only ssm_cfg.layer = "
                 "\"Mamba3\" is supported");
  }
  if (!ssm_it->is_object()) fail(source, "ssm_cfg must be an object, got " + type_of(*ssm_it));
  const json& s = *ssm_it;
  SsmConfig& m = c.ssm;
  m.layer.clear();
  read_string(s, "layer", "ssm_cfg.layer", source, &m.layer, true);
  read_bool(s, "is_mimo", "ssm_cfg.is_mimo", source, &m.is_mimo);
  read_int(s, "mimo_rank", "ssm_cfg.mimo_rank", source, &m.mimo_rank, false);
  read_int(s, "d_state", "ssm_cfg.d_state", source, &m.d_state, false);
  read_int(s, "headdim", "ssm_cfg.headdim", source, &m.headdim, false);
  read_int(s, "expand", "ssm_cfg.expand", source, &m.expand, false);
  read_int(s, "ngroups", "ssm_cfg.ngroups", source, &m.ngroups, false);
  read_double(s, "rope_fraction", "ssm_cfg.rope_fraction", source, &m.rope_fraction);
  read_bool(s, "is_outproj_norm", "ssm_cfg.is_outproj_norm", source, &m.is_outproj_norm);
  read_double(s, "A_floor", "ssm_cfg.A_floor", source, &m.A_floor);

  c.validate(source);
  return c;
}

ModelConfig ModelConfig::load(const std::filesystem::path& config_json) {
  // A model's config.json is a few hundred bytes.
  constexpr uint64_t kMaxConfigBytes = 1 << 20;
  return parse(read_text_file(config_json, kMaxConfigBytes), config_json.string());
}

std::string ModelConfig::to_json() const {
  // ordered_json keeps the MambaConfig field order, so files diff cleanly.
  nlohmann::ordered_json ssm_cfg = {
      {"layer", ssm.layer},
      {"is_mimo", ssm.is_mimo},
      {"mimo_rank", ssm.mimo_rank},
      {"d_state", ssm.d_state},
      {"headdim", ssm.headdim},
      {"expand", ssm.expand},
      {"ngroups", ssm.ngroups},
      {"rope_fraction", ssm.rope_fraction},
      {"is_outproj_norm", ssm.is_outproj_norm},
      {"A_floor", ssm.A_floor},
  };
  nlohmann::ordered_json j = {
      {"d_model", d_model},
      {"d_intermediate", d_intermediate},
      {"n_layer", n_layer},
      {"vocab_size", vocab_size},
      {"ssm_cfg", ssm_cfg},
      {"attn_layer_idx", attn_layer_idx},
      {"attn_cfg", nlohmann::ordered_json::object()},
      {"rms_norm", rms_norm},
      {"residual_in_fp32", residual_in_fp32},
      {"fused_add_norm", fused_add_norm},
      {"pad_vocab_size_multiple", pad_vocab_size_multiple},
      {"tie_embeddings", tie_embeddings},
  };
  return j.dump(2) + "\n";
}

void ModelConfig::validate(const std::string& source) const {
  auto positive = [&](const char* name, int v) {
    if (v <= 0) fail(source, std::string(name) + " must be positive, got " + std::to_string(v));
  };
  positive("d_model", d_model);
  positive("n_layer", n_layer);
  // Far above any released Mamba model (64 layers at 2.8B parameters); the weights' names
  // and shapes are listed per layer before a single tensor is checked.
  constexpr int kMaxLayers = 1024;
  if (n_layer > kMaxLayers)
    fail(source, "n_layer = " + std::to_string(n_layer) + " is over the supported " + std::to_string(kMaxLayers));
  positive("vocab_size", vocab_size);
  positive("pad_vocab_size_multiple", pad_vocab_size_multiple);
  if (d_intermediate < 0)
    fail(source, "d_intermediate must be >= 0 (0 = no MLP), got " + std::to_string(d_intermediate));
  if (!attn_layer_idx.empty())
    fail(source, "attention layers are not supported: attn_layer_idx = " + int_list(attn_layer_idx));
  if (ssm.layer != "Mamba3")
    fail(source, "ssm_cfg.layer = \"" + ssm.layer + "\" is not supported; only \"Mamba3\" is");
  if (!ssm.is_mimo)
    fail(source, "ssm_cfg.is_mimo = false (SISO Mamba3) is not supported; only MIMO models are");
  if (ssm.mimo_rank < 1)
    fail(source, "ssm_cfg.mimo_rank must be >= 1, got " + std::to_string(ssm.mimo_rank));
  positive("ssm_cfg.d_state", ssm.d_state);
  positive("ssm_cfg.headdim", ssm.headdim);
  positive("ssm_cfg.expand", ssm.expand);
  if (ssm.ngroups != 1)
    fail(source, "ssm_cfg.ngroups = " + std::to_string(ssm.ngroups) + " is not supported; only 1 is");
  if (ssm.d_state % 2 != 0)
    fail(source, "ssm_cfg.d_state = " + std::to_string(ssm.d_state) +
                     " must be even (rotary pairs (i, i + N/2))");
  if (ssm.rope_fraction != 0.5 && ssm.rope_fraction != 1.0) {
    std::ostringstream v;
    v << ssm.rope_fraction;
    fail(source, "ssm_cfg.rope_fraction = " + v.str() + " is not supported; use 0.5 or 1.0");
  }
  if (!std::isfinite(ssm.A_floor) || ssm.A_floor < 0) {
    std::ostringstream v;
    v << ssm.A_floor;
    fail(source, "ssm_cfg.A_floor = " + v.str() + " must be a finite number >= 0");
  }
  if (!rms_norm) fail(source, "rms_norm = false (LayerNorm blocks) is not supported");
  // mamba-ssm would keep the residual stream in the weights' dtype; both engines keep it in
  // fp32, so such a model would not decode as it was trained.
  if (!residual_in_fp32)
    fail(source, "residual_in_fp32 = false is not supported; the engines keep the residual stream in fp32");

  // Derived sizes are ints; refuse configs whose sizes would overflow them.
  const int64_t d_inner64 = static_cast<int64_t>(ssm.expand) * d_model;
  const int64_t bc64 = static_cast<int64_t>(ssm.mimo_rank) * ssm.ngroups * ssm.d_state;
  const int64_t padded64 =
      (static_cast<int64_t>(vocab_size) + pad_vocab_size_multiple - 1) / pad_vocab_size_multiple *
      pad_vocab_size_multiple;
  const int64_t rows64 = 2 * d_inner64 + 2 * bc64 + 3 * (d_inner64 / ssm.headdim) + ssm.d_state;
  const int64_t mlp64 = (static_cast<int64_t>(d_intermediate) + 127) / 128 * 128;
  if (d_inner64 > INT_MAX / 4 || rows64 > INT_MAX || padded64 > INT_MAX || mlp64 > INT_MAX / 2)
    fail(source, "model sizes are too large (a derived dimension exceeds 2^31)");
  if (d_inner64 % ssm.headdim != 0)
    fail(source, "d_inner = expand * d_model = " + std::to_string(d_inner64) +
                     " is not divisible by ssm_cfg.headdim = " + std::to_string(ssm.headdim));
  // Every slot of an engine holds this much; a few small numbers can ask for terabytes.
  // (In double: the product of the sizes validated above can pass 2^63.)
  constexpr double kMaxStateBytesPerSequence = 16.0 * (1ull << 30);
  const double state_bytes = 4.0 * static_cast<double>(state_floats_per_layer()) * n_layer;
  if (state_bytes > kMaxStateBytesPerSequence) {
    std::ostringstream v;
    v << "the recurrent state of one sequence would need " << state_bytes / (1ull << 30)
      << " GiB (n_layer x (heads x headdim x d_state + ...) floats), over the supported 16 GiB";
    fail(source, v.str());
  }
}

int ModelConfig::rope_split() const {
  int split = static_cast<int>(ssm.d_state * ssm.rope_fraction);
  return split - split % 2;
}

int ModelConfig::padded_vocab() const {
  // In 64 bits: vocab_size + m - 1 can pass INT_MAX where the result (checked by validate)
  // does not.
  const int64_t m = pad_vocab_size_multiple;
  return static_cast<int>((vocab_size + m - 1) / m * m);
}

ModelConfig::InProjLayout ModelConfig::in_proj_layout() const {
  InProjLayout l{};
  l.z = 0;
  l.x = l.z + d_inner();
  l.B = l.x + d_inner();
  l.C = l.B + bc_width();
  l.dd_dt = l.C + bc_width();
  l.dd_A = l.dd_dt + n_heads();
  l.trap = l.dd_A + n_heads();
  l.ang = l.trap + n_heads();
  l.total = l.ang + n_angles();
  return l;
}

int64_t ModelConfig::state_floats_per_layer() const {
  const int64_t H = n_heads(), P = ssm.headdim, N = ssm.d_state, R = ssm.mimo_rank;
  return H * n_angles() + H * P * N + R * H * N + H * P;
}

int64_t ModelConfig::parameter_count() const {
  const int64_t d = d_model, di = d_inner(), H = n_heads(), P = ssm.headdim, N = ssm.d_state,
                R = ssm.mimo_rank, V = padded_vocab(), F = mlp_width();
  int64_t layer = d                       // norm
                  + in_proj_rows() * d    // in_proj
                  + 2 * H                 // dt_bias, D
                  + 2 * H * R * N         // B_bias, C_bias
                  + 2 * N                 // B_norm, C_norm
                  + 3 * H * R * P         // mimo_x, mimo_z, mimo_o
                  + d * di;               // out_proj
  if (ssm.is_outproj_norm) layer += di;
  if (has_mlp()) layer += d + 2 * F * d + d * F;
  int64_t total = V * d + n_layer * layer + d;
  if (!tie_embeddings) total += V * d;
  return total;
}

}  // namespace m3
