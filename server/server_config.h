// Every m3serve setting in one typed struct: read from a YAML file (configs/server.yaml),
// overridden by command-line flags, validated before anything starts. Each YAML key
// `some_key` has the flag `--some-key VALUE`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/cuda_policy.h"

namespace m3 {

struct ServerConfig {
  std::string listen = "127.0.0.1:50051";   // gRPC address (port 0: any free port)
  std::string metrics_listen = "127.0.0.1:9464";  // Prometheus /metrics; "" = off
  std::string model;                         // model directory; "" = generated demo model
  std::string demo_model_dir;                // where the demo model goes; "" = cache dir
  std::string tokenizer;                     // SentencePiece .model; "" = token ids only
  std::string backend = "auto";              // auto | cuda | cpu
  std::string weight_dtype = "bf16";         // bf16 | fp32 (CUDA; CPU is always fp32)
  int device = 0;                            // CUDA device ordinal
  int cpu_threads = 0;                       // CPU engine threads; 0 = all cores
  bool cuda_graphs = true;                   // off only for debugging
  bool deterministic = false;                // CUDA: bitwise-repeatable logits (no atomic out_proj)
  int max_batch = 0;                         // engine slots = sequences decoded together; 0: auto
  std::string state_dtype = "fp32";          // fp32 | bf16: how the recurrent state is stored
  int queue_capacity = 64;                   // requests waiting for a slot; more: RESOURCE_EXHAUSTED
  bool pipelined_steps = true;               // submit each step before the previous one's tokens are out
  // Input tokens read by prefill per iteration; 0 = by decode steps; kAutoPrefillChunkTokens
  // (auto) = chosen for the backend at start (resolve_prefill_chunk_tokens).
  static constexpr int kAutoPrefillChunkTokens = -1;
  int prefill_chunk_tokens = kAutoPrefillChunkTokens;
  int prefill_alone_tokens = 2048;           // the same while no stream replies (the larger of the two)
  int prefill_min_tokens = 32;               // shorter unread Converse input is read by decode steps
  int max_new_tokens_limit = 4096;           // per request / per reply
  int max_prompt_tokens = 8192;              // per prompt / per pending Converse input
  int stream_buffer_tokens = 1024;           // unread tokens per stream before it is cancelled
  double shutdown_grace_s = 10.0;            // in-flight streams get this long to finish
  double session_idle_timeout_s = 300.0;     // a Converse session waiting longer for input ends; 0 = never
  double stalled_stream_timeout_s = 30.0;    // a finished stream its client reads nothing of is cut
  std::string log_level = "info";            // trace | debug | info | warn | error | off
  // CUDA: how the decode step is built; YAML section `cuda:`, flags --cuda-<key-path>.
  CudaPolicy cuda;
  // Snapshots, the prefix cache, idle sessions.
  std::string snapshot_store = "memory";     // memory | dir:PATH | redis://HOST:PORT
  int64_t snapshot_capacity_bytes = 0;       // LRU-evicted beyond this; 0 = no limit
  double snapshot_ttl_s = 0;                 // 0 = none
  bool prefix_cache = false;                 // keep states at prompt boundaries to start later prompts from
  int prefix_cache_interval = 256;           // a state kept every this many tokens of a first input
  int64_t prefix_cache_capacity_bytes = int64_t{1} << 30;  // LRU-evicted beyond this
  double session_swap_after_s = 0;           // an idle session's state leaves its slot after this; 0 = never
  int max_sessions = 0;                      // Converse sessions open at once; 0 = no limit
  // Production: drain, TLS, API keys, /metrics access.
  double drain_delay_s = 5.0;                // SIGTERM: NOT_SERVING this long, still serving, then shutdown
  std::string health_listen;                 // plaintext port with only grpc.health.v1; "" = none
  std::string tls_cert;                      // PEM certificate chain; with tls_key: gRPC over TLS
  std::string tls_key;                       // PEM private key of tls_cert
  std::string tls_client_ca;                 // PEM CA bundle; set: clients need a certificate it signed
  std::string api_keys;                      // file of keys, one a line; set: RPCs need "Bearer KEY"
  std::string metrics_auth;                  // file of user:password lines; set: /metrics needs basic auth

  // Throws std::invalid_argument naming the setting when a value is out of range.
  void validate() const;
};

// Reads YAML text; `source` names it in errors ("configs/server.yaml: unknown key
// 'max_bach'"). Keys not given keep `base`'s values.
ServerConfig parse_server_config_yaml(const std::string& yaml_text, const std::string& source,
                                      ServerConfig base = {});
ServerConfig load_server_config_file(const std::string& path, ServerConfig base = {});

// What the command line asked for.
struct CommandLine {
  ServerConfig config;
  bool help = false;
};

// args excludes argv[0]. `--config FILE` is read first (wherever it appears); without it
// `default_config_path` is read when that file exists. Other flags then override it.
// Throws std::invalid_argument with a message naming the flag. Validates the result.
CommandLine parse_command_line(const std::vector<std::string>& args,
                               const std::string& default_config_path = "configs/server.yaml");

std::string command_line_help();

// prefill_chunk_tokens as configured, or for auto the backend's choice: 2048 on cuda, where
// a 2048-token pass takes about as long as a few decode steps and reading a prompt in
// 512-token passes costs the streams beside it more (each pass its own fixed cost); 512 on
// the CPU, where a pass is long beside the step.
int resolve_prefill_chunk_tokens(int configured, bool cuda);

}  // namespace m3
