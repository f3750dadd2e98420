// memkit/optim/state_codecs.hpp — how each adam_state flavour stores its moments, and the element-wise
// load/update/store helpers the host loop and the CUDA kernels share.
//
// Quantized moments are codes into a sorted table of 2^bits values in [-1, 1] (m) or [0, 1] (v), scaled
// by the block's absmax: value = table[code] * absmax. 4-bit codes are packed two per byte, the element
// at the even index in the high nibble (as bitsandbytes and torchao pack them).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/optim/adam_math.hpp"
#include "memkit/quant/codebooks.hpp"

// The host step's vector paths (plain host compilers only: nvcc's host pass keeps the scalar loops).
#if !defined(__CUDACC__) && defined(__SSE2__)
#include <immintrin.h>
#define MEMKIT_HOST_SIMD 1
#else
#define MEMKIT_HOST_SIMD 0
#endif

MEMKIT_NAMESPACE_BEGIN

// Tag type: adam_state<four_bit, Block> keeps 4-bit moments.
struct four_bit {};

namespace detail {

// Index of the table entry nearest to x in a sorted table of `Entries` values. Exact ties go to the
// lower code (the midpoint comparison is strict), as bitsandbytes breaks them.
template <int Entries>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE unsigned nearest_in_table(const float* table, float x) noexcept {
  unsigned low = 0;

  for (unsigned half = Entries / 2; half > 0; half >>= 1)
    low += half & (0u - static_cast<unsigned>(table[low + half] <= x));  // branch-free: the outcomes are coin flips
  const unsigned next = low + 1 < static_cast<unsigned>(Entries) ? low + 1 : low;
  return low + static_cast<unsigned>((x > mul_rn(add_rn(table[low], table[next]), 0.5f)) & (next != low));
}

// The last step of quant::nearest_dynamic once its search has ended at the even index `pivot`: move
// to a neighbour past the float midpoint (a tie stays at pivot). Written without branches, because the
// comparisons are coin flips for optimizer moments and mispredict half the time on a CPU.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE unsigned finish_dynamic_code(const float* map, unsigned pivot, float x) noexcept {
  const float probe = map[pivot];
  const float up = (map[pivot + 1] + probe) * 0.5f;
  const float down = (map[pivot == 0 ? 0 : pivot - 1] + probe) * 0.5f;
  const bool above = x > probe;
  return pivot + static_cast<unsigned>(above & (x > up)) - static_cast<unsigned>(!above & (pivot != 0) & (x < down));
}

// quant::nearest_dynamic's result, computed without its data-dependent branches. That search is a
// complete binary search tree over the 127 odd indices 1..253 of the map, so the even index P where it
// ends is twice the number of odd entries below x, and its last two brackets are P-1 and P+1; the
// final midpoint test is then the same float expression as in quant::nearest_dynamic, so the codes
// are identical, ties included (tests/host/adam_codes_test.cpp checks this against the shared function).
// Branch-free, it runs several times faster on a CPU, where the shared function's branches mispredict.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE unsigned dynamic_code(const float* map, float x) noexcept {
  unsigned below = 0;  // odd entries map[2i - 1], i = 1..127, that are < x

  for (unsigned step = 64; step > 0; step >>= 1) below += map[2 * (below + step) - 1] < x ? step : 0u;
  return finish_dynamic_code(map, 2 * below, x);
}

