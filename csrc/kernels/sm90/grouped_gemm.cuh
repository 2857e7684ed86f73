// Hopper (sm_90a) grouped GEMM kernels over ragged row groups: gmm, gmm + SwiGLU, gmm + SwiGLU backward + router
// weight gradient, and tgmm (contraction over the ragged rows).
//
// One persistent, warp-specialized kernel template serves all four:
//  - 384 threads: warpgroup 0 is the producer (one thread issues TMA loads into a 4-stage shared-memory ring, each
//    stage guarded by a "full" mbarrier with the transaction byte count and an "empty" mbarrier the consumers
//    arrive on); warpgroups 1 and 2 are consumers, each owning 64 rows of the 128-row tile and issuing one
//    m64n256k16 wgmma per 16-wide k slice (operands from shared memory, float32 accumulators in registers; the
//    SwiGLU modes' 256 columns are the gate's 128 and then the up's, so both products come from one instruction).
//    A consumer whose 64 rows hold no data (the short last tile of a group) issues none, and the tensor cores serve
//    the other one alone. setmaxnreg moves registers from the producer to the consumers.
//  - The tile scheduler runs on the device: linear tile indices map to (group, m block, n block) through
//    group_offsets, so nothing is synced to the host; the decomposition is kernels/grouped_gemm.h's, which the CPU
//    twins walk too, in the row GEMMs after a visit plan (light groups between the heavy groups' bands) that one
//    warp of each CTA makes at the start. CTAs (clusters) claim tiles in order from a global counter as they free
//    up (see "Tile queue"); the producer decodes each claimed tile and hands it to the CTA's consumers through a
//    small shared-memory ring (see "Tile ring"), so that the consumers go from one tile's epilogue to the next tile's
//    k loop without the scheduler's arithmetic.
//  - Clusters of two CTAs (kCluster = 2) when the n-block count is even. A row pair takes the two n blocks of one
//    (group, m block), so their lhs tiles are equal: each producer loads one 64-row half of the lhs stage and
//    multicasts it into both CTAs (40 KB of L2-to-SM traffic per k step instead of 48). The row GEMMs whose lhs is
//    gathered run in weight pairs instead: as a rule two adjacent m blocks of one n block, whose weights each producer
//    loads one column half of for both (32 KB a k step; see "Weight pairs"). A stage is free again when the consumers
//    of both CTAs have released it (16 warp arrivals on each CTA's empty barrier). This is TMA multicast inside one
//    GPU (shared memory of a thread-block cluster's SMs), not NVLink multicast.
//  - An operand may come straight from the tokens through a row -> token map (kGathered): the lhs of gmm_swiglu and
//    of the dgrad, either operand of tgmm. Producer warps then copy its lines with cp.async; tgmm's gathered lhs in a
//    row pair is copied half by each CTA and forwarded to the peer by a bulk copy between the CTAs' shared memory
//    (see "Gathered operands").
//  - Every mbarrier wait but the tile queue's and the tile ring's pops has a 20 s deadline (then __trap), so a broken
//    pipeline fails the launch instead of hanging (the pops wait on a thread whose own waits have one).
//  - Shared-memory tiles are 128-byte-swizzled 64-element lines written by TMA (box inner dim 64 bf16 = 128 B) and
//    read by wgmma through matrix descriptors; K-major operands advance 32 B per k16 step inside the swizzle atom,
//    MN-major operands (the rhs [K, N] of a forward GEMM, both operands of tgmm) advance two 8-row groups (2 KB).
//  - Epilogues work on the accumulator fragments in registers. bf16 outputs go out in 16 x 64 chunks, each warp its
//    own 16 rows, through two swizzled staging buffers per warp (stmatrix) and TMA stores, so a warp moves on
//    without waiting for the others and starts its next tile while the copies drain; float32 outputs, and the rows
//    of a tile that ends inside the buffer short of 16 rows per warp (the box would overwrite the next group's
//    rows), are stored from registers.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <cute/arch/cluster_sm90.hpp>
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
constexpr int kStoreRows = 16;  // a consumer warp's rows of its fragment: each warp stores its own boxes
constexpr int kStoreBytes = kStoreRows * kLineBytes;  // 2 KB: 16 x 64 bf16
constexpr int kStagingBytes = 8 * 2 * kStoreBytes;    // two store buffers per consumer warp
constexpr int kTileSlots = 4;  // the tile queue's and the tile ring's slots: tiles ahead of the slowest reader
constexpr int kQueueBytes = 2 * kTileSlots * 8 + kTileSlots * 4;
constexpr int kTileBytes = 32;  // a decoded Tile
constexpr int kRingBytes = kTileSlots * kTileBytes + 2 * kTileSlots * 8;
constexpr int kPlanBytes = 16 + 2 * kMaxVisits;  // a VisitPlan (kernels/grouped_gemm.h)
constexpr int kSmemBytes = kStages * kStageBytes + kStagingBytes + 1024 /* alignment slack */ + 3 * kStages * 8 +
                           kQueueBytes + kRingBytes + kPlanBytes;
static_assert(kSmemBytes <= 232448, "over the 227 KB of shared memory a Hopper CTA may opt in to");
constexpr uint64_t kCacheHintNormal = 0x1000000000000000ull;  // L2 evict-normal policy for TMA loads

// Which operand the producer copies from the tokens through row_tokens instead of loading it by TMA: the lhs
// (gmm_swiglu, dgrad, tgmm) or the rhs (tgmm).
enum class Gathered : int { kNone = 0, kLhs = 1, kRhs = 2 };

enum class Mode : int {
  kGmm = 0,          // out = lhs @ rhs (+ lhs2 @ rhs2: k steps k_steps1.. run over the second pair)
  kSwiglu = 1,       // act = swiglu(lhs @ w_gate, lhs @ w_up) (+ saved gate, up)
  kSwigluDgrad = 2,  // g = dy @ w_down^T; SwiGLU backward, per-n-block router-weight partials (+ weighted act)
  kTgmm = 3,         // out[g] = lhs[rows of g]^T @ rhs[rows of g]
};

struct Params {
  GroupLayout layout;
  int32_t n;         // output columns (N, or I for the SwiGLU modes)
  int32_t m_extent;  // tgmm: the K of lhs [R, K] (output rows per group)
  int32_t k_steps1;  // row-grouped modes: 64-wide k steps over rhs (K1 / 64)
  int32_t k_steps2;  // ... and over rhs2 (K2 / 64)
  void* out;         // gmm: [R, N]; tgmm: [G, K, N]; swiglu: act [R, I]; dgrad: d_gate [R, I]
  uint16_t* out2;    // swiglu: saved gate (or null); dgrad: d_up
  uint16_t* out3;    // swiglu: saved up (or null); dgrad: weighted act (or null)
  const uint16_t* gate_in;  // dgrad
  const uint16_t* up_in;    // dgrad
  const float* row_weights;    // dgrad
  float* row_weight_partials;  // dgrad: [n blocks, R]
  SwigluClamp clamp;
  // A gathered operand: its row r is token row_tokens[r] of tokens [num_tokens, 8 * token_chunks] (a token outside
  // [0, num_tokens) reads as zeros).
  const uint16_t* tokens;
  const int32_t* row_tokens;  // [R]
  int32_t num_tokens;
  uint32_t token_chunks;  // 16-byte chunks of a token row
  int32_t* tile_counter;  // zeroed before the launch: claims past each cluster's first tile
};

// The maps a target does not use are left zero and never read.
struct TensorMaps {
  CUtensorMap a;   // lhs
  CUtensorMap a2;  // lhs2 (gmm with a second K range)
  CUtensorMap b;   // rhs (gmm, tgmm, dgrad) or w_gate (swiglu)
  CUtensorMap b2;  // rhs2 (gmm) or w_up (swiglu)
  // bf16 outputs, boxes of kStoreRows x 64: gmm out [R, N]; swiglu act, gate, up [R, I]; dgrad d_gate, d_up,
  // weighted act [R, I]; tgmm out [G, K, N]. Unused (never read) for float32 outputs.
  CUtensorMap out[3];
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
  int32_t k_steps;  // of the main loop; 0: written as zeros without loading anything; -1: past the last tile
};

static_assert(sizeof(VisitPlan) <= kPlanBytes);
static_assert(2 * kMaxVisits <= kStagingBytes, "the planning warp's scratch lies in the staging buffers");

template <Mode kMode, int kBlockN>
struct Scheduler {
  RowTileScheduler<kBlockM, kBlockN> rows;

  __device__ Scheduler(const Params& p, const VisitPlan& plan) : rows(p.layout, p.n, &plan) {}

  // Maps linear tile t (nondecreasing across calls) to a tile, with k_steps -1 when t is past the last tile.
  __device__ Tile get(const Params& p, int32_t t) {
    if constexpr (kMode == Mode::kTgmm) {
      ContractionTile c;
      if (!contraction_tile<kBlockM, kBlockN>(p.layout, p.m_extent, p.n, t, &c)) return past_the_end();
      return {c.group, c.row0, c.valid, 0, c.m0, c.n0, 0, (c.valid + kBlockK - 1) / kBlockK};
    } else {
      RowTile r;
      if (!rows.get(p.layout, t, &r)) return past_the_end();
      return {r.group, r.row0, r.valid, r.written, 0, r.n0, r.n_block, r.valid > 0 ? p.k_steps1 + p.k_steps2 : 0};
    }
  }

