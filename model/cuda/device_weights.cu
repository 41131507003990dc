#include "model/cuda/device_weights.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/common.cuh"
#include "model/tensor.h"
#include "model/weights.h"

namespace m3::cuda {
namespace {

constexpr size_t kAlign = 256;

// Lays tensors out in one host staging buffer, converted, then copies it up once.
class Packer {
 public:
  explicit Packer(WeightDType type) : type_(type) {}

  size_t add_matrix(const TensorView& t) { return add(t, type_ == WeightDType::BF16); }
  // t (rows of `cols`) followed by zero rows up to `rows` rows.
  size_t add_matrix_rows(const TensorView& t, size_t rows, size_t cols) {
    const size_t offset = add_matrix(t);
    host_.resize(std::max(host_.size(), offset + rows * cols * (type_ == WeightDType::BF16 ? 2 : 4)));
    return offset;
  }
  size_t add_vector(const TensorView& t) { return add(t, false); }
  std::vector<unsigned char>& bytes() { return host_; }

 private:
  size_t add(const TensorView& t, bool bf16) {
    const size_t offset = (host_.size() + kAlign - 1) / kAlign * kAlign;
    const size_t n = static_cast<size_t>(t.numel());
    const std::vector<float> f = to_f32(t);
    host_.resize(offset + n * (bf16 ? 2 : 4));
    unsigned char* dst = host_.data() + offset;
    if (bf16) {
      for (size_t i = 0; i < n; ++i) {
        const uint16_t v = f32_to_bf16(f[i]);
        std::memcpy(dst + 2 * i, &v, 2);
      }
    } else {
      std::memcpy(dst, f.data(), n * 4);
    }
    return offset;
  }

  WeightDType type_;
  std::vector<unsigned char> host_;
};

}  // namespace

DeviceWeights upload_weights(const ModelWeights& weights, WeightDType type) {
  const ModelConfig& cfg = weights.config();
  DeviceWeights dw;
  dw.type = type;
  Packer pk(type);
  const size_t msize = type == WeightDType::BF16 ? 2 : 4;

  struct LayerOffsets {
    size_t in_proj, out_proj, fc1 = 0, fc2 = 0, norm, norm2 = 0, dt_bias, D, B_bias, C_bias,
        B_norm, C_norm, mimo_x, mimo_z, mimo_o, out_norm = 0;
  };
  const size_t emb = pk.add_matrix(weights.tensor("backbone.embedding.weight"));
  const size_t lm = cfg.tie_embeddings ? emb : pk.add_matrix(weights.lm_head());
  const size_t norm_f = pk.add_vector(weights.tensor("backbone.norm_f.weight"));
  std::vector<LayerOffsets> offs(cfg.n_layer);
  size_t matrix_elems = static_cast<size_t>(cfg.padded_vocab()) * cfg.d_model;  // lm_head
  size_t vector_elems = cfg.d_model;
  for (int i = 0; i < cfg.n_layer; ++i) {
    LayerOffsets& o = offs[i];
    auto mat = [&](const char* s) {
      const TensorView& t = weights.layer(i, s);
      matrix_elems += t.numel();
      return pk.add_matrix(t);
    };
    auto vec = [&](const char* s) {
      const TensorView& t = weights.layer(i, s);
      vector_elems += t.numel();
      return pk.add_vector(t);
    };
    {
      const TensorView& t = weights.layer(i, "mixer.in_proj.weight");
      matrix_elems += t.numel();
      o.in_proj = pk.add_matrix_rows(t, cfg.padded_in_proj_rows(), cfg.d_model);
    }
    o.out_proj = mat("mixer.out_proj.weight");
    o.norm = vec("norm.weight");
    o.dt_bias = vec("mixer.dt_bias");
    o.D = vec("mixer.D");
    o.B_bias = vec("mixer.B_bias");
    o.C_bias = vec("mixer.C_bias");
    o.B_norm = vec("mixer.B_norm.weight");
    o.C_norm = vec("mixer.C_norm.weight");
    o.mimo_x = vec("mixer.mimo_x");
    o.mimo_z = vec("mixer.mimo_z");
    o.mimo_o = vec("mixer.mimo_o");
    if (cfg.ssm.is_outproj_norm) o.out_norm = vec("mixer.norm.weight");
    if (cfg.has_mlp()) {
      o.fc1 = mat("mlp.fc1.weight");
      o.fc2 = mat("mlp.fc2.weight");
      o.norm2 = vec("norm2.weight");
    }
  }
  dw.matrix_bytes = matrix_elems * msize;
  dw.vector_bytes = vector_elems * 4;

  std::vector<unsigned char>& host = pk.bytes();
  dw.storage = DeviceBuffer(host.size(), "model weights");
  M3_CUDA_CHECK(cudaMemcpy(dw.storage.get(), host.data(), host.size(), cudaMemcpyHostToDevice));
  auto* base = dw.storage.as<unsigned char>();
  auto f = [&](size_t off) { return reinterpret_cast<const float*>(base + off); };
  dw.embedding = base + emb;
  dw.lm_head = base + lm;
  dw.norm_f = f(norm_f);
  dw.layers.resize(cfg.n_layer);
  for (int i = 0; i < cfg.n_layer; ++i) {
    const LayerOffsets& o = offs[i];
    DeviceLayer& l = dw.layers[i];
    l.in_proj = base + o.in_proj;
    l.out_proj = base + o.out_proj;
    l.norm = f(o.norm);
    l.dt_bias = f(o.dt_bias);
    l.D = f(o.D);
    l.B_bias = f(o.B_bias);
    l.C_bias = f(o.C_bias);
    l.B_norm = f(o.B_norm);
    l.C_norm = f(o.C_norm);
    l.mimo_x = f(o.mimo_x);
    l.mimo_z = f(o.mimo_z);
    l.mimo_o = f(o.mimo_o);
    if (cfg.ssm.is_outproj_norm) l.out_norm = f(o.out_norm);
    if (cfg.has_mlp()) {
      l.fc1 = base + o.fc1;
      l.fc2 = base + o.fc2;
      l.norm2 = f(o.norm2);
    }
  }
  return dw;
}

}  // namespace m3::cuda
