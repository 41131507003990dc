#include "kernels/embedding.cuh"

#include <stdexcept>
#include <string>

#include "kernels/common.cuh"

namespace m3::kernels {
namespace {

template <typename W>
struct EmbeddingParams {
  const W* table;
  int vocab_rows, dim;
  const int32_t* slots;
  const int32_t* tokens;
  const int32_t* last_token;
  float* out;
  L2Prefetch prefetch[2];
};

template <typename W>
__global__ void embedding_kernel(const EmbeddingParams<W> p) {
  prefetch_l2(p.prefetch[0]);
  prefetch_l2(p.prefetch[1]);
  wait_for_previous_kernel();
  allow_next_kernel();  // the first layer's in_proj loads its weights while the rows are copied
  const int b = blockIdx.y;
  const int token = step_input_token(p.tokens, p.last_token, p.slots, b, p.vocab_rows);
  const W* row = p.table + static_cast<size_t>(token) * p.dim;
  float* out = p.out + static_cast<size_t>(b) * p.dim;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.dim; i += gridDim.x * blockDim.x) {
    out[i] = load1(row + i);
  }
}

template <typename W>
KernelLaunch plan_typed(const EmbeddingArgs& a) {
  EmbeddingParams<W> p{static_cast<const W*>(a.table), a.vocab_rows, a.dim, a.slots,
                       a.tokens, a.last_token, a.out, {a.prefetch[0], a.prefetch[1]}};
  const int threads = 256;
  const int blocks_x = (a.dim + threads - 1) / threads;
  return KernelLaunch::make("embedding", embedding_kernel<W>, dim3(blocks_x, a.batch),
                            dim3(threads), 0, p);
}

}  // namespace

KernelLaunch plan_embedding(const EmbeddingArgs& a) {
  if (a.batch <= 0 || a.dim <= 0 || a.vocab_rows <= 0) {
    throw std::invalid_argument("plan_embedding: batch " + std::to_string(a.batch) + ", dim " +
                                std::to_string(a.dim) + ", vocab rows " +
                                std::to_string(a.vocab_rows) + " must be positive");
  }
  return a.type == WeightDType::BF16 ? plan_typed<__nv_bfloat16>(a) : plan_typed<float>(a);
}

}  // namespace m3::kernels
