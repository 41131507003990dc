// y (+)= x W^T over a block of rows through cuBLASLt, for the prefill projections (in_proj,
// out_proj, fc1, fc2) and the decode step's at large batches: W is [out_features,
// in_features] row-major (bf16 or fp32, as the engine's weights), x is [rows, x_stride] in
// the weights' type, y is [rows, y_stride] fp32 (accumulate: y += x W^T, the residual add of
// out_proj and fc2).
//
// Everything cuBLASLt chooses is chosen at construction (load), so run() only looks its
// row count up. Either the row counts are bucketed (lt_gemm_padded_rows): a call computes
// all rows of its bucket, so x and y must hold lt_gemm_padded_rows(max_rows) rows and the
// rows past `rows` read and write scratch that nothing else reads; or the shape lists the
// exact row counts it takes (the decode step's chains, whose rows lie next to another
// chain's): a call then touches its `rows` rows only. fp32 weights compute in fp32 (no tf32).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "kernels/weight_dtype.h"

namespace m3::kernels {

// Rows a call of `rows` rows computes: a multiple of 16 up to 128, of 64 up to 1024, of
// 256 beyond.
int lt_gemm_padded_rows(int rows);

// A cuBLASLt handle and the workspace its matmuls share (one stream at a time), made once.
// GEMMs on different streams at once each need a context of their own (its workspace).
class LtContext {
 public:
  static constexpr size_t kWorkspaceBytes = 32u << 20;
  explicit LtContext(size_t workspace_bytes = kWorkspaceBytes);
  ~LtContext();
  LtContext(const LtContext&) = delete;
  LtContext& operator=(const LtContext&) = delete;
  void* handle() const { return handle_; }
  void* workspace() const { return workspace_; }
  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  void* handle_ = nullptr;  // cublasLtHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

struct LtGemmShape {
  int out_features = 0, in_features = 0;
  int max_rows = 0;  // the largest `rows` run() takes
  WeightDType type = WeightDType::BF16;
  int x_stride = 0;  // elements; a multiple of 8 (16-byte rows)
  int y_stride = 0;  // a multiple of 4 (16-byte rows)
  bool accumulate = false;
  // The exact row counts run() takes (each at most max_rows); empty: any count up to
  // max_rows, computed in buckets of lt_gemm_padded_rows.
  std::vector<int> row_counts;
};

// "" when LtGemm takes the shape, else why not ("in_features and x_stride must be ...").
std::string lt_gemm_shape_refusal(const LtGemmShape& shape);

class LtGemm {
 public:
  // Throws with the shape when cuBLASLt has no algorithm for a bucket.
  LtGemm(const LtContext& context, const LtGemmShape& shape);
  ~LtGemm();
  LtGemm(LtGemm&&) noexcept;
  LtGemm& operator=(LtGemm&&) noexcept;
  const LtGemmShape& shape() const;
  // weight, x and y 16-byte aligned; 1 <= rows <= shape.max_rows (one of shape.row_counts
  // where it lists them).
  void run(const void* weight, const void* x, float* y, int rows, cudaStream_t stream) const;
  // The same split for callers that replay one row count (the decode step's planned
  // launches): bucket_of(rows) checks `rows` as run() does and finds its plan once, at
  // planning; run_bucket then only checks the pointers and calls cuBLASLt.
  int bucket_of(int rows) const;
  void run_bucket(int bucket, const void* weight, const void* x, float* y, cudaStream_t stream) const;
  // One call at every row bucket, so that each bucket's kernel is loaded before the first
  // real call needs it (CUDA loads a kernel's module at its first launch, several
  // milliseconds for a cuBLASLt kernel). x and y as for run() at max_rows.
  void run_every_bucket(const void* weight, const void* x, float* y, cudaStream_t stream) const;

 private:
  struct Plan;
  std::unique_ptr<Plan> plan_;
};

}  // namespace m3::kernels
