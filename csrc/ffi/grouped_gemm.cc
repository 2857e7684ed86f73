// CPU twins of the grouped GEMM targets (jk_gmm, jk_gmm_swiglu, jk_gmm_swiglu_dgrad, jk_tgmm): plain loops with
// float32 accumulation, the same row/group math and SwiGLU arithmetic as the sm90 kernels (kernels/grouped_gemm.h).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "ffi/ffi_util.h"
#include "ffi/grouped_gemm_shapes.h"
#include "ffi/registry.h"
#include "kernels/grouped_gemm.h"

namespace jk {
namespace {

namespace gg = grouped_gemm;
using gg::GroupLayout;
using gg::SwigluClamp;

constexpr uint16_t kBf16Nan = 0x7FC0;

// Weights of one group as a [K, N] operand: row-major [K, N], or [N, K] when transposed.
struct WeightView {
  const uint16_t* data;
  int64_t k, n;
  bool transposed;
  float at(int64_t kk, int64_t nn) const {
    return bf16_bits_to_float(transposed ? data[nn * k + kk] : data[kk * n + nn]);
  }
};

// acc[0 .. n1 - n0) = (lhs_row @ w)[n0 : n1] (+ lhs2_row @ w2 when w2 has K > 0), the K steps in the kernels' order.
void row_product(const uint16_t* lhs_row, const WeightView& w, const uint16_t* lhs2_row, const WeightView& w2,
                 int32_t n0, int32_t n1, float* acc) {
  std::fill(acc, acc + (n1 - n0), 0.0f);
  for (auto [row, weights] : {std::pair{lhs_row, &w}, std::pair{lhs2_row, &w2}}) {
    for (int64_t kk = 0; kk < weights->k; ++kk) {
      float a = bf16_bits_to_float(row[kk]);
      for (int32_t nn = n0; nn < n1; ++nn) acc[nn - n0] += a * weights->at(kk, nn);
    }
  }
}

// acc[0 .. n1 - n0) = (lhs_row @ w)[n0 : n1].
void row_product(const uint16_t* lhs_row, const WeightView& w, int32_t n0, int32_t n1, float* acc) {
  row_product(lhs_row, w, nullptr, WeightView{nullptr, 0, w.n, w.transposed}, n0, n1, acc);
}

// Row r of an operand: x [R, C] itself, or with row_tokens (not empty) row row_tokens[r] of tokens x [T, C], zeros
// for a token outside [0, T): the kernels' gathered operands.
class OperandRows {
 public:
  OperandRows(ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::S32>& row_tokens)
      : data_(x.typed_data()),
        row_tokens_(row_tokens.element_count() != 0 ? row_tokens.typed_data() : nullptr),
        num_tokens_(x.dimensions()[0]),
        cols_(x.dimensions()[1]),
        zeros_(cols_, 0) {}

  const uint16_t* operator()(int64_t r) const {
    if (row_tokens_ == nullptr) return data_ + r * cols_;
    const int32_t token = row_tokens_[r];
    return token >= 0 && token < num_tokens_ ? data_ + token * cols_ : zeros_.data();
  }

 private:
  const uint16_t* data_;
  const int32_t* row_tokens_;
  int64_t num_tokens_, cols_;
  std::vector<uint16_t> zeros_;
};

GroupLayout layout_of(ffi::Buffer<ffi::S32>& offsets, ffi::Buffer<ffi::S32>& sizes, int64_t groups, int64_t rows) {
  return {offsets.typed_data(), sizes.typed_data(), static_cast<int32_t>(groups), static_cast<int32_t>(rows)};
}

// What the kernels' 2-CTA clusters assume of a tile order, which the CPU cannot run: where the n-block count is even
// (the launch's condition for clusters, ffi/grouped_gemm_cuda.cu), tiles 2j and 2j + 1 share their lhs (group and
// first lhs row or column) and take n blocks 2i and 2i + 1. Called with every tile in order.
class ClusterPairCheck {
 public:
  explicit ClusterPairCheck(int64_t n_blocks) : clusters_(n_blocks % 2 == 0) {}