  __device__ static Tile past_the_end() { return {0, 0, 0, 0, 0, 0, 0, -1}; }

  // Whether consumer c's 64 rows of the tile hold data (tgmm: lie inside K, a multiple of 64), i.e. have products.
  __device__ static bool consumer_has_rows(const Params& p, const Tile& tile, int consumer) {
    if constexpr (kMode == Mode::kTgmm) return tile.m0 + 64 * consumer < p.m_extent;
    return 64 * consumer < tile.valid;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// mbarrier wait with a deadline: a pipeline that never completes (a transaction byte count that does not match
// the loads, say) traps after kWaitTimeoutNs, so the launch fails with an error instead of hanging the GPU.

constexpr uint64_t kWaitTimeoutNs = 20ull * 1000 * 1000 * 1000;

// One test of phase `parity` of the barrier at shared-memory address addr (the instruction itself waits a while).
// CTA scope throughout, also where peer CTAs arrive: a cluster-scope release or acquire costs a MEMBAR.GPU or an L1
// invalidation (CCTL.IVALL) per call, and nothing here needs one (see "Tile queue").
__device__ __forceinline__ bool try_wait_barrier(uint32_t addr, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(addr), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void wait_barrier_at(uint32_t addr, uint32_t parity) {
  uint64_t start = 0;
  while (!try_wait_barrier(addr, parity)) {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (start == 0) {
      start = now;
    } else if (now - start > kWaitTimeoutNs) {
      __trap();
    }
  }
}

__device__ __forceinline__ void wait_barrier(uint64_t* barrier, uint32_t parity) {
  wait_barrier_at(cute::cast_smem_ptr_to_uint(barrier), parity);
}

// ---------------------------------------------------------------------------------------------------------------
// Tile queue: which tiles a CTA runs, in which order.
//
// Tiles that share operands sit next to each other in the linear order (an n block's weights across a band's m
// blocks, a tile's lhs across its cluster pair), and they only share them through L2 if they run at about the same
// time. A fixed stride (t = blockIdx.x, +gridDim.x, ...) lets the CTAs drift apart: short tiles (a group's last m
// block, one consumer idle) finish early and their CTA runs ahead, so after some waves the tiles in flight need not
// share operands (with that stride, kimi-k2's gate/up GEMM read 15.8 GB from DRAM for ~4 GB of operands, banded
// order or not). Claiming tiles from a counter keeps the tiles in flight a contiguous run of the order, and
// balances ragged tile lengths at the end.
//
// The unit of a claim is a cluster's pair of tiles (kCluster * pair + rank; a weight pair's differ, see "Weight
// pairs"). Each cluster's first pair is its own index; later ones are gridDim.x / kCluster + atomicAdd(tile_counter,
// 1). Producer thread 0 of the cluster's rank 0 (the fetcher) claims a pair when it starts loading the tile and writes
// it into slot i % kTileSlots of every CTA of the cluster, with the slot's full barrier there. The readers (the
// producer threads of each CTA) wait for it, read it and arrive on rank 0's empty barrier of the slot, which the
// fetcher waits for before it writes the slot again (a CTA-scope arrival, like a consumer's release of a stage that the
// peer then refills). The pair past the last tile is published too: it stops every reader.

// The shared::cluster address of a shared-memory address of this CTA, in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t in_cta(uint32_t local, uint32_t rank) {
  uint32_t peer;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer) : "r"(local), "r"(rank));
  return peer;
}

template <int kCluster>
struct TileQueue {
  // kQueueBytes of shared memory from `base` on: full barriers [kTileSlots] (one arrival: the fetcher's), empty
  // barriers [kTileSlots] (rank 0's count every reader warp of the cluster), then the claimed pairs int32
  // [kTileSlots].
  uint32_t base;
  uint32_t index = 0;

  // The count of the empty barriers: per CTA, the producer's reader warps (with a gathered operand all 4, else
  // thread 0).
  static constexpr int readers(bool gathered) { return kCluster * (gathered ? 4 : 1); }

  __device__ uint32_t full(uint32_t slot) const { return base + 8 * slot; }
  __device__ uint32_t empty(uint32_t slot) const { return base + 8 * (kTileSlots + slot); }
  __device__ uint32_t pair_at(uint32_t slot) const { return base + 16 * kTileSlots + 4 * slot; }

  __device__ void init(bool gathered) const {
    for (uint32_t slot = 0; slot < kTileSlots; ++slot) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full(slot)) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(empty(slot)), "r"(readers(gathered))
                   : "memory");
    }
  }

  // Arrives on a barrier of this CTA (kCluster == 1) or of CTA `rank`.
  __device__ static void arrive(uint32_t barrier, uint32_t rank) {
    if constexpr (kCluster == 1) {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
    } else {
      asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(in_cta(barrier, rank)) : "memory");
    }
  }

  // Fetcher only, before its own pop of the same index. In a cluster the pair goes out by st.async, whose bytes
  // complete the slot's full barrier in each CTA (the arrival expects them): a reader that sees the phase complete
  // sees the pair, with no cluster-scope release.
  __device__ void publish(int32_t pair) const {
    const uint32_t slot = index % kTileSlots;
    wait_barrier_at(empty(slot), ((index / kTileSlots) & 1) ^ 1);
    if constexpr (kCluster == 1) {
      asm volatile("st.shared::cta.u32 [%0], %1;" ::"r"(pair_at(slot)), "r"(pair) : "memory");
      arrive(full(slot), 0);
    } else {
#pragma unroll
      for (uint32_t rank = 0; rank < kCluster; ++rank) {
        const uint32_t full_there = in_cta(full(slot), rank);
        asm volatile("mbarrier.arrive.expect_tx.shared::cluster.b64 _, [%0], 4;" ::"r"(full_there) : "memory");
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%0], %1, [%2];" ::"r"(
                         in_cta(pair_at(slot), rank)),
                     "r"(pair), "r"(full_there)
                     : "memory");
      }
    }
  }

  // Every reader: the next claimed pair. kWholeWarp: all 32 lanes call it and lane 0 arrives for them; otherwise
  // a lone thread (producer thread 0 without a gathered operand) arrives for itself. No deadline, as the tile ring's
  // pop (below): the fetcher publishes every index up to the one past the last tile, unless one of its own waits
  // traps first.
  template <bool kWholeWarp>
  __device__ int32_t pop() {
    const uint32_t slot = index % kTileSlots;
    while (!try_wait_barrier(full(slot), (index / kTileSlots) & 1)) {
    }
    int32_t pair;
    asm volatile("ld.shared::cta.u32 %0, [%1];" : "=r"(pair) : "r"(pair_at(slot)) : "memory");
    if constexpr (kWholeWarp) __syncwarp();
    if (!kWholeWarp || threadIdx.x % 32 == 0) arrive(empty(slot), 0);
    ++index;
    return pair;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Tile ring: the producer's thread 0 decodes each tile it pops from the queue (Scheduler::get, whose divisions and
// group walk would otherwise run in every consumer warp between two tiles, while the tensor cores wait) and writes it
// into slot i % kTileSlots of a CTA-local ring, ahead of the tile's stages. The 8 consumer warps wait on the slot's
// full barrier (the producer's arrival releases the write), read the tile and arrive on the slot's empty barrier,
// which the producer waits for before it writes the slot again. The tile past the last one (k_steps -1) goes through
// the ring too and stops the consumers.
// These waits have no deadline (one here cost the consumers ~2 KB of register spills in the dgrad kernel): the
// producer pushes every tile up to the one past the last, unless one of its own waits, which have deadlines, traps
// first and ends the launch.
struct TileRing {
  // kRingBytes of shared memory from `base` on (16-byte aligned; the address alone, so that the consumers keep one
  // register for it): the tiles [kTileSlots], then full barriers [kTileSlots] (one arrival: the producer's) and
  // empty barriers [kTileSlots] (8 arrivals: the consumer warps').
  uint32_t base;
  uint32_t index = 0;
  static_assert(sizeof(Tile) == kTileBytes, "a tile is two 16-byte words");

  __device__ uint32_t tile_at(uint32_t slot) const { return base + kTileBytes * slot; }
  __device__ uint32_t full(uint32_t slot) const { return base + kTileBytes * kTileSlots + 8 * slot; }
  __device__ uint32_t empty(uint32_t slot) const { return full(kTileSlots + slot); }

  __device__ void init() const {
    for (uint32_t slot = 0; slot < kTileSlots; ++slot) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full(slot)) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 8;" ::"r"(empty(slot)) : "memory");
    }
  }

  // Producer thread 0.
  __device__ void push(const Tile& tile) {
    const uint32_t slot = index % kTileSlots;
    wait_barrier_at(empty(slot), ((index / kTileSlots) & 1) ^ 1);
    asm volatile("st.shared::cta.v4.s32 [%0], {%1, %2, %3, %4};" ::"r"(tile_at(slot)), "r"(tile.group),
                 "r"(tile.row0), "r"(tile.valid), "r"(tile.written)
                 : "memory");
    asm volatile("st.shared::cta.v4.s32 [%0], {%1, %2, %3, %4};" ::"r"(tile_at(slot) + 16), "r"(tile.m0),
                 "r"(tile.n0), "r"(tile.n_block), "r"(tile.k_steps)
                 : "memory");
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(full(slot)) : "memory");
    ++index;
  }

  // Every consumer warp, all 32 lanes; lane 0 arrives for the warp.
  __device__ Tile pop() {
    const uint32_t slot = index % kTileSlots;
    while (!try_wait_barrier(full(slot), (index / kTileSlots) & 1)) {
    }
    Tile tile;
    asm volatile("ld.shared::cta.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(tile.group), "=r"(tile.row0), "=r"(tile.valid), "=r"(tile.written)
                 : "r"(tile_at(slot))
                 : "memory");
    asm volatile("ld.shared::cta.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(tile.m0), "=r"(tile.n0), "=r"(tile.n_block), "=r"(tile.k_steps)
                 : "r"(tile_at(slot) + 16)
                 : "memory");
    __syncwarp();
    if (threadIdx.x % 32 == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty(slot)) : "memory");
    ++index;
    return tile;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Operand layouts.

