// memkit/core/checked_math.hpp — integer arithmetic that cannot wrap, for every size that comes from outside.
//
// Sizes read from files (safetensors headers, bitsandbytes quant_state, optimizer state) or given by users
// (batch, sequence, model dimensions) are multiplied and added before anything is allocated. Plain
// arithmetic wraps silently: a claimed 2^40 x 2^40 tensor becomes 0 bytes and is "accepted". Three
// families, all constexpr:
//
//   try_mul / try_add            -> checked<T>: the value, or "overflowed"; never throws.
//   checked_mul / checked_add /
//   checked_product / checked_sum -> T, or memkit::error naming the quantity ("safetensors tensor 'w' bytes
//                                   overflow 64-bit: 4611686018427387904 * 8"). In a constant expression
//                                   an overflow does not compile: the error points at
//                                   `integer_overflow_in_constant_expression`, with the quantity's name in
//                                   the constexpr-expansion notes.
//   saturating_mul / saturating_add -> T, clamped to the largest value (for "does not fit" answers).
//
// and the range test every bounds check should use: within_range(offset, count, size) compares without
// forming offset + count, so offset near INT64_MAX cannot wrap past the check.
#pragma once

#include "memkit/config.hpp"

#include <concepts>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

MEMKIT_NAMESPACE_BEGIN

// The outcome of a checked operation: `value` is meaningful only when `ok()`.
template <std::integral T>
struct checked {
  T value{};
  bool overflowed = false;

  constexpr bool ok() const noexcept { return !overflowed; }
  constexpr explicit operator bool() const noexcept { return ok(); }
  constexpr T value_or(T fallback) const noexcept { return overflowed ? fallback : value; }
};

// a * b without wrapping (signed or unsigned). Portable, not __builtin_mul_overflow, so nvcc and every
// constant evaluator accept it.
template <std::integral T>
constexpr checked<T> try_mul(T a, T b) noexcept {
  constexpr T max = std::numeric_limits<T>::max();
  if constexpr (std::is_unsigned_v<T>) {
    if (a != 0 && b > max / a) return {0, true};
    return {static_cast<T>(a * b), false};
  } else {
    constexpr T min = std::numeric_limits<T>::min();
    if (a == 0 || b == 0) return {0, false};
    if (a > 0) {
      if (b > 0 ? a > max / b : b < min / a) return {0, true};
    } else {
      if (b > 0 ? a < min / b : (a != 0 && b < max / a)) return {0, true};
    }
    return {static_cast<T>(a * b), false};
  }
}

// a + b without wrapping (signed or unsigned).
template <std::integral T>
constexpr checked<T> try_add(T a, T b) noexcept {
  constexpr T max = std::numeric_limits<T>::max();
  if constexpr (std::is_unsigned_v<T>) {
    if (b > max - a) return {0, true};
  } else {
    constexpr T min = std::numeric_limits<T>::min();
    if (b > 0 ? a > max - b : a < min - b) return {0, true};
  }
  return {static_cast<T>(a + b), false};
}

namespace detail {

template <std::integral T>
std::string integer_text(T value) {
  return std::to_string(value);
}

// Deliberately not constexpr: reaching it during constant evaluation is a compile error whose text names it.
template <std::integral T>
[[noreturn]] void integer_overflow_in_constant_expression(const char* quantity, const char* operation, T a, T b) {
  (void)quantity, (void)operation, (void)a, (void)b;
  throw error("memkit: integer overflow in a constant expression");
}

template <std::integral T>
[[noreturn]] void throw_integer_overflow(const char* quantity, const char* operation, T a, T b) {
  throw error(std::string("memkit: ") + quantity + " overflows " + std::to_string(sizeof(T) * 8) +
              "-bit " + (std::is_signed_v<T> ? "signed" : "unsigned") + " arithmetic: " + integer_text(a) + " " +
              operation + " " + integer_text(b));
}

}  // namespace detail

// a * b, or memkit::error naming `quantity` (a compile error in a constant expression).
template <std::integral T>
constexpr T checked_mul(T a, T b, const char* quantity) {
  const checked<T> r = try_mul(a, b);
  if (!r.ok()) {
    if (std::is_constant_evaluated()) detail::integer_overflow_in_constant_expression(quantity, "*", a, b);
    detail::throw_integer_overflow(quantity, "*", a, b);
  }
  return r.value;
}

// a + b, or memkit::error naming `quantity` (a compile error in a constant expression).
template <std::integral T>
constexpr T checked_add(T a, T b, const char* quantity) {
  const checked<T> r = try_add(a, b);
  if (!r.ok()) {
    if (std::is_constant_evaluated()) detail::integer_overflow_in_constant_expression(quantity, "+", a, b);
    detail::throw_integer_overflow(quantity, "+", a, b);
  }
  return r.value;
}

// first * rest... (all of type T), or memkit::error naming `quantity`.
template <std::integral T, std::same_as<T>... Rest>
constexpr T checked_product(const char* quantity, T first, Rest... rest) {
  T result = first;
  ((result = checked_mul(result, rest, quantity)), ...);
  return result;
}

// first + rest... (all of type T), or memkit::error naming `quantity`.
template <std::integral T, std::same_as<T>... Rest>
constexpr T checked_sum(const char* quantity, T first, Rest... rest) {
  T result = first;
  ((result = checked_add(result, rest, quantity)), ...);
  return result;
}

// a * b, or the largest T when the true product does not fit (for non-negative a, b).
template <std::integral T>
constexpr T saturating_mul(T a, T b) noexcept {
  return try_mul(a, b).value_or(std::numeric_limits<T>::max());
}

// a + b, or the largest T when the true sum does not fit (for non-negative a, b).
template <std::integral T>
constexpr T saturating_add(T a, T b) noexcept {
  return try_add(a, b).value_or(std::numeric_limits<T>::max());
}

// `value` converted to To when it is representable, else memkit::error naming `quantity`.
template <std::integral To, std::integral From>
constexpr To checked_cast(From value, const char* quantity) {
  if (!std::in_range<To>(value)) {
    if (std::is_constant_evaluated()) detail::integer_overflow_in_constant_expression(quantity, "cast", value, value);
    throw error(std::string("memkit: ") + quantity + " = " + std::to_string(value) + " does not fit in a " +
                std::to_string(sizeof(To) * 8) + "-bit " + (std::is_signed_v<To> ? "signed" : "unsigned") +
                " integer");
  }
  return static_cast<To>(value);
}

// True when [offset, offset + count) lies inside [0, size): all three non-negative and count <= size - offset.
// Never forms offset + count, so it cannot wrap. Device code may use it too.
template <std::integral T>
MEMKIT_HOST_DEVICE constexpr bool within_range(T offset, T count, T size) noexcept {
  if constexpr (std::is_signed_v<T>) {
    if (offset < 0 || count < 0 || size < 0) return false;
  }
  return offset <= size && count <= size - offset;
}

MEMKIT_NAMESPACE_END
