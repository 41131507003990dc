#include "model/random_model.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <stdexcept>

#include "model/safetensors.h"
#include "model/weights.h"

namespace m3 {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// std::normal_distribution differs between standard libraries; these draws use only
// mt19937_64 (fully specified) and exact arithmetic, so files match everywhere.
class Draw {
 public:
  Draw(uint64_t seed, const std::string& tensor) : gen_(splitmix64(seed ^ fnv1a(tensor))) {}

  double uniform() { return static_cast<double>(gen_() >> 11) * 0x1p-53; }  // [0, 1)

  // Sum of four 16-bit uniforms (Irwin-Hall), scaled to unit variance: close to a normal
  // inside +-3.4 and never beyond it, which keeps random models free of outliers.
  float normal() {
    uint64_t r = gen_();
    double s = 0;
    for (int i = 0; i < 4; ++i, r >>= 16) s += (static_cast<double>(r & 0xffff) + 0.5) * 0x1p-16;
    return static_cast<float>((s - 2.0) * 1.7320508075688772);
  }

 private:
  std::mt19937_64 gen_;
};

// How each kind of parameter is drawn. Chosen so that activations keep unit-scale RMS,
// dt = softplus(dd_dt + dt_bias) spans about [1e-3, 1e-1] as at mamba-ssm's init, and the
// tied head yields logits with a spread of a few units.
struct Recipe {
  enum Kind { kNormal, kAround, kDtBias } kind;
  double center = 0;  // kAround: value = center + scale * normal
  double scale = 0;   // kNormal: std
};

std::vector<float> draw_values(const Recipe& r, int64_t n, Draw& d) {
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) {
    switch (r.kind) {
      case Recipe::kNormal:
        x = static_cast<float>(r.scale * d.normal());
        break;
      case Recipe::kAround:
        x = static_cast<float>(r.center + r.scale * d.normal());
        break;
      case Recipe::kDtBias: {
        // dt log-uniform in [1e-3, 1e-1]; bias = softplus^-1(dt) = dt + log(1 - exp(-dt)).
        double dt = std::exp(std::log(1e-3) + d.uniform() * (std::log(1e-1) - std::log(1e-3)));
        x = static_cast<float>(dt + std::log(-std::expm1(-dt)));
        break;
      }
    }
  }
  return v;
}

std::vector<std::byte> encode(const std::vector<float>& v, DType dtype) {
  std::vector<std::byte> out(v.size() * dtype_size(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    switch (dtype) {
      case DType::F32:
        std::memcpy(&out[4 * i], &v[i], 4);
        break;
      case DType::BF16: {
        uint16_t h = f32_to_bf16(v[i]);
        std::memcpy(&out[2 * i], &h, 2);
        break;
      }
      case DType::F16: {
        uint16_t h = f32_to_f16(v[i]);
        std::memcpy(&out[2 * i], &h, 2);
        break;
      }
      default:
        throw std::invalid_argument("write_random_model: dtype must be F32, BF16 or F16");
    }
  }
  return out;
}

}  // namespace

