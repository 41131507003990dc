#include "kernels/gemv.cuh"

#include <stdexcept>
#include <string>

#include "kernels/common.cuh"
#include "kernels/gemv_operands.cuh"
#include "kernels/gemv_mma.cuh"

namespace m3::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
static_assert(sizeof(float) * kWarps * 8 <= kMaxSharedBytesPerBlock, "static shared memory");

template <typename W>
struct GemvParams : GemvOperands<W> {
  GemvGatherOperands<W> gather;
};

template <typename W>
struct WeightChunk;  // 8 consecutive weights as raw 16-byte words
template <>
struct WeightChunk<__nv_bfloat16> {
  uint4 v;
  // kNoL1: load16_no_l1 (common.cuh) instead of __ldg.
  template <bool kNoL1>
  __device__ __forceinline__ void load(const __nv_bfloat16* p) {
    v = kNoL1 ? load16_no_l1(p) : __ldg(reinterpret_cast<const uint4*>(p));
  }
  __device__ __forceinline__ void widen(float (&f)[8]) const {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      f[2 * j] = __uint_as_float(w[j] << 16);
      f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  }
};
template <>
struct WeightChunk<float> {
  float4 a, b;
  template <bool>
  __device__ __forceinline__ void load(const float* p) {
    a = __ldg(reinterpret_cast<const float4*>(p));
    b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  }
  __device__ __forceinline__ void widen(float (&f)[8]) const {
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  }
};

// One output row's value `a` (and, gated, its gate's `g`) into y.
template <GemvEpilogue E>
__device__ __forceinline__ void write_output(float* out, float a, float g) {
  if constexpr (E == GemvEpilogue::Store) *out = a;
  if constexpr (E == GemvEpilogue::Accumulate) *out += a;
  if constexpr (E == GemvEpilogue::GatedSilu) *out = a * silu(g);
}

// BT: vectors per block (batch tile); RPW: output rows per warp; KC: 8-weight chunks per
// lane per row held in registers at once (a "pass" covers 32*KC chunks of a row).
//
// The first pass of weights is loaded into registers before waiting for the previous
// kernel (weights never depend on it), so with programmatic dependent launch the weight
// stream overlaps the previous kernel's tail and this kernel's own x staging.
// kGather: the input rows come from the embedding table (GemvGather). The bf16 batch-1
// variant is held to the 64 registers of the others (four blocks a multiprocessor):
// with more, two of its blocks left no room for a recurrence block launched beside them.
template <typename W, int BT, int RPW, GemvEpilogue E, int KC, bool kGather>
__global__ void __launch_bounds__(kThreads, kGather && BT == 1 && sizeof(W) == 2 && RPW * KC <= 8 ? 4 : 1)
    gemv_kernel(const GemvParams<W> p) {
  constexpr int NW = (E == GemvEpilogue::GatedSilu) ? 2 : 1;  // weight rows per output row
  constexpr int NR = RPW * NW;
  constexpr bool kNoL1 = BT <= 2;  // the batch-1 and -2 kernels (load16_no_l1, common.cuh)
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);  // [BT][cols]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cols = p.cols, chunks = cols >> 3;
  const int b0 = blockIdx.x * BT;
  const int nb = min(BT, p.batch - b0);
  const int row0 = (blockIdx.y * kWarps + warp) * RPW;

  const W* wrow[NR];
#pragma unroll
  for (int i = 0; i < RPW; ++i)
#pragma unroll
    for (int g = 0; g < NW; ++g) {
      const int row = min(row0 + i, p.out_rows - 1);  // clamped rows compute, never store
      wrow[i * NW + g] = p.weight + (size_t)(row + g * p.out_rows) * cols;
    }
  WeightChunk<W> wc[NR][KC];
