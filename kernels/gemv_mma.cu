// The batched gemv on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate), for
// bf16 weights from batch 2 (tiles of 8 or 16 columns, zero-padded), where the CUDA-core
// kernel turns arithmetic-bound; matrices of many row blocks (from batch 2) and every
// matrix from batch 8 go to the row-block kernel
// (gemv_mma_rows.cu). Same contract and fusions as gemv.cu (see gemv.cuh).
//
// A block owns 16 weight rows and splits the columns over its 8 warps. Each lane loads
// 16 bytes of two rows (g and g+8) per 32 columns; since a dot product does not care in
// which order its terms are summed, those 8 consecutive columns are fed to two mma k-slots
// of 4 each, with x read in the same order, so weights go from one 16-byte load straight
// into the A fragments. x is staged once per block in shared memory as bf16.
#include "kernels/gemv_mma.cuh"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/common.cuh"
#include "kernels/gemv_operands.cuh"
#include "kernels/gemv_mma_rows.cuh"
#include "kernels/mma_bf16.cuh"

namespace m3::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// Static part (partial sums of squares, widest tile); the dynamic part is checked when
// the launch is planned and again against the kernel's attributes at load.
static_assert(sizeof(float) * kWarps * 16 <= kMaxSharedBytesPerBlock, "static shared memory");

struct MmaParams : GemvOperands<__nv_bfloat16> {
  int x_row_words;  // padded shared-memory row of x, in 4-byte words
  GemvGatherOperands<__nv_bfloat16> gather;
};


// BT: batch columns per block (multiple of 8); kGather: input rows from the embedding table.
template <int BT, GemvEpilogue E, bool kGather>
__global__ void __launch_bounds__(kThreads) gemv_mma_kernel(const MmaParams p) {
  constexpr int NT = BT / 8;  // n-tiles
  // 32-column blocks per warp whose weights load before the PDL wait (fewer for wide
  // tiles, whose staging needs the registers).
  constexpr int kHeld = BT >= 16 ? 4 : 8;
  constexpr bool kGated = E == GemvEpilogue::GatedSilu;
  extern __shared__ float4 smem4[];
  uint32_t* xs = reinterpret_cast<uint32_t*>(smem4);          // [BT][x_row_words] bf16 pairs
  float* red = reinterpret_cast<float*>(xs + BT * p.x_row_words);  // [kWarps][16][BT]
  __shared__ float partial_ss[kWarps][BT];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int cols = p.cols, kblocks = cols >> 5;
  const int b0 = blockIdx.x * BT;
  const int nb = min(BT, p.batch - b0);
  // Rows of this block: 16 weight rows; gated: 8 output rows, a-part in g, gate in g+8.
  const int out0 = blockIdx.y * (kGated ? 8 : 16);
  const int row_a = min(out0 + g, p.out_rows - 1);
  const int row_b = kGated ? row_a + p.out_rows : min(out0 + g + 8, p.out_rows - 1);
  const __nv_bfloat16* wa = p.weight + (size_t)row_a * cols + 8 * c;
  const __nv_bfloat16* wb = p.weight + (size_t)row_b * cols + 8 * c;

  uint4 ha[kHeld], hb[kHeld];
#pragma unroll
  for (int j = 0; j < kHeld; ++j) {
    const int kb = warp + kWarps * j;
    if (kb < kblocks) {
      ha[j] = load16_l2_256(wa + kb * 32);
      hb[j] = load16_l2_256(wb + kb * 32);
    }
  }

  wait_for_previous_kernel(p.trigger_point);
  const __nv_bfloat16* in[BT];  // gathering: the embedding rows
  const bool keep = blockIdx.y == 0;
#pragma unroll
  for (int b = 0; b < BT; ++b) in[b] = b < nb ? gemv_gather_row<kGather>(p, p.gather, b0 + b) : nullptr;

  // Stage x (times the norm weight) as bf16; sums of squares on the side.
  const bool norm = p.norm_weight != nullptr;
  const int cols4 = cols >> 2;
  float ss[BT];
#pragma unroll
  for (int b = 0; b < BT; ++b) ss[b] = 0.f;
  for (int i = threadIdx.x; i < cols4; i += kThreads) {
    const float4 gw = norm ? reinterpret_cast<const float4*>(p.norm_weight)[i] : make_float4(1.f, 1.f, 1.f, 1.f);
    float4 v[BT];
#pragma unroll
    for (int b = 0; b < BT; ++b) {
      v[b] = b < nb ? gemv_input4<kGather>(p, p.gather, in[b], b0 + b, i, keep) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int b = 0; b < BT; ++b) {
      const float4 x = v[b];
      ss[b] += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
      uint2 packed;
      packed.x = pack_bf16(x.x * gw.x, x.y * gw.y);
      packed.y = pack_bf16(x.z * gw.z, x.w * gw.w);
      reinterpret_cast<uint2*>(xs + b * p.x_row_words)[i] = packed;
    }
  }
  if (norm) store_warp_sums(ss, partial_ss);
  __syncthreads();

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  auto consume = [&](const uint4& A, const uint4& B, int kb) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const uint4 xv = *reinterpret_cast<const uint4*>(xs + (t * 8 + g) * p.x_row_words + kb * 16 + 4 * c);
      mma_bf16(acc[t], A.x, B.x, A.y, B.y, xv.x, xv.y);
      mma_bf16(acc[t], A.z, B.z, A.w, B.w, xv.z, xv.w);
    }
  };
