// What the two register-fragment chunk kernels share (kernels/prefill_chunk_state_tc.cu and
// kernels/prefill_chunk_output_tc.cu): the block's shape, the staging copies, the fragment
// loads and the product of a warp's q rows with rows of a staged matrix. Internal to the
// prefill scan; the interface is kernels/prefill_scan.cuh.
//
// The layout the kernels rely on: in an A fragment of mma m16n8k16 lane (g, c) holds columns
// 16 kt + 2c, +1 and +8, +9 of rows g and g + 8; a MIMO rotation pairs entry n with n + N/2,
// which for N a multiple of 32 is tile kt + N/32 at the same place, so each lane holds both
// entries of every pair it rotates.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/mma_bf16.cuh"
#include "kernels/prefill_chunk.cuh"

namespace m3::kernels::prefill_detail::tc {

inline constexpr int kRows = kPrefillRowsBf16;  // (token, rank) rows of a chunk
inline constexpr int kThreads = kRows * 2;      // a warp per 16 rows
inline constexpr int kMaxPT = kMaxP / 8;        // 8-column tiles of y
// Row strides 4 words past a multiple of 32 words: the fragment loads and stores are free
// of bank conflicts.
inline constexpr int kLdK = kMaxN + 8;  // k [rows][n], 16-bit
inline constexpr int kLdS = kMaxN + 8;  // S~ [p][n], bf16

// Byte offsets of a kernel's shared-memory areas, laid out in the order they are taken.
class SmemPlan {
 public:
  int take(int bytes) {
    const int o = at_;
    at_ += (bytes + 15) & ~15;
    return o;
  }
  int bytes() const { return at_; }

 private:
  int at_ = 0;
};

// Halves between rows of the fp16 cos and sin tables: the angles rounded up to 8, so that a
// row's eight-entry pieces are whole (the padding is the identity).
inline int rotation_table_width(int n_angles) { return (n_angles + 7) & ~7; }

__device__ __forceinline__ float2 ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }

// a / b for 0 <= a < 2^21 and 0 < b < 256 through the fast float division (a product with an
// approximate reciprocal, 2 ulp): (a + 0.5) / b lies at least 0.5 / b from an integer, and the
// quotient's error, under (a / b) 2^-22, is below that for every such a, so truncation is
// exact. An integer division by a value known only at run time is some 20 instructions, and
// the IEEE reciprocal adds a range test and a branch.
__device__ __forceinline__ int div_small(int a, int b) {
  return __float2int_rz(__fdividef(static_cast<float>(a) + 0.5f, static_cast<float>(b)));
}

// 2^x by the hardware's approximation (2 ulp), subnormal results flushed to zero (exp2f and
// __expf add a rescaling for them).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float exp_fast(float x) { return exp2_ftz(x * 1.4426950408889634f); }

// silu in fast-math form, for kernels whose result is rounded to bf16: the IEEE division and
// expf are some 25 instructions an element. __fdividef gives 0 once 1 + e^-v passes 2^126,
// the limit of v e^v.
__device__ __forceinline__ float silu_fast(float v) { return __fdividef(v, 1.0f + exp_fast(-v)); }

