// configs/server.yaml and the flags: every bad setting is refused with a message that
// names it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "server/server_config.h"
#include "tests/server/config_test_support.h"

namespace m3 {
namespace {

template <typename F>
std::string error_of(F&& f) {
  return test::config_error_of(f);
}
using test::from_yaml;

TEST(ServerConfigTest, ReadsEveryKindOfValue) {
  ServerConfig c = from_yaml(
      "listen: 127.0.0.1:6000\nbackend: cpu\nmax_batch: 3\nshutdown_grace_s: 2.5\n"
      "cuda_graphs: false\nmetrics_listen: \"\"\ndeterministic: true\npipelined_steps: false\n");
  EXPECT_EQ(c.listen, "127.0.0.1:6000");
  EXPECT_TRUE(c.deterministic);
  EXPECT_FALSE(c.pipelined_steps);
  EXPECT_EQ(c.backend, "cpu");
  EXPECT_EQ(c.max_batch, 3);
  EXPECT_EQ(c.shutdown_grace_s, 2.5);
  EXPECT_FALSE(c.cuda_graphs);
  EXPECT_EQ(c.metrics_listen, "");
  EXPECT_EQ(c.queue_capacity, ServerConfig{}.queue_capacity);  // untouched keys keep defaults
}

TEST(ServerConfigTest, TheShippedFileIsValid) {
  ServerConfig c = load_server_config_file(M3_TEST_SERVER_YAML);
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.model, "");
}

TEST(ServerConfigTest, BadFilesAreRefusedWithTheirReason) {
  EXPECT_EQ(error_of([] { from_yaml("max_bach: 4\n"); }).substr(0, 36),
            "server.yaml: unknown key 'max_bach' ");
  EXPECT_EQ(error_of([] { from_yaml("max_batch: eight\n"); }),
            "server.yaml: key 'max_batch': expected auto or a positive integer, got 'eight'");
  EXPECT_EQ(error_of([] { from_yaml("max_batch: 4.5\n"); }),
            "server.yaml: key 'max_batch': expected auto or a positive integer, got '4.5'");
  EXPECT_EQ(error_of([] { from_yaml("cuda_graphs: maybe\n"); }),
            "server.yaml: key 'cuda_graphs': expected true or false, got 'maybe'");
  EXPECT_EQ(error_of([] { from_yaml("shutdown_grace_s: soon\n"); }),
            "server.yaml: key 'shutdown_grace_s': expected a number, got 'soon'");
  EXPECT_EQ(error_of([] { from_yaml("max_batch: [1, 2]\n"); }),
            "server.yaml: key 'max_batch': expected a single value, got a list or mapping");
  EXPECT_EQ(error_of([] { from_yaml("- a\n- b\n"); }),
            "server.yaml: expected a mapping of settings at the top level");
  EXPECT_EQ(error_of([] { from_yaml("max_batch: [\n"); }).substr(0, 31),
            "server.yaml: not valid YAML: ya");
  EXPECT_EQ(error_of([] { load_server_config_file("/nonexistent/server.yaml"); }),
            "/nonexistent/server.yaml: cannot open the config file");
}

// Files yaml-cpp reads without complaint that would not do what they say: each refusal
// names the file, and the key where there is one.
TEST(ServerConfigTest, AmbiguousFilesAreRefused) {
  EXPECT_EQ(error_of([] { from_yaml("max_batch: 5000\nmax_batch: 8\n"); }),
            "server.yaml: key 'max_batch' is given twice (lines 1 and 2); give each setting once");
  EXPECT_EQ(error_of([] { from_yaml("backend: cpu\nmax_batch: 3\n---\nmax_batch: 4\n"); }),
            "server.yaml: holds 2 YAML documents (separated by '---'); a config file is one "
            "mapping of settings");
  EXPECT_EQ(error_of([] { from_yaml("max_batch: 3\n---\n"); }).substr(0, 35),
            "server.yaml: holds 2 YAML documents");
  // Up to the list of known keys.
  const auto named = [](const std::string& e) { return e.substr(0, e.find(" (known: ")); };
  EXPECT_EQ(named(error_of([] { from_yaml("max_batch: 3\n[a, b]: 1\n"); })),
            "server.yaml: line 2: key [a, b] is a list or mapping; keys are setting names");
  EXPECT_EQ(named(error_of([] { from_yaml("{x: 1}: 2\n"); })),
            "server.yaml: line 1: key {x: 1} is a list or mapping; keys are setting names");
  // One document, with or without its "---", and an empty file are fine.
  EXPECT_EQ(from_yaml("---\nmax_batch: 3\n").max_batch, 3);
  EXPECT_EQ(from_yaml("# nothing set\n").max_batch, ServerConfig{}.max_batch);
}

TEST(ServerConfigTest, OutOfRangeValuesAreRefused) {
  EXPECT_EQ(error_of([] { from_yaml("max_batch: 0\n"); }),
            "server.yaml: key 'max_batch': expected auto or a positive integer, got '0'");
  EXPECT_EQ(error_of([] { from_yaml("max_batch: 4097\n"); }),
            "max_batch must be auto or between 1 and 4096, got 4097");
  EXPECT_EQ(from_yaml("max_batch: 4096\n").max_batch, 4096);
  EXPECT_EQ(error_of([] { from_yaml("state_dtype: fp16\n"); }),
            "state_dtype must be one of fp32, bf16, got 'fp16'");
  EXPECT_EQ(error_of([] { from_yaml("queue_capacity: -1\n"); }),
            "queue_capacity must be between 0 and 1000000, got -1");
  EXPECT_EQ(error_of([] { from_yaml("max_new_tokens_limit: 0\n"); }),
            "max_new_tokens_limit must be between 1 and 16777216, got 0");
  EXPECT_EQ(error_of([] { from_yaml("stream_buffer_tokens: 0\n"); }),
            "stream_buffer_tokens must be between 1 and 65536, got 0");
  EXPECT_EQ(error_of([] { from_yaml("stream_buffer_tokens: 65537\n"); }),
            "stream_buffer_tokens must be between 1 and 65536, got 65537");
  EXPECT_EQ(error_of([] { from_yaml("backend: gpu\n"); }),
            "backend must be one of auto, cuda, cpu, got 'gpu'");
  EXPECT_EQ(error_of([] { from_yaml("weight_dtype: fp16\n"); }),
            "weight_dtype must be one of bf16, fp32, got 'fp16'");
  EXPECT_EQ(error_of([] { from_yaml("log_level: loud\n"); }),
            "log_level must be one of trace, debug, info, warn, error, off, got 'loud'");
  EXPECT_EQ(error_of([] { from_yaml("listen: localhost\n"); }),
            "listen must be host:port (port 0..65535), got 'localhost'");
  EXPECT_EQ(error_of([] { from_yaml("metrics_listen: \":99999\"\n"); }),
            "metrics_listen must be host:port (port 0..65535), got ':99999'");
  EXPECT_EQ(error_of([] { from_yaml("shutdown_grace_s: -1\n"); }),
            "shutdown_grace_s must be between 0 and 3600 seconds, got -1.000000");
  EXPECT_EQ(error_of([] { from_yaml("session_idle_timeout_s: -5\n"); }),
            "session_idle_timeout_s must be 0 (never) or between 0.001 and 86400 seconds, got -5.000000");
  EXPECT_EQ(error_of([] { from_yaml("stalled_stream_timeout_s: 0.05\n"); }),
            "stalled_stream_timeout_s must be between 0.1 and 3600 seconds, got 0.050000");
  EXPECT_EQ(from_yaml("stalled_stream_timeout_s: 0.5\n").stalled_stream_timeout_s, 0.5);
  EXPECT_EQ(error_of([] { from_yaml("session_idle_timeout_s: 1e-10\n"); }),  // would round to "never"
            "session_idle_timeout_s must be 0 (never) or between 0.001 and 86400 seconds, got 0.000000");
  EXPECT_EQ(from_yaml("session_idle_timeout_s: 0\n").session_idle_timeout_s, 0.0);  // never
  EXPECT_EQ(error_of([] { from_yaml("model: /nonexistent/model\n"); }),
            "model: '/nonexistent/model' is not a directory");
  EXPECT_EQ(error_of([] { from_yaml("tokenizer: /nonexistent/tok.model\n"); }),
            "tokenizer: '/nonexistent/tok.model' is not a file");
}

TEST(ServerConfigTest, PrefillChunkTokens) {
  EXPECT_EQ(ServerConfig{}.prefill_chunk_tokens, ServerConfig::kAutoPrefillChunkTokens);
  EXPECT_EQ(load_server_config_file(M3_TEST_SERVER_YAML).prefill_chunk_tokens,
            ServerConfig::kAutoPrefillChunkTokens);  // documented there
  EXPECT_EQ(from_yaml("prefill_chunk_tokens: auto\n").prefill_chunk_tokens, ServerConfig::kAutoPrefillChunkTokens);
  EXPECT_EQ(resolve_prefill_chunk_tokens(ServerConfig::kAutoPrefillChunkTokens, /*cuda=*/true), 2048);
  EXPECT_EQ(resolve_prefill_chunk_tokens(ServerConfig::kAutoPrefillChunkTokens, /*cuda=*/false), 512);
  EXPECT_EQ(resolve_prefill_chunk_tokens(64, /*cuda=*/true), 64);  // a number stays as written
  EXPECT_EQ(resolve_prefill_chunk_tokens(0, /*cuda=*/true), 0);
  EXPECT_EQ(from_yaml("prefill_chunk_tokens: 0\n").prefill_chunk_tokens, 0);  // one step per token
  EXPECT_EQ(parse_command_line({"--prefill-chunk-tokens", "64"}, "").config.prefill_chunk_tokens, 64);
  EXPECT_EQ(error_of([] { from_yaml("prefill_chunk_tokens: -1\n"); }),
            "server.yaml: key 'prefill_chunk_tokens': expected auto or an integer >= 0, got '-1'");
  EXPECT_EQ(error_of([] { parse_command_line({"--prefill-chunk-tokens", "65537"}, ""); }),
            "prefill_chunk_tokens must be between 0 and 65536, got 65537");
}

TEST(ServerConfigTest, PrefillAloneTokens) {
  EXPECT_EQ(ServerConfig{}.prefill_alone_tokens, 2048);
  EXPECT_EQ(load_server_config_file(M3_TEST_SERVER_YAML).prefill_alone_tokens, 2048);  // documented there
  EXPECT_EQ(parse_command_line({"--prefill-alone-tokens", "8192"}, "").config.prefill_alone_tokens, 8192);
  // Below prefill_chunk_tokens it is simply the smaller of the two (the larger applies).
  EXPECT_EQ(from_yaml("prefill_chunk_tokens: 4096\n").prefill_alone_tokens, 2048);
  EXPECT_EQ(error_of([] { from_yaml("prefill_alone_tokens: 0\n"); }),
            "prefill_alone_tokens must be between 1 and 65536, got 0");
}

TEST(ServerConfigTest, PrefillMinTokens) {
  EXPECT_EQ(ServerConfig{}.prefill_min_tokens, 32);
  EXPECT_EQ(load_server_config_file(M3_TEST_SERVER_YAML).prefill_min_tokens, 32);  // documented there
  EXPECT_EQ(from_yaml("prefill_min_tokens: 1\n").prefill_min_tokens, 1);  // all input by prefill
  EXPECT_EQ(parse_command_line({"--prefill-min-tokens", "128"}, "").config.prefill_min_tokens, 128);
  EXPECT_EQ(error_of([] { from_yaml("prefill_min_tokens: 0\n"); }),
            "prefill_min_tokens must be between 1 and 65536, got 0");
}

// max_batch auto (the default) is kept as 0 and resolved by the server once the engine's
// backend is known; state_dtype fp32 is the default.
TEST(ServerConfigTest, MaxBatchAutoAndStateDtype) {
  EXPECT_EQ(ServerConfig{}.max_batch, 0);
  EXPECT_EQ(ServerConfig{}.state_dtype, "fp32");
  EXPECT_EQ(from_yaml("max_batch: auto\n").max_batch, 0);
  const ServerConfig c = from_yaml("max_batch: 3\nstate_dtype: bf16\n");
  EXPECT_EQ(c.max_batch, 3);
  EXPECT_EQ(c.state_dtype, "bf16");
  const CommandLine cmd = parse_command_line({"--max-batch", "auto", "--state-dtype", "bf16"}, "");
  EXPECT_EQ(cmd.config.max_batch, 0);
  EXPECT_EQ(cmd.config.state_dtype, "bf16");
  EXPECT_EQ(error_of([] { parse_command_line({"--max-batch", "-4"}, ""); }),
            "--max-batch: expected auto or a positive integer, got '-4'");
  EXPECT_EQ(error_of([] { parse_command_line({"--max-batch=Auto"}, ""); }),
            "--max-batch: expected auto or a positive integer, got 'Auto'");
  // The shipped file asks for the defaults.
  const ServerConfig shipped = load_server_config_file(M3_TEST_SERVER_YAML);
  EXPECT_EQ(shipped.max_batch, 0);
  EXPECT_EQ(shipped.state_dtype, "fp32");
}

TEST(ServerConfigTest, FlagsOverrideTheFile) {
  const auto path = std::filesystem::temp_directory_path() / "m3serve-config-test.yaml";
  std::ofstream(path) << "max_batch: 3\nbackend: cpu\nlisten: 127.0.0.1:1\ndeterministic: true\n";
  CommandLine cmd = parse_command_line(
      {"--max-batch", "5", "--config", path.string(), "--listen=127.0.0.1:7", "--deterministic", "false"}, "");
  EXPECT_EQ(cmd.config.max_batch, 5);
  EXPECT_FALSE(cmd.config.deterministic);
  EXPECT_EQ(cmd.config.backend, "cpu");
  EXPECT_EQ(cmd.config.listen, "127.0.0.1:7");
  std::filesystem::remove(path);
}

TEST(ServerConfigTest, BadFlagsAreRefused) {
  EXPECT_EQ(error_of([] { parse_command_line({"--max-bach", "4"}, ""); }),
            "unknown flag '--max-bach' (see --help)");
  EXPECT_EQ(error_of([] { parse_command_line({"--max-batch"}, ""); }), "--max-batch needs a value");
  EXPECT_EQ(error_of([] { parse_command_line({"--max-batch", "x"}, ""); }),
            "--max-batch: expected auto or a positive integer, got 'x'");
  EXPECT_EQ(error_of([] { parse_command_line({"--backend", "tpu"}, ""); }),
            "backend must be one of auto, cuda, cpu, got 'tpu'");
  EXPECT_EQ(error_of([] { parse_command_line({"--config"}, ""); }), "--config needs a file argument");
  EXPECT_TRUE(parse_command_line({"--help"}, "").help);
  EXPECT_NE(command_line_help().find("--stream-buffer-tokens"), std::string::npos);
}

}  // namespace
}  // namespace m3
