// CUDA kernels of the expert-parallel protocol (the CPU twin is ffi/expert_parallel.cc; same flags, same order).
//
// Peers are plain load/store addresses (NVLink P2P or nvshmem_ptr), so one kernel serves both GPU heap backends.
// Flags are written with st.release.sys after __threadfence_system and read with ld.acquire.sys; waits give up after
// the heap's timeout on %globaltimer and record the error in host-mapped memory instead of hanging.
//
// Transport kernels are persistent: the grid never exceeds the SM count, so every block is resident and a block may
// wait for data another block of the same launch stages (a rank is its own peer). Work is split in contiguous
// pieces of rows; a piece waits only for the source chunks it reads. A persistent MoE megakernel would run the same
// pieces on its communication SMs and hand them to compute SMs by counters: a change of scheduling, not of protocol.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/expert_parallel.h"
#include "kernels/symmetric_heap.h"

namespace jk {
namespace ep {

constexpr int kTransportThreads = 256;
constexpr int kPlanThreads = 256;
constexpr int64_t kPieceRows = 32;

// Per-call view of this rank's heap member.
struct HeapView {
  char* const* peer_bases;  // [num_ranks] device table
  const char* local_base;   // this device's region: peer_bases[rank] must be it
  const int32_t* rank;      // device scalar (the axis index)
  heap::ErrorRecord* error;
  int32_t num_ranks;
  int32_t experts_per_rank;
  int32_t skip_signal_rank;
  int64_t region_bytes;
  int64_t timeout_ns;
  uint64_t epoch;
};

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* flag) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ void store_release(uint64_t* flag, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__device__ __forceinline__ bool heap_failed(const HeapView& view) {
  return *reinterpret_cast<volatile int32_t*>(&view.error->code) != heap::kNoError;
}

// Claims this member's error slot (device memory), then fills the host-mapped record with plain stores, code last.
// Members on other GPUs of a single-process heap may fill it too: each writes a true account of a failure.
__device__ inline void record_error(const HeapView& view, int32_t code, int32_t rank, int32_t channel, int32_t peer) {
  auto* mine = reinterpret_cast<heap::SignalPad*>(const_cast<char*>(view.local_base));
  if (atomicCAS(&mine->error_claim, 0, 1) != 0) return;
  volatile heap::ErrorRecord* record = view.error;
  record->rank = rank;
  record->channel = channel;
  record->peer = peer;
  record->epoch = view.epoch;
  __threadfence_system();
  record->code = code;
  __threadfence_system();
}

// One thread waits; false on timeout or when any member of the heap failed.
__device__ inline bool wait_flag(const HeapView& view, const uint64_t* flag, uint64_t epoch, int32_t rank,
                                 int32_t channel, int32_t peer) {
  if (load_acquire(flag) >= epoch) return true;
  const uint64_t start = global_timer_ns();
  for (uint32_t spin = 0; load_acquire(flag) < epoch; ++spin) {
    if (spin % 64 == 63 && heap_failed(view)) return false;  // a host-memory read: not every spin
    if (global_timer_ns() - start > static_cast<uint64_t>(view.timeout_ns)) {
      record_error(view, heap::kPeerTimeout, rank, channel, peer);
      return false;
    }
    __nanosleep(100);
  }
  return true;
}

__device__ __forceinline__ heap::SignalPad* pad_of(const HeapView& view, int32_t rank) {
  return reinterpret_cast<heap::SignalPad*>(view.peer_bases[rank]);
}

// The rank this launch runs as, checked against the device the heap put at that rank; -1 on mismatch.
__device__ inline int32_t checked_rank(const HeapView& view, int32_t channel) {
  const int32_t rank = *view.rank;
  if (rank < 0 || rank >= view.num_ranks || view.peer_bases[rank] != view.local_base) {
    if (threadIdx.x == 0) record_error(view, heap::kDeviceOrderMismatch, rank, channel, -1);
    return -1;
  }
  return rank;
}

// Block-wide: thread 0 waits for every peer's flag in row `flags` (stride kMaxRanks) to reach epoch.
__device__ inline bool block_wait_all(const HeapView& view, const uint64_t* flags, uint64_t epoch, int32_t rank,
                                      int32_t channel) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    for (int32_t p = 0; p < view.num_ranks && ok; ++p) ok = wait_flag(view, &flags[p], epoch, rank, channel, p);
  }
  __syncthreads();
  const bool result = ok != 0;
  __syncthreads();
  return result;
}

