// The operands of every gemv kernel (GemvArgs with the weight typed): the first part of
// each kernel's parameter block, so the kernels share one definition of them.
#pragma once

#include "kernels/embedding.cuh"  // step_input_token
#include "kernels/gemv.cuh"
#include "kernels/launch.cuh"

namespace m3::kernels {

template <typename W>
struct GemvOperands {
  const W* weight;  // [rows, cols] row-major
  int out_rows, cols;
  const float* x;   // [batch, x_stride]
  int x_stride;
  const float* norm_weight;  // [cols] or nullptr
  float norm_eps;
  float* y;         // [batch, y_stride]
  int y_stride;
  int batch;
  int trigger_point;  // GemvPolicy::trigger
};

// GemvGather with the table typed; the last member of a kernel's parameter block (after
// the kernel's own parameters), so the kernels that do not gather see their parameters
// where they always were.
template <typename W>
struct GemvGatherOperands {
  const W* table;  // nullptr: x is read from `x`
  int vocab_rows;
  const int32_t* slots;
  const int32_t* tokens;
  const int32_t* last_token;
  float* rows_out;
};

template <typename W>
GemvOperands<W> gemv_operands(const GemvArgs& a) {
  return GemvOperands<W>{static_cast<const W*>(a.weight), a.out_rows, a.cols, a.x, a.x_stride,
                         a.norm_weight, a.norm_eps, a.y, a.y_stride, a.batch,
                         static_cast<int>(a.policy.trigger)};
}

template <typename W>
GemvGatherOperands<W> gemv_gather_operands(const GemvArgs& a) {
  const GemvGather& g = a.gather;
  return GemvGatherOperands<W>{static_cast<const W*>(g.table), g.vocab_rows, g.slots, g.tokens, g.last_token,
                               g.rows_out};
}

#if defined(__CUDACC__)
// Where input row b of a gemv starts when gathering (kGather: a kernel variant of its own,
// so the others keep their registers): the embedding row of the entry's token. Call after
// the PDL wait: the tokens and the slots' last ids are written by earlier work.
template <bool kGather, typename W>
__device__ __forceinline__ const W* gemv_gather_row(const GemvOperands<W>& p, const GemvGatherOperands<W>& g,
                                                    int b) {
  if constexpr (!kGather) return nullptr;
  return g.table + (size_t)step_input_token(g.tokens, g.last_token, g.slots, b, g.vocab_rows) * p.cols;
}

// Elements 4i .. 4i + 3 of input row b: from x, or (gathering) from the embedding row
// `row` (gemv_gather_row), which `keep` (the first row block of each batch tile) also
// writes, in fp32, to rows_out, so the later kernels find it in the residual stream.
template <bool kGather, typename W>
__device__ __forceinline__ float4 gemv_input4(const GemvOperands<W>& p, const GemvGatherOperands<W>& g,
                                              const W* row, int b, int i, bool keep) {
  if constexpr (!kGather) return reinterpret_cast<const float4*>(p.x + (size_t)b * p.x_stride)[i];
  float4 v;
  if constexpr (sizeof(W) == 2) {
    const uint2 raw = reinterpret_cast<const uint2*>(row)[i];
    v = make_float4(__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                    __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u));
  } else {
    v = reinterpret_cast<const float4*>(row)[i];
  }
  if (keep) reinterpret_cast<float4*>(g.rows_out + (size_t)b * p.x_stride)[i] = v;
  return v;
}
#endif

}  // namespace m3::kernels
