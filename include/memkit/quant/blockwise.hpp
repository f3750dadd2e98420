// memkit/quant/blockwise.hpp — blockwise NF4 / FP4 / dynamic-int8 quantization, host and CUDA.
//
// A tensor is flattened row-major and cut into blocks of `block_size` consecutive elements (a block may
// straddle rows). Each block keeps its absolute maximum in fp32; each value is multiplied by the block's
// reciprocal 1/absmax (computed once per block, as bitsandbytes does) and mapped to the nearest code.
// 4-bit formats pack two codes per byte, the element at the even flat index in the high nibble; an odd
// element count pads the last byte with the code of 0.0. The int8 format stores one byte per value, an
// index into the signed dynamic 8-bit map. Results match bitsandbytes bit for bit.
//
// The per-element math (encode, decode, reciprocal) is written once, MEMKIT_HOST_DEVICE, and both the host
// loops and the CUDA kernels call it, so both paths produce identical bytes.
//
// Non-finite input: the host path throws memkit::error naming the tensor, the element and the block; it
// checks each group of blocks (up to max_block_size values) in the same pass that finds their absmax, before
// writing any of the group, so the input is read once (groups before the offending one are already written).
// The CUDA path cannot throw without synchronizing, so it marks the offending block by storing NaN as its
// absmax (every value of that block then decodes to NaN, never to silent garbage);
// find_nonfinite_block() locates it after the stream is synchronized (quantized_tensor does this for you).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/device_vector.hpp"
#include "memkit/core/checked_math.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/rounded_math.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/core/units.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/quant/codebooks.hpp"
#include "memkit/quant/dynamic_index.hpp"

// Host SIMD (x86-64 with GCC or Clang, outside nvcc), selected per CPU at run time.
#if !MEMKIT_HAS_CUDA && defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define MEMKIT_QUANT_X86_SIMD 1
#else
#define MEMKIT_QUANT_X86_SIMD 0
#endif

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

enum class format : std::uint8_t {
  nf4,   // 4-bit normal float (QLoRA)
  fp4,   // 4-bit float, bitsandbytes' e2m1 variant
  int8,  // 8-bit index into the signed dynamic map ("blockwise int8" of bitsandbytes' quantize_blockwise)
};

constexpr const char* to_string(format f) noexcept {
  switch (f) {
    case format::nf4: return "nf4";
    case format::fp4: return "fp4";
    case format::int8: return "int8";
  }
  return "unknown";
}

MEMKIT_HOST_DEVICE constexpr bool is_four_bit(format f) noexcept { return f != format::int8; }

inline constexpr std::int64_t min_block_size = 32;
inline constexpr std::int64_t max_block_size = 4096;

constexpr bool is_valid_block_size(std::int64_t block_size) noexcept {
  return block_size >= min_block_size && block_size <= max_block_size && (block_size & (block_size - 1)) == 0;
}

inline void require_block_size(std::int64_t block_size, const char* operation) {
  require(is_valid_block_size(block_size), std::string(operation) + ": block size " + std::to_string(block_size) +
                                               " is not supported (use a power of two from 32 to 4096)");
}

// Number of blocks (and so of absmax values) for `numel` elements.
MEMKIT_HOST_DEVICE constexpr std::int64_t block_count(std::int64_t numel, std::int64_t block_size) noexcept {
  return (numel + block_size - 1) / block_size;
}

// Bytes of codes for `numel` elements.
MEMKIT_HOST_DEVICE constexpr std::int64_t code_bytes(format f, std::int64_t numel) noexcept {
  return is_four_bit(f) ? (numel + 1) / 2 : numel;
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

namespace detail {
// Weights per 16 bytes of codes.
template <format F>
inline constexpr int codes_per_16_bytes = F == format::int8 ? 16 : 32;
}  // namespace detail

// Block size of the second quantization level of double-quantized scales (bitsandbytes' "nested" state).
inline constexpr std::int64_t nested_block_size = 256;

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

// --- x86 SIMD for the host loops, chosen at run time (no compile flags needed) ---
//
// The 4-bit dequantization is a 16-entry table lookup per value: SSSE3's byte shuffle does 16 of them per
// instruction on the bytes of the block's already-converted table, so the results are the same bytes the
// scalar loop writes. Plain g++ only: nvcc's host pass and other targets take the scalar loops.
#if MEMKIT_QUANT_X86_SIMD
inline bool cpu_has_ssse3() noexcept {
  static const bool has = __builtin_cpu_supports("ssse3");
  return has;
}

// bf16 bits of 16 floats, the same round-to-nearest-even (and canonical NaN) as float_to_bf16_bits,
// four at a time with SSE2 integer operations (baseline x86-64).
inline void bf16_bits_x16(const float* in, std::uint16_t* out) noexcept {
  const __m128i magnitude_mask = _mm_set1_epi32(0x7fffffff), infinity = _mm_set1_epi32(0x7f800000);
  const __m128i half_minus_one = _mm_set1_epi32(0x7fff), one = _mm_set1_epi32(1), bias16 = _mm_set1_epi32(0x8000);
  __m128i packed[2];
  for (int pair = 0; pair < 2; ++pair) {
    __m128i result[2];
    for (int q = 0; q < 2; ++q) {
      const __m128i u = _mm_castps_si128(_mm_loadu_ps(in + 8 * pair + 4 * q));
      const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, magnitude_mask), infinity);
      const __m128i rounding = _mm_add_epi32(half_minus_one, _mm_and_si128(_mm_srli_epi32(u, 16), one));
      const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(u, rounding), 16);
      const __m128i bits = _mm_or_si128(_mm_and_si128(nan, half_minus_one), _mm_andnot_si128(nan, rounded));
      result[q] = _mm_sub_epi32(bits, bias16);  // into signed 16-bit range for the saturating pack
    }
    packed[pair] = _mm_xor_si128(_mm_packs_epi32(result[0], result[1]), _mm_set1_epi16(static_cast<short>(0x8000)));
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed[0]);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), packed[1]);
}

inline bool cpu_has_avx512bw() noexcept {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has;
}

// encode<F>'s thresholds, for the vector encoders.
inline constexpr float nf4_thresholds[15] = {-0.8480964004993439f,  -0.6106329262256622f, -0.4599952697753906f,
                                             -0.33967943489551544f, -0.23460740596055984f, -0.13791173323988914f,
                                             -0.045525018125772476f, 0.03979014977812767f, 0.1202552504837513f,
                                             0.2035212516784668f,   0.2920137718319893f,  0.3893125355243683f,
                                             0.5016634166240692f,   0.6427869200706482f,  0.8614784181118011f};
inline constexpr float fp4_thresholds[7] = {0.00260417f, 0.0859375f, 0.20833333f, 0.29166667f,
                                            0.4166667f,  0.583333f,  0.8333333f};

// The thresholds of a 4-bit format padded to 16 with +Inf, which no value exceeds. encode<F> counts the
// thresholds below a value; over sorted thresholds a binary search with the same strict, ordered `>` finds
// the same count (NaN exceeds none: code 0) in 4 steps instead of 15 compares.
template <format F>
inline constexpr std::array<float, 16> padded_thresholds = [] {
  std::array<float, 16> padded{};
  for (int k = 0; k < 16; ++k) {
    const int count = F == format::nf4 ? 15 : 7;
    padded[static_cast<std::size_t>(k)] = k < count ? (F == format::nf4 ? nf4_thresholds[k] : fp4_thresholds[k])
                                                    : std::numeric_limits<float>::infinity();
  }
  return padded;
}();

// The binary search over padded_thresholds<F> probes, at the step of size s, the entry code + s - 1, where
// `code` has only bits of weight >= 2s set. These tables hold that entry at index `code` (step 4, 2, 1; the
// first step compares with one broadcast threshold), so each step is one permute and no index arithmetic.
template <format F>
inline constexpr std::array<std::array<float, 16>, 3> step_tables = [] {
  std::array<std::array<float, 16>, 3> tables{};
  const int steps[3] = {4, 2, 1};
  for (int t = 0; t < 3; ++t)
    for (int c = 0; c < 16; ++c) {
      const int probe = c + steps[t] - 1;
      tables[static_cast<std::size_t>(t)][static_cast<std::size_t>(c)] =
          padded_thresholds<F>[static_cast<std::size_t>(probe < 16 ? probe : 15)];
    }
  return tables;
}();

// The same tables for the AVX2 search, which keeps `code / 2` (0..7) to index one 8-entry permute:
// entry j of table t is the probe of code 2j.
template <format F>
inline constexpr std::array<std::array<float, 8>, 3> half_step_tables = [] {
  std::array<std::array<float, 8>, 3> tables{};
  for (int t = 0; t < 3; ++t)
    for (int j = 0; j < 8; ++j)
      tables[static_cast<std::size_t>(t)][static_cast<std::size_t>(j)] =
          step_tables<F>[static_cast<std::size_t>(t)][static_cast<std::size_t>(2 * j)];
  return tables;
}();

// 16 values widened to fp32 (exactly, as to_float does).
template <class T>
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16_as_float_avx512(const T* values) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(values);
  } else if constexpr (std::is_same_v<T, bf16>) {
    const __m512i wide = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, wide, 16));
  } else {
    return _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
  }
}

// The AVX-512 encoder's tables. Cut [-1, 1) (NF4) or the magnitudes [0, 1) (FP4) into cells of width 1/16:
// none holds more than one threshold (the thresholds are further apart), so the code of x is the count of
// thresholds below x's cell plus x > (the cell's threshold, or +Inf). The thresholds are kept times 16,
// compared with 16 * x (both exact: a power of two), whose floor is the cell.
struct four_bit_cells {
  std::array<float, 32> threshold16{};  // 16 * the threshold inside the cell, or +Inf
  std::array<std::int32_t, 32> base{};  // thresholds below the cell
};

