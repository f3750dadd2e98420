// Double quantization of block scales on the host.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <string>
#include <vector>

#include "memkit/quant/double_quant.hpp"
#include "support/test_values.hpp"

namespace q = memkit::quant;
using memkit::host;
using memkit::host_view;

namespace {

struct nested {
  std::vector<std::uint8_t> codes;
  std::vector<float> group_absmax;
  float offset = 0;
};

nested quantize_scales(const std::vector<float>& absmax) {
  const auto blocks = static_cast<std::int64_t>(absmax.size());
  nested out{std::vector<std::uint8_t>(absmax.size()),
             std::vector<float>(static_cast<std::size_t>(q::nested_group_count(blocks))), 0.0f};
  q::quantize_scales(host, host_view(absmax.data(), {blocks}), host_view(out.codes), host_view(out.group_absmax),
                     host_view(&out.offset, {1}));
  return out;
}

std::vector<float> dequantize_scales(const nested& in) {
  std::vector<float> out(in.codes.size());
  const auto blocks = static_cast<std::int64_t>(in.codes.size());
  q::dequantize_scales(host, host_view(in.codes.data(), {blocks}),
                       host_view(in.group_absmax.data(), {static_cast<std::int64_t>(in.group_absmax.size())}),
                       host_view(&in.offset, {1}), host_view(out));
  return out;
}

}  // namespace

TEST_CASE("quant double: a hand-made set of scales") {
  const nested out = quantize_scales({1.0f, 2.0f, 3.0f, 4.0f});
  CHECK(out.offset == 2.5f);                                  // the mean
  CHECK(out.group_absmax == std::vector<float>{1.5f});       // max |absmax - offset|
  const float* map = q::dynamic_map_signed.data();
  CHECK(out.codes[0] == q::nearest_dynamic(map, -1.0f));     // -1.5 / 1.5
  CHECK(out.codes[3] == 255);                                // +1
  CHECK(out.codes[1] == q::nearest_dynamic(map, -0.5f * (1.0f / 1.5f)));
  const std::vector<float> back = dequantize_scales(out);
  CHECK(back[3] == 4.0f);                                    // 1 * 1.5 + 2.5
  CHECK(back[0] == map[0] * 1.5f + 2.5f);                    // decode is map * absmax2, then + offset
  for (int i = 0; i < 4; ++i) CHECK(back[static_cast<std::size_t>(i)] == doctest::Approx(1.0f + i).epsilon(0.01));
}

TEST_CASE("quant double: groups of 256 scales, the offset, and the decoding error") {
  const std::int64_t blocks = 256 * 5 + 17;  // a partial last group
  const std::vector<float> absmax =
      memkit_test::random_values(blocks, 3, std::uniform_real_distribution<float>(0.5f, 4.0f));
  const nested out = quantize_scales(absmax);
  REQUIRE(out.group_absmax.size() == 6);
  double mean = 0;
  for (float v : absmax) mean += v;
  mean /= static_cast<double>(blocks);
  CHECK(out.offset == doctest::Approx(mean).epsilon(1e-7));
  const std::vector<float> back = dequantize_scales(out);
  for (std::int64_t b = 0; b < blocks; ++b) {
    const float group_max = out.group_absmax[static_cast<std::size_t>(b / 256)];
    CHECK(std::fabs(back[static_cast<std::size_t>(b)] - absmax[static_cast<std::size_t>(b)]) <= 0.01f * group_max);
  }
  // Each group's absmax is the largest |scale - offset| in it.
  for (std::int64_t g = 0; g < 6; ++g) {
    float largest = 0;
    for (std::int64_t b = g * 256; b < std::min(blocks, g * 256 + 256); ++b)
      largest = std::max(largest, std::fabs(absmax[static_cast<std::size_t>(b)] - out.offset));
    CHECK(out.group_absmax[static_cast<std::size_t>(g)] == largest);
  }
}

TEST_CASE("quant double: NF4 with double-quantized scales stays within bitsandbytes' bounds") {
  const std::int64_t n = 1024 * 1024;
  const std::vector<float> data = memkit_test::standard_normal(n, 77);
  for (std::int64_t block : {32, 64, 128}) {
    CAPTURE(block);
    const std::int64_t blocks = q::block_count(n, block);
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(n / 2));
    std::vector<float> absmax(static_cast<std::size_t>(blocks));
    q::quantize_blockwise(host, q::format::nf4, host_view(data.data(), {n}), block, host_view(codes),
                          host_view(absmax));
    const nested scales = quantize_scales(absmax);
    const std::vector<float> decoded_scales = dequantize_scales(scales);
    std::vector<float> back(static_cast<std::size_t>(n));
    q::dequantize_blockwise(host, q::format::nf4, host_view(codes.data(), {n / 2}),
                            host_view(decoded_scales.data(), {blocks}), block, 0, host_view(back));
    const auto e = memkit_test::round_trip_errors(data, back);
    CHECK(e.absolute < 0.11);
    CHECK(e.relative < 0.28);
  }
}

TEST_CASE("quant double: a non-finite scale and wrong sizes are errors") {
  std::vector<float> absmax = {1.0f, std::numeric_limits<float>::infinity(), 2.0f};
  std::vector<std::uint8_t> codes(3, 9);
  std::vector<float> group(1, -1.0f);
  float offset = -1.0f;
  CHECK_THROWS_WITH_AS(q::quantize_scales(host, host_view(std::as_const(absmax).data(), {3}), host_view(codes),
                                          host_view(group), host_view(&offset, {1})),
                       doctest::Contains("scale of block 1 is not finite"), memkit::error);
  CHECK(codes == std::vector<std::uint8_t>(3, 9));
  CHECK(offset == -1.0f);
  std::vector<float> two_groups(2);
  CHECK_THROWS_WITH_AS(q::quantize_scales(host, host_view(std::as_const(absmax).data(), {3}), host_view(codes),
                                          host_view(two_groups), host_view(&offset, {1})),
                       doctest::Contains("`nested_absmax` has 2 entries but 3 scales need 1"), memkit::error);
}
