// memkit/quant/dynamic_index.hpp — the nearest code in the 8-bit dynamic maps, found fast on the host.
//
// quant::nearest_dynamic (bitsandbytes' search over a 256-entry sorted map) is a chain of dependent,
// data-dependent branches. Two forms here give exactly its codes, ties and NaN included:
//   dynamic_code            branch-free binary search, host and device (MEMKIT_HOST_DEVICE);
//   dynamic_code_indexed    host: one load from a 33 KiB index keyed by the value's top 16 bits and one
//                           compare, with AVX-512 and AVX2 kernels for whole arrays (dynamic_codes_indexed).
// The 8-bit optimizer state (optim/state_codecs.hpp) encodes its moments with them, and blockwise int8
// quantization (quant/blockwise.hpp) its values. tests/host/adam_codes_test.cpp and the blockwise tests
// check them against nearest_dynamic.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/core/rounded_math.hpp"
#include "memkit/quant/codebooks.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace detail {

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

// Threshold k (k = 0..254) separates codes k and k + 1 of quant::nearest_dynamic: the float midpoint of
// the two entries, or for odd k (an exact tie goes up, to the even code k + 1) the float just below it.
// The code of x is the number of thresholds below it (NaN exceeds none: code 0).
MEMKIT_HOST_DEVICE constexpr float dynamic_threshold(const float* map, unsigned k) noexcept {
  const float middle = (map[k + 1] + map[k]) * 0.5f;  // nearest_dynamic's midpoint
  if (k % 2 == 0) return middle;
  const std::uint32_t bits = bit_cast<std::uint32_t>(middle);  // the next float towards -Inf
  return bit_cast<float>((bits & 0x7fffffffu) == 0 ? 0x80000001u : (bits >> 31) ? bits + 1 : bits - 1);
}

// The 255 thresholds of a sorted map in order, then +Inf up to `count` entries (count > 255); throws if they
// are out of order (a NaN entry included). The host index and the CUDA buckets both search these.
constexpr void sorted_dynamic_thresholds(const float* map, float* thresholds, unsigned count) {
  for (unsigned k = 0; k < 255; ++k) {
    thresholds[k] = dynamic_threshold(map, k);
    if (k > 0 && !(thresholds[k - 1] <= thresholds[k])) throw error("memkit: dynamic map thresholds out of order");
  }
  for (unsigned k = 255; k < count; ++k) thresholds[k] = std::numeric_limits<float>::infinity();
}

// The same code in two loads and two compares, for the 8-bit Adam update on CUDA. A binary search there
// made the update issue-bound (eight dependent levels per moment: 228 instructions per parameter against
// the fp32 update's 71, ncu on an H200); dynamic_code's probes of the sorted map also collide in one
// shared-memory bank for its first four steps. Buckets are keyed by the top bits of |x| (exponent and 6
// mantissa bits) and the sign; each holds the code of its lowest value and at most two thresholds
// (checked when built), so
//   code = low + (x > t[low]) + (x > t[low + 1])
// over the sorted thresholds t (dynamic_threshold, then +Inf). Magnitudes below the bucket of the
// smallest threshold share the first bucket, larger than 1 the last. NaN takes code 0.
// tests/host/adam_codes_test.cpp checks it against quant::nearest_dynamic.
struct dynamic_code_buckets {
  static constexpr int shift = 17;             // magnitude bits >> 17: exponent and 6 mantissa bits
  static constexpr int capacity = 4096;        // buckets of both signs
  static constexpr std::uint32_t last_key = 0x3f800000u >> shift;  // 1.0's
  std::uint32_t first_key = 0;
  std::uint32_t positive = 0;                  // buckets per sign: keys first_key..last_key
  float thresholds[257] = {};
  std::uint8_t low_code[capacity] = {};        // positive buckets, then negative ones
  std::uint32_t bucket_count = 0;              // 2 * positive
};

// Where x (not NaN) falls: its clamped magnitude key, past the positive buckets if x is negative.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE std::uint32_t dynamic_bucket_of(std::uint32_t bits, std::uint32_t first_key,
                                                                      std::uint32_t positive) noexcept {
  const std::uint32_t key = (bits & 0x7fffffffu) >> dynamic_code_buckets::shift;
  const std::uint32_t last = dynamic_code_buckets::last_key;
  const std::uint32_t clamped = key < first_key ? first_key : key > last ? last : key;
  return clamped - first_key + ((bits >> 31) ? positive : 0u);
}

