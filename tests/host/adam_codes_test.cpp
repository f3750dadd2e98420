// The optimizer's fast code lookups give exactly the codes of the shared quant::nearest_dynamic, and the
// 4-bit maps are torchao's.
#include <doctest/doctest.h>
#include <memkit/optim/state_codecs.hpp>
#include <memkit/quant/codebooks.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

namespace {

// Every entry, every float midpoint, and a few ulps around each: the only places a code can change.
std::vector<float> boundary_values(const std::array<float, 256>& map) {
  std::vector<float> values{0.0f, -0.0f, 1.0f, -1.0f, 1.0000001f, -1.0000001f, 2.0f, -2.0f, 1e-30f, -1e-30f,
                            std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()};
  for (std::size_t i = 0; i < map.size(); ++i) {
    std::vector<float> centres{map[i]};
    if (i + 1 < map.size()) centres.push_back((map[i + 1] + map[i]) * 0.5f);
    for (float centre : centres) {
      float up = centre, down = centre;
      values.push_back(centre);
      for (int k = 0; k < 4; ++k) {
        up = std::nextafter(up, 2.0f);
        down = std::nextafter(down, -2.0f);
        values.push_back(up);
        values.push_back(down);
      }
    }
  }
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-24.0f, 0.0f);
  for (int i = 0; i < 200000; ++i) {
    values.push_back(uniform(rng));
    const float magnitude = std::pow(2.0f, exponent(rng));
    values.push_back(i % 2 ? magnitude : -magnitude);
  }
  return values;
}

template <bool Signed>
void check_map(const std::array<float, 256>& map) {
  const auto& index = memkit::detail::dynamic_code_index_for<Signed>();
  static const memkit::detail::dynamic_code_buckets buckets = memkit::detail::make_dynamic_code_buckets(map);
  int branch_free = 0, indexed = 0, bucketed = 0, paired = 0;
  // The CUDA update's layout of the thresholds (#30): pairs[k] = {t[k], t[k + 1]}.
  std::array<memkit::detail::dynamic_threshold_pair, 256> pairs{};
  for (std::size_t k = 0; k < pairs.size(); ++k) pairs[k] = {buckets.thresholds[k], buckets.thresholds[k + 1]};
  auto values = boundary_values(map);
  // Every bucket's ends too: where a bucket's two probes must hand over to the next bucket's.
  for (std::uint32_t key = buckets.first_key; key <= memkit::detail::dynamic_code_buckets::last_key + 1; ++key)
    for (std::uint32_t bits : {key << 17, (key << 17) - 1, (key << 17) + 1})
      for (std::uint32_t sign : {0u, 0x80000000u}) values.push_back(memkit::detail::bit_cast<float>(bits | sign));
  for (float x : values) {
    const unsigned expected = memkit::quant::nearest_dynamic(map.data(), x);
    branch_free += memkit::detail::dynamic_code(map.data(), x) != expected;
    indexed += memkit::detail::dynamic_code_indexed(index, x) != expected;
    bucketed += memkit::detail::dynamic_code_bucketed(buckets.thresholds, buckets.low_code, buckets.first_key,
                                                      buckets.positive, x) != expected;
    paired += memkit::detail::dynamic_code_bucketed(pairs.data(), buckets.low_code, buckets.first_key, buckets.positive,
                                                    x) != expected;
  }
  CHECK(values.size() > 400000);
  CHECK(branch_free == 0);
  CHECK(indexed == 0);
  CHECK(bucketed == 0);
  CHECK(paired == 0);
}

}  // namespace

TEST_CASE("adam codes: the branch-free, indexed and bucketed 8-bit lookups equal quant::nearest_dynamic, ties included") {
  check_map<true>(memkit::quant::dynamic_map_signed);
  check_map<false>(memkit::quant::dynamic_map_unsigned);
}

