#include "model/cuda_policy.h"

#include <charconv>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "model/decode_buckets.h"

namespace m3 {
namespace {

// A setting's value as text both ways, over a reference into the policy.
template <typename T>
using Access = T& (*)(CudaPolicy&);

template <typename T>
T& field(const CudaPolicy& p, Access<T> access) {
  return access(const_cast<CudaPolicy&>(p));  // read only: get() never writes
}

std::string bool_text(bool v) { return v ? "true" : "false"; }

std::string parse_bool(std::string_view t, bool* out) {
  if (t == "true" || t == "on" || t == "yes") {
    *out = true;
  } else if (t == "false" || t == "off" || t == "no") {
    *out = false;
  } else {
    return "expected true or false, got '" + std::string(t) + "'";
  }
  return {};
}

// An integer whose 0 has a name ("planned", "measure", "never"), given as either.
std::string int_text(int v, const char* zero) { return v == 0 && zero != nullptr ? zero : std::to_string(v); }

std::string parse_int(std::string_view t, const char* zero, int* out) {
  if (zero != nullptr && t == zero) {
    *out = 0;
    return {};
  }
  int v = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || ec != std::errc() || end != t.data() + t.size()) {
    return std::string("expected an integer") + (zero != nullptr ? std::string(" or ") + zero : "") + ", got '" +
           std::string(t) + "'";
  }
  *out = v;
  return {};
}

// An enumeration by its names, in the order of its values from `first`.
template <typename E>
struct Names {
  int first;
  std::vector<const char*> names;
  std::string text(E v) const {
    const int i = static_cast<int>(v) - first;
    return i >= 0 && i < static_cast<int>(names.size()) ? names[i] : std::to_string(static_cast<int>(v));
  }
  std::string parse(std::string_view t, E* out) const {
    std::string list;
    for (size_t i = 0; i < names.size(); ++i) {
      if (t == names[i]) {
        *out = static_cast<E>(first + static_cast<int>(i));
        return {};
      }
      list += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + std::string(names[i]);
    }
    return "expected " + list + ", got '" + std::string(t) + "'";
  }
};

const Names<Tuned> kTuned{0, {"measure", "off", "on"}};
const Names<PrefillPath> kPrefillPath{0, {"steps", "chunked", "auto"}};
const Names<Batch2Gemv> kBatch2Gemv{0, {"measure", "tensor_cores", "cuda_cores"}};
const Names<kernels::PdlTrigger> kPdlTrigger{0, {"at_end", "after_wait", "before_wait"}};
const Names<kernels::RecurrenceTrigger> kRecurrenceTrigger{
    -1, {"planned", "at_end", "after_wait", "before_wait", "after_inputs", "after_norms"}};
const Names<kernels::StateLoad> kStateLoad{0, {"planned", "plain", "streamed"}};

// Captureless accessors keep each setting's table entry one line of data.
#define M3_ACCESS(type, expr) [](CudaPolicy& p) -> type& { return p.expr; }

struct Table {
  std::vector<CudaPolicySetting> settings;

