// The explicitly rounded helpers must round every operation separately on the host too, whatever the
// consumer's flags: g++ contracts a * b + c into an FMA in C++ by default whenever the target has FMA
// (e.g. -march=native), and a fused result differs from the device's _rn intrinsics.
#include <doctest/doctest.h>
#include <memkit/core/rounded_math.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// a * b = 1 + 2^-11 + 2^-24 exactly; rounded to float it is 1 + 2^-11 (ties to even), so
// a * b - (1 + 2^-11) is 0 when rounded twice and 2^-24 when fused.
volatile float a_input = 1.0f + 0x1p-12f;
volatile float b_input = 1.0f + 0x1p-12f;
volatile float c_input = -(1.0f + 0x1p-11f);

#if defined(__x86_64__) && defined(__GNUC__)
// Compiled for an FMA-capable target, so the compiler is free to fuse whatever it may.
__attribute__((target("fma"))) float product_then_sum_with_fma_allowed() {
  return memkit::detail::add_rn(memkit::detail::mul_rn(a_input, b_input), c_input);
}
__attribute__((target("fma"))) double double_product_then_sum_with_fma_allowed() {
  const double a = 1.0 + 0x1p-27, c = -(1.0 + 0x1p-26);
  volatile double va = a, vc = c;
  return memkit::detail::dadd_rn(memkit::detail::dmul_rn(va, va), vc);
}
#endif

}  // namespace

TEST_CASE("rounded_math: products are rounded before they are added, even where FMA is available") {
  CHECK(memkit::detail::add_rn(memkit::detail::mul_rn(a_input, b_input), c_input) == 0.0f);
#if defined(__x86_64__) && defined(__GNUC__)
  if (!__builtin_cpu_supports("fma")) {
    MESSAGE("this CPU has no FMA: the contraction case cannot be exercised here");
    return;
  }
  CHECK(product_then_sum_with_fma_allowed() == 0.0f);
  CHECK(std::fma(static_cast<float>(a_input), static_cast<float>(b_input), static_cast<float>(c_input)) ==
        0x1p-24f);  // the fused answer really differs
  CHECK(double_product_then_sum_with_fma_allowed() == 0.0);
#endif
}

TEST_CASE("rounded_math: max_magnitude_bits is the largest |x| wherever it stands, and sorts Inf and NaN above") {
  using memkit::detail::bit_cast;
  using memkit::detail::max_magnitude_bits;
  // Every length around the 16-lane stride, the largest magnitude (negative) at every position.
  for (std::int64_t count = 1; count <= 40; ++count)
    for (std::int64_t at = 0; at < count; ++at) {
      std::vector<float> values(static_cast<std::size_t>(count));
      for (std::int64_t i = 0; i < count; ++i) values[static_cast<std::size_t>(i)] = 0.25f * static_cast<float>(i % 7) - 0.75f;
      values[static_cast<std::size_t>(at)] = -3.5f;
      REQUIRE(bit_cast<float>(max_magnitude_bits(values.data(), count)) == 3.5f);
    }
  std::vector<memkit::bf16> halves(37, memkit::bf16(0.5f));
  halves[33] = memkit::bf16(-2.0f);
  CHECK(bit_cast<float>(max_magnitude_bits(halves.data(), 37)) == 2.0f);
  CHECK(max_magnitude_bits(halves.data(), 0) == 0u);
  std::vector<float> odd(20, 1.0f);
  odd[17] = -std::numeric_limits<float>::infinity();
  CHECK(max_magnitude_bits(odd.data(), 20) == 0x7f800000u);
  odd[3] = -std::numeric_limits<float>::quiet_NaN();
  CHECK(max_magnitude_bits(odd.data(), 20) > 0x7f800000u);
}

TEST_CASE("rounded_math: max_magnitude_bits of bf16 and fp16 equals the maximum over the widened values") {
  using memkit::detail::bit_cast;
  // Every 16-bit pattern (NaNs, Infs, subnormals, both zeros) in runs of every length around the 32-lane
  // stride: the 16-bit maximum, widened once, must be the maximum of the widened magnitudes.
  auto check = [](auto tag) {
    using T = decltype(tag);
    int wrong = 0;
    for (std::uint32_t start = 0; start < 65536; start += 61) {
      const std::int64_t count = 1 + start % 70;
      std::vector<T> values(static_cast<std::size_t>(count));
      std::uint32_t expected = 0;
      for (std::int64_t i = 0; i < count; ++i) {
        const auto bits = static_cast<std::uint16_t>((start * 2654435761u + static_cast<std::uint32_t>(i) * 40503u) >> 16);
        values[static_cast<std::size_t>(i)] = bit_cast<T>(bits);
        const std::uint32_t widened = bit_cast<std::uint32_t>(memkit::to_float(values[static_cast<std::size_t>(i)])) & 0x7fffffffu;
        expected = widened > expected ? widened : expected;
      }
      wrong += memkit::detail::max_magnitude_bits(values.data(), count) != expected;
    }
    CHECK(wrong == 0);
  };
  check(memkit::bf16{});
  check(memkit::fp16{});
}

TEST_CASE("rounded_math: is_finite is false exactly for Inf and NaN, float and double") {
  using memkit::detail::is_finite;
  for (float x : {0.0f, -0.0f, 1.0f, -2.5f, std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min()})
    CHECK(is_finite(x));
  for (float x : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::signaling_NaN()})
    CHECK_FALSE(is_finite(x));
  for (double x : {0.0, -0.0, 1e300, -std::numeric_limits<double>::max(), std::numeric_limits<double>::denorm_min()})
    CHECK(is_finite(x));
  for (double x : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                   std::numeric_limits<double>::quiet_NaN(), -std::numeric_limits<double>::quiet_NaN()})
    CHECK_FALSE(is_finite(x));
}