// Matrix descriptor of a 128-byte-swizzled tile (1024-byte aligned). K-major: lines are MN rows of 64 K values,
// 8-row groups 1 KB apart. MN-major: lines are K rows of 64 MN values, 8-row groups 1 KB apart, 64-wide MN chunks
// kSubTileBytes apart. The low word holds the start address (16-byte units, bits 0-13) and the leading byte offset;
// the high word, the same for every operand, the 8-row stride and the swizzle mode.
constexpr uint32_t kDescriptorHigh = (1024 >> 4) | (1u << 30);  // stride 1 KB; 128-byte swizzle (bit 62)

__device__ __forceinline__ uint32_t descriptor_low(uint32_t smem_addr, bool mn_major) {
  const uint32_t leading = mn_major ? (kSubTileBytes >> 4) : 1;
  return ((smem_addr & 0x3FFFF) >> 4) | (leading << 16);
}

// A start address moved inside the shared-memory window (< 256 KB) stays inside the 14-bit field, so stages and
// k16 slices are one add on the low word (offset in 16-byte units).
__device__ __forceinline__ uint64_t descriptor(uint32_t low, uint32_t offset) {
  return (static_cast<uint64_t>(kDescriptorHigh) << 32) | (low + offset);
}

// 16-byte units the descriptor start moves per k16 step.
constexpr uint32_t k16_advance(bool mn_major) { return (mn_major ? 2 * 1024 : 32) >> 4; }

template <Mode kMode>
struct OperandLayout {
  static constexpr bool kAMnMajor = kMode == Mode::kTgmm;
  static constexpr int kBlockN = kMode == Mode::kSwiglu ? kSwigluTileCols : kTileCols;  // output columns
};

// A consumer's 64 x 256 float32 fragment: 128 registers per thread. In the SwiGLU mode up column j sits kUpOffset
// registers after gate column j (128 columns further along the fragment).
constexpr int kAccumulators = 128;
constexpr int kUpOffset = 64;

// ---------------------------------------------------------------------------------------------------------------
// wgmma wrappers: expand the accumulator array into the instruction's register list.

template <class Mma, size_t... I>
__device__ __forceinline__ void mma_call(uint64_t desc_a, uint64_t desc_b, float* acc, cute::SM90::GMMA::ScaleOut scale,
                                         std::index_sequence<I...>) {
  Mma::fma(desc_a, desc_b, acc[I]..., scale);
}

template <bool kAMn, bool kBMn>
__device__ __forceinline__ void wgmma(uint64_t desc_a, uint64_t desc_b, float* acc, bool accumulate) {
  using cute::SM90::GMMA::Major;
  using Mma = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<kAMn ? Major::MN : Major::K, kBMn ? Major::MN : Major::K>;
  mma_call<Mma>(desc_a, desc_b, acc, accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero,
                std::make_index_sequence<kAccumulators>{});
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma.
__device__ __forceinline__ void fence_accumulators(float* acc) {
#pragma unroll
  for (int i = 0; i < kAccumulators; ++i) cute::warpgroup_fence_operand(acc[i]);
}

// ---------------------------------------------------------------------------------------------------------------
// Producer: TMA loads of one k step into a stage.

// What the two CTAs of a cluster share. A row pair takes the two n blocks of one (group, m block): their lhs tiles
// are equal. The row GEMMs with a gathered lhs (gmm_swiglu's and the dgrad's) run in weight pairs, two tiles two
// apart in the order, as a rule two adjacent m blocks of one n block (see "Weight pairs" below): where both are
// of one group, their weights.
template <Mode kMode, int kCluster, Gathered kGathered>
struct ClusterLayout {
  static constexpr bool kWeightPair = kCluster == 2 && kMode != Mode::kTgmm && kGathered == Gathered::kLhs;
  static constexpr bool kRowPair = kCluster == 2 && !kWeightPair;
  static constexpr uint16_t kBoth = 3;  // the multicast mask of both CTAs
};

// One TMA load into this CTA's shared memory, or multicast into the CTAs of `peers` (0: this CTA alone), completing
// bytes on each one's barrier at `full`'s offset.
template <class... Coords>
__device__ __forceinline__ void tma_load(const CUtensorMap* map, uint64_t* full, uint16_t peers, void* smem,
                                         Coords... coords) {
  if (peers != 0) {
    cute::SM90_TMA_LOAD_MULTICAST::copy(map, full, peers, kCacheHintNormal, smem, static_cast<int32_t>(coords)...);
  } else {
    cute::SM90_TMA_LOAD::copy(map, full, kCacheHintNormal, smem, static_cast<int32_t>(coords)...);
  }
}

// The lhs of k step ks by TMA: in a row pair this CTA loads lhs half `rank` into both CTAs, and its peer the other.
template <Mode kMode, int kCluster, Gathered kGathered>
__device__ __forceinline__ void load_lhs(const TensorMaps& maps, const Params& p, const Tile& tile, int32_t ks,
                                         uint32_t rank, uint8_t* a_smem, uint64_t* full) {
  using Layout = ClusterLayout<kMode, kCluster, kGathered>;
  const uint16_t peers = Layout::kRowPair ? Layout::kBoth : 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (Layout::kRowPair && half != static_cast<int>(rank)) continue;
    uint8_t* half_smem = a_smem + half * kSubTileBytes;
    if constexpr (kMode == Mode::kTgmm) {  // MN-major: a half is 64 output rows (m) of the 64 contraction rows
      tma_load(&maps.a, full, peers, half_smem, tile.m0 + 64 * half, tile.row0 + ks * kBlockK);
    } else {  // 64 tile rows; k steps from k_steps1 on read lhs2
      const bool second = ks >= p.k_steps1;
      tma_load(second ? &maps.a2 : &maps.a, full, peers, half_smem, (second ? ks - p.k_steps1 : ks) * kBlockK,
               tile.row0 + 64 * half);
    }
  }
}

// Column half `half` (128 of the 256) of the rhs of k step ks, into the CTAs of `peers`. Half 1 lies 16 KB after
// half 0: SwiGLU's halves are the gate's and the up's operands (one box each), the dgrad's are 128 K-major lines each
// (its map's box is half as tall in weight pairs).
template <Mode kMode>
__device__ __forceinline__ void load_rhs_half(const TensorMaps& maps, const Tile& tile, int32_t ks, int half,
                                              uint16_t peers, uint8_t* b_smem, uint64_t* full) {
  static_assert(kMode == Mode::kSwiglu || kMode == Mode::kSwigluDgrad, "weights loaded in halves");
  uint8_t* half_smem = b_smem + half * (kBBytes / 2);
  if constexpr (kMode == Mode::kSwiglu) {
    tma_load(half == 0 ? &maps.b : &maps.b2, full, peers, half_smem, 0, ks * kBlockK, tile.n0 / 64, tile.group);
  } else {
    tma_load(&maps.b, full, peers, half_smem, ks * kBlockK, tile.n0 + 128 * half, tile.group);
  }
}

