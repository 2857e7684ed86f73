// Hopper (sm_90a) grouped GEMM kernels over ragged row groups: gmm, gmm + SwiGLU, gmm + SwiGLU backward + router
// weight gradient, and tgmm (contraction over the ragged rows).
//
// One persistent, warp-specialized kernel template serves all four:
//  - 384 threads: warpgroup 0 is the producer (one thread issues TMA loads into a 4-stage shared-memory ring, each
//    stage guarded by a "full" mbarrier with the transaction byte count and an "empty" mbarrier the consumers
//    arrive on); warpgroups 1 and 2 are consumers, each owning 64 rows of the 128-row tile and issuing wgmma
//    (m64nNk16, operands from shared memory, float32 accumulators in registers). setmaxnreg moves registers from
//    the producer to the consumers.
//  - The tile scheduler runs on the device: every CTA walks the linear tile index blockIdx.x, +gridDim.x, ... and
//    maps it to (group, m block, n block) from group_offsets, so nothing is synced to the host. Producer and
//    consumers walk the same sequence; the decomposition is kernels/grouped_gemm.h's, which the CPU twins walk too.
//  - Every mbarrier wait has a 20 s deadline (then __trap), so a broken pipeline fails the launch instead of hanging.
//  - Shared-memory tiles are 128-byte-swizzled 64-element lines written by TMA (box inner dim 64 bf16 = 128 B) and
//    read by wgmma through matrix descriptors; K-major operands advance 32 B per k16 step inside the swizzle atom,
//    MN-major operands (the rhs [K, N] of a forward GEMM, both operands of tgmm) advance two 8-row groups (2 KB).
//  - Epilogues work on the accumulator fragments in registers and store straight to global memory.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include "kernels/grouped_gemm.h"

namespace jk {
namespace grouped_gemm {
namespace sm90 {

constexpr int kBlockM = kTileRows;  // 128 rows: 2 consumer warpgroups x 64
constexpr int kBlockK = 64;   // one 128-byte swizzled line of bf16
constexpr int kStages = 4;
constexpr int kThreads = 384;
constexpr int kLineBytes = 128;
constexpr int kSubTileBytes = 64 * kLineBytes;  // 64 lines: one MN-major 64-wide chunk of a k step
constexpr int kABytes = kBlockM * kLineBytes;   // 16 KB
constexpr int kBBytes = 256 * kLineBytes;       // 32 KB: 256 output columns (or gate 128 + up 128)
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kSmemBytes = kStages * kStageBytes + 1024 /* alignment slack */ + 2 * kStages * 8;
constexpr uint64_t kCacheHintNormal = 0x1000000000000000ull;  // L2 evict-normal policy for TMA loads

enum class Mode : int {
  kGmm = 0,          // out = lhs @ rhs (+ lhs2 @ rhs2 over the second K range)
  kSwiglu = 1,       // act = swiglu(lhs @ w_gate, lhs @ w_up) (+ saved gate, up)
  kSwigluDgrad = 2,  // g = dy @ w_down^T; SwiGLU backward and per-n-block router-weight partials
  kTgmm = 3,         // out[g] = (row_scale * lhs)[rows of g]^T @ rhs[rows of g]
};

struct Params {
  GroupLayout layout;
  int32_t n;         // output columns (N, or I for the SwiGLU modes)
  int32_t m_extent;  // tgmm: the K of lhs [R, K] (output rows per group)
  int32_t k_steps1;  // row-grouped modes: 64-wide k steps over rhs (K1 / 64)
  int32_t k_steps2;  // ... and over rhs2 (K2 / 64)
  void* out;         // gmm: [R, N]; tgmm: [G, K, N]; swiglu: act [R, I]; dgrad: d_gate [R, I]
  uint16_t* out2;    // swiglu: saved gate (or null); dgrad: d_up
  uint16_t* out3;    // swiglu: saved up (or null)
  const uint16_t* gate_in;  // dgrad
  const uint16_t* up_in;    // dgrad
  const float* row_weights;    // dgrad
  float* row_weight_partials;  // dgrad: [n blocks, R]
  const float* row_scale;      // tgmm (or null)
  SwigluClamp clamp;
};

struct TensorMaps {
  CUtensorMap a;   // lhs
  CUtensorMap b;   // rhs (gmm, tgmm, dgrad) or w_gate (swiglu)
  CUtensorMap b2;  // rhs2 (gmm) or w_up (swiglu)
};

// ---------------------------------------------------------------------------------------------------------------
// Tile scheduling: the decomposition of kernels/grouped_gemm.h (shared with the CPU twins), one tile type per mode.

struct Tile {
  int32_t group;
  int32_t row0;     // row-grouped: first row of the tile; tgmm: first contraction row of the group
  int32_t valid;    // row-grouped: data rows in the tile; tgmm: data rows of the group
  int32_t written;  // row-grouped: rows of the tile to write (data + padding)
  int32_t m0, n0;   // tgmm: output row and column; row-grouped: n0 only
  int32_t n_block;
};

template <Mode kMode, int kBlockN>
struct Scheduler {
  RowTileScheduler<kBlockM, kBlockN> rows;