// Copies bytes (a multiple of 4) with 16-byte accesses where both ends allow. Four loads are in flight per thread
// before their stores: a peer's memory is a microsecond away over NVLink, so bandwidth needs many loads outstanding.
__device__ inline void copy_bytes(char* dst, const char* src, int64_t bytes) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {
    constexpr int kUnroll = 4;
    auto* d = reinterpret_cast<int4*>(dst);
    const auto* s = reinterpret_cast<const int4*>(src);
    const int64_t vectors = bytes / 16;
    const int64_t stride = blockDim.x;
    int64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * stride < vectors; i += kUnroll * stride) {
      int4 values[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) values[u] = __ldcg(s + i + u * stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[i + u * stride] = values[u];
    }
    for (; i < vectors; i += stride) d[i] = __ldcg(s + i);
  } else {
    auto* d = reinterpret_cast<int32_t*>(dst);
    const auto* s = reinterpret_cast<const int32_t*>(src);
    for (int64_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) d[i] = __ldcg(s + i);
  }
}

__device__ inline void zero_bytes(char* dst, int64_t bytes) {
  if (((reinterpret_cast<uintptr_t>(dst) | bytes) & 15) == 0) {
    for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) reinterpret_cast<int4*>(dst)[i] = int4{0, 0, 0, 0};
  } else {
    for (int64_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) reinterpret_cast<int32_t*>(dst)[i] = 0;
  }
}

// The last block of the launch to finish `phase` gets true (and resets the count for the next launch).
__device__ inline bool last_block_of_phase(heap::SignalPad* mine, int32_t channel, int32_t phase) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's reads and writes are done before it counts
    const uint32_t arrived = atomicAdd(&mine->block_arrivals[channel][phase], 1u) + 1;
    last = arrived == gridDim.x;
    if (last) mine->block_arrivals[channel][phase] = 0;
  }
  __syncthreads();
  return last != 0;
}

// Thread 0 of the caller: publish `epoch` in slot [chunk][rank] of `flags_of(peer)` at every peer.
template <typename FlagOf>
__device__ inline void signal_all(const HeapView& view, FlagOf flag_of) {
  __threadfence_system();
  for (int32_t p = 0; p < view.num_ranks; ++p) store_release(flag_of(p), view.epoch);
}

// ---------------------------------------------------------------------------------------------------------------
// jk_ep_plan: one block. all_counts: [num_ranks][num_experts] scratch.
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(HeapView view, int32_t capacity,
                                                            const int32_t* __restrict__ counts,
                                                            int32_t* __restrict__ all_counts, Block* blocks,
                                                            int32_t* send_kept_out, int32_t* group_sizes,
                                                            int32_t* dropped) {
  const int32_t channel = heap::kPlanChannel;
  const int32_t rank = checked_rank(view, channel);
  if (rank < 0) return;
  const Layout layout{view.num_ranks, view.experts_per_rank, capacity};
  const int32_t experts = layout.num_experts();
  heap::SignalPad* mine = pad_of(view, rank);

  if (!block_wait_all(view, mine->done[channel], view.epoch - 1, rank, channel)) return;
  for (int32_t g = threadIdx.x; g < experts; g += blockDim.x) mine->counts[g] = counts[g];
  __syncthreads();
  if (threadIdx.x == 0) signal_all(view, [&](int32_t p) { return &pad_of(view, p)->ready[channel][0][rank]; });

  if (!block_wait_all(view, &mine->ready[channel][0][0], view.epoch, rank, channel)) return;
  for (int32_t s = 0; s < view.num_ranks; ++s) {
    const int32_t* theirs = pad_of(view, s)->counts;
    for (int32_t g = threadIdx.x; g < experts; g += blockDim.x) all_counts[s * experts + g] = __ldcg(theirs + g);
  }
  __syncthreads();
  if (threadIdx.x == 0) signal_all(view, [&](int32_t p) { return &pad_of(view, p)->done[channel][rank]; });

  // Kept rows per block and per own expert in parallel; the placement prefix is sequential but short.
  const int32_t num_blocks = layout.num_ranks * layout.experts_per_rank;
  for (int32_t b = threadIdx.x; b < num_blocks; b += blockDim.x) {
    const int32_t e = b / layout.num_ranks, s = b % layout.num_ranks;
    blocks[b].kept = kept_rows(all_counts, layout, rank, s, e);
    blocks[b].source_position = expert_position(all_counts, layout, s, rank * layout.experts_per_rank + e);
  }
  __shared__ int32_t lost_total;
  if (threadIdx.x == 0) lost_total = 0;
  __syncthreads();
  int32_t lost = 0;
  for (int32_t g = threadIdx.x; g < experts; g += blockDim.x) {
    send_kept_out[g] = send_kept(all_counts, layout, rank, g);
    lost += counts[g] - send_kept_out[g];
  }
  atomicAdd(&lost_total, lost);
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t row = 0;
    for (int32_t e = 0; e < layout.experts_per_rank; ++e) {
      int32_t group = 0;
      for (int32_t s = 0; s < layout.num_ranks; ++s) {
        Block& block = blocks[e * layout.num_ranks + s];
        block.recv_offset = row;
        row += block.kept;
        group += block.kept;
      }
      group_sizes[e] = group;
    }
    *dropped = lost_total;
  }
}