// Host-only acceleration. quant::nearest_dynamic amounts to: the nearest entry by the float midpoints
// (a + b) * 0.5f of adjacent entries, an exact tie going to the even index (where its search ends).
// This index, keyed by the top 16 bits of |x| (exponent and 7 mantissa bits) and the sign, stores per
// bucket the code at the bucket's low end and the one midpoint inside the bucket (buckets are narrower
// than the spacing of the entries, checked when it is built), so a lookup is one load and one compare
// instead of a chain of dependent loads. A midpoint inside a bucket shares the bucket's top 16 bits, so
// one 32-bit word per bucket holds everything:
//   bits 0-15 the midpoint's low 16 bits, 16-23 the code below it, 24 "a tie goes up" (the code above
//   is even), 25 "the bucket has a midpoint".
// Only magnitudes between the smallest midpoint and 1 need buckets of their own (normalised moments lie
// in [-1, 1]); smaller and larger magnitudes are clamped to the end buckets, which the build checks hold
// one code each. Both maps' indexes take 33 KiB and build in about 3 ms on first use (a full 16-bit
// index took 512 KiB and 54 ms; the step ran no faster with it). NaN maps to code 0, as in
// quant::nearest_dynamic. tests/host/adam_codes_test.cpp checks it against the shared function.
struct dynamic_code_index {
  static constexpr std::uint32_t top_key = 0x3f80;  // 1.0f >> 16: larger magnitudes share its bucket
  std::uint32_t first_key = 0;                      // smaller magnitudes share this key's bucket
  std::uint32_t positive_buckets = 0;               // keys first_key..top_key
  std::uint32_t negative_limit = 0;                 // the largest clamped magnitude key of a negative x
  std::vector<std::uint32_t> buckets;               // positive keys, then negative ones

  // The bucket of x (not NaN): its clamped magnitude key, offset past the positive buckets if x < 0.
  std::uint32_t bucket_of(std::uint32_t bits) const noexcept {
    const std::uint32_t magnitude = (bits & 0x7fffffffu) >> 16;
    const std::uint32_t key = (magnitude < first_key ? first_key : magnitude > top_key ? top_key : magnitude) - first_key;
    return (bits >> 31) == 0 ? key : positive_buckets + (key < negative_limit ? key : negative_limit);
  }
};

inline dynamic_code_index build_dynamic_code_index(const float* map) {
  dynamic_code_index index;
  const auto midpoint = [map](unsigned c) { return (map[c + 1] + map[c]) * 0.5f; };  // nearest_dynamic's
  float smallest_midpoint = 1.0f;
  for (unsigned c = 0; c < 255; ++c) {
    const float middle = midpoint(c);
    if (middle != 0.0f && std::fabs(middle) < smallest_midpoint) smallest_midpoint = std::fabs(middle);
  }
  index.first_key = (bit_cast<std::uint32_t>(smallest_midpoint) >> 16) - 1;
  index.positive_buckets = dynamic_code_index::top_key - index.first_key + 1;
  const bool has_negatives = map[0] < 0.0f;  // an unsigned map gives every negative x code 0: one bucket
  index.negative_limit = has_negatives ? index.positive_buckets - 1 : 0;
  index.buckets.resize(index.positive_buckets + index.negative_limit + 1);
  for (std::uint32_t slot = 0; slot < index.buckets.size(); ++slot) {
    const bool negative = slot >= index.positive_buckets;
    const std::uint32_t key = index.first_key + (negative ? slot - index.positive_buckets : slot);
    // The magnitudes the bucket serves, clamped ends included.
    const float small = bit_cast<float>(key == index.first_key ? 0u : key << 16);
    const float large = key == dynamic_code_index::top_key || (negative && !has_negatives)
                            ? std::numeric_limits<float>::infinity()
                            : bit_cast<float>((key << 16) | 0xffffu);
    const float low = negative ? -large : small, high = negative ? -small : large;
    std::uint32_t bucket = dynamic_code(map, low) << 16;
    int boundaries = 0;
    for (unsigned c = 0; c < 255; ++c) {
      const float middle = midpoint(c);
      if (!(middle >= low && middle <= high)) continue;
      if (bit_cast<std::uint32_t>(middle) >> 16 != (key | (negative ? 0x8000u : 0u)))
        throw error("memkit: dynamic map midpoint outside its bucket");
      ++boundaries;
      bucket = (bit_cast<std::uint32_t>(middle) & 0xffffu) | (c << 16) | (((c + 1) % 2 == 0 ? 1u : 0u) << 24) | (1u << 25);
    }
    if (boundaries > 1) throw error("memkit: dynamic map too dense for its 16-bit index");
    index.buckets[slot] = bucket;
  }
  return index;
}