  ffi::Error operator()(int32_t t, int32_t group, int32_t lhs, int32_t n_block) {
    if (t % 2 == 0) {
      group_ = group, lhs_ = lhs, n_block_ = n_block;
    } else if (clusters_) {
      JK_FFI_CHECK(group == group_ && lhs == lhs_ && n_block == n_block_ + 1 && n_block % 2 == 1,
                   "tile order: tiles 2j and 2j + 1 must be one cluster's pair");
    }
    return ffi::Error::Success();
  }

 private:
  bool clusters_;
  int32_t group_ = 0, lhs_ = 0, n_block_ = 0;
};

// Walks the kernels' row tiles (kernels/grouped_gemm.h): data_row(row, group, n0, n1, n_block) for data rows,
// pad_row(row, n0, n1, n_block) for padding, tail and head rows. Outputs are NaN-filled first, so a row the tile
// decomposition missed fails the tests as it would on the GPU.
template <int kBlockN, typename DataRow, typename PadRow>
ffi::Error for_each_tile_row(const GroupLayout& layout, int32_t n, DataRow data_row, PadRow pad_row) {
  gg::VisitPlan plan;
  gg::plan_visits<gg::kTileRows>(layout, &plan);
  gg::RowTileScheduler<gg::kTileRows, kBlockN> scheduler(layout, n, &plan);
  ClusterPairCheck check_pair(scheduler.n_blocks);
  // With every row written (the NaN fill), a tile count equal to the pseudo-groups' means each tile ran once.
  int64_t tiles = 0;
  for (int32_t g = 0; g < layout.groups + 2; ++g) tiles += gg::group_m_blocks<gg::kTileRows>(layout, g);
  tiles *= scheduler.n_blocks;
  gg::RowTile tile;
  int32_t t = 0;
  for (; scheduler.get(layout, t, &tile); ++t) {
    JK_FFI_RETURN_IF_ERROR(check_pair(t, tile.group, tile.row0, tile.n_block));
    int32_t n1 = std::min(tile.n0 + kBlockN, n);
    for (int32_t r = 0; r < tile.written; ++r) {
      if (r < tile.valid) {
        data_row(tile.row0 + r, tile.group, tile.n0, n1, tile.n_block);
      } else {
        pad_row(tile.row0 + r, tile.n0, n1, tile.n_block);
      }
    }
  }
  JK_FFI_CHECK(t == tiles, "tile decomposition: the visits walked a tile count other than the groups'");
  return ffi::Error::Success();
}

void store(void* out, ffi::DataType type, int64_t index, float value) {
  if (type == ffi::F32) {
    static_cast<float*>(out)[index] = value;
  } else {
    static_cast<uint16_t*>(out)[index] = float_to_bf16_bits(value);
  }
}

void poison(void* out, ffi::DataType type, size_t count) {
  if (type == ffi::F32) {
    std::fill_n(static_cast<float*>(out), count, std::numeric_limits<float>::quiet_NaN());
  } else {
    std::fill_n(static_cast<uint16_t*>(out), count, kBf16Nan);
  }
}

ffi::Error check_rows(int64_t rows) {
  JK_FFI_CHECK(rows < (int64_t{1} << 31), "grouped GEMM: more than 2^31 - 1 rows");
  return ffi::Error::Success();
}

ffi::Error GmmCpu(ffi::Buffer<ffi::BF16> lhs, ffi::Buffer<ffi::BF16> lhs2, ffi::Buffer<ffi::BF16> rhs,
                  ffi::Buffer<ffi::BF16> rhs2, ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> sizes,
                  ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::S32> tile_counter, bool transpose_rhs) {
  gg::GmmShape s;
  JK_FFI_RETURN_IF_ERROR(gg::gmm_shape(lhs.dimensions(), lhs2.dimensions(), rhs.dimensions(), rhs2.dimensions(),
                                       offsets.element_count(), sizes.element_count(), tile_counter->element_count(),
                                       transpose_rhs, &s));
  JK_FFI_RETURN_IF_ERROR(check_rows(s.rows));
  ffi::DataType type = out->element_type();
  JK_FFI_CHECK(type == ffi::F32 || type == ffi::BF16, "jk_gmm: out must be bf16 or f32");
  JK_FFI_CHECK(out->dimensions().size() == 2 && out->dimensions()[0] == s.rows && out->dimensions()[1] == s.n,
               "jk_gmm: out must be [R, N]");
  void* o = out->untyped_data();
  poison(o, type, out->element_count());
  std::vector<float> acc(gg::kTileCols);
  JK_FFI_RETURN_IF_ERROR(for_each_tile_row<gg::kTileCols>(
      layout_of(offsets, sizes, s.groups, s.rows), static_cast<int32_t>(s.n),
      [&](int64_t r, int32_t g, int32_t n0, int32_t n1, int32_t) {
        WeightView w1{rhs.typed_data() + g * s.k1 * s.n, s.k1, s.n, transpose_rhs};
        WeightView w2{rhs2.typed_data() + g * s.k2 * s.n, s.k2, s.n, transpose_rhs};
        row_product(lhs.typed_data() + r * s.k1, w1, lhs2.typed_data() + r * s.k2, w2, n0, n1, acc.data());
        for (int32_t c = n0; c < n1; ++c) store(o, type, r * s.n + c, acc[c - n0]);
      },
      [&](int64_t r, int32_t n0, int32_t n1, int32_t) {
        for (int32_t c = n0; c < n1; ++c) store(o, type, r * s.n + c, 0.0f);
      }));
  return ffi::Error::Success();
}

ffi::Error GmmSwigluCpu(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> row_tokens, ffi::Buffer<ffi::BF16> w_gate,
                        ffi::Buffer<ffi::BF16> w_up, ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> sizes,
                        ffi::ResultBuffer<ffi::BF16> act, ffi::ResultBuffer<ffi::BF16> gate_out,
                        ffi::ResultBuffer<ffi::BF16> up_out, ffi::ResultBuffer<ffi::S32> tile_counter,
                        float swiglu_limit) {
  gg::SwigluShape s;
  JK_FFI_RETURN_IF_ERROR(gg::swiglu_shape(x.dimensions(), row_tokens.element_count(), w_gate.dimensions(),
                                          w_up.dimensions(), act->dimensions(), gate_out->dimensions(),
                                          offsets.element_count(), sizes.element_count(),
                                          tile_counter->element_count(), &s));
  JK_FFI_RETURN_IF_ERROR(check_rows(s.rows));
  const OperandRows lhs_row(x, row_tokens);
  SwigluClamp clamp{swiglu_limit};
  uint16_t* outputs[3] = {act->typed_data(), s.save_preactivations ? gate_out->typed_data() : nullptr,
                          s.save_preactivations ? up_out->typed_data() : nullptr};
  for (uint16_t* o : outputs) {
    if (o != nullptr) std::fill_n(o, s.rows * s.inner, kBf16Nan);
  }
  std::vector<float> gate(gg::kSwigluTileCols), up(gg::kSwigluTileCols);
  JK_FFI_RETURN_IF_ERROR(for_each_tile_row<gg::kSwigluTileCols>(
      layout_of(offsets, sizes, s.groups, s.rows), static_cast<int32_t>(s.inner),
      [&](int64_t r, int32_t g, int32_t n0, int32_t n1, int32_t) {
        const uint16_t* row = lhs_row(r);
        row_product(row, {w_gate.typed_data() + g * s.hidden * s.inner, s.hidden, s.inner, false}, n0, n1,
                    gate.data());
        row_product(row, {w_up.typed_data() + g * s.hidden * s.inner, s.hidden, s.inner, false}, n0, n1,
                    up.data());
        for (int32_t c = n0; c < n1; ++c) {
          int64_t i = r * s.inner + c;
          outputs[0][i] = float_to_bf16_bits(gg::swiglu(gate[c - n0], up[c - n0], clamp));
          if (s.save_preactivations) {
            outputs[1][i] = float_to_bf16_bits(gate[c - n0]);
            outputs[2][i] = float_to_bf16_bits(up[c - n0]);
          }
        }
      },
      [&](int64_t r, int32_t n0, int32_t n1, int32_t) {
        for (uint16_t* o : outputs) {
          if (o != nullptr) std::fill(o + r * s.inner + n0, o + r * s.inner + n1, uint16_t{0});
        }
      }));
  return ffi::Error::Success();
}

ffi::Error GmmSwigluDgradCpu(ffi::Buffer<ffi::BF16> dy, ffi::Buffer<ffi::S32> row_tokens,
                             ffi::Buffer<ffi::BF16> w_down, ffi::Buffer<ffi::BF16> gate, ffi::Buffer<ffi::BF16> up,
                             ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::S32> offsets,
                             ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::BF16> d_gate,
                             ffi::ResultBuffer<ffi::BF16> d_up, ffi::ResultBuffer<ffi::F32> d_row_weights,
                             ffi::ResultBuffer<ffi::BF16> weighted_act,
                             ffi::ResultBuffer<ffi::F32> row_weight_partials, ffi::ResultBuffer<ffi::S32> tile_counter,
                             float swiglu_limit) {
  gg::DgradShape s;
  JK_FFI_RETURN_IF_ERROR(gg::dgrad_shape(dy.dimensions(), row_tokens.element_count(), w_down.dimensions(),
                                         gate.dimensions(), up.dimensions(), row_weights.element_count(),
                                         weighted_act->dimensions(), row_weight_partials->dimensions(),
                                         offsets.element_count(), sizes.element_count(),
                                         tile_counter->element_count(), &s));
  JK_FFI_RETURN_IF_ERROR(check_rows(s.rows));
  const OperandRows dy_row(dy, row_tokens);
  SwigluClamp clamp{swiglu_limit};
  uint16_t* outputs[3] = {d_gate->typed_data(), d_up->typed_data(),
                          s.save_weighted_act ? weighted_act->typed_data() : nullptr};
  for (uint16_t* o : outputs) {
    if (o != nullptr) std::fill_n(o, s.rows * s.inner, kBf16Nan);
  }
  // Per-(n block, row) partials summed in block order afterwards: the kernels' deterministic reduction.
  const int64_t n_blocks = gg::ceil_div(s.inner, gg::kTileCols);
  float* partials = row_weight_partials->typed_data();
  poison(partials, ffi::F32, row_weight_partials->element_count());
  std::vector<float> g(gg::kTileCols);
  JK_FFI_RETURN_IF_ERROR(for_each_tile_row<gg::kTileCols>(
      layout_of(offsets, sizes, s.groups, s.rows), static_cast<int32_t>(s.inner),
      [&](int64_t r, int32_t grp, int32_t n0, int32_t n1, int32_t n_block) {
        // w_down[grp] is [I, H]: as the [K = H, N = I] operand it is transposed.
        row_product(dy_row(r), {w_down.typed_data() + grp * s.inner * s.hidden, s.hidden, s.inner, true}, n0, n1,
                    g.data());
        float weight = row_weights.typed_data()[r];
        float partial = 0.0f;
        for (int32_t c = n0; c < n1; ++c) {
          int64_t i = r * s.inner + c;
          float gate_i = bf16_bits_to_float(gate.typed_data()[i]);
          float up_i = bf16_bits_to_float(up.typed_data()[i]);
          float dg, du;
          float act = round_to_bf16(gg::swiglu_backward(gate_i, up_i, weight * g[c - n0], clamp, &dg, &du));
          partial += g[c - n0] * act;
          outputs[0][i] = float_to_bf16_bits(dg);
          outputs[1][i] = float_to_bf16_bits(du);
          if (s.save_weighted_act) outputs[2][i] = float_to_bf16_bits(weight * act);
        }
        partials[n_block * s.rows + r] = partial;
      },
      [&](int64_t r, int32_t n0, int32_t n1, int32_t n_block) {
        for (uint16_t* o : outputs) {
          if (o != nullptr) std::fill(o + r * s.inner + n0, o + r * s.inner + n1, uint16_t{0});
        }
        partials[n_block * s.rows + r] = 0.0f;
      }));
  for (int64_t r = 0; r < s.rows; ++r) {
    float sum = 0.0f;
    for (int64_t b = 0; b < n_blocks; ++b) sum += partials[b * s.rows + r];
    d_row_weights->typed_data()[r] = sum;
  }
  return ffi::Error::Success();
}

ffi::Error TgmmCpu(ffi::Buffer<ffi::BF16> lhs, ffi::Buffer<ffi::S32> lhs_row_tokens, ffi::Buffer<ffi::BF16> rhs,
                   ffi::Buffer<ffi::S32> rhs_row_tokens, ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> sizes,
                   ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::S32> tile_counter) {
  gg::TgmmShape s;
  JK_FFI_RETURN_IF_ERROR(gg::tgmm_shape(lhs.dimensions(), lhs_row_tokens.element_count(), rhs.dimensions(),
                                        rhs_row_tokens.element_count(), out->dimensions(), offsets.element_count(),
                                        sizes.element_count(), tile_counter->element_count(), &s));
  JK_FFI_RETURN_IF_ERROR(check_rows(s.rows));
  ffi::DataType type = out->element_type();
  JK_FFI_CHECK(type == ffi::F32 || type == ffi::BF16, "jk_tgmm: out must be bf16 or f32");
  void* o = out->untyped_data();
  poison(o, type, out->element_count());
  const OperandRows lhs_row(lhs, lhs_row_tokens), rhs_row(rhs, rhs_row_tokens);
  GroupLayout layout = layout_of(offsets, sizes, s.groups, s.rows);
  constexpr int kM = gg::kTileRows, kN = gg::kTileCols;
  std::vector<float> acc(kM * kN);
  gg::ContractionTile tile;
  ClusterPairCheck check_pair(gg::ceil_div(s.n, kN));
  for (int32_t t = 0;
       gg::contraction_tile<kM, kN>(layout, static_cast<int32_t>(s.k), static_cast<int32_t>(s.n), t, &tile); ++t) {
    JK_FFI_RETURN_IF_ERROR(check_pair(t, tile.group, tile.m0, tile.n0 / kN));
    int32_t m1 = std::min<int32_t>(tile.m0 + kM, s.k), n1 = std::min<int32_t>(tile.n0 + kN, s.n);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t r = tile.row0; r < tile.row0 + tile.valid; ++r) {
      const uint16_t* a = lhs_row(r);
      const uint16_t* b = rhs_row(r);
      for (int32_t m = tile.m0; m < m1; ++m) {
        float a_m = bf16_bits_to_float(a[m]);
        float* acc_row = acc.data() + (m - tile.m0) * kN;
        for (int32_t c = tile.n0; c < n1; ++c) acc_row[c - tile.n0] += a_m * bf16_bits_to_float(b[c]);
      }
    }
    for (int32_t m = tile.m0; m < m1; ++m) {
      for (int32_t c = tile.n0; c < n1; ++c) {
        store(o, type, (static_cast<int64_t>(tile.group) * s.k + m) * s.n + c, acc[(m - tile.m0) * kN + c - tile.n0]);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GmmCpuHandler, GmmCpu,
                              gmm_signature(ffi::Ffi::Bind()));
JK_REGISTER_FFI("jk_gmm", "cpu", GmmCpuHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GmmSwigluCpuHandler, GmmSwigluCpu,
                              gmm_swiglu_signature(ffi::Ffi::Bind()));
JK_REGISTER_FFI("jk_gmm_swiglu", "cpu", GmmSwigluCpuHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GmmSwigluDgradCpuHandler, GmmSwigluDgradCpu,
                              gmm_swiglu_dgrad_signature(ffi::Ffi::Bind()));
JK_REGISTER_FFI("jk_gmm_swiglu_dgrad", "cpu", GmmSwigluDgradCpuHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(TgmmCpuHandler, TgmmCpu,
                              tgmm_signature(ffi::Ffi::Bind()));
JK_REGISTER_FFI("jk_tgmm", "cpu", TgmmCpuHandler);

}  // namespace jk