template <format F>
inline constexpr four_bit_cells cells = [] {
  four_bit_cells t;
  const int count = F == format::nf4 ? 15 : 7;
  for (int cell = 0; cell < 32; ++cell) {
    const double low = F == format::nf4 ? (cell - 16) / 16.0 : cell / 16.0, high = low + 1.0 / 16.0;
    int inside = 0;
    t.threshold16[static_cast<std::size_t>(cell)] = std::numeric_limits<float>::infinity();
    for (int k = 0; k < count; ++k) {
      const double threshold = padded_thresholds<F>[static_cast<std::size_t>(k)];
      if (threshold < low) ++t.base[static_cast<std::size_t>(cell)];
      else if (threshold < high) {
        t.threshold16[static_cast<std::size_t>(cell)] = padded_thresholds<F>[static_cast<std::size_t>(k)] * 16.0f;
        ++inside;
      }
    }
    if (inside > 1) throw "memkit: two 4-bit thresholds in one cell";  // not a constant expression: no build
  }
  return t;
}();

// encode<F>'s codes of 16 values already multiplied by the reciprocal, in int32 lanes. The cell's floor is
// taken of 16 * x clamped to [-16, 15.5] (NF4) or [0, 15.5] (FP4 magnitudes): +-Inf land in the end cells, NaN
// (vmaxps returns the bound) in the first, whose code 0 no NaN exceeds, as in encode<F>'s strict `>`.
template <format F>
__attribute__((target("avx512f,avx512bw"))) inline __m512i codes16_avx512(__m512 normalized) noexcept {
  const __m512 x = F == format::nf4 ? normalized
                                    : _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(normalized),
                                                                           _mm512_set1_epi32(0x7fffffff)));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(16.0f));
  const __m512 clamped = _mm512_maskz_min_ps(0xffff, _mm512_maskz_max_ps(0xffff, y, _mm512_set1_ps(F == format::nf4 ? -16.0f : 0.0f)),
                                       _mm512_set1_ps(15.5f));
  __m512i cell = _mm512_maskz_cvt_roundps_epi32(0xffff, clamped, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 threshold;
  __m512i code;
  if constexpr (F == format::nf4) {
    cell = _mm512_add_epi32(cell, _mm512_set1_epi32(16));
    threshold = _mm512_permutex2var_ps(_mm512_loadu_ps(cells<F>.threshold16.data()), cell,
                                       _mm512_loadu_ps(cells<F>.threshold16.data() + 16));
    code = _mm512_permutex2var_epi32(_mm512_loadu_si512(cells<F>.base.data()), cell,
                                     _mm512_loadu_si512(cells<F>.base.data() + 16));
  } else {
    threshold = _mm512_maskz_permutexvar_ps(0xffff, cell, _mm512_loadu_ps(cells<F>.threshold16.data()));
    code = _mm512_maskz_permutexvar_epi32(0xffff, cell, _mm512_loadu_si512(cells<F>.base.data()));
  }
  code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(y, threshold, _CMP_GT_OQ), code, _mm512_set1_epi32(1));
  if constexpr (F == format::fp4) {
    // Magnitude rank 0..7 to FP4 bits (flip bit 2 where bit 1 is set), the sign in bit 3.
    code = _mm512_xor_si512(code, _mm512_maskz_slli_epi32(0xffff, _mm512_and_si512(code, _mm512_set1_epi32(2)), 1));
    code = _mm512_mask_or_epi32(code, _mm512_cmp_ps_mask(normalized, _mm512_setzero_ps(), _CMP_LT_OQ), code,
                                _mm512_set1_epi32(8));
  }
  return code;
}

// 4-bit encoding of `blocks` whole blocks of `block_size` values (a multiple of 16), block b scaled by
// reciprocals[b] (one IEEE multiply per value), two codes per byte, the even value in the high nibble.
// Same codes as the scalar loop; the tests compare them.
// `ahead` points as far past `values` as the next group starts (or at `values` for the last group): its
// lines are prefetched while this group is encoded, so that reading the next group overlaps this work.
template <format F, class T>
__attribute__((target("avx512f,avx512bw"))) void encode4_blocks_avx512(const T* values, std::int64_t blocks,
                                                                      std::int64_t block_size, const float* reciprocals,
                                                                      std::uint8_t* out, const T* ahead) noexcept {
  for (std::int64_t b = 0; b < blocks; ++b) {
    const __m512 scale = _mm512_set1_ps(reciprocals[b]);
    const T* block = values + b * block_size;
    std::uint8_t* block_out = out + b * block_size / 2;
    for (std::int64_t i = 0; i < block_size; i += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + b * block_size + i), _MM_HINT_T0);
      const __m512i code = codes16_avx512<F>(_mm512_mul_ps(load16_as_float_avx512(block + i), scale));
      // As 64-bit lanes (even code low, odd code high): even << 4 | odd in each lane's low byte.
      const __m512i pairs = _mm512_or_si512(_mm512_maskz_slli_epi64(0xff, code, 4), _mm512_maskz_srli_epi64(0xff, code, 32));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(block_out + i / 2), _mm512_maskz_cvtepi64_epi8(0xff, pairs));
    }
  }
}

// The low bytes of 8 int32 lanes holding 0..255, in order, in the low 8 bytes.
__attribute__((target("avx2"))) inline __m128i low_bytes_of_lanes_avx2(__m256i lanes) noexcept {
  const __m256i gather = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(lanes, gather);
  return _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
}

// 8 values widened to fp32 (exactly, as to_float does).
template <class T>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8_as_float_avx2(const T* values) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(values);
  } else if constexpr (std::is_same_v<T, bf16>) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
  }
}

// `weight` in the lanes where x > probe, else 0.
__attribute__((target("avx2"))) inline __m256i weight_above_avx2(__m256 x, __m256 probe, int weight) noexcept {
  return _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(x, probe, _CMP_GT_OQ)), _mm256_set1_epi32(weight));
}

// codes16_avx512's AVX2 sibling for 8 values: the same binary search, holding code / 2 so that every probe
// is one 8-entry permute of half_step_tables (the last step's comparison gives the code's low bit).
template <format F>
__attribute__((target("avx2,fma"))) inline __m256i codes8_avx2(__m256 normalized) noexcept {
  const __m256 t4 = _mm256_loadu_ps(half_step_tables<F>[0].data()), t2 = _mm256_loadu_ps(half_step_tables<F>[1].data()),
               t1 = _mm256_loadu_ps(half_step_tables<F>[2].data());
  const __m256 x = F == format::nf4 ? normalized
                                    : _mm256_and_ps(normalized, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  __m256i half;  // code / 2
  if constexpr (F == format::nf4) {
    half = weight_above_avx2(x, _mm256_set1_ps(padded_thresholds<F>[7]), 4);
    half = _mm256_add_epi32(half, weight_above_avx2(x, _mm256_permutevar8x32_ps(t4, half), 2));
  } else {
    half = weight_above_avx2(x, _mm256_set1_ps(padded_thresholds<F>[3]), 2);
  }
  half = _mm256_add_epi32(half, weight_above_avx2(x, _mm256_permutevar8x32_ps(t2, half), 1));
  __m256i code = _mm256_add_epi32(_mm256_add_epi32(half, half), weight_above_avx2(x, _mm256_permutevar8x32_ps(t1, half), 1));
  if constexpr (F == format::fp4) {
    code = _mm256_xor_si256(code, _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(2)), 1));
    const __m256i negative = _mm256_castps_si256(_mm256_cmp_ps(normalized, _mm256_setzero_ps(), _CMP_LT_OQ));
    code = _mm256_or_si256(code, _mm256_and_si256(negative, _mm256_set1_epi32(8)));
  }
  return code;
}

// encode4_blocks_avx512's AVX2 + FMA sibling, 16 values (two vectors of 8) per step: the same multiply,
// the same search, the same codes.
template <format F, class T>
__attribute__((target("avx2,fma,f16c"))) void encode4_blocks_avx2(const T* values, std::int64_t blocks,
                                                                 std::int64_t block_size, const float* reciprocals,
                                                                 std::uint8_t* out, const T* ahead) noexcept {
  for (std::int64_t b = 0; b < blocks; ++b) {
    const __m256 scale = _mm256_set1_ps(reciprocals[b]);
    const T* block = values + b * block_size;
    std::uint8_t* block_out = out + b * block_size / 2;
    for (std::int64_t i = 0; i < block_size; i += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + b * block_size + i), _MM_HINT_T0);
      const __m128i codes16 =
          _mm_unpacklo_epi64(low_bytes_of_lanes_avx2(codes8_avx2<F>(_mm256_mul_ps(load8_as_float_avx2(block + i), scale))),
                             low_bytes_of_lanes_avx2(codes8_avx2<F>(_mm256_mul_ps(load8_as_float_avx2(block + i + 8), scale))));
      // 16 codes -> 8 bytes, the even value in the high nibble.
      const __m128i pairs16 = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(codes16, _mm_set1_epi16(0x00ff)), 4),
                                           _mm_srli_epi16(codes16, 8));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(block_out + i / 2), _mm_packus_epi16(pairs16, _mm_setzero_si128()));
    }
  }
}

// max_magnitude_bits of each of `blocks` whole blocks of `block_size` values (a multiple of 32), into bits[].
template <class T>
__attribute__((target("avx512f,avx512bw"))) void block_max_bits_avx512(const T* values, std::int64_t blocks,
                                                                      std::int64_t block_size, std::uint32_t* bits) noexcept {
  for (std::int64_t b = 0; b < blocks; ++b) {
    const T* block = values + b * block_size;
    if constexpr (sizeof(T) == 4) {
      const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
      __m512i a = _mm512_setzero_si512(), c = _mm512_setzero_si512();
      for (std::int64_t i = 0; i < block_size; i += 32) {
        a = _mm512_maskz_max_epu32(0xffff, a, _mm512_and_si512(_mm512_loadu_si512(block + i), magnitude));
        c = _mm512_maskz_max_epu32(0xffff, c, _mm512_and_si512(_mm512_loadu_si512(block + i + 16), magnitude));
      }
      a = _mm512_maskz_max_epu32(0xffff, a, c);
      __m256i h = _mm256_max_epu32(_mm512_maskz_extracti64x4_epi64(0xff, a, 0), _mm512_maskz_extracti64x4_epi64(0xff, a, 1));
      __m128i q = _mm_max_epu32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
      q = _mm_max_epu32(q, _mm_shuffle_epi32(q, 0x4e));
      q = _mm_max_epu32(q, _mm_shuffle_epi32(q, 0xb1));
      bits[b] = static_cast<std::uint32_t>(_mm_cvtsi128_si32(q));
    } else {
      // 16-bit formats: the maximum over magnitude patterns (their order is the values' order), widened once.
      const __m512i magnitude = _mm512_set1_epi16(0x7fff);
      __m512i a = _mm512_setzero_si512();
      for (std::int64_t i = 0; i < block_size; i += 32)
        a = _mm512_maskz_max_epu16(0xffffffff, a, _mm512_and_si512(_mm512_loadu_si512(block + i), magnitude));
      const __m256i h = _mm256_max_epu16(_mm512_maskz_extracti64x4_epi64(0xff, a, 0), _mm512_maskz_extracti64x4_epi64(0xff, a, 1));
      const __m128i q = _mm_max_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
      // The maximum of 8 words is the complement of the minimum of their complements.
      const __m128i ones = _mm_set1_epi32(-1);
      const auto largest = static_cast<std::uint16_t>(~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(q, ones))));
      bits[b] = ::memkit::detail::bit_cast<std::uint32_t>(to_float(::memkit::detail::bit_cast<T>(largest))) & 0x7fffffffu;
    }
  }
}

