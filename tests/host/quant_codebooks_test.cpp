// Codebooks: the tables against their published values and recipes, and the nearest-code rules.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "memkit/quant/codebooks.hpp"

namespace q = memkit::quant;

namespace {

float next_up(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }

// bitsandbytes' create_dynamic_map, step by step in float32 (PyTorch's scalar linspace formula).
std::vector<float> rebuild_dynamic_map(bool is_signed) {
  const float decade_scale[7] = {1e-6f, 1e-5f, 1e-4f, 1e-3f, 1e-2f, 1e-1f, 1.0f};
  std::vector<float> values;
  for (int i = 0; i < 7; ++i) {
    const std::int64_t steps = is_signed ? (std::int64_t{1} << i) + 1 : (std::int64_t{1} << (i + 1)) + 1;
    const float start = 0.1f, end = 1.0f;
    const float step = (end - start) / static_cast<float>(steps - 1);
    std::vector<float> boundary(static_cast<std::size_t>(steps));
    for (std::int64_t k = 0; k < steps; ++k) {
      const float offset = step * static_cast<float>(k < steps / 2 ? k : steps - k - 1);
      boundary[static_cast<std::size_t>(k)] = k < steps / 2 ? start + offset : end - offset;
    }
    for (std::int64_t k = 0; k + 1 < steps; ++k) {
      const float mean = (boundary[static_cast<std::size_t>(k)] + boundary[static_cast<std::size_t>(k + 1)]) / 2.0f;
      values.push_back(decade_scale[i] * mean);
      if (is_signed) values.push_back(-decade_scale[i] * mean);
    }
  }
  values.push_back(0.0f);
  values.push_back(1.0f);
  std::sort(values.begin(), values.end());
  return values;
}

// Inverse standard normal CDF by bisection on erfc (double precision, plenty for a 1e-6 check).
double normal_quantile(double p) {
  double lo = -10.0, hi = 10.0;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

}  // namespace

TEST_CASE("quant codebooks: NF4 table is QLoRA's published table") {
  // shared/REFERENCE.md, code -> value.
  const double published[16] = {-1.0,
                                -0.6961928009986877,
                                -0.5250730514526367,
                                -0.39491748809814453,
                                -0.28444138169288635,
                                -0.18477343022823334,
                                -0.09105003625154495,
                                0.0,
                                0.07958029955625534,
                                0.16093020141124725,
                                0.24611230194568634,
                                0.33791524171829224,
                                0.44070982933044434,
                                0.5626170039176941,
                                0.7229568362236023,
                                1.0};
  for (int code = 0; code < 16; ++code) {
    CAPTURE(code);
    CHECK(q::nf4_codebook[code] == static_cast<float>(published[code]));
    CHECK(q::nf4_value(static_cast<std::uint8_t>(code)) == static_cast<float>(published[code]));  // the decoder itself
    CHECK(q::nf4_value(static_cast<std::uint8_t>(code | 0xf0)) == q::nf4_codebook[code]);  // high bits ignored
  }
  // And it is what create_normal_map(offset=0.9677083) computes: 8 positive and 7 negative normal quantiles
  // on linspace(offset, 0.5, .), a zero, normalised by the largest.
  std::vector<double> quantiles;
  const double offset = 0.9677083;
  for (int k = 0; k < 8; ++k) quantiles.push_back(normal_quantile(offset + (0.5 - offset) * k / 8.0));
  for (int k = 0; k < 7; ++k) quantiles.push_back(-normal_quantile(offset + (0.5 - offset) * k / 7.0));
  quantiles.push_back(0.0);
  std::sort(quantiles.begin(), quantiles.end());
  for (int code = 0; code < 16; ++code) CHECK(q::nf4_codebook[code] == doctest::Approx(quantiles[code] / quantiles[15]).epsilon(2e-6));
}

TEST_CASE("quant codebooks: FP4 magnitudes by bit pattern, sign only in bit 3") {
  const float magnitude_by_bits[8] = {0.0f, 0.0625f, 8.0f, 12.0f, 4.0f, 6.0f, 2.0f, 3.0f};
  for (int code = 0; code < 16; ++code) {
    CAPTURE(code);
    const float expected = (code & 8 ? -1.0f : 1.0f) * magnitude_by_bits[code & 7] / 12.0f;
    CHECK(q::fp4_codebook[code] == expected);
    CHECK(q::fp4_value(static_cast<std::uint8_t>(code)) == expected);
  }
  CHECK(q::fp4_codebook[3] == 1.0f);
  CHECK(q::fp4_codebook[11] == -1.0f);
  CHECK_FALSE(std::signbit(q::fp4_codebook[8]));  // bitsandbytes' stored quant_map has +0 there
  CHECK(std::signbit(q::fp4_value(8)));           // and its kernels decode code 8 as -0
}

namespace {
// `map` equals the table rebuilt from the recipe, entry by entry, and increases strictly.
void check_rebuilt_and_increasing(const std::array<float, 256>& map, bool is_signed) {
  const std::vector<float> rebuilt = rebuild_dynamic_map(is_signed);
  REQUIRE(rebuilt.size() == 256);
  for (int i = 0; i < 256; ++i) {
    CAPTURE(i);
    CHECK(map[i] == rebuilt[static_cast<std::size_t>(i)]);
  }
  for (int i = 0; i + 1 < 256; ++i) CHECK(map[i] < map[i + 1]);
}
}  // namespace

TEST_CASE("quant codebooks: dynamic 8-bit maps match the 8-bit optimizers recipe and published properties") {
  SUBCASE("signed") {
    const auto& map = q::dynamic_map_signed;
    check_rebuilt_and_increasing(map, true);
    CHECK(map[127] == 0.0f);
    CHECK(map[255] == 1.0f);
    CHECK(map[0] == static_cast<float>(-0.99296875));
    CHECK(map[254] == static_cast<float>(0.99296875));
    int negative = 0, positive = 0;
    for (float v : map) (v < 0 ? negative : v > 0 ? positive : negative) += v == 0.0f ? 0 : 1;
    CHECK(negative == 127);
    CHECK(positive == 128);  // 127 + the 1.0
    for (int i = 0; i < 127; ++i) CHECK(map[i] == -map[254 - i]);  // mirrored around index 127
    CHECK(map[128] == doctest::Approx(5.5e-7).epsilon(1e-6));       // smallest decade: 0.55 * 1e-6
  }
  SUBCASE("unsigned") {
    const auto& map = q::dynamic_map_unsigned;
    check_rebuilt_and_increasing(map, false);
    CHECK(map[0] == 0.0f);
    CHECK(map[255] == 1.0f);
    CHECK(map[1] == doctest::Approx(0.325e-6).epsilon(1e-6));  // 0.1 + 0.9/4 / 2 at 1e-6
    CHECK(map[254] == doctest::Approx(1.0 - 0.9 / 128 / 2).epsilon(1e-6));
  }
}

TEST_CASE("quant codebooks: NF4 nearest code, with exact ties going to the lower code") {
  for (int code = 0; code < 16; ++code) CHECK(q::nearest_nf4(q::nf4_codebook[code]) == code);
  // bitsandbytes' decision thresholds (its kernel's literals): the double midpoints of neighbouring values,
  // which float rounding leaves within one ulp of the float32 midpoint. A value equal to a threshold takes
  // the lower code; one ulp above takes the upper.
  const float thresholds[15] = {-0.8480964004993439f,  -0.6106329262256622f,  -0.4599952697753906f,
                                 -0.33967943489551544f, -0.23460740596055984f, -0.13791173323988914f,
                                 -0.045525018125772476f, 0.03979014977812767f, 0.1202552504837513f,
                                 0.2035212516784668f,   0.2920137718319893f,   0.3893125355243683f,
                                 0.5016634166240692f,   0.6427869200706482f,   0.8614784181118011f};
  for (int code = 0; code < 15; ++code) {
    CAPTURE(code);
    const float tie = thresholds[code];  // float literals: rounding via double could land one ulp off
    CHECK(tie == doctest::Approx((static_cast<double>(q::nf4_codebook[code]) + q::nf4_codebook[code + 1]) / 2).epsilon(1e-7));
    CHECK(q::nearest_nf4(tie) == code);
    CHECK(q::nearest_nf4(next_up(tie)) == code + 1);
  }
  CHECK(q::nearest_nf4(0.0f) == 7);
  CHECK(q::nearest_nf4(-0.0f) == 7);
  CHECK(q::nearest_nf4(5.0f) == 15);
  CHECK(q::nearest_nf4(-5.0f) == 0);
  CHECK(q::nearest_nf4(std::numeric_limits<float>::quiet_NaN()) == 0);  // bitsandbytes' all-zero block
  // Away from the thresholds it is the plain nearest value.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.2f, 1.2f);
  for (int i = 0; i < 20000; ++i) {
    const float x = uniform(rng);
    int best = 0;
    for (int c = 1; c < 16; ++c)
      if (std::fabs(x - q::nf4_codebook[c]) < std::fabs(x - q::nf4_codebook[best])) best = c;
    const int got = q::nearest_nf4(x);
    if (got != best) CHECK(std::fabs(std::fabs(x - q::nf4_codebook[got]) - std::fabs(x - q::nf4_codebook[best])) < 1e-6f);
  }
}

TEST_CASE("quant codebooks: FP4 nearest code, sign only for negative values, ties to the smaller magnitude") {
  for (int code = 0; code < 16; ++code)
    if (code != 8) CHECK(q::nearest_fp4(q::fp4_value(static_cast<std::uint8_t>(code))) == code);
  CHECK(q::nearest_fp4(0.0f) == 0);
  CHECK(q::nearest_fp4(-0.0f) == 0);        // -0 is not < 0
  CHECK(q::nearest_fp4(-1e-9f) == 0b1000);  // negative, rounds to magnitude 0
  // bitsandbytes' thresholds, ties to the smaller magnitude, then one ulp above goes up.
  struct step {
    float threshold;
    int below, above;
  } steps[] = {{0.00260417f, 0b000, 0b001}, {0.0859375f, 0b001, 0b110}, {0.20833333f, 0b110, 0b111},
               {0.29166667f, 0b111, 0b100}, {0.4166667f, 0b100, 0b101}, {0.583333f, 0b101, 0b010},
               {0.8333333f, 0b010, 0b011}};
  for (const step& s : steps) {
    CAPTURE(s.threshold);
    CHECK(q::nearest_fp4(s.threshold) == s.below);
    CHECK(q::nearest_fp4(next_up(s.threshold)) == s.above);
    CHECK(q::nearest_fp4(-s.threshold) == (s.below | 0b1000));
    CHECK(q::nearest_fp4(-next_up(s.threshold)) == (s.above | 0b1000));
    // Each threshold sits within 1e-6 of the midpoint of its two neighbours.
    CHECK(s.threshold == doctest::Approx((q::fp4_value(static_cast<std::uint8_t>(s.below)) +
                                          q::fp4_value(static_cast<std::uint8_t>(s.above))) / 2).epsilon(2e-6));
  }
  CHECK(q::nearest_fp4(std::numeric_limits<float>::quiet_NaN()) == 0);
}

TEST_CASE("quant codebooks: dynamic-map nearest entry, ties to the even index as bitsandbytes' search leaves them") {
  for (const auto* map : {&q::dynamic_map_signed, &q::dynamic_map_unsigned}) {
    const float* m = map->data();
    for (int i = 0; i < 256; ++i) CHECK(q::nearest_dynamic(m, m[i]) == i);
    for (int i = 0; i + 1 < 256; ++i) {
      CAPTURE(i);
      const float tie = (m[i] + m[i + 1]) * 0.5f;
      if (!(tie > m[i] && tie < m[i + 1])) continue;
      CHECK(q::nearest_dynamic(m, tie) == (i % 2 == 0 ? i : i + 1));
    }
    CHECK(q::nearest_dynamic(m, 2.0f) == 255);
    CHECK(q::nearest_dynamic(m, -2.0f) == 0);
    CHECK(q::nearest_dynamic(m, std::numeric_limits<float>::quiet_NaN()) == 0);
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    for (int trial = 0; trial < 20000; ++trial) {
      // Log-uniform magnitudes reach the small decades too.
      const float x = std::copysign(std::pow(10.0f, -7.0f * std::fabs(uniform(rng))), uniform(rng));
      int best = 0;
      for (int c = 1; c < 256; ++c)
        if (std::fabs(x - m[c]) < std::fabs(x - m[best])) best = c;
      const int got = q::nearest_dynamic(m, x);
      if (got != best) CHECK(std::fabs(std::fabs(x - m[got]) - std::fabs(x - m[best])) <= 1e-7f * std::fabs(x));
    }
  }
}

TEST_CASE("quant codebooks: lookups are usable in constant expressions") {
  static_assert(q::nearest_nf4(1.0f) == 15);
  static_assert(q::nearest_fp4(-1.0f) == 0b1011);
  static_assert(q::nf4_value(7) == 0.0f);
  static_assert(q::nearest_dynamic(q::dynamic_map_signed.data(), 0.0f) == 127);
  static_assert(q::make_code_table(q::nf4_codebook).value[15] == 1.0f);
  CHECK(true);
}