__device__ __forceinline__ uint32_t half2_bits(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __half2 bits_half2(uint32_t v) { return *reinterpret_cast<__half2*>(&v); }
__device__ __forceinline__ float2 half2_bits_to_float2(uint32_t bits) { return __half22float2(bits_half2(bits)); }

// Rows [0, rows) of row_bytes (a multiple of 16, at most 16 * kThreads) from src, src_ld
// bytes apart, to dst, dst_ld bytes apart, in 16-byte cp.async pieces; rows from `valid` on
// become zeros. A thread keeps one piece of a row and walks the rows.
__device__ __forceinline__ void copy_rows(unsigned char* dst, int dst_ld, const void* src, int64_t src_ld, int rows,
                                          int valid, int row_bytes) {
  const int pieces = row_bytes >> 4, rows_per_pass = div_small(kThreads, pieces);
  const int first = div_small(threadIdx.x, pieces), pc = threadIdx.x - first * pieces;
  if (first >= rows_per_pass) return;
  // Both sides advance by pointer: a piece is its copy, an add each and a test.
  const char* from = static_cast<const char*>(src) + pc * 16 + first * src_ld;
  unsigned char* to = dst + first * dst_ld + pc * 16;
  const int64_t from_step = rows_per_pass * src_ld;
  const int to_step = rows_per_pass * dst_ld;
  for (int row = first; row < rows; row += rows_per_pass, from += from_step, to += to_step) {
    if (row < valid) {
      cp_async16(to, from);
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// The chunk's token terms into shared memory: L, gamma, u, `tokens` floats apart.
__device__ __forceinline__ void stage_token_terms(const PrefillScanArgs& a, const ChunkPlace& cp, int h, float* L) {
  const int tokens = kRows / a.dims.rank;
  chunk_token_terms(a, cp, h, L, L + tokens, L + 2 * tokens);
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// One row's normed C entries (fp16 bits) as this lane holds them in an A fragment:
// raw[hh][kt][hf] packs columns n, n+1 with n = (hh * H2 + kt) * 16 + 2c + 8 hf. Zeros for
// a row past the chunk's tokens.
// The lane's words lie at fixed offsets from one pointer, so each load is one instruction.
template <int kH2>
__device__ __forceinline__ void load_q_row(const __half* row, int c, bool valid, uint32_t (&raw)[2][kH2][2]) {
  const unsigned int* words = reinterpret_cast<const unsigned int*>(row + 2 * c);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
    for (int kt = 0; kt < kH2; ++kt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) raw[hh][kt][hf] = valid ? __ldg(words + (hh * kH2 + kt) * 8 + 4 * hf) : 0u;
    }
  }
}

// The fp16 tables of the rotations, from global memory: cos and sin of each token's angles
// in pairs (angles past S up to ldr the identity, tokens past the chunk's zeros), B's bias
// and, with_c_bias, C's after it. Every load of a thread is issued before its first store,
// so the block waits on one round trip for them, beside its cp.async copies.
template <int kTokens, int kN>
__device__ __forceinline__ void load_rotation_tables(const PrefillScanArgs& a, const ChunkPlace& cp, int h, uint32_t* cs,
                                                     uint32_t* sn, uint2* b16, int ldr, bool with_c_bias) {
  constexpr int kMaxAngles = kTokens * kN / 4, kMaxBias = 2 * 8 * kN / 4;  // pairs of angles; float4 of biases (R <= 8)
  constexpr int kAngleLoads = (kMaxAngles + kThreads - 1) / kThreads, kBiasLoads = (kMaxBias + kThreads - 1) / kThreads;
  const int H = a.dims.heads, S = a.dims.n_angles, RN = a.dims.rank * kN;
  const int pairs = ldr / 2, angle_tasks = kTokens * pairs, bias_tasks = (with_c_bias ? 2 : 1) * RN / 4;
  float4 ang[kAngleLoads], bias[kBiasLoads];
#pragma unroll
  for (int i = 0; i < kAngleLoads; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int t = div_small(idx, max(pairs, 1)), j = 2 * (idx - t * pairs);
    ang[i] = make_float4(1.f, 0.f, 1.f, 0.f);  // cos_j, sin_j, cos_j+1, sin_j+1
    if (idx < angle_tasks && t >= cp.len) ang[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (idx < angle_tasks && t < cp.len && j < S) {
      ang[i] = __ldg(reinterpret_cast<const float4*>(a.ws.rot + ((int64_t)(cp.first + t) * H + h) * S + j));
    }
  }
#pragma unroll
  for (int i = 0; i < kBiasLoads; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx < bias_tasks) {
      const float* src = idx < RN / 4 ? a.B_bias + (int64_t)h * RN + 4 * idx : a.C_bias + (int64_t)h * RN + 4 * idx - RN;
      bias[i] = __ldg(reinterpret_cast<const float4*>(src));
    }
  }
#pragma unroll
  for (int i = 0; i < kAngleLoads; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx < angle_tasks) {
      cs[idx] = half2_bits(__floats2half2_rn(ang[i].x, ang[i].z));
      sn[idx] = half2_bits(__floats2half2_rn(ang[i].y, ang[i].w));
    }
  }
#pragma unroll
  for (int i = 0; i < kBiasLoads; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx < bias_tasks) {
      b16[idx] = make_uint2(half2_bits(__floats2half2_rn(bias[i].x, bias[i].y)),
                            half2_bits(__floats2half2_rn(bias[i].z, bias[i].w)));
    }
  }
}

// (x0, x1) rotated by (c, s), two pairs at once.
__device__ __forceinline__ void rotate_h2(__half2 x0, __half2 x1, __half2 c, __half2 s, __half2& v0, __half2& v1) {
  v0 = __hfma2(x0, c, __hneg2(__hmul2(x1, s)));
  v1 = __hfma2(x0, s, __hmul2(x1, c));
}

// The type of the 16-bit operands of q_times_rows (q is always fp16).
enum class Operands { F16, F16AsBf16 };

__device__ __forceinline__ uint32_t f16x2_to_bf16x2(uint32_t bits) {
  const float2 f = half2_bits_to_float2(bits);
  return pack_bf16(f.x, f.y);
}

// The staged normed B rows (fp16, [kRows][kLdK] at kh) become k in place: bias added and
// rotated in fp16 pairs (bias: [R][N] fp16; cs, sn: [tokens][ldr] fp16), then kept in fp16
// or, kToBf16, stored in bf16; rows past m zeros. A thread takes eight adjacent entries of a
// row and their partners N/2 on.
template <int kH2, int kR, bool kToBf16>
__device__ __forceinline__ void rotate_k_in_place(__half* kh, const __half* bias, const __half* cs, const __half* sn,
                                                  int ldr, int m) {
  constexpr int kN = kH2 * 32, kHalf = kN / 2, kOctets = kHalf / 8;
  for (int idx = threadIdx.x; idx < kRows * kOctets; idx += kThreads) {
    const int row = idx / kOctets, n0 = 8 * (idx - row * kOctets);
    uint4* lo = reinterpret_cast<uint4*>(kh + row * kLdK + n0);
    uint4* hi = reinterpret_cast<uint4*>(kh + row * kLdK + n0 + kHalf);
    if (row >= m) {
      *lo = make_uint4(0u, 0u, 0u, 0u);
      *hi = make_uint4(0u, 0u, 0u, 0u);
      continue;
    }
    const int t = row / kR, r = row % kR;
    uint4 a = *lo, b = *hi;
    const uint4 ba = *reinterpret_cast<const uint4*>(bias + r * kN + n0);
    const uint4 bb = *reinterpret_cast<const uint4*>(bias + r * kN + n0 + kHalf);
    uint32_t* aw = &a.x;
    uint32_t* bw = &b.x;
    const uint32_t* baw = &ba.x;
    const uint32_t* bbw = &bb.x;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      aw[q] = half2_bits(__hadd2(bits_half2(aw[q]), bits_half2(baw[q])));
      bw[q] = half2_bits(__hadd2(bits_half2(bw[q]), bits_half2(bbw[q])));
    }
    if (n0 < ldr) {
      const uint4 c4 = *reinterpret_cast<const uint4*>(cs + t * ldr + n0);
      const uint4 s4 = *reinterpret_cast<const uint4*>(sn + t * ldr + n0);
      const uint32_t* cw = &c4.x;
      const uint32_t* sw = &s4.x;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        __half2 v0, v1;
        rotate_h2(bits_half2(aw[q]), bits_half2(bw[q]), bits_half2(cw[q]), bits_half2(sw[q]), v0, v1);
        aw[q] = half2_bits(v0);
        bw[q] = half2_bits(v1);
      }
    }
    if constexpr (kToBf16) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        aw[q] = f16x2_to_bf16x2(aw[q]);
        bw[q] = f16x2_to_bf16x2(bw[q]);
      }
    }
    *lo = a;
    *hi = b;
  }
}

