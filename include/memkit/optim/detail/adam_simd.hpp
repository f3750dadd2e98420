// memkit/optim/detail/adam_simd.hpp — the host step's loops over whole blocks: the AdamW update, the decoding
// of codes and the 4-bit encoding, several elements at a time (SSE2/AVX/AVX-512 through host_lanes, and
// AVX2 / AVX-512 kernels chosen at run time). The same bits as the per-element functions of
// optim/adam_math.hpp and optim/state_codecs.hpp, which the CUDA kernels call; nothing here is API.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "memkit/config.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/core/rounded_math.hpp"
#include "memkit/optim/adam_math.hpp"
#include "memkit/optim/state_codecs.hpp"

// The host step's vector paths (plain host compilers only: nvcc's host pass keeps the scalar loops).
#if !defined(__CUDACC__) && defined(__SSE2__)
#include <immintrin.h>
#define MEMKIT_HOST_SIMD 1
#else
#define MEMKIT_HOST_SIMD 0
#endif

MEMKIT_NAMESPACE_BEGIN
namespace optim {
namespace detail {

// ---- Host block kernels of the step: the same bits as the per-element functions above, several
// elements at a time. Each vector lane performs exactly the scalar operations, in the same order and
// each IEEE correctly rounded, so the results do not depend on the vector width or the instruction set
// (tests/host/adam_fast_path_test.cpp checks every path against the per-element functions).
// The AVX-512 and AVX2 kernels are compiled with __attribute__((target)) and chosen at run time
// (core/host_simd.hpp: host_isa_in_use, MEMKIT_HOST_ISA, limit_host_isa), so a binary built for baseline
// x86-64 uses them; the portable path is what the compiler's own target makes of plain C++. ----

#if MEMKIT_HOST_SIMD
// The portable path's float vector: the widest the host compiler targets (SSE2 is the x86-64 baseline).
// The AVX-512 code uses the all-lanes masked forms of some intrinsics: g++ 12 warns (maybe-uninitialized)
// on the plain ones.
struct host_lanes {
  // g++ implements these intrinsics as vector arithmetic, which -ffp-contract=fast (g++'s default even
  // with -std=c++20) may fuse with a following add into an FMA; the CUDA kernels never fuse. Passing
  // each product through an empty asm keeps it a rounded product.
  template <class V>
  static V unfused(V product) noexcept {
    asm("" : "+v"(product));
    return product;
  }
#if defined(__AVX512F__)
  using type = __m512;
  static constexpr int width = 16;
  static type load(const float* p) noexcept { return _mm512_loadu_ps(p); }
  static void store(float* p, type x) noexcept { _mm512_storeu_ps(p, x); }
  static type set(float x) noexcept { return _mm512_set1_ps(x); }
  static type add(type a, type b) noexcept { return _mm512_add_ps(a, b); }
  static type sub(type a, type b) noexcept { return _mm512_sub_ps(a, b); }
  static type mul(type a, type b) noexcept { return unfused(_mm512_mul_ps(a, b)); }
  static type div(type a, type b) noexcept { return _mm512_div_ps(a, b); }
  static type sqrt(type a) noexcept { return _mm512_maskz_sqrt_ps(0xffff, a); }
#elif defined(__AVX__)
  using type = __m256;
  static constexpr int width = 8;
  static type load(const float* p) noexcept { return _mm256_loadu_ps(p); }
  static void store(float* p, type x) noexcept { _mm256_storeu_ps(p, x); }
  static type set(float x) noexcept { return _mm256_set1_ps(x); }
  static type add(type a, type b) noexcept { return _mm256_add_ps(a, b); }
  static type sub(type a, type b) noexcept { return _mm256_sub_ps(a, b); }
  static type mul(type a, type b) noexcept { return unfused(_mm256_mul_ps(a, b)); }
  static type div(type a, type b) noexcept { return _mm256_div_ps(a, b); }
  static type sqrt(type a) noexcept { return _mm256_sqrt_ps(a); }
#else
  using type = __m128;
  static constexpr int width = 4;
  static type load(const float* p) noexcept { return _mm_loadu_ps(p); }
  static void store(float* p, type x) noexcept { _mm_storeu_ps(p, x); }
  static type set(float x) noexcept { return _mm_set1_ps(x); }
  static type add(type a, type b) noexcept { return _mm_add_ps(a, b); }
  static type sub(type a, type b) noexcept { return _mm_sub_ps(a, b); }
  static type mul(type a, type b) noexcept { return unfused(_mm_mul_ps(a, b)); }
  static type div(type a, type b) noexcept { return _mm_div_ps(a, b); }
  static type sqrt(type a) noexcept { return _mm_sqrt_ps(a); }
#endif
};
#endif

#if MEMKIT_X86_DISPATCH
// The run-time dispatched kernels. Each handles a prefix of its range in whole vectors and returns how
// many elements it did; the caller finishes with the scalar functions. Products pass through an empty asm
// (see host_lanes::unfused): these functions are compiled with FMA enabled, and a fused multiply-add
// would round differently from the scalar functions and the CUDA kernels.
// (A GNU statement expression: a lambda would not inherit the function's target attribute.)
#define MEMKIT_UNFUSED(expression) \
  __extension__({                  \
    auto product_ = (expression);  \
    asm("" : "+v"(product_));      \
    product_;                      \
  })

// Scaled: m and v come in as the quantization table's entries of the block and are multiplied by the block's
// absmax first (dequantize_codes' product, the same rounding), and the largest magnitude bits of the new m
// and v are returned in maxima (as max_magnitude_bits takes them): the decode's scaling pass and the two
// absmax passes of a quantized block, fused into the update loop.
// The vector kernels' per-lane maxima folded into `maxima`.
inline void fold_maxima(const std::uint32_t* m_lanes, const std::uint32_t* v_lanes, int lanes, moment_maxima& maxima) noexcept {
  for (int l = 0; l < lanes; ++l) {
    maxima.m = std::max(maxima.m, m_lanes[l]);
    maxima.v = std::max(maxima.v, v_lanes[l]);
  }
}

// adamw_update_avx512 and adamw_update_avx2 (and the two dequantize_codes_ and table16_codes_ pairs below) are
// ISA twins that cannot share a body: each must be compiled under its own __attribute__((target)), and the
// intrinsics (always_inline, target-specific) cannot be inlined into a template without that target, which
// cannot depend on a template parameter; a generic body would make every vector operation a call. They
// compute the same operations in the same order (tests/host/adam_fast_path_test.cpp checks each against
// the scalar functions).
template <bool Scaled = false>
__attribute__((target("avx512f"))) inline std::int64_t adamw_update_avx512(float* param, float* m, float* v,
                                                                          const float* grad, std::int64_t count,
                                                                          const adam_coefficients& c, float m_absmax = 1.0f,
                                                                          float v_absmax = 1.0f,
                                                                          moment_maxima* maxima = nullptr) noexcept {
  const __m512 multiplier = _mm512_set1_ps(c.grad_multiplier), decay = _mm512_set1_ps(c.decay);
  const __m512 beta1 = _mm512_set1_ps(c.beta1), one_minus_beta1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(c.beta2), one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 correction2 = _mm512_set1_ps(c.bias_correction2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 step_size = _mm512_set1_ps(c.step_size);
  const __m512 m_scale = _mm512_set1_ps(m_absmax), v_scale = _mm512_set1_ps(v_absmax);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512i m_max = _mm512_setzero_si512(), v_max = _mm512_setzero_si512();
  std::int64_t i = 0;
  for (const std::int64_t end = count - count % 16; i < end; i += 16) {  // adamw_update, 16 lanes
    __m512 m_old = _mm512_loadu_ps(m + i), v_old = _mm512_loadu_ps(v + i);
    if constexpr (Scaled) {
      m_old = _mm512_mul_ps(m_old, m_scale);
      v_old = _mm512_mul_ps(v_old, v_scale);
    }
    const __m512 g = MEMKIT_UNFUSED(_mm512_mul_ps(_mm512_loadu_ps(grad + i), multiplier));
    const __m512 p = MEMKIT_UNFUSED(_mm512_mul_ps(_mm512_loadu_ps(param + i), decay));
    const __m512 m_new = _mm512_add_ps(MEMKIT_UNFUSED(_mm512_mul_ps(beta1, m_old)), MEMKIT_UNFUSED(_mm512_mul_ps(one_minus_beta1, g)));
    const __m512 v_new = _mm512_add_ps(MEMKIT_UNFUSED(_mm512_mul_ps(beta2, v_old)),
                                       MEMKIT_UNFUSED(_mm512_mul_ps(MEMKIT_UNFUSED(_mm512_mul_ps(one_minus_beta2, g)), g)));
    const __m512 denominator = _mm512_add_ps(_mm512_div_ps(_mm512_maskz_sqrt_ps(0xffff, v_new), correction2), eps);
    _mm512_storeu_ps(m + i, m_new);
    _mm512_storeu_ps(v + i, v_new);
    _mm512_storeu_ps(param + i, _mm512_sub_ps(p, MEMKIT_UNFUSED(_mm512_mul_ps(step_size, _mm512_div_ps(m_new, denominator)))));
    if constexpr (Scaled) {
      m_max = _mm512_maskz_max_epu32(0xffff, m_max, _mm512_and_si512(_mm512_castps_si512(m_new), magnitude));
      v_max = _mm512_maskz_max_epu32(0xffff, v_max, _mm512_and_si512(_mm512_castps_si512(v_new), magnitude));
    }
  }
  if constexpr (Scaled) {
    alignas(64) std::uint32_t lanes[2][16];
    _mm512_store_si512(lanes[0], m_max);
    _mm512_store_si512(lanes[1], v_max);
    fold_maxima(lanes[0], lanes[1], 16, *maxima);
  }
  return i;
}

template <bool Scaled = false>
__attribute__((target("avx2,fma"))) inline std::int64_t adamw_update_avx2(float* param, float* m, float* v,
                                                                         const float* grad, std::int64_t count,
                                                                         const adam_coefficients& c, float m_absmax = 1.0f,
                                                                         float v_absmax = 1.0f,
                                                                         moment_maxima* maxima = nullptr) noexcept {
  const __m256 multiplier = _mm256_set1_ps(c.grad_multiplier), decay = _mm256_set1_ps(c.decay);
  const __m256 beta1 = _mm256_set1_ps(c.beta1), one_minus_beta1 = _mm256_set1_ps(c.one_minus_beta1);
  const __m256 beta2 = _mm256_set1_ps(c.beta2), one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 correction2 = _mm256_set1_ps(c.bias_correction2_sqrt), eps = _mm256_set1_ps(c.eps);
  const __m256 step_size = _mm256_set1_ps(c.step_size);
  const __m256 m_scale = _mm256_set1_ps(m_absmax), v_scale = _mm256_set1_ps(v_absmax);
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  __m256i m_max = _mm256_setzero_si256(), v_max = _mm256_setzero_si256();
  std::int64_t i = 0;
  for (const std::int64_t end = count - count % 8; i < end; i += 8) {  // adamw_update, 8 lanes
    __m256 m_old = _mm256_loadu_ps(m + i), v_old = _mm256_loadu_ps(v + i);
    if constexpr (Scaled) {
      m_old = _mm256_mul_ps(m_old, m_scale);
      v_old = _mm256_mul_ps(v_old, v_scale);
    }
    const __m256 g = MEMKIT_UNFUSED(_mm256_mul_ps(_mm256_loadu_ps(grad + i), multiplier));
    const __m256 p = MEMKIT_UNFUSED(_mm256_mul_ps(_mm256_loadu_ps(param + i), decay));
    const __m256 m_new = _mm256_add_ps(MEMKIT_UNFUSED(_mm256_mul_ps(beta1, m_old)), MEMKIT_UNFUSED(_mm256_mul_ps(one_minus_beta1, g)));
    const __m256 v_new = _mm256_add_ps(MEMKIT_UNFUSED(_mm256_mul_ps(beta2, v_old)),
                                       MEMKIT_UNFUSED(_mm256_mul_ps(MEMKIT_UNFUSED(_mm256_mul_ps(one_minus_beta2, g)), g)));
    const __m256 denominator = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_new), correction2), eps);
    _mm256_storeu_ps(m + i, m_new);
    _mm256_storeu_ps(v + i, v_new);
    _mm256_storeu_ps(param + i, _mm256_sub_ps(p, MEMKIT_UNFUSED(_mm256_mul_ps(step_size, _mm256_div_ps(m_new, denominator)))));
    if constexpr (Scaled) {
      m_max = _mm256_max_epu32(m_max, _mm256_and_si256(_mm256_castps_si256(m_new), magnitude));
      v_max = _mm256_max_epu32(v_max, _mm256_and_si256(_mm256_castps_si256(v_new), magnitude));
    }
  }
  if constexpr (Scaled) {
    alignas(32) std::uint32_t lanes[2][8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), m_max);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[1]), v_max);
    fold_maxima(lanes[0], lanes[1], 8, *maxima);
  }
  return i;
}

