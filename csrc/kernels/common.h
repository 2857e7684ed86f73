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

// float -> bf16 bits, round to nearest even (NaN stays NaN): the rounding of every bf16 result.
JK_HOST_DEVICE uint16_t float_to_bf16_bits(float value) {
#if defined(__CUDA_ARCH__)
  uint16_t out;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(value));
  return out;
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
#endif
}

JK_HOST_DEVICE float round_to_bf16(float value) { return bf16_bits_to_float(float_to_bf16_bits(value)); }

JK_HOST_DEVICE float load_as_float(const float* data, int64_t i) { return data[i]; }
JK_HOST_DEVICE float load_as_float(const uint16_t* data, int64_t i) { return bf16_bits_to_float(data[i]); }

}  // namespace jk
