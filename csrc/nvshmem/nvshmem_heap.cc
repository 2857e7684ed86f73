// _jk_nvshmem: the host side of the NVSHMEM heap backend, a separate module so the main extension never needs NVSHMEM.
//
// Only host calls: the unique-id bootstrap, nvshmem_malloc of the symmetric regions, and nvshmem_ptr for the NVLink
// load/store address of every peer's region. The expert-parallel kernels then address peers through a table of those
// pointers exactly as with the single-process heap, so no device code links libnvshmem_device.a (no -rdc): the
// module uses the host library's own entry points (nvshmemx_hostlib_init_attr / _finalize).
// Python (jax_kittens/symmetric_heap.py) loads it with ctypes after setting NVSHMEM_DISABLE_NVLS=1.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "nvshmem.h"
#include "nvshmemx.h"

#define JK_NVSHMEM_API extern "C" __attribute__((visibility("default")))

namespace {
thread_local std::string last_error;
bool initialized = false;
}  // namespace

JK_NVSHMEM_API const char* jk_nvshmem_last_error() { return last_error.c_str(); }

JK_NVSHMEM_API int64_t jk_nvshmem_unique_id_size() { return sizeof(nvshmemx_uniqueid_t); }

JK_NVSHMEM_API int32_t jk_nvshmem_get_unique_id(char* out) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  int status = nvshmemx_get_uniqueid(&id);
  if (status != 0) {
    last_error = "nvshmemx_get_uniqueid returned " + std::to_string(status);
    return status;
  }
  std::memcpy(out, &id, sizeof(id));
  return 0;
}

// Initialises this process as PE `rank` of `num_ranks` on CUDA device `device_ordinal`.
JK_NVSHMEM_API int32_t jk_nvshmem_init(const char* unique_id, int32_t rank, int32_t num_ranks,
                                       int32_t device_ordinal) {
  if (initialized) return 0;
  // Never NVLink multicast (NVLS): set here too, in case the caller's environment was not.
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  cudaError_t cuda_status = cudaSetDevice(device_ordinal);
  if (cuda_status != cudaSuccess) {
    last_error = std::string("cudaSetDevice: ") + cudaGetErrorString(cuda_status);
    return -1;
  }
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id, sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int status = nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr);
  if (status != 0) {
    last_error = "nvshmemx_set_attr_uniqueid_args returned " + std::to_string(status);
    return status;
  }
  // The host-library entry point: nvshmemx_init_attr would also set up device state, which lives in
  // libnvshmem_device.a and is only for kernels that call NVSHMEM themselves.
  status = nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  if (status != 0) {
    last_error = "nvshmemx_hostlib_init_attr returned " + std::to_string(status);
    return status;
  }
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != num_ranks) {
    last_error = "NVSHMEM gave PE " + std::to_string(nvshmem_my_pe()) + " of " + std::to_string(nvshmem_n_pes()) +
                 ", expected " + std::to_string(rank) + " of " + std::to_string(num_ranks);
    return -1;
  }
  initialized = true;
  return 0;
}

// Collective: every PE allocates the same size. Zeroed, and every PE's zeroing is done before it returns.
JK_NVSHMEM_API uint64_t jk_nvshmem_malloc(int64_t bytes) {
  void* region = nvshmem_malloc(static_cast<size_t>(bytes));
  if (region == nullptr) return 0;
  if (cudaMemset(region, 0, static_cast<size_t>(bytes)) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    return 0;
  }
  nvshmem_barrier_all();
  return reinterpret_cast<uint64_t>(region);
}

// The load/store address of PE `pe`'s copy of `region`, or 0 when it is not reachable over NVLink/P2P.
JK_NVSHMEM_API uint64_t jk_nvshmem_ptr(void* region, int32_t pe) {
  return reinterpret_cast<uint64_t>(nvshmem_ptr(region, pe));
}

JK_NVSHMEM_API void jk_nvshmem_free(void* region) {
  cudaDeviceSynchronize();
  nvshmem_free(region);
}

JK_NVSHMEM_API void jk_nvshmem_finalize() {
  if (!initialized) return;
  cudaDeviceSynchronize();
  nvshmemx_hostlib_finalize();
  initialized = false;
}