#pragma unroll
  for (int j = 0; j < KC; ++j) {
    const int c = lane + 32 * j;
    if (c < chunks) {
#pragma unroll
      for (int i = 0; i < NR; ++i) wc[i][j].template load<kNoL1>(wrow[i] + c * 8);
    }
  }

  wait_for_previous_kernel(p.trigger_point);
  const W* in[BT];  // gathering: the embedding rows
  const bool keep = blockIdx.y == 0;
#pragma unroll
  for (int b = 0; b < BT; ++b) in[b] = b < nb ? gemv_gather_row<kGather>(p, p.gather, b0 + b) : nullptr;

  // Stage the batch tile of x (times the norm weight when normalising; the 1/rms scale is
  // applied to the dot products at the end), zero rows past the batch. The sums of
  // squares come out of the same pass, so the norm costs no extra barrier.
  __shared__ float partial_ss[kWarps][BT];
  const bool norm = p.norm_weight != nullptr;
  const int cols4 = cols >> 2;
  const float4* nw4 = reinterpret_cast<const float4*>(p.norm_weight);
  float ss[BT];
#pragma unroll
  for (int b = 0; b < BT; ++b) ss[b] = 0.f;
  // Two float4 per row per thread per pass, all rows' loads issued before any store.
  for (int base = 0; base < cols4; base += 2 * kThreads) {
    float4 v[BT][2], g[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = base + threadIdx.x + u * kThreads;
      g[u] = (norm && i < cols4) ? nw4[i] : make_float4(1.f, 1.f, 1.f, 1.f);
    }
#pragma unroll
    for (int b = 0; b < BT; ++b) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = base + threadIdx.x + u * kThreads;
        v[b][u] = (b < nb && i < cols4) ? gemv_input4<kGather>(p, p.gather, in[b], b0 + b, i, keep)
                                        : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = base + threadIdx.x + u * kThreads;
      if (i >= cols4) continue;
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        float4 x = v[b][u];
        ss[b] += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
        x.x *= g[u].x; x.y *= g[u].y; x.z *= g[u].z; x.w *= g[u].w;
        reinterpret_cast<float4*>(xs + b * cols)[i] = x;
      }
    }
  }
  if (norm) store_warp_sums(ss, partial_ss);
  __syncthreads();

  float acc[NR][BT];
#pragma unroll
  for (int i = 0; i < NR; ++i)
#pragma unroll
    for (int b = 0; b < BT; ++b) acc[i][b] = 0.f;

  for (int pass0 = 0; pass0 < chunks; pass0 += 32 * KC) {
    if (pass0 > 0) {  // rows longer than one pass: load the next one
#pragma unroll
      for (int j = 0; j < KC; ++j) {
        const int c = pass0 + lane + 32 * j;
        if (c < chunks) {
#pragma unroll
          for (int i = 0; i < NR; ++i) wc[i][j].template load<kNoL1>(wrow[i] + c * 8);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < KC; ++j) {
      const int c = pass0 + lane + 32 * j;
      if (c < chunks) {
        float w[NR][8];
#pragma unroll
        for (int i = 0; i < NR; ++i) wc[i][j].widen(w[i]);
#pragma unroll
        for (int b = 0; b < BT; ++b) {
          const float4 xa = reinterpret_cast<const float4*>(xs + b * cols + c * 8)[0];
          const float4 xb = reinterpret_cast<const float4*>(xs + b * cols + c * 8)[1];
#pragma unroll
          for (int i = 0; i < NR; ++i) {
            float s = acc[i][b];
            s = fmaf(w[i][0], xa.x, s); s = fmaf(w[i][1], xa.y, s);
            s = fmaf(w[i][2], xa.z, s); s = fmaf(w[i][3], xa.w, s);
            s = fmaf(w[i][4], xb.x, s); s = fmaf(w[i][5], xb.y, s);
            s = fmaf(w[i][6], xb.z, s); s = fmaf(w[i][7], xb.w, s);
            acc[i][b] = s;
          }
        }
      }
    }
  }
  if (p.trigger_point == 0) allow_next_kernel();

  float scale[BT];
#pragma unroll
  for (int b = 0; b < BT; ++b) {
    scale[b] = 1.f;
    if (norm) scale[b] = inverse_rms(partial_ss, b, cols, p.norm_eps);
  }
  if constexpr (BT == 1 && NW == 1 && RPW > 1) {
    // The warp's RPW row sums in one transposed butterfly (RPW=4: 6 shuffles, not 20);
    // lane i < RPW then holds row row0 + i.
    float v[RPW];
#pragma unroll
    for (int i = 0; i < RPW; ++i) v[i] = acc[i][0];
    const float a = warp_sum_many<RPW>(v) * scale[0];
    const int row = row0 + lane;
    if (lane < RPW && nb > 0 && row < p.out_rows) {
      write_output<E>(p.y + (size_t)b0 * p.y_stride + row, a, 0.f);
    }
  } else {
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        const float a = warp_sum(acc[i * NW][b]) * scale[b];
        float g = 0.f;
        if constexpr (NW == 2) g = warp_sum(acc[i * NW + 1][b]) * scale[b];
        const int row = row0 + i;
        if (lane == 0 && b < nb && row < p.out_rows) {
          write_output<E>(p.y + (size_t)(b0 + b) * p.y_stride + row, a, g);
        }
      }
    }
  }
}

