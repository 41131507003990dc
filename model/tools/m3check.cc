// m3check MODEL_DIR TRAJECTORY [--backend cpu|cuda|auto] [--dtype fp32|bf16]
//         [--state-dtype fp32|bf16] [--one-at-a-time] [--prefill] [--cuda-... VALUE ...]
//
// The --cuda-... flags set the CUDA engine's policy (model/cuda_policy.h) as m3serve's do,
// so a variant of the step can be checked against the trajectory.
//
// Replays a decode trajectory (teacher forcing: every input is the trajectory's token) on
// an engine and compares each step's logits with the reference. The sequences decode side
// by side (one batch of B), or with --one-at-a-time each alone (the engine's batch-1 plan,
// which on the CUDA backend runs other kernels). With --prefill each sequence's prompt is
// read by one Engine::prefill() call (all sequences' prompts in one call) and only the
// rest is teacher-forced step by step; the logits compared then start at the prompt's
// last token (step Lp-1):
//   err(b, t) = max|logits - ref| / max|ref|, reported as the max over all steps;
//   greedy_match: for t >= Lp-1 the engine's greedy sample equals greedy_ids[b, t+1].
// Prints one line "max_rel_err=<x> greedy_match=<yes|no>" on stdout (detail on stderr).
//
// Tolerance: fp32 arithmetic 1e-4 (either backend; 1e-3 for the CUDA backend with
// --prefill); bf16 weights 3e-2, whether the CUDA
// engine rounds them (--dtype bf16) or the model stores them in 16 bits (BF16 or F16: the
// CPU engine widens them exactly, but they are already rounded); bf16 state (the ssm state
// stored in bf16, updated in fp32: --state-dtype bf16) 3e-2 too. With fp32 a greedy
// mismatch fails. With bf16 weights or state a mismatch is tolerated only at a near tie: where
// the reference logit of the id the engine picked is within 2 * that step's absolute
// logit error of the reference maximum, the rounded weights may legitimately reorder
// the top two; any other mismatch fails. greedy_match still reports "no" then.
//
// Exit status: 0 within tolerance, 1 outside it, 2 usage error, 3 the model or
// trajectory cannot be loaded or do not fit together, 4 --backend cuda in a CUDA build
// where no CUDA device is visible (nothing checked: ctest counts it as skipped).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/cuda_policy.h"
#include "model/engine.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace {

constexpr int kExitTolerance = 1;
constexpr int kExitUsage = 2;
constexpr int kExitInput = 3;
constexpr int kExitNoDevice = 4;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::string model_dir, trajectory, backend = "cpu";
  m3::WeightDType dtype = m3::WeightDType::F32;
  m3::StateDType state_dtype = m3::StateDType::F32;
  bool one_at_a_time = false;
  m3::CudaPolicy cuda;
  bool prefill = false;  // read the prompts through Engine::prefill()
  bool help = false;  // print the usage to stdout and exit 0
};

std::string usage() {
  return "usage: m3check MODEL_DIR TRAJECTORY [--backend cpu|cuda|auto] [--dtype fp32|bf16]\n"
         "               [--state-dtype fp32|bf16] [--one-at-a-time] [--prefill] [--cuda-... VALUE ...]\n"
         "  TRAJECTORY: safetensors with prompt_ids I64 [B,Lp], logits F32 [B,Lp+Ln-1,V],\n"
         "  greedy_ids I64 [B,Lp+Ln]. --one-at-a-time: each sequence decodes alone (batch 1)\n"
         "  instead of all B side by side. --prefill: the prompts are read by prefill(), the logits\n"
         "  compared from the prompt's last token on. Exit: 0 ok, 1 outside tolerance, 2 usage,\n"
         "  3 bad input, 4 --backend cuda with no CUDA device visible (nothing checked).\n"
         "the CUDA engine's policy (configs/server.yaml's cuda: section), as m3serve takes it:\n" +
         m3::cuda_policy_flags_help();
}