// The rhs of k step ks by TMA. MN-major operands come as one box of 64-column chunks (the maps' chunk dim), so
// that a k step issues one load per operand, not one per chunk. In a weight pair: this CTA's half (`rank`) into
// both CTAs when the pair shares its weights, else both halves here.
template <Mode kMode, bool kBMnMajor, int kCluster, Gathered kGathered>
__device__ __forceinline__ void load_rhs(const TensorMaps& maps, const Params& p, const Tile& tile, int32_t ks,
                                         uint32_t rank, bool share_weights, uint8_t* b_smem, uint64_t* full) {
  using Layout = ClusterLayout<kMode, kCluster, kGathered>;
  if constexpr (Layout::kWeightPair) {
    if (share_weights) {
      load_rhs_half<kMode>(maps, tile, ks, static_cast<int>(rank), Layout::kBoth, b_smem, full);
    } else {
      load_rhs_half<kMode>(maps, tile, ks, 0, 0, b_smem, full);
      load_rhs_half<kMode>(maps, tile, ks, 1, 0, b_smem, full);
    }
  } else if constexpr (kMode == Mode::kTgmm) {
    tma_load(&maps.b, full, 0, b_smem, 0, tile.row0 + ks * kBlockK, tile.n0 / 64, 0);
  } else if constexpr (kMode == Mode::kSwiglu) {  // one 256-column operand: the gate's 128 columns, then the up's
    load_rhs_half<kMode>(maps, tile, ks, 0, 0, b_smem, full);
    load_rhs_half<kMode>(maps, tile, ks, 1, 0, b_smem, full);
  } else {
    const CUtensorMap* map = ks < p.k_steps1 ? &maps.b : &maps.b2;
    const int32_t k = (ks < p.k_steps1 ? ks : ks - p.k_steps1) * kBlockK;
    if constexpr (kBMnMajor) {
      tma_load(map, full, 0, b_smem, 0, k, tile.n0 / 64, tile.group);
    } else {
      tma_load(map, full, 0, b_smem, k, tile.n0, tile.group);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Gathered operands (straight from the tokens): Hopper's TMA cannot follow a row map, so producer threads copy the
// operand's lines with cp.async, 16 bytes per copy, to where the 128-byte swizzle puts them: the layout a TMA box
// gives. A line is 64 values of one token row: for a K-major lhs (gmm_swiglu, dgrad) a tile row's k step, for tgmm's
// MN-major operands one contraction row's 64 columns of a sub-tile. Each gathering thread copies chunk t % 8 of its
// lines, so one warp instruction moves four whole lines; the other operand still comes by TMA from thread 0, whose
// arrival on the stage's full barrier carries the transaction bytes.
//  - Alone (kCluster = 1), in a weight pair, or a gathered rhs (tgmm's own 256 columns, never shared), the whole
//    producer warpgroup copies the lines, and each thread's copies arrive on the stage's full barrier when they land
//    (noinc: the barrier's count includes the 128 threads).
//  - tgmm's gathered lhs in a row pair (the CTAs share it, as with a TMA lhs): warps 0-1 copy this CTA's 64-line
//    half and arrive on the stage's `landed` barrier. Warp 2 (the forwarder) waits for it and sends the half on to
//    the same offset of the peer's stage by one shared::cluster bulk copy, whose bytes complete there on the peer's
//    full barrier; then it arrives on its own full barrier for the half. So each CTA reads half the lhs bytes from
//    L2 and issues half the copies, as the multicast halves of a TMA lhs do.
// A K-major line's token is fixed for the tile, so the thread looks its 8 tokens up once per tile. tgmm's lines are
// the k step's contraction rows, each the same row in every sub-tile: the thread looks up its 4 (8 in a cluster)
// rows' tokens per k step, before it waits for the stage.

template <Mode kMode, Gathered kGathered, int kCluster>
struct Gather {
  static constexpr bool kRhs = kGathered == Gathered::kRhs;
  static constexpr bool kMnMajor = kMode == Mode::kTgmm;
  static constexpr bool kForwards = !kRhs && ClusterLayout<kMode, kCluster, kGathered>::kRowPair;
  // This CTA's lines of a stage: a forwarded lhs is copied half by each CTA of the row pair.
  static constexpr int kLines = kRhs ? kBBytes / kLineBytes : (kForwards ? kBlockM / 2 : kBlockM);
  static constexpr int kLinesPerThread = kRhs ? 16 : 8;
  static constexpr int kThreads = kLines * (kLineBytes / 16) / kLinesPerThread;  // 128, or 64 forwarding
  static constexpr int kLineStride = kThreads / 8;                               // between a thread's lines
  // Token rows per thread: a K-major line is one, tgmm's lines repeat the 64 contraction rows in each sub-tile.
  static constexpr int kRows = kMnMajor ? kBlockK / kLineStride : kLinesPerThread;
  static constexpr int kForwarderWarp = kThreads / 32;
  static constexpr int kFullArrivals = kForwards ? 2 : 1 + kThreads;  // thread 0, and the copies or the forwarder
  static constexpr uint32_t kFullBytes = kRhs ? kABytes : (kForwards ? kBBytes + kSubTileBytes : kBBytes);
  static constexpr uint32_t kStageOffset = kRhs ? kABytes : 0;  // the operand's place in a stage
  static_assert(!kForwards || kLines * kLineBytes == kSubTileBytes, "a half is one sub-tile");
  static_assert(kMnMajor || kLineStride * kLinesPerThread == kLines, "K-major: one line per row");

  // The operand's line of the thread's line 0 (this CTA's half first when forwarding); line i is kLineStride * i
  // further.
  __device__ static int first_line(uint32_t rank, int thread) {
    return (kForwards ? static_cast<int>(rank) * kLines : 0) + thread / 8;
  }
};

// Where each of the thread's token rows starts in the tokens, in 16-byte chunks (32 bits: the producer has 40
// registers), and which read as zeros: rows without data and tokens out of range.
template <int kRows>
struct GatherRows {
  uint32_t first_chunk[kRows];
  uint32_t zero_mask;  // bit i: row i is zeros
};

// Rows first + step * i (i < kRows) of the tile, counted from tile.row0; those from tile.valid on have no data.
template <int kRows>
__device__ __forceinline__ GatherRows<kRows> gather_rows(const Params& p, const Tile& tile, int32_t first,
                                                          int32_t step) {
  GatherRows<kRows> rows;
  rows.zero_mask = 0;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int32_t row = first + step * i;
    const int32_t token = row < tile.valid ? p.row_tokens[tile.row0 + row] : -1;
    const bool zeros = token < 0 || token >= p.num_tokens;
    rows.first_chunk[i] = zeros ? 0u : static_cast<uint32_t>(token) * p.token_chunks;
    rows.zero_mask |= static_cast<uint32_t>(zeros) << i;
  }
  return rows;
}

// The thread's copies of one k step, arriving on `barrier` as they land. Line i comes from row i % kRows at 16-byte
// chunk `column` (the k step's, or the thread's first sub-tile's) plus 8 per sub-tile, i / kRows, and goes to line
// first_line + kLineStride * i of the operand at `operand` (shared-memory address). tgmm's last m or n block may reach
// past the token rows' columns (K or N a multiple of 64, not of the tile): such sub-tiles read zeros, as from a TMA
// box, with a source inside the tokens (no byte of it is read).
template <class G>
__device__ __forceinline__ void gather_copies(const Params& p, const GatherRows<G::kRows>& rows, uint32_t column,
                                              uint32_t operand, int first_line, int thread, uint64_t* barrier) {
  const int chunk = thread % 8;
  // The column's chunk of token 0; a line's source is first_chunk 16-byte units further, one wide multiply-add
  // (written in PTX: left to itself the compiler re-associates the sum into four instructions per line).
  const uint64_t column_chunk = reinterpret_cast<uint64_t>(p.tokens) + 16 * static_cast<uint64_t>(column + chunk);
  // A thread's lines are 8 apart, so they share the swizzle's row phase.
  const uint32_t swizzled = (chunk ^ (first_line & 7)) << 4;
#pragma unroll
  for (int i = 0; i < G::kLinesPerThread; ++i) {
    const int row = i % G::kRows;
    const uint32_t dst = operand + (first_line + G::kLineStride * i) * kLineBytes + swizzled;
    const bool outside = G::kMnMajor && column + 8 * (i / G::kRows) >= p.token_chunks;
    const uint32_t src_bytes = outside || ((rows.zero_mask >> row) & 1) ? 0 : 16;  // a source size of 0: zeros
    const uint64_t sub_tile_chunk = column_chunk + 128 * (i / G::kRows);
    uint64_t src;
    asm("mad.wide.u32 %0, %1, 16, %2;" : "=l"(src) : "r"(rows.first_chunk[row]), "l"(sub_tile_chunk));
    if (outside) src = reinterpret_cast<uint64_t>(p.tokens);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
  }
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(cute::cast_smem_ptr_to_uint(barrier))
               : "memory");
}

// Row pairs only, the forwarder warp (lane 0 issues): this CTA's landed half of stage `stage` on to the peer's stage,
// then its own full barrier's arrival for the half. peer_stage0 and peer_full0 are the peer's stage 0 and its full
// barrier, as shared::cluster addresses.
__device__ __forceinline__ void forward_lhs_half(uint8_t* smem, uint64_t* full, uint64_t* landed, uint32_t stage,
                                                 uint32_t parity, uint32_t rank, uint32_t peer_stage0,
                                                 uint32_t peer_full0, int lane) {
  wait_barrier(&landed[stage], parity);
  if (lane != 0) return;
  // cp.async wrote through the generic proxy; the bulk copy reads through the async proxy.
  cutlass::arch::fence_view_async_shared();
  const uint32_t half_offset = stage * kStageBytes + rank * kSubTileBytes;
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          peer_stage0 + half_offset),
      "r"(cute::cast_smem_ptr_to_uint(smem) + half_offset), "n"(kSubTileBytes), "r"(peer_full0 + 8 * stage)
      : "memory");
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(cute::cast_smem_ptr_to_uint(&full[stage])) : "memory");
}