TEST_CASE("adam codes: odd thresholds sit one float below the midpoint (a tie goes up to the even code)") {
  const auto& map = memkit::quant::dynamic_map_signed;
  const float middle = (map[11] + map[10]) * 0.5f, odd_middle = (map[12] + map[11]) * 0.5f;
  CHECK(memkit::detail::dynamic_threshold(map.data(), 10) == middle);
  CHECK(memkit::detail::dynamic_threshold(map.data(), 11) == std::nextafter(odd_middle, -2.0f));
  static const auto buckets = memkit::detail::make_dynamic_code_buckets(map);
  auto code = [&](float x) {
    return memkit::detail::dynamic_code_bucketed(buckets.thresholds, buckets.low_code, buckets.first_key, buckets.positive, x);
  };
  CHECK(code(middle) == 10u);
  CHECK(code(odd_middle) == 12u);
  CHECK(code(std::numeric_limits<float>::quiet_NaN()) == 0u);
  CHECK(code(-std::numeric_limits<float>::quiet_NaN()) == 0u);
}

TEST_CASE("adam codes: the 4-bit maps are torchao's and round to the nearest entry, ties down") {
  const auto& maps = memkit::optim::detail::int4_maps;
  const float expected_m[16] = {-0.8875f, -0.6625f, -0.4375f, -0.2125f, -0.0775f, -0.0325f, -0.0055f, 0.0f,
                                0.0055f,  0.0325f,  0.0775f,  0.2125f,  0.4375f,  0.6625f,  0.8875f,  1.0f};
  for (int i = 0; i < 16; ++i) {
    CHECK(maps.m[static_cast<std::size_t>(i)] == doctest::Approx(expected_m[i]).epsilon(1e-6));
    CHECK(maps.v[static_cast<std::size_t>(i)] == static_cast<float>(i + 1) / 16.0f);
  }
  using traits = memkit::optim::adam_state_traits<memkit::optim::four_bit>;
  for (int i = 0; i < 16; ++i) CHECK(traits::code(maps.m.data(), maps.m[static_cast<std::size_t>(i)]) == static_cast<unsigned>(i));
  for (int i = 0; i + 1 < 16; ++i) {
    const float middle = (maps.v[static_cast<std::size_t>(i)] + maps.v[static_cast<std::size_t>(i + 1)]) * 0.5f;
    CHECK(traits::code(maps.v.data(), middle) == static_cast<unsigned>(i));  // a tie goes down
    CHECK(traits::code(maps.v.data(), std::nextafter(middle, 2.0f)) == static_cast<unsigned>(i + 1));
  }
  CHECK(traits::code(maps.v.data(), 0.0f) == 0u);  // no zero level: 0 maps to 1/16 (times absmax 0 -> 0)
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  int not_nearest = 0;
  for (int n = 0; n < 20000; ++n) {
    const float x = uniform(rng);
    const unsigned code = traits::code(maps.m.data(), x);
    for (int j = 0; j < 16; ++j)
      not_nearest += std::abs(maps.m[code] - x) > std::abs(maps.m[static_cast<std::size_t>(j)] - x) + 1e-7f;
  }
  CHECK(not_nearest == 0);
}

// constant_code<M>'s tree over compile-time midpoints against code()'s search of the table, for one float.
template <bool M>
bool same_4bit_code(std::uint32_t bits) {
  using traits = memkit::optim::adam_state_traits<memkit::optim::four_bit>;
  const auto& maps = memkit::optim::detail::int4_maps;
  const float x = std::bit_cast<float>(bits);
  return traits::constant_code<M>(x) == traits::code(M ? maps.m.data() : maps.v.data(), x);
}