// A bucket's two thresholds t[low], t[low + 1], side by side so that a device reads them in one 8-byte load.
struct alignas(8) dynamic_threshold_pair {
  float first, second;
};
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE unsigned dynamic_code_in_bucket(unsigned low, dynamic_threshold_pair t, float x) noexcept {
  const unsigned code = low + static_cast<unsigned>(x > t.first) + static_cast<unsigned>(x > t.second);
  return x == x ? code : 0u;
}

MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE unsigned dynamic_code_bucketed(const float* thresholds, const std::uint8_t* low_code,
                                                                     std::uint32_t first_key, std::uint32_t positive,
                                                                     float x) noexcept {
  const unsigned low = low_code[dynamic_bucket_of(bit_cast<std::uint32_t>(x), first_key, positive)];
  return dynamic_code_in_bucket(low, {thresholds[low], thresholds[low + 1]}, x);
}
// The same code from pairs[k] = {t[k], t[k + 1]} (k < 256): the CUDA update's shared copy, one load per probe
// pair instead of two.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE unsigned dynamic_code_bucketed(const dynamic_threshold_pair* pairs,
                                                                     const std::uint8_t* low_code, std::uint32_t first_key,
                                                                     std::uint32_t positive, float x) noexcept {
  const unsigned low = low_code[dynamic_bucket_of(bit_cast<std::uint32_t>(x), first_key, positive)];
  return dynamic_code_in_bucket(low, pairs[low], x);
}

