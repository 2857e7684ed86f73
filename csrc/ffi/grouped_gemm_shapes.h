// Operand shape checks of the grouped GEMM targets, shared by the CPU twins and the CUDA bindings. Python checks
// the same constraints at trace time with clearer messages; these keep a direct FFI call from reading out of bounds.
#pragma once

#include <cstdint>
#include <utility>
#include <string>

#include "ffi/ffi_util.h"
#include "kernels/grouped_gemm.h"

namespace jk {
namespace grouped_gemm {

// The tile queue's counter, a workspace result of every target (see the signatures below).
inline ffi::Error tile_counter_shape(const char* op, int64_t count) {
  JK_FFI_CHECK(count == 1, std::string(op) + ": tile_counter must be [1]");
  return ffi::Error::Success();
}

// jk_gmm: lhs [R, K1] x rhs [G, K1, N] + lhs2 [R, K2] x rhs2 [G, K2, N] or, transposed, rhs [G, N, K1] and rhs2
// [G, N, K2]. K2 = 0 (lhs2 [R, 0]) for one product.
struct GmmShape {
  int64_t rows, k1, k2, n, groups;
};

inline ffi::Error gmm_shape(ffi::Span<const int64_t> lhs, ffi::Span<const int64_t> lhs2, ffi::Span<const int64_t> rhs,
                            ffi::Span<const int64_t> rhs2, int64_t offsets_count, int64_t sizes_count,
                            int64_t tile_counter_count, bool transpose_rhs, GmmShape* shape) {
  JK_FFI_CHECK(lhs.size() == 2 && lhs2.size() == 2 && rhs.size() == 3 && rhs2.size() == 3,
               "jk_gmm: lhs and lhs2 must be 2-D, rhs and rhs2 3-D");
  int64_t groups = rhs[0];
  int64_t n = transpose_rhs ? rhs[1] : rhs[2];
  int64_t k1 = transpose_rhs ? rhs[2] : rhs[1];
  int64_t n2 = transpose_rhs ? rhs2[1] : rhs2[2];
  int64_t k2 = transpose_rhs ? rhs2[2] : rhs2[1];
  JK_FFI_CHECK(rhs2[0] == groups && (n2 == n || k2 == 0), "jk_gmm: rhs2 must match rhs in groups and N");
  JK_FFI_CHECK(lhs[1] == k1 && lhs2[1] == k2, "jk_gmm: lhs must have K1 columns and lhs2 K2");
  JK_FFI_CHECK(lhs2[0] == lhs[0], "jk_gmm: lhs2 must have lhs's rows");
  JK_FFI_CHECK(offsets_count == groups + 1 && sizes_count == groups, "jk_gmm: group_offsets [G+1], group_sizes [G]");
  JK_FFI_RETURN_IF_ERROR(tile_counter_shape("jk_gmm", tile_counter_count));
  *shape = {lhs[0], k1, k2, n, groups};
  return ffi::Error::Success();
}

// A gathered operand's rows: row_tokens [R] picks rows of tokens [T, *]; without it (empty) the operand is [R, *].
inline ffi::Error gathered_rows(const char* message, int64_t operand_rows, int64_t row_tokens_count, int64_t rows) {
  JK_FFI_CHECK(row_tokens_count != 0 ? row_tokens_count == rows : operand_rows == rows, message);
  return ffi::Error::Success();
}

// jk_gmm_swiglu: x [R, H] rows, or x [T, H] tokens with row_tokens [R] (gathered); w_gate, w_up [G, H, I]; act
// [R, I]; gate/up outputs [R, I] or [0, I] when not saved.
struct SwigluShape {
  int64_t rows, tokens, hidden, inner, groups;
  bool gathered, save_preactivations;
};

inline ffi::Error swiglu_shape(ffi::Span<const int64_t> x, int64_t row_tokens_count, ffi::Span<const int64_t> w_gate,
                               ffi::Span<const int64_t> w_up, ffi::Span<const int64_t> act,
                               ffi::Span<const int64_t> saved, int64_t offsets_count, int64_t sizes_count,
                               int64_t tile_counter_count, SwigluShape* shape) {
  JK_FFI_CHECK(x.size() == 2 && w_gate.size() == 3 && w_up.size() == 3 && act.size() == 2 && saved.size() == 2,
               "jk_gmm_swiglu: x, act, gate, up 2-D; weights 3-D");
  JK_FFI_CHECK(w_gate[0] == w_up[0] && w_gate[1] == w_up[1] && w_gate[2] == w_up[2],
               "jk_gmm_swiglu: w_gate and w_up must have one shape");
  JK_FFI_CHECK(x[1] == w_gate[1], "jk_gmm_swiglu: x columns must be H");
  JK_FFI_CHECK(offsets_count == w_gate[0] + 1 && sizes_count == w_gate[0],
               "jk_gmm_swiglu: group_offsets [G+1], group_sizes [G]");
  const int64_t rows = act[0];
  JK_FFI_RETURN_IF_ERROR(gathered_rows(
      "jk_gmm_swiglu: row_tokens must be [R] (x [T, H] tokens), or empty with x [R, H] rows", x[0],
      row_tokens_count, rows));
  JK_FFI_CHECK(act[1] == w_gate[2], "jk_gmm_swiglu: act must be [R, I]");
  JK_FFI_CHECK((saved[0] == rows || saved[0] == 0) && saved[1] == w_gate[2],
               "jk_gmm_swiglu: saved gate/up must be [R, I] or [0, I]");
  JK_FFI_RETURN_IF_ERROR(tile_counter_shape("jk_gmm_swiglu", tile_counter_count));
  *shape = {rows, x[0], w_gate[1], w_gate[2], w_gate[0], row_tokens_count != 0, saved[0] != 0};
  return ffi::Error::Success();
}

// jk_gmm_swiglu_dgrad: g = dy_rows @ w_down[G, I, H]^T with dy [R, H] rows, or dy [T, H] tokens and row_tokens [R]
// (gathered); gate, up [R, I]; row_weights [R]; the weighted act output [R, I], or [0, I] when not saved; the
// row_weight_partials workspace [ceil(I / kTileCols), R].
struct DgradShape {
  int64_t rows, tokens, hidden, inner, groups;
  bool gathered, save_weighted_act;
};

inline ffi::Error dgrad_shape(ffi::Span<const int64_t> dy, int64_t row_tokens_count, ffi::Span<const int64_t> w_down,
                              ffi::Span<const int64_t> gate, ffi::Span<const int64_t> up, int64_t row_weights_count,
                              ffi::Span<const int64_t> weighted_act, ffi::Span<const int64_t> partials,
                              int64_t offsets_count, int64_t sizes_count, int64_t tile_counter_count,
                              DgradShape* shape) {
  JK_FFI_CHECK(dy.size() == 2 && w_down.size() == 3 && gate.size() == 2 && up.size() == 2,
               "jk_gmm_swiglu_dgrad: dy, gate, up 2-D; w_down 3-D");
  JK_FFI_CHECK(dy[1] == w_down[2], "jk_gmm_swiglu_dgrad: dy columns must be H (w_down [G, I, H])");
  const int64_t rows = gate[0];
  JK_FFI_CHECK(gate[1] == w_down[1] && up[0] == rows && up[1] == w_down[1],
               "jk_gmm_swiglu_dgrad: gate and up must be [R, I]");
  JK_FFI_RETURN_IF_ERROR(gathered_rows(
      "jk_gmm_swiglu_dgrad: row_tokens must be [R] (dy [T, H] tokens), or empty with dy [R, H] rows", dy[0],
      row_tokens_count, rows));
  JK_FFI_CHECK(row_weights_count == rows, "jk_gmm_swiglu_dgrad: row_weights must be [R]");
  JK_FFI_CHECK(weighted_act.size() == 2 && (weighted_act[0] == rows || weighted_act[0] == 0) &&
                   weighted_act[1] == w_down[1],
               "jk_gmm_swiglu_dgrad: weighted_act must be [R, I] or [0, I]");
  JK_FFI_CHECK(offsets_count == w_down[0] + 1 && sizes_count == w_down[0],
               "jk_gmm_swiglu_dgrad: group_offsets [G+1], group_sizes [G]");
  JK_FFI_CHECK(partials.size() == 2 && partials[0] == ceil_div(w_down[1], kTileCols) && partials[1] == rows,
               "jk_gmm_swiglu_dgrad: row_weight_partials must be [ceil(I / 256), R]");
  JK_FFI_RETURN_IF_ERROR(tile_counter_shape("jk_gmm_swiglu_dgrad", tile_counter_count));
  *shape = {rows, dy[0], w_down[2], w_down[1], w_down[0], row_tokens_count != 0, weighted_act[0] != 0};
  return ffi::Error::Success();
}

// jk_tgmm: lhs [R, K], rhs [R, N] -> out [G, K, N]. Either operand may instead be tokens [T, *] gathered through
// its row_tokens [R] (not both).
struct TgmmShape {
  int64_t rows, k, n, groups;
  int64_t lhs_tokens, rhs_tokens;  // the operands' own rows (T when gathered)
  bool lhs_gathered, rhs_gathered;
};

inline ffi::Error tgmm_shape(ffi::Span<const int64_t> lhs, int64_t lhs_row_tokens_count, ffi::Span<const int64_t> rhs,
                             int64_t rhs_row_tokens_count, ffi::Span<const int64_t> out, int64_t offsets_count,
                             int64_t sizes_count, int64_t tile_counter_count, TgmmShape* shape) {
  JK_FFI_CHECK(lhs.size() == 2 && rhs.size() == 2 && out.size() == 3, "jk_tgmm: lhs, rhs 2-D; out 3-D");
  JK_FFI_CHECK(lhs_row_tokens_count == 0 || rhs_row_tokens_count == 0,
               "jk_tgmm: at most one of lhs_row_tokens and rhs_row_tokens");
  const int64_t rows = lhs_row_tokens_count != 0 ? lhs_row_tokens_count
                                                 : (rhs_row_tokens_count != 0 ? rhs_row_tokens_count : lhs[0]);
  JK_FFI_RETURN_IF_ERROR(gathered_rows("jk_tgmm: lhs must have the rows (or its row_tokens)", lhs[0],
                                       lhs_row_tokens_count, rows));
  JK_FFI_RETURN_IF_ERROR(gathered_rows("jk_tgmm: rhs must have the rows (or its row_tokens)", rhs[0],
                                       rhs_row_tokens_count, rows));
  JK_FFI_CHECK(out[1] == lhs[1] && out[2] == rhs[1], "jk_tgmm: out must be [G, K, N]");
  JK_FFI_CHECK(offsets_count == out[0] + 1 && sizes_count == out[0], "jk_tgmm: group_offsets [G+1], group_sizes [G]");
  JK_FFI_RETURN_IF_ERROR(tile_counter_shape("jk_tgmm", tile_counter_count));
  *shape = {rows, lhs[1], rhs[1], out[0], lhs[0], rhs[0], lhs_row_tokens_count != 0, rhs_row_tokens_count != 0};
  return ffi::Error::Success();
}

}  // namespace grouped_gemm
}  // namespace jk

