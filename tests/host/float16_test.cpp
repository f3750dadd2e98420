#include <doctest/doctest.h>
#include <memkit/core/float16.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>

using memkit::bf16;
using memkit::fp16;

namespace {

float from_bits(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Reference rounding, independent of the integer tricks under test: find the two representable
// neighbours of x by decoding candidate bit patterns and compare distances in double precision.
template <class Decode>
std::uint16_t round_nearest_even(double x, std::uint16_t below, Decode decode) {
  const double lo = decode(below), hi = decode(static_cast<std::uint16_t>(below + 1));
  const double to_lo = x - lo, to_hi = hi - x;
  if (to_lo < to_hi) return below;
  if (to_hi < to_lo) return static_cast<std::uint16_t>(below + 1);
  return (below & 1) ? static_cast<std::uint16_t>(below + 1) : below;
}

std::uint16_t reference_bf16(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint16_t truncated = static_cast<std::uint16_t>((u & 0x7fffffffu) >> 16);
  // Past the largest finite bf16 the next pattern is Inf; for rounding it stands for 2^128.
  const auto decode = [](std::uint16_t b) {
    return b == 0x7f80 ? std::ldexp(1.0, 128) : static_cast<double>(memkit::bf16_bits_to_float(b));
  };
  return sign | round_nearest_even(std::fabs(static_cast<double>(x)), truncated, decode);
}

std::uint16_t reference_fp16(float x) {
  const double magnitude = std::fabs(static_cast<double>(x));
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (magnitude >= 65520.0) return sign | 0x7c00;
  if (magnitude >= 65504.0) return sign | 0x7bff;
  // Largest positive fp16 pattern not above the magnitude (positive patterns are ordered like values).
  std::uint16_t lo = 0, hi = 0x7bff;
  while (lo < hi) {
    const std::uint16_t mid = static_cast<std::uint16_t>((lo + hi + 1) / 2);
    if (memkit::fp16_bits_to_float(mid) <= magnitude) lo = mid;
    else hi = static_cast<std::uint16_t>(mid - 1);
  }
  const auto decode = [](std::uint16_t b) { return static_cast<double>(memkit::fp16_bits_to_float(b)); };
  return sign | round_nearest_even(magnitude, lo, decode);
}

}  // namespace

TEST_CASE("bf16: exact values, infinities, NaN and ties") {
  CHECK(bf16(1.0f).bits == 0x3f80);
  CHECK(bf16(-2.0f).bits == 0xc000);
  CHECK(bf16(0.0f).bits == 0x0000);
  CHECK(bf16(-0.0f).bits == 0x8000);
  CHECK(bf16(std::numeric_limits<float>::infinity()).bits == 0x7f80);
  CHECK(bf16(-std::numeric_limits<float>::infinity()).bits == 0xff80);
  CHECK(bf16(std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);  // CUDA's canonical NaN
  CHECK(bf16(from_bits(0xffc00001u)).bits == 0x7fff);
  CHECK(std::isnan(static_cast<float>(bf16::from_bits(0xffc1))));
  // 1 + 2^-8 is exactly halfway between 1.0 and 1 + 2^-7: ties go to the even mantissa (1.0).
  CHECK(bf16(1.00390625f).bits == 0x3f80);
  // 1 + 3*2^-8 is halfway between 0x3f81 and 0x3f82: even is 0x3f82.
  CHECK(bf16(1.01171875f).bits == 0x3f82);
  CHECK(bf16(std::nextafter(1.00390625f, 2.0f)).bits == 0x3f81);  // just above the tie rounds up
  // The largest float rounds up to infinity; the largest bf16 is exact.
  CHECK(bf16(std::numeric_limits<float>::max()).bits == 0x7f80);
  CHECK(bf16(memkit::bf16_bits_to_float(0x7f7f)).bits == 0x7f7f);
  // Subnormal floats stay subnormal in bf16 (same exponent range).
  CHECK(bf16(from_bits(0x00010000u)).bits == 0x0001);
  CHECK(bf16(from_bits(0x00008000u)).bits == 0x0000);  // tie between 0 and the smallest subnormal: even (0)
  CHECK(bf16(from_bits(0x00018000u)).bits == 0x0002);  // tie between 1 and 2: even (2)
}

TEST_CASE("fp16: exact values, overflow, subnormals, NaN and ties") {
  CHECK(fp16(1.0f).bits == 0x3c00);
  CHECK(fp16(-2.0f).bits == 0xc000);
  CHECK(fp16(-0.0f).bits == 0x8000);
  CHECK(fp16(65504.0f).bits == 0x7bff);
  CHECK(fp16(65519.996f).bits == 0x7bff);
  CHECK(fp16(65520.0f).bits == 0x7c00);  // halfway to 2^16: rounds to even, which is Inf
  CHECK(fp16(-1e9f).bits == 0xfc00);
  CHECK(fp16(std::numeric_limits<float>::infinity()).bits == 0x7c00);
  CHECK(fp16(std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);
  CHECK(std::isnan(static_cast<float>(fp16::from_bits(0x7e00))));
  CHECK(std::isinf(static_cast<float>(fp16::from_bits(0xfc00))));
  CHECK(fp16(std::ldexp(1.0f, -14)).bits == 0x0400);  // smallest normal
  CHECK(fp16(std::ldexp(1.0f, -24)).bits == 0x0001);  // smallest subnormal
  CHECK(fp16(std::ldexp(1.0f, -25)).bits == 0x0000);  // tie between 0 and 2^-24: even (0)
  CHECK(fp16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)).bits == 0x0001);
  CHECK(fp16(std::ldexp(3.0f, -25)).bits == 0x0002);  // tie between 1 and 2 subnormal units: even
  CHECK(fp16(std::ldexp(1023.5f, -24)).bits == 0x0400);  // rounds out of the subnormals into the normals
  CHECK(fp16(1.0f + std::ldexp(1.0f, -11)).bits == 0x3c00);  // tie: even
  CHECK(fp16(1.0f + std::ldexp(3.0f, -11)).bits == 0x3c02);  // tie: even
  CHECK(fp16(std::ldexp(1.0f, -30)).bits == 0x0000);
  CHECK(fp16(-std::ldexp(1.0f, -30)).bits == 0x8000);
  CHECK(static_cast<float>(fp16::from_bits(0x0001)) == std::ldexp(1.0f, -24));
  CHECK(static_cast<float>(fp16::from_bits(0x83ff)) == -std::ldexp(1023.0f, -24));
}

TEST_CASE("bf16 and fp16: every bit pattern survives a round trip through float") {
  int bf16_failures = 0, fp16_failures = 0;
  for (std::uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const auto raw = static_cast<std::uint16_t>(bits);
    const float b = bf16::from_bits(raw), h = fp16::from_bits(raw);
    if (std::isnan(b) ? bf16(b).bits != 0x7fff : bf16(b).bits != raw) ++bf16_failures;
    if (std::isnan(h) ? fp16(h).bits != 0x7fff : fp16(h).bits != raw) ++fp16_failures;
  }
  CHECK(bf16_failures == 0);
  CHECK(fp16_failures == 0);
}

TEST_CASE("bf16 and fp16: conversion of arbitrary floats is round-to-nearest-even") {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::uniform_real_distribution<float> fp16_range(-70000.0f, 70000.0f);
  int bf16_failures = 0, fp16_failures = 0;
  for (int i = 0; i < 200000; ++i) {
    const float x = from_bits(any_bits(rng));
    if (!std::isnan(x) && !std::isinf(x) && bf16(x).bits != reference_bf16(x)) ++bf16_failures;
    // fp16 cares about magnitudes near its own range: mix wide random floats with in-range ones
    // and tiny ones that land in fp16's subnormals.
    const float y = (i % 3 == 0) ? fp16_range(rng) : (i % 3 == 1) ? x : std::ldexp(fp16_range(rng), -30);
    if (!std::isnan(y) && !std::isinf(y) && fp16(y).bits != reference_fp16(y)) ++fp16_failures;
  }
  CHECK(bf16_failures == 0);
  CHECK(fp16_failures == 0);
}

TEST_CASE("float storage: conversions are constexpr and usable in generic code") {
  static_assert(memkit::float_to_bf16_bits(1.0f) == 0x3f80);
  static_assert(memkit::float_to_fp16_bits(-2.0f) == 0xc000);
  static_assert(memkit::to_float(memkit::from_float<bf16>(0.5f)) == 0.5f);
  static_assert(memkit::float_storage<float> && memkit::float_storage<bf16> && memkit::float_storage<fp16>);
  static_assert(!memkit::float_storage<double>);
  CHECK(std::string(memkit::dtype_name<bf16>()) == "BF16");
  CHECK(std::string(memkit::dtype_name<fp16>()) == "F16");
  CHECK(std::string(memkit::dtype_name<float>()) == "F32");
}