template <class T>
__attribute__((target("avx2"))) void block_max_bits_avx2(const T* values, std::int64_t blocks, std::int64_t block_size,
                                                         std::uint32_t* bits) noexcept {
  for (std::int64_t b = 0; b < blocks; ++b) {
    const T* block = values + b * block_size;
    __m128i q;
    if constexpr (sizeof(T) == 4) {
      const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
      __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();
      for (std::int64_t i = 0; i < block_size; i += 16) {
        a = _mm256_max_epu32(a, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + i)), magnitude));
        c = _mm256_max_epu32(c, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + i + 8)), magnitude));
      }
      a = _mm256_max_epu32(a, c);
      q = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
      q = _mm_max_epu32(q, _mm_shuffle_epi32(q, 0x4e));
      q = _mm_max_epu32(q, _mm_shuffle_epi32(q, 0xb1));
      bits[b] = static_cast<std::uint32_t>(_mm_cvtsi128_si32(q));
    } else {
      const __m256i magnitude = _mm256_set1_epi16(0x7fff);
      __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();
      for (std::int64_t i = 0; i < block_size; i += 32) {
        a = _mm256_max_epu16(a, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + i)), magnitude));
        c = _mm256_max_epu16(c, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + i + 16)), magnitude));
      }
      a = _mm256_max_epu16(a, c);
      q = _mm_max_epu16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
      const auto largest = static_cast<std::uint16_t>(~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(q, _mm_set1_epi32(-1)))));
      bits[b] = ::memkit::detail::bit_cast<std::uint32_t>(to_float(::memkit::detail::bit_cast<T>(largest))) & 0x7fffffffu;
    }
  }
}

// Expands `pairs` code bytes (two values each, high nibble first) into values of `Bytes` bytes each,
// looking them up in `table` (16 entries of Bytes bytes). Handles whole groups of 16 bytes; returns how
// many bytes it consumed.
template <int Bytes>
__attribute__((target("ssse3"))) inline std::int64_t expand_nibbles_ssse3(const std::uint8_t* bytes, std::int64_t pairs,
                                                                          const void* table, void* output) noexcept {
  static_assert(Bytes == 2 || Bytes == 4);
  // Split the table into byte planes: plane[b] holds byte b of entries 0..15.
  const auto* entries = static_cast<const __m128i*>(table);
  __m128i plane[Bytes];
  if constexpr (Bytes == 2) {
    const __m128i first = _mm_loadu_si128(entries), second = _mm_loadu_si128(entries + 1);
    const __m128i low_byte = _mm_set1_epi16(0x00ff);
    plane[0] = _mm_packus_epi16(_mm_and_si128(first, low_byte), _mm_and_si128(second, low_byte));
    plane[1] = _mm_packus_epi16(_mm_srli_epi16(first, 8), _mm_srli_epi16(second, 8));
  } else {
    // Within each 4-entry vector gather byte 0 of every entry, then byte 1, ...; then transpose the four
    // vectors' 32-bit groups so that plane[b] lists byte b of all 16 entries.
    const __m128i gather = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m128i v[4];
    for (int q = 0; q < 4; ++q) v[q] = _mm_shuffle_epi8(_mm_loadu_si128(entries + q), gather);
    const __m128i t0 = _mm_unpacklo_epi32(v[0], v[1]), t1 = _mm_unpackhi_epi32(v[0], v[1]);
    const __m128i t2 = _mm_unpacklo_epi32(v[2], v[3]), t3 = _mm_unpackhi_epi32(v[2], v[3]);
    plane[0] = _mm_unpacklo_epi64(t0, t2);
    plane[1] = _mm_unpackhi_epi64(t0, t2);
    plane[2] = _mm_unpacklo_epi64(t1, t3);
    plane[3] = _mm_unpackhi_epi64(t1, t3);
  }
  const __m128i low_nibble = _mm_set1_epi8(0x0f);
  auto* out = static_cast<std::uint8_t*>(output);
  std::int64_t p = 0;
  for (; p + 16 <= pairs; p += 16) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + p));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibble);
    const __m128i low = _mm_and_si128(packed, low_nibble);
    const __m128i index[2] = {_mm_unpacklo_epi8(high, low), _mm_unpackhi_epi8(high, low)};  // values 0..15, 16..31
    std::uint8_t* dst = out + 2 * p * Bytes;
    for (int half = 0; half < 2; ++half) {
      if constexpr (Bytes == 2) {
        const __m128i b0 = _mm_shuffle_epi8(plane[0], index[half]);
        const __m128i b1 = _mm_shuffle_epi8(plane[1], index[half]);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * half), _mm_unpacklo_epi8(b0, b1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * half + 16), _mm_unpackhi_epi8(b0, b1));
      } else {
        const __m128i b0 = _mm_shuffle_epi8(plane[0], index[half]);
        const __m128i b1 = _mm_shuffle_epi8(plane[1], index[half]);
        const __m128i b2 = _mm_shuffle_epi8(plane[2], index[half]);
        const __m128i b3 = _mm_shuffle_epi8(plane[3], index[half]);
        const __m128i lo01 = _mm_unpacklo_epi8(b0, b1), hi01 = _mm_unpackhi_epi8(b0, b1);
        const __m128i lo23 = _mm_unpacklo_epi8(b2, b3), hi23 = _mm_unpackhi_epi8(b2, b3);
        std::uint8_t* d = dst + 64 * half;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm_unpacklo_epi16(lo01, lo23));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16), _mm_unpackhi_epi16(lo01, lo23));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 32), _mm_unpacklo_epi16(hi01, hi23));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 48), _mm_unpackhi_epi16(hi01, hi23));
      }
    }
  }
  return p;
}

// --- vector dequantization (AVX-512 and AVX2 + FMA, chosen at run time) ---
//
// Each kernel takes elements [first, first + count) (4-bit: `first` even) into out[0, count) in chunks of 16
// or 32 values that start anywhere, so a chunk may straddle one block boundary (blocks hold at least 32
// values): its lanes past the boundary take the next block's values, by a blend. The caller starts the
// kernels where `out` is 64-byte aligned, so every chunk's stores fill whole (fp32: one line per 16 values)
// or half lines. Each returns how many elements it wrote (whole chunks); the caller writes the rest.
// 4-bit: per block, the 16 decoded values (the products decode() forms, four_bit_values<F>[c] * absmax) in
// the output type, then one in-register table permute per 16 (fp32) or 32 (bf16) values. int8: per value the
// map entry (256 entries: 8 two-table permutes and a blend tree on AVX-512, 8 loads per 8 values on AVX2),
// times the block's absmax, then converted.
// Non-temporal stores were measured and are not used: on the Cascade Lake of docs/performance.md they made
// the fp32 output 15-20% slower and the bf16 one no faster, at 32-64 MiB of output.

// from_float<bf16>'s bits (float_to_bf16_bits: round to nearest even, NaN -> 0x7fff) of 16 floats. (The
// zero-masked forms: GCC 12 warns about the unmasked ones' undefined pass-through operand.)
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m256i bf16_bits16_avx512(__m512 values) noexcept {
  const __m512i u = _mm512_castps_si512(values);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i rounding = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_maskz_srli_epi32(0xffff, u, 16), _mm512_set1_epi32(1)));
  const __m512i bits = _mm512_mask_mov_epi32(_mm512_maskz_srli_epi32(0xffff, _mm512_add_epi32(u, rounding), 16), nan, _mm512_set1_epi32(0x7fff));
  return _mm512_maskz_cvtepi32_epi16(0xffff, bits);
}

// The 4-bit codes of 16 values at element e (even) as 16 bytes, value order; only the low 4 bits of each
// byte are the code (the rest is the neighbouring nibble, which the table permutes ignore).
inline __m128i nibbles16(const std::uint8_t* codes, std::int64_t e) noexcept {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (e >> 1)));
  return _mm_unpacklo_epi8(_mm_srli_epi16(bytes, 4), bytes);
}

// Block b's 16 decoded values in the output type T: fp32 lanes, or bf16 words repeated in both halves (the
// word permute reads 5 index bits; the 5th is the neighbouring nibble's).
template <format F, class T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i table4_avx512(float scale) noexcept {
  __m512 base = _mm512_loadu_ps(four_bit_values<F>.data());
  // Hidden from the optimizer, which could otherwise form a negative entry's product as -(|v| * scale): the
  // same number, but for a NaN scale a NaN of the other sign than decode()'s (g++ 12 did, for FP4).
  __asm__("" : "+v"(base));
  const __m512 decoded = _mm512_mul_ps(base, _mm512_set1_ps(scale));
  if constexpr (std::is_same_v<T, float>) return _mm512_castps_si512(decoded);
  else return _mm512_maskz_broadcast_i64x4(0xff, bf16_bits16_avx512(decoded));
}

// The values of the chunk at element e (fp32: 16, bf16: 32) looked up in table4_avx512's table.
template <class T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i lookup4_avx512(const std::uint8_t* codes, std::int64_t e,
                                                                                   __m512i table) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_castps_si512(_mm512_maskz_permutexvar_ps(0xffff, _mm512_maskz_cvtepu8_epi32(0xffff, nibbles16(codes, e)),
                                                           _mm512_castsi512_ps(table)));
  } else {
    const __m256i nibbles = _mm256_inserti128_si256(_mm256_castsi128_si256(nibbles16(codes, e)), nibbles16(codes, e + 16), 1);
    return _mm512_maskz_permutexvar_epi16(0xffffffff, _mm512_maskz_cvtepu8_epi16(0xffffffff, nibbles), table);
  }
}

