// memkit/quant/formats.hpp — the vocabulary of blockwise quantization: formats, block sizes, what a code means.
//
// A tensor is flattened row-major and cut into blocks of `block_size` consecutive elements (a block may
// straddle rows). Each block keeps its absolute maximum in fp32; each value is multiplied by the block's
// reciprocal 1/absmax (computed once per block, as bitsandbytes does) and mapped to the nearest code.
// 4-bit formats pack two codes per byte, the element at the even flat index in the high nibble; an odd
// element count pads the last byte with the code of 0.0. The int8 format stores one byte per value, an
// index into the signed dynamic 8-bit map. Double-quantized scales (block_scales) quantize the fp32 absmax
// values once more, 256 blocks to a nested group.
//
// The per-element math (encode, decode, reciprocal, nested scale) is written here once, MEMKIT_HOST_DEVICE:
// the host loops and the CUDA kernels (quant/detail/) call the same functions, so both produce identical bytes.
// The operations themselves are in quant/blockwise.hpp (quantize / dequantize) and quant/matmul.hpp; the format
// enum, block sizes and the counts of codes and scales (block_count, code_bytes, nested_group_count) in
// quant/bytes.hpp, which memory_budget includes without the per-element math.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "memkit/config.hpp"
#include "memkit/core/rounded_math.hpp"
#include "memkit/quant/bytes.hpp"
#include "memkit/quant/codebooks.hpp"

// Full unrolling of the small fixed loops, in each compiler's spelling (nvcc's host pass accepts neither).
#if MEMKIT_DEVICE_PASS
#define MEMKIT_QUANT_UNROLL _Pragma("unroll")
#elif MEMKIT_HAS_CUDA
#define MEMKIT_QUANT_UNROLL
#else
#define MEMKIT_QUANT_UNROLL _Pragma("GCC unroll 16")
#endif

MEMKIT_NAMESPACE_BEGIN

namespace quant {

inline void require_block_size(std::int64_t block_size, const char* operation) {
  require(is_valid_block_size(block_size), std::string(operation) + ": block size " + std::to_string(block_size) +
                                               " is not supported (use a power of two from 32 to 4096)");
}

// --- per-element math, shared by host and device ---

namespace detail {
// The explicitly rounded operations shared with the rest of memkit (core/rounded_math.hpp), so that
// host and device round every step of the per-element math identically.
using memkit::detail::add_rn;
using memkit::detail::dadd_rn;
using memkit::detail::div_rn;
using memkit::detail::is_finite;
using memkit::detail::max_magnitude_bits;
using memkit::detail::mul_rn;
using memkit::detail::stored_product;
using memkit::detail::sub_rn;

MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float abs_value(float x) noexcept {
  return __builtin_bit_cast(float, __builtin_bit_cast(std::uint32_t, x) & 0x7fffffffu);
}
}  // namespace detail

// The block's scale factor: one IEEE division per block. For an all-zero block it is +Inf, every value
// becomes 0 * Inf = NaN and takes code 0, exactly as in bitsandbytes; the block decodes to zeros.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float block_reciprocal(float absmax) noexcept {
  return detail::div_rn(1.0f, absmax);
}

// The same code as nearest_dynamic (bitsandbytes' search), found without data-dependent branches: count
// the entries below x (branchless, 8 steps), then pick between the two neighbours by their float midpoint.
// bitsandbytes' search ends on a leaf p whose in-order neighbours p - 1 and p + 1 were its last left and
// right turns, so it compares exactly these two candidates, and on an exact tie it keeps p, which is
// always the even index of the two. The test suite checks the two functions agree.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE std::uint8_t nearest_dynamic_counting(const float* map, float x) noexcept {
  int below = 0;  // entries < x, 0..256
  MEMKIT_QUANT_UNROLL
  for (int step = 128; step > 0; step >>= 1) below += step & -static_cast<int>(map[below + step - 1] < x);
  if (below == 0) return 0;
  if (below == 256) return 255;
  const float midpoint = (map[below - 1] + map[below]) * 0.5f;
  const int even = (below - 1) & 1 ? below : below - 1;
  return static_cast<std::uint8_t>(x > midpoint ? below : x < midpoint ? below - 1 : even);
}

