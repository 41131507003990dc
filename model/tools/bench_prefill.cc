#include "model/tools/bench_prefill.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/cpu/cpu_ops.h"
#include "model/cpu/cpu_thread_pool.h"
#include "model/cuda_policy.h"
#include "model/engine.h"
#include "model/random_model.h"
#include "model/weights.h"
#if defined(M3_WITH_CUDA)
#include <cuda_runtime.h>

#include "model/cuda/profiling.h"
#if defined(M3_BENCH_WITH_CUBLAS)
#include <cublas_v2.h>
#endif
#endif

namespace m3 {
namespace {

constexpr const char* kUsage =
    "usage: m3bench prefill --config FILE [--len 128,512,2048,8192] [--batch 1,8]\n"
    "                       [--backend auto|cuda|cpu] [--dtype bf16|fp32] [--iters 5]\n"
    "                       [--threads 0] [--json OUT] [--seed 1]\n"
    "  --len: prompt lengths in [1, 1048576]; --batch: prompts read together, in [1, 4096];\n"
    "  each (len, batch) is one prefill() call of len x batch tokens. --iters: 1 to 1000\n"
    "  timed calls per case (median), after a first call at that shape (first ms).\n"
    "  --threads: CPU engine threads (0: all cores).\n"
    "  The CUDA engine's policy flags (--cuda-prefill steps reads one decode step a token;\n"
    "  auto, the default, the chunked kernels where they take the model):\n";

struct Options {
  std::string config;
  std::vector<int> lens = {128, 512, 2048, 8192};
  std::vector<int> batches = {1, 8};
  std::string backend = "auto";
  std::string dtype = "bf16";
  int iters = 5;
  int threads = 0;
  std::string json;
  uint64_t seed = 1;
  CudaPolicy cuda;
};

int parse_int(std::string_view flag, std::string_view text, int min, int max) {
  int value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (error != std::errc() || stop != end || value < min || value > max) {
    throw std::invalid_argument(std::string(flag) + ": '" + std::string(text) + "' is not an integer in [" +
                                std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return value;
}

std::vector<int> parse_list(std::string_view flag, const std::string& text, int min, int max) {
  std::vector<int> out;
  size_t begin = 0;
  for (;;) {
    const size_t comma = text.find(',', begin);
    const std::string item = text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    if (item.empty()) throw std::invalid_argument(std::string(flag) + ": empty entry in \"" + text + "\"");
    out.push_back(parse_int(flag, item, min, max));
    if (comma == std::string::npos) return out;
    begin = comma + 1;
  }
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--config") o.config = value();
    else if (a == "--len") o.lens = parse_list("--len", value(), 1, 1 << 20);
    else if (a == "--batch") o.batches = parse_list("--batch", value(), 1, 4096);
    else if (a == "--backend") o.backend = value();
    else if (a == "--dtype") o.dtype = value();
    else if (a == "--iters") o.iters = parse_int("--iters", value(), 1, 1000);
    else if (a == "--threads") o.threads = parse_int("--threads", value(), 0, 1024);
    else if (a == "--json") o.json = value();
    else if (a == "--seed") o.seed = static_cast<uint64_t>(parse_int("--seed", value(), 0, 1 << 30));
    else if (a.rfind("--cuda-", 0) == 0 && set_cuda_policy_flag(o.cuda, a, value())) continue;
    else throw std::invalid_argument("unknown argument " + a);
  }
  if (o.config.empty()) throw std::invalid_argument("--config is required");
  if (o.dtype != "bf16" && o.dtype != "fp32") throw std::invalid_argument("--dtype must be bf16 or fp32");
  if (o.backend != "auto" && o.backend != "cuda" && o.backend != "cpu") {
    throw std::invalid_argument("--backend must be auto, cuda or cpu, got \"" + o.backend + "\"");
  }
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The rate the hardware multiplies matrices at, and how it was measured.
struct MatrixRate {
  double flops_per_s = 0;  // 0: not measured
  std::string how;
};

// The CPU engine's own blocked product (what its prefill runs) on a 1024 x 1024 weight
// and 256 inputs, over a pool of the engine's size.
MatrixRate cpu_matrix_rate(int threads) {
  const int rows = 1024, in = 1024, tokens = 256;
  std::vector<float> W(static_cast<size_t>(rows) * in), x(static_cast<size_t>(tokens) * in),
      y(static_cast<size_t>(tokens) * rows);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& v : W) v = u(rng);
  for (float& v : x) v = u(rng);
  CpuThreadPool pool(threads);
  std::vector<double> s;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.run(rows, [&](int64_t b, int64_t e, int) {
      cpu::matmul_rows(W.data(), in, rows, static_cast<int>(b), static_cast<int>(e), x.data(), tokens, y.data());
    });
    if (i > 0) s.push_back(seconds_since(t0));
  }
  return {2.0 * rows * in * tokens / median(s),
          "cpu::matmul_rows fp32 1024x1024 x 256 tokens, " + std::to_string(pool.threads()) + " threads"};
}

// Bytes read plus written by a 256 MiB memcpy, per second.
double cpu_copy_bandwidth() {
  const size_t bytes = size_t{256} << 20;
  std::vector<char> a(bytes, 1), b(bytes, 0);
  std::vector<double> s;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    if (i > 0) s.push_back(seconds_since(t0));
  }
  return 2.0 * bytes / median(s);
}

#if defined(M3_WITH_CUDA)
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device-to-device copy of 1 GiB, bytes read plus written per second.
double cuda_copy_bandwidth() {
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  cuda_check(cudaMalloc(&a, bytes), "cudaMalloc");
  cuda_check(cudaMalloc(&b, bytes), "cudaMalloc");
  cuda_check(cudaMemset(a, 1, bytes), "cudaMemset");
  cudaEvent_t e0, e1;
  cuda_check(cudaEventCreate(&e0), "cudaEventCreate");
  cuda_check(cudaEventCreate(&e1), "cudaEventCreate");
  std::vector<double> s;
  for (int i = 0; i < 12; ++i) {
    cuda_check(cudaEventRecord(e0), "cudaEventRecord");
    cuda_check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
    cuda_check(cudaEventRecord(e1), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    if (i >= 2) s.push_back(ms * 1e-3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / median(s);
}

MatrixRate cuda_matrix_rate(bool bf16) {
#if defined(M3_BENCH_WITH_CUBLAS)
  // cuBLAS on a 4096^3 product in the weights' type (fp32 accumulation, no TF32).
  const int n = 4096;
  const size_t elem = bf16 ? 2 : 4, bytes = elem * n * n;
  void *A = nullptr, *B = nullptr, *C = nullptr;
  cuda_check(cudaMalloc(&A, bytes), "cudaMalloc");
  cuda_check(cudaMalloc(&B, bytes), "cudaMalloc");
  cuda_check(cudaMalloc(&C, bytes), "cudaMalloc");
  cuda_check(cudaMemset(A, 0, bytes), "cudaMemset");
  cuda_check(cudaMemset(B, 0, bytes), "cudaMemset");
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
  const cudaDataType_t t = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const float one = 1.0f, zero = 0.0f;
  cudaEvent_t e0, e1;
  cuda_check(cudaEventCreate(&e0), "cudaEventCreate");
  cuda_check(cudaEventCreate(&e1), "cudaEventCreate");
  std::vector<double> s;
  for (int i = 0; i < 12; ++i) {
    cuda_check(cudaEventRecord(e0), "cudaEventRecord");
    if (cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, A, t, n, B, t, n, &zero, C, t, n,
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
      throw std::runtime_error("cublasGemmEx failed");
    }
    cuda_check(cudaEventRecord(e1), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    if (i >= 2) s.push_back(ms * 1e-3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cublasDestroy(h);
  cudaFree(A);
  cudaFree(B);
  cudaFree(C);
  return {2.0 * n * n * n / median(s), std::string("cuBLAS ") + (bf16 ? "bf16" : "fp32") + " 4096^3"};
#else
  (void)bf16;
  return {0, "not measured (built without cuBLAS)"};
#endif
}
#endif

struct Row {
  int len = 0, batch = 0;
  double prefill_s = 0, step_s = 0, flops = 0, bytes = 0, floor_s = 0;
  double first_s = 0;  // the first call at this length and batch (the warm-up, left out of the median)
  const char* floor_kind = "";
};

// Multiply-add FLOPs of the matrix products a prefill of `tokens` tokens in `runs` runs
// performs: in_proj, out_proj and the MLP for every token, lm_head for each run's last.
double gemm_flops(const ModelConfig& c, double tokens, double runs) {
  const double d = c.d_model, di = c.d_inner(), F = c.has_mlp() ? c.mlp_width() : 0;
  const double per_token = d * c.in_proj_rows() + di * d + 3.0 * d * F;
  return 2.0 * (tokens * c.n_layer * per_token + runs * d * c.padded_vocab());
}

// Bytes it must move at least: every weight once, each slot's state read and written.
double floor_bytes(const ModelConfig& c, double weight_bytes, int batch) {
  return weight_bytes * static_cast<double>(c.parameter_count()) +
         2.0 * 4.0 * static_cast<double>(c.state_floats_per_layer()) * c.n_layer * batch;
}

int run(const Options& o) {
  const ModelConfig cfg = ModelConfig::load(o.config);
  const int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  int64_t max_tokens = 0;
  for (int len : o.lens) {
    for (int b : o.batches) max_tokens = std::max(max_tokens, int64_t{len} * b);
  }
  if (max_tokens > (1 << 30)) throw std::invalid_argument("--len x --batch is over 2^30 tokens");
  const std::string backend = o.backend == "auto" ? (cuda_backend_available() ? "cuda" : "cpu") : o.backend;
  const auto dir = std::filesystem::temp_directory_path() / ("m3bench-prefill-" + std::to_string(::getpid()));
  struct Cleanup {
    std::filesystem::path p;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
  } cleanup{dir};
  const bool bf16 = backend == "cuda" && o.dtype == "bf16";
  write_random_model(cfg, o.seed, bf16 ? DType::BF16 : DType::F32, dir);
  const ModelWeights weights = ModelWeights::load(dir);
  EngineOptions eo;
  eo.max_slots = max_batch;
  eo.weight_dtype = bf16 ? WeightDType::BF16 : WeightDType::F32;
  eo.cpu_threads = o.threads;
  eo.max_prefill_tokens = static_cast<int>(max_tokens);
  eo.cuda = o.cuda;
  const auto load_start = std::chrono::steady_clock::now();
  auto engine = make_engine(backend, weights, eo);
  const double load_s = seconds_since(load_start);  // with the prefill graphs it captures

  MatrixRate rate;
  double bandwidth = 0;
  std::string device = "cpu";
  int graph_tokens = 0;  // lone runs up to this many tokens replay a graph
#if defined(M3_WITH_CUDA)
  if (engine->backend() == "cuda") {
    graph_tokens = cuda::cuda_profiling(*engine)->prefill_graph_max_tokens();
    rate = cuda_matrix_rate(bf16);
    bandwidth = cuda_copy_bandwidth();
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    device = prop.name;
  }
#endif
  if (engine->backend() == "cpu") {
    rate = cpu_matrix_rate(o.threads);
    bandwidth = cpu_copy_bandwidth();
  }

  std::mt19937 rng(static_cast<uint32_t>(o.seed));
  std::uniform_int_distribution<int32_t> pick(0, cfg.vocab_size - 1);
  std::vector<Row> rows;
  for (int b : o.batches) {
    std::vector<int32_t> slots(b), tokens(b), sampled(b);
    for (int i = 0; i < b; ++i) slots[i] = i;
    for (int len : o.lens) {
      std::vector<std::vector<int32_t>> prompts(b, std::vector<int32_t>(len));
      for (auto& p : prompts) {
        for (int32_t& t : p) t = pick(rng);
      }
      // Token-by-token reading: the decode step of b slots over the same prompts from a
      // fresh state (the first 512 tokens of them; a step's cost depends on the state's
      // values), its median times the length.
      for (int k = 0; k < b; ++k) engine->reset(k);
      std::vector<double> step_s;
      for (int t = 0; t < std::min(len, 512); ++t) {
        for (int k = 0; k < b; ++k) tokens[k] = prompts[k][t];
        const auto t0 = std::chrono::steady_clock::now();
        engine->step(slots, tokens, sampled);
        step_s.push_back(seconds_since(t0));
      }
      const double step = median(step_s);
      std::vector<PrefillRun> runs;
      for (int i = 0; i < b; ++i) runs.push_back({i, prompts[i]});
      std::vector<double> s;
      double first_s = 0;
      for (int i = 0; i <= o.iters; ++i) {  // the first call warms up
        for (int k = 0; k < b; ++k) engine->reset(k);
        const auto t0 = std::chrono::steady_clock::now();
        engine->prefill(runs, sampled);
        const double took = seconds_since(t0);
        if (i == 0) {
          first_s = took;
        } else {
          s.push_back(took);
        }
      }
      Row r;
      r.len = len;
      r.batch = b;
      r.prefill_s = median(s);
      r.first_s = first_s;
      r.step_s = step;
      r.flops = gemm_flops(cfg, double{1.0} * len * b, b);
      r.bytes = floor_bytes(cfg, bf16 ? 2.0 : 4.0, b);
      const double flop_floor = rate.flops_per_s > 0 ? r.flops / rate.flops_per_s : 0;
      const double byte_floor = r.bytes / bandwidth;
      r.floor_s = std::max(flop_floor, byte_floor);
      r.floor_kind = flop_floor >= byte_floor ? "flops" : "bytes";
      rows.push_back(r);
    }
  }

  std::printf("m3bench prefill: %s, backend %s (%s), %s weights, engine loaded in %.2f s (graphs for lone runs "
              "up to %d tokens); matrix rate %.3g TFLOP/s (%s), copy bandwidth %.0f GB/s\n",
              o.config.c_str(), std::string(engine->backend()).c_str(), device.c_str(), bf16 ? "bf16" : "fp32",
              load_s, graph_tokens, rate.flops_per_s / 1e12, rate.how.c_str(), bandwidth / 1e9);
  std::printf("%7s %6s %12s %10s %14s %12s %13s %11s %9s %6s\n", "len", "batch", "ms/prefill", "first ms",
              "tokens/s", "step ms", "vs stepping", "floor ms", "vs floor", "bound");
  for (const Row& r : rows) {
    std::printf("%7d %6d %12.3f %10.3f %14.0f %12.3f %13.3f %11.3f %9.2f %6s\n", r.len, r.batch,
                r.prefill_s * 1e3, r.first_s * 1e3, r.len * r.batch / r.prefill_s, r.step_s * 1e3,
                r.prefill_s / (r.step_s * r.len), r.floor_s * 1e3,
                r.prefill_s / r.floor_s, r.floor_kind);
  }
  if (!o.json.empty()) {
    nlohmann::json j;
    j["config"] = o.config;
    j["backend"] = engine->backend();
    j["device"] = device;
    j["dtype"] = bf16 ? "bf16" : "fp32";
    j["iters"] = o.iters;
    j["engine_load_s"] = load_s;
    j["prefill_graph_max_tokens"] = graph_tokens;
    j["cuda_policy"] = to_string(o.cuda);
    j["prefill_path"] = engine->has_prefill_path() ? "engine's own" : "decode steps";
    j["matrix_flops_per_s"] = rate.flops_per_s;
    j["matrix_rate_measured_with"] = rate.how;
    j["copy_bandwidth_bytes_per_s"] = bandwidth;
    j["results"] = nlohmann::json::array();
    for (const Row& r : rows) {
      j["results"].push_back({{"len", r.len},
                              {"batch", r.batch},
                              {"prefill_ms", r.prefill_s * 1e3},
                              {"first_call_ms", r.first_s * 1e3},
                              {"prompt_tokens_per_s", r.len * r.batch / r.prefill_s},
                              {"decode_step_ms", r.step_s * 1e3},
                              {"ratio_to_stepping", r.prefill_s / (r.step_s * r.len)},
                              {"gemm_flops", r.flops},
                              {"floor_bytes", r.bytes},
                              {"floor_ms", r.floor_s * 1e3},
                              {"floor_bound_by", r.floor_kind},
                              {"ratio_to_floor", r.prefill_s / r.floor_s}});
    }
    std::ofstream file(o.json);
    file << j.dump(2) << "\n";
    file.close();
    if (!file) {
      std::fprintf(stderr, "m3bench prefill: cannot write %s\n", o.json.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace

int run_bench_prefill(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::cout << kUsage << cuda_policy_flags_help();
      return 0;
    }
  }
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "m3bench prefill: " << e.what() << "\n" << kUsage;
    return 2;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "m3bench prefill: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace m3