template <typename W, int BT, int RPW, GemvEpilogue E, bool G>
KernelLaunch plan_variant(const GemvArgs& a) {
  const GemvParams<W> p{gemv_operands<W>(a), gemv_gather_operands<W>(a)};
  const int rows_per_block = kWarps * RPW;
  const dim3 grid((a.batch + BT - 1) / BT, (a.out_rows + rows_per_block - 1) / rows_per_block);
  const size_t smem = sizeof(float) * BT * a.cols;  // + static partial sums (checked at make)
  // Eight chunks per lane in flight when the row is long and the registers allow.
  constexpr int NW = E == GemvEpilogue::GatedSilu ? 2 : 1;
  constexpr bool wide_ok = RPW * NW * sizeof(W) <= 4;
  const std::string variant = "cuda cores, batch tile " + std::to_string(BT) + ", rows a warp " + std::to_string(RPW);
  if (wide_ok && a.cols / 8 > 32 * 4) {
    return KernelLaunch::make("gemv", gemv_kernel<W, BT, RPW, E, wide_ok ? 8 : 4, G>, grid,
                              dim3(kThreads), smem, p).described(variant);
  }
  // Large tiles are arithmetic-heavy: fewer weights in flight, more blocks resident.
  constexpr int kc = BT >= 8 ? 2 : 4;
  return KernelLaunch::make("gemv", gemv_kernel<W, BT, RPW, E, kc, G>, grid, dim3(kThreads), smem, p)
      .described(variant);
}

// Rows per warp at batch 1 unless GemvArgs::rows_per_warp says: the policy's (two by
// default). With the next kernel's blocks launched before this one's wait, fewer blocks
// start their loads sooner beside the running kernel (one row a warp lost everywhere and
// is gone); beside the fused out_proj four can win, so the engine measures both.
template <typename W, GemvEpilogue E, bool G>
KernelLaunch plan_tile(const GemvArgs& a, int tile) {
  switch (tile) {
    case 1: {
      const int rpw = a.rows_per_warp > 0 ? a.rows_per_warp : a.policy.batch1_rows_per_warp;
      return rpw == 4 ? plan_variant<W, 1, 4, E, G>(a) : plan_variant<W, 1, 2, E, G>(a);
    }
    // Four rows a warp: fewer, larger blocks than the tensor-core kernels', which leave
    // room beside them for the fused recurrence's (the engine measures it at batch 2).
    case 2: return a.rows_per_warp == 4 ? plan_variant<W, 2, 4, E, G>(a) : plan_variant<W, 2, 1, E, G>(a);
    case 4: return plan_variant<W, 4, 2, E, G>(a);
    default: return plan_variant<W, 8, 4, E, G>(a);
  }
}

