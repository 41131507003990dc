// m3make as a user runs it: exit status and messages.
#include <sys/wait.h>

#include <cstdio>

#include "model/random_model.h"
#include "model/weights.h"
#include "tests/model/test_util.h"

namespace m3 {
namespace {

using ::testing::HasSubstr;

struct ToolRun {
  int status;
  std::string output;
};

ToolRun run_m3make(const std::string& args) {
  std::string cmd = std::string(M3MAKE_PATH) + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("popen failed");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

const std::string kTiny = std::string(M3_CONFIGS_DIR) + "/tiny.json";

TEST(M3make, WritesALoadableModel) {
  test::ScratchDir dir;
  ToolRun r = run_m3make("--config " + kTiny + " --seed 5 --dtype bf16 --out " + (dir / "m").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("wrote"));
  ModelWeights w = ModelWeights::load(dir / "m");
  EXPECT_EQ(w.tensor("backbone.embedding.weight").dtype, DType::BF16);
  EXPECT_EQ(w.config().n_layer, 2);
  // The same as the library call with the same arguments.
  write_random_model(w.config(), 5, DType::BF16, dir / "lib");
  EXPECT_EQ(test::read_file(dir / "m" / "model.safetensors"), test::read_file(dir / "lib" / "model.safetensors"));
}

TEST(M3make, Fp32) {
  test::ScratchDir dir;
  ToolRun r = run_m3make("--out " + dir.path().string() + " --dtype fp32 --seed 0 --config " + kTiny);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(ModelWeights::load(dir.path()).tensor("lm_head.weight").dtype, DType::F32);
}

TEST(M3make, BadArgumentsExitTwoWithUsage) {
  test::ScratchDir dir;
  const std::filesystem::path never_written = dir / "never_written";
  const std::string out = " --out " + never_written.string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "--config is required"},
      {"--config " + kTiny + " --seed 1" + out, "--dtype is required"},
      {"--config " + kTiny + " --dtype bf16" + out, "--seed is required"},
      {"--config " + kTiny + " --seed 1 --dtype bf16", "--out is required"},
      {"--config " + kTiny + " --seed -1 --dtype bf16" + out, "--seed must be a non-negative integer"},
      {"--config " + kTiny + " --seed 12x --dtype bf16" + out, "--seed must be a non-negative integer, got \"12x\""},
      {"--config " + kTiny + " --seed 1 --dtype int8" + out, "--dtype must be bf16, fp32 or fp16, got \"int8\""},
      {"--config " + kTiny + " --seed 1 --dtype bf16 --frobnicate" + out, "unknown argument --frobnicate"},
      {"--config", "--config needs a value"},
  };
  for (const auto& [args, message] : cases) {
    SCOPED_TRACE(args);
    ToolRun r = run_m3make(args);
    EXPECT_EQ(r.status, 2);
    EXPECT_THAT(r.output, HasSubstr(message));
    EXPECT_THAT(r.output, HasSubstr("usage: m3make"));
  }
  EXPECT_FALSE(std::filesystem::exists(never_written));
}

TEST(M3make, BadConfigExitsOne) {
  test::ScratchDir dir;
  test::write_file(dir / "bad.json", R"({"d_model": 64, "n_layer": 1, "vocab_size": 10,
      "ssm_cfg": {"layer": "Mamba3", "is_mimo": true, "ngroups": 2}})");
  ToolRun r = run_m3make("--config " + (dir / "bad.json").string() + " --seed 1 --dtype bf16 --out " +
                     (dir / "m").string());
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("bad.json: ssm_cfg.ngroups = 2 is not supported"));
  r = run_m3make("--config " + (dir / "none.json").string() + " --seed 1 --dtype bf16 --out " + (dir / "m").string());
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("none.json: no such file"));
}

TEST(M3make, Help) {
  ToolRun r = run_m3make("--help");
  EXPECT_EQ(r.status, 0);
  EXPECT_THAT(r.output, HasSubstr("usage: m3make --config FILE --seed S --dtype"));
}

}  // namespace
}  // namespace m3