// Builds the buckets of a sorted 256-entry map; throws (at compile time: not a constant expression) if a
// bucket would hold more than two thresholds or the map does not fit.
constexpr dynamic_code_buckets make_dynamic_code_buckets(const std::array<float, 256>& map) {
  dynamic_code_buckets b;
  sorted_dynamic_thresholds(map.data(), b.thresholds, 257);
  float smallest = 1.0f;
  for (unsigned k = 0; k < 255; ++k) {
    const float magnitude = b.thresholds[k] < 0.0f ? -b.thresholds[k] : b.thresholds[k];
    if (magnitude != 0.0f && magnitude < smallest) smallest = magnitude;
  }
  b.first_key = (bit_cast<std::uint32_t>(smallest) >> dynamic_code_buckets::shift) - 1;
  b.positive = dynamic_code_buckets::last_key - b.first_key + 1;
  b.bucket_count = 2 * b.positive;
  if (b.bucket_count > static_cast<std::uint32_t>(dynamic_code_buckets::capacity))
    throw error("memkit: dynamic map too wide for its buckets");
  constexpr float infinity = std::numeric_limits<float>::infinity();
  // In increasing x: the negative buckets from the largest magnitude down, then the positive ones up; the
  // count of thresholds below a bucket's lowest x only grows.
  unsigned low = 0;
  for (std::uint32_t step = 0; step < b.bucket_count; ++step) {
    const std::uint32_t bucket = step < b.positive ? b.bucket_count - 1 - step : step - b.positive;
    const bool negative = bucket >= b.positive;
    const std::uint32_t key = b.first_key + (negative ? bucket - b.positive : bucket);
    // The magnitudes the bucket serves, clamped ends included, and so its lowest and highest x.
    const float small = key == b.first_key ? 0.0f : bit_cast<float>(key << dynamic_code_buckets::shift);
    const float large = key == dynamic_code_buckets::last_key ? infinity
                                                              : bit_cast<float>(((key + 1) << dynamic_code_buckets::shift) - 1);
    const float lowest = negative ? -large : small, highest = negative ? -small : large;
    while (low < 255 && b.thresholds[low] < lowest) ++low;
    if (!(b.thresholds[low + 2 < 256 ? low + 2 : 256] >= highest))  // a third threshold inside the bucket
      throw error("memkit: a dynamic map bucket holds more than two thresholds");
    b.low_code[bucket] = static_cast<std::uint8_t>(low);
  }
  return b;
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

  // The same codes as a binary search, for the AVX-512 kernel (no table loads per value: gathers and scalar
  // loads cost more than permutes). The code of x is the number of the 255 thresholds below it, where
  // threshold k is the midpoint between entries k and k + 1, or for odd k (a tie goes up to the even k + 1)
  // the float just below that midpoint; NaN exceeds none. Step s of the search (s = 128 .. 1) probes
  // threshold c + s - 1, c a multiple of 2s; search_tables lists them per step at index c / (2s):
  //   [0, 16) s = 64, [16, 32) s = 32, [32, 48) s = 16, [48, 64) s = 8, [64, 96) s = 4, [96, 160) s = 2,
  //   [160, 288) s = 1; the step s = 128 compares with search_middle (threshold 127).
  float search_middle = 0.0f;
  std::vector<float> search_tables;

  // The bucket of x (not NaN): its clamped magnitude key, offset past the positive buckets if x < 0.
  std::uint32_t bucket_of(std::uint32_t bits) const noexcept {
    const std::uint32_t magnitude = (bits & 0x7fffffffu) >> 16;
    const std::uint32_t key = (magnitude < first_key ? first_key : magnitude > top_key ? top_key : magnitude) - first_key;
    // Selected arithmetically: the sign is a coin flip for optimizer moments, and a branch on it mispredicts.
    const std::uint32_t negative_key = positive_buckets + (key < negative_limit ? key : negative_limit);
    const std::uint32_t negative = 0u - (bits >> 31);
    return key ^ ((key ^ negative_key) & negative);
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
  float thresholds[256];
  sorted_dynamic_thresholds(map, thresholds, 256);
  index.search_middle = thresholds[127];
  index.search_tables.assign(288, std::numeric_limits<float>::infinity());
  const unsigned offsets[7] = {0, 16, 32, 48, 64, 96, 160};
  for (unsigned level = 0, s = 64; s > 0; ++level, s >>= 1)
    for (unsigned j = 0; j * 2 * s < 256; ++j) index.search_tables[offsets[level] + j] = thresholds[j * 2 * s + s - 1];
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

#if MEMKIT_X86_DISPATCH
// 8 int32 lanes holding values 0..255 -> their low bytes, in order, in the low 8 bytes.
__attribute__((target("avx2"))) inline __m128i low_bytes_avx2(__m256i lanes) noexcept {
  const __m256i gather = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(lanes, gather);
  return _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
}

#endif

#if MEMKIT_X86_DISPATCH
// dynamic_codes_indexed's AVX2 kernel works in three phases per chunk of up to indexed_chunk values:
// the bucket keys (vector), the index words (scalar loads: on the CPUs measured, scalar loads cost less
// than a gather), then the midpoint test (vector).
inline constexpr int indexed_chunk = 256;

inline void load_index_words(const std::uint32_t* buckets, const std::uint32_t* keys, int length,
                             std::uint32_t* words) noexcept {
  for (int k = 0; k < length; k += 4) {
    std::uint32_t k0 = keys[k], k1 = keys[k + 1], k2 = keys[k + 2], k3 = keys[k + 3];
    asm("" : "+r"(k0), "+r"(k1), "+r"(k2), "+r"(k3));  // keeps g++ from turning these loads back into a gather
    words[k] = buckets[k0];
    words[k + 1] = buckets[k1];
    words[k + 2] = buckets[k2];
    words[k + 3] = buckets[k3];
  }
}

// One step of the search: c += s where x > probe.
__attribute__((target("avx512f"))) inline __m512i search_step_avx512(__m512i c, __m512 x, __m512 probe, int s) noexcept {
  return _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(x, probe, _CMP_GT_OQ), c, _mm512_set1_epi32(s));
}

// The search for U vectors of 16 values at once, step by step: one vector's steps form a chain of dependent
// permutes and compares (~80 cycles), so independent vectors are interleaved to keep the ports busy.
struct search_registers {
  __m512 middle, t64, t32, t16, t8, t4a, t4b, t2[4], t1[8];
};

// The steps of 64, 32, 16 and 8 (Shift 7..4): the probe is entry c >> Shift of one 16-entry table.
template <int U, int Shift>
__attribute__((target("avx512f"))) inline void permute_step_avx512(__m512 table, const __m512 (&x)[U], __m512i (&c)[U]) noexcept {
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
    c[u] = search_step_avx512(c[u], x[u], _mm512_maskz_permutexvar_ps(0xffff, _mm512_maskz_srli_epi32(0xffff, c[u], Shift), table),
                              1 << (Shift - 1));
}

template <int U>
__attribute__((target("avx512f,avx512bw,avx512dq"))) inline void search_codes_avx512(const search_registers& r,
                                                                                   const __m512 (&x)[U],
                                                                                   __m512i (&c)[U]) noexcept {
  const __m512i bit5 = _mm512_set1_epi32(32), bit6 = _mm512_set1_epi32(64);
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
    c[u] = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x[u], r.middle, _CMP_GT_OQ), _mm512_set1_epi32(128));
  permute_step_avx512<U, 7>(r.t64, x, c);
  permute_step_avx512<U, 6>(r.t32, x, c);
  permute_step_avx512<U, 5>(r.t16, x, c);
  permute_step_avx512<U, 4>(r.t8, x, c);
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
    c[u] = search_step_avx512(c[u], x[u], _mm512_permutex2var_ps(r.t4a, _mm512_maskz_srli_epi32(0xffff, c[u], 3), r.t4b), 4);
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u) {
    const __m512i j = _mm512_maskz_srli_epi32(0xffff, c[u], 2);  // 0..63: bit 5 picks the half
    c[u] = search_step_avx512(c[u], x[u],
                              _mm512_mask_blend_ps(_mm512_test_epi32_mask(j, bit5), _mm512_permutex2var_ps(r.t2[0], j, r.t2[1]),
                                                   _mm512_permutex2var_ps(r.t2[2], j, r.t2[3])),
                              2);
  }
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u) {
    const __m512i j = _mm512_maskz_srli_epi32(0xffff, c[u], 1);  // 0..127: bits 5 and 6 pick the quarter
    const __mmask16 b5 = _mm512_test_epi32_mask(j, bit5);
    const __m512 low = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(r.t1[0], j, r.t1[1]), _mm512_permutex2var_ps(r.t1[2], j, r.t1[3]));
    const __m512 high = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(r.t1[4], j, r.t1[5]), _mm512_permutex2var_ps(r.t1[6], j, r.t1[7]));
    c[u] = search_step_avx512(c[u], x[u], _mm512_mask_blend_ps(_mm512_test_epi32_mask(j, bit6), low, high), 1);
  }
}

