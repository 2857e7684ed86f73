// Token <-> expert-major row permutations of the fused MoE pipeline, shared by the CPU twin (ffi/moe_permute.cc)
// and the CUDA kernels (kernels/moe_permute.cuh), so both compute the same function bit for bit.
//
// Layout (jax_kittens.schedule): entry (t, j) of the [T, k] routing goes to row rows[t * k + j] of the [R, H]
// expert-major buffers, or nowhere when that is -1. Expert e's data rows are [offsets[e], offsets[e] + counts[e]);
// every other row (alignment gaps, the tail [offsets[E], R), a head [0, offsets[0])) is padding.
//
// gather:  x_rows[rows[t, j]] = x[t] and row_weights[rows[t, j]] = weights[t, j]; padding rows get 0.
// combine: y[t] = addend[t] + sum_j weights[t, j] * rows_values[rows[t, j]], summed in float32 in slot order j = 0..k-1
//          (one fused multiply-add per slot) with the addend last, then rounded once. Each output element is owned
//          by one thread: no atomics, the same bits on every run.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common.h"

namespace jk::moe_permute {

struct RowLayout {
  const int32_t* offsets;  // [experts + 1] first row of each expert; offsets[experts] ends the rows in use
  const int32_t* counts;   // [experts] data rows of each expert
  int32_t experts;
  int64_t rows;            // R, the buffers' leading dim
};

// True when row r holds no (token, slot) entry. A binary search over the (nondecreasing) offsets finds r's expert.
JK_HOST_DEVICE bool is_padding_row(const RowLayout& l, int64_t r) {
  if (r < l.offsets[0] || r >= l.offsets[l.experts]) return true;
  int32_t lo = 0, hi = l.experts;  // offsets[lo] <= r < offsets[hi]
  while (hi - lo > 1) {
    int32_t mid = (lo + hi) / 2;
    if (l.offsets[mid] <= r) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return r - l.offsets[lo] >= static_cast<int64_t>(l.counts[lo]);
}

// The float32 accumulation of combine, one slot at a time; both sides use a true fused multiply-add so they agree.
JK_HOST_DEVICE float accumulate(float acc, float weight, float value) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(weight, value, acc);
#else
  return std::fma(weight, value, acc);
#endif
}

// Element storage of the permuted values: float32, or bfloat16 as raw bits (rounded to nearest even).
JK_HOST_DEVICE float to_float(float v) { return v; }
JK_HOST_DEVICE float to_float(uint16_t v) { return bf16_bits_to_float(v); }

template <typename T>
JK_HOST_DEVICE T from_float(float v);
template <>
JK_HOST_DEVICE float from_float<float>(float v) { return v; }
template <>
JK_HOST_DEVICE uint16_t from_float<uint16_t>(float v) { return float_to_bf16_bits(v); }

// A schedule row that names a row of the [num_rows, H] buffers (-1 and anything out of range name none).
JK_HOST_DEVICE bool placed(int32_t r, int64_t num_rows) { return r >= 0 && r < num_rows; }

// combine for one output element y[t, c]. rows/weights point at token t's k slots; weights may be null (all 1);
// addend points at y's row t or is null (0). values: [num_rows, H] row-major.
template <typename T>
JK_HOST_DEVICE T combine_element(const T* values, int64_t num_rows, int64_t hidden, const int32_t* rows,
                                 const float* weights, int32_t top_k, const T* addend, int64_t c) {
  float acc = 0.0f;
  for (int32_t j = 0; j < top_k; ++j) {
    int32_t r = rows[j];
    if (!placed(r, num_rows)) continue;
    acc = accumulate(acc, weights != nullptr ? weights[j] : 1.0f, to_float(values[r * hidden + c]));
  }
  if (addend != nullptr) acc += to_float(addend[c]);
  return from_float<T>(acc);
}

}  // namespace jk::moe_permute