// Two floats -> bf16x2 (lo in the low half), round to nearest even, in one instruction.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// tgmm: the rows of a group's last k step past its end are zeroed in both operands, in shared memory before the
// wgmma reads them (padding rows, and the next group's, may hold anything, even NaN). The stages are MN-major
// sub-tiles of 64 lines (one per k-step row), a's two then b's four, contiguous; the 256 consumer threads zero the
// bad lines' 16-byte chunks of each in turn. A gathered operand's sub-tiles are skipped: its copies already read such
// lines as zeros (and a forwarded half may still be on its way out to the peer).
template <Gathered kGathered>
__device__ __forceinline__ void tgmm_zero_tail(const Tile& tile, int32_t ks, uint8_t* stage, int consumer_thread) {
  static_assert(kABytes + kBBytes == 6 * kSubTileBytes, "tgmm stage: six MN-major sub-tiles");
  constexpr int kFirstSub = kGathered == Gathered::kLhs ? 2 : 0;
  constexpr int kSubs = kGathered == Gathered::kLhs ? 4 : (kGathered == Gathered::kRhs ? 2 : 6);
  const int32_t rows_here = tile.valid - ks * kBlockK;  // > 0
  if (rows_here >= kBlockK) return;
  const int bad_chunks = (kBlockK - rows_here) * 8;  // per sub-tile
  for (int c = consumer_thread; c < kSubs * bad_chunks; c += 256) {
    const int sub = kFirstSub + c / bad_chunks;
    const int rest = c % bad_chunks;
    *reinterpret_cast<uint4*>(stage + sub * kSubTileBytes + (rows_here + (rest >> 3)) * kLineBytes + (rest & 7) * 16) =
        make_uint4(0, 0, 0, 0);
  }
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(256, 1);
}

// ---------------------------------------------------------------------------------------------------------------
// Epilogues. Fragment of thread (warp w in its warpgroup, lane l): rows w*16 + l/4 + 8h of the warpgroup's 64,
// columns 8j + 2(l%4) + {0,1} in acc[4j + 2h + {0,1}]. Outputs go out in 64-column chunks.

// The warpgroup row of the thread's fragment row h.
__device__ __forceinline__ int fragment_line(int warp, int lane, int h) { return warp * 16 + (lane >> 2) + 8 * h; }

// One 64-column chunk of a bf16 output in fragment order: v[2 jj + h] packs columns 8 jj + 2(l%4) + {0,1} of the
// chunk in row h.
struct ChunkPairs {
  uint32_t v[16];
};

// bf16 chunks through shared memory, per warp: the warp's 16 rows of a chunk go into one of its two
// 128-byte-swizzled staging buffers (four stmatrix: the fragment's 8 x 8 blocks are stmatrix's matrices) and out
// through one TMA store (which clips rows and columns past the tensor's end). No other warp takes part, so the
// warps of a consumer do not wait for each other in the epilogue.
struct StagedStore {
  uint32_t buffers;     // shared-memory address of 2 x kStoreBytes, 1024-byte aligned
  uint32_t issued = 0;  // chunks stored so far: the same count on every lane

  // coords: (column, row) of a 2D map or (column, row, group) of a 3D one, of the warp's first row.
  template <int kRank>
  __device__ __forceinline__ void store(const CUtensorMap* map, const ChunkPairs& pairs, int lane, int32_t x,
                                        int32_t y, int32_t z) {
    const uint32_t buffer = buffers + (issued & 1) * kStoreBytes;
    if (issued >= 2) {  // the store issued two chunks ago read this buffer: it must be done reading
      if (lane == 0) cute::tma_store_wait<1>();
      __syncwarp();
    }
    // stmatrix q stores the blocks (jj, h) = (2q + i / 2, i % 2) of registers v[4q + i]; lane t addresses row t % 8
    // of block t / 8, i.e. line 8 h + t % 8 of the buffer, whose 16-byte chunk jj the swizzle puts at jj ^ (t % 8).
    const uint32_t line = 8 * ((lane >> 3) & 1) + (lane & 7);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t addr = buffer + line * kLineBytes + (((2 * q + (lane >> 4)) ^ (lane & 7)) << 4);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                   "r"(pairs.v[4 * q]), "r"(pairs.v[4 * q + 1]), "r"(pairs.v[4 * q + 2]), "r"(pairs.v[4 * q + 3])
                   : "memory");
    }
    cute::tma_store_fence();  // the generic-proxy writes must be visible to the TMA (async proxy)
    __syncwarp();
    // Lane 0, whose bulk groups the waits above and drain() wait for (the whole warp is here). Elected, not tested
    // for: the compiler then knows that one thread issues, and reads the store's operands into uniform registers
    // without a loop over the lanes' values.
    if (cute::elect_one_sync()) {
      void* smem = __cvta_shared_to_generic(buffer);
      if constexpr (kRank == 2) {
        cute::SM90_TMA_STORE_2D::copy(map, smem, x, y);
      } else {
        cute::SM90_TMA_STORE_3D::copy(map, smem, x, y, z);
      }
      cute::tma_store_arrive();
    }
    ++issued;
  }

  // Shared memory must outlive the stores' reads of it.
  __device__ __forceinline__ void drain(int lane) const {
    if (lane == 0) cute::tma_store_wait<0>();
  }
};

// A finished tile's staged bf16 chunks, packed in registers, wait there to be stored while the next tile's first k
// steps run: the consumer stores one chunk after issuing each of those steps' wgmma, so the tensor cores do not idle
// through the stores (stmatrix, the proxy fence, the TMA issue) at every tile's end, as they do when both consumers
// store there at once. Slot i holds the tile's chunk i.
// The stores sit in the k loop behind warp votes. Written as a peeled head of the loop, or behind a per-lane test of
// a slot, they made ptxas build every k step's wgmma descriptors in vector registers and move them to uniform ones
// at each wgmma (16 R2UR and 8 moves more per k step, SASS). With that cost, only the GEMMs with short k loops paid
// for holding chunks: back to back at the power cap (`gpu_power_h200_slots_ab.json`), without slots the down GEMM
// took 4.0% (qwen3.5) and 2.1% (kimi-k2) longer, the SwiGLU GEMMs (64-112 k steps) 0.5-1.2% less time. With a
// uniform loop the SwiGLU GEMM holds its activation chunks too; the dgrad epilogue and float32 outputs store at once.
template <Mode kMode, typename OutT>
struct PendingChunks {
  // gmm and tgmm: all 4 chunks of a 256-column tile; SwiGLU: the 2 activation chunks (saved gate and up go at once).
  static constexpr int kSlots =
      sizeof(OutT) != 2 || kMode == Mode::kSwigluDgrad ? 0 : (kMode == Mode::kSwiglu ? kSwigluTileCols / 64 : 4);

  ChunkPairs pairs[kSlots > 0 ? kSlots : 1];
  uint32_t live = 0;  // bit i: slot i waits to be stored
  int32_t x0, y, z;   // the TMA coordinates of the warp's rows of the tile's chunk 0 (column, row, group)

  // Slot `slot` (a constant after unrolling, so that pairs stays in registers) to its output, if it waits. live is
  // the same on every lane (a warp's rows are staged or not together); the test is a vote so that ptxas knows it.
  __device__ __forceinline__ void store(int slot, const TensorMaps& maps, StagedStore& staged, int lane) {
    if (!__any_sync(0xFFFFFFFF, (live >> slot) & 1)) return;
    staged.store<kMode == Mode::kTgmm ? 3 : 2>(&maps.out[0], pairs[slot], lane, x0 + 64 * slot, y, z);
    live &= ~(1u << slot);
  }

  __device__ __forceinline__ void flush(const TensorMaps& maps, StagedStore& staged, int lane) {
#pragma unroll
    for (int slot = 0; slot < kSlots; ++slot) store(slot, maps, staged, lane);
  }
};

// Where the warpgroup's rows of a tile are and which hold data.
struct EpilogueRows {
  int32_t first;   // row (row-grouped: of the [R, *] buffer; tgmm: of the group's K) of the warpgroup's row 0
  bool data[2];    // fragment row h holds data (otherwise it is written as 0)
  bool written[2]; // fragment row h is inside the tile (and the tensor)
  bool staged;     // the warp's rows go out through TMA stores
};

template <Mode kMode, typename OutT>
__device__ __forceinline__ EpilogueRows epilogue_rows(const Params& p, const Tile& tile, bool has_data, int consumer,
                                                      int warp, int lane) {
  EpilogueRows rows;
  const int32_t wg_row0 = consumer * 64;
  if constexpr (kMode == Mode::kTgmm) {
    rows.first = tile.m0 + wg_row0;
    for (int h = 0; h < 2; ++h) {
      rows.data[h] = has_data;
      rows.written[h] = rows.first + fragment_line(warp, lane, h) < p.m_extent;
    }
    rows.staged = sizeof(OutT) == 2 && rows.first + kStoreRows * warp < p.m_extent;  // the 3D map clips at K
  } else {
    rows.first = tile.row0 + wg_row0;
    for (int h = 0; h < 2; ++h) {
      const int32_t r = wg_row0 + fragment_line(warp, lane, h);
      rows.data[h] = has_data && r < tile.valid;
      rows.written[h] = r < tile.written;
    }
    // A warp's box of 16 rows may only run past the tile where the buffer ends (the map clips there).
    const int32_t warp_rows = tile.written - wg_row0 - kStoreRows * warp;
    rows.staged = sizeof(OutT) == 2 &&
                  (warp_rows >= kStoreRows || (warp_rows > 0 && tile.row0 + tile.written == p.layout.rows));
  }
  return rows;
}