// dynamic_code_index's binary search (search_tables): the probes come from registers (one to eight permutes
// per step), so no value waits on a table load; 64 values per round, as four interleaved searches.
__attribute__((target("avx512f,avx512bw,avx512dq"))) inline std::int64_t dynamic_codes_search_avx512(
    const dynamic_code_index& index, const float* values, float inverse, std::int64_t count, std::uint8_t* codes) noexcept {
  const float* t = index.search_tables.data();
  search_registers r;
  r.middle = _mm512_set1_ps(index.search_middle);
  r.t64 = _mm512_loadu_ps(t), r.t32 = _mm512_loadu_ps(t + 16), r.t16 = _mm512_loadu_ps(t + 32);
  r.t8 = _mm512_loadu_ps(t + 48), r.t4a = _mm512_loadu_ps(t + 64), r.t4b = _mm512_loadu_ps(t + 80);
  for (int k = 0; k < 4; ++k) r.t2[k] = _mm512_loadu_ps(t + 96 + 16 * k);
  for (int k = 0; k < 8; ++k) r.t1[k] = _mm512_loadu_ps(t + 160 + 16 * k);
  const __m512 scale = _mm512_set1_ps(inverse);
  std::int64_t e = 0;
  for (; e + 64 <= count; e += 64) {
    __m512 x[4];
    __m512i c[4];
    for (int u = 0; u < 4; ++u) x[u] = _mm512_mul_ps(_mm512_loadu_ps(values + e + 16 * u), scale);
    search_codes_avx512<4>(r, x, c);
    for (int u = 0; u < 4; ++u)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + e + 16 * u), _mm512_maskz_cvtepi32_epi8(0xffff, c[u]));
  }
  for (; e + 16 <= count; e += 16) {
    __m512 x[1] = {_mm512_mul_ps(_mm512_loadu_ps(values + e), scale)};
    __m512i c[1];
    search_codes_avx512<1>(r, x, c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + e), _mm512_maskz_cvtepi32_epi8(0xffff, c[0]));
  }
  return e;
}

