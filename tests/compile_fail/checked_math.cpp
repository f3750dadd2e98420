// A size that overflows in a constant expression must not compile, and the error must name the helper
// that caught it. Built by tests/compile_fail/check_compile_error.cmake:
//   GOOD      compiles: the product fits
//   OVERFLOW  rejected, pointing at integer_overflow_in_constant_expression with the quantity's name
#include <memkit/core/checked_math.hpp>

#include <cstdint>

#if defined(MEMKIT_CASE_GOOD)
constexpr std::uint64_t bytes = memkit::checked_product("activation bytes", std::uint64_t{1} << 20, std::uint64_t{4096});
static_assert(bytes == std::uint64_t{1} << 32);
#elif defined(MEMKIT_CASE_OVERFLOW)
constexpr std::uint64_t bytes = memkit::checked_product("activation bytes", std::uint64_t{1} << 40, std::uint64_t{1} << 30);
#endif

int main() { return 0; }