// Chunk c of the warpgroup's fragment as bf16 pairs: pair_of(i) packs the two columns at acc[i], acc[i + 1]; zeros
// in rows without data. Rows are masked by selects, not skipped (see the SwiGLU chunks below).
template <class PairOf>
__device__ __forceinline__ ChunkPairs chunk_pairs(int c, const EpilogueRows& rows, PairOf pair_of) {
  ChunkPairs pairs;
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t pair = pair_of(4 * (8 * c + jj) + 2 * h);
      pairs.v[2 * jj + h] = rows.data[h] ? pair : 0u;
    }
  }
  return pairs;
}

__device__ __forceinline__ ChunkPairs pack_chunk(const float* acc, int c, const EpilogueRows& rows) {
  return chunk_pairs(c, rows, [&](int i) { return pack_bf16x2(acc[i], acc[i + 1]); });
}

// dgrad: chunk c of the forward's saved gate and up in fragment order, 0 in rows without data (which may lie past
// the buffer's end).
struct SavedGateUp {
  ChunkPairs gate, up;
};

__device__ __forceinline__ SavedGateUp load_saved_gate_up(const Params& p, const Tile& tile, const EpilogueRows& rows,
                                                          int c, int warp, int lane) {
  SavedGateUp saved;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = static_cast<int64_t>(rows.first) + fragment_line(warp, lane, h);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int64_t at = row * p.n + tile.n0 + 64 * c + 8 * jj + 2 * (lane & 3);
      saved.gate.v[2 * jj + h] = rows.data[h] ? __ldg(reinterpret_cast<const uint32_t*>(p.gate_in + at)) : 0u;
      saved.up.v[2 * jj + h] = rows.data[h] ? __ldg(reinterpret_cast<const uint32_t*>(p.up_in + at)) : 0u;
    }
  }
  return saved;
}

// The SwiGLU chunk math below is straight-line code per chunk, so that the compiler interleaves the elements' MUFU
// chains (exp, reciprocal). The callers pass a constant inactive clamp when the clamp is off, and rows without data
// are masked by selects, not skipped: a per-element test of either became a branch around every element pair, each
// its own scheduling region, and the chains ran one after another.

// act = swiglu(gate, up) of output chunk c (gate chunk c, up chunk c + 2), zeros in rows without data.
__device__ __forceinline__ ChunkPairs swiglu_chunk(const float* acc, int c, const EpilogueRows& rows,
                                                   SwigluClamp clamp) {
  return chunk_pairs(c, rows, [&](int i) {
    return pack_bf16x2(swiglu(acc[i], acc[i + kUpOffset], clamp), swiglu(acc[i + 1], acc[i + 1 + kUpOffset], clamp));
  });
}

// dgrad of chunk c from g = dy @ w_down^T (acc) and the saved gate/up: d_gate, d_up, the weighted act
// bf16(w * bf16(act)) that dW_down contracts (zeros in rows without data, where dy's padding rows may hold anything)
// and each row's router-weight partial sum(g * act).
__device__ __forceinline__ void swiglu_dgrad_chunk(const float* acc, const SavedGateUp& saved, int c,
                                                   const EpilogueRows& rows, const float (&weights)[2],
                                                   SwigluClamp clamp, ChunkPairs* d_gate, ChunkPairs* d_up,
                                                   ChunkPairs* weighted_act, float (&row_partial)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int k = 2 * jj + h;
      float dg[2], du[2], weighted[2], partial = 0.0f;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float gate = bf16_bits_to_float(static_cast<uint16_t>(e ? saved.gate.v[k] >> 16 : saved.gate.v[k]));
        const float up = bf16_bits_to_float(static_cast<uint16_t>(e ? saved.up.v[k] >> 16 : saved.up.v[k]));
        const float g = acc[4 * (8 * c + jj) + 2 * h + e];
        const float act = round_to_bf16(swiglu_backward(gate, up, weights[h] * g, clamp, &dg[e], &du[e]));
        partial += g * act;
        weighted[e] = weights[h] * act;
      }
      row_partial[h] += rows.data[h] ? partial : 0.0f;
      d_gate->v[k] = rows.data[h] ? pack_bf16x2(dg[0], dg[1]) : 0u;
      d_up->v[k] = rows.data[h] ? pack_bf16x2(du[0], du[1]) : 0u;
      weighted_act->v[k] = rows.data[h] ? pack_bf16x2(weighted[0], weighted[1]) : 0u;
    }
  }
}

template <Mode kMode, int kBlockN, typename OutT>
__device__ __forceinline__ void epilogue(const TensorMaps& maps, const Params& p, const Tile& tile, bool has_data,
                                         const float* acc, int consumer, int warp, int lane,
                                         StagedStore& staged, PendingChunks<kMode, OutT>& pending) {
  const EpilogueRows rows = epilogue_rows<kMode, OutT>(p, tile, has_data, consumer, warp, lane);
  constexpr bool kDefer = PendingChunks<kMode, OutT>::kSlots > 0;
  pending.x0 = tile.n0;
  pending.y = rows.first + kStoreRows * warp;
  pending.z = kMode == Mode::kTgmm ? tile.group : 0;
  const int col_in_chunk = 2 * (lane & 3);
  // Row-major [*, n] output o, offset to the tile's group (tgmm) and to the warpgroup's first row.
  auto out_rows = [&](int o) {
    void* base = o == 0 ? p.out : (o == 1 ? static_cast<void*>(p.out2) : static_cast<void*>(p.out3));
    int64_t row = rows.first;
    if constexpr (kMode == Mode::kTgmm) row += static_cast<int64_t>(tile.group) * p.m_extent;
    return static_cast<OutT*>(base) + row * p.n;
  };
  // Chunk c of output o stored from registers: pair_at(h, jj) is what goes to fragment row h, columns
  // 8 jj + 2(l%4) + {0,1} of the chunk (a bf16x2 word or a float2).
  auto store_from_registers = [&](int o, int c, auto pair_at) {
    using Pair = decltype(pair_at(0, 0));
    OutT* out = out_rows(o) + tile.n0 + 64 * c + col_in_chunk;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!rows.written[h]) continue;
      const int64_t line = fragment_line(warp, lane, h);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) *reinterpret_cast<Pair*>(out + line * p.n + 8 * jj) = pair_at(h, jj);
    }
  };
  // Chunk c of output o: held in pending slot `slot` (a constant, -1: none) or stored now.
  auto emit = [&](int o, int c, const ChunkPairs& pairs, int slot) {
    if (!rows.staged) {
      store_from_registers(o, c, [&](int h, int jj) { return pairs.v[2 * jj + h]; });
    } else if (slot >= 0) {
      pending.pairs[slot] = pairs;
      pending.live |= 1u << slot;
    } else {
      staged.store<kMode == Mode::kTgmm ? 3 : 2>(&maps.out[o], pairs, lane, tile.n0 + 64 * c, pending.y, pending.z);
    }
  };

  // dgrad: the router weights of the thread's two rows.
  float row_partial[2] = {0.0f, 0.0f};
  float weights[2] = {0.0f, 0.0f};
  if constexpr (kMode == Mode::kSwigluDgrad) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (rows.data[h]) weights[h] = p.row_weights[rows.first + fragment_line(warp, lane, h)];
  }
#pragma unroll
  for (int c = 0; c < kBlockN / 64; ++c) {
    if (tile.n0 + 64 * c >= p.n) break;
    if constexpr (sizeof(OutT) == 4) {  // gmm or tgmm to float32: from registers
      store_from_registers(0, c, [&](int h, int jj) {
        const int i = 4 * (8 * c + jj) + 2 * h;
        return rows.data[h] ? make_float2(acc[i], acc[i + 1]) : make_float2(0.0f, 0.0f);
      });
    } else if constexpr (kMode == Mode::kGmm || kMode == Mode::kTgmm) {
      emit(0, c, pack_chunk(acc, c, rows), kDefer ? c : -1);
    } else if constexpr (kMode == Mode::kSwiglu) {
      emit(0, c, p.clamp.active() ? swiglu_chunk(acc, c, rows, p.clamp)
                                  : swiglu_chunk(acc, c, rows, SwigluClamp{0.0f}),
           kDefer ? c : -1);
      if (p.out2 != nullptr) {
        emit(1, c, pack_chunk(acc, c, rows), -1);
        emit(2, c, pack_chunk(acc, c + kUpOffset / 32, rows), -1);
      }
    } else {  // kSwigluDgrad
      const SavedGateUp saved = load_saved_gate_up(p, tile, rows, c, warp, lane);
      ChunkPairs d_gate, d_up, weighted_act;
      if (p.clamp.active()) {
        swiglu_dgrad_chunk(acc, saved, c, rows, weights, p.clamp, &d_gate, &d_up, &weighted_act, row_partial);
      } else {
        swiglu_dgrad_chunk(acc, saved, c, rows, weights, SwigluClamp{0.0f}, &d_gate, &d_up, &weighted_act,
                           row_partial);
      }
      emit(0, c, d_gate, -1);
      emit(1, c, d_up, -1);
      if (p.out3 != nullptr) emit(2, c, weighted_act, -1);
    }
  }
  if constexpr (kMode == Mode::kSwigluDgrad) {
    // The four lanes of a quad hold one row: a fixed butterfly order keeps the sum deterministic.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_partial[h];
      sum += __shfl_xor_sync(0xFFFFFFFF, sum, 1);
      sum += __shfl_xor_sync(0xFFFFFFFF, sum, 2);
      const int64_t row = static_cast<int64_t>(rows.first) + fragment_line(warp, lane, h);
      if (rows.written[h] && (lane & 3) == 0)
        p.row_weight_partials[static_cast<int64_t>(tile.n_block) * p.layout.rows + row] = sum;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Roles.

// A stage is free again when the consumer warps of every CTA of the cluster (whose lhs half lives in it) are done.
// The empty barriers as seen from the consumers: stage s's barrier in CTA c is at barrier0[c] + 8 s (a CTA's
// shared::cluster window is contiguous), so a release is an add and the arrivals.
template <int kCluster>
struct StageRelease {
  uint32_t barrier0[kCluster];

  __device__ explicit StageRelease(uint64_t* empty) {
    const uint32_t local = cute::cast_smem_ptr_to_uint(empty);
#pragma unroll
    for (uint32_t cta = 0; cta < kCluster; ++cta)
      barrier0[cta] = kCluster == 1 ? local : in_cta(local, cta);
  }

  __device__ __forceinline__ void operator()(uint32_t stage) const {
#pragma unroll
    for (uint32_t cta = 0; cta < kCluster; ++cta) {
      if constexpr (kCluster == 1) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier0[cta] + 8 * stage) : "memory");
      } else {
        asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(barrier0[cta] + 8 * stage) : "memory");
      }
    }
  }
};

