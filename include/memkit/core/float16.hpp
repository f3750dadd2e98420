// memkit/core/float16.hpp — bf16 and fp16 storage types that work without CUDA.
//
// Both are 2-byte structs with the same bit layout as CUDA's __nv_bfloat16 and __half, so buffers
// of them can be handed to CUDA code and loaded from checkpoints as they are. Conversion from
// float rounds to nearest, ties to even, exactly as CUDA's __float2bfloat16 / __float2half do
// (including their canonical NaN 0x7FFF). The same integer code runs on host and device, so the
// two paths cannot round differently.
#pragma once

#include <cstdint>
#include <type_traits>

#include "memkit/config.hpp"

#if MEMKIT_HAS_CUDA
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

MEMKIT_NAMESPACE_BEGIN

namespace detail {
template <class To, class From>
MEMKIT_HOST_DEVICE constexpr To bit_cast(const From& from) noexcept {
  static_assert(sizeof(To) == sizeof(From));
  return __builtin_bit_cast(To, from);
}
}  // namespace detail

// Round-to-nearest-even float -> bf16 bits. bf16 keeps float's exponent range, so only the
// mantissa is rounded; a carry out of the mantissa correctly bumps the exponent (up to Inf).
MEMKIT_HOST_DEVICE constexpr std::uint16_t float_to_bf16_bits(float value) noexcept {
  const std::uint32_t u = detail::bit_cast<std::uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN
  const std::uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding_bias) >> 16);
}

MEMKIT_HOST_DEVICE constexpr float bf16_bits_to_float(std::uint16_t bits) noexcept {
  return detail::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

// Round-to-nearest-even float -> IEEE binary16 bits, with fp16's subnormals and overflow to Inf.
MEMKIT_HOST_DEVICE constexpr std::uint16_t float_to_fp16_bits(float value) noexcept {
  const std::uint32_t u = detail::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return 0x7fffu;                                   // NaN
  if (magnitude >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (magnitude >= 0x38800000u) {                                                // normal in fp16 (>= 2^-14)
    const std::uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | ((rounded - 0x38000000u) >> 13));  // rebias exponent 127 -> 15
  }
  // Subnormal in fp16: the result is round(value / 2^-24), an integer below 0x400 (or exactly 0x400).
  const std::uint32_t exponent = magnitude >> 23;
  if (exponent < 102) return static_cast<std::uint16_t>(sign);  // below 2^-25: rounds to zero
  const std::uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126u - exponent;  // 14..24
  std::uint32_t quotient = mantissa >> shift;
  const std::uint32_t remainder = mantissa & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1u);
  if (remainder > halfway || (remainder == halfway && (quotient & 1u))) ++quotient;
  return static_cast<std::uint16_t>(sign | quotient);
}

MEMKIT_HOST_DEVICE constexpr float fp16_bits_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1fu) return detail::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // Inf / NaN
  if (exponent != 0) return detail::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24 is exact in float.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

// Brain float: 1 sign, 8 exponent, 7 mantissa bits. A storage type: convert to float for math.
struct bf16 {
  std::uint16_t bits;

  bf16() = default;
  MEMKIT_HOST_DEVICE constexpr explicit bf16(float value) noexcept : bits(float_to_bf16_bits(value)) {}
  MEMKIT_HOST_DEVICE constexpr operator float() const noexcept { return bf16_bits_to_float(bits); }
  MEMKIT_HOST_DEVICE static constexpr bf16 from_bits(std::uint16_t raw) noexcept {
    bf16 out{};
    out.bits = raw;
    return out;
  }
};

// IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits.
struct fp16 {
  std::uint16_t bits;

  fp16() = default;
  MEMKIT_HOST_DEVICE constexpr explicit fp16(float value) noexcept : bits(float_to_fp16_bits(value)) {}
  MEMKIT_HOST_DEVICE constexpr operator float() const noexcept { return fp16_bits_to_float(bits); }
  MEMKIT_HOST_DEVICE static constexpr fp16 from_bits(std::uint16_t raw) noexcept {
    fp16 out{};
    out.bits = raw;
    return out;
  }
};

static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2);
static_assert(sizeof(fp16) == 2 && alignof(fp16) == 2);

// The element types memkit kernels read and write, and the one way they convert to/from float.
template <class T>
concept float_storage = std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, fp16>;

template <float_storage T>
MEMKIT_HOST_DEVICE constexpr float to_float(T value) noexcept {
  return static_cast<float>(value);
}

template <float_storage T>
MEMKIT_HOST_DEVICE constexpr T from_float(float value) noexcept {
  return T(value);
}

// Name of a storage type as safetensors spells its dtype.
template <float_storage T>
constexpr const char* dtype_name() noexcept {
  if constexpr (std::is_same_v<T, float>) return "F32";
  else if constexpr (std::is_same_v<T, bf16>) return "BF16";
  else return "F16";
}

#if MEMKIT_HAS_CUDA
static_assert(sizeof(bf16) == sizeof(__nv_bfloat16) && alignof(bf16) == alignof(__nv_bfloat16));
static_assert(sizeof(fp16) == sizeof(__half) && alignof(fp16) == alignof(__half));

MEMKIT_HOST_DEVICE inline __nv_bfloat16 to_cuda(bf16 value) noexcept {
  return __nv_bfloat16_raw{value.bits};
}
MEMKIT_HOST_DEVICE inline __half to_cuda(fp16 value) noexcept { return __half_raw{value.bits}; }
MEMKIT_HOST_DEVICE inline bf16 from_cuda(__nv_bfloat16 value) noexcept {
  return bf16::from_bits(static_cast<__nv_bfloat16_raw>(value).x);
}
MEMKIT_HOST_DEVICE inline fp16 from_cuda(__half value) noexcept {
  return fp16::from_bits(static_cast<__half_raw>(value).x);
}
#endif

MEMKIT_NAMESPACE_END
