// CPU twin of the expert-parallel protocol: jk_ep_plan, jk_ep_to_experts, jk_ep_from_experts.
//
// XLA:CPU runs the device programs of a shard_map concurrently in threads of one process, so each rank's call
// talks to its peers through the host heap exactly as the GPU kernels do through NVLink: same layout, same flags,
// same epochs, same order of waits and signals (expert_parallel_cuda.cu). Waits yield the thread (CI machines have
// few cores) and give up after the heap's timeout.
//
// The handlers are asynchronous: each checks its operands, takes its epoch and returns a future; the protocol (every
// wait for a peer) runs on a thread of its own, which completes the future. Waiting on XLA's thread would deadlock:
// XLA:CPU runs a device's ready ops one after another on one thread, so an op that blocks there holds back the ops
// queued behind it. An XLA collective (the psum of a replicated weight's gradient) blocks until every rank has joined
// it, a transport until every peer has signalled; two such ops that do not depend on each other are queued in whichever
// order their inputs happen to be ready, which differs between ranks. One rank then sits in the psum with its transport
// queued behind it while a peer sits in that transport with its psum queued behind it, and XLA aborts the process when
// its rendezvous times out (issue 5). Off XLA's threads, a transport never holds back another op, so every rank reaches
// every collective.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "ffi/expert_parallel_attrs.h"
#include "ffi/ffi_util.h"
#include "ffi/registry.h"
#include "ffi/symmetric_heap.h"
#include "kernels/expert_parallel.h"
#include "kernels/symmetric_heap.h"

namespace jk {
namespace {

using heap::SignalPad;

struct Peer {
  SymmetricHeap* heap;
  HeapMember* member;
  int32_t rank;

  SignalPad* pad(int32_t r) const { return reinterpret_cast<SignalPad*>(member->peer_bases[r]); }
  char* region(int32_t r) const { return member->peer_bases[r]; }
};

ffi::Error heap_failure(const SymmetricHeap& heap) {
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, heap.error_message());
}

void signal(uint64_t* flag, uint64_t epoch) { __atomic_store_n(flag, epoch, __ATOMIC_RELEASE); }

// Waits until *flag >= epoch; false (with the heap's error recorded) on timeout or when another rank failed.
bool wait_flag(const Peer& self, const uint64_t* flag, uint64_t epoch, int32_t channel, int32_t peer) {
  if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= epoch) return true;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(self.heap->timeout_ns);
  while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < epoch) {
    if (__atomic_load_n(&self.heap->error->code, __ATOMIC_ACQUIRE) != heap::kNoError) return false;
    if (std::chrono::steady_clock::now() > deadline) {
      record_heap_error(*self.heap, heap::kPeerTimeout, self.rank, channel, peer, epoch);
      return false;
    }
    std::this_thread::yield();
  }
  return true;
}

ffi::Error find_self(int64_t heap_id, int32_t num_ranks, ffi::Buffer<ffi::S32> rank, Peer* out) {
  SymmetricHeap* heap = nullptr;
  JK_FFI_RETURN_IF_ERROR(lookup_heap(heap_id, num_ranks, &heap));
  JK_FFI_CHECK(heap->backend == HeapBackend::kCpu, "a CPU expert-parallel call needs a CPU heap");
  int32_t me = rank.typed_data()[0];
  JK_FFI_CHECK(me >= 0 && me < num_ranks, "rank operand outside [0, num_ranks)");
  *out = Peer{heap, heap->member_for_rank(me), me};
  return ffi::Error::Success();
}

uint64_t next_epoch(const Peer& self, int32_t channel) { return self.member->epochs[channel].fetch_add(1) + 1; }

// What a call does once its operands are checked and its epoch taken: every wait, copy and signal. It holds plain
// pointers and values only, because XLA reuses the call's frame (the operands' Buffer views) once the handler returns.
using Protocol = std::function<ffi::Error()>;

// The call's future: failed with `checked`, or completed by `protocol` on a thread of its own. Completing it runs
// XLA's next ready ops of this device on that thread, as for any asynchronous op.
ffi::Future launch(ffi::Error checked, Protocol protocol) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (checked.failure()) {
    promise.SetError(std::move(checked));
    return future;
  }
  try {
    std::thread([promise, protocol = std::move(protocol)]() mutable {
      ffi::Error outcome = protocol();
      if (outcome.success()) {
        promise.SetAvailable();
      } else {
        promise.SetError(std::move(outcome));
      }
    }).detach();
  } catch (const std::system_error& error) {
    promise.SetError(ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                std::string("expert-parallel call could not start its thread: ") + error.what()));
  }
  return future;
}