// Weight pairs (the row GEMMs with a gathered lhs; back to back on an H100, 0.9-1.7% less time in the SwiGLU GEMM and
// 0-1.1% in the dgrad than row pairs gathering half the lhs each and forwarding it, while gmm's TMA-loaded lhs lost
// 3-8% in weight pairs: `gpu_power_h100_session45_{wpair,hybrid}_ab.json`): claim c is tiles low = 4 (c / 2) + c % 2
// (rank 0) and low + 2 (rank 1), m fastest in the band order (kernels/grouped_gemm.h) the same n block of two adjacent
// m blocks, except where a band's n pair, a visit or a group ends between them. Where both tiles hold data of one group
// and one n block, each CTA loads one column half of the weight block into both, and a k step reads 32 KB from L2 per
// CTA (the lhs and a weight half) instead of a row pair's 40 (an lhs half and the whole weight block); otherwise each
// loads its own. The pair steps through its stages in lockstep (a stage is free when the consumer warps of both CTAs
// have released it), so both run the longer k loop of the two: a tile without data beside one with data (the tail
// pseudo-group's, or a claim's second tile past the last one) hands its stages on without loads, its producer arriving
// on the full barriers without bytes and its consumers releasing the stages unread.
struct ClaimedTile {
  Tile tile;           // this CTA's, with the k loop of the claim (a tile without data may get the peer's)
  bool share_weights;  // with the weight pair's other CTA
};

template <Mode kMode, int kBlockN, int kCluster, Gathered kGathered>
__device__ __forceinline__ ClaimedTile claimed_tile(Scheduler<kMode, kBlockN>& scheduler, const Params& p,
                                                   int32_t claim, uint32_t rank) {
  if constexpr (!ClusterLayout<kMode, kCluster, kGathered>::kWeightPair) {
    return {scheduler.get(p, kCluster * claim + static_cast<int32_t>(rank)), false};
  } else {
    // The scheduler is a forward-only cursor: the low tiles of successive claims increase, the high one goes
    // through a copy.
    const int32_t low = 4 * (claim / 2) + claim % 2;
    Scheduler<kMode, kBlockN> ahead = scheduler;
    Tile tile = scheduler.get(p, low), peer = ahead.get(p, low + 2);
    if (rank == 1) {  // field by field: selects in registers, where a reference to either would take local memory
      const Tile low_tile = tile;
      tile = peer;
      peer = low_tile;
    }
    const bool share = tile.valid > 0 && peer.valid > 0 && tile.group == peer.group && tile.n_block == peer.n_block;
    if (peer.k_steps > tile.k_steps) {
      if (tile.k_steps < 0) tile = {0, 0, 0, 0, 0, 0, 0, 0};  // past the last tile: nothing to write
      tile.k_steps = peer.k_steps;
    }
    return {tile, share};
  }
}

// thread: 0 (TMA loads; it also decodes the tiles for the consumers) or, with a gathered operand, 0..127 (see
// "Gathered operands" for the warps' parts; thread 0 also issues the other operand's loads, and every warp pops the
// tile queue).
template <Mode kMode, bool kBMnMajor, int kCluster, Gathered kGathered>
__device__ __forceinline__ void produce(const TensorMaps& maps, const Params& p, uint8_t* smem, uint64_t* full,
                                         uint64_t* empty, uint64_t* landed, TileQueue<kCluster>& queue, TileRing& ring,
                                         const VisitPlan& plan, int thread) {
  constexpr int kBlockN = OperandLayout<kMode>::kBlockN;
  constexpr bool kGathers = kGathered != Gathered::kNone;
  using G = Gather<kMode, kGathered, kCluster>;
  if (thread == 0) {
    if constexpr (kGathered != Gathered::kLhs) cute::prefetch_tma_descriptor(&maps.a);
    if (kMode == Mode::kGmm && p.k_steps2 > 0) cute::prefetch_tma_descriptor(&maps.a2);
    if constexpr (kGathered != Gathered::kRhs) cute::prefetch_tma_descriptor(&maps.b);
    cute::prefetch_tma_descriptor(&maps.b2);
  }
  const uint32_t rank = kCluster > 1 ? cute::block_rank_in_cluster() : 0;
  const bool fetcher = thread == 0 && rank == 0;
  const bool gatherer = kGathers && thread < G::kThreads;
  const bool forwarder = kGathers && G::kForwards && thread / 32 == G::kForwarderWarp;
  const uint32_t peer_stage0 = forwarder ? in_cta(cute::cast_smem_ptr_to_uint(smem), rank ^ 1) : 0;
  const uint32_t peer_full0 = forwarder ? in_cta(cute::cast_smem_ptr_to_uint(full), rank ^ 1) : 0;
  const int32_t clusters = gridDim.x / kCluster;
  int32_t pair = blockIdx.x / kCluster;
  Scheduler<kMode, kBlockN> scheduler(p, plan);
  uint32_t it = 0;
  for (;;) {
    if (fetcher) queue.publish(pair);
    const ClaimedTile claimed =
        claimed_tile<kMode, kBlockN, kCluster, kGathered>(scheduler, p, queue.template pop<kGathers>(), rank);
    const Tile& tile = claimed.tile;
    if (thread == 0) ring.push(tile);
    if (tile.k_steps < 0) break;
    // Claimed now, when this CTA starts loading, so that the claims follow the order the CTAs free up in; the
    // stage ring holds kStages steps of work over the atomic's latency.
    if (fetcher) pair = clusters + atomicAdd(p.tile_counter, 1);
    const int32_t steps = tile.k_steps;
    // Else it hands the stages on (weight pairs).
    const bool has_data = !ClusterLayout<kMode, kCluster, kGathered>::kWeightPair || tile.valid > 0;
    if (steps == 0 || (kGathers && !gatherer && !forwarder)) continue;
    if (forwarder) {
      for (int32_t ks = 0; ks < steps; ++ks, ++it)
        forward_lhs_half(smem, full, landed, it % kStages, (it / kStages) & 1, rank, peer_stage0, peer_full0,
                         thread % 32);
      continue;
    }
    GatherRows<G::kRows> rows;
    if constexpr (kGathers && kMode != Mode::kTgmm)
      rows = gather_rows<G::kRows>(p, tile, G::first_line(rank, thread), G::kLineStride);
    for (int32_t ks = 0; ks < steps; ++ks, ++it) {
      // tgmm: the k step's contraction rows, looked up while the stage may still be in use.
      if constexpr (kGathers && kMode == Mode::kTgmm)
        rows = gather_rows<G::kRows>(p, tile, ks * kBlockK + G::first_line(rank, thread) % kBlockK, G::kLineStride);
      const uint32_t stage = it % kStages;
      wait_barrier(&empty[stage], ((it / kStages) & 1) ^ 1);
      uint8_t* a_smem = smem + stage * kStageBytes;
      if (thread == 0) {
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(
            &full[stage], has_data ? (kGathers ? G::kFullBytes : kStageBytes) : 0);
        if (has_data) {
          if constexpr (kGathered != Gathered::kLhs)
            load_lhs<kMode, kCluster, kGathered>(maps, p, tile, ks, rank, a_smem, &full[stage]);
          if constexpr (kGathered != Gathered::kRhs)
            load_rhs<kMode, kBMnMajor, kCluster, kGathered>(maps, p, tile, ks, rank, claimed.share_weights,
                                                            a_smem + kABytes, &full[stage]);
        }
      }
      if (kGathers && !has_data) {  // the copies' arrivals without copies (weight pairs: on the full barrier)
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(cute::cast_smem_ptr_to_uint(&full[stage]))
                     : "memory");
      } else if constexpr (kGathers) {
        // The 16-byte column of the thread's line 0: the k step's (K-major), or its sub-tile's of the tile's columns.
        const int first_line = G::first_line(rank, thread);
        uint32_t column = ks * (kBlockK / 8);
        if constexpr (kMode == Mode::kTgmm)
          column = ((kGathered == Gathered::kLhs ? tile.m0 : tile.n0) + first_line / kBlockK * 64) / 8;
        gather_copies<G>(p, rows, column, cute::cast_smem_ptr_to_uint(a_smem) + G::kStageOffset, first_line, thread,
                         G::kForwards ? &landed[stage] : &full[stage]);
      }
    }
  }
  // Copies still in flight would arrive on the barriers of a CTA this thread no longer belongs to.
  if constexpr (kGathers) asm volatile("cp.async.wait_all;\n" ::: "memory");
}

