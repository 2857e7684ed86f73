// CPU twin of the MoE permute targets: jk_moe_gather (tokens -> expert-major rows) and jk_moe_combine (weighted sum
// of rows back to tokens). The per-row and per-element math is kernels/moe_permute.h, shared with the CUDA kernels.
// Outputs are filled with NaN first, so an element the loops miss fails the tests.
#include <cstdint>
#include <cstring>

#include "ffi/ffi_util.h"
#include "ffi/moe_permute_shapes.h"
#include "ffi/registry.h"
#include "kernels/moe_permute.h"

namespace jk {
namespace {

namespace mp = moe_permute;

// All-ones bytes are a NaN in bf16, f16 and f32.
void poison(void* data, size_t bytes) { std::memset(data, 0xFF, bytes); }

ffi::Error GatherCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> weights,
                     ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> counts, ffi::Result<ffi::AnyBuffer> x_rows,
                     ffi::ResultBuffer<ffi::F32> row_weights) {
  mp::GatherShape s;
  JK_FFI_RETURN_IF_ERROR(mp::gather_shape(x, rows.dimensions(), weights.element_count(), offsets.element_count(),
                                          counts.element_count(), *x_rows, row_weights->element_count(), &s));
  const size_t row_bytes = ffi::ByteWidth(x.element_type()) * static_cast<size_t>(s.hidden);
  auto* out = static_cast<uint8_t*>(x_rows->untyped_data());
  const auto* in = static_cast<const uint8_t*>(x.untyped_data());
  poison(out, x_rows->size_bytes());
  if (s.with_row_weights) poison(row_weights->typed_data(), row_weights->size_bytes());
  mp::RowLayout layout{offsets.typed_data(), counts.typed_data(), static_cast<int32_t>(s.experts), s.rows};
  for (int64_t r = 0; r < s.rows; ++r) {
    if (!mp::is_padding_row(layout, r)) continue;
    std::memset(out + r * row_bytes, 0, row_bytes);
    if (s.with_row_weights) row_weights->typed_data()[r] = 0.0f;
  }
  const int32_t* row = rows.typed_data();
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t j = 0; j < s.top_k; ++j) {
      int32_t r = row[t * s.top_k + j];
      if (!mp::placed(r, s.rows)) continue;
      std::memcpy(out + r * row_bytes, in + t * row_bytes, row_bytes);
      if (s.with_row_weights) row_weights->typed_data()[r] = weights.typed_data()[t * s.top_k + j];
    }
  }
  return ffi::Error::Success();
}

template <typename T>
void combine_rows(const mp::CombineShape& s, const T* values, const int32_t* rows, const float* weights,
                  const T* addend, T* y) {
  for (int64_t t = 0; t < s.tokens; ++t) {
    const int32_t* token_rows = rows + t * s.top_k;
    const float* token_weights = s.with_weights ? weights + t * s.top_k : nullptr;
    const T* token_addend = s.with_addend ? addend + t * s.hidden : nullptr;
    for (int64_t c = 0; c < s.hidden; ++c) {
      y[t * s.hidden + c] = mp::combine_element(values, s.rows, s.hidden, token_rows, token_weights,
                                                static_cast<int32_t>(s.top_k), token_addend, c);
    }
  }
}

ffi::Error CombineCpu(ffi::AnyBuffer values, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> weights,
                      ffi::AnyBuffer addend, ffi::Result<ffi::AnyBuffer> y) {
  mp::CombineShape s;
  JK_FFI_RETURN_IF_ERROR(mp::combine_shape(values, rows.dimensions(), weights.element_count(), addend, *y, &s));
  poison(y->untyped_data(), y->size_bytes());
  if (values.element_type() == ffi::F32) {
    combine_rows(s, static_cast<const float*>(values.untyped_data()), rows.typed_data(), weights.typed_data(),
                 static_cast<const float*>(addend.untyped_data()), static_cast<float*>(y->untyped_data()));
  } else if (values.element_type() == ffi::BF16) {
    combine_rows(s, static_cast<const uint16_t*>(values.untyped_data()), rows.typed_data(), weights.typed_data(),
                 static_cast<const uint16_t*>(addend.untyped_data()), static_cast<uint16_t*>(y->untyped_data()));
  } else {
    return invalid_argument("jk_moe_combine: values must be bf16 or f32");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGatherCpuHandler, GatherCpu,
                              moe_gather_signature(ffi::Ffi::Bind()));
JK_REGISTER_FFI("jk_moe_gather", "cpu", MoeGatherCpuHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeCombineCpuHandler, CombineCpu,
                              moe_combine_signature(ffi::Ffi::Bind()));
JK_REGISTER_FFI("jk_moe_combine", "cpu", MoeCombineCpuHandler);

}  // namespace jk
