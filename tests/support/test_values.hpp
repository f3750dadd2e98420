// Test inputs and metrics shared by the host and CUDA tests: seeded random values, their conversion to
// memkit's 16-bit types, and the round-trip error of a quantization. Same seed, same values, everywhere.
#pragma once

#include <memkit/core/float16.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace memkit_test {

// `count` draws of `distribution` from a std::mt19937 seeded with `seed`.
template <class Distribution>
std::vector<float> random_values(std::int64_t count, unsigned seed, Distribution distribution) {
  std::mt19937 rng(seed);
  std::vector<float> values(static_cast<std::size_t>(count));
  for (float& v : values) v = distribution(rng);
  return values;
}

inline std::vector<float> standard_normal(std::int64_t count, unsigned seed) {
  return random_values(count, seed, std::normal_distribution<float>(0.0f, 1.0f));
}

// Uniform in [-1, 1).
inline std::vector<float> uniform_values(std::int64_t count, unsigned seed) {
  return random_values(count, seed, std::uniform_real_distribution<float>(-1.0f, 1.0f));
}

// Each value rounded to T (float, bf16, fp16) as memkit::from_float does.
template <class T>
std::vector<T> convert(const std::vector<float>& values) {
  std::vector<T> out;
  out.reserve(values.size());
  for (float x : values) out.push_back(memkit::from_float<T>(x));
  return out;
}

// bitsandbytes' quantization test metrics: mean |x - x'| and mean |x - x'| / (|x| + 1e-8).
struct round_trip_error {
  double absolute = 0, relative = 0;
};

inline round_trip_error round_trip_errors(const std::vector<float>& original, const std::vector<float>& restored) {
  round_trip_error e;
  for (std::size_t i = 0; i < original.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(original[i]) - restored[i]);
    e.absolute += diff;
    e.relative += diff / (std::fabs(static_cast<double>(original[i])) + 1e-8);
  }
  e.absolute /= static_cast<double>(original.size());
  e.relative /= static_cast<double>(original.size());
  return e;
}

}  // namespace memkit_test