// Rows j = t R + r of out ([kRows][ld], bf16): weight(t) x_t[p] mimo_x[r][p], from x
// ([tokens][ldx], fp32) and mimo_x ([R][ldm], fp32). A thread item is four columns of one
// token for all R of its rows, so x and the token's weight are read and computed once for them.
template <int kR, typename Weight>
__device__ __forceinline__ void build_token_rows(const float* xs, int ldx, const float* mxs, int ldm, int P,
                                                 __nv_bfloat16* out, int ld, Weight&& weight) {
  constexpr int kTokens = kRows / kR;
  const int quads = P / 4;
  for (int idx = threadIdx.x; idx < kTokens * quads; idx += kThreads) {
    const int t = div_small(idx, quads), p = 4 * (idx - t * quads);
    const float wt = weight(t);
    float4 x = *reinterpret_cast<const float4*>(xs + t * ldx + p);
    x.x *= wt; x.y *= wt; x.z *= wt; x.w *= wt;
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      const float4 w = *reinterpret_cast<const float4*>(mxs + r * ldm + p);
      store4(out + (t * kR + r) * ld + p, make_float4(x.x * w.x, x.y * w.y, x.z * w.z, x.w * w.w));
    }
  }
}

// acc[nt] += Q (this warp's rows, qf) . Bt[rows nt * 8 .. + 7]^T for nt < count (even), with
// Bt [rows][ld] 16-bit, one row per output column (S~ for the inherited state, k for G).
// kOps: both operands fp16, or q fp16 and Bt bf16 (each q fragment converted as it is
// used, so no second copy of q lives in registers). Rows of Bt are the B operand's
// columns: one ldmatrix.x4 gives tiles nt and nt + 1.
template <int kH2, int NT, Operands kOps>
__device__ __forceinline__ void q_times_rows(float (&acc)[NT][4], const uint32_t (&qf)[2][kH2][4], const void* bt,
                                             int ld, int count) {
  static_assert(NT % 2 == 0, "column tiles go in pairs");
  const int lane = threadIdx.x & 31;
  // Lanes 0-7: rows of tile nt at k0, 8-15: the same at k0 + 8, 16-31: tile nt + 1.
  const uint16_t* row = static_cast<const uint16_t*>(bt) + ((lane & 7) + 8 * (lane >> 4)) * ld + 8 * ((lane >> 3) & 1);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
    for (int kt = 0; kt < kH2; ++kt) {
      const int k0 = (hh * kH2 + kt) * 16;
      uint32_t a[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = kOps == Operands::F16AsBf16 ? f16x2_to_bf16x2(qf[hh][kt][e]) : qf[hh][kt][e];
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        if (nt < count) {
          uint32_t b[4];
          ldmatrix_x4(b, row + nt * 8 * ld + k0);
          if constexpr (kOps == Operands::F16) {
            mma_f16(acc[nt], a[0], a[1], a[2], a[3], b[0], b[1]);
            mma_f16(acc[nt + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
          } else {
            mma_bf16(acc[nt], a[0], a[1], a[2], a[3], b[0], b[1]);
            mma_bf16(acc[nt + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
          }
        }
      }
    }
  }
}

// Calls f.template operator()<kH2, kR>() for the head shape's d_state / 32 and rank.
template <typename F>
void for_head_shape(const PrefillScanDims& d, F&& f) {
  auto rank = [&]<int kH2>() {
    switch (d.rank) {
      case 1: f.template operator()<kH2, 1>(); break;
      case 2: f.template operator()<kH2, 2>(); break;
      case 4: f.template operator()<kH2, 4>(); break;
      case 8: f.template operator()<kH2, 8>(); break;
      default: throw std::invalid_argument("prefill chunk kernels: mimo_rank " + std::to_string(d.rank) +
                                           " is not 1, 2, 4 or 8");
    }
  };
  switch (d.d_state / 32) {
    case 1: rank.template operator()<1>(); break;
    case 2: rank.template operator()<2>(); break;
    case 3: rank.template operator()<3>(); break;
    case 4: rank.template operator()<4>(); break;
    default: throw std::invalid_argument("prefill chunk kernels: d_state " + std::to_string(d.d_state) +
                                         " is not a multiple of 32 up to 128");
  }
}

// Every (d_state / 32, rank) the kernels are instantiated for, for load-time setup.
template <typename F>
void for_every_head_shape(F&& f) {
  auto ranks = [&]<int kH2>() {
    f.template operator()<kH2, 1>();
    f.template operator()<kH2, 2>();
    f.template operator()<kH2, 4>();
    f.template operator()<kH2, 8>();
  };
  ranks.template operator()<1>();
  ranks.template operator()<2>();
  ranks.template operator()<3>();
  ranks.template operator()<4>();
}

// Load time, for a chunk kernel given as kernel_of.template operator()<kH2, kR>() (its
// instance for that head shape): every instance may take the most shared memory any shape
// uses, since the plan depends on the shape and chunk_tc_applies keeps shapes whose plan is
// larger on the general kernels.
template <typename KernelOf>
void set_every_shape_smem_limit(KernelOf&& kernel_of, const char* name) {
  for_every_head_shape([&]<int kH2, int kR>() {
    set_chunk_kernel_smem_limit(reinterpret_cast<const void*>(kernel_of.template operator()<kH2, kR>()),
                                kMaxSharedBytesPerBlock, name);
  });
}

// A chunk kernel's launch over the call's chunks and heads, for the head shape's instance
// (kernel_of as above) and its shared-memory plan `sm`, passed beside the parameters.
template <typename KernelOf, typename Plan>
void launch_chunk_kernel(const ScanParams& prm, const Plan& sm, cudaStream_t stream, KernelOf&& kernel_of) {
  for_head_shape(prm.a.dims, [&]<int kH2, int kR>() {
    const dim3 grid(prm.a.runs.n_chunks, prm.a.dims.heads);
    launch_scan_kernel(kernel_of.template operator()<kH2, kR>(), grid, kThreads, sm.bytes, stream, prm.a.pdl, prm, sm);
  });
}

// Per kernel (kernels/prefill_chunk_state_tc.cu, kernels/prefill_chunk_output_tc.cu): the
// shared memory one block asks for at this head shape, and the load-time limits.
int chunk_state_tc_smem_bytes(const PrefillScanDims& d);
int chunk_output_tc_smem_bytes(const PrefillScanDims& d);
void prepare_chunk_state_tc();
void prepare_chunk_output_tc();

}  // namespace m3::kernels::prefill_detail::tc
