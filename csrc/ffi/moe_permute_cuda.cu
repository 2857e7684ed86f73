// CUDA bindings of jk_moe_gather and jk_moe_combine; the kernels are kernels/moe_permute.cuh.
#include <cstdint>

#include "ffi/ffi_util.h"
#include "ffi/moe_permute_shapes.h"
#include "ffi/registry.h"
#include "kernels/moe_permute.cuh"

namespace jk {
namespace {

namespace mp = moe_permute;

ffi::Error GatherCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> weights,
                      ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> counts,
                      ffi::Result<ffi::AnyBuffer> x_rows, ffi::ResultBuffer<ffi::F32> row_weights) {
  mp::GatherShape s;
  JK_FFI_RETURN_IF_ERROR(mp::gather_shape(x, rows.dimensions(), weights.element_count(), offsets.element_count(),
                                          counts.element_count(), *x_rows, row_weights->element_count(), &s));
  JK_FFI_RETURN_IF_ERROR(poison_results(stream, *x_rows, *row_weights));
  mp::GatherGlobals g{};
  g.x = x.untyped_data();
  g.rows = rows.typed_data();
  g.weights = s.with_row_weights ? weights.typed_data() : nullptr;
  g.layout = {offsets.typed_data(), counts.typed_data(), static_cast<int32_t>(s.experts), s.rows};
  g.x_rows = x_rows->untyped_data();
  g.row_weights = s.with_row_weights ? row_weights->typed_data() : nullptr;
  g.tokens = s.tokens;
  g.top_k = static_cast<int32_t>(s.top_k);
  JK_CUDA_CHECK(mp::launch_gather(stream, g, static_cast<int64_t>(ffi::ByteWidth(x.element_type())) * s.hidden));
  return ffi::Error::Success();
}

template <typename T>
ffi::Error combine_typed(cudaStream_t stream, const mp::CombineShape& s, ffi::AnyBuffer values,
                         ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer addend,
                         ffi::AnyBuffer y) {
  mp::CombineGlobals<T> g{};
  g.values = static_cast<const T*>(values.untyped_data());
  g.num_rows = s.rows;
  g.rows = rows.typed_data();
  g.weights = s.with_weights ? weights.typed_data() : nullptr;
  g.addend = s.with_addend ? static_cast<const T*>(addend.untyped_data()) : nullptr;
  g.y = static_cast<T*>(y.untyped_data());
  g.tokens = s.tokens;
  g.hidden = s.hidden;
  g.top_k = static_cast<int32_t>(s.top_k);
  JK_CUDA_CHECK(mp::launch_combine(stream, g));
  return ffi::Error::Success();
}

ffi::Error CombineCuda(cudaStream_t stream, ffi::AnyBuffer values, ffi::Buffer<ffi::S32> rows,
                       ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer addend, ffi::Result<ffi::AnyBuffer> y) {
  mp::CombineShape s;
  JK_FFI_RETURN_IF_ERROR(mp::combine_shape(values, rows.dimensions(), weights.element_count(), addend, *y, &s));
  JK_FFI_RETURN_IF_ERROR(poison_results(stream, *y));
  if (values.element_type() == ffi::F32) {
    return combine_typed<float>(stream, s, values, rows, weights, addend, *y);
  }
  JK_FFI_CHECK(values.element_type() == ffi::BF16, "jk_moe_combine: values must be bf16 or f32");
  return combine_typed<uint16_t>(stream, s, values, rows, weights, addend, *y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGatherCudaHandler, GatherCuda,
                              moe_gather_signature(ffi::Ffi::Bind()
                                                       .Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JK_REGISTER_FFI("jk_moe_gather", "CUDA", MoeGatherCudaHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeCombineCudaHandler, CombineCuda,
                              moe_combine_signature(ffi::Ffi::Bind()
                                                        .Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JK_REGISTER_FFI("jk_moe_combine", "CUDA", MoeCombineCudaHandler);

}  // namespace jk
