// memkit/optim/state_codecs.hpp — how each adam_state flavour stores its moments, and the element-wise
// load/update/store helpers the host loop and the CUDA kernels share. The host step's vector loops over
// whole blocks are in detail/adam_simd.hpp.
//
// Quantized moments are codes into a sorted table of 2^bits values in [-1, 1] (m) or [0, 1] (v), scaled
// by the block's absmax: value = table[code] * absmax. 4-bit codes are packed two per byte, the element
// at the even index in the high nibble (as bitsandbytes and torchao pack them).
#pragma once

#include <algorithm>
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
#include "memkit/quant/dynamic_index.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace optim {

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

// nearest_in_table<16>'s midpoint test in every position: midpoint k separates codes k and k + 1 (the same
// float expression, evaluated at compile time). Each must lie in [table[k], table[k + 1]) and the table be
// strictly increasing (throws otherwise: not a constant expression), which makes nearest_in_table's code the
// number of midpoints below x (x >= table[k + 1] passes midpoint k strictly; NaN passes none).
// A plain array, not std::array, whose operator[] is host-only for nvcc.
struct midpoints16 {
  float t[15];
};
constexpr midpoints16 constant_midpoints16(const std::array<float, 16>& table) {
  midpoints16 midpoints{};
  for (std::size_t k = 0; k < 15; ++k) {
    midpoints.t[k] = (table[k] + table[k + 1]) * 0.5f;
    if (!(table[k] < table[k + 1] && table[k] <= midpoints.t[k] && midpoints.t[k] < table[k + 1]))
      throw error("memkit: a 4-bit table is not strictly increasing with midpoints between its entries");
  }
  return midpoints;
}

// b ? a : c, on the bit patterns: nvcc turned a ternary selection of constants into divergent branches
// (BSSY/BRA in the SASS), which a warp takes both sides of.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float select_bits(bool b, float a, float c) noexcept {
  const std::uint32_t ua = bit_cast<std::uint32_t>(a), uc = bit_cast<std::uint32_t>(c);
  return bit_cast<float>(uc ^ ((ua ^ uc) & (0u - static_cast<std::uint32_t>(b))));
}

// The number of the 15 sorted thresholds t below x (strict >; NaN: 0), by a 4-level binary search. The first two
// levels' probes are selected among t's entries (compile-time constants where t is one); the last two are
// probe(k), which must return t[k]: the CUDA update reads them from warp lane k's register with a shuffle, the
// host from t. On sm_90: 19 instructions and 2 shuffles per code, no branch, where nearest_in_table's search of a
// shared table took 33 with 5 dependent LDS (docs/cuda.md, "The #30 kernels").
template <class Probe>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE unsigned count_below16(const midpoints16& midpoints, float x, const Probe& probe) noexcept {
  const float* t = midpoints.t;
  const bool b8 = x > t[7];
  const unsigned c4 = (b8 ? 8u : 0u) | (x > select_bits(b8, t[11], t[3]) ? 4u : 0u);
  const unsigned c2 = c4 | (x > probe(c4 + 1) ? 2u : 0u);
  return c2 | (x > probe(c2) ? 1u : 0u);
}

template <int Bits>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE unsigned load_code(const std::uint8_t* codes, std::int64_t index) noexcept {
  if constexpr (Bits == 8) return codes[index];
  else return (index & 1) ? (codes[index >> 1] & 0x0fu) : (codes[index >> 1] >> 4);
}

// A block's absmax, one value at a time: memkit's one rule (core/rounded_math.hpp, max_magnitude), the same
// the host's max_magnitude_bits applies to a whole block. Exact and order-free, NaN included: a NaN moment
// makes the block's absmax NaN on the host and on the device.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float max_abs(float current, float value) noexcept {
  return max_magnitude(current, value);
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
inline constexpr midpoints16 int4_m_midpoints = constant_midpoints16(int4_maps.m);
inline constexpr midpoints16 int4_v_midpoints = constant_midpoints16(int4_maps.v);

// A fingerprint of a pair of tables, saved with the state so a change of map is caught on load.
template <std::size_t N>
constexpr std::uint64_t table_fingerprint(const std::array<float, N>& m, const std::array<float, N>& v) noexcept {
  std::uint64_t hash = N;
  for (float x : m) hash = mix64(hash ^ bit_cast<std::uint32_t>(x));
  for (float x : v) hash = mix64(hash ^ bit_cast<std::uint32_t>(x));
  return hash;
}

