// Helpers shared by the FFI bindings: shape checks and error propagation into XLA.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jk {

namespace ffi = xla::ffi;

// Product of all dimensions but the last: FFI ops treat leading dimensions as one flattened batch of rows.
inline int64_t leading_rows(ffi::Span<const int64_t> dims) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];
  return rows;
}

inline ffi::Error invalid_argument(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, message);
}

// Test switch, read once per process: with JAX_KITTENS_POISON_OUTPUTS set to anything but "" or "0" (tests/conftest.py
// sets it), the CUDA handlers of the routing, permute and grouped-GEMM targets fill their results with all-ones bytes
// (a NaN in bf16 and f32, -1 in int32) before their kernels run. An element a kernel misses then fails the tests,
// instead of passing on whatever the allocator left there. The permute and grouped-GEMM CPU twins always do it.
inline bool poison_outputs_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("JAX_KITTENS_POISON_OUTPUTS");
    return value != nullptr && std::string(value) != "" && std::string(value) != "0";
  }();
  return enabled;
}

}  // namespace jk

// Returns from the enclosing handler when a check fails; the message reaches the Python caller.
#define JK_FFI_CHECK(condition, message)                                   \
  do {                                                                     \
    if (!(condition)) return ::jk::invalid_argument(std::string(message)); \
  } while (0)

#define JK_FFI_RETURN_IF_ERROR(expr)       \
  do {                                     \
    ::xla::ffi::Error jk_error_ = (expr);  \
    if (jk_error_.failure()) return jk_error_; \
  } while (0)

#if defined(__CUDACC__) || defined(JK_WITH_CUDA_RUNTIME)
#include <cuda_runtime.h>

namespace jk {
inline ffi::Error cuda_error(cudaError_t status, const char* expr, const char* file, int line) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("CUDA error ") + cudaGetErrorName(status) + " (" +
                                                   cudaGetErrorString(status) + ") at " + file + ":" +
                                                   std::to_string(line) + ": " + expr);
}
}  // namespace jk

// Every CUDA runtime call and every launch (JK_CUDA_CHECK(cudaGetLastError())) goes through this.
#define JK_CUDA_CHECK(expr)                                                            \
  do {                                                                                 \
    cudaError_t jk_status_ = (expr);                                                   \
    if (jk_status_ != cudaSuccess) return ::jk::cuda_error(jk_status_, #expr, __FILE__, __LINE__); \
  } while (0)

namespace jk {
// The results' bytes set to 0xFF on the stream when poison_outputs_enabled(); a no-op otherwise.
template <typename... Results>
ffi::Error poison_results(cudaStream_t stream, const Results&... results) {
  if (!poison_outputs_enabled()) return ffi::Error::Success();
  for (const auto& [data, bytes] : {std::pair<void*, size_t>(results.untyped_data(), results.size_bytes())...}) {
    if (bytes > 0) JK_CUDA_CHECK(cudaMemsetAsync(data, 0xFF, bytes, stream));
  }
  return ffi::Error::Success();
}
}  // namespace jk
#endif