// The entries of a 16-entry table held as two 8-entry halves, at 8 indices 0..15.
__attribute__((target("avx2"))) inline __m256 lookup16_avx2(__m256 low_half, __m256 high_half, __m256i index) noexcept {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_half, index), _mm256_permutevar8x32_ps(high_half, index),
                          _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));  // bit 3 of the index picks the half
}

// Pairs of 4-bit codes (the even element's in the high nibble) from 16 codes in bytes.
inline __m128i pack_nibble_pairs(__m128i codes) noexcept {
  const __m128i pairs = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(codes, _mm_set1_epi16(0x00ff)), 4), _mm_srli_epi16(codes, 8));
  return _mm_packus_epi16(pairs, pairs);
}

// out[e] = table[codes[e]] for e < end (a multiple of 4), the 8-bit decoders' first half: scalar loads, 4 at a
// time, the codes kept in registers by an empty asm so that the compiler does not turn them into a gather.
// Returns end.
inline std::int64_t lookup_entries(const float* table, const std::uint8_t* codes, std::int64_t end,
                                               float* out) noexcept {
  for (std::int64_t e = 0; e < end; e += 4) {
    unsigned c0 = codes[e], c1 = codes[e + 1], c2 = codes[e + 2], c3 = codes[e + 3];
    asm("" : "+r"(c0), "+r"(c1), "+r"(c2), "+r"(c3));
    out[e] = table[c0];
    out[e + 1] = table[c1];
    out[e + 2] = table[c2];
    out[e + 3] = table[c3];
  }
  return end;
}