Options parse_args(int argc, char** argv) {
  Options o;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--backend") {
      o.backend = value();
      if (o.backend != "cpu" && o.backend != "cuda" && o.backend != "auto") {
        throw UsageError("--backend must be cpu, cuda or auto, got \"" + o.backend + "\"");
      }
    } else if (arg == "--dtype") {
      const std::string d = value();
      if (!m3::parse_weight_dtype(d, &o.dtype)) {
        throw UsageError("--dtype must be fp32 or bf16, got \"" + d + "\"");
      }
    } else if (arg == "--state-dtype") {
      const std::string d = value();
      if (!m3::parse_state_dtype(d, &o.state_dtype)) {
        throw UsageError("--state-dtype must be fp32 or bf16, got \"" + d + "\"");
      }
    } else if (arg == "--one-at-a-time") {
      o.one_at_a_time = true;
    } else if (arg == "--prefill") {
      o.prefill = true;
    } else if (arg.rfind("--cuda-", 0) == 0) {
      try {
        if (!m3::set_cuda_policy_flag(o.cuda, arg, value())) throw UsageError("unknown option " + arg);
      } catch (const std::invalid_argument& e) {
        throw UsageError(e.what());
      }
    } else if (arg == "-h" || arg == "--help") {
      o.help = true;
      return o;
    } else if (arg.size() > 1 && arg[0] == '-') {
      throw UsageError("unknown option " + arg);
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 2) {
    throw UsageError("expected MODEL_DIR and TRAJECTORY, got " + std::to_string(positional.size()) +
                     " positional argument(s)");
  }
  o.model_dir = positional[0];
  o.trajectory = positional[1];
  try {
    o.cuda.validate();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  return o;
}

// A trajectory tensor, checked for dtype and rank.
const m3::TensorView& require(const m3::SafetensorsFile& file, const char* name, m3::DType dtype,
                              size_t rank) {
  const m3::TensorView* t = file.find(name);
  if (t == nullptr) {
    throw std::runtime_error(file.path().string() + ": no tensor " + name);
  }
  if (t->dtype != dtype || t->shape.size() != rank) {
    throw std::runtime_error(file.path().string() + ": tensor " + name + " is " +
                             std::string(m3::dtype_name(t->dtype)) + " " + t->shape_str() +
                             ", expected " + std::string(m3::dtype_name(dtype)) + " of rank " +
                             std::to_string(rank));
  }
  return *t;
}

std::vector<int64_t> read_i64(const m3::TensorView& t) {
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  std::memcpy(v.data(), t.data, v.size() * sizeof(int64_t));
  return v;
}

struct Trajectory {
  int B = 0, Lp = 0, T = 0, V = 0;  // T = steps = Lp + Ln - 1
  std::vector<int64_t> greedy_ids;  // [B, T+1]
  std::vector<float> logits;        // [B, T, V]
};

Trajectory load_trajectory(const std::string& path, const m3::ModelConfig& config) {
  auto file = m3::SafetensorsFile::open(path);
  const auto& prompt = require(*file, "prompt_ids", m3::DType::I64, 2);
  const auto& logits = require(*file, "logits", m3::DType::F32, 3);
  const auto& greedy = require(*file, "greedy_ids", m3::DType::I64, 2);
  Trajectory tr;
  tr.B = static_cast<int>(prompt.shape[0]);
  tr.Lp = static_cast<int>(prompt.shape[1]);
  tr.T = static_cast<int>(greedy.shape[1]) - 1;
  tr.V = config.padded_vocab();
  const std::string where = path + ": ";
  if (tr.B < 1 || tr.Lp < 1) {
    throw std::runtime_error(where + "prompt_ids " + prompt.shape_str() + " is empty");
  }
  if (greedy.shape[0] != tr.B || greedy.shape[1] < tr.Lp) {
    throw std::runtime_error(where + "greedy_ids " + greedy.shape_str() +
                             " does not fit prompt_ids " + prompt.shape_str() +
                             " (need [B, >= Lp])");
  }
  if (tr.T < 1) throw std::runtime_error(where + "greedy_ids " + greedy.shape_str() + " has no step");
  const std::vector<int64_t> want = {tr.B, tr.T, tr.V};
  if (logits.shape != want) {
    throw std::runtime_error(where + "logits " + logits.shape_str() + ", expected [" +
                             std::to_string(tr.B) + ", " + std::to_string(tr.T) + ", " +
                             std::to_string(tr.V) + "] (B, Lp+Ln-1, padded vocab of the model)");
  }
  tr.greedy_ids = read_i64(greedy);
  const std::vector<int64_t> prompt_ids = read_i64(prompt);
  for (int b = 0; b < tr.B; ++b) {
    for (int t = 0; t <= tr.T; ++t) {
      const int64_t id = tr.greedy_ids[static_cast<size_t>(b) * (tr.T + 1) + t];
      if (id < 0 || id >= config.vocab_size) {
        throw std::runtime_error(where + "greedy_ids[" + std::to_string(b) + ", " +
                                 std::to_string(t) + "] = " + std::to_string(id) +
                                 " outside the model's vocabulary [0, " +
                                 std::to_string(config.vocab_size) + ")");
      }
      if (t < tr.Lp && id != prompt_ids[static_cast<size_t>(b) * tr.Lp + t]) {
        throw std::runtime_error(where + "greedy_ids[" + std::to_string(b) + ", " +
                                 std::to_string(t) + "] differs from prompt_ids");
      }
    }
  }
  tr.logits.resize(static_cast<size_t>(logits.numel()));
  m3::to_f32(logits, tr.logits);
  return tr;
}

