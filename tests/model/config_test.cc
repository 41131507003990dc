#include "model/config.h"

#include <functional>

#include <nlohmann/json.hpp>

#include "model/safetensors.h"
#include "tests/model/test_util.h"

namespace m3 {
namespace {

using json = nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;
using test::error_of;

// The golden tiny model's config, written the way mamba-ssm writes it.
json tiny_json() {
  return json::parse(R"({
    "d_model": 128, "d_intermediate": 0, "n_layer": 2, "vocab_size": 512,
    "ssm_cfg": {"layer": "Mamba3", "is_mimo": true, "mimo_rank": 4, "d_state": 32,
                "headdim": 32, "chunk_size": 16, "is_outproj_norm": false, "rope_fraction": 0.5},
    "rms_norm": true, "residual_in_fp32": true, "fused_add_norm": true,
    "pad_vocab_size_multiple": 8, "tie_embeddings": true})");
}

TEST(ConfigParse, ReadsEveryKey) {
  json j = tiny_json();
  j["d_intermediate"] = 300;
  j["pad_vocab_size_multiple"] = 16;
  j["tie_embeddings"] = false;
  j["ssm_cfg"]["mimo_rank"] = 2;
  j["ssm_cfg"]["expand"] = 4;
  j["ssm_cfg"]["rope_fraction"] = 1.0;
  j["ssm_cfg"]["is_outproj_norm"] = true;
  j["ssm_cfg"]["A_floor"] = 0.001;
  ModelConfig c = ModelConfig::parse(j.dump(), "cfg.json");
  EXPECT_EQ(c.d_model, 128);
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.d_intermediate, 300);
  EXPECT_EQ(c.pad_vocab_size_multiple, 16);
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_EQ(c.ssm.layer, "Mamba3");
  EXPECT_TRUE(c.ssm.is_mimo);
  EXPECT_EQ(c.ssm.mimo_rank, 2);
  EXPECT_EQ(c.ssm.d_state, 32);
  EXPECT_EQ(c.ssm.headdim, 32);
  EXPECT_EQ(c.ssm.expand, 4);
  EXPECT_EQ(c.ssm.rope_fraction, 1.0);
  EXPECT_TRUE(c.ssm.is_outproj_norm);
  EXPECT_DOUBLE_EQ(c.ssm.A_floor, 0.001);
}

TEST(ConfigParse, DefaultsFollowMambaConfig) {
  ModelConfig c = ModelConfig::parse(
      R"({"d_model": 64, "n_layer": 1, "vocab_size": 100, "ssm_cfg": {"layer": "Mamba3", "is_mimo": true}})",
      "min.json");
  EXPECT_EQ(c.d_intermediate, 0);
  EXPECT_EQ(c.pad_vocab_size_multiple, 8);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_TRUE(c.rms_norm);
  EXPECT_TRUE(c.residual_in_fp32);
  EXPECT_TRUE(c.fused_add_norm);
  EXPECT_TRUE(c.attn_layer_idx.empty());
  EXPECT_EQ(c.ssm.mimo_rank, 4);
  EXPECT_EQ(c.ssm.d_state, 128);
  EXPECT_EQ(c.ssm.headdim, 64);
  EXPECT_EQ(c.ssm.expand, 2);
  EXPECT_EQ(c.ssm.ngroups, 1);
  EXPECT_EQ(c.ssm.rope_fraction, 0.5);
  EXPECT_FALSE(c.ssm.is_outproj_norm);
  EXPECT_DOUBLE_EQ(c.ssm.A_floor, 1e-4);
  EXPECT_EQ(c.padded_vocab(), 104);
}

TEST(ConfigParse, IgnoresTrainingOnlyKeys) {
  json j = tiny_json();
  j["ssm_cfg"]["dt_min"] = 0.001;
  j["ssm_cfg"]["dt_max"] = 0.1;
  j["ssm_cfg"]["chunk_size"] = 64;
  j["initializer_cfg"] = {{"rescale_prenorm_residual", true}};
  j["attn_cfg"] = json::object();
  j["attn_layer_idx"] = json::array();
  EXPECT_NO_THROW(ModelConfig::parse(j.dump(), "cfg.json"));
}