template <int Bits>
__attribute__((target("avx512f"))) inline std::int64_t dequantize_codes_avx512(const float* table, const std::uint8_t* codes,
                                                                              std::int64_t first, std::int64_t count,
                                                                              float absmax, float* out) noexcept {
  std::int64_t e = 0;
  const __m512 scale = _mm512_set1_ps(absmax);
  if constexpr (Bits == 8) {
    // Scalar loads of the entries, then the scaling 16 at a time in place: on a Cascade Lake this took 0.46
    // ns/value against 0.54 for a register lookup (8 two-table permutes and a 3-level blend tree per 16 codes)
    // and 1.3 for 8-lane gathers.
    e = lookup_entries(table, codes + first, count - count % 16, out);
    for (std::int64_t k = 0; k < e; k += 16) _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_loadu_ps(out + k), scale));
  } else if ((first & 1) == 0) {  // 16 codes in 8 bytes, the even element in the high nibble
    const __m512 entries = _mm512_loadu_ps(table);
    for (const std::int64_t end = count - count % 16; e < end; e += 16) {
      const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (first + e) / 2));
      const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f));
      const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0f));
      const __m512i index = _mm512_maskz_cvtepu8_epi32(0xffff, _mm_unpacklo_epi8(high, low));
      _mm512_storeu_ps(out + e, _mm512_mul_ps(_mm512_maskz_permutexvar_ps(0xffff, index, entries), scale));
    }
  }
  return e;
}

