#include "kernels/gemv.cuh"

#include <stdexcept>
#include <string>

#include "kernels/common.cuh"

namespace m3::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

template <typename W>
struct GemvParams {
  const W* weight;
  int out_rows, cols;
  const float* x;
  int x_stride;
  const float* norm_weight;
  float norm_eps;
  float* y;
  int y_stride;
  int batch;
};

// BT: vectors per block (batch tile); RPW: output rows per warp.
template <typename W, int BT, int RPW, GemvEpilogue E>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const GemvParams<W> p) {
  constexpr int NW = (E == GemvEpilogue::GatedSilu) ? 2 : 1;  // weight rows per output row
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);  // [BT][cols]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cols = p.cols, chunks = cols >> 3;
  const int b0 = blockIdx.x * BT;
  const int nb = min(BT, p.batch - b0);
  const int row0 = (blockIdx.y * kWarps + warp) * RPW;

  // Weights do not depend on the previous kernel: start pulling this warp's rows into L2
  // while that kernel drains.
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
#pragma unroll
    for (int g = 0; g < NW; ++g) {
      const int row = row0 + i;
      if (row < p.out_rows) {
        const char* base = reinterpret_cast<const char*>(p.weight + (size_t)(row + g * p.out_rows) * cols);
        const int bytes = cols * (int)sizeof(W);
        for (int off = lane * 128; off < bytes; off += 32 * 128) {
          asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off));
        }
      }
    }
  }
  wait_for_previous_kernel();

  // Stage the batch tile of x (fp32), zero rows past the batch.
  const int cols4 = cols >> 2;
  for (int b = 0; b < BT; ++b) {
    float4* dst = reinterpret_cast<float4*>(xs + b * cols);
    if (b < nb) {
      const float4* src = reinterpret_cast<const float4*>(p.x + (size_t)(b0 + b) * p.x_stride);
      for (int i = threadIdx.x; i < cols4; i += kThreads) dst[i] = src[i];
    } else {
      for (int i = threadIdx.x; i < cols4; i += kThreads) dst[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  __syncthreads();
  if (p.norm_weight != nullptr) {
    for (int b = warp; b < nb; b += kWarps) {
      float* row = xs + b * cols;
      float ss = 0.f;
      for (int i = lane; i < cols; i += 32) ss += row[i] * row[i];
      ss = warp_sum(ss);
      const float scale = rsqrtf(ss / cols + p.norm_eps);
      for (int i = lane; i < cols; i += 32) row[i] = row[i] * scale * p.norm_weight[i];
    }
    __syncthreads();
  }

  float acc[RPW * NW][BT];
#pragma unroll
  for (int i = 0; i < RPW * NW; ++i)
#pragma unroll
    for (int b = 0; b < BT; ++b) acc[i][b] = 0.f;

  const W* wrow[RPW * NW];
#pragma unroll
  for (int i = 0; i < RPW; ++i)
#pragma unroll
    for (int g = 0; g < NW; ++g) {
      const int row = min(row0 + i, p.out_rows - 1);  // clamped rows compute, never store
      wrow[i * NW + g] = p.weight + (size_t)(row + g * p.out_rows) * cols;
    }

  int c = lane;
  for (; c + 32 < chunks; c += 64) {  // two chunks per lane in flight
    float w[2][RPW * NW][8];
#pragma unroll
    for (int i = 0; i < RPW * NW; ++i) {
      load8(wrow[i] + c * 8, w[0][i]);
      load8(wrow[i] + (c + 32) * 8, w[1][i]);
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int cc = c + 32 * u;
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        const float4 xa = reinterpret_cast<const float4*>(xs + b * cols + cc * 8)[0];
        const float4 xb = reinterpret_cast<const float4*>(xs + b * cols + cc * 8)[1];
#pragma unroll
        for (int i = 0; i < RPW * NW; ++i) {
          float s = acc[i][b];
          s = fmaf(w[u][i][0], xa.x, s); s = fmaf(w[u][i][1], xa.y, s);
          s = fmaf(w[u][i][2], xa.z, s); s = fmaf(w[u][i][3], xa.w, s);
          s = fmaf(w[u][i][4], xb.x, s); s = fmaf(w[u][i][5], xb.y, s);
          s = fmaf(w[u][i][6], xb.z, s); s = fmaf(w[u][i][7], xb.w, s);
          acc[i][b] = s;
        }
      }
    }
  }
  if (c < chunks) {
    float w[RPW * NW][8];
#pragma unroll
    for (int i = 0; i < RPW * NW; ++i) load8(wrow[i] + c * 8, w[i]);
#pragma unroll
    for (int b = 0; b < BT; ++b) {
      const float4 xa = reinterpret_cast<const float4*>(xs + b * cols + c * 8)[0];
      const float4 xb = reinterpret_cast<const float4*>(xs + b * cols + c * 8)[1];
#pragma unroll
      for (int i = 0; i < RPW * NW; ++i) {
        float s = acc[i][b];
        s = fmaf(w[i][0], xa.x, s); s = fmaf(w[i][1], xa.y, s);
        s = fmaf(w[i][2], xa.z, s); s = fmaf(w[i][3], xa.w, s);
        s = fmaf(w[i][4], xb.x, s); s = fmaf(w[i][5], xb.y, s);
        s = fmaf(w[i][6], xb.z, s); s = fmaf(w[i][7], xb.w, s);
        acc[i][b] = s;
      }
    }
  }
  allow_next_kernel();

#pragma unroll
  for (int i = 0; i < RPW; ++i) {
#pragma unroll
    for (int b = 0; b < BT; ++b) {
      const float a = warp_sum(acc[i * NW][b]);
      float g = 0.f;
      if constexpr (NW == 2) g = warp_sum(acc[i * NW + 1][b]);
      const int row = row0 + i;
      if (lane == 0 && b < nb && row < p.out_rows) {
        float* out = p.y + (size_t)(b0 + b) * p.y_stride + row;
        if constexpr (E == GemvEpilogue::Store) *out = a;
        if constexpr (E == GemvEpilogue::Accumulate) *out += a;
        if constexpr (E == GemvEpilogue::GatedSilu) *out = a * silu(g);
      }
    }
  }
}

template <typename W, int BT, int RPW, GemvEpilogue E>
KernelLaunch plan_variant(const GemvArgs& a) {
  GemvParams<W> p{static_cast<const W*>(a.weight), a.out_rows, a.cols, a.x, a.x_stride,
                  a.norm_weight, a.norm_eps, a.y, a.y_stride, a.batch};
  const int rows_per_block = kWarps * RPW;
  const dim3 grid((a.batch + BT - 1) / BT, (a.out_rows + rows_per_block - 1) / rows_per_block);
  const size_t smem = sizeof(float) * BT * a.cols;
  return KernelLaunch::make("gemv", gemv_kernel<W, BT, RPW, E>, grid, dim3(kThreads), smem, p);
}

template <typename W, GemvEpilogue E>
KernelLaunch plan_tile(const GemvArgs& a, int tile) {
  switch (tile) {
    case 1: return plan_variant<W, 1, 1, E>(a);
    case 2: return plan_variant<W, 2, 2, E>(a);
    case 4: return plan_variant<W, 4, 2, E>(a);
    default: return plan_variant<W, 8, 4, E>(a);
  }
}

template <typename W>
KernelLaunch plan_typed(const GemvArgs& a, int tile) {
  switch (a.epilogue) {
    case GemvEpilogue::Store: return plan_tile<W, GemvEpilogue::Store>(a, tile);
    case GemvEpilogue::Accumulate: return plan_tile<W, GemvEpilogue::Accumulate>(a, tile);
    default: return plan_tile<W, GemvEpilogue::GatedSilu>(a, tile);
  }
}

}  // namespace