#pragma unroll
  for (int j = 0; j < kHeld; ++j) {
    const int kb = warp + kWarps * j;
    if (kb < kblocks) consume(ha[j], hb[j], kb);
  }
  for (int kb = warp + kWarps * kHeld; kb < kblocks; kb += kWarps) {
    const uint4 A = load16_l2_256(wa + kb * 32);
    const uint4 B = load16_l2_256(wb + kb * 32);
    consume(A, B, kb);
  }
  if (p.trigger_point == 0) allow_next_kernel();

  // Sum the warps' partial products: red[warp][row][n].
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int n = t * 8 + 2 * c;
    red[(warp * 16 + g) * BT + n] = acc[t][0];
    red[(warp * 16 + g) * BT + n + 1] = acc[t][1];
    red[(warp * 16 + g + 8) * BT + n] = acc[t][2];
    red[(warp * 16 + g + 8) * BT + n + 1] = acc[t][3];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < (kGated ? 8 : 16) * BT; idx += kThreads) {
    const int r = idx / BT, n = idx % BT;
    if (n >= nb) continue;
    float scale = 1.f;
    if (norm) scale = inverse_rms(partial_ss, n, cols, p.norm_eps);
    float a = 0.f, gate = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      a += red[(w * 16 + r) * BT + n];
      if constexpr (kGated) gate += red[(w * 16 + r + 8) * BT + n];
    }
    a *= scale;
    const int row = out0 + r;
    if (row >= p.out_rows) continue;
    float* out = p.y + (size_t)(b0 + n) * p.y_stride + row;
    if constexpr (E == GemvEpilogue::Store) *out = a;
    if constexpr (E == GemvEpilogue::Accumulate) *out += a;
    if constexpr (E == GemvEpilogue::GatedSilu) *out = a * silu(gate * scale);
  }
}

template <int BT, GemvEpilogue E, bool G = false>
KernelLaunch plan_bt(const GemvArgs& a, const MmaParams& p) {
  const int rows_per_block = E == GemvEpilogue::GatedSilu ? 8 : 16;
  const dim3 grid((a.batch + BT - 1) / BT, (a.out_rows + rows_per_block - 1) / rows_per_block);
  const size_t smem = sizeof(uint32_t) * BT * p.x_row_words + sizeof(float) * kWarps * 16 * BT;
  return KernelLaunch::make("gemv_mma", gemv_mma_kernel<BT, E, G>, grid, dim3(kThreads), smem, p)
      .described("tensor cores, 16-row blocks, batch tile " + std::to_string(BT));
}

size_t smem_for(int bt, int row_words) {
  return sizeof(uint32_t) * bt * row_words + sizeof(float) * kWarps * 16 * bt + 2048;
}

}  // namespace

bool gemv_mma_applies(const GemvArgs& a) {
  if (a.type != WeightDType::BF16 || a.batch < a.policy.tensor_core_min_batch || a.cols % 32 != 0) return false;
  if (a.batch == 2 && a.rows_per_warp == 4) return false;  // CUDA cores asked for (GemvArgs)
  const int words = a.cols / 2 + (16 - (a.cols / 2) % 32 + 32) % 32;
  return smem_for(8, words) <= kMaxSharedBytesPerBlock;
}

KernelLaunch plan_gemv_mma(const GemvArgs& a) {
  if (!gemv_mma_applies(a)) {
    throw std::invalid_argument("plan_gemv_mma: needs bf16 weights, batch >= " + std::to_string(a.policy.tensor_core_min_batch) +
                                " and cols % 32 == 0");
  }
  if (gemv_mma_rows_applies(a)) return plan_gemv_mma_rows(a);
  MmaParams p{gemv_operands<__nv_bfloat16>(a), 0, gemv_gather_operands<__nv_bfloat16>(a)};
  // Pad each staged row so the 8 rows a warp reads at once fall in different banks.
  p.x_row_words = a.cols / 2 + (16 - (a.cols / 2) % 32 + 32) % 32;
  const bool wide = a.batch >= 16 && smem_for(16, p.x_row_words) <= kMaxSharedBytesPerBlock;
  if (a.gather.table != nullptr) {
    return wide ? plan_bt<16, GemvEpilogue::Store, true>(a, p) : plan_bt<8, GemvEpilogue::Store, true>(a, p);
  }
  switch (a.epilogue) {
    case GemvEpilogue::Store:
      return wide ? plan_bt<16, GemvEpilogue::Store>(a, p) : plan_bt<8, GemvEpilogue::Store>(a, p);
    case GemvEpilogue::Accumulate:
      return wide ? plan_bt<16, GemvEpilogue::Accumulate>(a, p) : plan_bt<8, GemvEpilogue::Accumulate>(a, p);
    default:
      return wide ? plan_bt<16, GemvEpilogue::GatedSilu>(a, p) : plan_bt<8, GemvEpilogue::GatedSilu>(a, p);
  }
}

}  // namespace m3::kernels