namespace jk {

// The operands, results and attributes of each target, shared by its CPU and CUDA bindings (which put their
// platform context first). The last results are workspace, not outputs: XLA allocates them with the op, so that the
// CUDA handlers allocate nothing (an allocation from XLA's scratch allocator would not outlive the recording) and XLA
// records them into its command buffers (CUDA graphs) with the ops around them. tile_counter [1]: the persistent
// kernels' tile queue (zeroed on the stream before each launch; the CPU twins leave it as it is). The dgrad's
// row_weight_partials [ceil(I / 256), R]: each row's router-weight gradient per 256-column block, summed in block
// order afterwards (both platforms).

template <typename Binding>
auto gmm_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::S32>>()  // tile_counter
      .template Attr<bool>("transpose_rhs");
}

template <typename Binding>
auto gmm_swiglu_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::BF16>>()
      .template Ret<ffi::Buffer<ffi::BF16>>()
      .template Ret<ffi::Buffer<ffi::BF16>>()
      .template Ret<ffi::Buffer<ffi::S32>>()  // tile_counter
      .template Attr<float>("swiglu_limit");
}

template <typename Binding>
auto gmm_swiglu_dgrad_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::BF16>>()
      .template Ret<ffi::Buffer<ffi::BF16>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::BF16>>()
      .template Ret<ffi::Buffer<ffi::F32>>()  // row_weight_partials
      .template Ret<ffi::Buffer<ffi::S32>>()  // tile_counter
      .template Attr<float>("swiglu_limit");
}

template <typename Binding>
auto tgmm_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::BF16>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::S32>>();  // tile_counter
}

}  // namespace jk
