// CUDA backends of the symmetric heap: all local GPUs of one process (cudaMalloc + peer access), and one GPU whose
// peers are already mapped (NVSHMEM regions from nvshmem_malloc, addressed through nvshmem_ptr). No multicast.
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ffi/symmetric_heap.h"

namespace jk {
namespace {

std::string cuda_failure(cudaError_t status, const char* what) {
  return std::string(what) + ": " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")";
}

#define JK_HEAP_CUDA(expr, what)                    \
  do {                                              \
    cudaError_t jk_status_ = (expr);                \
    if (jk_status_ != cudaSuccess) {                \
      *error = cuda_failure(jk_status_, what);      \
      return false;                                 \
    }                                               \
  } while (0)

// Keeps the caller's current device across heap setup.
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&saved_); }
  ~DeviceGuard() { cudaSetDevice(saved_); }

 private:
  int saved_ = 0;
};

// Host-mapped pinned record: kernels write it, the host reads it without synchronising.
bool allocate_error_record(SymmetricHeap& heap, std::string* error) {
  void* host = nullptr;
  JK_HEAP_CUDA(cudaHostAlloc(&host, sizeof(heap::ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable),
               "cudaHostAlloc of the heap's error record");
  std::memset(host, 0, sizeof(heap::ErrorRecord));
  void* device = nullptr;
  JK_HEAP_CUDA(cudaHostGetDevicePointer(&device, host, 0), "cudaHostGetDevicePointer");
  heap.error = static_cast<heap::ErrorRecord*>(host);
  heap.error_device = static_cast<heap::ErrorRecord*>(device);
  return true;
}

// The [num_ranks] table of region bases, in the member's device memory.
bool upload_peer_table(HeapMember& member, const std::vector<char*>& bases, std::string* error) {
  JK_HEAP_CUDA(cudaSetDevice(member.device_ordinal), "cudaSetDevice");
  void* table = nullptr;
  JK_HEAP_CUDA(cudaMalloc(&table, bases.size() * sizeof(char*)), "cudaMalloc of a peer table");
  member.peer_bases = static_cast<char**>(table);
  JK_HEAP_CUDA(cudaMemcpy(table, bases.data(), bases.size() * sizeof(char*), cudaMemcpyHostToDevice),
               "cudaMemcpy of a peer table");
  return true;
}

void release_members(SymmetricHeap& heap, bool owns_regions) {
  DeviceGuard guard;
  for (auto& member : heap.members) {
    if (cudaSetDevice(member->device_ordinal) != cudaSuccess) continue;
    cudaDeviceSynchronize();  // nothing may still be reading the regions
    if (owns_regions && member->base != nullptr) cudaFree(member->base);
    if (member->peer_bases != nullptr) cudaFree(member->peer_bases);
  }
  if (heap.error != nullptr) cudaFreeHost(heap.error);
}

bool setup_peer_heap(SymmetricHeap& heap, const int32_t* device_ordinals, std::string* error) {
  const int32_t num_ranks = heap.num_ranks;
  std::vector<char*> bases(num_ranks, nullptr);
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    auto member = std::make_unique<HeapMember>();
    member->rank = rank;
    member->device_ordinal = device_ordinals[rank];
    JK_HEAP_CUDA(cudaSetDevice(member->device_ordinal), "cudaSetDevice");
    void* base = nullptr;
    JK_HEAP_CUDA(cudaMalloc(&base, heap.region_bytes), "cudaMalloc of a heap region");
    member->base = static_cast<char*>(base);
    heap.members.push_back(std::move(member));
    JK_HEAP_CUDA(cudaMemset(base, 0, heap.region_bytes), "cudaMemset of a heap region");
    bases[rank] = static_cast<char*>(base);
  }
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    const int32_t device = device_ordinals[rank];
    JK_HEAP_CUDA(cudaSetDevice(device), "cudaSetDevice");
    for (int32_t peer = 0; peer < num_ranks; ++peer) {
      const int32_t peer_device = device_ordinals[peer];
      if (peer_device == device) continue;
      int can_access = 0;
      JK_HEAP_CUDA(cudaDeviceCanAccessPeer(&can_access, device, peer_device), "cudaDeviceCanAccessPeer");
      if (!can_access) {
        *error = "GPU " + std::to_string(device) + " cannot access GPU " + std::to_string(peer_device) +
                 " directly (no peer access): the single-process heap needs NVLink/P2P between all its GPUs";
        return false;
      }
      cudaError_t status = cudaDeviceEnablePeerAccess(peer_device, 0);
      if (status == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // XLA may have enabled it already; clear the sticky-free error
      } else if (status != cudaSuccess) {
        *error = cuda_failure(status, "cudaDeviceEnablePeerAccess");
        return false;
      }
    }
  }
  for (auto& member : heap.members) {
    if (!upload_peer_table(*member, bases, error)) return false;
  }
  JK_HEAP_CUDA(cudaDeviceSynchronize(), "cudaDeviceSynchronize after heap setup");
  return allocate_error_record(heap, error);
}

std::unique_ptr<SymmetricHeap> create_peer_heap(int32_t num_ranks, const int32_t* device_ordinals,
                                                int64_t region_bytes, std::string* error) {
  DeviceGuard guard;
  auto heap = std::make_unique<SymmetricHeap>();
  heap->backend = HeapBackend::kCudaPeer;
  heap->num_ranks = num_ranks;
  heap->region_bytes = region_bytes;
  heap->release = [](SymmetricHeap& self) { release_members(self, /*owns_regions=*/true); };
  if (!setup_peer_heap(*heap, device_ordinals, error)) {
    heap->release(*heap);
    return nullptr;
  }
  return heap;
}

bool setup_external_heap(SymmetricHeap& heap, int32_t rank, int32_t device_ordinal, const uint64_t* peer_bases,
                         std::string* error) {
  auto member = std::make_unique<HeapMember>();
  member->rank = rank;
  member->device_ordinal = device_ordinal;
  member->base = reinterpret_cast<char*>(peer_bases[rank]);
  std::vector<char*> bases(heap.num_ranks);
  for (int32_t r = 0; r < heap.num_ranks; ++r) bases[r] = reinterpret_cast<char*>(peer_bases[r]);
  heap.members.push_back(std::move(member));
  if (!upload_peer_table(*heap.members.back(), bases, error)) return false;
  JK_HEAP_CUDA(cudaMemset(heap.members.back()->base, 0, heap.region_bytes), "cudaMemset of the heap region");
  JK_HEAP_CUDA(cudaDeviceSynchronize(), "cudaDeviceSynchronize after heap setup");
  return allocate_error_record(heap, error);
}

std::unique_ptr<SymmetricHeap> create_external_heap(int32_t num_ranks, int32_t rank, int32_t device_ordinal,
                                                    const uint64_t* peer_bases, int64_t region_bytes,
                                                    std::string* error) {
  DeviceGuard guard;
  auto heap = std::make_unique<SymmetricHeap>();
  heap->backend = HeapBackend::kCudaExternal;
  heap->num_ranks = num_ranks;
  heap->region_bytes = region_bytes;
  heap->release = [](SymmetricHeap& self) { release_members(self, /*owns_regions=*/false); };
  if (!setup_external_heap(*heap, rank, device_ordinal, peer_bases, error)) {
    heap->release(*heap);
    return nullptr;
  }
  return heap;
}

struct RegisterCudaHeaps {
  RegisterCudaHeaps() {
    static CudaHeapFactory factory{create_peer_heap, create_external_heap};
    cuda_heap_factory() = &factory;
  }
};
RegisterCudaHeaps register_cuda_heaps;

}  // namespace
}  // namespace jk