// Code of one value already multiplied by its block's reciprocal. `map` is the 256-entry map (int8 only).
template <format F>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE std::uint8_t encode(float normalized, const float* map) noexcept {
  if constexpr (F == format::nf4) {
    // bitsandbytes' comparison tree (the same strict `>`, so the same code, NaN included: code 0), with
    // selects instead of branches: four comparisons against the thresholds between codes, each picked
    // among compile-time constants by the outcomes so far.
    constexpr float t[15] = {-0.8480964004993439f,  -0.6106329262256622f, -0.4599952697753906f,
                             -0.33967943489551544f, -0.23460740596055984f, -0.13791173323988914f,
                             -0.045525018125772476f, 0.03979014977812767f, 0.1202552504837513f,
                             0.2035212516784668f,   0.2920137718319893f,  0.3893125355243683f,
                             0.5016634166240692f,   0.6427869200706482f,  0.8614784181118011f};
    const bool b8 = normalized > t[7];
    const bool b4 = normalized > (b8 ? t[11] : t[3]);
    const bool b2 = normalized > (b8 ? (b4 ? t[13] : t[9]) : (b4 ? t[5] : t[1]));
    const float last = b8 ? (b4 ? (b2 ? t[14] : t[12]) : (b2 ? t[10] : t[8]))
                          : (b4 ? (b2 ? t[6] : t[4]) : (b2 ? t[2] : t[0]));
    const bool b1 = normalized > last;
    return static_cast<std::uint8_t>((b8 ? 8 : 0) | (b4 ? 4 : 0) | (b2 ? 2 : 0) | (b1 ? 1 : 0));
  } else if constexpr (F == format::fp4) {
    constexpr float t[7] = {0.00260417f, 0.0859375f, 0.20833333f, 0.29166667f, 0.4166667f, 0.583333f, 0.8333333f};
    const float magnitude = detail::abs_value(normalized);
    // The magnitude's rank among the thresholds, by the same kind of tree (3 comparisons).
    const bool r4 = magnitude > t[3];
    const bool r2 = magnitude > (r4 ? t[5] : t[1]);
    const bool r1 = magnitude > (r4 ? (r2 ? t[6] : t[4]) : (r2 ? t[2] : t[0]));
    const int rank = (r4 ? 4 : 0) | (r2 ? 2 : 0) | (r1 ? 1 : 0);
    // Magnitude rank 0..7 to FP4 bits: 0, 1, 6, 7, 4, 5, 2, 3 (flip bit 2 where bit 1 is set).
    const int bits = rank ^ ((rank & 2) << 1);
    return static_cast<std::uint8_t>(bits | (normalized < 0.0f ? 0b1000 : 0));
  } else {
    return nearest_dynamic_counting(map, normalized);
  }
}

// Unscaled value of a code.
template <format F>
MEMKIT_HOST_DEVICE constexpr float code_value(std::uint8_t code, const float* map) noexcept {
  if constexpr (F == format::nf4) return nf4_value(code);
  else if constexpr (F == format::fp4) return fp4_value(code);
  else return map[code];
}

// The 16 values of a 4-bit format as code_value gives them (FP4 code 8 is -0), for host loops.
template <format F>
inline constexpr std::array<float, 16> four_bit_values = [] {
  std::array<float, 16> values{};
  for (int c = 0; c < 16; ++c) values[static_cast<std::size_t>(c)] = code_value<F>(static_cast<std::uint8_t>(c), nullptr);
  return values;
}();

// Decoded value: the code's value times the block's absmax (one rounding, as bitsandbytes).
template <format F>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float decode(std::uint8_t code, float absmax, const float* map) noexcept {
  return detail::stored_product(code_value<F>(code, map), absmax);
}

// Code of flat element `index` in a packed code array.
template <format F>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE std::uint8_t code_at(const std::uint8_t* codes, std::int64_t index) noexcept {
  if constexpr (F == format::int8) return codes[index];
  else return static_cast<std::uint8_t>((index & 1) ? (codes[index >> 1] & 0x0f) : (codes[index >> 1] >> 4));
}

// The default map of the int8 format, as a by-value table for kernels.
inline constexpr code_table<256> signed_dynamic_table = make_code_table(dynamic_map_signed);

// A double-quantized scale: the nested code's map value times its group's fp32 absmax, rounded, plus the
// offset, rounded (bitsandbytes dequantizes the nested codes, then adds the offset as a second operation).
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float decode_nested_scale(std::uint8_t nested_code, float nested_absmax,
                                                                float offset, const float* nested_map) noexcept {
  return detail::add_rn(detail::mul_rn(nested_map[nested_code], nested_absmax), offset);
}

// Where the per-block scales of a quantized tensor come from: plain fp32 absmax, or double-quantized ones
// (uint8 nested codes, one fp32 absmax per 256 blocks, an fp32 offset). Trivially copyable, for kernels too.
struct block_scales {
  const float* absmax = nullptr;               // plain scales, or nullptr when nested
  const std::uint8_t* nested_codes = nullptr;  // double quantization:
  const float* nested_absmax = nullptr;        //   one per nested_block_size blocks
  const float* offset = nullptr;               //   one value
  const float* nested_map = nullptr;           //   256 entries (kernels point this at shared memory)

  MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE bool nested() const noexcept { return nested_codes != nullptr; }
  MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float operator()(std::int64_t block) const noexcept {
    if (nested_codes == nullptr) return absmax[block];
    return nested_scale(block, *offset);
  }
  // A double-quantized block's scale, the offset already read (a kernel reads it once, not per block).
  MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float nested_scale(std::int64_t block, float offset_value) const noexcept {
    return decode_nested_scale(nested_codes[block], nested_absmax[block / nested_block_size], offset_value, nested_map);
  }
};

namespace detail {

// Calls body.template operator()<F>() with the runtime format as a template argument.
template <class Body>
decltype(auto) dispatch_format(format f, Body&& body) {
  switch (f) {
    case format::nf4: return body.template operator()<format::nf4>();
    case format::fp4: return body.template operator()<format::fp4>();
    case format::int8: break;
  }
  return body.template operator()<format::int8>();
}
}  // namespace detail

}  // namespace quant

MEMKIT_NAMESPACE_END
