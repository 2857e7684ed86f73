// The symmetric heap registry, the CPU backend, and the C functions Python drives heaps with (through ctypes, so the
// heap needs no change to the extension module's nanobind bindings).
#include "ffi/symmetric_heap.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace jk {
namespace {

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<int64_t, std::unique_ptr<SymmetricHeap>>& registry() {
  static auto* heaps = new std::map<int64_t, std::unique_ptr<SymmetricHeap>>();  // outlives static destructors
  return *heaps;
}

int64_t& next_heap_id() {
  static int64_t id = 1;
  return id;
}

thread_local std::string last_error;

// One host allocation per rank, zeroed: the CPU devices of a process share its address space.
std::unique_ptr<SymmetricHeap> create_cpu_heap(int32_t num_ranks, int64_t region_bytes) {
  auto heap = std::make_unique<SymmetricHeap>();
  heap->backend = HeapBackend::kCpu;
  heap->num_ranks = num_ranks;
  heap->region_bytes = region_bytes;
  auto* bases = new char*[num_ranks];
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    bases[rank] = static_cast<char*>(std::aligned_alloc(heap::kRegionAlignment, region_bytes));
    if (bases[rank] == nullptr) {
      for (int32_t r = 0; r < rank; ++r) std::free(bases[r]);
      delete[] bases;
      last_error = "host allocation of " + std::to_string(region_bytes) + " bytes failed";
      return nullptr;
    }
    std::memset(bases[rank], 0, region_bytes);
  }
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    auto member = std::make_unique<HeapMember>();
    member->rank = rank;
    member->base = bases[rank];
    member->peer_bases = bases;
    heap->members.push_back(std::move(member));
  }
  heap->error = new heap::ErrorRecord{};
  heap->error_device = heap->error;
  heap->release = [bases, num_ranks](SymmetricHeap& self) {
    for (int32_t rank = 0; rank < num_ranks; ++rank) std::free(bases[rank]);
    delete[] bases;
    delete self.error;
  };
  return heap;
}

bool valid_shape(int32_t num_ranks, int64_t region_bytes) {
  if (num_ranks < 1 || num_ranks > heap::kMaxRanks) {
    last_error = "num_ranks must be in [1, " + std::to_string(heap::kMaxRanks) + "], got " + std::to_string(num_ranks);
    return false;
  }
  if (region_bytes < heap::kPadBytes + 2 * heap::kRegionAlignment || region_bytes % heap::kRegionAlignment != 0) {
    last_error = "region_bytes must be a multiple of " + std::to_string(heap::kRegionAlignment) + " and at least " +
                 std::to_string(heap::kPadBytes + 2 * heap::kRegionAlignment) + ", got " + std::to_string(region_bytes);
    return false;
  }
  return true;
}

int64_t register_heap(std::unique_ptr<SymmetricHeap> heap, int64_t timeout_ns) {
  if (!heap) return -1;
  heap->timeout_ns = timeout_ns;
  return add_heap(std::move(heap));
}

}  // namespace

HeapMember* SymmetricHeap::member_for_rank(int32_t rank) {
  for (auto& member : members) {
    if (member->rank == rank) return member.get();
  }
  return nullptr;
}

HeapMember* SymmetricHeap::member_for_device(int32_t device_ordinal) {
  for (auto& member : members) {
    if (member->device_ordinal == device_ordinal) return member.get();
  }
  return nullptr;
}

const char* channel_name(int32_t channel) {
  switch (channel) {
    case heap::kPlanChannel: return "plan (count exchange)";
    case heap::kToExpertsChannel: return "to_experts (dispatch)";
    case heap::kFromExpertsChannel: return "from_experts (combine)";
    default: return "unknown channel";
  }
}

std::string SymmetricHeap::error_message() const {
  heap::ErrorRecord record;
  std::memcpy(&record, const_cast<const heap::ErrorRecord*>(error), sizeof(record));
  int32_t code = __atomic_load_n(&error->code, __ATOMIC_ACQUIRE);
  if (code == heap::kNoError) return "";
  std::string where = " (heap " + std::to_string(id) + ", rank " + std::to_string(record.rank) + ", " +
                      channel_name(record.channel) + ", epoch " + std::to_string(record.epoch) + ")";
  if (code == heap::kPeerTimeout) {
    return "expert-parallel peer timed out: rank " + std::to_string(record.peer) + " never signalled within " +
           std::to_string(timeout_ns / 1000000) + " ms" + where +
           "; the heap is unusable now, create a new SymmetricHeap";
  }
  if (code == heap::kDeviceOrderMismatch) {
    return "expert-parallel rank " + std::to_string(record.rank) + " runs on a device that is not the heap's member " +
           "for that rank: build the SymmetricHeap from the mesh's devices in axis order" + where;
  }
  return "expert-parallel heap error code " + std::to_string(code) + where;
}

void record_heap_error(SymmetricHeap& heap, heap::ErrorCode code, int32_t rank, int32_t channel, int32_t peer,
                       uint64_t epoch) {
  int32_t expected = heap::kNoError;
  // Claim the record with a sentinel, fill it, then publish the code: readers never see a half-written record.
  if (!__atomic_compare_exchange_n(&heap.error->code, &expected, -1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    return;
  }
  heap.error->rank = rank;
  heap.error->channel = channel;
  heap.error->peer = peer;
  heap.error->epoch = epoch;
  __atomic_store_n(&heap.error->code, static_cast<int32_t>(code), __ATOMIC_RELEASE);
}

SymmetricHeap* find_heap(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second.get();
}

int64_t add_heap(std::unique_ptr<SymmetricHeap> heap) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  int64_t id = next_heap_id()++;
  heap->id = id;
  registry()[id] = std::move(heap);
  return id;
}