void write_random_model(const ModelConfig& config, uint64_t seed, DType dtype,
                        const std::filesystem::path& dir) {
  if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16)
    throw std::invalid_argument("write_random_model: dtype " + std::string(dtype_name(dtype)) +
                                " is not F32, BF16 or F16");
  config.validate("write_random_model config");
  const ModelConfig& c = config;
  const int64_t d = c.d_model, di = c.d_inner(), H = c.n_heads(), R = c.ssm.mimo_rank,
                N = c.ssm.d_state, P = c.ssm.headdim, V = c.padded_vocab(), F = c.mlp_width();
  // Mixer/MLP outputs reach about residual_scale RMS, well above the embedding's RMS: with
  // a tied head a residual dominated by the token's own embedding would make "repeat
  // the input" the only likely output.
  const double residual_scale = 1.0 / std::sqrt(2.0 * c.n_layer);
  // Tied: the same matrix embeds and projects; logits' spread ~ std * sqrt(d_model).
  const double embed_std = 2.0 / std::sqrt(static_cast<double>(d));

  struct Spec {
    std::vector<int64_t> shape;
    Recipe recipe;
  };
  std::map<std::string, Spec> specs;  // sorted by name, as mamba-ssm checkpoints are
  specs["backbone.embedding.weight"] = {{V, d}, {Recipe::kNormal, 0, embed_std}};
  specs["backbone.norm_f.weight"] = {{d}, {Recipe::kAround, 1.0, 0.1}};
  if (!c.tie_embeddings)
    specs["lm_head.weight"] = {{V, d}, {Recipe::kNormal, 0, 2.0 / std::sqrt(static_cast<double>(d))}};
  for (int i = 0; i < c.n_layer; ++i) {
    auto L = [&](const char* suffix, std::vector<int64_t> shape, Recipe r) {
      specs[layer_tensor_name(i, suffix)] = {std::move(shape), r};
    };
    L("norm.weight", {d}, {Recipe::kAround, 1.0, 0.1});
    L("mixer.in_proj.weight", {c.in_proj_rows(), d}, {Recipe::kNormal, 0, 1.0 / std::sqrt(double(d))});
    L("mixer.dt_bias", {H}, {Recipe::kDtBias});
    L("mixer.D", {H}, {Recipe::kAround, 1.0, 0.1});
    L("mixer.B_bias", {H, R, N}, {Recipe::kAround, 0.0, 0.1});
    L("mixer.C_bias", {H, R, N}, {Recipe::kAround, 0.0, 0.1});
    L("mixer.B_norm.weight", {N}, {Recipe::kAround, 1.0, 0.1});
    L("mixer.C_norm.weight", {N}, {Recipe::kAround, 1.0, 0.1});
    L("mixer.mimo_x", {H, R, P}, {Recipe::kAround, 1.0, 0.2});
    L("mixer.mimo_z", {H, R, P}, {Recipe::kAround, 1.0, 0.2});
    L("mixer.mimo_o", {H, R, P}, {Recipe::kAround, 1.0 / R, 0.2 / R});
    if (c.ssm.is_outproj_norm) L("mixer.norm.weight", {di}, {Recipe::kAround, 1.0, 0.1});
    L("mixer.out_proj.weight", {d, di},
      {Recipe::kNormal, 0, residual_scale * embed_std * std::sqrt(double(d) / double(di))});
    if (c.has_mlp()) {
      L("norm2.weight", {d}, {Recipe::kAround, 1.0, 0.1});
      L("mlp.fc1.weight", {2 * F, d}, {Recipe::kNormal, 0, 1.0 / std::sqrt(double(d))});
      L("mlp.fc2.weight", {d, F},
        {Recipe::kNormal, 0, residual_scale * embed_std * std::sqrt(double(d) / double(F))});
    }
  }

  std::vector<TensorToWrite> tensors;
  tensors.reserve(specs.size() + 1);
  for (const auto& [name, spec] : specs) {
    int64_t n = 1;
    for (int64_t x : spec.shape) n *= x;
    Draw draw(seed, name);
    tensors.push_back({name, dtype, spec.shape, encode(draw_values(spec.recipe, n, draw), dtype)});
  }
  if (c.tie_embeddings) {
    // mamba-ssm's state_dict holds lm_head.weight even when tied (same values).
    const TensorToWrite* emb = nullptr;
    for (const auto& t : tensors)
      if (t.name == "backbone.embedding.weight") emb = &t;
    TensorToWrite head = *emb;
    head.name = "lm_head.weight";
    tensors.push_back(std::move(head));
  }

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw std::runtime_error(dir.string() + ": cannot create directory: " + ec.message());
  {
    std::ofstream out(dir / "config.json", std::ios::binary | std::ios::trunc);
    out << c.to_json();
    out.flush();
    if (!out) throw std::runtime_error((dir / "config.json").string() + ": write failed");
  }
  write_safetensors(dir / "model.safetensors", tensors,
                    {{"format", "pt"}, {"m3make_seed", std::to_string(seed)}});
}

}  // namespace m3
