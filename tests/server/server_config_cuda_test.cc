// The `cuda:` section of configs/server.yaml and its --cuda-... flags: the shipped file
// states the policy's defaults, every key reaches its field, and bad keys and values are
// refused naming them.
#include <gtest/gtest.h>

#include "server/server_config.h"
#include "tests/error_of.h"

namespace m3 {
namespace {

// The policy a `cuda:` section (its lines, indented under it) sets, validated; refusals
// are std::invalid_argument.
CudaPolicy policy_of(const std::string& section) {
  ServerConfig c = parse_server_config_yaml("cuda:\n" + section, "server.yaml");
  c.validate();
  return c.cuda;
}

std::string refusal_of(const std::string& section) {
  return test::error_of<std::invalid_argument>([&] { policy_of(section); });
}

TEST(ServerConfigCudaTest, TheShippedFileSaysTheDefaults) {
  const ServerConfig c = load_server_config_file(M3_TEST_SERVER_YAML);
  EXPECT_EQ(to_string(c.cuda), to_string(CudaPolicy{}));
}

TEST(ServerConfigCudaTest, NestedKeysReachTheirFields) {
  const CudaPolicy p = policy_of(
      "  pdl: false\n"
      "  chains: 2\n"
      "  step_variants:\n"
      "    out_proj_fused: off\n"
      "    batch2_gemv: cuda_cores\n"
      "    fused_cluster: 4\n"
      "  gemv:\n"
      "    trigger: after_wait\n"
      "    row_block_cluster: 8\n"
      "    row_block_min_batch: never\n"
      "  recurrence:\n"
      "    state_load: plain\n"
      "    trigger: after_norms\n"
      "    tc_column_split: planned\n");
  EXPECT_FALSE(p.pdl);
  EXPECT_EQ(p.chains, 2);
  EXPECT_EQ(p.step_variants.out_proj_fused, Tuned::Off);
  EXPECT_EQ(p.step_variants.batch2_gemv, Batch2Gemv::CudaCores);
  EXPECT_EQ(p.step_variants.fused_cluster, 4);
  EXPECT_EQ(p.gemv.trigger, kernels::PdlTrigger::AfterWait);
  EXPECT_EQ(p.gemv.row_block_cluster, 8);
  EXPECT_EQ(p.gemv.row_block_min_batch, 0);
  EXPECT_EQ(p.recurrence.state_load, kernels::StateLoad::Plain);
  EXPECT_EQ(p.recurrence.trigger, kernels::RecurrenceTrigger::AfterNorms);
  EXPECT_EQ(p.recurrence.tc_column_split, 0);
  EXPECT_TRUE(p.next_step_prefetch);  // untouched keys keep their defaults
}

TEST(ServerConfigCudaTest, FlagsAreTheKeyPathsJoinedWithDashes) {
  const CommandLine cmd = parse_command_line({"--cuda-pdl", "false", "--cuda-gemv-row-block-batch-tile=32",
                                              "--cuda-step-variants-batch1-gemv-rows-per-warp", "4",
                                              "--cuda-graphs", "false"},
                                             "");
  EXPECT_FALSE(cmd.config.cuda.pdl);
  EXPECT_EQ(cmd.config.cuda.gemv.row_block_batch_tile, 32);
  EXPECT_EQ(cmd.config.cuda.step_variants.batch1_gemv_rows_per_warp, 4);
  EXPECT_FALSE(cmd.config.cuda_graphs);  // the top-level setting, not a policy key
  EXPECT_NE(command_line_help().find("--cuda-recurrence-state-load"), std::string::npos);
}

TEST(ServerConfigCudaTest, BadKeysAndValuesAreRefusedNamingThem) {
  EXPECT_EQ(refusal_of("  gemv:\n    rows: 2\n").substr(0, 45), "server.yaml: unknown key 'cuda.gemv.rows' (kn");
  EXPECT_EQ(refusal_of("  pdl: maybe\n"), "server.yaml: key 'cuda.pdl': expected true or false, got 'maybe'");
  EXPECT_EQ(refusal_of("  recurrence:\n    state_load: fast\n"),
            "server.yaml: key 'cuda.recurrence.state_load': expected planned, plain or streamed, got 'fast'");
  EXPECT_EQ(refusal_of("  chains: 7\n"), "cuda.chains must be 0 (planned) or 1 to 4, got 7");
  EXPECT_EQ(refusal_of("  gemv:\n    row_block_cluster: 3\n"),
            "cuda.gemv.row_block_cluster must be 0 (planned), 2, 4 or 8, got 3");
  EXPECT_EQ(refusal_of("  gemv:\n    batch1_rows_per_warp: 1\n"), "cuda.gemv.batch1_rows_per_warp must be 2 or 4, got 1");
  EXPECT_EQ(test::error_of<std::invalid_argument>([] { parse_server_config_yaml("cuda: 3\n", "server.yaml"); }),
            "server.yaml: key 'cuda': expected a mapping of settings");
  EXPECT_EQ(test::error_of<std::invalid_argument>([] { parse_command_line({"--cuda-chains", "two"}, ""); }),
            "--cuda-chains: expected an integer or planned, got 'two'");
  EXPECT_EQ(test::error_of<std::invalid_argument>([] { parse_command_line({"--cuda-gemv-rows", "2"}, ""); }),
            "unknown flag '--cuda-gemv-rows' (see --help)");
}

}  // namespace
}  // namespace m3