  __device__ explicit Scheduler(const Params& p) : rows(p.layout, p.n) {}

  // Maps linear tile t (nondecreasing across calls) to a tile; false when t is past the last tile.
  __device__ bool get(const Params& p, int32_t t, Tile* tile) {
    if constexpr (kMode == Mode::kTgmm) {
      ContractionTile c;
      if (!contraction_tile<kBlockM, kBlockN>(p.layout, p.m_extent, p.n, t, &c)) return false;
      *tile = {c.group, c.row0, c.valid, 0, c.m0, c.n0, 0};
      return true;
    } else {
      RowTile r;
      if (!rows.get(p.layout, t, &r)) return false;
      *tile = {r.group, r.row0, r.valid, r.written, 0, r.n0, r.n_block};
      return true;
    }
  }

  // k steps of a tile's main loop; 0 means the tile is written as zeros without loading anything.
  __device__ int32_t k_steps(const Params& p, const Tile& tile) const {
    if constexpr (kMode == Mode::kTgmm) return (tile.valid + kBlockK - 1) / kBlockK;
    return tile.valid > 0 ? p.k_steps1 + p.k_steps2 : 0;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// mbarrier wait with a deadline: a pipeline that never completes (a transaction byte count that does not match
// the loads, say) traps after kWaitTimeoutNs, so the launch fails with an error instead of hanging the GPU.

constexpr uint64_t kWaitTimeoutNs = 20ull * 1000 * 1000 * 1000;

__device__ __forceinline__ void wait_barrier(uint64_t* barrier, uint32_t parity) {
  uint32_t addr = cute::cast_smem_ptr_to_uint(barrier);
  uint64_t start = 0;
  while (true) {
    uint32_t done;
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
    if (done) return;
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (start == 0) {
      start = now;
    } else if (now - start > kWaitTimeoutNs) {
      __trap();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Operand layouts.

// Matrix descriptor of a 128-byte-swizzled tile (1024-byte aligned). K-major: lines are MN rows of 64 K values,
// 8-row groups 1 KB apart. MN-major: lines are K rows of 64 MN values, 8-row groups 1 KB apart, 64-wide MN chunks
// kSubTileBytes apart.
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t smem_addr, bool mn_major) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  uint64_t leading = mn_major ? (kSubTileBytes >> 4) : 1;
  desc |= leading << 16;
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;
  desc |= 1ull << 62;  // 128-byte swizzle
  return desc;
}

// Bytes the descriptor start moves per k16 step.
constexpr uint32_t k16_advance(bool mn_major) { return mn_major ? 2 * 1024 : 32; }

template <Mode kMode>
struct OperandLayout {
  static constexpr bool kAMnMajor = kMode == Mode::kTgmm;
  static constexpr int kBlockN = kMode == Mode::kSwiglu ? kSwigluTileCols : kTileCols;
};

// ---------------------------------------------------------------------------------------------------------------
// wgmma wrappers: expand the accumulator array into the instruction's register list.

template <class Mma, size_t... I>
__device__ __forceinline__ void mma_call(uint64_t desc_a, uint64_t desc_b, float* acc, cute::SM90::GMMA::ScaleOut scale,
                                         std::index_sequence<I...>) {
  Mma::fma(desc_a, desc_b, acc[I]..., scale);
}

template <int kN, bool kAMn, bool kBMn>
__device__ __forceinline__ void wgmma(uint64_t desc_a, uint64_t desc_b, float* acc, bool accumulate) {
  using cute::SM90::GMMA::Major;
  constexpr Major a_major = kAMn ? Major::MN : Major::K;
  constexpr Major b_major = kBMn ? Major::MN : Major::K;
  using Mma = typename std::conditional<kN == 256, cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<a_major, b_major>,
                                        cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<a_major, b_major>>::type;
  mma_call<Mma>(desc_a, desc_b, acc, accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero,
                std::make_index_sequence<kN / 2>{});
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma.
template <Mode kMode>
__device__ __forceinline__ void fence_accumulators(float* acc, float* acc_up) {
  constexpr int kAccN = kMode == Mode::kSwiglu ? 64 : 128;
#pragma unroll
  for (int i = 0; i < kAccN; ++i) cute::warpgroup_fence_operand(acc[i]);
  if constexpr (kMode == Mode::kSwiglu) {
#pragma unroll
    for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(acc_up[i]);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Producer: TMA loads of one k step into a stage.

template <Mode kMode, bool kBMnMajor>
__device__ __forceinline__ void load_stage(const TensorMaps& maps, const Params& p, const Tile& tile, int32_t ks,
                                           uint8_t* a_smem, uint8_t* b_smem, uint64_t* full) {
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, kStageBytes);
  if constexpr (kMode == Mode::kTgmm) {
    int32_t row = tile.row0 + ks * kBlockK;
    for (int i = 0; i < 2; ++i)
      cute::SM90_TMA_LOAD_2D::copy(&maps.a, full, kCacheHintNormal, a_smem + i * kSubTileBytes, tile.m0 + 64 * i, row);
    for (int j = 0; j < 4; ++j)
      cute::SM90_TMA_LOAD_2D::copy(&maps.b, full, kCacheHintNormal, b_smem + j * kSubTileBytes, tile.n0 + 64 * j, row);
  } else {
    int32_t row = tile.row0;
    cute::SM90_TMA_LOAD_2D::copy(&maps.a, full, kCacheHintNormal, a_smem, ks * kBlockK, row);
    if constexpr (kMode == Mode::kSwiglu) {
      for (int j = 0; j < 2; ++j) {
        cute::SM90_TMA_LOAD_3D::copy(&maps.b, full, kCacheHintNormal, b_smem + j * kSubTileBytes, tile.n0 + 64 * j,
                                     ks * kBlockK, tile.group);
        cute::SM90_TMA_LOAD_3D::copy(&maps.b2, full, kCacheHintNormal, b_smem + (2 + j) * kSubTileBytes,
                                     tile.n0 + 64 * j, ks * kBlockK, tile.group);
      }
    } else {
      const CUtensorMap* map = ks < p.k_steps1 ? &maps.b : &maps.b2;
      int32_t k = (ks < p.k_steps1 ? ks : ks - p.k_steps1) * kBlockK;
      if constexpr (kBMnMajor) {
        for (int j = 0; j < 4; ++j)
          cute::SM90_TMA_LOAD_3D::copy(map, full, kCacheHintNormal, b_smem + j * kSubTileBytes, tile.n0 + 64 * j, k,
                                       tile.group);
      } else {
        cute::SM90_TMA_LOAD_3D::copy(map, full, kCacheHintNormal, b_smem, k, tile.n0, tile.group);
      }
    }
  }
}

// Two floats -> bf16x2 (lo in the low half), round to nearest even, in one instruction.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// tgmm: rows of a k step outside the group are zeroed in both operands (padding rows may hold anything, even NaN)
// and lhs rows are scaled by row_scale, in shared memory before the wgmma reads them.

__device__ __forceinline__ void tgmm_fixup(const Params& p, const Tile& tile, int32_t ks, uint8_t* a_smem,
                                           uint8_t* b_smem, int consumer_thread) {
  int32_t step_row0 = ks * kBlockK;
  int32_t rows_here = tile.valid - step_row0;  // > 0
  bool partial = rows_here < kBlockK;
  if (!partial && p.row_scale == nullptr) return;
  // A: both 64-wide halves, 64 lines x 8 chunks of 16 B each = 1024 chunks over 256 threads.
  for (int c = consumer_thread; c < 2 * 64 * 8; c += 256) {
    int line = (c >> 3) & 63;
    uint4* chunk = reinterpret_cast<uint4*>(a_smem + (c >> 9) * kSubTileBytes + line * kLineBytes + (c & 7) * 16);
    if (line >= rows_here) {
      *chunk = make_uint4(0, 0, 0, 0);
    } else if (p.row_scale != nullptr) {
      float scale = p.row_scale[tile.row0 + step_row0 + line];
      uint4 v = *chunk;
      uint32_t* words = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        float lo = bf16_bits_to_float(static_cast<uint16_t>(words[w] & 0xFFFF)) * scale;
        float hi = bf16_bits_to_float(static_cast<uint16_t>(words[w] >> 16)) * scale;
        words[w] = pack_bf16x2(lo, hi);
      }
      *chunk = v;
    }
  }
  if (partial) {
    int bad_lines = kBlockK - rows_here;
    for (int c = consumer_thread; c < 4 * bad_lines * 8; c += 256) {
      int sub = c / (bad_lines * 8);
      int rest = c - sub * bad_lines * 8;
      int line = rows_here + (rest >> 3);
      *reinterpret_cast<uint4*>(b_smem + sub * kSubTileBytes + line * kLineBytes + (rest & 7) * 16) =
          make_uint4(0, 0, 0, 0);
    }
  }
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(256, 1);
}

// ---------------------------------------------------------------------------------------------------------------
// Epilogues. Fragment of thread (warp w in its warpgroup, lane l): rows w*16 + l/4 + 8h, columns 8j + 2(l%4) + {0,1}
// in acc[4j + 2h + {0,1}].

template <typename OutT>
__device__ __forceinline__ void store_pair(OutT* out, int64_t index, float lo, float hi) {
  if constexpr (sizeof(OutT) == 4) {
    *reinterpret_cast<float2*>(out + index) = make_float2(lo, hi);
  } else {
    *reinterpret_cast<uint32_t*>(out + index) = pack_bf16x2(lo, hi);
  }
}

template <Mode kMode, int kBlockN, typename OutT>
__device__ __forceinline__ void epilogue(const Params& p, const Tile& tile, bool has_data, const float* acc,
                                         const float* acc_up, int warpgroup_row0, int lane) {
  const int col_in_block = 2 * (lane & 3);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r_local = warpgroup_row0 + (lane >> 2) + 8 * h;
    if constexpr (kMode == Mode::kTgmm) {
      int32_t m = tile.m0 + r_local;
      if (m >= p.m_extent) continue;
      OutT* out = static_cast<OutT*>(p.out) + (static_cast<int64_t>(tile.group) * p.m_extent + m) * p.n;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        int32_t col = tile.n0 + 8 * j + col_in_block;
        if (tile.n0 + 8 * j >= p.n) break;
        float lo = has_data ? acc[4 * j + 2 * h] : 0.0f;
        float hi = has_data ? acc[4 * j + 2 * h + 1] : 0.0f;
        store_pair(out, col, lo, hi);
      }
    } else {
      // dgrad keeps rows past the tile in the loop: its quad shuffles below need all 32 lanes of the warp.
      const bool in_tile = r_local < tile.written;
      if (kMode != Mode::kSwigluDgrad && !in_tile) continue;
      const bool data = has_data && r_local < tile.valid;
      const int64_t row = static_cast<int64_t>(tile.row0) + r_local;
      if constexpr (kMode == Mode::kGmm) {
        OutT* out = static_cast<OutT*>(p.out) + row * p.n;
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          if (tile.n0 + 8 * j >= p.n) break;
          store_pair(out, tile.n0 + 8 * j + col_in_block, data ? acc[4 * j + 2 * h] : 0.0f,
                     data ? acc[4 * j + 2 * h + 1] : 0.0f);
        }
      } else if constexpr (kMode == Mode::kSwiglu) {
        uint16_t* act = static_cast<uint16_t*>(p.out) + row * p.n;
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          if (tile.n0 + 8 * j >= p.n) break;
          int32_t col = tile.n0 + 8 * j + col_in_block;
          float g0 = acc[4 * j + 2 * h], g1 = acc[4 * j + 2 * h + 1];
          float u0 = acc_up[4 * j + 2 * h], u1 = acc_up[4 * j + 2 * h + 1];
          uint32_t act_bits = data ? pack_bf16x2(swiglu(g0, u0, p.clamp), swiglu(g1, u1, p.clamp)) : 0u;
          *reinterpret_cast<uint32_t*>(act + col) = act_bits;
          if (p.out2 != nullptr) {
            *reinterpret_cast<uint32_t*>(p.out2 + row * p.n + col) = data ? pack_bf16x2(g0, g1) : 0u;
            *reinterpret_cast<uint32_t*>(p.out3 + row * p.n + col) = data ? pack_bf16x2(u0, u1) : 0u;
          }
        }
      } else {  // kSwigluDgrad
        uint16_t* d_gate = static_cast<uint16_t*>(p.out) + row * p.n;
        uint16_t* d_up = p.out2 + row * p.n;
        const float weight = data ? p.row_weights[row] : 0.0f;
        float row_partial = 0.0f;
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          if (tile.n0 + 8 * j >= p.n) break;
          int32_t col = tile.n0 + 8 * j + col_in_block;
          uint32_t dg_bits = 0, du_bits = 0;
          if (data) {
            uint32_t gate2 = *reinterpret_cast<const uint32_t*>(p.gate_in + row * p.n + col);
            uint32_t up2 = *reinterpret_cast<const uint32_t*>(p.up_in + row * p.n + col);
            float dg[2], du[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              float gate = bf16_bits_to_float(static_cast<uint16_t>(c ? gate2 >> 16 : gate2 & 0xFFFF));
              float up = bf16_bits_to_float(static_cast<uint16_t>(c ? up2 >> 16 : up2 & 0xFFFF));
              float g = acc[4 * j + 2 * h + c];
              row_partial += g * round_to_bf16(swiglu(gate, up, p.clamp));
              swiglu_backward(gate, up, weight * g, p.clamp, &dg[c], &du[c]);
            }
            dg_bits = pack_bf16x2(dg[0], dg[1]);
            du_bits = pack_bf16x2(du[0], du[1]);
          }
          if (in_tile) {
            *reinterpret_cast<uint32_t*>(d_gate + col) = dg_bits;
            *reinterpret_cast<uint32_t*>(d_up + col) = du_bits;
          }
        }
        // The four lanes of a quad hold one row: a fixed butterfly order keeps the sum deterministic.
        row_partial += __shfl_xor_sync(0xFFFFFFFF, row_partial, 1);
        row_partial += __shfl_xor_sync(0xFFFFFFFF, row_partial, 2);
        if (in_tile && (lane & 3) == 0) p.row_weight_partials[static_cast<int64_t>(tile.n_block) * p.layout.rows + row] = row_partial;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The kernel.

template <Mode kMode, bool kBMnMajor, typename OutT>
__global__ void __launch_bounds__(kThreads, 1) grouped_gemm_kernel(const __grid_constant__ TensorMaps maps, Params p) {
  constexpr int kBlockN = OperandLayout<kMode>::kBlockN;
  constexpr bool kAMn = OperandLayout<kMode>::kAMnMajor;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;

  const int warpgroup = threadIdx.x / 128;
  const int thread_in_wg = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterBarrier::init(&full[s], 1);
      cutlass::arch::ClusterBarrier::init(&empty[s], 8);  // one arrive per consumer warp
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  Scheduler<kMode, kBlockN> scheduler(p);
  Tile tile;
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (thread_in_wg != 0) return;
    cute::prefetch_tma_descriptor(&maps.a);
    cute::prefetch_tma_descriptor(&maps.b);
    cute::prefetch_tma_descriptor(&maps.b2);
    uint32_t it = 0;
    for (int32_t t = blockIdx.x; scheduler.get(p, t, &tile); t += gridDim.x) {
      int32_t steps = scheduler.k_steps(p, tile);
      for (int32_t ks = 0; ks < steps; ++ks, ++it) {
        uint32_t stage = it % kStages;
        wait_barrier(&empty[stage], ((it / kStages) & 1) ^ 1);
        uint8_t* a_smem = smem + stage * kStageBytes;
        load_stage<kMode, kBMnMajor>(maps, p, tile, ks, a_smem, a_smem + kABytes, &full[stage]);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int consumer = warpgroup - 1;
  const int consumer_thread = threadIdx.x - 128;
  const int lane = threadIdx.x % 32;
  const int warpgroup_row0 = consumer * 64 + (thread_in_wg / 32) * 16;
  constexpr int kAccN = kMode == Mode::kSwiglu ? 64 : kBlockN / 2;
  float acc[kAccN];
  float acc_up[kMode == Mode::kSwiglu ? 64 : 1];
  uint32_t it = 0;
  for (int32_t t = blockIdx.x; scheduler.get(p, t, &tile); t += gridDim.x) {
    int32_t steps = scheduler.k_steps(p, tile);
    for (int32_t ks = 0; ks < steps; ++ks, ++it) {
      uint32_t stage = it % kStages;
      wait_barrier(&full[stage], (it / kStages) & 1);
      uint8_t* a_smem = smem + stage * kStageBytes;
      uint8_t* b_smem = a_smem + kABytes;
      if constexpr (kMode == Mode::kTgmm) tgmm_fixup(p, tile, ks, a_smem, b_smem, consumer_thread);
      uint32_t a_addr = cute::cast_smem_ptr_to_uint(a_smem + consumer * (kAMn ? kSubTileBytes : 64 * kLineBytes));
      uint32_t b_addr = cute::cast_smem_ptr_to_uint(b_smem);
      fence_accumulators<kMode>(acc, acc_up);
      cute::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        uint64_t desc_a = smem_descriptor(a_addr + kk * k16_advance(kAMn), kAMn);
        bool accumulate = ks > 0 || kk > 0;
        if constexpr (kMode == Mode::kSwiglu) {
          wgmma<128, false, true>(desc_a, smem_descriptor(b_addr + kk * k16_advance(true), true), acc, accumulate);
          wgmma<128, false, true>(desc_a, smem_descriptor(b_addr + 2 * kSubTileBytes + kk * k16_advance(true), true),
                                  acc_up, accumulate);
        } else {
          wgmma<256, kAMn, kBMnMajor>(desc_a, smem_descriptor(b_addr + kk * k16_advance(kBMnMajor), kBMnMajor), acc,
                                      accumulate);
        }
      }
      cute::warpgroup_commit_batch();
      // Keep this step's wgmma in flight while releasing the previous step's stage.
      cute::warpgroup_wait<1>();
      fence_accumulators<kMode>(acc, acc_up);
      if (ks > 0 && lane == 0) cutlass::arch::ClusterBarrier::arrive(&empty[(it - 1) % kStages]);
    }
    cute::warpgroup_wait<0>();
    fence_accumulators<kMode>(acc, acc_up);
    if (steps > 0 && lane == 0) cutlass::arch::ClusterBarrier::arrive(&empty[(it - 1) % kStages]);
    epilogue<kMode, kBlockN, OutT>(p, tile, steps > 0, acc, acc_up, warpgroup_row0, lane);
  }
}

// d_row_weights[r] = sum over n blocks of the partials, in block order (deterministic).
__global__ void sum_row_weight_partials(const float* partials, int32_t n_blocks, int64_t rows, float* d_row_weights) {
  int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float sum = 0.0f;
  for (int32_t b = 0; b < n_blocks; ++b) sum += partials[b * rows + r];
  d_row_weights[r] = sum;
}

}  // namespace sm90
}  // namespace grouped_gemm
}  // namespace jk
