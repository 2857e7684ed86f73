// CUDA bindings of jk_route and jk_schedule; the kernels are kernels/routing.cuh.
#include <cstdint>

#include "ffi/ffi_util.h"
#include "ffi/registry.h"
#include "ffi/routing_attrs.h"
#include "kernels/routing.cuh"

namespace jk {
namespace {

ffi::Error RouteCuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> bias,
                     ffi::ResultBuffer<ffi::F32> weights, ffi::ResultBuffer<ffi::S32> ids, int32_t top_k,
                     int32_t score, bool renormalize, int32_t num_groups, int32_t top_groups, bool has_bias) {
  RouteShape shape;
  JK_FFI_RETURN_IF_ERROR(route_shape(logits, bias, top_k, num_groups, top_groups, &shape));
  routing::RouteParams p{shape.num_experts, top_k, score, renormalize, num_groups, top_groups, has_bias};
  JK_FFI_RETURN_IF_ERROR(poison_results(stream, *weights, *ids));
  if (logits.element_type() == ffi::F32) {
    JK_CUDA_CHECK(routing::launch_route(stream, static_cast<const float*>(logits.untyped_data()), bias.typed_data(),
                                        shape.tokens_per_bias_row, p, shape.tokens, weights->typed_data(),
                                        ids->typed_data()));
  } else {
    JK_CUDA_CHECK(routing::launch_route(stream, static_cast<const uint16_t*>(logits.untyped_data()),
                                        bias.typed_data(), shape.tokens_per_bias_row, p, shape.tokens,
                                        weights->typed_data(), ids->typed_data()));
  }
  return ffi::Error::Success();
}

ffi::Error ScheduleCuda(cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                        ffi::ResultBuffer<ffi::S32> expert_offsets, ffi::ResultBuffer<ffi::S32> rows,
                        ffi::ResultBuffer<ffi::S32> chunk_counts, int32_t num_experts, int32_t align) {
  JK_FFI_RETURN_IF_ERROR(check_schedule_shapes(ids, tokens_per_expert->element_count(), expert_offsets->element_count(),
                                               chunk_counts->element_count(), num_experts, align));
  JK_FFI_RETURN_IF_ERROR(poison_results(stream, *tokens_per_expert, *expert_offsets, *rows, *chunk_counts));
  int64_t entries = static_cast<int64_t>(ids.element_count());
  routing::ScheduleGlobals g{ids.typed_data(), entries, num_experts, align, chunk_counts->typed_data(),
                             tokens_per_expert->typed_data(), expert_offsets->typed_data(), rows->typed_data()};
  JK_CUDA_CHECK(routing::launch_schedule(stream, g));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RouteCudaHandler, RouteCuda,
                              route_signature(ffi::Ffi::Bind()
                                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JK_REGISTER_FFI("jk_route", "CUDA", RouteCudaHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScheduleCudaHandler, ScheduleCuda,
                              schedule_signature(ffi::Ffi::Bind()
                                                     .Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JK_REGISTER_FFI("jk_schedule", "CUDA", ScheduleCudaHandler);

}  // namespace jk