// The asynchronous handler of `kPrepare(Protocol*, operands..., attributes...)`, which checks a call and sets what it
// does.
template <auto kPrepare>
struct Asynchronous;

template <typename... Args, ffi::Error (*kPrepare)(Protocol*, Args...)>
struct Asynchronous<kPrepare> {
  static ffi::Future Handler(Args... args) {
    Protocol protocol;
    ffi::Error checked = kPrepare(&protocol, args...);
    return launch(std::move(checked), std::move(protocol));
  }
};

// Publishes this rank's counts, reads everyone's, and derives the receive blocks and what of ours is kept.
ffi::Error PlanCpu(Protocol* protocol, ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> counts_operand,
                   ffi::ResultBuffer<ffi::S32> blocks_result, ffi::ResultBuffer<ffi::S32> send_kept_result,
                   ffi::ResultBuffer<ffi::S32> group_sizes_result, ffi::ResultBuffer<ffi::S32> dropped_result,
                   int64_t heap_id, int32_t num_ranks, int32_t experts_per_rank, int32_t capacity) {
  ep::Layout layout{num_ranks, experts_per_rank, capacity};
  JK_FFI_RETURN_IF_ERROR(check_layout(layout, counts_operand.element_count()));
  Peer self;
  JK_FFI_RETURN_IF_ERROR(find_self(heap_id, num_ranks, rank, &self));
  const int32_t channel = heap::kPlanChannel;
  const uint64_t epoch = next_epoch(self, channel);
  const int32_t* counts = counts_operand.typed_data();
  auto* blocks = reinterpret_cast<ep::Block*>(blocks_result->typed_data());
  int32_t* send_kept = send_kept_result->typed_data();
  int32_t* group_sizes = group_sizes_result->typed_data();
  int32_t* dropped = dropped_result->typed_data();

  *protocol = [=]() -> ffi::Error {
    const int32_t experts = layout.num_experts();
    SignalPad* mine = self.pad(self.rank);
    // Our count area is free once every peer has read the previous epoch's counts.
    for (int32_t p = 0; p < num_ranks; ++p) {
      if (!wait_flag(self, &mine->done[channel][p], epoch - 1, channel, p)) return heap_failure(*self.heap);
    }
    std::memcpy(mine->counts, counts, experts * sizeof(int32_t));
    for (int32_t p = 0; p < num_ranks; ++p) signal(&self.pad(p)->ready[channel][0][self.rank], epoch);

    std::vector<int32_t> all_counts(static_cast<size_t>(num_ranks) * experts);
    for (int32_t s = 0; s < num_ranks; ++s) {
      if (!wait_flag(self, &mine->ready[channel][0][s], epoch, channel, s)) return heap_failure(*self.heap);
      std::memcpy(all_counts.data() + static_cast<size_t>(s) * experts, self.pad(s)->counts,
                  experts * sizeof(int32_t));
    }
    for (int32_t s = 0; s < num_ranks; ++s) signal(&self.pad(s)->done[channel][self.rank], epoch);

    ep::receive_blocks(all_counts.data(), layout, self.rank, blocks, group_sizes);
    int32_t lost = 0;
    for (int32_t g = 0; g < experts; ++g) {
      send_kept[g] = ep::send_kept(all_counts.data(), layout, self.rank, g);
      lost += counts[g] - send_kept[g];
    }
    *dropped = lost;
    return ffi::Error::Success();
  };
  return ffi::Error::Success();
}