TEST_CASE("adam codes: the 4-bit codes from constant midpoints are code()'s, for every float checked") {
  // Every 257th bit pattern (all exponents, both signs, NaN and Inf among them) and every float within 2^12
  // ulps of each entry and midpoint (where a code changes). MEMKIT_EXHAUSTIVE_CODES=1 checks all 2^32 floats
  // (about a minute at -O2).
  const auto& maps = memkit::optim::detail::int4_maps;
  const bool exhaustive = std::getenv("MEMKIT_EXHAUSTIVE_CODES") != nullptr;
  std::uint64_t checked = 0, wrong_m = 0, wrong_v = 0;
  auto check = [&](std::uint32_t bits) {
    wrong_m += !same_4bit_code<true>(bits);
    wrong_v += !same_4bit_code<false>(bits);
    ++checked;
  };
  const std::uint64_t stride = exhaustive ? 1 : 257;
  for (std::uint64_t bits = 0; bits < (std::uint64_t{1} << 32); bits += stride) check(static_cast<std::uint32_t>(bits));
  for (const auto* table : {&maps.m, &maps.v})
    for (std::size_t k = 0; k < 16; ++k) {
      const float middle = k + 1 < 16 ? ((*table)[k] + (*table)[k + 1]) * 0.5f : 2.0f;
      for (const float centre : {(*table)[k], middle, -(*table)[k], -middle}) {
        const std::uint32_t c = std::bit_cast<std::uint32_t>(centre);
        for (std::uint32_t d = 0; d <= 4096; ++d) {
          check(c + d);
          check(c - d);
        }
      }
    }
  CHECK(checked > 16'000'000);
  CHECK(wrong_m == 0);
  CHECK(wrong_v == 0);
  using traits = memkit::optim::adam_state_traits<memkit::optim::four_bit>;
  CHECK(traits::constant_code<true>(std::numeric_limits<float>::quiet_NaN()) == 0u);
  CHECK(traits::constant_code<false>(std::numeric_limits<float>::infinity()) == 15u);
  CHECK(traits::constant_code<true>(-std::numeric_limits<float>::infinity()) == 0u);
  MESSAGE("4-bit constant-midpoint codes: " << checked << " floats checked against code()");
}

TEST_CASE("adam codes: the 8-bit index keeps only the magnitudes between the smallest midpoint and 1") {
  // Both indexes together stay small enough to share L1/L2 with the step's streams.
  const auto& signed_index = memkit::detail::dynamic_code_index_for<true>();
  const auto& unsigned_index = memkit::detail::dynamic_code_index_for<false>();
  const std::size_t bytes = (signed_index.buckets.size() + unsigned_index.buckets.size()) * sizeof(std::uint32_t);
  CHECK(bytes < 40 * 1024);
  // The signed map mirrors its buckets; the unsigned map has one bucket for every negative value.
  CHECK(signed_index.buckets.size() == 2 * signed_index.positive_buckets);
  CHECK(unsigned_index.buckets.size() == unsigned_index.positive_buckets + 1);
  // The clamped ends: a tiny magnitude codes as zero, anything past 1 as the largest entry.
  for (float x : {1e-30f, 1.5f, 1e30f, -1e-30f, -1.5f, -1e30f}) {
    CHECK(memkit::detail::dynamic_code_indexed(signed_index, x) ==
          memkit::quant::nearest_dynamic(memkit::quant::dynamic_map_signed.data(), x));
    CHECK(memkit::detail::dynamic_code_indexed(unsigned_index, x) ==
          memkit::quant::nearest_dynamic(memkit::quant::dynamic_map_unsigned.data(), x));
  }
}

TEST_CASE("adam codes: the CUDA buckets of both maps are built at compile time and hold at most two thresholds") {
  // make_dynamic_code_buckets throws (so these would not compile) if a bucket held a third threshold.
  constexpr auto signed_buckets = memkit::detail::make_dynamic_code_buckets(memkit::quant::dynamic_map_signed);
  constexpr auto unsigned_buckets = memkit::detail::make_dynamic_code_buckets(memkit::quant::dynamic_map_unsigned);
  static_assert(signed_buckets.bucket_count <= memkit::detail::dynamic_code_buckets::capacity);
  CHECK(signed_buckets.bucket_count == 2 * signed_buckets.positive);
  CHECK(unsigned_buckets.bucket_count == 2 * unsigned_buckets.positive);
  // A map whose thresholds crowd one bucket is refused.
  std::array<float, 256> crowded = memkit::quant::dynamic_map_unsigned;
  for (int i = 0; i < 8; ++i) crowded[static_cast<std::size_t>(200 + i)] = 0.5f + 1e-4f * static_cast<float>(i);
  std::sort(crowded.begin(), crowded.end());
  CHECK_THROWS_AS(memkit::detail::make_dynamic_code_buckets(crowded), memkit::error);
}