struct Result {
  double max_rel_err = 0.0;
  int worst_sequence = 0, worst_step = 0;
  bool greedy_match = true;
  bool mismatch_outside_tie = false;
};

// Replays the sequences `seqs` side by side (sequence b in slot b), folding into `res`;
// with `prefill` the prompts go through one prefill() call.
void replay_batch(m3::Engine& engine, const Trajectory& tr, const std::vector<int32_t>& seqs,
                  bool prefill, Result& res) {
  const int n = static_cast<int>(seqs.size()), T = tr.T, V = tr.V;
  std::vector<int32_t> tokens(seqs.size()), sampled(seqs.size());
  std::vector<float> logits(static_cast<size_t>(n) * V);
  for (const int32_t b : seqs) {
    engine.reset(b);
    engine.set_sampling(b, m3::SamplingParams{});  // greedy
  }
  int first_step = 0;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<m3::PrefillRun> runs;
  if (prefill) {
    for (const int32_t b : seqs) {
      const int64_t* ids = tr.greedy_ids.data() + static_cast<size_t>(b) * (T + 1);
      prompts.emplace_back(ids, ids + tr.Lp);
    }
    for (int i = 0; i < n; ++i) runs.push_back({seqs[static_cast<size_t>(i)], prompts[static_cast<size_t>(i)]});
    first_step = tr.Lp - 1;  // prefill() gives that step's logits and sample
  }
  for (int t = first_step; t < T; ++t) {
    if (prefill && t == first_step) {
      engine.prefill(runs, sampled, logits);
    } else {
      for (int i = 0; i < n; ++i) {
        tokens[static_cast<size_t>(i)] = static_cast<int32_t>(tr.greedy_ids[static_cast<size_t>(seqs[i]) * (T + 1) + t]);
      }
      engine.step(seqs, tokens, sampled, logits);
    }
    for (int i = 0; i < n; ++i) {
      const int b = seqs[static_cast<size_t>(i)];
      const float* ours = logits.data() + static_cast<size_t>(i) * V;
      const float* ref = tr.logits.data() + (static_cast<size_t>(b) * T + t) * V;
      double max_diff = 0.0, max_ref = 0.0;
      for (int v = 0; v < V; ++v) {
        const double d = std::fabs(static_cast<double>(ours[v]) - ref[v]);
        max_diff = std::isnan(d) ? INFINITY : std::max(max_diff, d);
        max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[v])));
      }
      const double err = max_ref > 0.0 ? max_diff / max_ref : max_diff;
      if (!(err <= res.max_rel_err)) {  // NaN-safe: a NaN err becomes the worst
        res.max_rel_err = err;
        res.worst_sequence = b;
        res.worst_step = t;
      }
      if (t < tr.Lp - 1) continue;
      const int64_t want = tr.greedy_ids[static_cast<size_t>(b) * (T + 1) + t + 1];
      const int32_t got = sampled[static_cast<size_t>(i)];
      if (got != want) {
        res.greedy_match = false;
        const double gap = static_cast<double>(ref[want]) - ref[got];
        const bool near_tie = gap <= 2.0 * max_diff;
        if (!near_tie) res.mismatch_outside_tie = true;
        std::fprintf(stderr,
                     "m3check: sequence %d step %d: greedy id %d, reference %lld (reference "
                     "logit gap %.3g, step abs err %.3g%s)\n",
                     b, t, got, static_cast<long long>(want), gap, max_diff,
                     near_tie ? ", near tie" : "");
      }
    }
  }
}

