// m3bench prefill as a program on the CPU backend: its table and JSON hold one row per
// (length, batch) with the measured times and ratios; bad flags are usage errors.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "test_models.h"

namespace m3 {
namespace {

struct ToolRun {
  int exit_code = -1;
  std::string out, err;
};

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

ToolRun m3bench(const std::string& args, const testing::ScratchDir& dir) {
  const auto out = dir.path() / "out", err = dir.path() / "err";
  const std::string cmd = std::string("'") + M3BENCH_PATH + "' " + args + " >'" + out.string() + "' 2>'" +
                          err.string() + "'";
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

TEST(BenchPrefill, MeasuresEveryLengthAndBatchOnTheCpu) {
  testing::ScratchDir dir("bench_prefill");
  const auto json = dir.path() / "prefill.json";
  const ToolRun r = m3bench("prefill --config '" + std::string(M3_TINY_CONFIG) +
                                "' --backend cpu --len 3,40 --batch 1,2 --iters 2 --threads 1 --json '" +
                                json.string() + "'",
                            dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("backend cpu"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("vs stepping"), std::string::npos) << r.out;
  const nlohmann::json j = nlohmann::json::parse(slurp(json));
  EXPECT_EQ(j["backend"], "cpu");
  EXPECT_EQ(j["dtype"], "fp32");  // the CPU engine computes in fp32 whatever --dtype says
  EXPECT_GT(j["matrix_flops_per_s"].get<double>(), 0);
  EXPECT_GT(j["copy_bandwidth_bytes_per_s"].get<double>(), 0);
  ASSERT_EQ(j["results"].size(), 4u);
  int i = 0;
  for (int batch : {1, 2}) {
    for (int len : {3, 40}) {
      const auto& row = j["results"][i++];
      EXPECT_EQ(row["len"], len);
      EXPECT_EQ(row["batch"], batch);
      for (const char* key : {"prefill_ms", "first_call_ms", "prompt_tokens_per_s", "decode_step_ms", "ratio_to_stepping",
                              "gemm_flops", "floor_bytes", "floor_ms", "ratio_to_floor"}) {
        EXPECT_GT(row[key].get<double>(), 0) << key << " of row " << i;
      }
      EXPECT_NEAR(row["prompt_tokens_per_s"].get<double>(), len * batch / (row["prefill_ms"].get<double>() * 1e-3),
                  1e-6 * row["prompt_tokens_per_s"].get<double>());
    }
  }
  // The FLOPs grow with the tokens read: 40 tokens do more than 3.
  EXPECT_GT(j["results"][1]["gemm_flops"].get<double>(), 10 * j["results"][0]["gemm_flops"].get<double>());
}

TEST(BenchPrefill, RefusesBadFlags) {
  testing::ScratchDir dir("bench_prefill_flags");
  const std::string config = " --config '" + std::string(M3_TINY_CONFIG) + "'";
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"", "--config is required"},
           {config + " --len 0", "--len: '0' is not an integer in [1, 1048576]"},
           {config + " --len 4,,8", "--len: empty entry in \"4,,8\""},
           {config + " --batch x", "--batch: 'x' is not an integer in [1, 4096]"},
           {config + " --backend tpu", "--backend must be auto, cuda or cpu, got \"tpu\""},
           {config + " --dtype fp16", "--dtype must be bf16 or fp32"},
           {config + " --frobnicate", "unknown argument --frobnicate"}}) {
    const ToolRun r = m3bench("prefill" + args, dir);
    EXPECT_EQ(r.exit_code, 2) << args;
    EXPECT_NE(r.err.find("m3bench prefill: " + message + "\n"), std::string::npos) << args << ": " << r.err;
    EXPECT_NE(r.err.find("usage: m3bench prefill"), std::string::npos) << r.err;
  }
  const ToolRun help = m3bench("prefill --help", dir);
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("usage: m3bench prefill"), std::string::npos);
}

}  // namespace
}  // namespace m3