template <typename W>
KernelLaunch plan_typed(const GemvArgs& a, int tile) {
  if (a.gather.table != nullptr) return plan_tile<W, GemvEpilogue::Store, true>(a, tile);
  switch (a.epilogue) {
    case GemvEpilogue::Store: return plan_tile<W, GemvEpilogue::Store, false>(a, tile);
    case GemvEpilogue::Accumulate: return plan_tile<W, GemvEpilogue::Accumulate, false>(a, tile);
    default: return plan_tile<W, GemvEpilogue::GatedSilu, false>(a, tile);
  }
}

}  // namespace

std::string gemv_cols_refusal(int cols) {
  // The CUDA-core kernel stages a tile of fp32 input rows in shared memory beside its
  // static partial sums (kWarps floats a row); the tensor-core ones fall back to it.
  const int max_cols = static_cast<int>(kMaxSharedBytesPerBlock / sizeof(float)) - kWarps;
  if (cols <= 0) return "must be positive";
  if (cols % 8 != 0) return "must be a multiple of 8 (16-byte weight loads)";
  if (cols > max_cols) return "must be at most " + std::to_string(max_cols) + " (one fp32 input row in shared memory)";
  return {};
}

KernelLaunch plan_gemv(const GemvArgs& a) {
  const std::string shape = "gemv " + std::to_string(a.out_rows) + "x" + std::to_string(a.cols) +
                            " batch " + std::to_string(a.batch);
  if (a.out_rows <= 0 || a.cols <= 0 || a.batch <= 0) {
    throw std::invalid_argument(shape + ": sizes must be positive");
  }
  if (const std::string why = gemv_cols_refusal(a.cols); !why.empty()) {
    throw std::invalid_argument(shape + ": cols " + why);
  }
  if (a.x_stride % 4 != 0) throw std::invalid_argument(shape + ": x_stride must be a multiple of 4 (16-byte loads)");
  if (a.weight == nullptr || (a.x == nullptr && a.gather.table == nullptr) || a.y == nullptr) {
    throw std::invalid_argument(shape + ": null pointer");
  }
  if (a.rows_per_warp != 0 && a.rows_per_warp != 2 && a.rows_per_warp != 4) {
    throw std::invalid_argument(shape + ": rows_per_warp " + std::to_string(a.rows_per_warp) +
                                " is not 0 (default), 2 or 4");
  }
  const GemvGather& gt = a.gather;
  if (gt.table != nullptr &&
      (a.epilogue != GemvEpilogue::Store || gt.vocab_rows <= 0 || gt.slots == nullptr || gt.tokens == nullptr ||
       gt.last_token == nullptr || gt.rows_out == nullptr || reinterpret_cast<uintptr_t>(gt.rows_out) % 16 != 0)) {
    throw std::invalid_argument(shape + ": gathering its input needs the Store epilogue, a table of at least one "
                                        "row, the slots, tokens and last tokens, and a 16-byte aligned rows_out");
  }
  // (Batch 2 with four rows a warp asks for CUDA cores: gemv_mma_applies says no.)
  if (const std::string why = gemv_policy_refusal(a.policy); !why.empty()) {
    throw std::invalid_argument(shape + ": policy " + why);
  }
  if (gemv_mma_applies(a)) return plan_gemv_mma(a);
  // The largest power of two <= batch (at most 8) whose x tile fits in shared memory, with
  // the kernel's static part (partial_ss: kWarps floats a vector).
  auto smem_bytes = [&](int t) { return sizeof(float) * t * (static_cast<size_t>(a.cols) + kWarps); };
  int tile = 8;  // (a tile of one fits: gemv_cols_refusal)
  while (tile > 1 && (tile > a.batch || smem_bytes(tile) > kMaxSharedBytesPerBlock)) tile /= 2;
  return a.type == WeightDType::BF16 ? plan_typed<__nv_bfloat16>(a, tile) : plan_typed<float>(a, tile);
}

}  // namespace m3::kernels