template <int Bits>
__attribute__((target("avx2,fma"))) inline std::int64_t dequantize_codes_avx2(const float* table, const std::uint8_t* codes,
                                                                             std::int64_t first, std::int64_t count,
                                                                             float absmax, float* out) noexcept {
  std::int64_t e = 0;
  const __m256 scale = _mm256_set1_ps(absmax);
  if constexpr (Bits == 8) {
    // AVX2 has no 256-entry permute, and an 8-lane gather took ~28 cycles on a Cascade Lake (slower than the
    // scalar loads it replaces): the entries are loaded one by one, then scaled 8 at a time in place.
    e = lookup_entries(table, codes + first, count - count % 8, out);
    for (std::int64_t k = 0; k < e; k += 8) _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_loadu_ps(out + k), scale));
  } else if ((first & 1) == 0) {  // 16 codes in 8 bytes, the even element in the high nibble
    const __m256 low_half = _mm256_loadu_ps(table), high_half = _mm256_loadu_ps(table + 8);
    for (const std::int64_t end = count - count % 16; e < end; e += 16) {
      const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (first + e) / 2));
      const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f));
      const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0f));
      const __m128i index = _mm_unpacklo_epi8(high, low);  // 16 codes in element order
      const __m256i first8 = _mm256_cvtepu8_epi32(index), next8 = _mm256_cvtepu8_epi32(_mm_srli_si128(index, 8));
      _mm256_storeu_ps(out + e, _mm256_mul_ps(lookup16_avx2(low_half, high_half, first8), scale));
      _mm256_storeu_ps(out + e + 8, _mm256_mul_ps(lookup16_avx2(low_half, high_half, next8), scale));
    }
  }
  return e;
}
#endif

