#include "model/tools/bench_decode.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <span>
#include <iostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/cuda_policy.h"
#include "model/random_model.h"
#include "model/tools/integer_text.h"
#include "model/weights.h"
#if defined(M3_WITH_CUDA)
#include <unistd.h>

#include "kernels/common.cuh"
#include "model/cuda/cuda_engine.h"
#include "model/cuda/profiling.h"
#endif

namespace m3 {
namespace {

std::string usage() {
  return "usage: m3bench decode --config FILE [--batch 1,4,16,64] [--dtype bf16|fp32] [--state-dtype fp32|bf16]\n"
         "                      [--iters 300] [--json OUT] [--seed 1] [--per-kernel] [--plan]\n"
         "                      [--slot-copies]\n"
         "                      [--cuda-... VALUE ...]\n"
         "  --batch: batch sizes in [1, 4096], comma-separated; --iters: 10 to 1000000\n"
         "  --state-dtype: the recurrent state's storage (state_dtype; bf16 needs --dtype bf16)\n"
         "  --per-kernel: also time every kernel of the step alone (sum by kernel name)\n"
         "  --plan: also print each batch's step as planned (kernels and the planners' choices)\n"
         "  --slot-copies: also the pipelined step with one slot outside the batch saved and\n"
         "      loaded between steps (an idle session swapped out and another in), from pageable\n"
         "      and from page-locked host memory (Engine::allocate_host_state), the load also\n"
         "      beside the steps (load_slot_async, as the scheduler swaps sessions in)\n"
         "the engine's policy (configs/server.yaml's cuda: section), as m3serve takes it:\n" +
         cuda_policy_flags_help();
}

constexpr int kMaxBatch = 4096;
constexpr int kMaxIters = 1'000'000;

struct Options {
  std::string config;
  std::vector<int> batches = {1, 4, 16, 64};
  std::string dtype = "bf16";
  StateDType state_dtype = StateDType::F32;
  int iters = 300;
  std::string json;
  uint64_t seed = 1;
  bool per_kernel = false;
  bool plan = false;
  bool slot_copies = false;
  CudaPolicy policy;
};

template <typename Int>
Int parse_integer(std::string_view flag, std::string_view text, Int min, Int max) {
  Int value = 0;
  if (std::string refusal = client::integer_refusal(flag, text, min, max, &value); !refusal.empty()) {
    throw std::invalid_argument(refusal);
  }
  return value;
}

// "1,4,16": every entry a batch size, none empty.
std::vector<int> parse_batches(const std::string& text) {
  std::vector<int> out;
  size_t begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    const std::string item = text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    if (item.empty()) throw std::invalid_argument("--batch: empty entry in \"" + text + "\"");
    out.push_back(parse_integer<int>("--batch", item, 1, kMaxBatch));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--config") o.config = value();
    else if (a == "--batch") o.batches = parse_batches(value());
    else if (a == "--dtype") o.dtype = value();
    else if (a == "--state-dtype") {
      const std::string d = value();
      if (!parse_state_dtype(d, &o.state_dtype)) throw std::invalid_argument("--state-dtype must be fp32 or bf16, got \"" + d + "\"");
    }
    else if (a == "--iters") o.iters = parse_integer<int>("--iters", value(), 10, kMaxIters);
    else if (a == "--json") o.json = value();
    else if (a == "--seed") o.seed = parse_integer<uint64_t>("--seed", value(), 0, UINT64_MAX);
    else if (a == "--per-kernel") o.per_kernel = true;
    else if (a == "--plan") o.plan = true;
    else if (a == "--slot-copies") o.slot_copies = true;
    else if (a.rfind("--cuda-", 0) == 0 && set_cuda_policy_flag(o.policy, a, value())) continue;
    else throw std::invalid_argument("unknown argument " + a);
  }
  o.policy.validate();
  if (o.config.empty()) throw std::invalid_argument("--config is required");
  if (o.dtype != "bf16" && o.dtype != "fp32") throw std::invalid_argument("--dtype must be bf16 or fp32");
  return o;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

#if defined(M3_WITH_CUDA)
// Device-to-device copy of 1 GiB, bytes read plus written over the median time.
double copy_bandwidth_gbps() {
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  M3_CUDA_CHECK(cudaMalloc(&a, bytes));
  M3_CUDA_CHECK(cudaMalloc(&b, bytes));
  M3_CUDA_CHECK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  M3_CUDA_CHECK(cudaEventCreate(&e0));
  M3_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 12; ++i) {
    M3_CUDA_CHECK(cudaEventRecord(e0));
    M3_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    M3_CUDA_CHECK(cudaEventRecord(e1));
    M3_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    M3_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 2) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (median(ms) * 1e-3) / 1e9;
}

struct Row {
  int batch = 0, bucket = 0, kernels = 0;
  std::vector<std::pair<std::string, double>> per_kernel;  // name, us per step (alone)
  double graph_us = 0, direct_us = 0, step_wall_us = 0, pipelined_wall_us = 0, floor_bytes = 0, floor_us = 0;
  // --slot-copies: the pipelined wall with a slot saved and loaded between steps.
  double copies_pageable_wall_us = 0, copies_locked_wall_us = 0, copies_async_wall_us = 0;
};

// The server's view of a step: each submitted before the previous one is collected, so the
// host's work overlaps the device's; `between` runs with one step in flight, where the
// scheduler copies slot states. Median microseconds from one collect to the next.
template <typename Between>
double pipelined_wall_us(Engine& engine, std::span<const int32_t> slots, std::span<const int32_t> tokens,
                         std::span<int32_t> sampled, int iters, Between&& between) {
  std::vector<float> wall;
  engine.submit_step(slots, tokens);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters + 10; ++i) {
    between();
    engine.submit_step(slots, tokens);
    engine.collect_step(sampled);
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= 10) wall.push_back(std::chrono::duration<float, std::micro>(t1 - t0).count());
    t0 = t1;
  }
  engine.collect_step(sampled);
  return median(wall);
}

