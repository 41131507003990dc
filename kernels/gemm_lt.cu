#include "kernels/gemm_lt.cuh"

#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/common.cuh"

namespace m3::kernels {
namespace {

// cuBLASLt is opened at run time, when the first GEMM context is made, not linked: its 94 KB
// of static thread-local storage, taken from every thread's stack when the library is
// linked, left civetweb's small worker stacks (the /metrics exposer) too small to start.
// A library opened with dlopen gets its thread-local storage allocated apart.
struct LtApi {
  decltype(&::cublasLtCreate) cublasLtCreate = nullptr;
  decltype(&::cublasLtDestroy) cublasLtDestroy = nullptr;
  decltype(&::cublasLtMatmul) cublasLtMatmul = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) cublasLtMatmulAlgoGetHeuristic = nullptr;
  decltype(&::cublasLtMatmulDescCreate) cublasLtMatmulDescCreate = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) cublasLtMatmulDescDestroy = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) cublasLtMatmulDescSetAttribute = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) cublasLtMatmulPreferenceCreate = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) cublasLtMatmulPreferenceDestroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) cublasLtMatmulPreferenceSetAttribute = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) cublasLtMatrixLayoutCreate = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) cublasLtMatrixLayoutDestroy = nullptr;
};

LtApi load_lt_api() {
  void* lib = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error(std::string("prefill GEMM: cannot open libcublasLt.so.13 (CUDA 13's cuBLASLt): ") +
                             (why != nullptr ? why : "unknown error"));
  }
  auto symbol = [lib](const char* name) {
    void* f = dlsym(lib, name);
    if (f == nullptr) throw std::runtime_error(std::string("prefill GEMM: libcublasLt.so.13 has no ") + name);
    return f;
  };
  LtApi api;
  api.cublasLtCreate = reinterpret_cast<decltype(&::cublasLtCreate)>(symbol("cublasLtCreate"));
  api.cublasLtDestroy = reinterpret_cast<decltype(&::cublasLtDestroy)>(symbol("cublasLtDestroy"));
  api.cublasLtMatmul = reinterpret_cast<decltype(&::cublasLtMatmul)>(symbol("cublasLtMatmul"));
  api.cublasLtMatmulAlgoGetHeuristic = reinterpret_cast<decltype(&::cublasLtMatmulAlgoGetHeuristic)>(symbol("cublasLtMatmulAlgoGetHeuristic"));
  api.cublasLtMatmulDescCreate = reinterpret_cast<decltype(&::cublasLtMatmulDescCreate)>(symbol("cublasLtMatmulDescCreate"));
  api.cublasLtMatmulDescDestroy = reinterpret_cast<decltype(&::cublasLtMatmulDescDestroy)>(symbol("cublasLtMatmulDescDestroy"));
  api.cublasLtMatmulDescSetAttribute = reinterpret_cast<decltype(&::cublasLtMatmulDescSetAttribute)>(symbol("cublasLtMatmulDescSetAttribute"));
  api.cublasLtMatmulPreferenceCreate = reinterpret_cast<decltype(&::cublasLtMatmulPreferenceCreate)>(symbol("cublasLtMatmulPreferenceCreate"));
  api.cublasLtMatmulPreferenceDestroy = reinterpret_cast<decltype(&::cublasLtMatmulPreferenceDestroy)>(symbol("cublasLtMatmulPreferenceDestroy"));
  api.cublasLtMatmulPreferenceSetAttribute = reinterpret_cast<decltype(&::cublasLtMatmulPreferenceSetAttribute)>(symbol("cublasLtMatmulPreferenceSetAttribute"));
  api.cublasLtMatrixLayoutCreate = reinterpret_cast<decltype(&::cublasLtMatrixLayoutCreate)>(symbol("cublasLtMatrixLayoutCreate"));
  api.cublasLtMatrixLayoutDestroy = reinterpret_cast<decltype(&::cublasLtMatrixLayoutDestroy)>(symbol("cublasLtMatrixLayoutDestroy"));
  return api;  // the library stays open for the process's life, as a linked one would
}

const LtApi& lt_api() {
  static const LtApi api = load_lt_api();
  return api;
}