template <format F, class T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) std::int64_t dequantize4_avx512(
    const std::uint8_t* codes, const block_scales& scales, int block_shift, std::int64_t first, std::int64_t count,
    T* out) noexcept {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>);
  constexpr std::int64_t chunk = std::is_same_v<T, float> ? 16 : 32;
  std::int64_t block = -1;
  __m512i table = _mm512_setzero_si512();
  std::int64_t k = 0;
  for (; k + chunk <= count; k += chunk) {
    const std::int64_t e = first + k;
    const std::int64_t b = e >> block_shift;
    if (b != block) {
      block = b;
      table = table4_avx512<F, T>(scales(b));
    }
    __m512i v = lookup4_avx512<T>(codes, e, table);
    const std::int64_t split = ((b + 1) << block_shift) - e;  // values still in block b
    if (split < chunk) {  // the next block's table, kept for the next chunk
      block = b + 1;
      table = table4_avx512<F, T>(scales(b + 1));
      const __m512i next = lookup4_avx512<T>(codes, e, table);
      if constexpr (std::is_same_v<T, float>) v = _mm512_mask_blend_epi32(static_cast<__mmask16>(0xffffu << split), v, next);
      else v = _mm512_mask_blend_epi16(static_cast<__mmask32>(0xffffffffu << split), v, next);
    }
    _mm512_storeu_si512(out + k, v);
  }
  return k;
}

// The int8 map's entries for the 16 codes at `codes` (the map in 16 vectors of 16): 8 two-table permutes
// (5 index bits each), then a blend tree on code bits 5, 6 and 7.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 lookup8_avx512(const __m512* table,
                                                                                  const std::uint8_t* codes) noexcept {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m512i index = _mm512_maskz_cvtepu8_epi32(0xffff, bytes);
  const __mmask16 bit5 = _mm_movepi8_mask(_mm_slli_epi16(bytes, 2)), bit6 = _mm_movepi8_mask(_mm_add_epi8(bytes, bytes)),
                  bit7 = _mm_movepi8_mask(bytes);
  __m512 part[8];
  for (int j = 0; j < 8; ++j) part[j] = _mm512_permutex2var_ps(table[2 * j], index, table[2 * j + 1]);
  for (int j = 0; j < 4; ++j) part[j] = _mm512_mask_blend_ps(bit5, part[2 * j], part[2 * j + 1]);
  for (int j = 0; j < 2; ++j) part[j] = _mm512_mask_blend_ps(bit6, part[2 * j], part[2 * j + 1]);
  return _mm512_mask_blend_ps(bit7, part[0], part[1]);
}

// The scales of the 16 values from element e: block e >> block_shift's, and past a block boundary inside
// the 16 the next block's. `finite`: whether every one is finite.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 scales16_avx512(const block_scales& scales, int block_shift,
                                                                                   std::int64_t e, bool& finite) noexcept {
  const std::int64_t b = e >> block_shift;
  const float scale = scales(b);
  finite = is_finite(scale);
  const std::int64_t split = ((b + 1) << block_shift) - e;  // values still in block b
  if (split >= 16) return _mm512_set1_ps(scale);
  const float next = scales(b + 1);
  finite = finite && is_finite(next);
  return _mm512_mask_blend_ps(static_cast<__mmask16>(0xffffu << split), _mm512_set1_ps(scale), _mm512_set1_ps(next));
}

// bf16 bits of 32 finite floats (two vectors of 16), in order: float_to_bf16_bits without its NaN case (a
// finite value never becomes NaN), and the high halves gathered by one two-vector word permute.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i bf16_bits32_finite_avx512(__m512 first, __m512 second) noexcept {
  const __m512i one = _mm512_set1_epi32(1), half_minus_one = _mm512_set1_epi32(0x7fff);
  const __m512i a = _mm512_castps_si512(first), b = _mm512_castps_si512(second);
  const __m512i ra = _mm512_add_epi32(_mm512_add_epi32(a, half_minus_one), _mm512_and_si512(_mm512_maskz_srli_epi32(0xffff, a, 16), one));
  const __m512i rb = _mm512_add_epi32(_mm512_add_epi32(b, half_minus_one), _mm512_and_si512(_mm512_maskz_srli_epi32(0xffff, b, 16), one));
  const __m512i high_words = _mm512_setr_epi32(0x00030001, 0x00070005, 0x000b0009, 0x000f000d, 0x00130011, 0x00170015,
                                               0x001b0019, 0x001f001d, 0x00230021, 0x00270025, 0x002b0029, 0x002f002d,
                                               0x00330031, 0x00370035, 0x003b0039, 0x003f003d);
  return _mm512_permutex2var_epi16(ra, high_words, rb);
}

// One block's 256 int8 outputs as bf16 bits (from_float<bf16>(map[c] * scale), the products and rounding the
// per-value path forms), in 8 vectors of 32 words: entries 32j..32j+31 in words[j].
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void scaled_bf16_map_avx512(const float* map, float scale,
                                                                                        __m512i* words) noexcept {
  // The zero-masked inserts: GCC 12 warns about the unmasked ones' undefined pass-through operand.
  const __m512 s = _mm512_set1_ps(scale);
  for (int j = 0; j < 8; ++j) {
    const __m256i low = bf16_bits16_avx512(_mm512_mul_ps(_mm512_loadu_ps(map + 32 * j), s));
    const __m256i high = bf16_bits16_avx512(_mm512_mul_ps(_mm512_loadu_ps(map + 32 * j + 16), s));
    words[j] = _mm512_maskz_inserti64x4(0xff, _mm512_maskz_inserti64x4(0xff, _mm512_setzero_si512(), low, 0), high, 1);
  }
}

// The bf16 outputs of the 32 codes at `codes` from scaled_bf16_map_avx512's words: 4 two-table word permutes
// (6 index bits each), then a blend tree on code bits 6 and 7.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i lookup8_bf16_avx512(const __m512i* words,
                                                                                       const std::uint8_t* codes) noexcept {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  const __m512i index = _mm512_maskz_cvtepu8_epi16(0xffffffff, bytes);
  const __mmask32 bit6 = _mm256_movepi8_mask(_mm256_add_epi8(bytes, bytes)), bit7 = _mm256_movepi8_mask(bytes);
  __m512i part[4];
  for (int j = 0; j < 4; ++j) part[j] = _mm512_permutex2var_epi16(words[2 * j], index, words[2 * j + 1]);
  part[0] = _mm512_mask_blend_epi16(bit6, part[0], part[1]);
  part[1] = _mm512_mask_blend_epi16(bit6, part[2], part[3]);
  return _mm512_mask_blend_epi16(bit7, part[0], part[1]);
}

// int8 -> bf16 for blocks of at least 256 values: each block's 256 outputs are rounded once into a table
// (scaled_bf16_map_avx512), then every 32 codes take 4 word permutes and 3 blends, against 16 permutes, 14
// blends, 2 multiplies and the rounding per 32 in dequantize8_avx512 (which smaller blocks keep: there the
// table costs more than it saves). Same bits: the table holds the very values the per-value path computes.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline std::int64_t dequantize8_bf16_by_table_avx512(
    const std::uint8_t* codes, const block_scales& scales, int block_shift, std::int64_t first, std::int64_t count,
    bf16* out, const float* map) noexcept {
  __m512i words[8] = {};  // filled at the first chunk (block -1 never matches)
  std::int64_t block = -1, k = 0;
  for (; k + 32 <= count; k += 32) {
    const std::int64_t e = first + k, b = e >> block_shift;
    if (b != block) {
      block = b;
      scaled_bf16_map_avx512(map, scales(b), words);
    }
    __m512i v = lookup8_bf16_avx512(words, codes + e);
    const std::int64_t split = ((b + 1) << block_shift) - e;  // values still in block b
    if (split < 32) {  // the next block's table, kept for the next chunk
      block = b + 1;
      scaled_bf16_map_avx512(map, scales(b + 1), words);
      v = _mm512_mask_blend_epi16(static_cast<__mmask32>(0xffffffffu << split), v, lookup8_bf16_avx512(words, codes + e));
    }
    _mm512_storeu_si512(out + k, v);
  }
  return k;
}

template <class T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) std::int64_t dequantize8_avx512(
    const std::uint8_t* codes, const block_scales& scales, int block_shift, std::int64_t first, std::int64_t count,
    T* out, const float* map) noexcept {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>);
  if constexpr (std::is_same_v<T, bf16>)
    if (block_shift >= 8) return dequantize8_bf16_by_table_avx512(codes, scales, block_shift, first, count, out, map);
  __m512 table[16];
  bool map_finite = true;
  for (int j = 0; j < 16; ++j) table[j] = _mm512_loadu_ps(map + 16 * j);
  for (int i = 0; i < 256; ++i) map_finite = map_finite && is_finite(map[i]);
  std::int64_t k = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; k + 16 <= count; k += 16) {
      bool finite;
      const __m512 scale = scales16_avx512(scales, block_shift, first + k, finite);
      _mm512_storeu_ps(out + k, _mm512_mul_ps(lookup8_avx512(table, codes + first + k), scale));
    }
  } else {
    for (; k + 32 <= count; k += 32) {
      bool finite[2];
      const __m512 scale0 = scales16_avx512(scales, block_shift, first + k, finite[0]);
      const __m512 scale1 = scales16_avx512(scales, block_shift, first + k + 16, finite[1]);
      const __m512 v0 = _mm512_mul_ps(lookup8_avx512(table, codes + first + k), scale0);
      const __m512 v1 = _mm512_mul_ps(lookup8_avx512(table, codes + first + k + 16), scale1);
      if (map_finite && finite[0] && finite[1]) {
        _mm512_storeu_si512(out + k, bf16_bits32_finite_avx512(v0, v1));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), bf16_bits16_avx512(v0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k + 16), bf16_bits16_avx512(v1));
      }
    }
  }
  return k;
}

