// The row-block tensor-core gemv (the default for bf16 weights from batch 2; gemv_mma.cu
// keeps the 16-row kernel for the rest). Same contract and fusions as gemv.cu (gemv.cuh).
#include "kernels/gemv_mma_rows.cuh"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cluster.cuh"
#include "kernels/common.cuh"
#include "kernels/gemv_operands.cuh"
#include "kernels/mma_bf16.cuh"

namespace m3::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

// Row-block kernel (the default): a block owns 128 weight rows (8 warps x 16; gated: 64
// output rows) and a batch tile of up to 64 columns, so weights are read once per batch
// tile and x is staged once per 128 rows. The columns are split over a cluster of KS
// blocks: each stages only its slice of x, its warps hold all their weights of the slice
// in registers (loaded before the PDL wait), and the grid fills the GPU. The KS partial
// tiles are summed in a fixed order through distributed shared memory, each block
// finishing 1/KS of the output rows, so results are deterministic and y is written (or
// accumulated into) exactly once.
//
// x staging: cp.async copies the fp32 slice to shared memory (every copy in flight at
// once, no registers; embedding rows, when gathering, go through registers instead), then
// one pass converts it to bf16 (times the norm weight) and takes the sums of squares; the
// fp32 buffer then holds the partial tile.
constexpr int kHeld = 8;             // 32-column blocks of weights per warp held in registers
constexpr int kRowsPerBlock = kWarps * 16;
constexpr int kPartStride = kRowsPerBlock + 4;  // floats per batch column of the partial tile
// Shared-memory row of the staged bf16 x chunk, in 4-byte words: kHeld 32-column blocks of
// 16 words plus 16 (16 mod 32: the 8 rows a warp reads at once fall in different banks).
// A compile-time stride turns the fragment addresses into immediates.
constexpr int kXWords = kHeld * 16 + 16;

struct RowsParams : GemvOperands<__nv_bfloat16> {
  int chunk_kb;     // 32-column blocks staged at once (<= kHeld)
  int x_row_words;  // padded shared-memory row of the staged bf16 x chunk, in 4-byte words
  int raw_offset;   // floats from the start of dynamic shared memory to the fp32 chunk
  int part_offset;  // ... and to the partial tile
};
// The gathering variant's parameters: a type of its own because one more member in
// RowsParams alone made ptxas spill in the 64-column variants that do not gather.
struct RowsGatherParams : RowsParams {
  GemvGatherOperands<__nv_bfloat16> gather;
};

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}

// Dynamic shared memory: bf16 x chunk [BT][kXWords], fp32 x chunk [BT][32 chunk_kb],
// partial tile [BT][kPartStride] (over the fp32 chunk when one chunk covers the slice).
size_t rows_smem(int bt, int chunk_kb, int row_words, bool alias) {
  const size_t raw = sizeof(float) * bt * 32 * chunk_kb;
  const size_t xs = sizeof(uint32_t) * bt * row_words;
  const size_t part = sizeof(float) * bt * kPartStride;
  return alias ? std::max(raw, part) + xs : raw + xs + part;
}

