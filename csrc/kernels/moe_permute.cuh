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

// A thread's row vectors land in shared memory by cp.async, kCombineSlotBatch slots a stage, two stages: while it
// sums one batch the next is in flight, and copies in flight hold no registers. An SM keeps up to 192 KB in flight,
// where loads into registers kept 48 KB (4 slots x 16 B for each of 768 threads). On an H100 that took 2.2-3.0% off
// the combine, which now runs at 95-99% of the bandwidth of XLA summing the same bytes from contiguous rows
// (gpu_power_h100_session34_combine_ab.json).
constexpr int kCombineSlotBatch = 8;
constexpr int kCombineStages = 2;
constexpr int kCombineCtasPerSm = 3;
constexpr int kCombineSmemBytes = kCombineStages * kCombineSlotBatch * kThreads * 16;  // 64 KB

// One vector of 4, 8 or 16 bytes from global into shared memory, asynchronously (16: through L2 only); a 2-byte or
// 1-byte vector (a row length that no wider vector divides) is copied synchronously.
template <typename V>
__device__ __forceinline__ void copy_to_shared(V* shared, const V* global) {
  constexpr int kBytes = sizeof(V);
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(
                     shared))),
                 "l"(global)
                 : "memory");
  } else if constexpr (kBytes == 8 || kBytes == 4) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(
                     shared))),
                 "l"(global), "n"(kBytes)
                 : "memory");
  } else {
    *shared = *global;
  }
}

// One thread computes N consecutive elements of y[t]: the slots in order j = 0..k-1, as combine_element does. Its
// work is a sequence of units (one (token, vector) item, one batch of slots); it copies unit u + 1 before it sums
// unit u. Stage s, slot b of a thread is vector (s * kCombineSlotBatch + b) * kThreads + threadIdx.x of the CTA's
// shared memory: each thread reads back only what it copied itself (no CTA barrier), and a warp's 32 vectors are
// consecutive (no bank conflicts).
template <typename T, int N>
__global__ void __launch_bounds__(kThreads, kCombineCtasPerSm) combine_kernel(CombineGlobals<T> g) {
  using P = Pack<T, N>;
  extern __shared__ uint4 combine_shared[];
  P* staged = reinterpret_cast<P*>(combine_shared) + threadIdx.x;
  // A CTA's (token, vector) items number about kItemsPerCta, so 32-bit local indices hold them.
  const int vectors_per_row = static_cast<int>(g.hidden / N);
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * g.tokens_per_cta;
  const int tokens = static_cast<int>(g.tokens - t0 < g.tokens_per_cta ? g.tokens - t0 : g.tokens_per_cta);
  const int items = tokens * vectors_per_row;
  // k = 0 still makes one (empty) unit per item: y[t] is then the addend, or 0.
  const int batches = g.top_k > kCombineSlotBatch ? (g.top_k + kCombineSlotBatch - 1) / kCombineSlotBatch : 1;
  const int units = threadIdx.x < items ? (items - threadIdx.x + kThreads - 1) / kThreads * batches : 0;

  // Unit u: item threadIdx.x + (u / batches) * kThreads, i.e. vector v of y[t], slots [j0, j0 + kCombineSlotBatch) and
  // the stage its copies land in.
  struct Unit {
    int64_t t;
    int v;
    int j0;
    P* stage;
  };
  auto unit = [&](int u) {
    const int i = threadIdx.x + u / batches * kThreads;
    return Unit{t0 + i / vectors_per_row, i % vectors_per_row, u % batches * kCombineSlotBatch,
                staged + u % kCombineStages * kCombineSlotBatch * kThreads};
  };

  // Copies unit u's placed slots into its stage and commits them as one group (an empty group past the last unit, so
  // that every unit's wait counts the same); returns the slots it copied, a bit each.
  auto copy_unit = [&](int u) -> uint32_t {
    uint32_t present = 0;
    if (u < units) {
      const Unit w = unit(u);
      const P* source = reinterpret_cast<const P*>(g.values) + w.v;
#pragma unroll
      for (int b = 0; b < kCombineSlotBatch; ++b) {
        const int32_t j = w.j0 + b;
        const int32_t r = j < g.top_k ? g.rows[w.t * g.top_k + j] : -1;
        if (!placed(r, g.num_rows)) continue;
        copy_to_shared(w.stage + b * kThreads, source + static_cast<int64_t>(r) * vectors_per_row);
        present |= 1u << b;
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    return present;
  };

  float acc[N];
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n] = 0.0f;
  uint32_t next_present = copy_unit(0);
  for (int u = 0; u < units; ++u) {
    const uint32_t present = next_present;
    next_present = copy_unit(u + 1);
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // unit u's group has landed
    const Unit w = unit(u);
#pragma unroll
    for (int b = 0; b < kCombineSlotBatch; ++b) {
      if (!(present >> b & 1u)) continue;
      const float weight = g.weights != nullptr ? g.weights[w.t * g.top_k + w.j0 + b] : 1.0f;
      const P value = w.stage[b * kThreads];
#pragma unroll
      for (int n = 0; n < N; ++n) acc[n] = accumulate(acc[n], weight, to_float(value.v[n]));
    }
    if (u % batches != batches - 1) continue;
    if (g.addend != nullptr) {
      const P add = reinterpret_cast<const P*>(g.addend + w.t * g.hidden)[w.v];
#pragma unroll
      for (int n = 0; n < N; ++n) acc[n] += to_float(add.v[n]);
    }
    P out;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      out.v[n] = from_float<T>(acc[n]);
      acc[n] = 0.0f;
    }
    reinterpret_cast<P*>(g.y + w.t * g.hidden)[w.v] = out;
  }
}

template <typename T, int N>
cudaError_t launch_combine_kernel(cudaStream_t stream, unsigned blocks, const CombineGlobals<T>& g) {
  // Over the 48 KB a launch gets without opting in; set once per instantiation (a static's initializer runs once).
  static const cudaError_t opted_in =
      cudaFuncSetAttribute(combine_kernel<T, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, kCombineSmemBytes);
  if (opted_in != cudaSuccess) return opted_in;
  combine_kernel<T, N><<<blocks, kThreads, kCombineSmemBytes, stream>>>(g);
  return cudaGetLastError();
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
  return vectorized ? launch_combine_kernel<T, kVector>(stream, static_cast<unsigned>(blocks), g)
                    : launch_combine_kernel<T, 1>(stream, static_cast<unsigned>(blocks), g);
}

}  // namespace jk::moe_permute
