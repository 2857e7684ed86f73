// Definitions shared by host and device code of every op.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JK_HOST_DEVICE inline
#endif

namespace jk {

// bf16 travels through the FFI as its 16 raw bits; widening is exact, so host and device agree bit for bit.
JK_HOST_DEVICE float bf16_bits_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
#if defined(__CUDA_ARCH__)
  value = __uint_as_float(widened);
#else
  std::memcpy(&value, &widened, sizeof(value));
#endif
  return value;
}

JK_HOST_DEVICE float load_as_float(const float* data, int64_t i) { return data[i]; }
JK_HOST_DEVICE float load_as_float(const uint16_t* data, int64_t i) { return bf16_bits_to_float(data[i]); }

}  // namespace jk