// bf16_bits16_avx512 for 8 floats, in the 8 low 32-bit lanes' low halves (0..0xffff in each lane).
__attribute__((target("avx2"))) inline __m256i bf16_bits8_avx2(__m256 values) noexcept {
  const __m256i u = _mm256_castps_si256(values);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i rounding = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
  return _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_add_epi32(u, rounding), 16), _mm256_set1_epi32(0x7fff), nan);
}

// bf16 bits of 16 floats in two vectors of 8, as 16 words in order.
__attribute__((target("avx2"))) inline __m256i bf16_bits16_avx2(__m256 first, __m256 second) noexcept {
  // packus works within 128-bit halves: put the 64-bit quarters back in order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits8_avx2(first), bf16_bits8_avx2(second)), 0xd8);
}

// `in_block` lanes of `v` (16-bit words, or 32-bit lanes) kept, the rest from `next`.
__attribute__((target("avx2"))) inline __m256i blend_from_avx2(__m256i v, __m256i next, std::int64_t in_block, bool words) noexcept {
  const __m256i lane = words ? _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                             : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i keep = words ? _mm256_cmpgt_epi16(_mm256_set1_epi16(static_cast<short>(in_block)), lane)
                             : _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(in_block)), lane);
  return _mm256_blendv_epi8(next, v, keep);
}

// fp32: entries 0-7 and 8-15 of a block's 16 decoded values; bf16: the low and the high bytes of their 16
// bf16 words, in both 128-bit halves (for the byte shuffle).
struct tables4_avx2 {
  __m256i low, high;
};

template <format F, class T>
__attribute__((target("avx2,fma"))) inline tables4_avx2 table4_avx2(float scale_value) noexcept {
  const __m256 scale = _mm256_set1_ps(scale_value);
  __m256 low = _mm256_loadu_ps(four_bit_values<F>.data()), high = _mm256_loadu_ps(four_bit_values<F>.data() + 8);
  __asm__("" : "+x"(low), "+x"(high));  // as in table4_avx512: decode()'s products, NaN signs included
  low = _mm256_mul_ps(low, scale);
  high = _mm256_mul_ps(high, scale);
  if constexpr (std::is_same_v<T, float>) {
    return tables4_avx2{_mm256_castps_si256(low), _mm256_castps_si256(high)};
  } else {
    // Words 0-7 | 8-15 -> per half: low bytes, then high bytes; quarters reordered to all low bytes | all high.
    const __m256i split_bytes = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                                                 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i planes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bf16_bits16_avx2(low, high), split_bytes), 0xd8);
    return tables4_avx2{_mm256_permute2x128_si256(planes, planes, 0x00), _mm256_permute2x128_si256(planes, planes, 0x11)};
  }
}

// The chunk at element e looked up in `t`: fp32 two vectors of 8 values, bf16 two vectors of 16 words.
template <class T>
__attribute__((target("avx2,fma"))) inline void lookup4_avx2(const std::uint8_t* codes, std::int64_t e, const tables4_avx2& t,
                                                             __m256i* v) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    const __m128i nibbles = nibbles16(codes, e);
    for (int h = 0; h < 2; ++h) {
      // The permutes read index bits 0-2; bit 3 moved to the sign bit picks the half.
      const __m256i index = _mm256_cvtepu8_epi32(h == 0 ? nibbles : _mm_srli_si128(nibbles, 8));
      v[h] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_castsi256_ps(t.low), index),
                                                  _mm256_permutevar8x32_ps(_mm256_castsi256_ps(t.high), index),
                                                  _mm256_castsi256_ps(_mm256_slli_epi32(index, 28))));
    }
  } else {
    // The 16 code bytes in both halves; per half, the bytes of values 0-7 and 16-23 (low half) or 8-15 and
    // 24-31 (high half), each twice, so that the unpacks below put the words in order.
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (e >> 1))));
    const __m256i twice = _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 8, 8, 9, 9, 10, 10, 11, 11,  //
                                                                      4, 4, 5, 5, 6, 6, 7, 7, 12, 12, 13, 13, 14, 14, 15, 15));
    // Even bytes the high nibble (a 16-bit shift brings it down), odd bytes the low one; nothing else (the
    // byte shuffle reads bits 0-3 and zeroes on bit 7).
    const __m256i nibbles = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(twice, 4), _mm256_set1_epi16(0x000f)),
                                            _mm256_and_si256(twice, _mm256_set1_epi16(0x0f00)));
    const __m256i low = _mm256_shuffle_epi8(t.low, nibbles), high = _mm256_shuffle_epi8(t.high, nibbles);
    v[0] = _mm256_unpacklo_epi8(low, high);  // values 0-7 | 8-15
    v[1] = _mm256_unpackhi_epi8(low, high);  // values 16-23 | 24-31
  }
}

// dequantize4_avx512's AVX2 sibling. fp32: the block's 16 values as two 8-entry halves, two permutes and a
// blend on code bit 3 per 8 values; bf16: the 16 words as two byte planes, two byte shuffles per 32 values.
template <format F, class T>
__attribute__((target("avx2,fma"))) std::int64_t dequantize4_avx2(const std::uint8_t* codes, const block_scales& scales,
                                                                 int block_shift, std::int64_t first, std::int64_t count,
                                                                 T* out) noexcept {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>);
  constexpr std::int64_t chunk = std::is_same_v<T, float> ? 16 : 32;
  constexpr std::int64_t half = chunk / 2;  // values per vector
  std::int64_t block = -1;
  tables4_avx2 table{_mm256_setzero_si256(), _mm256_setzero_si256()};
  std::int64_t k = 0;
  for (; k + chunk <= count; k += chunk) {
    const std::int64_t e = first + k;
    const std::int64_t b = e >> block_shift;
    if (b != block) {
      block = b;
      table = table4_avx2<F, T>(scales(b));
    }
    __m256i v[2];
    lookup4_avx2<T>(codes, e, table, v);
    const std::int64_t split = ((b + 1) << block_shift) - e;  // values still in block b
    if (split < chunk) {  // the next block's table, kept for the next chunk
      block = b + 1;
      table = table4_avx2<F, T>(scales(b + 1));
      __m256i next[2];
      lookup4_avx2<T>(codes, e, table, next);
      for (int h = 0; h < 2; ++h) v[h] = blend_from_avx2(v[h], next[h], split - half * h, !std::is_same_v<T, float>);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), v[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k + half), v[1]);
  }
  return k;
}

template <class T>
__attribute__((target("avx2,fma"))) std::int64_t dequantize8_avx2(const std::uint8_t* codes, const block_scales& scales,
                                                                  int block_shift, std::int64_t first, std::int64_t count,
                                                                  T* out, const float* map) noexcept {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>);
  std::int64_t block = -1;
  __m256 scale = _mm256_setzero_ps();
  std::int64_t k = 0;
  for (; k + 16 <= count; k += 16) {
    const std::int64_t e = first + k;
    const std::int64_t b = e >> block_shift;
    if (b != block) {
      block = b;
      scale = _mm256_set1_ps(scales(b));
    }
    __m256 lane_scale[2] = {scale, scale};
    const std::int64_t split = ((b + 1) << block_shift) - e;  // values still in block b
    if (split < 16) {
      const __m256 next = _mm256_set1_ps(scales(b + 1));
      for (int h = 0; h < 2; ++h)
        lane_scale[h] = _mm256_castsi256_ps(blend_from_avx2(_mm256_castps_si256(scale), _mm256_castps_si256(next), split - 8 * h, false));
    }
    __m256 value[2];
    const std::uint8_t* c = codes + e;
    for (int h = 0; h < 2; ++h, c += 8)
      value[h] = _mm256_mul_ps(_mm256_setr_ps(map[c[0]], map[c[1]], map[c[2]], map[c[3]], map[c[4]], map[c[5]], map[c[6]], map[c[7]]),
                               lane_scale[h]);
    if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(out + k, value[0]);
      _mm256_storeu_ps(out + k + 8, value[1]);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), bf16_bits16_avx2(value[0], value[1]));
    }
  }
  return k;
}
#endif

// --- host loops ---

inline constexpr std::uint32_t infinity_bits = 0x7f800000u;

// Throws, naming the tensor, element and block, if any value is not finite. Reads only.
template <float_storage T>
void require_finite_host(const T* input, std::int64_t numel, std::int64_t block_size, const char* operation,
                         const char* tensor_name) {
  for (std::int64_t begin = 0; begin < numel; begin += block_size) {
    const std::int64_t end = begin + block_size < numel ? begin + block_size : numel;
    if (max_magnitude_bits(input + begin, end - begin) < infinity_bits) continue;
    for (std::int64_t i = begin; i < end; ++i) {
      const float value = to_float(input[i]);
      if (is_finite(value)) continue;
      throw error(std::string(operation) + ": tensor '" + tensor_name + "' has a non-finite value (" +
                  format_float(value) + ") at flat element " + std::to_string(i) + ", in block " +
                  std::to_string(begin / block_size) + " of " + std::to_string(block_count(numel, block_size)) +
                  " (block size " + std::to_string(block_size) + ")");
    }
  }
}

// Whether `map` is the signed dynamic map, whose codes the indexed encoder (quant/dynamic_index.hpp) finds.
inline bool is_signed_dynamic_map(const float* map) noexcept {
  for (int i = 0; i < 256; ++i)
    if (::memkit::detail::bit_cast<std::uint32_t>(map[i]) != ::memkit::detail::bit_cast<std::uint32_t>(dynamic_map_signed[static_cast<std::size_t>(i)]))
      return false;
  return true;
}