// adamw_update over contiguous arrays. The vector bodies repeat adamw_update's operations one for one
// (keep them in step): g++ cannot vectorize adamw_update itself, because std::sqrt may set errno
// (-fmath-errno is the default), which puts a branch in every element.
inline void adamw_update_array(float* param, float* m, float* v, const float* grad, std::int64_t count,
                               const adam_coefficients& c) noexcept {
  std::int64_t i = 0;
#if MEMKIT_X86_DISPATCH
  const host_isa isa = host_isa_in_use();
  if (isa == host_isa::avx512) i = adamw_update_avx512(param, m, v, grad, count, c);
  else if (isa == host_isa::avx2) i = adamw_update_avx2(param, m, v, grad, count, c);
  else
#endif
  {
#if MEMKIT_HOST_SIMD
    using L = host_lanes;
    const L::type multiplier = L::set(c.grad_multiplier), decay = L::set(c.decay), beta1 = L::set(c.beta1),
                  one_minus_beta1 = L::set(c.one_minus_beta1), beta2 = L::set(c.beta2),
                  one_minus_beta2 = L::set(c.one_minus_beta2), correction2 = L::set(c.bias_correction2_sqrt),
                  eps = L::set(c.eps), step_size = L::set(c.step_size);
    for (const std::int64_t end = count - count % L::width; i < end; i += L::width) {
      const L::type g = L::mul(L::load(grad + i), multiplier);
      L::type p = L::mul(L::load(param + i), decay);
      const L::type m_new = L::add(L::mul(beta1, L::load(m + i)), L::mul(one_minus_beta1, g));
      const L::type v_new = L::add(L::mul(beta2, L::load(v + i)), L::mul(L::mul(one_minus_beta2, g), g));
      const L::type denominator = L::add(L::div(L::sqrt(v_new), correction2), eps);
      p = L::sub(p, L::mul(step_size, L::div(m_new, denominator)));
      L::store(m + i, m_new);
      L::store(v + i, v_new);
      L::store(param + i, p);
    }
#endif
  }
  for (; i < count; ++i) adamw_update(param[i], m[i], v[i], grad[i], c);
}