KernelLaunch plan_gemv(const GemvArgs& a) {
  const std::string shape = "gemv " + std::to_string(a.out_rows) + "x" + std::to_string(a.cols) +
                            " batch " + std::to_string(a.batch);
  if (a.out_rows <= 0 || a.cols <= 0 || a.batch <= 0) {
    throw std::invalid_argument(shape + ": sizes must be positive");
  }
  if (a.cols % 8 != 0 || a.x_stride % 4 != 0) {
    throw std::invalid_argument(shape + ": cols and x_stride must be multiples of 8 and 4 (16-byte loads)");
  }
  if (a.weight == nullptr || a.x == nullptr || a.y == nullptr) {
    throw std::invalid_argument(shape + ": null pointer");
  }
  // The largest power of two <= batch (at most 8) whose x tile fits in shared memory.
  int tile = 8;
  while (tile > 1 && (tile > a.batch || sizeof(float) * tile * a.cols > kMaxSharedBytesPerBlock)) {
    tile /= 2;
  }
  if (sizeof(float) * tile * a.cols > kMaxSharedBytesPerBlock) {
    throw std::invalid_argument(shape + ": one input row of " + std::to_string(a.cols) +
                                " floats does not fit in shared memory");
  }
  return a.type == WeightType::BF16 ? plan_typed<__nv_bfloat16>(a, tile) : plan_typed<float>(a, tile);
}

}  // namespace m3::kernels
