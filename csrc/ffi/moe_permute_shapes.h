// Operand checks of jk_moe_gather and jk_moe_combine, shared by the CPU twin and the CUDA bindings. Python checks the
// same constraints at trace time with clearer messages; these keep a direct FFI call from reading out of bounds.
#pragma once

#include <cstdint>
#include <utility>

#include "ffi/ffi_util.h"

namespace jk::moe_permute {

// jk_moe_gather: x [T, H] -> x_rows [R, H] (same dtype); rows [T, k]; weights [T, k] f32 and row_weights [R] f32, or
// both empty when the row weights are not wanted; offsets [E+1], counts [E].
struct GatherShape {
  int64_t tokens, hidden, top_k, rows, experts;
  bool with_row_weights;
};

inline ffi::Error gather_shape(ffi::AnyBuffer x, ffi::Span<const int64_t> rows, int64_t weights_count,
                               int64_t offsets_count, int64_t counts_count, ffi::AnyBuffer x_rows,
                               int64_t row_weights_count, GatherShape* shape) {
  auto xd = x.dimensions(), od = x_rows.dimensions();
  JK_FFI_CHECK(xd.size() == 2 && rows.size() == 2 && od.size() == 2, "jk_moe_gather: x, rows, x_rows must be 2-D");
  JK_FFI_CHECK(rows[0] == xd[0], "jk_moe_gather: rows must be [T, k] for x [T, H]");
  JK_FFI_CHECK(od[1] == xd[1] && x_rows.element_type() == x.element_type(),
               "jk_moe_gather: x_rows must be [R, H] of x's dtype");
  JK_FFI_CHECK(offsets_count == counts_count + 1 && counts_count >= 1,
               "jk_moe_gather: expert_offsets [E+1], tokens_per_expert [E]");
  bool with_row_weights = row_weights_count != 0;
  JK_FFI_CHECK(!with_row_weights || (row_weights_count == od[0] && weights_count == rows[0] * rows[1]),
               "jk_moe_gather: row_weights [R] needs weights [T, k]");
  JK_FFI_CHECK(od[0] < (int64_t{1} << 31), "jk_moe_gather: more than 2^31 - 1 rows");
  *shape = {xd[0], xd[1], rows[1], od[0], counts_count, with_row_weights};
  return ffi::Error::Success();
}

// jk_moe_combine: values [R, H], rows [T, k], weights [T, k] f32 or empty (all 1), addend [T, H] or empty (0)
// -> y [T, H]; values, addend and y share one dtype.
struct CombineShape {
  int64_t tokens, hidden, top_k, rows;
  bool with_weights, with_addend;
};

inline ffi::Error combine_shape(ffi::AnyBuffer values, ffi::Span<const int64_t> rows, int64_t weights_count,
                                ffi::AnyBuffer addend, ffi::AnyBuffer y, CombineShape* shape) {
  auto vd = values.dimensions(), yd = y.dimensions(), ad = addend.dimensions();
  JK_FFI_CHECK(vd.size() == 2 && rows.size() == 2 && yd.size() == 2, "jk_moe_combine: values, rows, y must be 2-D");
  JK_FFI_CHECK(yd[0] == rows[0] && yd[1] == vd[1], "jk_moe_combine: y must be [T, H] for rows [T, k], values [R, H]");
  JK_FFI_CHECK(y.element_type() == values.element_type() && addend.element_type() == values.element_type(),
               "jk_moe_combine: values, addend and y must share a dtype");
  JK_FFI_CHECK(weights_count == 0 || weights_count == rows[0] * rows[1], "jk_moe_combine: weights must be [T, k]");
  bool with_addend = addend.element_count() != 0;
  JK_FFI_CHECK(!with_addend || (ad.size() == 2 && ad[0] == yd[0] && ad[1] == yd[1]),
               "jk_moe_combine: addend must be [T, H] or empty");
  JK_FFI_CHECK(vd[0] < (int64_t{1} << 31), "jk_moe_combine: more than 2^31 - 1 rows");
  *shape = {yd[0], yd[1], rows[1], vd[0], weights_count != 0, with_addend};
  return ffi::Error::Success();
}

}  // namespace jk::moe_permute

namespace jk {

// The operands, results and attributes of each target, shared by its CPU and CUDA bindings (which put their
// platform context first).

template <typename Binding>
auto moe_gather_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

template <typename Binding>
auto moe_combine_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

}  // namespace jk