template <Mode kMode, bool kBMnMajor, typename OutT, int kCluster, Gathered kGathered>
__device__ __forceinline__ void consume(const TensorMaps& maps, const Params& p, uint8_t* smem, uint8_t* staging,
                                         uint64_t* full, uint64_t* empty, TileRing& ring) {
  constexpr int kBlockN = OperandLayout<kMode>::kBlockN;
  constexpr bool kAMn = OperandLayout<kMode>::kAMnMajor;
  // Broadcast from lane 0, so that the compiler knows them warp-uniform and keeps the k loop's stage arithmetic
  // and descriptors in uniform registers.
  const int consumer = __shfl_sync(0xFFFFFFFF, static_cast<int>(threadIdx.x / 128), 0) - 1;
  const int consumer_thread = threadIdx.x - 128;
  const int warp = (threadIdx.x % 128) / 32;
  const int lane = threadIdx.x % 32;
  StagedStore staged{cute::cast_smem_ptr_to_uint(staging) + (4 * consumer + warp) * 2 * kStoreBytes};
  PendingChunks<kMode, OutT> pending;
  constexpr int kSlots = PendingChunks<kMode, OutT>::kSlots;
  // Stage 0's full barrier and the consumer's operands there; stage s is kStageBytes (barrier: 8 bytes) further.
  const uint32_t full0 = cute::cast_smem_ptr_to_uint(full);
  const uint32_t stage0 = cute::cast_smem_ptr_to_uint(smem);
  const uint32_t a_desc0 = descriptor_low(stage0 + consumer * (kAMn ? kSubTileBytes : 64 * kLineBytes), kAMn);
  const uint32_t b_desc0 = descriptor_low(stage0 + kABytes, kBMnMajor);
  const StageRelease<kCluster> release(empty);
  float acc[kAccumulators];
  using Schedule = Scheduler<kMode, kBlockN>;
  uint32_t it = 0;
  // The tile loop's conditions are votes (warp-uniform, as far as the compiler knows), so the stage counter stays
  // in uniform registers too.
  for (;;) {
    const Tile tile = ring.pop();
    if (!__any_sync(0xFFFFFFFF, tile.k_steps >= 0)) break;
    const int32_t steps = __shfl_sync(0xFFFFFFFF, tile.k_steps, 0);
    // Waits for the stage of k step ks (tgmm: and fixes it up).
    auto acquire = [&](int32_t ks, uint32_t stage) {
      wait_barrier_at(full0 + 8 * stage, (it / kStages) & 1);
      // cp.async writes through the generic proxy; the wgmma reads through the async proxy. A forwarded lhs needs
      // no fence here: the forwarder fenced this CTA's half before its arrival on the full barrier (its bulk copy
      // reads the half through the async proxy too), and the peer's half came through the async proxy.
      if constexpr (kGathered != Gathered::kNone && !Gather<kMode, kGathered, kCluster>::kForwards)
        cutlass::arch::fence_view_async_shared();
      if constexpr (kMode == Mode::kTgmm)
        tgmm_zero_tail<kGathered>(tile, ks, smem + stage * kStageBytes, consumer_thread);
    };
    // k step ks's wgmma, left in flight.
    auto issue = [&](int32_t ks) {
      const uint32_t stage = it % kStages;
      acquire(ks, stage);
      const uint32_t stage_offset = stage * (kStageBytes >> 4);
      fence_accumulators(acc);
      cute::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        wgmma<kAMn, kBMnMajor>(descriptor(a_desc0, stage_offset + kk * k16_advance(kAMn)),
                               descriptor(b_desc0, stage_offset + kk * k16_advance(kBMnMajor)), acc,
                               ks > 0 || kk > 0);
      }
      cute::warpgroup_commit_batch();
    };
    // Keeps k step ks's wgmma in flight while releasing the previous step's stage.
    auto retire = [&](int32_t ks) {
      cute::warpgroup_wait<1>();
      fence_accumulators(acc);
      if (ks > 0 && lane == 0) release((it - 1) % kStages);
    };
    if (__any_sync(0xFFFFFFFF, Schedule::consumer_has_rows(p, tile, consumer))) {
      // The previous tile's pending chunks, one behind each of the first k steps' wgmma; a tile too short for that
      // stores them first. One k loop with the stores inside, behind votes: a peeled head of the loop made ptxas
      // build every k step's descriptors in vector registers.
      if constexpr (kSlots > 0) {
        if (steps < kSlots) pending.flush(maps, staged, lane);
      }
      for (int32_t ks = 0; ks < steps; ++ks, ++it) {
        issue(ks);
        if constexpr (kSlots > 0) {
          if (__any_sync(0xFFFFFFFF, ks < kSlots)) {
#pragma unroll
            for (int slot = 0; slot < kSlots; ++slot)
              if (__any_sync(0xFFFFFFFF, ks == slot)) pending.store(slot, maps, staged, lane);
          }
        }
        retire(ks);
      }
      cute::warpgroup_wait<0>();
      fence_accumulators(acc);
      if (steps > 0 && lane == 0) release((it - 1) % kStages);
    } else {
      // No data in this consumer's 64 rows (they are written as zeros): it only takes part in the stage hand-offs,
      // and the tensor cores serve the other consumer alone. A separate loop keeps the wgmma loop above free of
      // branches, which ptxas would otherwise answer by waiting for every wgmma before issuing the next.
      pending.flush(maps, staged, lane);
      for (int32_t ks = 0; ks < steps; ++ks, ++it) {
        acquire(ks, it % kStages);
        if (lane == 0) release(it % kStages);
      }
    }
    epilogue<kMode, kBlockN, OutT>(maps, p, tile, steps > 0, acc, consumer, warp, lane, staged, pending);
  }
  pending.flush(maps, staged, lane);
  staged.drain(lane);
}

// ---------------------------------------------------------------------------------------------------------------
// The kernel.

template <Mode kMode, bool kBMnMajor, typename OutT, int kCluster, Gathered kGathered>
__global__ void __launch_bounds__(kThreads, 1) grouped_gemm_kernel(const __grid_constant__ TensorMaps maps, Params p) {
  static_assert(kGathered == Gathered::kNone || kMode != Mode::kGmm, "gmm takes no gathered operand");
  static_assert(kGathered != Gathered::kRhs || kMode == Mode::kTgmm, "only tgmm takes a gathered rhs");
  using G = Gather<kMode, kGathered, kCluster>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* staging = smem + kStages * kStageBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(staging + kStagingBytes);
  uint64_t* empty = full + kStages;
  uint64_t* landed = empty + kStages;  // only a forwarded lhs waits here: this CTA's half has landed
  TileQueue<kCluster> queue{cute::cast_smem_ptr_to_uint(landed + kStages)};
  TileRing ring{queue.base + kQueueBytes};
  uint8_t* after_ring = reinterpret_cast<uint8_t*>(landed + kStages) + kQueueBytes + kRingBytes;
  VisitPlan& plan = *reinterpret_cast<VisitPlan*>(after_ring);

  // The row GEMMs' visit plan, made beside the barriers' init by one warp: the producers need it for their first
  // tile. The consumers' staging buffers are free until their first epilogue: the warp's list of light groups.
  // (tgmm's scheduler holds an unused row scheduler: no plan.)
  if (threadIdx.x / 32 == 1) {
    if (kMode != Mode::kTgmm) {
      plan_visits_warp<kBlockM>(p.layout, plan, reinterpret_cast<uint16_t*>(staging), threadIdx.x % 32);
    } else if (threadIdx.x == 32) {
      plan.count = 0;
    }
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterBarrier::init(&full[s], kGathered != Gathered::kNone ? G::kFullArrivals : 1);
      cutlass::arch::ClusterBarrier::init(&empty[s], 8 * kCluster);  // one arrive per consumer warp of the cluster
      if constexpr (kGathered != Gathered::kNone && G::kForwards) {
        cutlass::arch::ClusterBarrier::init(&landed[s], G::kThreads);
      }
    }
    queue.init(kGathered != Gathered::kNone);
    ring.init();
    cutlass::arch::fence_barrier_init();
  }
  // The peer multicasts into this CTA's stages and arrives on its barriers: they must be initialised first.
  if constexpr (kCluster > 1) {
    cute::cluster_sync();
  } else {
    __syncthreads();
  }

  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (kGathered != Gathered::kNone || threadIdx.x == 0)
      produce<kMode, kBMnMajor, kCluster, kGathered>(maps, p, smem, full, empty, landed, queue, ring, plan,
                                                     threadIdx.x);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    consume<kMode, kBMnMajor, OutT, kCluster, kGathered>(maps, p, smem, staging, full, empty, ring);
  }
  // Until its last k step the peer still multicasts into this CTA and arrives on its barriers (the stages' and the
  // tile queue's): neither CTA of a cluster exits before both are done.
  if constexpr (kCluster > 1) {
    __syncwarp();
    cute::cluster_sync();
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