TEST(ConfigParse, AcceptsIntegralFloats) {
  json j = tiny_json();
  j["ssm_cfg"]["expand"] = 2.0;
  EXPECT_EQ(ModelConfig::parse(j.dump(), "cfg.json").ssm.expand, 2);
}

struct Rejection {
  const char* what;
  std::function<void(json&)> mutate;
  std::vector<std::string> message_has;
};

TEST(ConfigParse, RejectsWhatTheEnginesCannotRun) {
  const std::vector<Rejection> cases = {
      {"no d_model", [](json& j) { j.erase("d_model"); }, {"missing required key d_model"}},
      {"no n_layer", [](json& j) { j.erase("n_layer"); }, {"missing required key n_layer"}},
      {"no vocab_size", [](json& j) { j.erase("vocab_size"); }, {"missing required key vocab_size"}},
      {"string size", [](json& j) { j["d_model"] = "128"; }, {"d_model must be an integer", "\"128\""}},
      {"fractional size", [](json& j) { j["n_layer"] = 1.5; }, {"n_layer must be an integer", "1.5"}},
      {"huge size", [](json& j) { j["vocab_size"] = 1LL << 40; }, {"vocab_size = 1099511627776 is too large"}},
      {"huge negative size", [](json& j) { j["d_model"] = -(1LL << 40); }, {"d_model = -1099511627776 is out of range"}},
      {"zero d_model", [](json& j) { j["d_model"] = 0; }, {"d_model must be positive, got 0"}},
      {"negative n_layer", [](json& j) { j["n_layer"] = -2; }, {"n_layer must be positive, got -2"}},
      {"zero vocab", [](json& j) { j["vocab_size"] = 0; }, {"vocab_size must be positive"}},
      {"zero pad multiple", [](json& j) { j["pad_vocab_size_multiple"] = 0; },
       {"pad_vocab_size_multiple must be positive"}},
      {"negative d_intermediate", [](json& j) { j["d_intermediate"] = -1; }, {"d_intermediate must be >= 0"}},
      {"bool as string", [](json& j) { j["tie_embeddings"] = "yes"; }, {"tie_embeddings must be true or false"}},
      {"attention layers", [](json& j) { j["attn_layer_idx"] = {1, 3}; },
       {"attention layers are not supported: attn_layer_idx = [1, 3]"}},
      {"attn_layer_idx not a list", [](json& j) { j["attn_layer_idx"] = "1"; }, {"attn_layer_idx must be a list"}},
      {"no ssm_cfg", [](json& j) { j.erase("ssm_cfg"); }, {"missing ssm_cfg", "Mamba3"}},
      {"ssm_cfg not an object", [](json& j) { j["ssm_cfg"] = 3; }, {"ssm_cfg must be an object"}},
      {"no layer", [](json& j) { j["ssm_cfg"].erase("layer"); }, {"missing required key ssm_cfg.layer"}},
      {"Mamba2", [](json& j) { j["ssm_cfg"]["layer"] = "Mamba2"; }, {"ssm_cfg.layer = \"Mamba2\" is not supported"}},
      {"SISO", [](json& j) { j["ssm_cfg"]["is_mimo"] = false; }, {"is_mimo = false", "SISO", "not supported"}},
      {"SISO by default", [](json& j) { j["ssm_cfg"].erase("is_mimo"); }, {"SISO"}},
      {"rank 0", [](json& j) { j["ssm_cfg"]["mimo_rank"] = 0; }, {"ssm_cfg.mimo_rank must be >= 1, got 0"}},
      {"ngroups 2", [](json& j) { j["ssm_cfg"]["ngroups"] = 2; }, {"ssm_cfg.ngroups = 2 is not supported"}},
      {"rope 0.25", [](json& j) { j["ssm_cfg"]["rope_fraction"] = 0.25; },
       {"ssm_cfg.rope_fraction = 0.25 is not supported"}},
      {"rope as string", [](json& j) { j["ssm_cfg"]["rope_fraction"] = "half"; },
       {"ssm_cfg.rope_fraction must be a number"}},
      {"headdim not dividing", [](json& j) { j["ssm_cfg"]["headdim"] = 48; },
       {"d_inner = expand * d_model = 256 is not divisible by ssm_cfg.headdim = 48"}},
      {"odd d_state", [](json& j) { j["ssm_cfg"]["d_state"] = 31; }, {"ssm_cfg.d_state = 31 must be even"}},
      {"zero d_state", [](json& j) { j["ssm_cfg"]["d_state"] = 0; }, {"ssm_cfg.d_state must be positive"}},
      {"zero headdim", [](json& j) { j["ssm_cfg"]["headdim"] = 0; }, {"ssm_cfg.headdim must be positive"}},
      {"negative expand", [](json& j) { j["ssm_cfg"]["expand"] = -2; }, {"ssm_cfg.expand must be positive"}},
      {"LayerNorm", [](json& j) { j["rms_norm"] = false; }, {"rms_norm = false", "not supported"}},
      {"negative A_floor", [](json& j) { j["ssm_cfg"]["A_floor"] = -1; }, {"ssm_cfg.A_floor = -1"}},
      {"overflowing sizes", [](json& j) { j["d_model"] = 1 << 30; j["ssm_cfg"]["expand"] = 4; }, {"too large"}},
      {"absurd n_layer", [](json& j) { j["n_layer"] = 2000000000; },
       {"n_layer = 2000000000 is over the supported 1024"}},
      {"a terabyte-sized state", [](json& j) { j["ssm_cfg"]["d_state"] = 1 << 20; j["n_layer"] = 16; },
       {"the recurrent state of one sequence would need 18", "over the supported 16 GiB"}},
      {"residual in the weights' dtype", [](json& j) { j["residual_in_fp32"] = false; },
       {"residual_in_fp32 = false is not supported"}},
      {"long value quoted briefly", [](json& j) { j["d_model"] = std::string(100000, 'x'); },
       {"d_model must be an integer, got string \"xxxx", "..."}},
      {"not an object", [](json& j) { j = json::array({1, 2}); }, {"config must be a JSON object"}},
  };
  for (const Rejection& r : cases) {
    SCOPED_TRACE(r.what);
    json j = tiny_json();
    r.mutate(j);
    std::string msg = error_of([&] { ModelConfig::parse(j.dump(), "models/x/config.json"); });
    EXPECT_THAT(msg, HasSubstr("models/x/config.json: "));
    for (const std::string& part : r.message_has) EXPECT_THAT(msg, HasSubstr(part));
  }
}