// Quantizes blocks [first_block, last_block) in one pass over the input, in groups of up to max_block_size
// values: per group, every block's largest magnitude (max_magnitude_bits, vectorized), which also tells whether
// the group holds an Inf or NaN; then the blocks' absmax, reciprocals and codes while the group is in L1/L2.
// Returns false at the first group holding a non-finite value, having written nothing of that group (earlier
// groups are written). The vector kernels are chosen at run time (core/host_simd.hpp); int8 with the signed
// dynamic map takes the indexed encoder. Every path gives the codes of encode<F>
// (tests/host/quant_blockwise_test.cpp compares them on each instruction set).
template <format F, float_storage T>
bool quantize_host(const T* input, std::int64_t numel, std::int64_t block_size, std::int64_t first_block,
                   std::int64_t last_block, std::uint8_t* codes, float* absmax, const float* map) {
#if MEMKIT_QUANT_X86_SIMD
  const host_isa isa = host_isa_in_use();
#endif
  const ::memkit::detail::dynamic_code_index* index = nullptr;
  if constexpr (F == format::int8)
    if (is_signed_dynamic_map(map)) index = &::memkit::detail::dynamic_code_index_for<true>();
  constexpr std::int64_t group_values = max_block_size;
  const std::int64_t group_blocks = block_size < group_values ? group_values / block_size : 1;
  std::uint32_t bits[group_values / min_block_size];
  float reciprocals[group_values / min_block_size];
  for (std::int64_t first = first_block; first < last_block; first += group_blocks) {
    const std::int64_t blocks = std::min(group_blocks, last_block - first);
    const std::int64_t group_begin = first * block_size;
    const T* group = input + group_begin;
    const std::int64_t whole = std::min(blocks, (numel - group_begin) / block_size);  // full-size blocks
    std::int64_t g = 0;
#if MEMKIT_QUANT_X86_SIMD
    if (isa == host_isa::avx512) block_max_bits_avx512(group, g = whole, block_size, bits);
    else if (isa == host_isa::avx2) block_max_bits_avx2(group, g = whole, block_size, bits);
#endif
    for (; g < blocks; ++g) {
      const std::int64_t begin = group_begin + g * block_size;
      bits[g] = max_magnitude_bits(input + begin, std::min(block_size, numel - begin));
    }
    std::uint32_t largest = 0;
    for (g = 0; g < blocks; ++g) largest = bits[g] > largest ? bits[g] : largest;
    if (largest >= infinity_bits) return false;
    for (g = 0; g < blocks; ++g) {
      const float block_max = ::memkit::detail::bit_cast<float>(bits[g]);
      absmax[first + g] = block_max;
      reciprocals[g] = block_reciprocal(block_max);
    }
    g = 0;
    // The next group of this range, read into the cache while this one is encoded (itself for the last one).
    const T* ahead = first + group_blocks < last_block ? group + group_blocks * block_size : group;
    (void)ahead;
    if constexpr (F != format::int8) {
#if MEMKIT_QUANT_X86_SIMD
      if (isa == host_isa::avx512) encode4_blocks_avx512<F>(group, g = whole, block_size, reciprocals, codes + group_begin / 2, ahead);
      else if (isa == host_isa::avx2) encode4_blocks_avx2<F>(group, g = whole, block_size, reciprocals, codes + group_begin / 2, ahead);
#endif
    }
    for (; g < blocks; ++g) {
      const std::int64_t begin = group_begin + g * block_size;
      const std::int64_t count = std::min(block_size, numel - begin);
      const T* values = input + begin;
      const float reciprocal = reciprocals[g];
      if constexpr (F == format::int8) {
        for (std::int64_t line = 0; line < count * static_cast<std::int64_t>(sizeof(T)); line += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(ahead + g * block_size) + line);
        if (index != nullptr) {
          if constexpr (std::is_same_v<T, float>) {
            ::memkit::detail::dynamic_codes_indexed(*index, values, reciprocal, count, codes + begin);
          } else {
            float widened[max_block_size];
            for (std::int64_t i = 0; i < count; ++i) widened[i] = to_float(values[i]);
            ::memkit::detail::dynamic_codes_indexed(*index, widened, reciprocal, count, codes + begin);
          }
        } else {
          for (std::int64_t i = 0; i < count; ++i) codes[begin + i] = encode<F>(stored_product(to_float(values[i]), reciprocal), map);
        }
      } else {
        std::uint8_t* out = codes + begin / 2;
        const std::int64_t pairs = count / 2;
        for (std::int64_t p = 0; p < pairs; ++p) {
          const std::uint8_t high = encode<F>(stored_product(to_float(values[2 * p]), reciprocal), map);
          const std::uint8_t low = encode<F>(stored_product(to_float(values[2 * p + 1]), reciprocal), map);
          out[p] = static_cast<std::uint8_t>((high << 4) | low);
        }
        if (count & 1) {  // odd tail of the tensor: pad with 0.0, which is scaled like any other value
          const std::uint8_t high = encode<F>(stored_product(to_float(values[count - 1]), reciprocal), map);
          const std::uint8_t low = encode<F>(stored_product(0.0f, reciprocal), map);
          out[pairs] = static_cast<std::uint8_t>((high << 4) | low);
        }
      }
    }
  }
  return true;
}

// Elements [first, first + count) one at a time (4-bit: one block's 16-entry table at a time, already in the
// output type): the portable path, and the head and tail of the vector one.
template <format F, float_storage T>
void dequantize_host_scalar(const std::uint8_t* codes, const block_scales& scales, std::int64_t block_size,
                            std::int64_t first, std::int64_t count, T* output, const float* map) {
  std::int64_t i = 0;
  while (i < count) {
    const std::int64_t element = first + i;
    const std::int64_t block = element / block_size;
    const std::int64_t block_end = (block + 1) * block_size;
    const std::int64_t run = (block_end - element) < (count - i) ? (block_end - element) : (count - i);
    const float scale = scales(block);
    if constexpr (F == format::int8) {
      for (std::int64_t k = 0; k < run; ++k) output[i + k] = from_float<T>(decode<F>(codes[element + k], scale, map));
    } else {
      // A 16-entry table of the block's decoded values, already in the output type: the same products
      // decode() forms and the same conversion, done 16 times per block instead of once per value.
      float decoded[16];  // decode() of each code: the same single products
      for (int c = 0; c < 16; ++c) decoded[c] = stored_product(four_bit_values<F>[static_cast<std::size_t>(c)], scale);
      T scaled[16];
#if MEMKIT_QUANT_X86_SIMD
      if constexpr (std::is_same_v<T, bf16>) bf16_bits_x16(decoded, reinterpret_cast<std::uint16_t*>(scaled));
      else
#endif
        for (int c = 0; c < 16; ++c) scaled[c] = from_float<T>(decoded[c]);
      std::int64_t k = 0;
      if (element & 1) {
        output[i] = scaled[codes[element >> 1] & 0x0f];
        k = 1;
      }
      const std::uint8_t* bytes = codes + ((element + k) >> 1);
      const std::int64_t pairs = (run - k) / 2;
      T* out = output + i + k;
      std::int64_t p = 0;
#if MEMKIT_QUANT_X86_SIMD
      if (pairs >= 16 && cpu_has_ssse3()) p = expand_nibbles_ssse3<static_cast<int>(sizeof(T))>(bytes, pairs, scaled, out);
#endif
      for (; p < pairs; ++p) {
        const std::uint8_t byte = bytes[p];
        out[2 * p] = scaled[byte >> 4];
        out[2 * p + 1] = scaled[byte & 0x0f];
      }
      if ((run - k) & 1) output[i + run - 1] = scaled[bytes[pairs] >> 4];
    }
    i += run;
  }
}

// Dequantizes elements [first, first + count) of codes into output[0, count): from_float<T>(decode<F>(...)) of
// each. fp32 and bf16 outputs take the vector chunks of the instruction set in use (core/host_simd.hpp) after
// a scalar head that aligns the output to 64 bytes where it can (4-bit: at an even element); fp16 outputs and
// the portable path take the scalar loop.
// Every path gives the same bits (tests/host/quant_blockwise_test.cpp compares them on each instruction set).
template <format F, float_storage T>
void dequantize_host(const std::uint8_t* codes, const block_scales& scales, std::int64_t block_size,
                     std::int64_t first, std::int64_t count, T* output, const float* map) {
#if MEMKIT_QUANT_X86_SIMD
  if constexpr (!std::is_same_v<T, fp16>) {
    const host_isa isa = host_isa_in_use();
    if (isa != host_isa::portable && count >= 64) {
      const auto misalignment = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(output) & 63);
      std::int64_t head = misalignment % static_cast<std::int64_t>(sizeof(T)) == 0
                              ? ((64 - misalignment) & 63) / static_cast<std::int64_t>(sizeof(T))
                              : -1;
      if (head < 0 || (is_four_bit(F) && ((first + head) & 1)))
        head = is_four_bit(F) ? (first & 1) : 0;  // unaligned stores from the first even element
      const int shift = __builtin_ctzll(static_cast<unsigned long long>(block_size));  // a power of two
      dequantize_host_scalar<F>(codes, scales, block_size, first, head, output, map);
      std::int64_t done = head;
      if constexpr (is_four_bit(F)) {
        if (isa == host_isa::avx512) done += dequantize4_avx512<F>(codes, scales, shift, first + head, count - head, output + head);
        else done += dequantize4_avx2<F>(codes, scales, shift, first + head, count - head, output + head);
      } else {
        if (isa == host_isa::avx512) done += dequantize8_avx512(codes, scales, shift, first + head, count - head, output + head, map);
        else done += dequantize8_avx2(codes, scales, shift, first + head, count - head, output + head, map);
      }
      dequantize_host_scalar<F>(codes, scales, block_size, first + done, count - done, output + done, map);
      return;
    }
  }
#endif
  dequantize_host_scalar<F>(codes, scales, block_size, first, count, output, map);
}

// Index of the first block whose absmax is not finite, or -1.
inline std::int64_t first_nonfinite(const float* absmax, std::int64_t blocks) {
  for (std::int64_t b = 0; b < blocks; ++b)
    if (!is_finite(absmax[b])) return b;
  return -1;
}

#if MEMKIT_HAS_CUDA
using memkit::detail::grid_for;  // the launch geometry every grid-stride kernel shares (core/execution.hpp)

// --- CUDA kernels: one warp per block; lanes stride over the block's values. ---