// Source: stage our expert-major rows in the send area, chunk by chunk, signalling each chunk. Receiver: pull the
// rows of every receive block from its source's send area once the chunks holding them are signalled.
ffi::Error ToExpertsCpu(Protocol* protocol, ffi::Buffer<ffi::S32> rank, ffi::AnyBuffer packed,
                        ffi::Buffer<ffi::S32> blocks_operand, ffi::AnyBuffer /*after*/,
                        ffi::Result<ffi::AnyBuffer> recv, int64_t heap_id, int32_t num_ranks,
                        int32_t experts_per_rank, int32_t chunk_rows) {
  Peer self;
  JK_FFI_RETURN_IF_ERROR(find_self(heap_id, num_ranks, rank, &self));
  ep::Layout layout{num_ranks, experts_per_rank, static_cast<int32_t>(rows_of(*recv))};
  const int64_t positions = rows_of(packed);
  const int64_t row_bytes = row_bytes_of(packed);
  JK_FFI_RETURN_IF_ERROR(check_transport_shapes("to_experts", "send", positions, row_bytes, row_bytes_of(*recv),
                                                self.heap->region_bytes, blocks_operand.element_count(), num_ranks,
                                                experts_per_rank));
  JK_FFI_CHECK(chunk_rows > 0 && (positions + chunk_rows - 1) / chunk_rows <= heap::kMaxChunks,
               "to_experts: chunk_rows gives too many chunks");
  const auto* blocks = reinterpret_cast<const ep::Block*>(blocks_operand.typed_data());
  JK_FFI_RETURN_IF_ERROR(check_blocks(blocks, layout, layout.capacity, positions));

  const int32_t channel = heap::kToExpertsChannel;
  const uint64_t epoch = next_epoch(self, channel);
  const bool skip_signal = self.heap->skip_signal_rank.load() == self.rank;
  const auto* source = static_cast<const char*>(packed.untyped_data());
  char* out = static_cast<char*>(recv->untyped_data());

  *protocol = [=]() -> ffi::Error {
    SignalPad* mine = self.pad(self.rank);
    char* send_area = self.region(self.rank) + heap::send_area_offset(self.heap->region_bytes);
    for (int32_t p = 0; p < num_ranks; ++p) {
      if (!wait_flag(self, &mine->done[channel][p], epoch - 1, channel, p)) return heap_failure(*self.heap);
    }
    for (int64_t first = 0, chunk = 0; first < positions; first += chunk_rows, ++chunk) {
      int64_t rows = std::min<int64_t>(chunk_rows, positions - first);
      std::memcpy(send_area + first * row_bytes, source + first * row_bytes, rows * row_bytes);
      if (skip_signal) continue;
      for (int32_t p = 0; p < num_ranks; ++p) signal(&self.pad(p)->ready[channel][chunk][self.rank], epoch);
    }

    int64_t received = 0;
    for (int32_t b = 0; b < num_ranks * experts_per_rank; ++b) {
      const ep::Block& block = blocks[b];
      if (block.kept == 0) continue;
      const int32_t s = b % num_ranks;
      const char* peer_send = self.region(s) + heap::send_area_offset(self.heap->region_bytes);
      int32_t first_chunk = ep::chunk_of(block.source_position, chunk_rows);
      int32_t last_chunk = ep::chunk_of(block.source_position + block.kept - 1, chunk_rows);
      for (int32_t chunk = first_chunk; chunk <= last_chunk; ++chunk) {
        if (!wait_flag(self, &mine->ready[channel][chunk][s], epoch, channel, s)) return heap_failure(*self.heap);
      }
      std::memcpy(out + static_cast<int64_t>(block.recv_offset) * row_bytes,
                  peer_send + static_cast<int64_t>(block.source_position) * row_bytes, block.kept * row_bytes);
      received += block.kept;
    }
    std::memset(out + received * row_bytes, 0, (layout.capacity - received) * row_bytes);
    for (int32_t s = 0; s < num_ranks; ++s) signal(&self.pad(s)->done[channel][self.rank], epoch);
    return ffi::Error::Success();
  };
  return ffi::Error::Success();
}