// adamw_update_array for one quantized block, fused with the decode's scaling and the new block maxima: m and v
// hold the block's table entries (dequantize_codes with absmax 1, or lookup_codes) and come back as the new
// fp32 moments; returns their max_magnitude_bits. The same bits as dequantize_codes, adamw_update_array and
// max_magnitude_bits one after the other.
inline moment_maxima adamw_update_block(float* param, float* m, float* v, const float* grad, std::int64_t count,
                                        const adam_coefficients& c, float m_absmax, float v_absmax) noexcept {
  moment_maxima maxima;
  std::int64_t i = 0;
#if MEMKIT_X86_DISPATCH
  const host_isa isa = host_isa_in_use();
  if (isa == host_isa::avx512) i = adamw_update_avx512<true>(param, m, v, grad, count, c, m_absmax, v_absmax, &maxima);
  else if (isa == host_isa::avx2) i = adamw_update_avx2<true>(param, m, v, grad, count, c, m_absmax, v_absmax, &maxima);
#endif
  for (std::int64_t e = i; e < count; ++e) {
    m[e] = mul_rn(m[e], m_absmax);
    v[e] = mul_rn(v[e], v_absmax);
  }
  adamw_update_array(param + i, m + i, v + i, grad + i, count - i, c);
  maxima.m = std::max(maxima.m, max_magnitude_bits(m + i, count - i));
  maxima.v = std::max(maxima.v, max_magnitude_bits(v + i, count - i));
  return maxima;
}

// Dequantizes `count` codes of one block starting at element `first`: out[e] = table[code] * absmax.
template <int Bits>
inline void dequantize_codes(const float* table, const std::uint8_t* codes, std::int64_t first, std::int64_t count,
                             float absmax, float* out) noexcept {
  std::int64_t e = 0;
#if MEMKIT_X86_DISPATCH
  const host_isa isa = host_isa_in_use();
  if (isa == host_isa::avx512) e = dequantize_codes_avx512<Bits>(table, codes, first, count, absmax, out);
  else if (isa == host_isa::avx2) e = dequantize_codes_avx2<Bits>(table, codes, first, count, absmax, out);
#endif
  for (; e < count; ++e) out[e] = mul_rn(table[load_code<Bits>(codes, first + e)], absmax);
}

// The table entries of `count` codes of one block starting at element `first` (unscaled: dequantize_codes
// with absmax 1, whose product is exact).
template <int Bits>
inline void lookup_codes(const float* table, const std::uint8_t* codes, std::int64_t first, std::int64_t count,
                         float* out) noexcept {
  std::int64_t e = 0;
#if MEMKIT_X86_DISPATCH
  if constexpr (Bits == 8)
    if (host_isa_in_use() != host_isa::portable) e = lookup_entries(table, codes + first, count - count % 4, out);
#endif
  if constexpr (Bits == 8) {
    for (; e < count; ++e) out[e] = table[codes[first + e]];
  } else {
    dequantize_codes<Bits>(table, codes, first, count, 1.0f, out);
  }
}

