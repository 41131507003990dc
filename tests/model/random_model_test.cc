#include "model/random_model.h"

#include <cmath>
#include <cstring>

#include "model/weights.h"
#include "tests/model/test_util.h"

namespace m3 {
namespace {

using ::testing::HasSubstr;
using test::error_of;

ModelConfig tiny_config() {
  return ModelConfig::load(std::filesystem::path(M3_CONFIGS_DIR) / "tiny.json");
}

TEST(RandomModel, SameSeedSameBytes) {
  test::ScratchDir a, b, c;
  write_random_model(tiny_config(), 42, DType::BF16, a.path());
  write_random_model(tiny_config(), 42, DType::BF16, b.path());
  write_random_model(tiny_config(), 43, DType::BF16, c.path());
  EXPECT_EQ(test::read_file(a / "model.safetensors"), test::read_file(b / "model.safetensors"));
  EXPECT_EQ(test::read_file(a / "config.json"), test::read_file(b / "config.json"));
  EXPECT_NE(test::read_file(a / "model.safetensors"), test::read_file(c / "model.safetensors"));
}

uint64_t fnv1a(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Random models must be the same files on every machine and standard library (tests and
// benchmarks elsewhere name models by seed). Pinned: the file for tiny.json, seed 1, F32.
// Change it only together with a deliberate change to how values are drawn.
TEST(RandomModel, PinnedBytesForSeedOne) {
  test::ScratchDir a;
  write_random_model(tiny_config(), 1, DType::F32, a.path());
  EXPECT_EQ(fnv1a(test::read_file(a / "model.safetensors")), 8424133127121086647ull);
}

TEST(RandomModel, DTypesHoldTheSameValues) {
  test::ScratchDir f32_dir, bf16_dir, f16_dir;
  write_random_model(tiny_config(), 7, DType::F32, f32_dir.path());
  write_random_model(tiny_config(), 7, DType::BF16, bf16_dir.path());
  write_random_model(tiny_config(), 7, DType::F16, f16_dir.path());
  ModelWeights a = ModelWeights::load(f32_dir.path());
  ModelWeights b = ModelWeights::load(bf16_dir.path());
  ModelWeights h = ModelWeights::load(f16_dir.path());
  for (const auto& name : {"backbone.layers.1.mixer.in_proj.weight", "backbone.layers.0.mixer.dt_bias"}) {
    std::vector<float> x = to_f32(a.tensor(name)), y = to_f32(b.tensor(name)), z = to_f32(h.tensor(name));
    ASSERT_EQ(b.tensor(name).dtype, DType::BF16);
    ASSERT_EQ(h.tensor(name).dtype, DType::F16);
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(y[i], bf16_to_f32(f32_to_bf16(x[i])));
      ASSERT_EQ(z[i], f16_to_f32(f32_to_f16(x[i])));
    }
  }
}

struct Stats {
  double mean = 0, rms = 0, min = 1e30, max = -1e30;
};
Stats stats(const TensorView& t) {
  std::vector<float> v = to_f32(t);
  Stats s;
  for (float x : v) {
    s.mean += x;
    s.rms += double(x) * x;
    s.min = std::min<double>(s.min, x);
    s.max = std::max<double>(s.max, x);
  }
  s.mean /= v.size();
  s.rms = std::sqrt(s.rms / v.size());
  return s;
}

// The ranges the engines rely on for a healthy forward pass.
TEST(RandomModel, ValuesLookTrained) {
  ModelConfig c = tiny_config();
  c.d_intermediate = 256;
  c.ssm.is_outproj_norm = true;
  test::ScratchDir dir;
  write_random_model(c, 11, DType::F32, dir.path());
  ModelWeights w = ModelWeights::load(dir.path());
  for (int i = 0; i < c.n_layer; ++i) {
    for (const char* norm : {"norm.weight", "norm2.weight", "mixer.B_norm.weight", "mixer.C_norm.weight",
                             "mixer.norm.weight", "mixer.D"}) {
      Stats s = stats(w.layer(i, norm));
      EXPECT_NEAR(s.mean, 1.0, 0.1) << norm;
      EXPECT_GT(s.min, 0.5) << norm;
      EXPECT_LT(s.max, 1.5) << norm;
      EXPECT_GT(s.max - s.min, 0.01) << norm << " is constant";
    }
    // dt = softplus(dt_bias) spans about [1e-3, 1e-1].
    for (float b : to_f32(w.layer(i, "mixer.dt_bias"))) {
      double dt = std::log1p(std::exp(double(b)));
      EXPECT_GE(dt, 0.99e-3);
      EXPECT_LE(dt, 1.01e-1);
    }
    Stats in = stats(w.layer(i, "mixer.in_proj.weight"));
    EXPECT_NEAR(in.rms, 1.0 / std::sqrt(c.d_model), 0.2 / std::sqrt(c.d_model));
    EXPECT_NEAR(in.mean, 0.0, 0.01);
    Stats bias = stats(w.layer(i, "mixer.B_bias"));
    EXPECT_LT(bias.rms, 0.3);
    EXPECT_GT(bias.rms, 0.01);
  }
  // Tied: lm_head.weight is stored and equals the embedding, padded rows included.
  const TensorView& emb = w.tensor("backbone.embedding.weight");
  const TensorView& head = w.tensor("lm_head.weight");
  EXPECT_EQ(emb.shape[0], c.padded_vocab());
  ASSERT_EQ(emb.nbytes, head.nbytes);
  EXPECT_EQ(std::memcmp(emb.data, head.data, emb.nbytes), 0);
}

TEST(RandomModel, NoTwoTensorsAreTheSame) {
  test::ScratchDir dir;
  write_random_model(tiny_config(), 3, DType::F32, dir.path());
  ModelWeights w = ModelWeights::load(dir.path());
  std::vector<float> a = to_f32(w.layer(0, "mixer.mimo_x"));
  std::vector<float> b = to_f32(w.layer(0, "mixer.mimo_z"));
  std::vector<float> c = to_f32(w.layer(1, "mixer.mimo_x"));
  EXPECT_NE(a, b);
  EXPECT_NE(a, c);
}

TEST(RandomModel, RefusesNonFloatDTypesAndBadConfigs) {
  test::ScratchDir dir;
  EXPECT_THAT(error_of<std::invalid_argument>([&] { write_random_model(tiny_config(), 1, DType::I32, dir.path()); }),
              HasSubstr("dtype I32"));
  ModelConfig bad = tiny_config();
  bad.ssm.ngroups = 2;
  EXPECT_THAT(error_of([&] { write_random_model(bad, 1, DType::F32, dir.path()); }), HasSubstr("ngroups"));
}

TEST(RandomModel, CreatesNestedDirectories) {
  test::ScratchDir dir;
  write_random_model(tiny_config(), 1, DType::BF16, dir / "a" / "b");
  EXPECT_NO_THROW(ModelWeights::load(dir / "a" / "b"));
}

}  // namespace
}  // namespace m3