__attribute__((target("avx2,fma"))) inline std::int64_t dynamic_codes_indexed_avx2(const dynamic_code_index& index,
                                                                                  const float* values, float inverse,
                                                                                  std::int64_t count,
                                                                                  std::uint8_t* codes) noexcept {
  std::int64_t e = 0;
  const __m256 scale = _mm256_set1_ps(inverse);
  const __m256i low_bits = _mm256_set1_epi32(0xffff), high_bits = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i code_bits = _mm256_set1_epi32(0xff), magnitude_bits = _mm256_set1_epi32(0x7fffffff);
  const __m256i first_key = _mm256_set1_epi32(static_cast<int>(index.first_key));
  const __m256i last_key = _mm256_set1_epi32(static_cast<int>(dynamic_code_index::top_key - index.first_key));
  const __m256i negative_limit = _mm256_set1_epi32(static_cast<int>(index.negative_limit));
  const __m256i positive_buckets = _mm256_set1_epi32(static_cast<int>(index.positive_buckets));
  alignas(64) std::uint32_t keys[indexed_chunk], words[indexed_chunk];
  for (int length; (length = static_cast<int>(std::min<std::int64_t>(indexed_chunk, (count - e) / 8 * 8))) > 0; e += length) {
    for (int k = 0; k < length; k += 8) {  // dynamic_code_index::bucket_of, 8 lanes
      const __m256i x_bits = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(values + e + k), scale));
      const __m256i magnitude = _mm256_srli_epi32(_mm256_and_si256(x_bits, magnitude_bits), 16);
      const __m256i key = _mm256_min_epu32(_mm256_sub_epi32(_mm256_max_epu32(magnitude, first_key), first_key), last_key);
      const __m256i negative_key = _mm256_add_epi32(_mm256_min_epu32(key, negative_limit), positive_buckets);
      const __m256i negative = _mm256_srai_epi32(x_bits, 31);  // the sign bit, in every bit
      _mm256_store_si256(reinterpret_cast<__m256i*>(keys + k), _mm256_blendv_epi8(key, negative_key, negative));
    }
    load_index_words(index.buckets.data(), keys, length, words);
    for (int k = 0; k < length; k += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(values + e + k), scale);
      const __m256i x_bits = _mm256_castps_si256(x);
      const __m256i bucket = _mm256_load_si256(reinterpret_cast<const __m256i*>(words + k));
      const __m256 threshold = _mm256_castsi256_ps(
          _mm256_or_si256(_mm256_and_si256(x_bits, high_bits), _mm256_and_si256(bucket, low_bits)));
      const __m256i has_threshold = _mm256_srai_epi32(_mm256_slli_epi32(bucket, 6), 31);  // bit 25, in every bit
      const __m256i tie_up = _mm256_srai_epi32(_mm256_slli_epi32(bucket, 7), 31);         // bit 24
      const __m256i above = _mm256_castps_si256(_mm256_cmp_ps(x, threshold, _CMP_GT_OQ));
      const __m256i tie = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(x, threshold, _CMP_EQ_OQ)), tie_up);
      const __m256i up = _mm256_and_si256(has_threshold, _mm256_or_si256(above, tie));  // -1 where the code goes up
      const __m256i code = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(bucket, 16), code_bits), up);
      const __m256i number = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));  // NaN -> code 0
      _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + e + k), low_bytes_avx2(_mm256_and_si256(code, number)));
    }
  }
  return e;
}
#endif

// 8-bit codes of values[e] * inverse, e < count, by the index (the codes of dynamic_code_indexed).
inline void dynamic_codes_indexed(const dynamic_code_index& index, const float* values, float inverse,
                                  std::int64_t count, std::uint8_t* codes) noexcept {
  std::int64_t e = 0;
#if MEMKIT_X86_DISPATCH
  const host_isa isa = host_isa_in_use();
  if (isa == host_isa::avx512) e = dynamic_codes_search_avx512(index, values, inverse, count, codes);
  else if (isa == host_isa::avx2) e = dynamic_codes_indexed_avx2(index, values, inverse, count, codes);
#endif
  for (; e < count; ++e) codes[e] = static_cast<std::uint8_t>(dynamic_code_indexed(index, mul_rn(values[e], inverse)));
}

}  // namespace detail

MEMKIT_NAMESPACE_END