void check_lt(cublasStatus_t status, const char* what, const std::string& context) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error("cuBLASLt " + std::string(what) + " failed (" + context + "): status " +
                             std::to_string(static_cast<int>(status)));
  }
}

std::string describe(const LtGemmShape& s) {
  return "gemm " + std::to_string(s.out_features) + "x" + std::to_string(s.in_features) + ", up to " +
         std::to_string(s.max_rows) + " rows, " + (s.type == WeightDType::BF16 ? "bf16" : "fp32") +
         (s.accumulate ? ", accumulating" : "");
}

}  // namespace

std::string lt_gemm_shape_refusal(const LtGemmShape& s) {
  if (s.out_features <= 0 || s.in_features <= 0 || s.max_rows <= 0) return "sizes must be positive";
  if (s.x_stride < s.in_features || s.y_stride < s.out_features) return "the row strides must cover the rows";
  if (s.x_stride % 8 != 0 || s.in_features % 8 != 0 || s.y_stride % 4 != 0) {
    return "in_features and x_stride must be multiples of 8, y_stride of 4 (16-byte rows)";
  }
  for (const int rows : s.row_counts) {
    if (rows <= 0 || rows > s.max_rows) return "a listed row count (" + std::to_string(rows) + ") outside 1 to max_rows";
  }
  return "";
}

int lt_gemm_padded_rows(int rows) {
  if (rows <= 128) return (rows + 15) / 16 * 16;
  if (rows <= 1024) return (rows + 63) / 64 * 64;
  return (rows + 255) / 256 * 256;
}

LtContext::LtContext(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  cublasLtHandle_t h = nullptr;
  check_lt(lt_api().cublasLtCreate(&h), "cublasLtCreate", "GEMM context");
  handle_ = h;
  const cudaError_t err = cudaMalloc(&workspace_, workspace_bytes_);
  if (err != cudaSuccess) {
    lt_api().cublasLtDestroy(h);
    check_cuda(err, "cudaMalloc(cuBLASLt workspace)", __FILE__, __LINE__);
  }
}

LtContext::~LtContext() {
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) lt_api().cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

struct LtGemm::Plan {
  struct Bucket {
    int rows = 0;
    cublasLtMatrixLayout_t x = nullptr, y = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  LtGemmShape shape;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w = nullptr;
  std::vector<Bucket> buckets;  // ascending rows
  ~Plan() {
    for (Bucket& b : buckets) {
      if (b.x != nullptr) lt_api().cublasLtMatrixLayoutDestroy(b.x);
      if (b.y != nullptr) lt_api().cublasLtMatrixLayoutDestroy(b.y);
    }
    if (w != nullptr) lt_api().cublasLtMatrixLayoutDestroy(w);
    if (desc != nullptr) lt_api().cublasLtMatmulDescDestroy(desc);
  }
};

LtGemm::LtGemm(const LtContext& context, const LtGemmShape& s) : plan_(std::make_unique<Plan>()) {
  const std::string what = describe(s);
  if (const std::string refusal = lt_gemm_shape_refusal(s); !refusal.empty()) {
    throw std::invalid_argument(what + ": " + refusal);
  }
  Plan& p = *plan_;
  p.shape = s;
  std::sort(p.shape.row_counts.begin(), p.shape.row_counts.end());
  p.shape.row_counts.erase(std::unique(p.shape.row_counts.begin(), p.shape.row_counts.end()), p.shape.row_counts.end());
  p.handle = static_cast<cublasLtHandle_t>(context.handle());
  p.workspace = context.workspace();
  p.workspace_bytes = context.workspace_bytes();
  const cudaDataType_t wt = s.type == WeightDType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  check_lt(lt_api().cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate", what);
  // Column-major view: y^T [out, rows] = W^T^T [in, out]^T . x^T [in, rows].
  const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
  check_lt(lt_api().cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)), "TRANSA", what);
  check_lt(lt_api().cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof(no_trans)), "TRANSB",
           what);
  check_lt(lt_api().cublasLtMatrixLayoutCreate(&p.w, wt, s.in_features, s.out_features, s.in_features), "layout W", what);

  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(lt_api().cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate", what);
  const uint64_t ws_bytes = p.workspace_bytes;
  const uint32_t align = 16;
  lt_api().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    lt_api().cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align));
  }
  // The row counts to plan: the listed ones, or every bucket up to max_rows.
  std::vector<int> counts = p.shape.row_counts;
  if (counts.empty()) {
    for (int rows = lt_gemm_padded_rows(1);; rows = lt_gemm_padded_rows(rows + 1)) {
      counts.push_back(rows);
      if (rows >= s.max_rows) break;
    }
  }
  try {
    for (const int rows : counts) {
      Plan::Bucket b;
      b.rows = rows;
      p.buckets.push_back(b);
      Plan::Bucket& nb = p.buckets.back();
      check_lt(lt_api().cublasLtMatrixLayoutCreate(&nb.x, wt, s.in_features, rows, s.x_stride), "layout x", what);
      check_lt(lt_api().cublasLtMatrixLayoutCreate(&nb.y, CUDA_R_32F, s.out_features, rows, s.y_stride), "layout y", what);
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      check_lt(lt_api().cublasLtMatmulAlgoGetHeuristic(p.handle, p.desc, p.w, nb.x, nb.y, nb.y, pref, 1, &result, &found),
               "AlgoGetHeuristic", what + " at " + std::to_string(rows) + " rows");
      if (found == 0) {
        throw std::runtime_error("cuBLASLt has no algorithm for " + what + " at " + std::to_string(rows) + " rows");
      }
      nb.algo = result.algo;
    }
  } catch (...) {
    lt_api().cublasLtMatmulPreferenceDestroy(pref);
    throw;
  }
  lt_api().cublasLtMatmulPreferenceDestroy(pref);
}

