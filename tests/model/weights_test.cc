#include "model/weights.h"

#include <cstring>
#include <functional>

#include <nlohmann/json.hpp>

#include "model/random_model.h"
#include "tests/model/test_util.h"

namespace m3 {
namespace {

using json = nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;
using test::error_of;

ModelConfig small_config(bool mlp = false, bool outproj_norm = false, bool tied = true) {
  ModelConfig c;
  c.d_model = 64;
  c.n_layer = 2;
  c.vocab_size = 100;  // padded to 104
  c.d_intermediate = mlp ? 100 : 0;
  c.tie_embeddings = tied;
  c.ssm.is_mimo = true;
  c.ssm.mimo_rank = 2;
  c.ssm.d_state = 16;
  c.ssm.headdim = 16;
  c.ssm.is_outproj_norm = outproj_norm;
  c.validate("test");
  return c;
}

// Rewrites dir/model.safetensors after `edit` changes its tensor list.
void rewrite(const std::filesystem::path& dir, const std::function<void(std::vector<TensorToWrite>&)>& edit) {
  std::vector<TensorToWrite> tensors;
  {
    auto f = SafetensorsFile::open(dir / "model.safetensors");
    tensors = test::copy_tensors(*f);
  }
  edit(tensors);
  write_safetensors(dir / "model.safetensors", tensors);
}

TensorToWrite* find(std::vector<TensorToWrite>& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return &t;
  throw std::runtime_error("test: no tensor " + name);
}

void erase_tensor(std::vector<TensorToWrite>& ts, const std::string& name) {
  std::erase_if(ts, [&](const TensorToWrite& t) { return t.name == name; });
}

TEST(ModelWeights, LoadsGoldenModels) {
  const std::filesystem::path golden = M3_GOLDEN_DIR;
  if (!std::filesystem::exists(golden / "tiny")) GTEST_SKIP() << "golden dir absent: " << golden;
  for (const char* name : {"tiny", "small_norm_mlp"}) {
    SCOPED_TRACE(name);
    ModelWeights w = ModelWeights::load(golden / name);
    const ModelConfig& c = w.config();
    EXPECT_EQ(w.dir(), golden / name);
    EXPECT_EQ(w.lm_head().shape, (std::vector<int64_t>{c.padded_vocab(), c.d_model}));
    for (int i = 0; i < c.n_layer; ++i) {
      EXPECT_EQ(w.layer(i, "mixer.in_proj.weight").shape,
                (std::vector<int64_t>{c.in_proj_rows(), c.d_model}));
      EXPECT_EQ(w.layer(i, "mixer.D").numel(), c.n_heads());
    }
    EXPECT_EQ(w.tensor("backbone.norm_f.weight").dtype, DType::F32);
  }
  EXPECT_TRUE(ModelWeights::load(golden / "small_norm_mlp").config().has_mlp());
}

TEST(ModelWeights, LoadsEveryConfigVariant) {
  for (bool mlp : {false, true})
    for (bool norm : {false, true})
      for (bool tied : {false, true}) {
        SCOPED_TRACE(testing::Message() << "mlp " << mlp << " outproj_norm " << norm << " tied " << tied);
        test::ScratchDir dir;
        write_random_model(small_config(mlp, norm, tied), 1, DType::BF16, dir.path());
        ModelWeights w = ModelWeights::load(dir.path());
        EXPECT_EQ(w.config().has_mlp(), mlp);
        EXPECT_EQ(w.tensor("backbone.layers.1.mixer.B_bias").shape, (std::vector<int64_t>{8, 2, 16}));
        if (mlp) {
          EXPECT_EQ(w.layer(0, "mlp.fc1.weight").shape, (std::vector<int64_t>{256, 64}));
        }
      }
}

TEST(ModelWeights, TiedHeadWithoutStoredCopyUsesTheEmbedding) {
  test::ScratchDir dir;
  write_random_model(small_config(), 3, DType::F32, dir.path());
  rewrite(dir.path(), [](auto& ts) { erase_tensor(ts, "lm_head.weight"); });
  ModelWeights w = ModelWeights::load(dir.path());
  EXPECT_EQ(&w.lm_head(), &w.tensor("backbone.embedding.weight"));
}

TEST(ModelWeights, AcceptsMixedFloatDTypes) {
  test::ScratchDir dir;
  write_random_model(small_config(), 3, DType::F32, dir.path());
  rewrite(dir.path(), [](auto& ts) {
    TensorToWrite* d = find(ts, "backbone.layers.0.mixer.D");
    std::vector<std::byte> half(d->data.size() / 2);
    for (size_t i = 0; i < half.size() / 2; ++i) {
      float v;
      std::memcpy(&v, &d->data[4 * i], 4);
      uint16_t h = f32_to_f16(v);
      std::memcpy(&half[2 * i], &h, 2);
    }
    d->dtype = DType::F16;
    d->data = half;
  });
  EXPECT_EQ(ModelWeights::load(dir.path()).layer(0, "mixer.D").dtype, DType::F16);
}

struct Broken {
  const char* what;
  std::function<void(std::vector<TensorToWrite>&)> edit;
  std::vector<std::string> message_has;
};

TEST(ModelWeights, RefusesWhatTheConfigDoesNotDescribe) {
  const std::vector<Broken> cases = {
      {"missing tensor", [](auto& ts) { erase_tensor(ts, "backbone.layers.1.mixer.D"); },
       {"model.safetensors: tensor backbone.layers.1.mixer.D is missing (config needs shape [8])"}},
      {"wrong shape",
       [](auto& ts) {
         TensorToWrite* t = find(ts, "backbone.layers.1.mixer.D");
         t->shape = {7};
         t->data.resize(7 * 4);
       },
       {"model.safetensors: tensor backbone.layers.1.mixer.D has shape [7], config needs [8]"}},
      {"transposed matrix",
       [](auto& ts) {
         TensorToWrite* t = find(ts, "backbone.layers.0.mixer.out_proj.weight");
         std::swap(t->shape[0], t->shape[1]);
       },
       {"tensor backbone.layers.0.mixer.out_proj.weight has shape [128, 64], config needs [64, 128]"}},
      {"integer dtype",
       [](auto& ts) { find(ts, "backbone.norm_f.weight")->dtype = DType::I32; },
       {"tensor backbone.norm_f.weight has dtype I32, expected F32, BF16 or F16"}},
      {"float64 dtype",
       [](auto& ts) {
         TensorToWrite* t = find(ts, "backbone.norm_f.weight");
         t->dtype = DType::F64;
         t->data.resize(t->data.size() * 2);
       },
       {"tensor backbone.norm_f.weight has dtype F64"}},
      {"surplus layer",
       [](auto& ts) {
         TensorToWrite extra = *find(ts, "backbone.layers.1.norm.weight");
         extra.name = "backbone.layers.2.norm.weight";
         ts.push_back(extra);
       },
       {"model.safetensors: tensors the config does not use: backbone.layers.2.norm.weight"}},
      {"surplus outproj norm",
       [](auto& ts) {
         TensorToWrite extra = *find(ts, "backbone.layers.0.norm.weight");
         extra.name = "backbone.layers.0.mixer.norm.weight";
         ts.push_back(extra);
       },
       {"tensors the config does not use: backbone.layers.0.mixer.norm.weight", "is_outproj_norm"}},
      {"tied head of the wrong shape",
       [](auto& ts) {
         TensorToWrite* t = find(ts, "lm_head.weight");
         t->shape = {100, 64};
         t->data.resize(100 * 64 * 4);
       },
       {"tensor lm_head.weight has shape [100, 64], config needs [104, 64]"}},
      {"tied head that differs",
       [](auto& ts) { find(ts, "lm_head.weight")->data[5] ^= std::byte{1}; },
       {"lm_head.weight differs from backbone.embedding.weight", "tie_embeddings = true"}},
      {"tied head in another dtype",
       [](auto& ts) {  // the head rounded to BF16: the engines would ignore it
         TensorToWrite* t = find(ts, "lm_head.weight");
         std::vector<std::byte> narrow(t->data.size() / 2);
         for (size_t i = 0; i < narrow.size() / 2; ++i) {
           float v;
           std::memcpy(&v, &t->data[4 * i], 4);
           const uint16_t b = f32_to_bf16(v);
           std::memcpy(&narrow[2 * i], &b, 2);
         }
         t->dtype = DType::BF16;
         t->data = narrow;
       },
       {"tensor lm_head.weight is BF16 but backbone.embedding.weight is F32", "tie_embeddings = true"}},
      {"unpadded embedding",
       [](auto& ts) {
         TensorToWrite* t = find(ts, "backbone.embedding.weight");
         t->shape = {100, 64};
         t->data.resize(100 * 64 * 4);
         erase_tensor(ts, "lm_head.weight");
       },
       {"tensor backbone.embedding.weight has shape [100, 64], config needs [104, 64]"}},
  };
  for (const Broken& b : cases) {
    SCOPED_TRACE(b.what);
    test::ScratchDir dir;
    write_random_model(small_config(), 5, DType::F32, dir.path());
    rewrite(dir.path(), b.edit);
    std::string msg = error_of([&] { ModelWeights::load(dir.path()); });
    EXPECT_THAT(msg, HasSubstr((dir / "model.safetensors").string() + ": "));
    for (const std::string& part : b.message_has) EXPECT_THAT(msg, HasSubstr(part));
  }
}

TEST(ModelWeights, UntiedNeedsTheHead) {
  test::ScratchDir dir;
  write_random_model(small_config(false, false, false), 5, DType::BF16, dir.path());
  rewrite(dir.path(), [](auto& ts) { erase_tensor(ts, "lm_head.weight"); });
  EXPECT_THAT(error_of([&] { ModelWeights::load(dir.path()); }),
              HasSubstr("tensor lm_head.weight is missing (config needs shape [104, 64])"));
}

TEST(ModelWeights, ConfigDisagreesWithTensors) {
  test::ScratchDir dir;
  write_random_model(small_config(), 5, DType::BF16, dir.path());
  json j = json::parse(test::read_file(dir / "config.json"));
  j["n_layer"] = 3;
  test::write_file(dir / "config.json", j.dump());
  EXPECT_THAT(error_of([&] { ModelWeights::load(dir.path()); }),
              HasSubstr("tensor backbone.layers.2.norm.weight is missing"));
  j["n_layer"] = 2;
  j["ssm_cfg"]["headdim"] = 32;  // 4 heads instead of 8
  test::write_file(dir / "config.json", j.dump());
  EXPECT_THAT(error_of([&] { ModelWeights::load(dir.path()); }),
              HasSubstr("has shape"));
}

TEST(ModelWeights, MissingConfigOrTensors) {
  test::ScratchDir dir;
  EXPECT_THAT(error_of([&] { ModelWeights::load(dir.path()); }),
              AllOf(HasSubstr("config.json"), HasSubstr("no such file")));
  test::write_file(dir / "config.json", small_config().to_json());
  EXPECT_THAT(error_of([&] { ModelWeights::load(dir.path()); }),
              HasSubstr("no model.safetensors or model.safetensors.index.json"));
}

TEST(ModelWeights, ShardedModel) {
  test::ScratchDir src, dir;
  write_random_model(small_config(true), 9, DType::BF16, src.path());
  auto f = SafetensorsFile::open(src / "model.safetensors");
  std::vector<TensorToWrite> all = test::copy_tensors(*f);
  std::vector<TensorToWrite> one, two;
  json weight_map = json::object();
  for (auto& t : all) {
    bool first = t.name.find("layers.1.") == std::string::npos;
    weight_map[t.name] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    (first ? one : two).push_back(t);
  }
  std::filesystem::copy_file(src / "config.json", dir / "config.json");
  write_safetensors(dir / "model-00001-of-00002.safetensors", one);
  write_safetensors(dir / "model-00002-of-00002.safetensors", two);
  test::write_file(dir / "model.safetensors.index.json", json{{"weight_map", weight_map}}.dump());
  ModelWeights w = ModelWeights::load(dir.path());
  EXPECT_EQ(std::memcmp(w.layer(1, "mlp.fc2.weight").data, f->find("backbone.layers.1.mlp.fc2.weight")->data,
                        w.layer(1, "mlp.fc2.weight").nbytes),
            0);

  // A wrong shape in a shard names that shard; a missing tensor names the index.
  for (auto& t : two)
    if (t.name == "backbone.layers.1.mixer.dt_bias") t.shape = {2, 4};
  write_safetensors(dir / "model-00002-of-00002.safetensors", two);
  EXPECT_THAT(error_of([&] { ModelWeights::load(dir.path()); }),
              HasSubstr("model-00002-of-00002.safetensors: tensor backbone.layers.1.mixer.dt_bias has shape [2, 4], "
                        "config needs [8]"));
  std::erase_if(two, [](const TensorToWrite& t) { return t.name == "backbone.layers.1.mixer.dt_bias"; });
  weight_map.erase("backbone.layers.1.mixer.dt_bias");
  write_safetensors(dir / "model-00002-of-00002.safetensors", two);
  test::write_file(dir / "model.safetensors.index.json", json{{"weight_map", weight_map}}.dump());
  EXPECT_THAT(error_of([&] { ModelWeights::load(dir.path()); }),
              HasSubstr("model.safetensors.index.json: tensor backbone.layers.1.mixer.dt_bias is missing"));
}

TEST(ModelWeights, AccessorsNameWhatIsAbsent) {
  test::ScratchDir dir;
  write_random_model(small_config(), 5, DType::BF16, dir.path());
  ModelWeights w = ModelWeights::load(dir.path());
  EXPECT_EQ(layer_tensor_name(3, "mixer.D"), "backbone.layers.3.mixer.D");
  EXPECT_THAT(error_of([&] { w.layer(0, "mlp.fc1.weight"); }), HasSubstr("no tensor backbone.layers.0.mlp.fc1.weight"));
  EXPECT_THAT(error_of([&] { w.tensor("nope"); }), HasSubstr("no tensor nope"));
}

}  // namespace
}  // namespace m3
