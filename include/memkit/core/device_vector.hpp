// memkit/core/device_vector.hpp — 16-byte global loads and stores of storage elements, for CUDA kernels.
//
// A memory-bound kernel keeps enough bytes in flight only when each thread moves 16 bytes per instruction
// (LDG.E.128 / STG.E.128). These helpers load N consecutive fp32/bf16/fp16 values as floats, and store N
// values given as their bit patterns, with N * sizeof(T) / 16 vector instructions. The pointer must be
// 16-byte aligned; callers check (vector_aligned) and keep a scalar path for the rest.
#pragma once

#include <cstdint>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace detail {

// Whether every pointer is 16-byte aligned (nullptr counts as aligned: an absent array is never accessed).
template <class... Pointee>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE bool vector_aligned(const Pointee*... pointers) noexcept {
  return ((reinterpret_cast<std::uintptr_t>(pointers) % 16 == 0) && ...);
}

#if MEMKIT_HAS_CUDA
// N consecutive storage elements as floats. ReadOnly: through the read-only (non-coherent) data path, for
// arrays no thread of the kernel writes.
template <float_storage T, int N, bool ReadOnly = false>
MEMKIT_DEVICE MEMKIT_FORCEINLINE void load_floats(const T* source, float* out) {
  static_assert(N * sizeof(T) % 16 == 0);
#pragma unroll
  for (int q = 0; q < static_cast<int>(N * sizeof(T) / 16); ++q) {
    const uint4* address = reinterpret_cast<const uint4*>(source) + q;
    uint4 raw;
    if constexpr (ReadOnly) raw = __ldg(address);
    else raw = *address;
    const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if constexpr (sizeof(T) == 4) {
        out[4 * q + w] = __uint_as_float(words[w]);
      } else {
        out[8 * q + 2 * w] = to_float(T::from_bits(static_cast<std::uint16_t>(words[w] & 0xffffu)));
        out[8 * q + 2 * w + 1] = to_float(T::from_bits(static_cast<std::uint16_t>(words[w] >> 16)));
      }
    }
  }
}

// The bit pattern of one storage element, widened to 32 bits.
template <float_storage T>
MEMKIT_DEVICE MEMKIT_FORCEINLINE std::uint32_t storage_bits(T value) {
  if constexpr (sizeof(T) == 4) return __float_as_uint(value);
  else return value.bits;
}

// N consecutive storage elements, element k's bits given by bits_of(k) (storage_bits of the value).
template <float_storage T, int N, class Bits>
MEMKIT_DEVICE MEMKIT_FORCEINLINE void store_bits(T* destination, Bits&& bits_of) {
  static_assert(N * sizeof(T) % 16 == 0);
#pragma unroll
  for (int q = 0; q < static_cast<int>(N * sizeof(T) / 16); ++q) {
    std::uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if constexpr (sizeof(T) == 4) words[w] = bits_of(4 * q + w);
      else words[w] = bits_of(8 * q + 2 * w) | (bits_of(8 * q + 2 * w + 1) << 16);
    }
    reinterpret_cast<uint4*>(destination)[q] = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// N floats stored as T (from_float's rounding).
template <float_storage T, int N>
MEMKIT_DEVICE MEMKIT_FORCEINLINE void store_floats(T* destination, const float* values) {
  store_bits<T, N>(destination, [&](int k) { return storage_bits(from_float<T>(values[k])); });
}
#endif

}  // namespace detail

MEMKIT_NAMESPACE_END