int run(const Options& o) {
  const ModelConfig cfg = ModelConfig::load(o.config);
  const int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  const auto dir = std::filesystem::temp_directory_path() /
                   ("m3bench-decode-" + std::to_string(::getpid()));
  struct Cleanup {
    std::filesystem::path p;
    ~Cleanup() { std::error_code ec; std::filesystem::remove_all(p, ec); }
  } cleanup{dir};
  write_random_model(cfg, o.seed, o.dtype == "bf16" ? DType::BF16 : DType::F32, dir);
  const ModelWeights weights = ModelWeights::load(dir);

  cudaDeviceProp prop{};
  M3_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double bw = copy_bandwidth_gbps();

  EngineOptions eo;
  eo.max_slots = max_batch + (o.slot_copies ? 1 : 0);  // the copied slot is outside every batch
  eo.weight_dtype = o.dtype == "bf16" ? WeightDType::BF16 : WeightDType::F32;
  eo.state_dtype = o.state_dtype;
  eo.use_graphs = true;
  eo.cuda = o.policy;
  auto engine = make_cuda_engine(weights, eo);
  Engine& graphed = *engine;
  cuda::CudaProfiling& profile = *cuda::cuda_profiling(graphed);

  std::vector<Row> rows;
  for (int b : o.batches) {
    Row r;
    r.batch = b;
    r.bucket = profile.bucket_for(b);
    r.kernels = profile.kernels_per_step(b);
    std::vector<int32_t> slots(b), tokens(b), sampled(b);
    for (int i = 0; i < b; ++i) {
      slots[i] = i;
      tokens[i] = (i * 37 + 11) % cfg.vocab_size;
      graphed.reset(i);
    }
    graphed.step(slots, tokens, sampled);
    std::fill(tokens.begin(), tokens.end(), kContinueToken);
    // Host view: one step() call (table copy, graph launch, sync; the sampled ids arrive
    // in pinned host memory).
    std::vector<float> wall;
    for (int i = 0; i < o.iters / 3 + 10; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      graphed.step(slots, tokens, sampled);
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= 10) wall.push_back(std::chrono::duration<float, std::micro>(t1 - t0).count());
    }
    r.step_wall_us = median(wall);
    r.pipelined_wall_us = pipelined_wall_us(graphed, slots, tokens, sampled, o.iters / 3, [] {});
    if (o.slot_copies) {
      const int copied = max_batch;
      graphed.reset(copied);
      std::vector<std::byte> pageable(graphed.slot_state_bytes());
      HostStateBuffer locked = graphed.allocate_host_state();
      graphed.save_slot(copied, pageable);
      graphed.save_slot(copied, locked.bytes());
      r.copies_pageable_wall_us = pipelined_wall_us(graphed, slots, tokens, sampled, o.iters / 3, [&] {
        graphed.save_slot(copied, pageable);
        graphed.load_slot(copied, pageable);
      });
      r.copies_locked_wall_us = pipelined_wall_us(graphed, slots, tokens, sampled, o.iters / 3, [&] {
        graphed.save_slot(copied, locked.bytes());
        graphed.load_slot(copied, locked.bytes());
      });
      // As the scheduler swaps: the load lands beside the steps, which leave its slot out.
      r.copies_async_wall_us = pipelined_wall_us(graphed, slots, tokens, sampled, o.iters / 3, [&] {
        graphed.save_slot(copied, locked.bytes());
        graphed.load_slot_async(copied, locked);
      });
      while (!graphed.slot_ready(copied)) {
      }
    }
    profile.time_replays(b, 20, true);  // warm-up
    r.graph_us = median(profile.time_replays(b, o.iters, true));
    profile.time_replays(b, 10, false);
    r.direct_us = median(profile.time_replays(b, o.iters, false));
    if (o.per_kernel) {
      for (const auto& kt : profile.time_kernels(b, 20)) {
        auto it = std::find_if(r.per_kernel.begin(), r.per_kernel.end(),
                               [&](const auto& p) { return p.first == kt.name; });
        if (it == r.per_kernel.end()) r.per_kernel.emplace_back(kt.name, kt.us);
        else it->second += kt.us;
      }
      for (int i = 0; i < b; ++i) graphed.reset(i);
    }
    r.floor_bytes = profile.floor_bytes(b);
    r.floor_us = r.floor_bytes / (bw * 1e9) * 1e6;
    rows.push_back(r);
  }

  std::printf("m3bench decode: %s, %s weights, %s state, %s, copy bandwidth %.0f GB/s, pdl %s\n", o.config.c_str(),
              o.dtype.c_str(), std::string(state_dtype_name(o.state_dtype)).c_str(), prop.name, bw,
              profile.policy().pdl ? "on" : "off");
  std::printf("cuda policy: %s\n", to_string(profile.policy()).c_str());
  std::printf("%6s %6s %8s %11s %11s %9s %7s %12s %8s %13s %14s\n", "batch", "bucket", "kernels",
              "us/step", "tokens/s", "floor us", "ratio", "no-graph us", "speedup", "step() wall us",
              "pipelined wall");
  for (const Row& r : rows) {
    std::printf("%6d %6d %8d %11.1f %11.0f %9.1f %7.2f %12.1f %8.2f %13.1f %14.1f\n", r.batch, r.bucket,
                r.kernels, r.graph_us, r.batch / (r.graph_us * 1e-6), r.floor_us, r.graph_us / r.floor_us,
                r.direct_us, r.direct_us / r.graph_us, r.step_wall_us, r.pipelined_wall_us);
  }
  std::printf("step variant per batch (where several apply, each measured at load, us per step):\n");
  for (const Row& r : rows) {
    std::printf("  batch %d: %s", r.batch, cuda::to_string(profile.step_variant(r.batch)).c_str());
    const auto& measured = profile.step_variant_timings(r.batch);
    for (size_t i = 0; i < measured.size(); ++i) {
      std::printf("%s%s %.1f", i == 0 ? "  [" : "; ", cuda::to_string(measured[i].first).c_str(), measured[i].second);
    }
    std::printf("%s\n", measured.empty() ? "" : "]");
  }
  if (o.plan) {
    std::printf("step plans:\n");
    for (const Row& r : rows) std::printf("%s", to_string(profile.step_plan(r.batch)).c_str());
  }
  if (o.slot_copies) {
    std::printf("pipelined wall us per step with one slot (%.1f MB) saved and loaded between steps:\n",
                graphed.slot_state_bytes() / 1e6);
    std::printf("%6s %14s %16s %18s %24s\n", "batch", "no copies", "pageable bytes", "page-locked bytes",
                "page-locked, async load");
    for (const Row& r : rows) {
      std::printf("%6d %14.1f %16.1f %18.1f %24.1f\n", r.batch, r.pipelined_wall_us, r.copies_pageable_wall_us,
                  r.copies_locked_wall_us, r.copies_async_wall_us);
    }
  }
  if (o.per_kernel) {
    std::printf("kernels timed alone (us per step, each kernel repeated back to back):\n");
    for (const Row& r : rows) {
      std::printf("  batch %d:", r.batch);
      for (const auto& [name, us] : r.per_kernel) std::printf("  %s %.1f", name.c_str(), us);
      std::printf("\n");
    }
  }
  if (!o.json.empty()) {
    nlohmann::json j;
    j["config"] = o.config;
    j["dtype"] = o.dtype;
    j["state_dtype"] = state_dtype_name(o.state_dtype);
    j["device"] = prop.name;
    j["copy_bandwidth_gbps"] = bw;
    j["pdl"] = profile.policy().pdl;
    j["cuda_policy"] = to_string(profile.policy());
    j["iters"] = o.iters;
    for (const Row& r : rows) {
      j["results"].push_back({{"batch", r.batch},
                              {"bucket", r.bucket},
                              {"kernels_per_step", r.kernels},
                              {"graph_us_per_step", r.graph_us},
                              {"tokens_per_s", r.batch / (r.graph_us * 1e-6)},
                              {"floor_bytes", r.floor_bytes},
                              {"floor_us", r.floor_us},
                              {"ratio_to_floor", r.graph_us / r.floor_us},
                              {"no_graph_us_per_step", r.direct_us},
                              {"step_call_wall_us", r.step_wall_us},
                              {"pipelined_step_wall_us", r.pipelined_wall_us},
                              {"step_variant", cuda::to_string(profile.step_variant(r.batch))}});
      for (const auto& [variant, us] : profile.step_variant_timings(r.batch)) {
        j["results"].back()["step_variants_measured_us"][cuda::to_string(variant)] = us;
      }
      for (const auto& [name, us] : r.per_kernel) j["results"].back()["kernels_alone_us"][name] = us;
      if (o.slot_copies) {
        j["results"].back()["pipelined_wall_us_slot_copies_pageable"] = r.copies_pageable_wall_us;
        j["results"].back()["pipelined_wall_us_slot_copies_page_locked"] = r.copies_locked_wall_us;
        j["results"].back()["pipelined_wall_us_slot_copies_page_locked_async_load"] = r.copies_async_wall_us;
      }
    }
    std::ofstream file(o.json);
    file << j.dump(2) << "\n";
    file.close();
    if (!file) {
      std::fprintf(stderr, "m3bench decode: cannot write %s\n", o.json.c_str());
      return 1;
    }
  }
  return 0;
}
#endif

}  // namespace

int run_bench_decode(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::cout << usage();
      return 0;
    }
  }
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "m3bench decode: " << e.what() << "\n" << usage();
    return 2;
  }
#if defined(M3_WITH_CUDA)
  try {
    if (cuda_device_count() == 0) {
      std::cerr << "m3bench decode: no CUDA device visible\n";
      return 1;
    }
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "m3bench decode: " << e.what() << "\n";
    return 1;
  }
#else
  std::cerr << "m3bench decode: this build has no CUDA support (nvcc was not found at configure time)\n";
  return 1;
#endif
}

}  // namespace m3