#if MEMKIT_X86_DISPATCH
// After nearest_in_table's search, its midpoint test compares with (table[low] + table[low + 1]) * 0.5f,
// never passed at the last entry.
inline void table16_midpoints(const float* table, float* midpoints) noexcept {
  for (int k = 0; k < 15; ++k) midpoints[k] = mul_rn(add_rn(table[k], table[k + 1]), 0.5f);
  midpoints[15] = std::numeric_limits<float>::infinity();
}

// nearest_in_table<16>'s code is also the number of midpoints (table16_midpoints) below x: each midpoint lies
// strictly between its two entries, so x >= table[k] passes the midpoints below k, and NaN passes none. That
// count is a 4-step binary search over the midpoints padded with +Inf; step s probes midpoint c + s - 1, kept
// at index c of a shifted copy, so a step is one permute. Four vectors are searched at once (a search is a
// chain of dependent permutes and compares).
__attribute__((target("avx512f"))) inline __m512i count_below_avx512(__m512 x, __m512 m7, __m512 s4, __m512 s2,
                                                                      __m512 s1) noexcept {
  __m512i c = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, m7, _CMP_GT_OQ), _mm512_set1_epi32(8));
  c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(x, _mm512_maskz_permutexvar_ps(0xffff, c, s4), _CMP_GT_OQ), c, _mm512_set1_epi32(4));
  c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(x, _mm512_maskz_permutexvar_ps(0xffff, c, s2), _CMP_GT_OQ), c, _mm512_set1_epi32(2));
  return _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(x, _mm512_maskz_permutexvar_ps(0xffff, c, s1), _CMP_GT_OQ), c, _mm512_set1_epi32(1));
}

__attribute__((target("avx512f"))) inline std::int64_t table16_codes_avx512(const float* table, const float* values,
                                                                           float inverse, std::int64_t count,
                                                                           std::uint8_t* codes) noexcept {
  std::int64_t e = 0;
  float midpoints[16];
  table16_midpoints(table, midpoints);
  const __m512 middle = _mm512_loadu_ps(midpoints);
  const __m512 m7 = _mm512_set1_ps(midpoints[7]);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i last = _mm512_set1_epi32(15);
  const __m512 s4 = _mm512_maskz_permutexvar_ps(0xffff, _mm512_maskz_min_epu32(0xffff, _mm512_add_epi32(lane, _mm512_set1_epi32(3)), last), middle);
  const __m512 s2 = _mm512_maskz_permutexvar_ps(0xffff, _mm512_maskz_min_epu32(0xffff, _mm512_add_epi32(lane, _mm512_set1_epi32(1)), last), middle);
  const __m512 scale = _mm512_set1_ps(inverse);
  for (; e + 64 <= count; e += 64) {
    __m512i c[4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u)
      c[u] = count_below_avx512(_mm512_mul_ps(_mm512_loadu_ps(values + e + 16 * u), scale), m7, s4, s2, middle);
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u)
      _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + (e + 16 * u) / 2),
                       pack_nibble_pairs(_mm512_maskz_cvtepi32_epi8(0xffff, c[u])));
  }
  for (const std::int64_t end = count - count % 16; e < end; e += 16) {
    const __m512i c = count_below_avx512(_mm512_mul_ps(_mm512_loadu_ps(values + e), scale), m7, s4, s2, middle);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + e / 2), pack_nibble_pairs(_mm512_maskz_cvtepi32_epi8(0xffff, c)));
  }
  return e;
}

// count_below_avx512's AVX2 sibling for 8 values: the same search, holding c / 2 so that every probe is one
// 8-entry permute (h4, h2, h1: the midpoints probed at steps 4, 2, 1 for c = 0, 2, .., 14); the last
// comparison gives the count's low bit.
__attribute__((target("avx2,fma"))) inline __m256i count_below_avx2(__m256 x, __m256 m7, __m256 h4, __m256 h2,
                                                                   __m256 h1) noexcept {
  const __m256i four = _mm256_set1_epi32(4), two = _mm256_set1_epi32(2), one = _mm256_set1_epi32(1);
  __m256i half = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(x, m7, _CMP_GT_OQ)), four);
  half = _mm256_add_epi32(half, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(x, _mm256_permutevar8x32_ps(h4, half), _CMP_GT_OQ)), two));
  half = _mm256_add_epi32(half, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(x, _mm256_permutevar8x32_ps(h2, half), _CMP_GT_OQ)), one));
  return _mm256_add_epi32(_mm256_add_epi32(half, half),
                          _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(x, _mm256_permutevar8x32_ps(h1, half), _CMP_GT_OQ)), one));
}