// kGather: the input rows come from the embedding table (GemvGather).
template <int BT, int KS, GemvEpilogue E, bool kGather>
__global__ void __cluster_dims__(KS, 1, 1) __launch_bounds__(kThreads, 2)
    gemv_mma_rows_kernel(const std::conditional_t<kGather, RowsGatherParams, RowsParams> p) {
  constexpr int NT = BT / 8;
  constexpr int RPW = BT / 8;  // staged batch rows per warp
  constexpr int TG = NT < 4 ? NT : 4;  // output tiles accumulated at once
  constexpr bool kGated = E == GemvEpilogue::GatedSilu;
  constexpr int kOutRows = kGated ? kRowsPerBlock / 2 : kRowsPerBlock;
  extern __shared__ float4 smem4[];
  uint32_t* xs = reinterpret_cast<uint32_t*>(smem4);              // [BT][kXWords]
  float* raw = reinterpret_cast<float*>(smem4) + p.raw_offset;    // [BT][32 chunk_kb] fp32
  float* part = reinterpret_cast<float*>(smem4) + p.part_offset;  // [BT][kPartStride]
  __shared__ float ss_blk[BT];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int cols = p.cols, kblocks = cols >> 5;
  const int rank = KS > 1 ? static_cast<int>(blockIdx.x % KS) : 0;
  const int b0 = (blockIdx.x / KS) * BT;
  const int nb = min(BT, p.batch - b0);
  const int kb0 = rank * kblocks / KS, kb1 = (rank + 1) * kblocks / KS;
  const int out_base = blockIdx.y * kOutRows;
  const int out0 = out_base + warp * (kGated ? 8 : 16);
  const int row_a = min(out0 + g, p.out_rows - 1);  // clamped rows compute, never store
  const int row_b = kGated ? row_a + p.out_rows : min(out0 + g + 8, p.out_rows - 1);
  const __nv_bfloat16* wa = p.weight + (size_t)row_a * cols + 8 * c;
  const __nv_bfloat16* wb = p.weight + (size_t)row_b * cols + 8 * c;

  uint4 ha[kHeld], hb[kHeld];
  int c0 = kb0, c1 = min(kb1, kb0 + p.chunk_kb);
  auto load_weights = [&]() {
#pragma unroll
    for (int j = 0; j < kHeld; ++j) {
      if (c0 + j < c1) {
        ha[j] = load16_l2_256(wa + (c0 + j) * 32);
        hb[j] = load16_l2_256(wb + (c0 + j) * 32);
      }
    }
  };
  load_weights();

  wait_for_previous_kernel(p.trigger_point);

  const bool norm = p.norm_weight != nullptr;
  const float4* nw4 = reinterpret_cast<const float4*>(p.norm_weight);
  // Stage x[b0 .. b0+BT)[32 c0 .. 32 c1) as bf16 (times the norm weight). Warp w copies
  // and converts batch rows w, w+8, ..., so each row's sum of squares is one warp's.
  auto stage = [&](bool first) {
    const int n4 = (c1 - c0) * 8, col4 = c0 * 8, raw4 = p.chunk_kb * 8;  // n4 <= 64
    const bool u0 = lane < n4, u1 = lane + 32 < n4;
    if constexpr (kGather) {  // embedding rows: converted on the way, no cp.async
      const bool keep = blockIdx.y == 0;
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const int n = warp + kWarps * r;
        if (n < nb) {
          const __nv_bfloat16* row = gemv_gather_row<true>(p, p.gather, b0 + n);
          float4* dst = reinterpret_cast<float4*>(raw) + n * raw4;
          if (u0) dst[lane] = gemv_input4<true>(p, p.gather, row, b0 + n, col4 + lane, keep);
          if (u1) dst[lane + 32] = gemv_input4<true>(p, p.gather, row, b0 + n, col4 + lane + 32, keep);
        }
      }
    } else {
      const float* src = p.x + (size_t)(b0 + warp) * p.x_stride + (col4 + lane) * 4;
      float* dst = raw + (warp * raw4 + lane) * 4;
      const size_t src_step = (size_t)kWarps * p.x_stride;
      const int dst_step = kWarps * raw4 * 4;
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        if (warp + kWarps * r < nb) {
          if (u0) cp_async16(dst + r * dst_step, src + r * src_step);
          if (u1) cp_async16(dst + r * dst_step + 128, src + r * src_step + 128);
        }
      }
    }
    float4 gw[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = lane + 32 * u;
      gw[u] = (norm && i < n4) ? nw4[col4 + i] : make_float4(1.f, 1.f, 1.f, 1.f);
    }
    cp_async_wait_all();  // each warp converts only the rows it copied
    __syncwarp();
    float ssr[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int n = warp + kWarps * r;
      float ss = 0.f;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = lane + 32 * u;
        if (u == 0 ? u0 : u1) {
          const float4 x = n < nb ? reinterpret_cast<const float4*>(raw)[n * raw4 + i] : make_float4(0.f, 0.f, 0.f, 0.f);
          ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
          uint2 packed;
          packed.x = pack_bf16(x.x * gw[u].x, x.y * gw[u].y);
          packed.y = pack_bf16(x.z * gw[u].z, x.w * gw[u].w);
          reinterpret_cast<uint2*>(xs + n * kXWords)[i] = packed;
        }
      }
      ssr[r] = ss;
    }
    if (norm) {
      // Lane L < RPW ends with the warp's sum for row warp + 8 L.
      const float t = warp_sum_many<RPW>(ssr);
      if (lane < RPW) {
        const int n = warp + kWarps * lane;
        ss_blk[n] = first ? t : ss_blk[n] + t;
      }
    }
  };
  // All of a chunk's weights are held, so the 16x8 output tiles are finished per chunk,
  // TG at a time (TG independent mma chains), and go straight to the partial tile (added
  // to it after the first chunk). part[n][r] for this warp's rows r is this warp's alone.
  const uint32_t* xg = xs + g * kXWords + 4 * c;
  auto consume = [&](bool first) {
#pragma unroll
    for (int t0 = 0; t0 < NT; t0 += TG) {
      float d[TG][4];
#pragma unroll
      for (int t = 0; t < TG; ++t) d[t][0] = d[t][1] = d[t][2] = d[t][3] = 0.f;
#pragma unroll
      for (int j = 0; j < kHeld; ++j) {
        if (c0 + j < c1) {
#pragma unroll
          for (int t = 0; t < TG; ++t) {
            const uint4 xv = *reinterpret_cast<const uint4*>(xg + ((t0 + t) * 8) * kXWords + j * 16);
            mma_bf16(d[t], ha[j].x, hb[j].x, ha[j].y, hb[j].y, xv.x, xv.y);
            mma_bf16(d[t], ha[j].z, hb[j].z, ha[j].w, hb[j].w, xv.z, xv.w);
          }
        }
      }
#pragma unroll
      for (int t = 0; t < TG; ++t) {
        const int n = (t0 + t) * 8 + 2 * c, r = warp * 16 + g;
        float* q0 = part + n * kPartStride + r;
        float* q1 = q0 + kPartStride;
        if (first) {
          q0[0] = d[t][0]; q1[0] = d[t][1]; q0[8] = d[t][2]; q1[8] = d[t][3];
        } else {
          q0[0] += d[t][0]; q1[0] += d[t][1]; q0[8] += d[t][2]; q1[8] += d[t][3];
        }
      }
    }
  };
  // First chunk: its weights are in flight since before the wait.
  stage(true);
  __syncthreads();  // bf16 x complete (and, when aliased, the raw chunk no longer read)
  consume(true);
  // Further chunks (only for column slices wider than the held registers; the partial
  // tile then has its own space).
  while (c1 < kb1) {
    c0 = c1;
    c1 = min(kb1, c0 + p.chunk_kb);
    load_weights();
    __syncthreads();  // everyone is done with the previous chunk of xs
    stage(false);
    __syncthreads();
    consume(false);
  }
  if (p.trigger_point == 0) allow_next_kernel();
  // This block's partial tile (and sums of squares) are complete: tell the cluster
  // (release: the shared-memory writes become visible to the blocks that wait below), and
  // prepare the reduction while the others catch up.
  cluster_arrive_release<KS>();

  // This block finishes 4-row groups [grp0, grp1) of the block's output rows, for all
  // batch columns: item i -> (column n, group). Accumulate's y values are loaded before
  // the cluster barrier so their latency hides behind it.
  constexpr int kGroups = kOutRows / 4;
  constexpr int kMaxGroups = (kGroups + KS - 1) / KS;
  constexpr int kItems = (kMaxGroups * BT + kThreads - 1) / kThreads;
  const int grp0 = rank * kGroups / KS, ngrp = (rank + 1) * kGroups / KS - grp0;
  int item_n[kItems], item_r[kItems];
  float4 yold[kItems];
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int idx = threadIdx.x + it * kThreads;
    const int n = idx / ngrp;
    item_n[it] = idx < ngrp * BT ? n : BT;  // BT: nothing to do
    item_r[it] = (grp0 + idx - n * ngrp) * 4;
    if constexpr (E == GemvEpilogue::Accumulate) {
      float v[4] = {0.f, 0.f, 0.f, 0.f};
      if (item_n[it] < nb) {
        const float* src = p.y + (size_t)(b0 + n) * p.y_stride + out_base + item_r[it];
        if (out_base + item_r[it] + 3 < p.out_rows && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
          const float4 t = *reinterpret_cast<const float4*>(src);
          v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (out_base + item_r[it] + e < p.out_rows) v[e] = src[e];
        }
      }
      yold[it] = make_float4(v[0], v[1], v[2], v[3]);
    }
  }

  const float* pq[KS];
  const float* sq[KS];
