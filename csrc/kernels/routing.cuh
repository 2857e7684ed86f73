// CUDA routing kernels (arch-generic): one thread per token for the scores and top-k; three small kernels for the
// expert-major schedule (count per chunk, scan, place), MoK-style: no sort, integer atomics only, deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/routing.h"

namespace jk::routing {

// ---- route -----------------------------------------------------------------------------------------------------

template <typename Logit>
__global__ void route_kernel(const Logit* __restrict__ logits, const float* __restrict__ bias, int64_t tokens_per_bias_row,
                             RouteParams p, int64_t tokens, float* __restrict__ weights, int32_t* __restrict__ ids) {
  int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  route_token(logits + t * p.num_experts, bias + t / tokens_per_bias_row * p.num_experts, p, weights + t * p.top_k, ids + t * p.top_k);
}

template <typename Logit>
cudaError_t launch_route(cudaStream_t stream, const Logit* logits, const float* bias, int64_t tokens_per_bias_row,
                         const RouteParams& p, int64_t tokens, float* weights, int32_t* ids) {
  if (tokens == 0) return cudaSuccess;
  constexpr int kThreads = 128;
  unsigned blocks = static_cast<unsigned>((tokens + kThreads - 1) / kThreads);
  route_kernel<<<blocks, kThreads, 0, stream>>>(logits, bias, tokens_per_bias_row, p, tokens, weights, ids);
  return cudaGetLastError();
}

// ---- schedule --------------------------------------------------------------------------------------------------
// The (token, slot) entries are cut into chunks of kChunk (kernels/routing.h). chunk_counts[e][c] first holds chunk
// c's count of expert e, then (after the scan) the number of entries of expert e in chunks before c: the chunk's base
// row. Expert e's counts lie side by side so that the scan reads them in coalesced loads.

struct ScheduleGlobals {
  const int32_t* ids;          // [entries]
  int64_t entries;
  int32_t num_experts;
  int32_t align;
  int32_t* chunk_counts;       // [num_experts, num_chunks] workspace
  int32_t* tokens_per_expert;  // [num_experts]
  int32_t* expert_offsets;     // [num_experts + 1]
  int32_t* rows;               // [entries]
};

__device__ __forceinline__ bool valid_expert(int32_t id, int32_t num_experts) { return id >= 0 && id < num_experts; }

__global__ void count_chunks_kernel(ScheduleGlobals g) {
  extern __shared__ int32_t histogram[];
  for (int e = threadIdx.x; e < g.num_experts; e += blockDim.x) histogram[e] = 0;
  __syncthreads();
  int64_t i = static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x;
  if (i < g.entries && valid_expert(g.ids[i], g.num_experts)) atomicAdd(&histogram[g.ids[i]], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < g.num_experts; e += blockDim.x) {
    g.chunk_counts[static_cast<int64_t>(e) * gridDim.x + blockIdx.x] = histogram[e];
  }
}

// The sum of `value` over the lanes below this one (the warp's exclusive prefix sum).
__device__ __forceinline__ int32_t warp_exclusive_sum(int32_t value, int lane) {
  int32_t inclusive = value;
  for (int d = 1; d < 32; d <<= 1) {
    int32_t below = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += below;
  }
  return inclusive - value;
}

// In place over items[0, n) of one warp: each item becomes the sum of the items before it (items[i] =
// transform(items[i]) first); returns the total. A round loads 32 * kBatch items, kBatch coalesced loads per lane all
// in flight at once, then scans them 32 at a time with shuffles. (For the 64 x 320 chunk counts of a T = 8192, k = 10
// schedule, one thread walking each expert's chunks, a dependent round trip per chunk, took 35 us; lanes whose loads
// lay a row of experts apart, 32 transactions per load on the one SM, took 32-42 us.)
template <typename Transform>
__device__ int32_t warp_exclusive_scan_in_place(int32_t* items, int n, int lane, Transform transform) {
  constexpr int kBatch = 8;
  int32_t carry = 0;
  for (int base = 0; base < n; base += 32 * kBatch) {
    int32_t values[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * 32 + lane;
      values[b] = i < n ? transform(items[i]) : 0;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * 32 + lane;
      const int32_t below = warp_exclusive_sum(values[b], lane);
      if (i < n) items[i] = carry + below;
      carry += __shfl_sync(0xffffffffu, below + values[b], 31);
    }
  }
  return carry;
}

constexpr int kScanThreads = 1024;

__global__ void __launch_bounds__(kScanThreads, 1) scan_kernel(ScheduleGlobals g, int num_chunks) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int e = warp; e < g.num_experts; e += warps) {
    int32_t total = warp_exclusive_scan_in_place(g.chunk_counts + static_cast<int64_t>(e) * num_chunks, num_chunks,
                                                 lane, [](int32_t count) { return count; });
    if (lane == 0) g.tokens_per_expert[e] = total;
  }
  __syncthreads();  // the block's global writes of tokens_per_expert are visible to warp 0 after this
  if (warp == 0) {
    for (int e = lane; e < g.num_experts; e += 32) g.expert_offsets[e] = g.tokens_per_expert[e];
    __syncwarp();
    int32_t rows = warp_exclusive_scan_in_place(g.expert_offsets, g.num_experts, lane,
                                                [align = g.align](int32_t count) { return align_up(count, align); });
    if (lane == 0) g.expert_offsets[g.num_experts] = rows;
  }
}

// Rank of an entry among its chunk's earlier entries of the same expert: at most kChunk compares from shared memory.
__global__ void place_kernel(ScheduleGlobals g) {
  __shared__ int32_t chunk_ids[kChunk];
  int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  int64_t i = base + threadIdx.x;
  int32_t id = i < g.entries ? g.ids[i] : -1;
  chunk_ids[threadIdx.x] = id;
  __syncthreads();
  if (i >= g.entries) return;
  if (!valid_expert(id, g.num_experts)) {
    g.rows[i] = -1;
    return;
  }
  int32_t rank = 0;
  for (int j = 0; j < static_cast<int>(threadIdx.x); ++j) rank += chunk_ids[j] == id;
  g.rows[i] = g.expert_offsets[id] + g.chunk_counts[static_cast<int64_t>(id) * gridDim.x + blockIdx.x] + rank;
}

inline cudaError_t launch_schedule(cudaStream_t stream, const ScheduleGlobals& g) {
  const int num_chunks = static_cast<int>(schedule_chunks(g.entries));
  size_t histogram_bytes = static_cast<size_t>(g.num_experts) * sizeof(int32_t);
  if (histogram_bytes > 48 * 1024) {
    cudaError_t status = cudaFuncSetAttribute(count_chunks_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(histogram_bytes));
    if (status != cudaSuccess) return status;
  }
  if (num_chunks > 0) {
    count_chunks_kernel<<<num_chunks, kChunk, histogram_bytes, stream>>>(g);
    if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
  }
  scan_kernel<<<1, kScanThreads, 0, stream>>>(g, num_chunks);
  if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
  if (num_chunks > 0) {
    place_kernel<<<num_chunks, kChunk, 0, stream>>>(g);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace jk::routing
