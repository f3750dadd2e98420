// memkit/core/units.hpp — byte-size constants and the human-readable byte and float formatters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN

inline constexpr std::uint64_t KiB = 1024ull;
inline constexpr std::uint64_t MiB = 1024ull * KiB;
inline constexpr std::uint64_t GiB = 1024ull * MiB;

// "0 B", "512 B", "1.50 KiB", "12.00 GiB": binary units, two decimals above bytes.
inline std::string format_bytes(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  if (unit == 0) std::snprintf(text, sizeof text, "%llu B", static_cast<unsigned long long>(bytes));
  else std::snprintf(text, sizeof text, "%.2f %s", value, units[unit]);
  return text;
}

// A float in error messages, as "%g" prints it ("0.001", "-1e-09", "inf", "nan"): unlike
// std::to_string's fixed six decimals, a small value does not print as 0.000000. 9 significant
// digits tell any two floats apart.
inline std::string format_float(float value, int significant_digits = 6) {
  char text[48];
  std::snprintf(text, sizeof text, "%.*g", significant_digits, static_cast<double>(value));
  return text;
}

MEMKIT_NAMESPACE_END
