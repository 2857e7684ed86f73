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
// The (token, slot) entries are cut into chunks of kChunk. chunk_counts[c][e] first holds chunk c's count of
// expert e, then (after the scan) the number of entries of expert e in chunks before c: the chunk's base row.

constexpr int kChunk = 256;

struct ScheduleGlobals {
  const int32_t* ids;          // [entries]
  int64_t entries;
  int32_t num_experts;
  int32_t align;
  int32_t* chunk_counts;       // [num_chunks, num_experts] scratch
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
  int32_t* out = g.chunk_counts + static_cast<int64_t>(blockIdx.x) * g.num_experts;
  for (int e = threadIdx.x; e < g.num_experts; e += blockDim.x) out[e] = histogram[e];
}

// One block: a running sum over chunks per expert, then the aligned exclusive scan over experts.
__global__ void scan_kernel(ScheduleGlobals g, int num_chunks) {
  for (int e = threadIdx.x; e < g.num_experts; e += blockDim.x) {
    int32_t running = 0;
    for (int c = 0; c < num_chunks; ++c) {
      int32_t* slot = g.chunk_counts + static_cast<int64_t>(c) * g.num_experts + e;
      int32_t count = *slot;
      *slot = running;
      running += count;
    }
    g.tokens_per_expert[e] = running;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t offset = 0;
    for (int e = 0; e < g.num_experts; ++e) {
      g.expert_offsets[e] = offset;
      offset += align_up(g.tokens_per_expert[e], g.align);
    }
    g.expert_offsets[g.num_experts] = offset;
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
  g.rows[i] = g.expert_offsets[id] + g.chunk_counts[static_cast<int64_t>(blockIdx.x) * g.num_experts + id] + rank;
}

inline int schedule_chunks(int64_t entries) { return static_cast<int>((entries + kChunk - 1) / kChunk); }

inline cudaError_t launch_schedule(cudaStream_t stream, const ScheduleGlobals& g) {
  int num_chunks = schedule_chunks(g.entries);
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
  scan_kernel<<<1, 1024, 0, stream>>>(g, num_chunks);
  if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
  if (num_chunks > 0) {
    place_kernel<<<num_chunks, kChunk, 0, stream>>>(g);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace jk::routing