#pragma unroll
  for (int q = 0; q < KS; ++q) pq[q] = map_cluster_rank<KS>(part, q), sq[q] = map_cluster_rank<KS>(&ss_blk[0], q);
  cluster_wait_acquire<KS>();

  // Every remote load first, then the sums (in rank order: deterministic).
  float4 va[kItems][KS], vg[kGated ? kItems : 1][KS];
  float vs[kItems][KS];
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int n = min(item_n[it], BT - 1), r = item_r[it];
    const int prow = kGated ? (r >> 3) * 16 + (r & 7) : r;
#pragma unroll
    for (int q = 0; q < KS; ++q) {
      if (item_n[it] < nb) {
        va[it][q] = *reinterpret_cast<const float4*>(pq[q] + n * kPartStride + prow);
        if constexpr (kGated) vg[it][q] = *reinterpret_cast<const float4*>(pq[q] + n * kPartStride + prow + 8);
        vs[it][q] = norm ? sq[q][n] : 0.f;
      }
    }
  }
  float4 res[kItems];
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    res[it] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (item_n[it] >= nb) continue;
    float4 a = va[it][0], gt = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (kGated) gt = vg[it][0];
    float ssum = vs[it][0];
#pragma unroll
    for (int q = 1; q < KS; ++q) {
      a.x += va[it][q].x; a.y += va[it][q].y; a.z += va[it][q].z; a.w += va[it][q].w;
      if constexpr (kGated) {
        gt.x += vg[it][q].x; gt.y += vg[it][q].y; gt.z += vg[it][q].z; gt.w += vg[it][q].w;
      }
      ssum += vs[it][q];
    }
    const float scale = norm ? rsqrtf(ssum / cols + p.norm_eps) : 1.f;
    a.x *= scale; a.y *= scale; a.z *= scale; a.w *= scale;
    if constexpr (kGated) a = make_float4(a.x * silu(gt.x * scale), a.y * silu(gt.y * scale),
                                          a.z * silu(gt.z * scale), a.w * silu(gt.w * scale));
    res[it] = a;
  }
  // This block is done with the others' shared memory: say so before its own stores
  // (release orders the remote loads, which the sums above already waited for, so the
  // fence finds nothing outstanding; after the stores it waited for them).
  cluster_arrive_release<KS>();
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    if (item_n[it] >= nb) continue;
    const int n = item_n[it];
    const float av[4] = {res[it].x, res[it].y, res[it].z, res[it].w};
    const float yv[4] = {yold[it].x, yold[it].y, yold[it].z, yold[it].w};
    float* out = p.y + (size_t)(b0 + n) * p.y_stride + out_base + item_r[it];
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = E == GemvEpilogue::Accumulate ? yv[e] + av[e] : av[e];
    if (out_base + item_r[it] + 3 < p.out_rows && (reinterpret_cast<uintptr_t>(out) & 15) == 0) {
      *reinterpret_cast<float4*>(out) = make_float4(v[0], v[1], v[2], v[3]);  // one 16-byte store
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (out_base + item_r[it] + e < p.out_rows) out[e] = v[e];
    }
  }
  cluster_wait_acquire<KS>();  // keep this block's shared memory until all have read it
}