  void add_bool(const char* path, Access<bool> access, const char* help) {
    settings.push_back({path, help, [access](const CudaPolicy& p) { return bool_text(field(p, access)); },
                        [access](CudaPolicy& p, std::string_view t) { return parse_bool(t, &access(p)); }});
  }
  // An int whose -1 reads "planned" (the engine picks by what it runs) and 0 `zero`.
  void add_planned_int(const char* path, Access<int> access, const char* zero, const char* help) {
    settings.push_back({path, help,
                        [access, zero](const CudaPolicy& p) {
                          return field(p, access) == -1 ? std::string("planned") : int_text(field(p, access), zero);
                        },
                        [access, zero](CudaPolicy& p, std::string_view t) {
                          if (t == "planned") {
                            access(p) = -1;
                            return std::string();
                          }
                          if (parse_int(t, zero, &access(p)).empty()) return std::string();
                          return "expected an integer, " + std::string(zero) + " or planned, got '" + std::string(t) +
                                 "'";
                        }});
  }
  void add_int(const char* path, Access<int> access, const char* zero, const char* help) {
    settings.push_back({path, help, [access, zero](const CudaPolicy& p) { return int_text(field(p, access), zero); },
                        [access, zero](CudaPolicy& p, std::string_view t) { return parse_int(t, zero, &access(p)); }});
  }
  template <typename E>
  void add_enum(const char* path, std::type_identity_t<Access<E>> access, const Names<E>* names, const char* help) {
    settings.push_back({path, help, [access, names](const CudaPolicy& p) { return names->text(field(p, access)); },
                        [access, names](CudaPolicy& p, std::string_view t) { return names->parse(t, &access(p)); }});
  }
};

Table make_table() {
  Table t;
  t.add_bool("pdl", M3_ACCESS(bool, pdl), "programmatic dependent launch between the step's kernels and the prefill scan's");
  t.add_int("chains", M3_ACCESS(int, chains), "planned",
            "chains a bucket's step splits into, side by side: planned (two from batch 32 on the gemvs; one on the "
            "GEMMs, two there with bf16 state above batch 1024) or 1-4 everywhere");
  t.add_bool("next_step_prefetch", M3_ACCESS(bool, next_step_prefetch),
             "the sampling kernel pulls the next step's first weights into L2");
  t.add_int("recurrence_tensor_core_min_batch", M3_ACCESS(int, recurrence_tensor_core_min_batch), "never",
            "bf16 weights: the recurrence on tensor cores from this batch (never: CUDA cores)");
  t.add_int("recurrence_fuse_max_batch", M3_ACCESS(int, recurrence_fuse_max_batch), nullptr,
            "tensor-core recurrence: out_proj fused into it up to this batch where the step variant asks");
  t.add_planned_int("projection_gemm_min_batch", M3_ACCESS(int, projection_gemm_min_batch), "never",
                    "the step's projections as cuBLASLt GEMMs (RMSNorm in its own kernel) from this batch: planned "
                    "(128) | N | never (the gemvs at every batch)");
  t.add_int("buckets_per_octave", M3_ACCESS(int, buckets_per_octave), nullptr,
            "decode graphs between one power of two and the next from batch 64 (1, 2, 4, 8 or 16): a batch runs "
            "at the smallest that holds it");
  t.add_enum("prefill", M3_ACCESS(PrefillPath, prefill), &kPrefillPath,
             "how prefill() reads a run: auto (chunked where the model's shape allows, else steps) | steps (a "
             "decode step a token) | chunked (GEMMs and the chunked scan; refuses a shape it cannot run)");
  t.add_int("prefill_graph_max_tokens", M3_ACCESS(int, prefill_graph_max_tokens), "never",
            "chunked prefill: a call of one run up to this many tokens replays a graph captured at load for "
            "its length (never: launched kernel by kernel)");
  t.add_enum("step_variants.out_proj_fused", M3_ACCESS(Tuned, step_variants.out_proj_fused), &kTuned,
             "batch 1-2: out_proj inside the recurrence: measure (at load) | off | on");
  t.add_enum("step_variants.embedding_gathered", M3_ACCESS(Tuned, step_variants.embedding_gathered), &kTuned,
             "batch 1-2: the first in_proj gathers the embedding rows: measure | off | on (own kernel when off)");
  t.add_int("step_variants.batch1_gemv_rows_per_warp", M3_ACCESS(int, step_variants.batch1_gemv_rows_per_warp),
            "measure", "batch 1: CUDA-core gemv rows a warp: measure (2 and 4) | 2 | 4");
  t.add_enum("step_variants.batch2_gemv", M3_ACCESS(Batch2Gemv, step_variants.batch2_gemv), &kBatch2Gemv,
             "batch 2: measure | tensor_cores | cuda_cores (four rows a warp)");
  t.add_int("step_variants.fused_cluster", M3_ACCESS(int, step_variants.fused_cluster), "measure",
            "batch 1-2, out_proj fused on tensor cores: blocks a cluster sums: measure (8 and 4) | 4 | 8");
  t.add_enum("gemv.trigger", M3_ACCESS(kernels::PdlTrigger, gemv.trigger), &kPdlTrigger,
             "where a gemv lets the next kernel launch: before_wait | after_wait | at_end");
  t.add_int("gemv.batch1_rows_per_warp", M3_ACCESS(int, gemv.batch1_rows_per_warp), nullptr,
            "CUDA-core gemv rows a warp at batch 1 where no step variant sets them: 2 | 4");
  t.add_int("gemv.tensor_core_min_batch", M3_ACCESS(int, gemv.tensor_core_min_batch), nullptr,
            "bf16 weights: gemvs on tensor cores from this batch");
  t.add_int("gemv.row_block_min_batch", M3_ACCESS(int, gemv.row_block_min_batch), "never",
            "the 128-row tensor-core gemv from this batch (never: the 16-row one only)");
  t.add_int("gemv.row_block_cluster", M3_ACCESS(int, gemv.row_block_cluster), "planned",
            "128-row gemv: blocks a cluster splits the columns over: planned | 2 | 4 | 8");
  t.add_int("gemv.row_block_batch_tile", M3_ACCESS(int, gemv.row_block_batch_tile), "planned",
            "128-row gemv: batch tile: planned | 8 | 16 | 32 | 64");
  t.add_enum("recurrence.trigger", M3_ACCESS(kernels::RecurrenceTrigger, recurrence.trigger), &kRecurrenceTrigger,
             "where the recurrence lets the next kernel launch: planned (by batch) | at_end | after_wait | "
             "before_wait | after_inputs | after_norms");
  t.add_enum("recurrence.state_load", M3_ACCESS(kernels::StateLoad, recurrence.state_load), &kStateLoad,
             "tensor-core recurrence's state loads: planned (streamed in one chain up to batch 16, fp32 state) | plain | streamed");
  t.add_int("recurrence.tc_column_split", M3_ACCESS(int, recurrence.tc_column_split), "planned",
            "tensor-core recurrence: warps a 16-row tile: planned | 1 | 2 | 4");
  t.add_int("recurrence.small_batch_rows", M3_ACCESS(int, recurrence.small_batch_rows), nullptr,
            "CUDA-core recurrence: state rows a block below batch 8: 16 | 8");
  t.add_int("recurrence.whole_head_min_batch", M3_ACCESS(int, recurrence.whole_head_min_batch), nullptr,
            "CUDA-core recurrence: a whole head a block from this batch");
  t.add_int("recurrence.streaming_min_batch", M3_ACCESS(int, recurrence.streaming_min_batch), "never",
            "tensor-core recurrence: the streaming kernel (persistent blocks, state staged ahead) from this batch");
  return t;
}

#undef M3_ACCESS

const CudaPolicySetting* find(std::string_view path) {
  for (const CudaPolicySetting& s : cuda_policy_settings()) {
    if (s.path == path) return &s;
  }
  return nullptr;
}

void refuse(const std::string& field, const std::string& rule, int value) {
  throw std::invalid_argument("cuda." + field + " must be " + rule + ", got " + std::to_string(value));
}

}  // namespace