MEMKIT_DEVICE MEMKIT_FORCEINLINE float warp_max(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// Lanes of a warp that quantize one block: each takes quantize_lane_values consecutive values per step
// (one or two 16-byte loads), so blocks of up to 256 values take one step and are read once, kept in
// registers between the absmax and the encoding; a warp takes 32 / lanes blocks at a time.
inline constexpr int quantize_lane_values = 8;
MEMKIT_HOST_DEVICE constexpr int quantize_lanes(std::int64_t block_size) noexcept {
  return block_size / quantize_lane_values < 32 ? static_cast<int>(block_size / quantize_lane_values) : 32;
}

template <format F, class T>
__global__ void quantize_kernel(const T* __restrict__ input, std::int64_t numel,
                                std::int64_t block_size, std::uint8_t* __restrict__ codes,
                                float* __restrict__ absmax, code_table<256> map_table) {
  constexpr int E = quantize_lane_values;
  __shared__ float map[256];
  if constexpr (F == format::int8)
    for (int i = threadIdx.x; i < 256; i += blockDim.x) map[i] = map_table.value[i];
  __syncthreads();
  const int lanes = quantize_lanes(block_size);  // a power of two, 4..32
  const int lane = static_cast<int>(threadIdx.x) & 31, sub = lane & (lanes - 1);
  const int per_warp = 32 / lanes;
  const std::int64_t steps = block_size / (static_cast<std::int64_t>(lanes) * E);
  const std::int64_t blocks = block_count(numel, block_size);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x >> 5);
  const bool vector_input = ::memkit::detail::vector_aligned(input);
  const bool vector_codes = (reinterpret_cast<std::uintptr_t>(codes) & (F == format::int8 ? 7u : 3u)) == 0;
  // Values e0 .. e0 + 8 of the block at `begin` (zeros past its end, which change neither the absmax nor
  // the finiteness; a 4-bit pair past the end is padded with 0.0 as on the host).
  auto load = [&](std::int64_t begin, std::int64_t count, std::int64_t e0, float* v) {
    if (vector_input && e0 + E <= count) {
      ::memkit::detail::load_floats<T, E, true>(input + begin + e0, v);
    } else {
#pragma unroll
      for (int j = 0; j < E; ++j) v[j] = e0 + j < count ? to_float(input[begin + e0 + j]) : 0.0f;
    }
  };
  // Warp-uniform loop: the shuffles below need every lane.
  for (std::int64_t first = (blockIdx.x * static_cast<std::int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5)) * per_warp;
       first < blocks; first += warps * per_warp) {
    const std::int64_t block = first + lane / lanes;
    const bool active = block < blocks;
    const std::int64_t begin = block * block_size;
    const std::int64_t count = !active ? 0 : numel - begin < block_size ? numel - begin : block_size;
    float cached[E];
    float block_max = 0.0f;
    int finite = 1;
    for (std::int64_t s = 0; s < steps; ++s) {
      float v[E];
      load(begin, count, (s * lanes + sub) * E, v);
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const float magnitude = abs_value(v[j]);
        finite &= is_finite(magnitude) ? 1 : 0;
        block_max = magnitude > block_max ? magnitude : block_max;
        if (s == 0) cached[j] = v[j];
      }
    }
    // The block's lanes: max is exact, so the order of reduction cannot change it.
    for (int offset = lanes / 2; offset > 0; offset >>= 1) {
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, offset));
      finite &= __shfl_xor_sync(0xffffffffu, finite, offset);
    }
    if (!active) continue;
    if (sub == 0) absmax[block] = finite ? block_max : __int_as_float(0x7fffffff);
    const float reciprocal = block_reciprocal(block_max);
    for (std::int64_t s = 0; s < steps; ++s) {
      const std::int64_t e0 = (s * lanes + sub) * E;
      if (e0 >= count) break;
      float v[E];
      if (s == 0) {
#pragma unroll
        for (int j = 0; j < E; ++j) v[j] = cached[j];
      } else {
        load(begin, count, e0, v);
      }
      unsigned c[E];
#pragma unroll
      for (int j = 0; j < E; ++j) c[j] = encode<F>(stored_product(v[j], reciprocal), map);
      if constexpr (F == format::int8) {
        if (vector_codes && e0 + E <= count) {
          *reinterpret_cast<uint2*>(codes + begin + e0) =
              make_uint2(c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24, c[4] | c[5] << 8 | c[6] << 16 | c[7] << 24);
        } else {
#pragma unroll
          for (int j = 0; j < E; ++j)
            if (e0 + j < count) codes[begin + e0 + j] = static_cast<std::uint8_t>(c[j]);
        }
      } else {
        std::uint8_t* out = codes + (begin + e0) / 2;
        if (vector_codes && e0 + E <= count) {
          *reinterpret_cast<std::uint32_t*>(out) = (c[0] << 4 | c[1]) | (c[2] << 4 | c[3]) << 8 | (c[4] << 4 | c[5]) << 16 |
                                                   (c[6] << 4 | c[7]) << 24;
        } else {
#pragma unroll
          for (int p = 0; p < E / 2; ++p)
            if (e0 + 2 * p < count) out[p] = static_cast<std::uint8_t>(c[2 * p] << 4 | c[2 * p + 1]);
        }
      }
    }
  }
}

// Generic dequantization of elements [first, first + count): one element per thread.
// Copies the nested map into shared memory when the scales are double-quantized.
MEMKIT_DEVICE MEMKIT_FORCEINLINE void stage_nested_map(block_scales& scales, float* shared_map,
                                                        const code_table<256>& nested_map) {
  if (scales.nested())
    for (int i = threadIdx.x; i < 256; i += blockDim.x) shared_map[i] = nested_map.value[i];
  scales.nested_map = shared_map;
}

// The code values of format F in shared memory: the 16 of a 4-bit format (code_value, unscaled) or the 256
// of the int8 map. Thread 0 writes the 16 with constant indices (no local copy of the codebook).
template <format F>
MEMKIT_DEVICE MEMKIT_FORCEINLINE void stage_code_values(float* table, const code_table<256>& map_table) {
  if constexpr (F == format::int8) {
    for (int i = static_cast<int>(threadIdx.x); i < 256; i += static_cast<int>(blockDim.x)) table[i] = map_table.value[i];
  } else if (threadIdx.x == 0) {
#pragma unroll
    for (int c = 0; c < 16; ++c) table[c] = code_value<F>(static_cast<std::uint8_t>(c), nullptr);
  }
}

// log2 of a block size (a power of two: require_block_size), so a block index is a shift, not a division.
MEMKIT_DEVICE MEMKIT_FORCEINLINE int block_shift(std::int64_t block_size) { return __ffsll(block_size) - 1; }

// The code of weight j (0..7) of a group of 8 stored in words[0] (4-bit) or words[0..1] (int8); 4-bit
// codes keep the even element in the high nibble.
template <format F>
MEMKIT_DEVICE MEMKIT_FORCEINLINE unsigned code_in_words(const std::uint32_t* words, int j) {
  if constexpr (F == format::int8) return (words[j >> 2] >> (8 * (j & 3))) & 0xffu;
  else return (words[0] >> (8 * (j >> 1) + ((j & 1) ? 0 : 4))) & 0x0fu;
}

template <format F, class T>
__global__ void __launch_bounds__(256) dequantize_kernel(const std::uint8_t* __restrict__ codes, block_scales scales,
                                                         std::int64_t block_size, std::int64_t first, std::int64_t count,
                                                         T* __restrict__ output, code_table<256> map_table,
                                                         code_table<256> nested_table) {
  constexpr int entries = F == format::int8 ? 256 : 16;
  __shared__ float table[entries];
  __shared__ float nested_map[256];
  stage_code_values<F>(table, map_table);
  stage_nested_map(scales, nested_map, nested_table);
  __syncthreads();
  const int shift = block_shift(block_size);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t element = first + i;
    output[i] = from_float<T>(stored_product(table[code_at<F>(codes, element)], scales(element >> shift)));
  }
}

// The vector path. Each lane turns the codes of one 16-byte output store (8 bf16/fp16 or 4 fp32 values, from
// 4 or 2 bytes of 4-bit codes, 8 or 4 bytes of int8 codes) into that store, and a warp's lanes take
// consecutive stores: every load and store instruction of a warp covers one contiguous span (an earlier
// version gave each lane 16 bytes of codes and so 32-64 bytes of output, which left each of its stores
// spread over 1-2 KiB in half-sectors: 0.40 of the copy roofline for NF4 -> bf16 on an H200). A store never
// straddles a quantization block (blocks are powers of two >= 32 values). Each lane keeps Unroll stores'
// codes and scales in flight before it computes. Needs `first` a multiple of the store's values, the codes
// of element `first` aligned to their load and `output` 16-byte aligned; the launcher sends the rest
// through dequantize_kernel.
template <format F, class T>
struct dequantize_store {
  static constexpr int values = 16 / static_cast<int>(sizeof(T));
  static constexpr int code_bytes = F == format::int8 ? values : values / 2;  // 2, 4 or 8
  using word = std::conditional_t<code_bytes == 2, std::uint16_t,
                                  std::conditional_t<code_bytes == 4, std::uint32_t, unsigned long long>>;
  // The code of value k of the store (4-bit: the even element in a byte's high nibble).
  static MEMKIT_DEVICE MEMKIT_FORCEINLINE unsigned code(word codes, int k) {
    if constexpr (F == format::int8) return static_cast<unsigned>(codes >> (8 * k)) & 0xffu;
    else return static_cast<unsigned>(codes >> (8 * (k >> 1) + ((k & 1) ? 0 : 4))) & 0x0fu;
  }
};
// Stores in flight per lane, chosen on an H200 (NF4 / int8 -> bf16, 2^28 values, block 64, fraction of the
// copy roofline): plain scales 0.92 / 0.93 at 4 against 0.89 / 0.89 at 8; double-quantized scales, whose
// decoding adds two dependent loads per store, 0.90 at 8 against 0.87 at 4.
inline constexpr int dequantize_unroll_plain = 4, dequantize_unroll_nested = 8;