LtGemm::~LtGemm() = default;
LtGemm::LtGemm(LtGemm&&) noexcept = default;
LtGemm& LtGemm::operator=(LtGemm&&) noexcept = default;

const LtGemmShape& LtGemm::shape() const { return plan_->shape; }

int LtGemm::bucket_of(int rows) const {
  const Plan& p = *plan_;
  if (rows <= 0 || rows > p.shape.max_rows) {
    throw std::invalid_argument(describe(p.shape) + ": called with " + std::to_string(rows) + " rows");
  }
  const bool exact = !p.shape.row_counts.empty();
  const int wanted = exact ? rows : lt_gemm_padded_rows(rows);
  size_t i = 0;
  while (i < p.buckets.size() && p.buckets[i].rows < wanted) ++i;  // bucketed: the last covers max_rows
  if (i == p.buckets.size() || (exact && p.buckets[i].rows != rows)) {
    throw std::invalid_argument(describe(p.shape) + ": called with " + std::to_string(rows) +
                                " rows, not one of the row counts it was planned for");
  }
  return static_cast<int>(i);
}

void LtGemm::run(const void* weight, const void* x, float* y, int rows, cudaStream_t stream) const {
  run_bucket(bucket_of(rows), weight, x, y, stream);
}

void LtGemm::run_bucket(int bucket, const void* weight, const void* x, float* y, cudaStream_t stream) const {
  const Plan& p = *plan_;
  if ((reinterpret_cast<uintptr_t>(weight) | reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y)) % 16 != 0) {
    throw std::invalid_argument(describe(p.shape) + ": weight, x and y must be 16-byte aligned");
  }
  const Plan::Bucket& b = p.buckets[bucket];
  const float alpha = 1.f, beta = p.shape.accumulate ? 1.f : 0.f;
  const cublasStatus_t status = lt_api().cublasLtMatmul(p.handle, p.desc, &alpha, weight, p.w, x, b.x, &beta, y, b.y, y,
                                                        b.y, &b.algo, p.workspace, p.workspace_bytes, stream);
  // The message is built only on failure: a call allocates nothing on the host.
  if (status != CUBLAS_STATUS_SUCCESS) check_lt(status, "Matmul", describe(p.shape));
}

void LtGemm::run_every_bucket(const void* weight, const void* x, float* y, cudaStream_t stream) const {
  for (const Plan::Bucket& b : plan_->buckets) run(weight, x, y, std::min(b.rows, plan_->shape.max_rows), stream);
}

}  // namespace m3::kernels