template <bool Signed>
const dynamic_code_index& dynamic_code_index_for() {
  static const dynamic_code_index index =
      build_dynamic_code_index(Signed ? quant::dynamic_map_signed.data() : quant::dynamic_map_unsigned.data());
  return index;
}

inline unsigned dynamic_code_indexed(const dynamic_code_index& index, float x) noexcept {
  const std::uint32_t bits = bit_cast<std::uint32_t>(x);
  const std::uint32_t bucket = index.buckets[index.bucket_of(bits)];
  const float threshold = bit_cast<float>((bits & 0xffff0000u) | (bucket & 0xffffu));
  const bool has_threshold = (bucket >> 25) & 1u, tie_up = (bucket >> 24) & 1u;
  const unsigned code = ((bucket >> 16) & 0xffu) +
                        static_cast<unsigned>(has_threshold & ((x > threshold) | ((x == threshold) & tie_up)));
  return x == x ? code : 0u;
}

template <int Bits>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE unsigned load_code(const std::uint8_t* codes, std::int64_t index) noexcept {
  if constexpr (Bits == 8) return codes[index];
  else return (index & 1) ? (codes[index >> 1] & 0x0fu) : (codes[index >> 1] >> 4);
}

MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float max_abs(float current, float value) noexcept {
  const float magnitude = value < 0.0f ? -value : value;
  return magnitude > current ? magnitude : current;  // max is exact and order-free: host and device agree
}

// 1/absmax, computed once per block; an all-zero block normalises to zeros.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float inverse_scale(float absmax) noexcept {
  return absmax > 0.0f ? div_rn(1.0f, absmax) : 0.0f;
}

struct int4_tables {
  std::array<float, 16> m, v;
};
struct int8_tables {
  std::array<float, 256> m, v;
};
inline constexpr int8_tables int8_maps{quant::dynamic_map_signed, quant::dynamic_map_unsigned};

// torchao's AdamW4bit maps. m: the dynamic map with 3 exponent bits: for decade i = 0, 1, 2 the
// midpoints of linspace(0.1, 1, 2^i + 1) scaled by 10^(i-2), mirrored negative, plus 0 and 1.
// v: the 16 linear levels k/16, k = 1..16 (no zero: a zero second moment never divides by ~0).
constexpr int4_tables make_int4_tables() noexcept {
  double values[16] = {};
  int count = 0;
  double decade = 0.01;
  for (int i = 0; i < 3; ++i, decade *= 10.0) {
    const int bins = 1 << i;
    for (int j = 0; j < bins; ++j) {
      const double low = 0.1 + 0.9 * j / bins, high = 0.1 + 0.9 * (j + 1) / bins;
      values[count++] = decade * (low + high) / 2.0;
      values[count++] = -decade * (low + high) / 2.0;
    }
  }
  values[count++] = 0.0;
  values[count++] = 1.0;
  for (int i = 1; i < 16; ++i)  // insertion sort: constexpr-friendly
    for (int j = i; j > 0 && values[j - 1] > values[j]; --j) {
      const double t = values[j];
      values[j] = values[j - 1];
      values[j - 1] = t;
    }
  int4_tables tables{};
  for (int i = 0; i < 16; ++i) {
    tables.m[static_cast<std::size_t>(i)] = static_cast<float>(values[i]);
    tables.v[static_cast<std::size_t>(i)] = static_cast<float>(i + 1) / 16.0f;
  }
  return tables;
}

inline constexpr int4_tables int4_maps = make_int4_tables();

// A fingerprint of a pair of tables, saved with the state so a change of map is caught on load.
template <std::size_t N>
constexpr std::uint64_t table_fingerprint(const std::array<float, N>& m, const std::array<float, N>& v) noexcept {
  std::uint64_t hash = N;
  for (float x : m) hash = mix64(hash ^ bit_cast<std::uint32_t>(x));
  for (float x : v) hash = mix64(hash ^ bit_cast<std::uint32_t>(x));
  return hash;
}

}  // namespace detail

