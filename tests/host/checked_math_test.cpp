// core/checked_math.hpp: every size computed from outside input goes through these, so they must be
// exact at the edges of each type and never wrap.
#include <doctest/doctest.h>
#include <memkit/core/checked_math.hpp>

#include <cstdint>
#include <limits>
#include <string>

using memkit::checked_add;
using memkit::checked_cast;
using memkit::checked_mul;
using memkit::checked_product;
using memkit::checked_sum;
using memkit::saturating_add;
using memkit::saturating_mul;
using memkit::try_add;
using memkit::try_mul;
using memkit::within_range;

namespace {
constexpr std::uint64_t u64_max = std::numeric_limits<std::uint64_t>::max();
constexpr std::int64_t i64_max = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t i64_min = std::numeric_limits<std::int64_t>::min();

// Usable in constant expressions: the budget's constexpr path relies on it.
static_assert(checked_product("bytes", std::uint64_t{4096}, std::uint64_t{4096}, std::uint64_t{2}) == 33554432);
static_assert(checked_sum("bytes", std::uint64_t{1}, std::uint64_t{2}, std::uint64_t{3}) == 6);
static_assert(!try_mul(std::uint64_t{1} << 32, std::uint64_t{1} << 32).ok());
static_assert(saturating_mul(std::uint64_t{1} << 40, std::uint64_t{1} << 40) == u64_max);
static_assert(within_range(std::int64_t{2}, std::int64_t{3}, std::int64_t{5}));
static_assert(!within_range(i64_max, std::int64_t{2}, std::int64_t{10}));
}  // namespace

TEST_CASE("try_mul: unsigned products at the edge of the type") {
  CHECK(try_mul(std::uint64_t{0}, u64_max).value == 0);
  CHECK(try_mul(u64_max, std::uint64_t{1}).value == u64_max);
  CHECK(try_mul(std::uint64_t{1} << 31, std::uint64_t{1} << 32).value == std::uint64_t{1} << 63);
  CHECK_FALSE(try_mul(std::uint64_t{1} << 32, std::uint64_t{1} << 32).ok());
  CHECK_FALSE(try_mul(u64_max / 2 + 1, std::uint64_t{2}).ok());
  CHECK(try_mul(u64_max / 3, std::uint64_t{3}).value == u64_max);
  // The safetensors case: numel * 8 that wraps to 0 must be caught.
  CHECK_FALSE(try_mul(std::uint64_t{1} << 61, std::uint64_t{8}).ok());
  CHECK_FALSE(try_mul(std::uint32_t{65536}, std::uint32_t{65536}).ok());
  CHECK(try_mul(std::uint32_t{65535}, std::uint32_t{65537}).value == 4294967295u);
}

TEST_CASE("try_mul: signed products in every sign combination") {
  CHECK(try_mul(i64_max, std::int64_t{1}).value == i64_max);
  CHECK(try_mul(i64_min, std::int64_t{1}).value == i64_min);
  CHECK_FALSE(try_mul(i64_min, std::int64_t{-1}).ok());
  CHECK_FALSE(try_mul(std::int64_t{-1}, i64_min).ok());
  CHECK(try_mul(std::int64_t{-1}, i64_max).value == -i64_max);
  CHECK_FALSE(try_mul(std::int64_t{1} << 32, std::int64_t{1} << 31).ok());  // 2^63 > max
  CHECK(try_mul(std::int64_t{1} << 32, -(std::int64_t{1} << 31)).value == i64_min);  // -2^63 == min
  CHECK_FALSE(try_mul(-(std::int64_t{1} << 32), -(std::int64_t{1} << 31)).ok());
  CHECK(try_mul(std::int64_t{1} << 20, std::int64_t{1} << 20).value == (std::int64_t{1} << 40));
  CHECK_FALSE(try_mul(std::int64_t{3037000500}, std::int64_t{3037000500}).ok());
  CHECK(try_mul(std::int64_t{3037000499}, std::int64_t{3037000499}).ok());
  CHECK_FALSE(try_mul(std::int64_t{-3037000500}, std::int64_t{3037000500}).ok());
  CHECK(try_mul(std::int64_t{0}, i64_min).value == 0);
}