// A block table entry inside the receive rows and the source positions. The table comes from plan_kernel, but the
// kernels never trust an operand with memory: a bad entry moves nothing.
__device__ __forceinline__ bool block_in_bounds(const Block& block, int64_t capacity, int64_t positions) {
  return block.kept >= 0 && block.recv_offset >= 0 && block.source_position >= 0 &&
         block.recv_offset + static_cast<int64_t>(block.kept) <= capacity &&
         block.source_position + static_cast<int64_t>(block.kept) <= positions;
}

// Visits the pieces of the receive blocks assigned to this block: fn(block index, first row within it, rows).
template <typename Fn>
__device__ inline void for_each_piece(const Block* blocks, int32_t num_blocks, int64_t capacity, int64_t positions,
                                      Fn fn) {
  int64_t work = 0;
  for (int32_t b = 0; b < num_blocks; ++b) {
    if (!block_in_bounds(blocks[b], capacity, positions)) continue;
    const int32_t kept = blocks[b].kept;
    for (int64_t first = 0; first < kept; first += kPieceRows, ++work) {
      if (work % gridDim.x != blockIdx.x) continue;
      fn(b, first, kept - first < kPieceRows ? kept - first : kPieceRows);
    }
  }
}

// Receive rows in use: the end of the furthest in-bounds block (plan packs them from row 0).
__device__ inline int64_t received_rows(const Block* blocks, int32_t num_blocks, int64_t capacity, int64_t positions) {
  int64_t end = 0;
  for (int32_t b = 0; b < num_blocks; ++b) {
    if (!block_in_bounds(blocks[b], capacity, positions)) continue;
    const int64_t block_end = blocks[b].recv_offset + static_cast<int64_t>(blocks[b].kept);
    end = block_end > end ? block_end : end;
  }
  return end;
}