template <class State>
struct adam_state_traits;

template <>
struct adam_state_traits<float> {
  static constexpr bool quantized = false;
  static constexpr int bits = 32;
  static constexpr int default_block = 0;
  using moment_type = float;
  static constexpr const char* name = "fp32";
  static constexpr std::uint64_t map_fingerprint() noexcept { return 0; }
};

template <>
struct adam_state_traits<bf16> {
  static constexpr bool quantized = false;
  static constexpr int bits = 16;
  static constexpr int default_block = 0;
  using moment_type = bf16;
  static constexpr const char* name = "bf16";
  static constexpr std::uint64_t map_fingerprint() noexcept { return 0; }
};

template <>
struct adam_state_traits<four_bit> {
  static constexpr bool quantized = true;
  static constexpr int bits = 4;
  static constexpr int entries = 16;
  static constexpr int default_block = 128;
  using moment_type = std::uint8_t;
  static constexpr const char* name = "int4.dynamic3-m.linear-v";
  static constexpr const detail::int4_tables& tables() noexcept { return detail::int4_maps; }
  static constexpr std::uint64_t map_fingerprint() noexcept {
    return detail::table_fingerprint(detail::int4_maps.m, detail::int4_maps.v);
  }
  MEMKIT_HOST_DEVICE static MEMKIT_FORCEINLINE unsigned m_code(const float* m_table, float x) noexcept {
    return detail::nearest_in_table<16>(m_table, x);
  }
  MEMKIT_HOST_DEVICE static MEMKIT_FORCEINLINE unsigned v_code(const float* v_table, float x) noexcept {
    return detail::nearest_in_table<16>(v_table, x);
  }
  // The host loop's lookups (the same codes as m_code / v_code).
  struct host_coder {
    unsigned m(float x) const noexcept { return m_code(detail::int4_maps.m.data(), x); }
    unsigned v(float x) const noexcept { return v_code(detail::int4_maps.v.data(), x); }
  };
  static host_coder make_host_coder() { return {}; }
};

// 8-bit blockwise moments: the dynamic maps of the 8-bit optimizers paper (memkit/quant/codebooks.hpp),
// signed for m and unsigned for v, looked up with bitsandbytes' own nearest-code rule (the shared
// quant::nearest_dynamic, in the branch-free form detail::dynamic_code). The maps contain
// an exact zero, so a moment never quantizes to a code of the opposite sign (no sign fix-up needed).
template <>
struct adam_state_traits<std::int8_t> {
  static constexpr bool quantized = true;
  static constexpr int bits = 8;
  static constexpr int entries = 256;
  static constexpr int default_block = 256;
  using moment_type = std::uint8_t;
  static constexpr const char* name = "int8.dynamic-signed-m.dynamic-unsigned-v";
  static constexpr const detail::int8_tables& tables() noexcept { return detail::int8_maps; }
  static constexpr std::uint64_t map_fingerprint() noexcept {
    return detail::table_fingerprint(detail::int8_maps.m, detail::int8_maps.v);
  }
  MEMKIT_HOST_DEVICE static MEMKIT_FORCEINLINE unsigned m_code(const float* m_table, float x) noexcept {
    return detail::dynamic_code(m_table, x);
  }
  MEMKIT_HOST_DEVICE static MEMKIT_FORCEINLINE unsigned v_code(const float* v_table, float x) noexcept {
    return detail::dynamic_code(v_table, x);
  }
  // The host loop's lookups: indexed, the same codes as m_code / v_code.
  struct host_coder {
    const detail::dynamic_code_index* m_index;
    const detail::dynamic_code_index* v_index;
    unsigned m(float x) const noexcept { return detail::dynamic_code_indexed(*m_index, x); }
    unsigned v(float x) const noexcept { return detail::dynamic_code_indexed(*v_index, x); }
  };
  static host_coder make_host_coder() {
    return {&detail::dynamic_code_index_for<true>(), &detail::dynamic_code_index_for<false>()};
  }
};