template <bool G>
using RowsKernel = void (*)(std::conditional_t<G, RowsGatherParams, RowsParams>);

template <GemvEpilogue E, bool G, int BT>
RowsKernel<G> rows_kernel_bt(int ks) {
  switch (ks) {
    case 2: return gemv_mma_rows_kernel<BT, 2, E, G>;
    case 4: return gemv_mma_rows_kernel<BT, 4, E, G>;
    default: return gemv_mma_rows_kernel<BT, 8, E, G>;
  }
}

template <GemvEpilogue E, bool G = false>
RowsKernel<G> rows_kernel_e(int bt, int ks) {
  switch (bt) {
    case 8: return rows_kernel_bt<E, G, 8>(ks);
    case 16: return rows_kernel_bt<E, G, 16>(ks);
    case 32: return rows_kernel_bt<E, G, 32>(ks);
    default: return rows_kernel_bt<E, G, 64>(ks);
  }
}

RowsKernel<false> rows_kernel(GemvEpilogue e, int bt, int ks) {
  switch (e) {
    case GemvEpilogue::Store: return rows_kernel_e<GemvEpilogue::Store>(bt, ks);
    case GemvEpilogue::Accumulate: return rows_kernel_e<GemvEpilogue::Accumulate>(bt, ks);
    default: return rows_kernel_e<GemvEpilogue::GatedSilu>(bt, ks);
  }
}