__attribute__((target("avx2,fma"))) inline std::int64_t table16_codes_avx2(const float* table, const float* values,
                                                                          float inverse, std::int64_t count,
                                                                          std::uint8_t* codes) noexcept {
  std::int64_t e = 0;
  float midpoints[16], h4[8], h2[8], h1[8];
  table16_midpoints(table, midpoints);
  for (int j = 0; j < 8; ++j) {  // the probes of c = 2j at steps 4, 2, 1: midpoints c + 3, c + 1, c
    h4[j] = midpoints[std::min(2 * j + 3, 15)];
    h2[j] = midpoints[2 * j + 1];
    h1[j] = midpoints[2 * j];
  }
  const __m256 m7 = _mm256_set1_ps(midpoints[7]);
  const __m256 t4 = _mm256_loadu_ps(h4), t2 = _mm256_loadu_ps(h2), t1 = _mm256_loadu_ps(h1);
  const __m256 scale = _mm256_set1_ps(inverse);
  for (const std::int64_t end = count - count % 32; e < end; e += 32) {
    __m256i c[4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) c[u] = count_below_avx2(_mm256_mul_ps(_mm256_loadu_ps(values + e + 8 * u), scale), m7, t4, t2, t1);
    for (int pair = 0; pair < 2; ++pair)
      _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + (e + 16 * pair) / 2),
                       pack_nibble_pairs(_mm_unpacklo_epi64(low_bytes_avx2(c[2 * pair]), low_bytes_avx2(c[2 * pair + 1]))));
  }
  for (const std::int64_t end = count - count % 16; e < end; e += 16) {
    const __m256i c0 = count_below_avx2(_mm256_mul_ps(_mm256_loadu_ps(values + e), scale), m7, t4, t2, t1);
    const __m256i c1 = count_below_avx2(_mm256_mul_ps(_mm256_loadu_ps(values + e + 8), scale), m7, t4, t2, t1);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + e / 2), pack_nibble_pairs(_mm_unpacklo_epi64(low_bytes_avx2(c0), low_bytes_avx2(c1))));
  }
  return e;
}
#endif

// 4-bit codes of values[e] * inverse (nearest_in_table<16>), packed two per byte into codes[0..count/2);
// count is even (blocks are even-sized and start at even indices) except for a tensor's last block.
inline void table16_codes(const float* table, const float* values, float inverse, std::int64_t count,
                          std::uint8_t* codes) noexcept {
  std::int64_t e = 0;
#if MEMKIT_X86_DISPATCH
  const host_isa isa = host_isa_in_use();
  if (isa == host_isa::avx512) e = table16_codes_avx512(table, values, inverse, count, codes);
  else if (isa == host_isa::avx2) e = table16_codes_avx2(table, values, inverse, count, codes);
#endif
  for (; e < count; e += 2) {
    const unsigned high = nearest_in_table<16>(table, mul_rn(values[e], inverse));
    const unsigned low = e + 1 < count ? nearest_in_table<16>(table, mul_rn(values[e + 1], inverse)) : 0u;
    codes[e / 2] = static_cast<std::uint8_t>((high << 4) | low);
  }
}

#if MEMKIT_X86_DISPATCH
#undef MEMKIT_UNFUSED
#endif

}  // namespace detail
}  // namespace optim
MEMKIT_NAMESPACE_END
