// m3drift MODEL_DIR [--tokens 2000] [--sequences 2] [--threads 0] [--backend cpu|cuda] [--json]
//
// How far bf16 state (the ssm state stored in bf16, updated in fp32) drifts from fp32
// state over a long generation, on the CPU engine (fp32 arithmetic) or the CUDA engine
// (bf16 weights on both sides, so only the state differs): two engines decode the same sequences
// (a short prompt, then the fp32 engine's greedy tokens fed to both, so they stay on one
// path); each step's logit error is max|l_bf16 - l_fp32| / max|l_fp32| over the
// sequences. The first step where the two greedy picks differ is where a bf16-state greedy
// decode would first emit another token. Prints a table (or JSON with --json).
// Exit status: 0 measured, 2 bad arguments, 3 the model cannot be loaded.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/engine.h"
#include "model/weights.h"

namespace {

constexpr const char* kUsage =
    "usage: m3drift MODEL_DIR [--tokens N] [--sequences B] [--threads T] [--backend cpu|cuda] [--json]\n"
    "  Decodes B sequences for N generated tokens (default 2000, 2) with fp32 and with bf16\n"
    "  state on the CPU engine (or the CUDA engine, bf16 weights) and reports the logit error\n"
    "  and the first greedy divergence.\n";

constexpr int kPromptTokens = 8;

int parse_int(const std::string& flag, const std::string& text, int lo, int hi) {
  int v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || v < lo || v > hi) {
    throw std::invalid_argument(flag + " must be an integer in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "], got \"" + text + "\"");
  }
  return v;
}

int argmax(const float* row, int n) { return static_cast<int>(std::max_element(row, row + n) - row); }

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir;
  int tokens = 2000, sequences = 2, threads = 0;
  bool json_out = false;
  std::string backend = "cpu";
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      const auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
        return argv[++i];
      };
      if (arg == "-h" || arg == "--help") {
        std::fputs(kUsage, stdout);
        return 0;
      } else if (arg == "--tokens") {
        tokens = parse_int(arg, value(), 1, 1'000'000);
      } else if (arg == "--sequences") {
        sequences = parse_int(arg, value(), 1, 256);
      } else if (arg == "--threads") {
        threads = parse_int(arg, value(), 0, 1024);
      } else if (arg == "--backend") {
        backend = value();
        if (backend != "cpu" && backend != "cuda") throw std::invalid_argument("--backend must be cpu or cuda");
      } else if (arg == "--json") {
        json_out = true;
      } else if (arg.size() > 1 && arg[0] == '-') {
        throw std::invalid_argument("unknown option " + arg);
      } else if (model_dir.empty()) {
        model_dir = arg;
      } else {
        throw std::invalid_argument("one MODEL_DIR expected, got also \"" + arg + "\"");
      }
    }
    if (model_dir.empty()) throw std::invalid_argument("MODEL_DIR missing");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3drift: %s\n%s", e.what(), kUsage);
    return 2;
  }

  std::unique_ptr<m3::ModelWeights> weights;
  std::unique_ptr<m3::Engine> fp32, bf16;
  try {
    weights = std::make_unique<m3::ModelWeights>(m3::ModelWeights::load(model_dir));
    m3::EngineOptions o;
    o.max_slots = sequences;
    o.cpu_threads = threads;
    o.weight_dtype = m3::WeightDType::BF16;  // (CUDA: bf16 state needs it; the CPU engine computes in fp32)
    fp32 = m3::make_engine(backend, *weights, o);
    o.state_dtype = m3::StateDType::BF16;
    bf16 = m3::make_engine(backend, *weights, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3drift: %s\n", e.what());
    return 3;
  }

  const m3::ModelConfig& c = weights->config();
  const int V = c.padded_vocab(), B = sequences;
  std::vector<int32_t> slots(B), input(B), sampled(B);
  for (int b = 0; b < B; ++b) slots[b] = b;
  std::vector<float> la(static_cast<size_t>(B) * V), lb(la.size());
  std::vector<double> err_at;  // per generated token
  std::vector<int> first_divergence(B, -1);
  int mismatches = 0;
  for (int t = 0; t < kPromptTokens + tokens - 1; ++t) {
    for (int b = 0; b < B; ++b) {
      // A prompt of ids spread over the vocabulary, different per sequence; then greedy.
      input[b] = t < kPromptTokens ? (7919 * (t + 1) + 104729 * b) % c.vocab_size
                                   : argmax(&la[static_cast<size_t>(b) * V], c.vocab_size);
    }
    fp32->step(slots, input, sampled, la);
    bf16->step(slots, input, sampled, lb);
    if (t < kPromptTokens - 1) continue;
    const int generated = t - (kPromptTokens - 1);  // 0 for the first generated token
    double worst = 0;
    for (int b = 0; b < B; ++b) {
      const float* a = &la[static_cast<size_t>(b) * V];
      const float* r = &lb[static_cast<size_t>(b) * V];
      double diff = 0, scale = 0;
      for (int i = 0; i < V; ++i) {
        diff = std::max(diff, double(std::fabs(a[i] - r[i])));
        scale = std::max(scale, double(std::fabs(a[i])));
      }
      worst = std::max(worst, diff / scale);
      if (argmax(a, c.vocab_size) != argmax(r, c.vocab_size)) {
        ++mismatches;
        if (first_divergence[b] < 0) first_divergence[b] = generated + 1;
      }
    }
    err_at.push_back(worst);
  }

  nlohmann::json j;
  j["model"] = model_dir;
  j["backend"] = backend;
  j["layers"] = c.n_layer;
  j["d_model"] = c.d_model;
  j["sequences"] = B;
  j["prompt_tokens"] = kPromptTokens;
  j["generated_tokens"] = tokens;
  j["max_rel_err"] = *std::max_element(err_at.begin(), err_at.end());
  double sum = 0;
  for (double e : err_at) sum += e;
  j["mean_rel_err"] = sum / err_at.size();
  for (int k = 1; k <= tokens; k *= 10) j["rel_err_at_token"][std::to_string(k)] = err_at[k - 1];
  j["rel_err_at_token"][std::to_string(tokens)] = err_at.back();
  j["greedy_mismatches"] = mismatches;
  j["first_greedy_divergence"] = nlohmann::json::array();
  for (int d : first_divergence) j["first_greedy_divergence"].push_back(d < 0 ? nlohmann::json() : nlohmann::json(d));
  if (json_out) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("bf16 state against fp32 state, %s engine, %s: %d sequences x %d generated tokens\n",
              backend.c_str(), model_dir.c_str(), B, tokens);
  for (const auto& [k, v] : j["rel_err_at_token"].items())
    std::printf("  token %6s: rel logit err %.3e\n", k.c_str(), v.get<double>());
  std::printf("  max %.3e, mean %.3e; greedy picks differ at %d of %d steps; first divergence:",
              j["max_rel_err"].get<double>(), j["mean_rel_err"].get<double>(), mismatches, B * tokens);
  for (int d : first_divergence) d < 0 ? std::printf(" none") : std::printf(" token %d", d);
  std::printf("\n");
  return 0;
}