// Shared-memory layout of one (batch tile, cluster size) choice.
struct RowsLayout {
  int chunk = 0, row_words = 0, raw_offset = 0, part_offset = 0;
  size_t smem = 0;
};

RowsLayout rows_layout(int kblocks, int bt, int ks) {
  const int slice = (kblocks + ks - 1) / ks;  // widest column slice, in 32-column blocks
  int chunk = std::max(1, std::min(kHeld, slice));
  auto words = [](int) { return kXWords; };  // the kernel's compile-time stride
  while (chunk > 1 && rows_smem(bt, chunk, words(chunk), chunk >= slice) > kMaxSharedBytesPerBlock - 1024) --chunk;
  const bool alias = chunk >= slice;
  RowsLayout l;
  l.chunk = chunk;
  l.row_words = words(chunk);
  l.raw_offset = bt * l.row_words;
  l.part_offset = l.raw_offset + (alias ? 0 : bt * 32 * chunk);
  l.smem = rows_smem(bt, chunk, l.row_words, alias);
  return l;
}

// Blocks of this kernel the GPU runs at once: clusters must fit within one GPC, so large
// clusters leave multiprocessors unused (measured: 32 clusters of 7, 30 of 8 at once).
long resident_blocks(const void* k, int ks, size_t smem) {
  allow_dynamic_smem(k, smem);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(ks, 1, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = smem;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, k, &config) != cudaSuccess ||
      clusters <= 0) {
    (void)cudaGetLastError();
    return 2L * multiprocessor_count();
  }
  return static_cast<long>(clusters) * ks;
}

}  // namespace