const std::vector<CudaPolicySetting>& cuda_policy_settings() {
  static const std::vector<CudaPolicySetting> kSettings = make_table().settings;
  return kSettings;
}

void CudaPolicy::validate() const {
  if (chains < 0 || chains > 4) refuse("chains", "0 (planned) or 1 to 4", chains);
  if (recurrence_tensor_core_min_batch < 0) {
    refuse("recurrence_tensor_core_min_batch", "0 (never) or more", recurrence_tensor_core_min_batch);
  }
  if (prefill != PrefillPath::Steps && prefill != PrefillPath::Chunked && prefill != PrefillPath::Auto) {
    refuse("prefill", "steps, chunked or auto", static_cast<int>(prefill));
  }
  if (prefill_graph_max_tokens < 0 || prefill_graph_max_tokens > kMaxPrefillGraphTokens) {
    refuse("prefill_graph_max_tokens", "0 (never) to " + std::to_string(kMaxPrefillGraphTokens),
           prefill_graph_max_tokens);
  }
  if (recurrence_fuse_max_batch < 0) refuse("recurrence_fuse_max_batch", "0 or more", recurrence_fuse_max_batch);
  if (projection_gemm_min_batch < -1) {
    refuse("projection_gemm_min_batch", "-1 (planned), 0 (never) or more", projection_gemm_min_batch);
  }
  if (!decode_buckets_refusal(buckets_per_octave).empty()) refuse("buckets_per_octave", "1, 2, 4, 8 or 16", buckets_per_octave);
  const StepVariantPolicy& v = step_variants;
  if (v.batch1_gemv_rows_per_warp != 0 && v.batch1_gemv_rows_per_warp != 2 && v.batch1_gemv_rows_per_warp != 4) {
    refuse("step_variants.batch1_gemv_rows_per_warp", "0 (measure), 2 or 4", v.batch1_gemv_rows_per_warp);
  }
  if (v.fused_cluster != 0 && v.fused_cluster != 4 && v.fused_cluster != 8) {
    refuse("step_variants.fused_cluster", "0 (measure), 4 or 8", v.fused_cluster);
  }
  if (const std::string why = kernels::gemv_policy_refusal(gemv); !why.empty()) {
    throw std::invalid_argument("cuda.gemv." + why);
  }
  if (const std::string why = kernels::mimo_step_policy_refusal(recurrence); !why.empty()) {
    throw std::invalid_argument("cuda.recurrence." + why);
  }
}

