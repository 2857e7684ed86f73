// Host side of the symmetric heaps: the process-global registry that FFI handlers look heaps up in by id.
//
// A heap is created from Python (jax_kittens/symmetric_heap.py, through the C functions jk_heap_* at the end of
// symmetric_heap.cc) before the computation that uses it is traced; its id reaches the handlers as the attribute
// `heap_id`. Heaps live until jk_heap_destroy (Python's atexit), so they survive recompiles and executables keep
// working with them.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/symmetric_heap.h"

namespace jk {

enum class HeapBackend : int32_t { kCpu = 0, kCudaPeer = 1, kCudaExternal = 2 };

// One device of a heap as this process sees it.
struct HeapMember {
  int32_t rank = 0;             // position along the expert-parallel axis
  int32_t device_ordinal = -1;  // CUDA device, -1 on CPU
  char* base = nullptr;         // this member's region (host address on CPU, device address on CUDA)
  // [num_ranks] region bases as this member addresses them: a host array on CPU, a device array on CUDA.
  char** peer_bases = nullptr;
  // Epoch of the last call per channel. Only this member's handler touches it, one call at a time.
  std::atomic<uint64_t> epochs[heap::kNumChannels] = {};
};

struct SymmetricHeap {
  int64_t id = 0;
  HeapBackend backend = HeapBackend::kCpu;
  int32_t num_ranks = 0;
  int64_t region_bytes = 0;
  int64_t timeout_ns = 0;
  // The members that live in this process: all ranks for kCpu and kCudaPeer, one for kCudaExternal (NVSHMEM).
  std::vector<std::unique_ptr<HeapMember>> members;
  heap::ErrorRecord* error = nullptr;         // host address
  heap::ErrorRecord* error_device = nullptr;  // the same record as device code writes it
  // Test hook: this rank stages data but never signals it (to_experts), so peers must time out.
  std::atomic<int32_t> skip_signal_rank{-1};
  std::function<void(SymmetricHeap&)> release;  // frees the backend's memory

  HeapMember* member_for_rank(int32_t rank);
  HeapMember* member_for_device(int32_t device_ordinal);
  // Non-empty when a previous call failed: the heap's epochs may disagree across ranks, so it cannot be reused.
  std::string error_message() const;
};

// nullptr when no live heap has that id.
SymmetricHeap* find_heap(int64_t id);
int64_t add_heap(std::unique_ptr<SymmetricHeap> heap);

// Created by the CUDA half of the extension when it is built (symmetric_heap_cuda.cu); null otherwise.
struct CudaHeapFactory {
  // All local GPUs of one process, cudaMalloc + peer access.
  std::function<std::unique_ptr<SymmetricHeap>(int32_t num_ranks, const int32_t* device_ordinals,
                                               int64_t region_bytes, std::string* error)>
      create_peer;
  // One GPU whose peers' regions are already mapped (NVSHMEM: nvshmem_ptr); the memory is not owned.
  std::function<std::unique_ptr<SymmetricHeap>(int32_t num_ranks, int32_t rank, int32_t device_ordinal,
                                               const uint64_t* peer_bases, int64_t region_bytes, std::string* error)>
      create_external;
};
CudaHeapFactory*& cuda_heap_factory();

// Records the first error of a heap; later ones are dropped. Host code only (device code writes error_device).
void record_heap_error(SymmetricHeap& heap, heap::ErrorCode code, int32_t rank, int32_t channel, int32_t peer,
                       uint64_t epoch);

const char* channel_name(int32_t channel);

}  // namespace jk