// Batch tile and cluster size from a rough cost model, fitted to measurements: a
// multiprocessor's time is about (blocks it gets) x (one block's bytes: weights, x slice,
// a fixed part for latencies), a penalty for slices wider than the held registers
// (several chunks), times the waves when the grid exceeds what runs at once.
// GemvPolicy::row_block_cluster / row_block_batch_tile fix either instead.
KernelLaunch plan_gemv_mma_rows(const GemvArgs& a) {
  const int kblocks = a.cols / 32;
  const int out_rows_per_block = a.epilogue == GemvEpilogue::GatedSilu ? kRowsPerBlock / 2 : kRowsPerBlock;
  const long row_blocks = (a.out_rows + out_rows_per_block - 1) / out_rows_per_block;
  int max_bt = 8;
  while (max_bt < 64 && max_bt < a.batch) max_bt *= 2;
  int bt = max_bt, ks = 4;
  double best = 1e30;
  // Beside another chain, one batch tile: fewer blocks, the other chain fills the GPU.
  const int min_bt = a.beside_other_chains ? max_bt : 8;
  for (int cbt = max_bt; cbt >= min_bt; cbt /= 2) {
    for (int cks : {2, 4, 8}) {
      const long blocks = row_blocks * ((a.batch + cbt - 1) / cbt) * cks;
      const int slice = (kblocks + cks - 1) / cks;
      const double block_kb = 16.0 + slice * (kRowsPerBlock * 64.0 + cbt * 128.0) / 1024.0 +
                              (slice > kHeld ? 32.0 : 0.0);
      const void* kernel = a.gather.table != nullptr
                               ? reinterpret_cast<const void*>(rows_kernel_e<GemvEpilogue::Store, true>(cbt, cks))
                               : reinterpret_cast<const void*>(rows_kernel(a.epilogue, cbt, cks));
      const long resident = resident_blocks(kernel, cks,
                                            rows_layout(kblocks, cbt, cks).smem);
      const double cost = static_cast<double>((blocks + multiprocessor_count() - 1) / multiprocessor_count()) * block_kb *
                          static_cast<double>((blocks + resident - 1) / resident);
      if (cost < best - 1e-9) best = cost, bt = cbt, ks = cks;
    }
  }
  if (a.policy.row_block_cluster != 0) ks = a.policy.row_block_cluster;
  if (a.policy.row_block_batch_tile != 0) bt = a.policy.row_block_batch_tile;

  const RowsLayout l = rows_layout(kblocks, bt, ks);
  const RowsParams p{gemv_operands<__nv_bfloat16>(a), l.chunk, l.row_words, l.raw_offset, l.part_offset};
  const dim3 grid(((a.batch + bt - 1) / bt) * ks, row_blocks);
  const std::string variant = "tensor cores, 128-row blocks, batch tile " + std::to_string(bt) + ", cluster " +
                              std::to_string(ks) + ", chunk " + std::to_string(l.chunk);
  if (a.gather.table != nullptr) {
    const RowsGatherParams pg{p, gemv_gather_operands<__nv_bfloat16>(a)};
    return KernelLaunch::make("gemv_mma", rows_kernel_e<GemvEpilogue::Store, true>(bt, ks), grid, dim3(kThreads),
                              l.smem, pg)
        .described(variant);
  }
  return KernelLaunch::make("gemv_mma", rows_kernel(a.epilogue, bt, ks), grid, dim3(kThreads), l.smem, p)
      .described(variant);
}

// From GemvPolicy::row_block_min_batch (0: never). Below batch 8 only for matrices of many
// row blocks: with few, the 16-row kernel's more blocks fill the GPU better.
bool gemv_mma_rows_applies(const GemvArgs& a) {
  const int min_b = a.policy.row_block_min_batch;
  const int out_rows_per_block = a.epilogue == GemvEpilogue::GatedSilu ? kRowsPerBlock / 2 : kRowsPerBlock;
  const int row_blocks = (a.out_rows + out_rows_per_block - 1) / out_rows_per_block;
  return min_b > 0 && a.batch >= min_b && (a.batch >= 8 || row_blocks >= 16) && cluster_launch_supported();
}

}  // namespace m3::kernels