namespace detail {

// Where one tensor's parameter values come from and go to during a step.
template <float_storage P, float_storage G>
struct param_access {
  P* param;
  const G* grad;
  float* master;  // nullptr: the parameter itself is updated
  bool stochastic_rounding;
  std::uint64_t seed;
  std::int64_t step;
  std::int64_t tensor;
  std::int64_t first = 0;  // the tensor index of element 0 (a shard of a tensor starts past 0): the random stream's position

  MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float load(std::int64_t i) const noexcept {
    return master != nullptr ? master[i] : to_float(param[i]);
  }
  MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE void store(std::int64_t i, float value) const noexcept {
    if (master != nullptr) master[i] = value;
    if constexpr (std::is_same_v<P, bf16>) {
      if (master == nullptr && stochastic_rounding)
        param[i] = bf16_stochastic_round(value, random_bits(seed, step, tensor, first + i));
      else
        param[i] = bf16(value);
    } else {
      param[i] = from_float<P>(value);
    }
  }
};

// Updates parameter i given its (dequantized) moments; m and v come back updated, unquantized.
template <float_storage P, float_storage G>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE void update_element(const param_access<P, G>& access, float& m, float& v,
                                                          std::int64_t i, const adam_coefficients& c) noexcept {
  float p = access.load(i);
  adamw_update(p, m, v, to_float(access.grad[i]), c);
  access.store(i, p);
}

// The same for moments stored as plain fp32/bf16 arrays.
template <float_storage P, float_storage G, float_storage M>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE void update_plain_element(const param_access<P, G>& access, M* m_array,
                                                                M* v_array, std::int64_t i,
                                                                const adam_coefficients& c) noexcept {
  float m = to_float(m_array[i]), v = to_float(v_array[i]);
  update_element(access, m, v, i, c);
  m_array[i] = from_float<M>(m);
  v_array[i] = from_float<M>(v);
}


// ---- Host block kernels of the step: the same bits as the per-element functions above, several
// elements at a time. Each vector lane performs exactly the scalar operations, in the same order and
// each IEEE correctly rounded, so the results do not depend on the vector width (tests/host/
// adam_fast_path_test.cpp checks every path against the per-element functions). ----

#if MEMKIT_HOST_SIMD
// The widest float vector the host compiler targets (SSE2 is the x86-64 baseline). The AVX-512 code
// uses the all-lanes masked forms of some intrinsics: g++ 12 warns (maybe-uninitialized) on the plain ones.
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

// adamw_update over contiguous arrays. The vector body repeats adamw_update's operations one for one
// (keep the two in step): g++ cannot vectorize adamw_update itself, because std::sqrt may set errno
// (-fmath-errno is the default), which puts a branch in every element.
inline void adamw_update_array(float* param, float* m, float* v, const float* grad, std::int64_t count,
                               const adam_coefficients& c) noexcept {
  std::int64_t i = 0;
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
  for (; i < count; ++i) adamw_update(param[i], m[i], v[i], grad[i], c);
}

// Dequantizes `count` codes of one block starting at element `first`: out[e] = table[code] * absmax.
template <int Bits>
inline void dequantize_codes(const float* table, const std::uint8_t* codes, std::int64_t first, std::int64_t count,
                             float absmax, float* out) noexcept {
  std::int64_t e = 0;
#if MEMKIT_HOST_SIMD && defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(absmax);
  if constexpr (Bits == 8) {
    // The 256-entry lookup from registers (a gather costs more): eight 32-entry permutes on the code's
    // low 5 bits, then a selection tree on bits 5, 6 and 7.
    __m512 entries[16];
    for (int j = 0; j < 16; ++j) entries[j] = _mm512_loadu_ps(table + 16 * j);
    for (const std::int64_t end = count - count % 16; e < end; e += 16) {
      const __m512i index = _mm512_maskz_cvtepu8_epi32(0xffff, _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + first + e)));
      __m512 part[8];
      for (int k = 0; k < 8; ++k) part[k] = _mm512_permutex2var_ps(entries[2 * k], index, entries[2 * k + 1]);
      const __mmask16 bit5 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(32));
      const __mmask16 bit6 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(64));
      const __mmask16 bit7 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(128));
      for (int k = 0; k < 4; ++k) part[k] = _mm512_mask_blend_ps(bit5, part[2 * k], part[2 * k + 1]);
      for (int k = 0; k < 2; ++k) part[k] = _mm512_mask_blend_ps(bit6, part[2 * k], part[2 * k + 1]);
      _mm512_storeu_ps(out + e, _mm512_mul_ps(_mm512_mask_blend_ps(bit7, part[0], part[1]), scale));
    }
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
#endif
  for (; e < count; ++e) out[e] = mul_rn(table[load_code<Bits>(codes, first + e)], absmax);
}