// Receiver: push the rows of every receive block into its source's return area. Source: once every owner has
// pushed, copy our positions out of the return area; positions nobody kept come back as zeros.
ffi::Error FromExpertsCpu(Protocol* protocol, ffi::Buffer<ffi::S32> rank, ffi::AnyBuffer expert_rows,
                          ffi::Buffer<ffi::S32> blocks_operand, ffi::Buffer<ffi::S32> send_kept_operand,
                          ffi::Buffer<ffi::S32> expert_offsets, ffi::AnyBuffer /*after*/,
                          ffi::Result<ffi::AnyBuffer> returned, int64_t heap_id, int32_t num_ranks,
                          int32_t experts_per_rank) {
  Peer self;
  JK_FFI_RETURN_IF_ERROR(find_self(heap_id, num_ranks, rank, &self));
  ep::Layout layout{num_ranks, experts_per_rank, static_cast<int32_t>(rows_of(expert_rows))};
  JK_FFI_RETURN_IF_ERROR(check_layout(layout, send_kept_operand.element_count()));
  JK_FFI_CHECK(expert_offsets.element_count() == send_kept_operand.element_count() + 1,
               "from_experts: expert_offsets must have num_experts + 1 entries");
  const int64_t positions = rows_of(*returned);
  const int64_t row_bytes = row_bytes_of(expert_rows);
  JK_FFI_RETURN_IF_ERROR(check_transport_shapes("from_experts", "return", positions, row_bytes,
                                                row_bytes_of(*returned), self.heap->region_bytes,
                                                blocks_operand.element_count(), num_ranks, experts_per_rank));
  const auto* blocks = reinterpret_cast<const ep::Block*>(blocks_operand.typed_data());
  JK_FFI_RETURN_IF_ERROR(check_blocks(blocks, layout, layout.capacity, positions));

  const int32_t channel = heap::kFromExpertsChannel;
  const uint64_t epoch = next_epoch(self, channel);
  const auto* rows = static_cast<const char*>(expert_rows.untyped_data());
  const int32_t* send_kept = send_kept_operand.typed_data();
  const int32_t* offsets = expert_offsets.typed_data();
  char* out = static_cast<char*>(returned->untyped_data());

  *protocol = [=]() -> ffi::Error {
    SignalPad* mine = self.pad(self.rank);
    const int64_t return_offset = heap::return_area_offset(self.heap->region_bytes);
    for (int32_t step = 0; step < num_ranks; ++step) {
      const int32_t s = (self.rank + step) % num_ranks;  // start with ourselves, then spread over the peers
      // The source's return area is free once it has consumed the previous epoch.
      if (!wait_flag(self, &mine->done[channel][s], epoch - 1, channel, s)) return heap_failure(*self.heap);
      char* peer_return = self.region(s) + return_offset;
      for (int32_t e = 0; e < experts_per_rank; ++e) {
        const ep::Block& block = blocks[e * num_ranks + s];
        std::memcpy(peer_return + static_cast<int64_t>(block.source_position) * row_bytes,
                    rows + static_cast<int64_t>(block.recv_offset) * row_bytes, block.kept * row_bytes);
      }
      signal(&self.pad(s)->ready[channel][0][self.rank], epoch);
    }

    for (int32_t p = 0; p < num_ranks; ++p) {
      if (!wait_flag(self, &mine->ready[channel][0][p], epoch, channel, p)) return heap_failure(*self.heap);
    }
    const char* return_area = self.region(self.rank) + return_offset;
    JK_FFI_CHECK(offsets[0] == 0 && offsets[layout.num_experts()] <= positions,
                 "from_experts: expert_offsets exceed the returned rows");
    for (int32_t g = 0; g < layout.num_experts(); ++g) {
      int64_t position = offsets[g];
      int64_t wanted = offsets[g + 1] - position;
      JK_FFI_CHECK(wanted >= 0, "from_experts: expert_offsets must not decrease");
      int64_t kept = std::clamp<int64_t>(send_kept[g], 0, wanted);
      std::memcpy(out + position * row_bytes, return_area + position * row_bytes, kept * row_bytes);
      std::memset(out + (position + kept) * row_bytes, 0, (wanted - kept) * row_bytes);
    }
    const int64_t used = offsets[layout.num_experts()];
    std::memset(out + used * row_bytes, 0, (positions - used) * row_bytes);
    for (int32_t p = 0; p < num_ranks; ++p) signal(&self.pad(p)->done[channel][self.rank], epoch);
    return ffi::Error::Success();
  };
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpPlanCpuHandler, Asynchronous<PlanCpu>::Handler,
                              ep_plan_signature(ffi::Ffi::Bind()));
JK_REGISTER_FFI("jk_ep_plan", "cpu", EpPlanCpuHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpToExpertsCpuHandler, Asynchronous<ToExpertsCpu>::Handler,
                              ep_to_experts_signature(ffi::Ffi::Bind()));
JK_REGISTER_FFI("jk_ep_to_experts", "cpu", EpToExpertsCpuHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpFromExpertsCpuHandler, Asynchronous<FromExpertsCpu>::Handler,
                              ep_from_experts_signature(ffi::Ffi::Bind()));
JK_REGISTER_FFI("jk_ep_from_experts", "cpu", EpFromExpertsCpuHandler);

}  // namespace jk