template <format F, class T, int Unroll>
__global__ void __launch_bounds__(256) dequantize_vector_kernel(const std::uint8_t* __restrict__ codes, block_scales scales,
                                                                std::int64_t block_size, std::int64_t first,
                                                                std::int64_t stores, T* __restrict__ output,
                                                                code_table<256> map_table, code_table<256> nested_table) {
  using store = dequantize_store<F, T>;
  constexpr int entries = F == format::int8 ? 256 : 16;
  __shared__ float table[entries];
  __shared__ float nested_map[256];
  stage_code_values<F>(table, map_table);
  stage_nested_map(scales, nested_map, nested_table);
  __syncthreads();
  const int shift = block_shift(block_size);
  const auto* packed = reinterpret_cast<const typename store::word*>(codes + (F == format::int8 ? first : first / 2));
  const bool nested = scales.nested();
  const float offset = nested ? *scales.offset : 0.0f;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t warp = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const std::int64_t warps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (std::int64_t base = warp * 32 * Unroll + lane; base < stores; base += warps * 32 * Unroll) {
    typename store::word words[Unroll];
    float scale[Unroll];
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      const std::int64_t s = base + 32 * u;
      words[u] = s < stores ? __ldg(packed + s) : 0;
      const std::int64_t block = (first + store::values * s) >> shift;
      scale[u] = s >= stores ? 0.0f : nested ? scales.nested_scale(block, offset) : scales.absmax[block];
    }
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      const std::int64_t s = base + 32 * u;
      if (s < stores) {
        float values[store::values];
#pragma unroll
        for (int k = 0; k < store::values; ++k) values[k] = stored_product(table[store::code(words[u], k)], scale[u]);
        ::memkit::detail::store_floats<T, store::values>(output + store::values * s, values);
      }
    }
  }
}
#endif

}  // namespace detail

namespace detail {
// Tensors smaller than this per thread are quantized on fewer threads (a thread start costs ~10-50 us).
inline constexpr std::int64_t quantize_values_per_thread = std::int64_t{1} << 18;

// quantize_blockwise; `operation` names the caller in error messages.
template <executor E, class Input>
void quantize_blockwise_checked(const E& exec, format fmt, tensor_view<Input> input_view, std::int64_t block_size,
                                tensor_view<std::uint8_t> codes, tensor_view<float> absmax, const char* tensor_name,
                                const code_table<256>& map, const char* operation, int host_threads) {
  const tensor_view<const std::remove_const_t<Input>> input = input_view;
  require_block_size(block_size, operation);
  const std::int64_t numel = input.size();
  require(codes.size() == code_bytes(fmt, numel),
          std::string(operation) + ": `codes` has " + std::to_string(codes.size()) + " bytes but " +
              std::to_string(numel) + " " + to_string(fmt) + " values need " + std::to_string(code_bytes(fmt, numel)));
  require(absmax.size() == block_count(numel, block_size),
          std::string(operation) + ": `absmax` has " + std::to_string(absmax.size()) + " entries but " +
              std::to_string(numel) + " values in blocks of " + std::to_string(block_size) + " need " +
              std::to_string(block_count(numel, block_size)));
  require_accessible(exec, input, operation, "input");
  require_accessible(exec, codes, operation, "codes");
  require_accessible(exec, absmax, operation, "absmax");
  if (numel == 0) return;
  if constexpr (!E::on_device) {
    // One pass: the finiteness check rides on the absmax pass. Threads take contiguous ranges of blocks, so the
    // codes do not depend on their number. A part that meets a non-finite value stops; the error then names
    // the first such element of the tensor, whichever thread met one.
    const std::int64_t blocks = block_count(numel, block_size);
    const int parts = static_cast<int>(std::max<std::int64_t>(
        1, std::min<std::int64_t>(resolve_host_threads(host_threads), numel / quantize_values_per_thread)));
    std::atomic<bool> nonfinite{false};
    dispatch_format(fmt, [&]<format F>() {
      ::memkit::detail::run_in_parts(parts, blocks, [&](std::int64_t first, std::int64_t last) {
        if (!quantize_host<F>(input.data(), numel, block_size, first, last, codes.data(), absmax.data(), map.value))
          nonfinite.store(true, std::memory_order_relaxed);
      });
    });
    if (nonfinite.load()) {
      require_finite_host(input.data(), numel, block_size, operation, tensor_name);
      throw error(std::string(operation) + ": internal error: a non-finite block was not found again");
    }
  } else {
#if MEMKIT_HAS_CUDA
    (void)tensor_name, (void)operation, (void)host_threads;
    constexpr int threads = 256;
    const std::int64_t warps = (block_count(numel, block_size) + 32 / detail::quantize_lanes(block_size) - 1) /
                               (32 / detail::quantize_lanes(block_size));
    const int grid = detail::grid_for(warps * 32, threads);
    ::memkit::detail::with_device(exec.device, [&] {
      detail::dispatch_format(fmt, [&]<format F>() {
        detail::quantize_kernel<F><<<grid, threads, 0, exec.stream>>>(input.data(), numel, block_size, codes.data(),
                                                                       absmax.data(), map);
      });
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    });
#endif
  }
}

}  // namespace detail

// Quantizes `input` blockwise into `codes` (code_bytes(fmt, n) bytes) and `absmax` (block_count(n, b)
// floats). `tensor_name` names the tensor in error messages. `map` is the 8-bit map of the int8 format.
// `host_threads`: threads of the host path (0 = every hardware thread); the codes do not depend on it.
// Host, non-finite input: throws before writing the group of blocks (up to max_block_size values) that holds
// the value and every later group of its thread's range; groups already quantized keep their new contents.
template <executor E, class Input>
  requires float_storage<std::remove_const_t<Input>>
void quantize_blockwise(const E& exec, format fmt, tensor_view<Input> input, std::int64_t block_size,
                        tensor_view<std::uint8_t> codes, tensor_view<float> absmax,
                        const char* tensor_name = "input", const code_table<256>& map = signed_dynamic_table,
                        int host_threads = 1) {
  detail::quantize_blockwise_checked(exec, fmt, input, block_size, codes, absmax, tensor_name, map,
                                     "quant::quantize_blockwise", host_threads);
}

namespace detail {
// Dequantization with either kind of scales; callers have checked the arguments.
template <executor E, float_storage T>
void dequantize_with_scales(const E& exec, format fmt, const std::uint8_t* codes, const block_scales& scales,
                            std::int64_t block_size, std::int64_t first_element, tensor_view<T> output,
                            const code_table<256>& map, const code_table<256>& nested_map) {
  const std::int64_t count = output.size();
  if (count == 0) return;
  if constexpr (!E::on_device) {
    (void)exec;
    block_scales host_scales = scales;
    if (host_scales.nested()) host_scales.nested_map = nested_map.value;
    dispatch_format(fmt, [&]<format F>() {
      dequantize_host<F>(codes, host_scales, block_size, first_element, count, output.data(), map.value);
    });
  } else {
#if MEMKIT_HAS_CUDA
    constexpr int threads = 256;
    ::memkit::detail::with_device(exec.device, [&] {
      dispatch_format(fmt, [&]<format F>() {
        // A scalar head up to the first element that starts a 16-byte output store, the vector body, a scalar tail.
        using store = dequantize_store<F, T>;
        constexpr std::int64_t per_store = store::values;
        const std::int64_t head = (per_store - first_element % per_store) % per_store;
        // After the head, the codes start at a multiple of store::code_bytes from `codes`.
        const bool vector = head < count && reinterpret_cast<std::uintptr_t>(codes) % store::code_bytes == 0 &&
                            ::memkit::detail::vector_aligned(output.data() + head);
        const std::int64_t stores = vector ? (count - head) / per_store : 0;
        const std::int64_t body_begin = vector ? head : 0, body_end = body_begin + stores * per_store;
        if (body_begin > 0)
          dequantize_kernel<F><<<grid_for(body_begin, threads), threads, 0, exec.stream>>>(
              codes, scales, block_size, first_element, body_begin, output.data(), map, nested_map);
        auto vector_body = [&]<int Unroll>() {
          dequantize_vector_kernel<F, T, Unroll><<<grid_for((stores + Unroll - 1) / Unroll, threads), threads, 0, exec.stream>>>(
              codes, scales, block_size, first_element + body_begin, stores, output.data() + body_begin, map, nested_map);
        };
        if (stores > 0 && scales.nested()) vector_body.template operator()<dequantize_unroll_nested>();
        else if (stores > 0) vector_body.template operator()<dequantize_unroll_plain>();
        if (body_end < count)
          dequantize_kernel<F><<<grid_for(count - body_end, threads), threads, 0, exec.stream>>>(
              codes, scales, block_size, first_element + body_end, count - body_end, output.data() + body_end, map,
              nested_map);
      });
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    });
#endif
  }
}
}  // namespace detail

// Dequantizes flat elements [first_element, first_element + output.size()) of a blockwise-quantized tensor
// into `output` (fp32, bf16 or fp16). With first_element 0 and a full-size output it is the whole tensor;
// otherwise it is a tile, the building block of the quantized matmul.
template <executor E, float_storage T>
void dequantize_blockwise(const E& exec, format fmt, tensor_view<const std::uint8_t> codes,
                          tensor_view<const float> absmax, std::int64_t block_size, std::int64_t first_element,
                          tensor_view<T> output, const code_table<256>& map = signed_dynamic_table) {
  constexpr const char* operation = "quant::dequantize_blockwise";
  require_block_size(block_size, operation);
  const std::int64_t count = output.size();
  const std::int64_t capacity = is_four_bit(fmt) ? saturating_mul(std::int64_t{2}, codes.size()) : codes.size();
  // Compared without forming first_element + count, which wraps for first_element near INT64_MAX.
  require(within_range(first_element, count, capacity),
          std::string(operation) + ": " + std::to_string(count) + " elements from element " +
              std::to_string(first_element) + " are outside the " + std::to_string(capacity) + " values `codes` holds");
  const std::int64_t end = first_element + count;
  require(absmax.size() >= block_count(end, block_size),
          std::string(operation) + ": `absmax` has " + std::to_string(absmax.size()) + " entries but elements up to " +
              std::to_string(end) + " need " + std::to_string(block_count(end, block_size)));
  require_accessible(exec, codes, operation, "codes");
  require_accessible(exec, absmax, operation, "absmax");
  require_accessible(exec, output, operation, "output");
  block_scales scales;
  scales.absmax = absmax.data();
  detail::dequantize_with_scales(exec, fmt, codes.data(), scales, block_size, first_element, output, map,
                                 signed_dynamic_table);
}

// Host memory only: the first block whose absmax is not finite (how the CUDA quantizer marks a block that
// held Inf or NaN), or -1. Copy device absmax to the host first.
inline std::int64_t find_nonfinite_block(tensor_view<const float> absmax) {
  require_accessible(host, absmax, "quant::find_nonfinite_block", "absmax");
  return detail::first_nonfinite(absmax.data(), absmax.size());
}

}  // namespace quant

MEMKIT_NAMESPACE_END