// 8-bit codes of values[e] * inverse, e < count, by the index (the codes of dynamic_code_indexed).
// The AVX-512 path works in three phases per chunk: keys (vector), the index words (scalar loads: on
// the CPUs measured, 16 scalar loads cost less than one 16-lane gather), then the midpoint test (vector).
inline void dynamic_codes_indexed(const dynamic_code_index& index, const float* values, float inverse,
                                  std::int64_t count, std::uint8_t* codes) noexcept {
  std::int64_t e = 0;
#if MEMKIT_HOST_SIMD && defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(inverse);
  const __m512i low_bits = _mm512_set1_epi32(0xffff), high_bits = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i code_bits = _mm512_set1_epi32(0xff), one = _mm512_set1_epi32(1);
  const __m512i magnitude_bits = _mm512_set1_epi32(0x7fffffff);
  const __m512i first_key = _mm512_set1_epi32(static_cast<int>(index.first_key));
  const __m512i last_key = _mm512_set1_epi32(static_cast<int>(dynamic_code_index::top_key - index.first_key));
  const __m512i negative_limit = _mm512_set1_epi32(static_cast<int>(index.negative_limit));
  const __m512i positive_buckets = _mm512_set1_epi32(static_cast<int>(index.positive_buckets));
  const std::uint32_t* buckets = index.buckets.data();
  constexpr int chunk = 256;
  alignas(64) std::uint32_t keys[chunk], words[chunk];
  for (const std::int64_t end = count - count % chunk; e < end; e += chunk) {
    for (int k = 0; k < chunk; k += 16) {  // dynamic_code_index::bucket_of, 16 lanes
      const __m512i x_bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(values + e + k), scale));
      const __m512i magnitude = _mm512_maskz_srli_epi32(0xffff, _mm512_and_si512(x_bits, magnitude_bits), 16);
      const __m512i key = _mm512_maskz_min_epu32(0xffff, _mm512_sub_epi32(_mm512_maskz_max_epu32(0xffff, magnitude, first_key), first_key), last_key);
      const __m512i negative_key = _mm512_add_epi32(_mm512_maskz_min_epu32(0xffff, key, negative_limit), positive_buckets);
      _mm512_store_si512(keys + k, _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(x_bits, _mm512_setzero_si512()), key, negative_key));
    }
    for (int k = 0; k < chunk; k += 4) {
      std::uint32_t k0 = keys[k], k1 = keys[k + 1], k2 = keys[k + 2], k3 = keys[k + 3];
      asm("" : "+r"(k0), "+r"(k1), "+r"(k2), "+r"(k3));  // keeps g++ from turning these loads back into a gather
      words[k] = buckets[k0];
      words[k + 1] = buckets[k1];
      words[k + 2] = buckets[k2];
      words[k + 3] = buckets[k3];
    }
    for (int k = 0; k < chunk; k += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(values + e + k), scale);
      const __m512i x_bits = _mm512_castps_si512(x);
      const __m512i bucket = _mm512_load_si512(words + k);
      const __m512 threshold = _mm512_castsi512_ps(
          _mm512_or_si512(_mm512_and_si512(x_bits, high_bits), _mm512_and_si512(bucket, low_bits)));
      const __mmask16 has_threshold = _mm512_test_epi32_mask(bucket, _mm512_set1_epi32(1 << 25));
      const __mmask16 tie_up = _mm512_test_epi32_mask(bucket, _mm512_set1_epi32(1 << 24));
      const __mmask16 up = has_threshold & (_mm512_cmp_ps_mask(x, threshold, _CMP_GT_OQ) |
                                            (_mm512_cmp_ps_mask(x, threshold, _CMP_EQ_OQ) & tie_up));
      const __m512i code = _mm512_and_si512(_mm512_maskz_srli_epi32(0xffff, bucket, 16), code_bits);
      const __mmask16 number = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);  // NaN -> code 0
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + e + k),
                       _mm512_maskz_cvtepi32_epi8(number, _mm512_mask_add_epi32(code, up, code, one)));
    }
  }