CudaHeapFactory*& cuda_heap_factory() {
  static CudaHeapFactory* factory = nullptr;
  return factory;
}

}  // namespace jk

// ---------------------------------------------------------------------------------------------------------------
// C interface for Python (jax_kittens/symmetric_heap.py loads this module with ctypes). Ids are > 0; -1 is failure,
// with the reason in jk_heap_last_error().
#define JK_HEAP_API extern "C" __attribute__((visibility("default")))

JK_HEAP_API const char* jk_heap_last_error() { return jk::last_error.c_str(); }

JK_HEAP_API int64_t jk_heap_create_cpu(int32_t num_ranks, int64_t region_bytes, int64_t timeout_ns) {
  if (!jk::valid_shape(num_ranks, region_bytes)) return -1;
  return jk::register_heap(jk::create_cpu_heap(num_ranks, region_bytes), timeout_ns);
}

JK_HEAP_API int64_t jk_heap_create_cuda(int32_t num_ranks, const int32_t* device_ordinals, int64_t region_bytes,
                                        int64_t timeout_ns) {
  if (!jk::valid_shape(num_ranks, region_bytes)) return -1;
  if (jk::cuda_heap_factory() == nullptr) {
    jk::last_error = "jax_kittens was built without CUDA";
    return -1;
  }
  std::unique_ptr<jk::SymmetricHeap> heap =
      jk::cuda_heap_factory()->create_peer(num_ranks, device_ordinals, region_bytes, &jk::last_error);
  return jk::register_heap(std::move(heap), timeout_ns);
}

JK_HEAP_API int64_t jk_heap_create_cuda_external(int32_t num_ranks, int32_t rank, int32_t device_ordinal,
                                                 const uint64_t* peer_bases, int64_t region_bytes,
                                                 int64_t timeout_ns) {
  if (!jk::valid_shape(num_ranks, region_bytes)) return -1;
  if (rank < 0 || rank >= num_ranks) {
    jk::last_error = "rank must be in [0, num_ranks)";
    return -1;
  }
  if (jk::cuda_heap_factory() == nullptr) {
    jk::last_error = "jax_kittens was built without CUDA";
    return -1;
  }
  std::unique_ptr<jk::SymmetricHeap> heap = jk::cuda_heap_factory()->create_external(
      num_ranks, rank, device_ordinal, peer_bases, region_bytes, &jk::last_error);
  return jk::register_heap(std::move(heap), timeout_ns);
}

// Frees the heap's memory. The caller guarantees no computation still uses it (Python: at exit, or an explicit
// close after block_until_ready).
JK_HEAP_API int32_t jk_heap_destroy(int64_t id) {
  std::unique_ptr<jk::SymmetricHeap> heap;
  {
    std::lock_guard<std::mutex> lock(jk::registry_mutex());
    auto it = jk::registry().find(id);
    if (it == jk::registry().end()) return -1;
    heap = std::move(it->second);
    jk::registry().erase(it);
  }
  if (heap->release) heap->release(*heap);
  return 0;
}

// out: [live heaps, bytes of all their regions in this process].
JK_HEAP_API void jk_heap_stats(int64_t* out) {
  std::lock_guard<std::mutex> lock(jk::registry_mutex());
  out[0] = static_cast<int64_t>(jk::registry().size());
  out[1] = 0;
  for (auto& [id, heap] : jk::registry()) {
    out[1] += heap->region_bytes * static_cast<int64_t>(heap->members.size());
  }
}

// Copies the heap's error message into message (capacity bytes, NUL-terminated); returns its error code (0: none).
JK_HEAP_API int32_t jk_heap_error(int64_t id, char* message, int64_t capacity) {
  jk::SymmetricHeap* heap = jk::find_heap(id);
  std::string text = heap == nullptr ? "unknown heap id " + std::to_string(id) : heap->error_message();
  if (capacity > 0) {
    std::strncpy(message, text.c_str(), capacity - 1);
    message[capacity - 1] = '\0';
  }
  if (heap == nullptr) return -1;
  return __atomic_load_n(&heap->error->code, __ATOMIC_ACQUIRE);
}

// Test hook: `rank` stops signalling to_experts data (-1: nobody). Peers waiting for it time out.
JK_HEAP_API int32_t jk_heap_set_skip_signal_rank(int64_t id, int32_t rank) {
  jk::SymmetricHeap* heap = jk::find_heap(id);
  if (heap == nullptr) return -1;
  heap->skip_signal_rank.store(rank);
  return 0;
}

// out: [pad bytes, max ranks, max chunks, max experts, region alignment]: what Python sizes regions and chunks by.
JK_HEAP_API void jk_heap_limits(int64_t* out) {
  out[0] = jk::heap::kPadBytes;
  out[1] = jk::heap::kMaxRanks;
  out[2] = jk::heap::kMaxChunks;
  out[3] = jk::heap::kMaxExperts;
  out[4] = jk::heap::kRegionAlignment;
}
