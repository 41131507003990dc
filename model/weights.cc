#include "model/weights.h"

#include <cstring>
#include <set>
#include <stdexcept>
#include <vector>

namespace m3 {

namespace {

struct Expected {
  std::string name;
  std::vector<int64_t> shape;
};

std::string shape_str(const std::vector<int64_t>& shape) {
  TensorView v;
  v.shape = shape;
  return v.shape_str();
}

// Every tensor the config needs, in checkpoint order (see MAMBA3_MIMO_DECODE.md).
// lm_head.weight is handled by the caller: required only when untied.
std::vector<Expected> expected_tensors(const ModelConfig& c) {
  const int64_t d = c.d_model, di = c.d_inner(), H = c.n_heads(), R = c.ssm.mimo_rank,
                N = c.ssm.d_state, P = c.ssm.headdim, V = c.padded_vocab(), F = c.mlp_width();
  std::vector<Expected> out;
  out.push_back({"backbone.embedding.weight", {V, d}});
  for (int i = 0; i < c.n_layer; ++i) {
    auto L = [&](const char* suffix, std::vector<int64_t> shape) {
      out.push_back({layer_tensor_name(i, suffix), std::move(shape)});
    };
    L("norm.weight", {d});
    L("mixer.in_proj.weight", {c.in_proj_rows(), d});
    L("mixer.dt_bias", {H});
    L("mixer.D", {H});
    L("mixer.B_bias", {H, R, N});
    L("mixer.C_bias", {H, R, N});
    L("mixer.B_norm.weight", {N});
    L("mixer.C_norm.weight", {N});
    L("mixer.mimo_x", {H, R, P});
    L("mixer.mimo_z", {H, R, P});
    L("mixer.mimo_o", {H, R, P});
    if (c.ssm.is_outproj_norm) L("mixer.norm.weight", {di});
    L("mixer.out_proj.weight", {d, di});
    if (c.has_mlp()) {
      L("norm2.weight", {d});
      L("mlp.fc1.weight", {2 * F, d});
      L("mlp.fc2.weight", {d, F});
    }
  }
  out.push_back({"backbone.norm_f.weight", {d}});
  return out;
}

bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

}  // namespace

std::string layer_tensor_name(int layer, const std::string& suffix) {
  return "backbone.layers." + std::to_string(layer) + "." + suffix;
}

ModelWeights ModelWeights::load(const std::filesystem::path& model_dir) {
  ModelWeights w;
  w.dir_ = model_dir;
  w.config_ = ModelConfig::load(model_dir / "config.json");
  w.set_ = SafetensorsSet::open_dir(model_dir);
  const ModelConfig& c = w.config_;
  const SafetensorsSet& set = w.set_;

  // Where a missing tensor should have been, for the message.
  const std::string where =
      std::filesystem::exists(model_dir / "model.safetensors.index.json")
          ? (model_dir / "model.safetensors.index.json").string()
          : (model_dir / "model.safetensors").string();

  auto check = [&](const std::string& name, const std::vector<int64_t>& shape) {
    const TensorView* t = set.find(name);
    if (!t) throw std::runtime_error(where + ": tensor " + name + " is missing (config needs shape " +
                                     shape_str(shape) + ")");
    if (t->shape != shape)
      throw std::runtime_error(set.file_of(name) + ": tensor " + name + " has shape " + t->shape_str() +
                               ", config needs " + shape_str(shape));
    if (!is_float(t->dtype))
      throw std::runtime_error(set.file_of(name) + ": tensor " + name + " has dtype " +
                               std::string(dtype_name(t->dtype)) + ", expected F32, BF16 or F16");
  };

  std::vector<Expected> expected = expected_tensors(c);
  for (const Expected& e : expected) check(e.name, e.shape);

  const std::vector<int64_t> head_shape = {c.padded_vocab(), c.d_model};
  if (!c.tie_embeddings || set.find("lm_head.weight")) check("lm_head.weight", head_shape);
  if (c.tie_embeddings && set.find("lm_head.weight")) {
    // A tied checkpoint stores the same parameter twice; different bytes mean the file is
    // not what its config says.
    const TensorView& head = *set.find("lm_head.weight");
    const TensorView& emb = *set.find("backbone.embedding.weight");
    if (head.dtype != emb.dtype)
      throw std::runtime_error(set.file_of("lm_head.weight") + ": tensor lm_head.weight is " +
                               std::string(dtype_name(head.dtype)) + " but backbone.embedding.weight is " +
                               std::string(dtype_name(emb.dtype)) +
                               ", and the config has tie_embeddings = true (one parameter stored twice)");
    if (std::memcmp(head.data, emb.data, head.nbytes) != 0)
      throw std::runtime_error(set.file_of("lm_head.weight") +
                               ": tensor lm_head.weight differs from backbone.embedding.weight, but the "
                               "config has tie_embeddings = true");
  }

  std::set<std::string> expected_names;
  for (const Expected& e : expected) expected_names.insert(e.name);
  std::vector<std::string> surplus;
  for (const auto& [name, view] : set.tensors()) {
    if (name == "lm_head.weight") continue;
    if (!expected_names.count(name)) surplus.push_back(name);
  }
  if (!surplus.empty()) {
    std::string list;
    for (size_t i = 0; i < surplus.size() && i < 8; ++i) list += (i ? ", " : "") + surplus[i];
    if (surplus.size() > 8) list += ", ... (" + std::to_string(surplus.size()) + " in all)";
    throw std::runtime_error(set.file_of(surplus[0]) + ": tensors the config does not use: " + list +
                             " (check n_layer, d_intermediate, is_outproj_norm)");
  }
  return w;
}

const TensorView& ModelWeights::tensor(const std::string& name) const {
  const TensorView* t = set_.find(name);
  if (!t) throw std::runtime_error(dir_.string() + ": no tensor " + name);
  return *t;
}

const TensorView& ModelWeights::layer(int i, const std::string& suffix) const {
  return tensor(layer_tensor_name(i, suffix));
}

const TensorView& ModelWeights::lm_head() const {
  if (const TensorView* t = set_.find("lm_head.weight")) return *t;
  return tensor("backbone.embedding.weight");
}

}  // namespace m3