TEST_CASE("try_add: unsigned and signed sums at the edge of the type") {
  CHECK(try_add(u64_max - 1, std::uint64_t{1}).value == u64_max);
  CHECK_FALSE(try_add(u64_max, std::uint64_t{1}).ok());
  CHECK(try_add(i64_max - 5, std::int64_t{5}).value == i64_max);
  CHECK_FALSE(try_add(i64_max, std::int64_t{1}).ok());
  CHECK_FALSE(try_add(i64_min, std::int64_t{-1}).ok());
  CHECK(try_add(i64_min, i64_max).value == -1);
  CHECK(try_add(i64_max, std::int64_t{-1}).value == i64_max - 1);
}

TEST_CASE("checked_*: the error names the quantity and the operands") {
  CHECK(checked_mul(std::uint64_t{6}, std::uint64_t{7}, "x") == 42);
  try {
    (void)checked_mul(std::uint64_t{1} << 61, std::uint64_t{8}, "safetensors tensor 'w' bytes");
    FAIL("no error");
  } catch (const memkit::error& e) {
    const std::string what = e.what();
    CHECK(what.find("safetensors tensor 'w' bytes") != std::string::npos);
    CHECK(what.find("2305843009213693952 * 8") != std::string::npos);
    CHECK(what.find("64-bit unsigned") != std::string::npos);
  }
  CHECK_THROWS_WITH_AS(checked_add(i64_max, std::int64_t{1}, "offset"),
                       doctest::Contains("offset overflows 64-bit signed arithmetic"), memkit::error);
  CHECK_THROWS_AS(checked_product("numel", std::int64_t{1} << 20, std::int64_t{1} << 20, std::int64_t{1} << 30),
                  memkit::error);
  CHECK(checked_product("numel", std::int64_t{1} << 20, std::int64_t{1} << 20, std::int64_t{1} << 22) ==
        std::int64_t{1} << 62);
  CHECK_THROWS_AS(checked_sum("bytes", u64_max / 2, u64_max / 2, std::uint64_t{2}), memkit::error);
}

TEST_CASE("saturating_*: clamps to the largest value instead of wrapping") {
  CHECK(saturating_add(u64_max - 1, std::uint64_t{5}) == u64_max);
  CHECK(saturating_add(std::uint64_t{2}, std::uint64_t{5}) == 7);
  CHECK(saturating_mul(std::uint64_t{1} << 33, std::uint64_t{1} << 33) == u64_max);
  CHECK(saturating_mul(std::uint64_t{3}, std::uint64_t{5}) == 15);
}

TEST_CASE("checked_cast: refuses values the target type cannot hold") {
  CHECK(checked_cast<std::int64_t>(std::uint64_t{42}, "n") == 42);
  CHECK_THROWS_WITH_AS(checked_cast<std::int64_t>(u64_max, "tensor size"),
                       doctest::Contains("tensor size = 18446744073709551615 does not fit in a 64-bit signed"),
                       memkit::error);
  CHECK_THROWS_AS(checked_cast<std::size_t>(std::int64_t{-1}, "count"), memkit::error);
  CHECK_THROWS_AS(checked_cast<int>(std::int64_t{1} << 40, "count"), memkit::error);
}

TEST_CASE("within_range: never wraps near the top of the type") {
  CHECK(within_range(std::int64_t{0}, std::int64_t{0}, std::int64_t{0}));
  CHECK(within_range(std::int64_t{5}, std::int64_t{0}, std::int64_t{5}));
  CHECK_FALSE(within_range(std::int64_t{6}, std::int64_t{0}, std::int64_t{5}));
  CHECK(within_range(std::int64_t{0}, std::int64_t{5}, std::int64_t{5}));
  CHECK_FALSE(within_range(std::int64_t{1}, std::int64_t{5}, std::int64_t{5}));
  CHECK_FALSE(within_range(std::int64_t{-1}, std::int64_t{1}, std::int64_t{5}));
  CHECK_FALSE(within_range(std::int64_t{0}, std::int64_t{-1}, std::int64_t{5}));
  // offset + count wraps to a small negative number; a naive `offset + count > size` check passes it.
  CHECK_FALSE(within_range(i64_max - 1, std::int64_t{10}, std::int64_t{100}));
  CHECK_FALSE(within_range(std::int64_t{10}, i64_max, std::int64_t{100}));
  CHECK_FALSE(within_range(u64_max, std::uint64_t{2}, std::uint64_t{100}));
  CHECK(within_range(u64_max - 2, std::uint64_t{2}, u64_max));
}