TEST(ConfigParse, RejectsInvalidJson) {
  EXPECT_THAT(error_of([] { ModelConfig::parse("{\"d_model\": 12,", "broken.json"); }),
              AllOf(HasSubstr("broken.json: not valid JSON"), HasSubstr("parse error")));
  EXPECT_THAT(error_of([] { ModelConfig::parse("", "empty.json"); }), HasSubstr("empty.json: not valid JSON"));
}

TEST(ConfigParse, RefusesDeepNestingBeforeAnythingRecursesOverIt) {
  // Printing a value a million levels deep in an error message overflowed the stack.
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  json j = tiny_json();
  j["d_model"] = 0;  // placeholder replaced by the nested list below
  std::string text = j.dump();
  text.replace(text.find("\"d_model\":0"), 11, "\"d_model\":" + deep);
  EXPECT_THAT(error_of([&] { ModelConfig::parse(text, "deep.json"); }),
              HasSubstr("deep.json: nests JSON deeper than 64 levels"));
}

TEST(ConfigDerived, PaddedVocabNearTheIntLimit) {
  // vocab_size + multiple - 1 passes INT_MAX; the padded size itself does not.
  json j = tiny_json();
  j["vocab_size"] = 1000000000;
  j["pad_vocab_size_multiple"] = 1500000000;
  EXPECT_EQ(ModelConfig::parse(j.dump(), "big-vocab").padded_vocab(), 1500000000);
}