// What a quantized flavour's traits take from its pair of maps (m's and v's, of equal size).
template <const auto& Maps>
struct coded_maps {
  static constexpr int entries = static_cast<int>(Maps.m.size());
  static constexpr const auto& tables() noexcept { return Maps; }
  static constexpr std::uint64_t map_fingerprint() noexcept { return table_fingerprint(Maps.m, Maps.v); }
};

}  // namespace detail

// A flavour of moments: its storage (adam_moment_format, optim/adam_bytes.hpp), name, code tables and coders.
template <class State>
struct adam_state_traits;

template <>
struct adam_state_traits<float> : adam_moment_format<float> {
  static constexpr const char* name = "fp32";
  static constexpr std::uint64_t map_fingerprint() noexcept { return 0; }
};

template <>
struct adam_state_traits<bf16> : adam_moment_format<bf16> {
  static constexpr const char* name = "bf16";
  static constexpr std::uint64_t map_fingerprint() noexcept { return 0; }
};

template <>
struct adam_state_traits<four_bit> : adam_moment_format<four_bit>, detail::coded_maps<detail::int4_maps> {
  static constexpr const char* name = "int4.dynamic3-m.linear-v";
  // The code of x in `table` (m's or v's map: one rule for both).
  MEMKIT_HOST_DEVICE static MEMKIT_FORCEINLINE unsigned code(const float* table, float x) noexcept {
    return detail::nearest_in_table<16>(table, x);
  }
  // code() in the state's own maps, m's (M = true) or v's, by count_below16 over their midpoints; probe(k)
  // returns midpoint k (the CUDA update: a shuffle from the warp lane holding it). tests/host/adam_codes_test.cpp
  // checks it against code() over every float.
  template <bool M, class Probe>
  MEMKIT_HOST_DEVICE static MEMKIT_FORCEINLINE unsigned constant_code(float x, const Probe& probe) noexcept {
    constexpr detail::midpoints16 midpoints = M ? detail::int4_m_midpoints : detail::int4_v_midpoints;
    return detail::count_below16(midpoints, x, probe);
  }
  // The same with the midpoints read from the constants (host).
  template <bool M>
  static unsigned constant_code(float x) noexcept {
    const float* midpoints = (M ? detail::int4_m_midpoints : detail::int4_v_midpoints).t;
    return constant_code<M>(x, [midpoints](unsigned k) { return midpoints[k]; });
  }
  // The host loop's lookups (the same codes as code()).
  struct host_coder {
    unsigned m(float x) const noexcept { return code(detail::int4_maps.m.data(), x); }
    unsigned v(float x) const noexcept { return code(detail::int4_maps.v.data(), x); }
  };
  static host_coder make_host_coder() { return {}; }
};

// 8-bit blockwise moments: the dynamic maps of the 8-bit optimizers paper (memkit/quant/codebooks.hpp),
// signed for m and unsigned for v, looked up with bitsandbytes' own nearest-code rule (the shared
// quant::nearest_dynamic, in the branch-free form detail::dynamic_code). The maps contain
// an exact zero, so a moment never quantizes to a code of the opposite sign (no sign fix-up needed).
template <>
struct adam_state_traits<std::int8_t> : adam_moment_format<std::int8_t>, detail::coded_maps<detail::int8_maps> {
  static constexpr const char* name = "int8.dynamic-signed-m.dynamic-unsigned-v";
  // The code of x in `table` (m's or v's map: one rule for both).
  MEMKIT_HOST_DEVICE static MEMKIT_FORCEINLINE unsigned code(const float* table, float x) noexcept {
    return detail::dynamic_code(table, x);
  }
  // The host loop's lookups: indexed, the same codes as code().
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
    param[i] = rounded(i, value);
  }
  // The parameter's stored value for element i (the CUDA update's vector stores use it too).
  MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE P rounded(std::int64_t i, float value) const noexcept {
    if constexpr (std::is_same_v<P, bf16>) {
      if (master == nullptr && stochastic_rounding) return bf16_stochastic_round(value, random_bits(seed, step, tensor, first + i));
      return bf16(value);
    } else {
      return from_float<P>(value);
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


// The largest magnitude bits (max_magnitude_bits) of a block's new m and v.
struct moment_maxima {
  std::uint32_t m = 0, v = 0;
};

}  // namespace detail

}  // namespace optim
MEMKIT_NAMESPACE_END
