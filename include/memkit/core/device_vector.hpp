// memkit/core/device_vector.hpp — 16-byte global loads and stores of storage elements, for CUDA kernels.
//
// A memory-bound kernel keeps enough bytes in flight only when each thread moves 16 bytes per instruction
// (LDG.E.128 / STG.E.128). These helpers load N consecutive fp32/bf16/fp16 values as floats, and store N
// values given as their bit patterns, with N * sizeof(T) / 16 vector instructions. The pointer must be
// 16-byte aligned; callers check (vector_aligned) and keep a scalar path for the rest.
#pragma once

#include <cstdint>
#include <type_traits>

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

// Two floats as 16-bit T's storage bits in one word (`low` in the low half), rounded to nearest even by
// one conversion instruction (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32, sm_80 and later) instead of
// float16.hpp's integer sequence per value: the same bits (NaN -> 0x7fff included), checked for every
// float by the GPU suite (tests/cuda/gpu_memory_test.cu). Memory-bound kernels that write 16-bit values
// are otherwise limited by those integer instructions (dequantize: SM 85% busy, DRAM 49%, on an H200).
template <float_storage T>
MEMKIT_DEVICE MEMKIT_FORCEINLINE std::uint32_t pack_pair_rn(float low, float high) {
  static_assert(sizeof(T) == 2);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  std::uint32_t bits;
  if constexpr (std::is_same_v<T, bf16>) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(bits) : "f"(high), "f"(low));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(bits) : "f"(high), "f"(low));
  return bits;
#else
  return storage_bits(from_float<T>(low)) | (storage_bits(from_float<T>(high)) << 16);
#endif
}

// N floats stored as T (from_float's rounding; 16-bit types two at a time by pack_pair_rn).
template <float_storage T, int N>
MEMKIT_DEVICE MEMKIT_FORCEINLINE void store_floats(T* destination, const float* values) {
  if constexpr (sizeof(T) == 4) {
    store_bits<T, N>(destination, [&](int k) { return __float_as_uint(values[k]); });
  } else {
    static_assert(N % 8 == 0);
#pragma unroll
    for (int q = 0; q < N / 8; ++q)
      reinterpret_cast<uint4*>(destination)[q] =
          make_uint4(pack_pair_rn<T>(values[8 * q], values[8 * q + 1]), pack_pair_rn<T>(values[8 * q + 2], values[8 * q + 3]),
                     pack_pair_rn<T>(values[8 * q + 4], values[8 * q + 5]), pack_pair_rn<T>(values[8 * q + 6], values[8 * q + 7]));
  }
}
#endif

}  // namespace detail

MEMKIT_NAMESPACE_END
