// CUDA bindings of jk_ep_plan, jk_ep_to_experts and jk_ep_from_experts; kernels in kernels/expert_parallel.cuh.
//
// The heap member is found by the device the call runs on (ffi::DeviceOrdinal); the rank is the axis index operand,
// read by the kernels on the device (no host sync), which check it against the member. Each call takes the next
// epoch of its channel from a host counter, so these handlers must run once per execution: they are not marked
// command-buffer compatible (a CUDA graph would replay a stale epoch).
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <mutex>

#include "ffi/expert_parallel_attrs.h"
#include "ffi/ffi_util.h"
#include "ffi/registry.h"
#include "ffi/symmetric_heap.h"
#include "kernels/expert_parallel.cuh"

namespace jk {
namespace {

int sm_count(int32_t device_ordinal) {
  static std::array<int, 256> counts{};
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  int& count = counts[device_ordinal & 255];
  if (count == 0 && cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device_ordinal) != cudaSuccess) {
    count = 1;
  }
  return count;
}

ffi::Error heap_view(int64_t heap_id, int32_t num_ranks, int32_t experts_per_rank, int32_t device_ordinal,
                     const int32_t* rank, int32_t channel, ep::HeapView* view) {
  SymmetricHeap* heap = nullptr;
  JK_FFI_RETURN_IF_ERROR(lookup_heap(heap_id, num_ranks, &heap));
  JK_FFI_CHECK(heap->backend != HeapBackend::kCpu, "a CUDA expert-parallel call needs a GPU heap");
  HeapMember* member = heap->member_for_device(device_ordinal);
  JK_FFI_CHECK(member != nullptr, "the heap has no member on GPU " + std::to_string(device_ordinal));
  *view = ep::HeapView{member->peer_bases, member->base, rank, heap->error_device, num_ranks, experts_per_rank,
                       heap->skip_signal_rank.load(), heap->region_bytes, heap->timeout_ns,
                       member->epochs[channel].fetch_add(1) + 1};
  return ffi::Error::Success();
}

// Launch grid of a transport: enough blocks for the work, never more than the SMs (all blocks must be resident).
int transport_grid(int32_t device_ordinal, int64_t work_items) {
  int64_t grid = work_items < 1 ? 1 : work_items;
  return static_cast<int>(grid < sm_count(device_ordinal) ? grid : sm_count(device_ordinal));
}

ffi::Error PlanCuda(cudaStream_t stream, int32_t device_ordinal, ffi::ScratchAllocator scratch,
                    ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::S32> blocks,
                    ffi::ResultBuffer<ffi::S32> send_kept, ffi::ResultBuffer<ffi::S32> group_sizes,
                    ffi::ResultBuffer<ffi::S32> dropped, int64_t heap_id, int32_t num_ranks, int32_t experts_per_rank,
                    int32_t capacity) {
  ep::Layout layout{num_ranks, experts_per_rank, capacity};
  JK_FFI_RETURN_IF_ERROR(check_layout(layout, counts.element_count()));
  auto all_counts = scratch.Allocate(static_cast<size_t>(num_ranks) * layout.num_experts() * sizeof(int32_t));
  JK_FFI_CHECK(all_counts.has_value(), "jk_ep_plan: scratch allocation failed");
  ep::HeapView view;
  JK_FFI_RETURN_IF_ERROR(heap_view(heap_id, num_ranks, experts_per_rank, device_ordinal, rank.typed_data(),
                                   heap::kPlanChannel, &view));
  ep::plan_kernel<<<1, ep::kPlanThreads, 0, stream>>>(
      view, capacity, counts.typed_data(), static_cast<int32_t*>(*all_counts),
      reinterpret_cast<ep::Block*>(blocks->typed_data()), send_kept->typed_data(), group_sizes->typed_data(),
      dropped->typed_data());
  JK_CUDA_CHECK(cudaGetLastError());
  return ffi::Error::Success();
}

ffi::Error ToExpertsCuda(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> rank,
                         ffi::AnyBuffer packed, ffi::Buffer<ffi::S32> blocks, ffi::AnyBuffer /*after*/,
                         ffi::Result<ffi::AnyBuffer> recv, int64_t heap_id, int32_t num_ranks,
                         int32_t experts_per_rank, int32_t chunk_rows) {
  const int64_t positions = rows_of(packed), row_bytes = row_bytes_of(packed), capacity = rows_of(*recv);
  JK_FFI_CHECK(row_bytes % 4 == 0, "to_experts: rows must be a multiple of 4 bytes");
  JK_FFI_CHECK(chunk_rows > 0 && (positions + chunk_rows - 1) / chunk_rows <= heap::kMaxChunks,
               "to_experts: chunk_rows gives too many chunks");
  ep::HeapView view;
  JK_FFI_RETURN_IF_ERROR(heap_view(heap_id, num_ranks, experts_per_rank, device_ordinal, rank.typed_data(),
                                   heap::kToExpertsChannel, &view));
  JK_FFI_RETURN_IF_ERROR(check_transport_shapes("to_experts", "send", positions, row_bytes, row_bytes_of(*recv),
                                                view.region_bytes, blocks.element_count(), num_ranks,
                                                experts_per_rank));
  // The block table lives on the device: the kernel skips any entry outside [0, capacity) and [0, positions).
  const int64_t pieces = (capacity + ep::kPieceRows - 1) / ep::kPieceRows + num_ranks * experts_per_rank;
  const int grid = transport_grid(device_ordinal, pieces > positions / chunk_rows + 1 ? pieces : positions / chunk_rows + 1);
  ep::to_experts_kernel<<<grid, ep::kTransportThreads, 0, stream>>>(
      view, static_cast<const char*>(packed.untyped_data()), positions, row_bytes, chunk_rows,
      reinterpret_cast<const ep::Block*>(blocks.typed_data()), static_cast<char*>(recv->untyped_data()), capacity);
  JK_CUDA_CHECK(cudaGetLastError());
  return ffi::Error::Success();
}

ffi::Error FromExpertsCuda(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::S32> rank,
                           ffi::AnyBuffer expert_rows, ffi::Buffer<ffi::S32> blocks, ffi::Buffer<ffi::S32> send_kept,
                           ffi::Buffer<ffi::S32> expert_offsets, ffi::AnyBuffer /*after*/,
                           ffi::Result<ffi::AnyBuffer> returned, int64_t heap_id, int32_t num_ranks,
                           int32_t experts_per_rank) {
  const int64_t positions = rows_of(*returned), row_bytes = row_bytes_of(expert_rows);
  ep::Layout layout{num_ranks, experts_per_rank, static_cast<int32_t>(rows_of(expert_rows))};
  JK_FFI_RETURN_IF_ERROR(check_layout(layout, send_kept.element_count()));
  JK_FFI_CHECK(expert_offsets.element_count() == send_kept.element_count() + 1,
               "from_experts: expert_offsets must have num_experts + 1 entries");
  JK_FFI_CHECK(row_bytes % 4 == 0, "from_experts: rows must be a multiple of 4 bytes");
  ep::HeapView view;
  JK_FFI_RETURN_IF_ERROR(heap_view(heap_id, num_ranks, experts_per_rank, device_ordinal, rank.typed_data(),
                                   heap::kFromExpertsChannel, &view));
  JK_FFI_RETURN_IF_ERROR(check_transport_shapes("from_experts", "return", positions, row_bytes,
                                                row_bytes_of(*returned), view.region_bytes, blocks.element_count(),
                                                num_ranks, experts_per_rank));
  const int64_t pieces = (layout.capacity + positions) / ep::kPieceRows + 2 * layout.num_experts();
  ep::from_experts_kernel<<<transport_grid(device_ordinal, pieces), ep::kTransportThreads, 0, stream>>>(
      view, static_cast<const char*>(expert_rows.untyped_data()), row_bytes,
      reinterpret_cast<const ep::Block*>(blocks.typed_data()), send_kept.typed_data(), expert_offsets.typed_data(),
      static_cast<char*>(returned->untyped_data()), layout.capacity, positions);
  JK_CUDA_CHECK(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpPlanCudaHandler, PlanCuda,
                              ep_plan_signature(ffi::Ffi::Bind()
                                                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                    .Ctx<ffi::DeviceOrdinal>()
                                                    .Ctx<ffi::ScratchAllocator>()));
JK_REGISTER_FFI("jk_ep_plan", "CUDA", EpPlanCudaHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpToExpertsCudaHandler, ToExpertsCuda,
                              ep_to_experts_signature(ffi::Ffi::Bind()
                                                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                          .Ctx<ffi::DeviceOrdinal>()));
JK_REGISTER_FFI("jk_ep_to_experts", "CUDA", EpToExpertsCudaHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpFromExpertsCudaHandler, FromExpertsCuda,
                              ep_from_experts_signature(ffi::Ffi::Bind()
                                                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                            .Ctx<ffi::DeviceOrdinal>()));
JK_REGISTER_FFI("jk_ep_from_experts", "CUDA", EpFromExpertsCudaHandler);

}  // namespace jk
