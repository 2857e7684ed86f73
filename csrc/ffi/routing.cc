// CPU twin of the routing targets: jk_route (scores + group-limited top-k) and jk_schedule (expert-major rows).
// The per-token math is kernels/routing.h, shared with routing_cuda.cu.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ffi/ffi_util.h"
#include "ffi/registry.h"
#include "ffi/routing_attrs.h"
#include "kernels/routing.h"

namespace jk {
namespace {

template <typename Logit>
void route_rows(const Logit* logits, const float* bias, int64_t tokens_per_bias_row, const routing::RouteParams& p,
                int64_t tokens, float* weights, int32_t* ids) {
  for (int64_t t = 0; t < tokens; ++t) {
    routing::route_token(logits + t * p.num_experts, bias + t / tokens_per_bias_row * p.num_experts, p, weights + t * p.top_k,
                         ids + t * p.top_k);
  }
}

ffi::Error RouteCpu(ffi::AnyBuffer logits, ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> weights,
                    ffi::ResultBuffer<ffi::S32> ids, int32_t top_k, int32_t score, bool renormalize,
                    int32_t num_groups, int32_t top_groups, bool has_bias) {
  RouteShape shape;
  JK_FFI_RETURN_IF_ERROR(route_shape(logits, bias, top_k, num_groups, top_groups, &shape));
  routing::RouteParams p{shape.num_experts, top_k, score, renormalize, num_groups, top_groups, has_bias};
  if (logits.element_type() == ffi::F32) {
    route_rows(static_cast<const float*>(logits.untyped_data()), bias.typed_data(), shape.tokens_per_bias_row, p,
               shape.tokens, weights->typed_data(), ids->typed_data());
  } else {
    route_rows(static_cast<const uint16_t*>(logits.untyped_data()), bias.typed_data(), shape.tokens_per_bias_row, p,
               shape.tokens, weights->typed_data(), ids->typed_data());
  }
  return ffi::Error::Success();
}

// Counting then placing in (token, slot) order gives each expert's rows in that order: the same rows the CUDA
// version derives per chunk.
ffi::Error ScheduleCpu(ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                       ffi::ResultBuffer<ffi::S32> expert_offsets, ffi::ResultBuffer<ffi::S32> rows,
                       ffi::ResultBuffer<ffi::S32> chunk_counts, int32_t num_experts, int32_t align) {
  JK_FFI_RETURN_IF_ERROR(check_schedule_shapes(ids, tokens_per_expert->element_count(), expert_offsets->element_count(),
                                               chunk_counts->element_count(), num_experts, align));
  const int32_t* id = ids.typed_data();
  int64_t entries = static_cast<int64_t>(ids.element_count());
  int32_t* counts = tokens_per_expert->typed_data();
  int32_t* offsets = expert_offsets->typed_data();
  std::fill(counts, counts + num_experts, 0);
  for (int64_t i = 0; i < entries; ++i) {
    if (id[i] >= 0 && id[i] < num_experts) ++counts[id[i]];
  }
  offsets[0] = 0;
  for (int32_t e = 0; e < num_experts; ++e) offsets[e + 1] = offsets[e] + routing::align_up(counts[e], align);
  std::vector<int32_t> next(offsets, offsets + num_experts);
  int32_t* row = rows->typed_data();
  for (int64_t i = 0; i < entries; ++i) row[i] = (id[i] >= 0 && id[i] < num_experts) ? next[id[i]]++ : -1;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RouteCpuHandler, RouteCpu,
                              route_signature(ffi::Ffi::Bind()));
JK_REGISTER_FFI("jk_route", "cpu", RouteCpuHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScheduleCpuHandler, ScheduleCpu,
                              schedule_signature(ffi::Ffi::Bind()));
JK_REGISTER_FFI("jk_schedule", "cpu", ScheduleCpuHandler);

}  // namespace jk