bool CudaPolicy::operator==(const CudaPolicy& o) const { return to_string(*this) == to_string(o); }

std::string cuda_policy_flag(std::string_view path) {
  std::string flag = "--cuda-" + std::string(path);
  for (char& c : flag) {
    if (c == '_' || c == '.') c = '-';
  }
  return flag;
}

std::string set_cuda_policy_value(CudaPolicy& policy, std::string_view path, std::string_view text) {
  const CudaPolicySetting* s = find(path);
  if (s == nullptr) {
    std::string known;
    for (const CudaPolicySetting& k : cuda_policy_settings()) known += (known.empty() ? "" : ", ") + k.path;
    return "unknown key 'cuda." + std::string(path) + "' (known under cuda: " + known + ")";
  }
  return s->set(policy, text);
}

bool set_cuda_policy_flag(CudaPolicy& policy, std::string_view flag, std::string_view value) {
  for (const CudaPolicySetting& s : cuda_policy_settings()) {
    if (cuda_policy_flag(s.path) != flag) continue;
    if (std::string why = s.set(policy, value); !why.empty()) {
      throw std::invalid_argument(std::string(flag) + ": " + why);
    }
    return true;
  }
  return false;
}

std::string cuda_policy_flags_help() {
  std::string out;
  for (const CudaPolicySetting& s : cuda_policy_settings()) {
    const std::string f = cuda_policy_flag(s.path);
    out += "  " + f + std::string(f.size() < 48 ? 48 - f.size() : 1, ' ') + s.help + "\n";
  }
  return out;
}

std::string to_string(const CudaPolicy& policy) {
  std::string out;
  for (const CudaPolicySetting& s : cuda_policy_settings()) {
    out += (out.empty() ? "" : " ") + s.path + "=" + s.get(policy);
  }
  return out;
}

}  // namespace m3