// ---------------------------------------------------------------------------------------------------------------
// jk_ep_to_experts: stage packed [positions] rows in our send area chunk by chunk (signalling each), then pull our
// receive blocks from the sources' send areas into recv [capacity] rows; the rows past the received ones are zeroed.
__global__ void __launch_bounds__(kTransportThreads) to_experts_kernel(HeapView view, const char* __restrict__ packed,
                                                                      int64_t positions, int64_t row_bytes,
                                                                      int32_t chunk_rows, const Block* blocks,
                                                                      char* recv, int64_t capacity) {
  const int32_t channel = heap::kToExpertsChannel;
  const int32_t rank = checked_rank(view, channel);
  if (rank < 0) return;
  heap::SignalPad* mine = pad_of(view, rank);
  const int64_t send_offset = heap::send_area_offset(view.region_bytes);
  char* send_area = view.peer_bases[rank] + send_offset;
  const int32_t num_blocks = view.num_ranks * view.experts_per_rank;

  if (!block_wait_all(view, mine->done[channel], view.epoch - 1, rank, channel)) return;
  const int64_t num_chunks = (positions + chunk_rows - 1) / chunk_rows;
  for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    const int64_t first = chunk * chunk_rows;
    const int64_t rows = positions - first < chunk_rows ? positions - first : chunk_rows;
    copy_bytes(send_area + first * row_bytes, packed + first * row_bytes, rows * row_bytes);
    __syncthreads();
    if (threadIdx.x == 0 && view.skip_signal_rank != rank) {
      signal_all(view, [&](int32_t p) { return &pad_of(view, p)->ready[channel][chunk][rank]; });
    }
  }

  __shared__ int ok;
  bool failed = false;
  for_each_piece(blocks, num_blocks, capacity, positions, [&](int32_t b, int64_t first, int64_t rows) {
    if (failed) return;
    const Block block = blocks[b];
    const int32_t source = b % view.num_ranks;
    const int64_t position = block.source_position + first;
    if (threadIdx.x == 0) {
      ok = 1;
      for (int32_t chunk = chunk_of(position, chunk_rows); ok && chunk <= chunk_of(position + rows - 1, chunk_rows);
           ++chunk) {
        ok = wait_flag(view, &mine->ready[channel][chunk][source], view.epoch, rank, channel, source);
      }
    }
    __syncthreads();
    failed = ok == 0;
    __syncthreads();
    if (failed) return;
    const char* peer_send = view.peer_bases[source] + send_offset;
    copy_bytes(recv + (block.recv_offset + first) * row_bytes, peer_send + position * row_bytes, rows * row_bytes);
  });
  if (failed) return;
  const int64_t received = received_rows(blocks, num_blocks, capacity, positions);
  const int64_t tail_bytes = (capacity - received) * row_bytes;
  const int64_t slice = ((tail_bytes + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
  const int64_t begin = slice * blockIdx.x;
  if (begin < tail_bytes) {
    zero_bytes(recv + received * row_bytes + begin, tail_bytes - begin < slice ? tail_bytes - begin : slice);
  }
  if (last_block_of_phase(mine, channel, 0) && threadIdx.x == 0) {
    signal_all(view, [&](int32_t p) { return &pad_of(view, p)->done[channel][rank]; });
  }
}

// ---------------------------------------------------------------------------------------------------------------
// jk_ep_from_experts: push our receive blocks of expert_rows back into their sources' return areas, then, once every
// owner has pushed, copy our positions out of our return area (kept rows) or write zeros (dropped rows, tail).
__global__ void __launch_bounds__(kTransportThreads) from_experts_kernel(HeapView view,
                                                                        const char* __restrict__ expert_rows,
                                                                        int64_t row_bytes, const Block* blocks,
                                                                        const int32_t* __restrict__ send_kept,
                                                                        const int32_t* __restrict__ expert_offsets,
                                                                        char* returned, int64_t capacity,
                                                                        int64_t positions) {
  const int32_t channel = heap::kFromExpertsChannel;
  const int32_t rank = checked_rank(view, channel);
  if (rank < 0) return;
  heap::SignalPad* mine = pad_of(view, rank);
  const int64_t return_offset = heap::return_area_offset(view.region_bytes);
  const int32_t num_blocks = view.num_ranks * view.experts_per_rank;

  // A source's return area is free once it consumed the previous epoch: wait for all once, before any push.
  if (!block_wait_all(view, mine->done[channel], view.epoch - 1, rank, channel)) return;
  for_each_piece(blocks, num_blocks, capacity, positions, [&](int32_t b, int64_t first, int64_t rows) {
    const Block block = blocks[b];
    char* peer_return = view.peer_bases[b % view.num_ranks] + return_offset;
    copy_bytes(peer_return + (block.source_position + first) * row_bytes,
               expert_rows + (block.recv_offset + first) * row_bytes, rows * row_bytes);
  });
  if (last_block_of_phase(mine, channel, 0) && threadIdx.x == 0) {
    signal_all(view, [&](int32_t p) { return &pad_of(view, p)->ready[channel][0][rank]; });
  }

  if (!block_wait_all(view, &mine->ready[channel][0][0], view.epoch, rank, channel)) return;
  const char* return_area = view.peer_bases[rank] + return_offset;
  const int32_t experts = num_blocks;
  int64_t work = 0;
  for (int32_t g = 0; g < experts; ++g) {
    const int64_t begin = expert_offsets[g];
    const int64_t wanted = begin < 0 || expert_offsets[g + 1] > positions ? 0 : expert_offsets[g + 1] - begin;
    const int64_t kept = send_kept[g] < wanted ? send_kept[g] : wanted;
    for (int64_t first = 0; first < wanted; first += kPieceRows, ++work) {
      if (work % gridDim.x != blockIdx.x) continue;
      const int64_t rows = wanted - first < kPieceRows ? wanted - first : kPieceRows;
      const int64_t copied = kept - first <= 0 ? 0 : (kept - first < rows ? kept - first : rows);
      copy_bytes(returned + (begin + first) * row_bytes, return_area + (begin + first) * row_bytes,
                 copied * row_bytes);
      zero_bytes(returned + (begin + first + copied) * row_bytes, (rows - copied) * row_bytes);
    }
  }
  const int64_t used = expert_offsets[experts] < 0 || expert_offsets[experts] > positions ? 0 : expert_offsets[experts];
  for (int64_t first = used + blockIdx.x * kPieceRows; first < positions; first += gridDim.x * kPieceRows) {
    const int64_t rows = positions - first < kPieceRows ? positions - first : kPieceRows;
    zero_bytes(returned + first * row_bytes, rows * row_bytes);
  }
  if (last_block_of_phase(mine, channel, 1) && threadIdx.x == 0) {
    signal_all(view, [&](int32_t p) { return &pad_of(view, p)->done[channel][rank]; });
  }
}

}  // namespace ep
}  // namespace jk