TEST(ConfigLoad, RefusesWhatIsNotASmallRegularFile) {
  test::ScratchDir dir;
  std::filesystem::create_directory(dir / "config.json");
  EXPECT_THAT(error_of([&] { ModelConfig::load(dir / "config.json"); }),
              HasSubstr((dir / "config.json").string() + ": not a regular file"));
  test::write_file(dir / "big.json", std::string((1 << 20) + 1, ' '));
  EXPECT_THAT(error_of([&] { ModelConfig::load(dir / "big.json"); }),
              HasSubstr((dir / "big.json").string() + ": is 1048577 bytes, over the 1048576-byte limit"));
}

TEST(ConfigLoad, NamesTheMissingFile) {
  test::ScratchDir dir;
  EXPECT_THAT(error_of([&] { ModelConfig::load(dir / "config.json"); }),
              AllOf(HasSubstr((dir / "config.json").string()), HasSubstr("no such file")));
}

TEST(ConfigLoad, ErrorsNameTheFile) {
  test::ScratchDir dir;
  json j = tiny_json();
  j["ssm_cfg"]["ngroups"] = 4;
  test::write_file(dir / "config.json", j.dump());
  EXPECT_THAT(error_of([&] { ModelConfig::load(dir / "config.json"); }),
              AllOf(HasSubstr((dir / "config.json").string() + ": "), HasSubstr("ngroups = 4")));
}

TEST(ConfigDerived, Sizes) {
  ModelConfig c = ModelConfig::parse(tiny_json().dump(), "tiny");
  // d_inner 2*128; H = 256/32; split = int(32*0.5) = 16 -> S = 8.
  EXPECT_EQ(c.d_inner(), 256);
  EXPECT_EQ(c.n_heads(), 8);
  EXPECT_EQ(c.rope_split(), 16);
  EXPECT_EQ(c.n_angles(), 8);
  EXPECT_EQ(c.bc_width(), 4 * 32);
  EXPECT_EQ(c.in_proj_rows(), 2 * 256 + 2 * 128 + 3 * 8 + 8);
  EXPECT_EQ(c.padded_vocab(), 512);
  EXPECT_FALSE(c.has_mlp());
  EXPECT_EQ(c.mlp_width(), 0);
  EXPECT_EQ(c.state_floats_per_layer(), 8 * 8 + 8 * 32 * 32 + 4 * 8 * 32 + 8 * 32);

  ModelConfig::InProjLayout l = c.in_proj_layout();
  EXPECT_EQ(l.z, 0);
  EXPECT_EQ(l.x, 256);
  EXPECT_EQ(l.B, 512);
  EXPECT_EQ(l.C, 640);
  EXPECT_EQ(l.dd_dt, 768);
  EXPECT_EQ(l.dd_A, 776);
  EXPECT_EQ(l.trap, 784);
  EXPECT_EQ(l.ang, 792);
  EXPECT_EQ(l.total, c.in_proj_rows());
}

TEST(ConfigDerived, RopeSplitRoundsDownToEven) {
  json j = tiny_json();
  j["ssm_cfg"]["d_state"] = 6;  // int(6 * 0.5) = 3 -> 2
  ModelConfig c = ModelConfig::parse(j.dump(), "c");
  EXPECT_EQ(c.rope_split(), 2);
  EXPECT_EQ(c.n_angles(), 1);
  j["ssm_cfg"]["rope_fraction"] = 1.0;
  c = ModelConfig::parse(j.dump(), "c");
  EXPECT_EQ(c.rope_split(), 6);
  EXPECT_EQ(c.n_angles(), 3);
}

TEST(ConfigDerived, PaddedVocabAndMlpWidth) {
  json j = tiny_json();
  j["vocab_size"] = 1001;
  j["d_intermediate"] = 300;
  ModelConfig c = ModelConfig::parse(j.dump(), "c");
  EXPECT_EQ(c.padded_vocab(), 1008);
  EXPECT_TRUE(c.has_mlp());
  EXPECT_EQ(c.mlp_width(), 384);
  j["d_intermediate"] = 256;
  EXPECT_EQ(ModelConfig::parse(j.dump(), "c").mlp_width(), 256);
}