#endif
  for (; e < count; ++e) codes[e] = static_cast<std::uint8_t>(dynamic_code_indexed(index, mul_rn(values[e], inverse)));
}

// 4-bit codes of values[e] * inverse (nearest_in_table<16>), packed two per byte into codes[0..count/2);
// count is even (blocks are even-sized and start at even indices) except for a tensor's last block.
inline void table16_codes(const float* table, const float* values, float inverse, std::int64_t count,
                          std::uint8_t* codes) noexcept {
  std::int64_t e = 0;
#if MEMKIT_HOST_SIMD && defined(__AVX512F__)
  // After nearest_in_table's search, its midpoint test compares with (table[low] + table[low + 1]) * 0.5f,
  // never passed at the last entry.
  float midpoints[16];
  for (int k = 0; k < 15; ++k) midpoints[k] = mul_rn(add_rn(table[k], table[k + 1]), 0.5f);
  midpoints[15] = std::numeric_limits<float>::infinity();
  const __m512 middle = _mm512_loadu_ps(midpoints), entries = _mm512_loadu_ps(table);
  const __m512 scale = _mm512_set1_ps(inverse);
  const __m512i one = _mm512_set1_epi32(1);
  for (const std::int64_t end = count - count % 16; e < end; e += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(values + e), scale);
    __m512i low = _mm512_setzero_si512();
    for (int half = 8; half > 0; half >>= 1) {  // nearest_in_table's search, the table in a register
      const __m512i step = _mm512_set1_epi32(half);
      const __m512 probe = _mm512_maskz_permutexvar_ps(0xffff, _mm512_add_epi32(low, step), entries);
      low = _mm512_mask_add_epi32(low, _mm512_cmp_ps_mask(probe, x, _CMP_LE_OQ), low, step);
    }
    const __mmask16 up = _mm512_cmp_ps_mask(x, _mm512_maskz_permutexvar_ps(0xffff, low, middle), _CMP_GT_OQ);
    const __m128i code = _mm512_maskz_cvtepi32_epi8(0xffff, _mm512_mask_add_epi32(low, up, low, one));
    // Pairs (even, odd) -> (even << 4) | odd.
    const __m128i pairs = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(code, _mm_set1_epi16(0x00ff)), 4),
                                       _mm_srli_epi16(code, 8));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + e / 2), _mm_packus_epi16(pairs, pairs));
  }
#endif
  for (; e < count; e += 2) {
    const unsigned high = nearest_in_table<16>(table, mul_rn(values[e], inverse));
    const unsigned low = e + 1 < count ? nearest_in_table<16>(table, mul_rn(values[e + 1], inverse)) : 0u;
    codes[e / 2] = static_cast<std::uint8_t>((high << 4) | low);
  }
}

}  // namespace detail

MEMKIT_NAMESPACE_END
