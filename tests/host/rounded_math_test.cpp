// The explicitly rounded helpers must round every operation separately on the host too, whatever the
// consumer's flags: g++ contracts a * b + c into an FMA in C++ by default whenever the target has FMA
// (e.g. -march=native), and a fused result differs from the device's _rn intrinsics.
#include <doctest/doctest.h>
#include <memkit/core/rounded_math.hpp>

#include <cmath>

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
