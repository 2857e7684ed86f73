// CUDA kernels of the MoE permutations (arch-generic, memory-bound): gather tokens into expert-major rows and combine
// rows back into tokens. Both walk tokens: a CTA owns a block of consecutive tokens and its threads stride over
// (token, 16-byte vector) pairs, so each token row is read once (gather) or written once (combine). The math per
// element is kernels/moe_permute.h, shared with the CPU twin.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe_permute.h"

namespace jk::moe_permute {

constexpr int kThreads = 256;
constexpr int kItemsPerCta = 1024;  // (token, vector) pairs per CTA: ~4 per thread keeps enough CTAs in flight
constexpr int kZeroRowsPerCta = 32;  // rows a padding-zeroing CTA of gather checks

// Elements moved as one aligned vector.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

inline bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

inline int tokens_per_cta(int64_t vectors_per_row) {
  int64_t tokens = kItemsPerCta / (vectors_per_row > 0 ? vectors_per_row : 1);
  return static_cast<int>(tokens > 0 ? tokens : 1);
}

// ---- gather ----------------------------------------------------------------------------------------------------
// CTAs [0, token_ctas) copy tokens to their rows; CTAs after them zero the padding rows, kZeroRowsPerCta each.

struct GatherGlobals {
  const void* x;        // [tokens, hidden] any dtype
  const int32_t* rows;  // [tokens, top_k]
  const float* weights;  // [tokens, top_k] or null
  RowLayout layout;
  void* x_rows;         // [layout.rows, hidden]
  float* row_weights;   // [layout.rows] or null
  int64_t tokens;
  int32_t top_k;
  int64_t vectors_per_row;
  int32_t tokens_per_cta;
  int32_t token_ctas;
};

template <typename V>
__global__ void __launch_bounds__(kThreads) gather_kernel(GatherGlobals g) {
  if (static_cast<int32_t>(blockIdx.x) < g.token_ctas) {
    int64_t t0 = static_cast<int64_t>(blockIdx.x) * g.tokens_per_cta;
    int64_t tokens = g.tokens - t0 < g.tokens_per_cta ? g.tokens - t0 : g.tokens_per_cta;
    const V* in = static_cast<const V*>(g.x);
    V* out = static_cast<V*>(g.x_rows);
    for (int64_t i = threadIdx.x; i < tokens * g.vectors_per_row; i += kThreads) {
      int64_t t = t0 + i / g.vectors_per_row;
      int64_t v = i % g.vectors_per_row;
      V value = in[t * g.vectors_per_row + v];
      const int32_t* token_rows = g.rows + t * g.top_k;
      for (int32_t j = 0; j < g.top_k; ++j) {
        int32_t r = token_rows[j];
        if (!placed(r, g.layout.rows)) continue;
        out[r * g.vectors_per_row + v] = value;
        if (v == 0 && g.row_weights != nullptr) g.row_weights[r] = g.weights[t * g.top_k + j];
      }
    }
    return;
  }
  __shared__ bool padding[kZeroRowsPerCta];
  int64_t r0 = static_cast<int64_t>(blockIdx.x - g.token_ctas) * kZeroRowsPerCta;
  int64_t rows = g.layout.rows - r0 < kZeroRowsPerCta ? g.layout.rows - r0 : kZeroRowsPerCta;
  if (threadIdx.x < rows) {
    bool pad = is_padding_row(g.layout, r0 + threadIdx.x);
    padding[threadIdx.x] = pad;
    if (pad && g.row_weights != nullptr) g.row_weights[r0 + threadIdx.x] = 0.0f;
  }
  __syncthreads();
  V* out = static_cast<V*>(g.x_rows);
  V zero;
  for (size_t b = 0; b < sizeof(V); ++b) reinterpret_cast<unsigned char*>(&zero)[b] = 0;
  for (int64_t i = threadIdx.x; i < rows * g.vectors_per_row; i += kThreads) {
    int64_t local = i / g.vectors_per_row;
    if (padding[local]) out[(r0 + local) * g.vectors_per_row + i % g.vectors_per_row] = zero;
  }
}

// row_bytes: bytes of one [hidden] row. The widest vector that divides the row and the buffers' alignment is used.
inline cudaError_t launch_gather(cudaStream_t stream, GatherGlobals g, int64_t row_bytes) {
  int vector_bytes = 16;
  while (vector_bytes > 1 && (row_bytes % vector_bytes || !aligned_to(g.x, vector_bytes) ||
                              !aligned_to(g.x_rows, vector_bytes))) {
    vector_bytes /= 2;
  }
  g.vectors_per_row = row_bytes / vector_bytes;
  g.tokens_per_cta = tokens_per_cta(g.vectors_per_row);
  int64_t token_ctas = (g.tokens + g.tokens_per_cta - 1) / g.tokens_per_cta;
  int64_t zero_ctas = (g.layout.rows + kZeroRowsPerCta - 1) / kZeroRowsPerCta;
  if (token_ctas + zero_ctas == 0 || g.vectors_per_row == 0) return cudaSuccess;
  if (token_ctas + zero_ctas >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  g.token_ctas = static_cast<int32_t>(token_ctas);
  unsigned blocks = static_cast<unsigned>(token_ctas + zero_ctas);
  switch (vector_bytes) {
    case 16: gather_kernel<uint4><<<blocks, kThreads, 0, stream>>>(g); break;
    case 8: gather_kernel<uint2><<<blocks, kThreads, 0, stream>>>(g); break;
    case 4: gather_kernel<uint32_t><<<blocks, kThreads, 0, stream>>>(g); break;
    case 2: gather_kernel<uint16_t><<<blocks, kThreads, 0, stream>>>(g); break;
    default: gather_kernel<uint8_t><<<blocks, kThreads, 0, stream>>>(g); break;
  }
  return cudaGetLastError();
}

// ---- combine ---------------------------------------------------------------------------------------------------

template <typename T>
struct CombineGlobals {
  const T* values;       // [num_rows, hidden]
  int64_t num_rows;
  const int32_t* rows;   // [tokens, top_k]
  const float* weights;  // [tokens, top_k] or null (all 1)
  const T* addend;       // [tokens, hidden] or null
  T* y;                  // [tokens, hidden]
  int64_t tokens;
  int64_t hidden;
  int32_t top_k;
  int32_t tokens_per_cta;
};

constexpr int kCombineSlotBatch = 4;
constexpr int kCombineCtasPerSm = 3;  // caps the registers (<= 85) so that 768 threads per SM keep their rows in flight

// One thread computes N consecutive elements of y[t]: the slots in order j = 0..k-1, as combine_element does. Up to
// kCombineSlotBatch slots' rows are loaded before any is summed, so a thread keeps that many loads in flight (the
// kernel streams k rows per token: ~3.7 TB/s at qwen3.5, 2.5% faster than one slot at a time).
template <typename T, int N>
__global__ void __launch_bounds__(kThreads, kCombineCtasPerSm) combine_kernel(CombineGlobals<T> g) {
  using P = Pack<T, N>;
  // A CTA's (token, vector) items number about kItemsPerCta, so 32-bit local indices hold them.
  const int vectors_per_row = static_cast<int>(g.hidden / N);
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * g.tokens_per_cta;
  const int tokens = static_cast<int>(g.tokens - t0 < g.tokens_per_cta ? g.tokens - t0 : g.tokens_per_cta);
  for (int i = threadIdx.x; i < tokens * vectors_per_row; i += kThreads) {
    const int64_t t = t0 + i / vectors_per_row;
    const int v = i % vectors_per_row;
    P add;
    if (g.addend != nullptr) add = reinterpret_cast<const P*>(g.addend + t * g.hidden)[v];
    float acc[N];
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n] = 0.0f;
    for (int32_t j0 = 0; j0 < g.top_k; j0 += kCombineSlotBatch) {
      P values[kCombineSlotBatch];
      float weights[kCombineSlotBatch];
      bool present[kCombineSlotBatch];
#pragma unroll
      for (int b = 0; b < kCombineSlotBatch; ++b) {
        int32_t j = j0 + b;
        int32_t r = j < g.top_k ? g.rows[t * g.top_k + j] : -1;
        present[b] = placed(r, g.num_rows);
        if (!present[b]) continue;
        weights[b] = g.weights != nullptr ? g.weights[t * g.top_k + j] : 1.0f;
        values[b] = reinterpret_cast<const P*>(g.values + r * g.hidden)[v];
      }
#pragma unroll
      for (int b = 0; b < kCombineSlotBatch; ++b) {
        if (!present[b]) continue;
#pragma unroll
        for (int n = 0; n < N; ++n) acc[n] = accumulate(acc[n], weights[b], to_float(values[b].v[n]));
      }
    }
    if (g.addend != nullptr) {
#pragma unroll
      for (int n = 0; n < N; ++n) acc[n] += to_float(add.v[n]);
    }
    P out;
#pragma unroll
    for (int n = 0; n < N; ++n) out.v[n] = from_float<T>(acc[n]);
    reinterpret_cast<P*>(g.y + t * g.hidden)[v] = out;
  }
}

template <typename T>
cudaError_t launch_combine(cudaStream_t stream, CombineGlobals<T> g) {
  constexpr int kVector = 16 / sizeof(T);
  bool vectorized = g.hidden % kVector == 0 && aligned_to(g.values, 16) && aligned_to(g.y, 16) &&
                    (g.addend == nullptr || aligned_to(g.addend, 16));
  int64_t vectors_per_row = vectorized ? g.hidden / kVector : g.hidden;
  g.tokens_per_cta = tokens_per_cta(vectors_per_row);
  int64_t blocks = (g.tokens + g.tokens_per_cta - 1) / g.tokens_per_cta;
  if (blocks == 0 || g.hidden == 0) return cudaSuccess;
  if (blocks >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  if (vectorized) {
    combine_kernel<T, kVector><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(g);
  } else {
    combine_kernel<T, 1><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(g);
  }
  return cudaGetLastError();
}

}  // namespace jk::moe_permute
