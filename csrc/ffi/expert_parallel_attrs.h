// Checks shared by the CPU and CUDA bindings of the expert-parallel targets: heap lookup and shapes.
#pragma once

#include <cstdint>
#include <utility>
#include <string>

#include "ffi/ffi_util.h"
#include "ffi/symmetric_heap.h"
#include "kernels/expert_parallel.h"

namespace jk {

// The heap a call names, checked against the layout it was traced for.
inline ffi::Error lookup_heap(int64_t heap_id, int32_t num_ranks, SymmetricHeap** out) {
  SymmetricHeap* heap = find_heap(heap_id);
  if (heap == nullptr) {
    return invalid_argument("expert-parallel call names heap " + std::to_string(heap_id) +
                            ", which does not exist (closed, or created in another process)");
  }
  if (heap->num_ranks != num_ranks) {
    return invalid_argument("heap " + std::to_string(heap_id) + " has " + std::to_string(heap->num_ranks) +
                            " ranks, the call expects " + std::to_string(num_ranks));
  }
  std::string failure = heap->error_message();
  if (!failure.empty()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, failure);
  *out = heap;
  return ffi::Error::Success();
}

// Bytes of one row of a [rows, ...] buffer.
inline int64_t row_bytes_of(ffi::AnyBuffer buffer) {
  auto dims = buffer.dimensions();
  int64_t rows = dims.size() == 0 ? 1 : dims[0];
  return rows == 0 ? 0 : static_cast<int64_t>(buffer.size_bytes()) / rows;
}

inline int64_t rows_of(ffi::AnyBuffer buffer) {
  auto dims = buffer.dimensions();
  return dims.size() == 0 ? 1 : dims[0];
}

// Shapes both transports check in both twins. `op` and `area` name the target and the heap area in the messages;
// `positions` rows of `row_bytes` must fit that area, and `other_row_bytes` (the other buffer's rows) must match.
inline ffi::Error check_transport_shapes(const std::string& op, const char* area, int64_t positions,
                                         int64_t row_bytes, int64_t other_row_bytes, int64_t region_bytes,
                                         size_t block_entries, int32_t num_ranks, int32_t experts_per_rank) {
  JK_FFI_CHECK(other_row_bytes == row_bytes, op + ": the rows in and out differ in size");
  JK_FFI_CHECK(positions * row_bytes <= heap::data_area_bytes(region_bytes),
               op + ": the rows do not fit the heap's " + area + " area");
  const int64_t expected_entries = static_cast<int64_t>(num_ranks) * experts_per_rank * ep::kBlockFields;
  JK_FFI_CHECK(static_cast<int64_t>(block_entries) == expected_entries,
               op + ": blocks must be [num_ranks * experts_per_rank, 3]");
  return ffi::Error::Success();
}

// Every block must stay inside the receive buffer and the source's positions: the table comes from jk_ep_plan, but a
// handler never trusts an operand with its memory.
inline ffi::Error check_blocks(const ep::Block* blocks, const ep::Layout& layout, int64_t recv_rows,
                               int64_t positions) {
  for (int32_t b = 0; b < layout.num_ranks * layout.experts_per_rank; ++b) {
    const ep::Block& block = blocks[b];
    if (block.kept < 0 || block.recv_offset < 0 || block.source_position < 0 ||
        block.recv_offset + static_cast<int64_t>(block.kept) > recv_rows ||
        block.source_position + static_cast<int64_t>(block.kept) > positions) {
      return invalid_argument("expert-parallel receive block " + std::to_string(b) + " is out of bounds");
    }
  }
  return ffi::Error::Success();
}

inline ffi::Error check_layout(const ep::Layout& layout, int64_t num_experts_operand) {
  JK_FFI_CHECK(layout.num_ranks >= 1 && layout.num_ranks <= heap::kMaxRanks, "num_ranks out of range");
  JK_FFI_CHECK(layout.experts_per_rank >= 1, "experts_per_rank must be positive");
  JK_FFI_CHECK(layout.num_experts() <= heap::kMaxExperts, "too many experts for the heap's count area");
  JK_FFI_CHECK(num_experts_operand == layout.num_experts(), "counts must have num_ranks * experts_per_rank entries");
  JK_FFI_CHECK(layout.capacity >= 0, "capacity must be non-negative");
  return ffi::Error::Success();
}

}  // namespace jk

namespace jk {

// The operands, results and attributes of each target, shared by its CPU and CUDA bindings (which put their
// platform context first).

template <typename Binding>
auto ep_plan_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Attr<int64_t>("heap_id")
      .template Attr<int32_t>("num_ranks")
      .template Attr<int32_t>("experts_per_rank")
      .template Attr<int32_t>("capacity");
}

template <typename Binding>
auto ep_to_experts_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::AnyBuffer>()  // after: an ordering edge only
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("heap_id")
      .template Attr<int32_t>("num_ranks")
      .template Attr<int32_t>("experts_per_rank")
      .template Attr<int32_t>("chunk_rows");
}

template <typename Binding>
auto ep_from_experts_signature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::AnyBuffer>()  // after: an ordering edge only
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("heap_id")
      .template Attr<int32_t>("num_ranks")
      .template Attr<int32_t>("experts_per_rank");
}

}  // namespace jk
