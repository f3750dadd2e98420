// memkit/quant/detail/blockwise_x86.hpp — x86 SIMD kernels of the host quantize / dequantize loops (and the
// fused matmul's helpers), chosen per CPU at run time (core/host_simd.hpp): no compile flags needed. Plain g++
// and clang only: nvcc's host pass and other targets take the scalar loops of quant/detail/blockwise_kernels.hpp.
// Every kernel gives the bytes of the scalar per-element math in quant/formats.hpp (the tests compare them on
// each instruction set). Not a public header: include memkit/quant/blockwise.hpp.
#pragma once

#include <array>
#include <cstdint>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/quant/formats.hpp"


// Host SIMD (x86-64 with GCC or Clang, outside nvcc), selected per CPU at run time.
#if !MEMKIT_HAS_CUDA && defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define MEMKIT_QUANT_X86_SIMD 1
#else
#define MEMKIT_QUANT_X86_SIMD 0
#endif

MEMKIT_NAMESPACE_BEGIN

namespace quant::detail {

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
// (An ISA twin: the loop repeats encode4_blocks_avx512's because each must be compiled for its own target
// attribute, and GCC inlines an intrinsic or a target function only into a function of the same target, so
// one template over both vector types would lose the inlining that makes them fast.)
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

}  // namespace quant::detail

MEMKIT_NAMESPACE_END