TEST(ConfigJson, RoundTrips) {
  json j = tiny_json();
  j["d_intermediate"] = 200;
  j["tie_embeddings"] = false;
  j["pad_vocab_size_multiple"] = 64;
  j["ssm_cfg"]["rope_fraction"] = 1.0;
  j["ssm_cfg"]["is_outproj_norm"] = true;
  j["ssm_cfg"]["A_floor"] = 3e-5;
  j["ssm_cfg"]["mimo_rank"] = 2;
  ModelConfig a = ModelConfig::parse(j.dump(), "a");
  ModelConfig b = ModelConfig::parse(a.to_json(), "b");
  EXPECT_EQ(a.to_json(), b.to_json());
  EXPECT_EQ(b.d_intermediate, 200);
  EXPECT_FALSE(b.tie_embeddings);
  EXPECT_EQ(b.pad_vocab_size_multiple, 64);
  EXPECT_EQ(b.ssm.rope_fraction, 1.0);
  EXPECT_TRUE(b.ssm.is_outproj_norm);
  EXPECT_EQ(b.ssm.A_floor, 3e-5);
  EXPECT_EQ(b.ssm.mimo_rank, 2);
  // The mamba-ssm layout: ssm_cfg nested, the same top-level keys.
  json out = json::parse(a.to_json());
  for (const char* key : {"d_model", "n_layer", "vocab_size", "d_intermediate", "ssm_cfg", "rms_norm",
                          "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings"})
    EXPECT_TRUE(out.contains(key)) << key;
  EXPECT_EQ(out["ssm_cfg"]["layer"], "Mamba3");
}

// parameter_count() must equal the element count of a real checkpoint.
TEST(ConfigDerived, ParameterCountMatchesGoldenCheckpoints) {
  const std::filesystem::path golden = M3_GOLDEN_DIR;
  if (!std::filesystem::exists(golden / "tiny")) GTEST_SKIP() << "golden dir absent: " << golden;
  for (const char* name : {"tiny", "small_norm_mlp"}) {
    SCOPED_TRACE(name);
    ModelConfig c = ModelConfig::load(golden / name / "config.json");
    auto f = SafetensorsFile::open(golden / name / "model.safetensors");
    int64_t total = 0;
    for (const auto& [tname, view] : f->tensors()) {
      if (tname == "lm_head.weight" && c.tie_embeddings) continue;
      total += view.numel();
    }
    EXPECT_EQ(c.parameter_count(), total);
    EXPECT_EQ(f->find("backbone.layers.0.mixer.in_proj.weight")->shape[0], c.in_proj_rows());
  }
}

TEST(ConfigFiles, ShippedModelConfigs) {
  const std::filesystem::path dir = M3_CONFIGS_DIR;
  ModelConfig tiny = ModelConfig::load(dir / "tiny.json");
  EXPECT_EQ(tiny.n_layer, 2);
  ModelConfig s2s = ModelConfig::load(dir / "s2s-14l.json");
  EXPECT_EQ(s2s.n_layer, 14);
  EXPECT_EQ(s2s.d_model, 896);
  EXPECT_EQ(s2s.ssm.d_state, 128);
  EXPECT_EQ(s2s.ssm.headdim, 64);
  EXPECT_EQ(s2s.ssm.mimo_rank, 4);
  EXPECT_EQ(s2s.ssm.expand, 2);
  EXPECT_EQ(s2s.vocab_size, 4096);
  EXPECT_EQ(s2s.d_intermediate, 0);
  EXPECT_TRUE(s2s.tie_embeddings);
  EXPECT_EQ(s2s.ssm.rope_fraction, 0.5);
  EXPECT_FALSE(s2s.ssm.is_outproj_norm);
  EXPECT_EQ(s2s.n_heads(), 28);
  // The doc's "about 86 M parameters".
  EXPECT_NEAR(static_cast<double>(s2s.parameter_count()), 86e6, 1e6);
}

}  // namespace
}  // namespace m3