Result replay(m3::Engine& engine, const Trajectory& tr, bool one_at_a_time, bool prefill) {
  Result res;
  std::vector<int32_t> all(static_cast<size_t>(tr.B));
  for (int b = 0; b < tr.B; ++b) all[static_cast<size_t>(b)] = b;
  if (!one_at_a_time) {
    replay_batch(engine, tr, all, prefill, res);
  } else {
    for (const int32_t b : all) replay_batch(engine, tr, {b}, prefill, res);
  }
  return res;
}

// Whether any weight is stored as BF16 or F16: then the arithmetic runs on rounded
// weights whichever engine widens them, and the bf16 tolerance applies.
bool model_stores_16bit_weights(const std::string& model_dir) {
  const m3::SafetensorsSet set = m3::SafetensorsSet::open_dir(model_dir);
  for (const auto& [name, view] : set.tensors()) {
    if (view->dtype == m3::DType::BF16 || view->dtype == m3::DType::F16) return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  try {
    opt = parse_args(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "m3check: %s\n", e.what());
    std::fputs(usage().c_str(), stderr);
    return kExitUsage;
  }
  if (opt.help) {
    std::fputs(usage().c_str(), stdout);
    return 0;
  }

  if (opt.backend == "cuda" && m3::cuda_backend_built() && !m3::cuda_backend_available()) {
    std::fprintf(stderr, "m3check: --backend cuda: no CUDA device is visible; nothing checked\n");
    return kExitNoDevice;
  }

  std::unique_ptr<m3::Engine> engine;
  Trajectory tr;
  bool stored_16bit = false;
  try {
    const m3::ModelWeights weights = m3::ModelWeights::load(opt.model_dir);
    stored_16bit = model_stores_16bit_weights(opt.model_dir);
    tr = load_trajectory(opt.trajectory, weights.config());
    m3::EngineOptions eo;
    eo.max_slots = tr.B;
    eo.weight_dtype = opt.dtype;
    eo.cuda = opt.cuda;
    eo.max_prefill_tokens = std::max(eo.max_prefill_tokens, tr.B * tr.Lp);  // all prompts in one call
    eo.state_dtype = opt.state_dtype;
    engine = m3::make_engine(opt.backend, weights, eo);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3check: %s\n", e.what());
    return kExitInput;
  }

  // The CPU engine always computes with fp32 weights, whatever --dtype says.
  const bool cuda = engine->backend() == "cuda";
  const bool bf16 = (cuda && opt.dtype == m3::WeightDType::BF16) || stored_16bit;
  const bool bf16_state = opt.state_dtype == m3::StateDType::BF16;
  const bool rounded = bf16 || bf16_state;
  // A chunked prefill on the GPU sums in another order than the step: fp32 within 1e-3.
  const double tolerance = rounded ? 3e-2 : (cuda && opt.prefill ? 1e-3 : 1e-4);
  if (!cuda && opt.dtype == m3::WeightDType::BF16) {
    std::fprintf(stderr, "m3check: the cpu backend computes in fp32; --dtype bf16 ignored\n");
  }

  Result res;
  try {
    res = replay(*engine, tr, opt.one_at_a_time, opt.prefill);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3check: %s\n", e.what());
    return kExitInput;
  }
  std::fprintf(stderr,
               "m3check: backend %s, weights %s, state %s, %d sequences x %d steps%s%s, tolerance %.0e, "
               "worst step %d of sequence %d\n",
               std::string(engine->backend()).c_str(), stored_16bit ? "stored in 16 bits" : bf16 ? "bf16" : "fp32",
               bf16_state ? "bf16" : "fp32", tr.B, tr.T, opt.one_at_a_time ? " (one at a time)" : "",
               opt.prefill ? " (prompts through prefill)" : "", tolerance, res.worst_step, res.worst_sequence);
  std::printf("max_rel_err=%.3e greedy_match=%s\n", res.max_rel_err, res.greedy_match ? "yes" : "no");
  std::fflush(stdout);
  const bool greedy_ok = res.greedy_match || (rounded && !res.mismatch_outside_tie);
  const bool ok = res.max_rel_err <= tolerance && greedy_ok;  // NaN err fails
  return ok ? 0 : kExitTolerance;
}
