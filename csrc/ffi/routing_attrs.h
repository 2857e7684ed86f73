// Shape checks of the routing targets, shared by the CPU and CUDA bindings. Python validates first and raises
// readable errors at trace time; these checks guard the buffers against a caller that bypassed it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include "ffi/ffi_util.h"
#include "kernels/routing.h"

namespace jk {

struct RouteShape {
  int64_t tokens;
  int32_t num_experts;
  int64_t tokens_per_bias_row;  // bias is [bias_rows, E] (a vmapped bias has a row per batch element): token t
                                // uses row t / tokens_per_bias_row
};

inline ffi::Error route_shape(const ffi::AnyBuffer& logits, const ffi::Buffer<ffi::F32>& bias, int32_t top_k,
                              int32_t num_groups, int32_t top_groups, RouteShape* shape) {
  auto dims = logits.dimensions();
  JK_FFI_CHECK(dims.size() >= 1, "jk_route: logits must have rank >= 1");
  JK_FFI_CHECK(logits.element_type() == ffi::F32 || logits.element_type() == ffi::BF16,
               "jk_route: logits must be float32 or bfloat16");
  shape->num_experts = static_cast<int32_t>(dims.back());
  shape->tokens = leading_rows(dims);
  JK_FFI_CHECK(top_k >= 1 && top_k <= shape->num_experts, "jk_route: need 1 <= top_k <= num_experts");
  JK_FFI_CHECK(num_groups >= 1 && num_groups <= 64 && shape->num_experts % num_groups == 0,
               "jk_route: num_groups must divide num_experts and be <= 64");
  JK_FFI_CHECK(top_groups >= 1 && top_groups <= num_groups, "jk_route: need 1 <= top_groups <= num_groups");
  int64_t bias_rows = static_cast<int64_t>(bias.element_count()) / shape->num_experts;
  JK_FFI_CHECK(bias_rows >= 1 && bias_rows * shape->num_experts == static_cast<int64_t>(bias.element_count()) &&
                   shape->tokens % bias_rows == 0,
               "jk_route: bias must be [E] or [batch..., E] matching the leading dims of logits");
  shape->tokens_per_bias_row = std::max<int64_t>(1, shape->tokens / bias_rows);
  return ffi::Error::Success();
}

inline ffi::Error check_schedule_shapes(const ffi::Buffer<ffi::S32>& ids, size_t tokens_per_expert_size,
                                        size_t expert_offsets_size, size_t chunk_counts_size, int32_t num_experts,
                                        int32_t align) {
  JK_FFI_CHECK(num_experts >= 1, "jk_schedule: num_experts must be >= 1");
  JK_FFI_CHECK(align >= 1, "jk_schedule: align must be >= 1");
  JK_FFI_CHECK(static_cast<int64_t>(tokens_per_expert_size) == num_experts,
               "jk_schedule: tokens_per_expert must have num_experts elements");
  JK_FFI_CHECK(static_cast<int64_t>(expert_offsets_size) == num_experts + 1,
               "jk_schedule: expert_offsets must have num_experts + 1 elements");
  JK_FFI_CHECK(ids.element_count() < (size_t(1) << 31) / 2, "jk_schedule: too many (token, slot) entries");
  JK_FFI_CHECK(static_cast<int64_t>(chunk_counts_size) ==
                   routing::schedule_chunks(static_cast<int64_t>(ids.element_count())) * num_experts,
               "jk_schedule: chunk_counts must have ceil(entries / 256) * num_experts elements");
  return ffi::Error::Success();
}

}  // namespace jk

namespace jk {

// The operands, results and attributes of each target, shared by its CPU and CUDA bindings (which put their
// platform context first).

template <typename Binding>
auto route_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Attr<int32_t>("top_k")
      .template Attr<int32_t>("score")
      .template Attr<bool>("renormalize")
      .template Attr<int32_t>("num_groups")
      .template Attr<int32_t>("top_groups")
      .template Attr<bool>("has_bias");
}

template <typename Binding>
auto schedule_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()  // chunk_counts: the CUDA kernels' workspace (kernels/routing.h)
      .template Attr<int32_t>("num_experts")
      .template Attr<int32_t>("align");
}

}  // namespace jk
