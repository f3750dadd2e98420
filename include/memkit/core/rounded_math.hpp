// memkit/core/rounded_math.hpp — explicitly rounded float and double arithmetic for per-element math.
//
// memkit's host loops and CUDA kernels call the same MEMKIT_HOST_DEVICE functions and must produce the same
// bits, so every operation has to round the same way on both sides. nvcc contracts a * b + c into one FMA
// (rounded once, not twice) unless told otherwise; on the device these helpers are therefore spelled as the
// _rn intrinsics, which it never fuses. Host compilers fuse too: g++ contracts in C++ by default whenever
// the target has FMA (-march=native, -mfma), whatever the -std. So on the host every product passes
// through rounded(), an empty asm that makes the rounded value exist before anything else uses it; no
// flag of the consumer's can then fuse it into a later addition. Division and square root are IEEE
// correctly rounded on both sides.
#pragma once

#include <cmath>
#include <cstdint>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace detail {

#if !MEMKIT_DEVICE_PASS
// The value, forced to exist as a rounded float/double in a register: the compiler cannot see through
// the asm, so it cannot fold the multiplication that produced it into a fused multiply-add.
template <class T>
inline T rounded(T value) noexcept {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(value));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(value));
#endif
  return value;
}
#endif

MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float mul_rn(float a, float b) noexcept {
#if MEMKIT_DEVICE_PASS
  return __fmul_rn(a, b);
#else
  return rounded(a * b);
#endif
}
// a * b for a product that is only stored, converted or compared, never added to: nothing can fuse it
// into an FMA, so it needs no barrier, and host loops built on it still vectorize. Use mul_rn for any
// product that feeds an addition.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float stored_product(float a, float b) noexcept { return a * b; }

MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float add_rn(float a, float b) noexcept {
#if MEMKIT_DEVICE_PASS
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float sub_rn(float a, float b) noexcept {
#if MEMKIT_DEVICE_PASS
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float div_rn(float a, float b) noexcept {
#if MEMKIT_DEVICE_PASS
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float sqrt_rn(float a) noexcept {
#if MEMKIT_DEVICE_PASS
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE double dmul_rn(double a, double b) noexcept {
#if MEMKIT_DEVICE_PASS
  return __dmul_rn(a, b);
#else
  return rounded(a * b);
#endif
}
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE double dadd_rn(double a, double b) noexcept {
#if MEMKIT_DEVICE_PASS
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE double dsqrt_rn(double a) noexcept {
#if MEMKIT_DEVICE_PASS
  return __dsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// memkit's one finiteness test, from the exponent bits (all ones: Inf or NaN): no libm (std::isfinite is not a
// device function everywhere) and no float arithmetic or compare that -ffast-math could assume away, so
// host and device give the same answer under any flags.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE bool is_finite(float x) noexcept {
  return (bit_cast<std::uint32_t>(x) & 0x7f800000u) != 0x7f800000u;
}
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE bool is_finite(double x) noexcept {
  return (bit_cast<std::uint64_t>(x) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

// memkit's one absmax rule, shared by every host loop and kernel that takes a block's largest magnitude:
// magnitudes are compared as IEEE bit patterns with the sign cleared. For non-negative floats that integer
// order is the float order; +0 and -0 are the same; Inf sorts above every finite value and NaN above Inf
// (the larger payload wins). So a NaN anywhere in a block makes its absmax NaN, whatever the order of the
// reduction, on the host and on the device alike. (A float compare or fmaxf would drop the NaN, or keep
// it only when it happens to arrive first.)
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE std::uint32_t max_magnitude_step(std::uint32_t current, float value) noexcept {
  const std::uint32_t bits = bit_cast<std::uint32_t>(value) & 0x7fffffffu;
  return bits > current ? bits : current;
}
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float max_magnitude(float current, float value) noexcept {
  return bit_cast<float>(max_magnitude_step(bit_cast<std::uint32_t>(current) & 0x7fffffffu, value));
}

// The largest |value| of values[0, count) as IEEE bits, by the rule above. For non-negative floats the integer order of the
// bits is the float order, and Inf and NaN sort above every finite value, so one integer maximum gives
// both the exact float maximum (max is exact, so a device reduction in any order gets the same bits) and
// whether all values are finite. Integer maxima need no serial chain of float compares, and sixteen
// independent lanes keep the loop vectorized. For host loops over a block; kernels reduce across a warp.
template <float_storage T>
inline std::uint32_t max_magnitude_bits(const T* values, std::int64_t count) noexcept {
  if constexpr (sizeof(T) == 2) {
    // bf16 / fp16: their magnitude bits sort the same way (Inf and NaN above every finite value) and widening
    // to float keeps that order, so the maximum is taken over the 16-bit patterns (which vectorizes well,
    // unlike a widening per value) and widened once.
    std::uint16_t lanes16[32] = {};
    const std::int64_t whole16 = count - count % 32;
    for (std::int64_t i = 0; i < whole16; i += 32)
      for (int j = 0; j < 32; ++j) {
        const std::uint16_t bits = values[i + j].bits & 0x7fffu;
        lanes16[j] = bits > lanes16[j] ? bits : lanes16[j];
      }
    std::uint16_t largest16 = 0;
    for (std::int64_t i = whole16; i < count; ++i) {
      const std::uint16_t bits = values[i].bits & 0x7fffu;
      largest16 = bits > largest16 ? bits : largest16;
    }
    for (std::uint16_t lane : lanes16) largest16 = lane > largest16 ? lane : largest16;
    return bit_cast<std::uint32_t>(to_float(bit_cast<T>(largest16))) & 0x7fffffffu;
  }
  std::uint32_t lanes[16] = {};
  const std::int64_t whole = count - count % 16;
  for (std::int64_t i = 0; i < whole; i += 16)
    for (int j = 0; j < 16; ++j) {
      const std::uint32_t bits = bit_cast<std::uint32_t>(to_float(values[i + j])) & 0x7fffffffu;
      lanes[j] = bits > lanes[j] ? bits : lanes[j];
    }
  std::uint32_t largest = 0;
  for (std::int64_t i = whole; i < count; ++i) {
    const std::uint32_t bits = bit_cast<std::uint32_t>(to_float(values[i])) & 0x7fffffffu;
    largest = bits > largest ? bits : largest;
  }
  for (std::uint32_t lane : lanes) largest = lane > largest ? lane : largest;
  return largest;
}

}  // namespace detail

MEMKIT_NAMESPACE_END
