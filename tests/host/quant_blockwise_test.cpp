// Blockwise quantization on the host: exact codes on hand-made inputs, round-trip error bounds,
// 16-bit inputs and outputs, tiles, and the errors.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "memkit/quant/blockwise.hpp"
#include "support/test_values.hpp"
#include "support/host_isa_scope.hpp"

namespace q = memkit::quant;
using memkit::bf16;
using memkit::fp16;
using memkit::host;
using memkit::host_view;

namespace {

struct quantized {
  std::vector<std::uint8_t> codes;
  std::vector<float> absmax;
};

template <class T>
quantized quantize(q::format fmt, const std::vector<T>& input, std::int64_t block_size, const char* name = "input") {
  const auto n = static_cast<std::int64_t>(input.size());
  quantized out{std::vector<std::uint8_t>(static_cast<std::size_t>(q::code_bytes(fmt, n))),
                std::vector<float>(static_cast<std::size_t>(q::block_count(n, block_size)))};
  q::quantize_blockwise(host, fmt, host_view(input.data(), {n}), block_size, host_view(out.codes),
                        host_view(out.absmax), name);
  return out;
}

template <class T = float>
std::vector<T> dequantize(q::format fmt, const quantized& data, std::int64_t block_size, std::int64_t numel,
                          std::int64_t first = 0) {
  std::vector<T> out(static_cast<std::size_t>(numel));
  q::dequantize_blockwise(host, fmt, host_view(data.codes.data(), {static_cast<std::int64_t>(data.codes.size())}),
                          host_view(data.absmax.data(), {static_cast<std::int64_t>(data.absmax.size())}), block_size,
                          first, host_view(out));
  return out;
}

using memkit_test::standard_normal;

using memkit_test::round_trip_errors;

std::string message_of(auto&& body) {
  try {
    body();
  } catch (const memkit::error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("quant blockwise: NF4 codes of a hand-made input, packing and odd tail") {
  // absmax 1; 0.5 -> 12, -1 -> 0, 0 -> 7, 1 -> 15, 0.25 -> 10, and the pad 0.0 -> 7.
  const std::vector<float> input = {0.5f, -1.0f, 0.0f, 1.0f, 0.25f};
  const quantized out = quantize(q::format::nf4, input, 64);
  REQUIRE(out.codes.size() == 3);
  CHECK(out.codes[0] == 0xC0);  // even element in the high nibble
  CHECK(out.codes[1] == 0x7F);
  CHECK(out.codes[2] == 0xA7);
  REQUIRE(out.absmax.size() == 1);
  CHECK(out.absmax[0] == 1.0f);
  const std::vector<float> back = dequantize(q::format::nf4, out, 64, 5);
  CHECK(back == std::vector<float>{q::nf4_codebook[12], -1.0f, 0.0f, 1.0f, q::nf4_codebook[10]});
}

TEST_CASE("quant blockwise: scaling uses the block reciprocal, and exact ties go to the lower code") {
  // absmax 2 makes the reciprocal exactly 0.5, so x = 2 * threshold lands exactly on each threshold.
  const float thresholds[15] = {-0.8480964004993439f,  -0.6106329262256622f, -0.4599952697753906f,
                                -0.33967943489551544f, -0.23460740596055984f, -0.13791173323988914f,
                                -0.045525018125772476f, 0.03979014977812767f, 0.1202552504837513f,
                                0.2035212516784668f,   0.2920137718319893f,  0.3893125355243683f,
                                0.5016634166240692f,   0.6427869200706482f,  0.8614784181118011f};
  std::vector<float> input = {2.0f};
  for (float t : thresholds) {
    input.push_back(2.0f * t);
    input.push_back(2.0f * std::nextafter(t, 2.0f));
  }
  const quantized out = quantize(q::format::nf4, input, 32);
  for (int k = 0; k < 15; ++k) {
    CAPTURE(k);
    CHECK(q::code_at<q::format::nf4>(out.codes.data(), 1 + 2 * k) == k);
    CHECK(q::code_at<q::format::nf4>(out.codes.data(), 2 + 2 * k) == k + 1);
  }
  // The reciprocal is formed once, then multiplied: with absmax 3, x = 1 maps via 1 * (1/3), not 1/3.
  const std::vector<float> thirds = {3.0f, 1.0f};
  const quantized third = quantize(q::format::int8, thirds, 32);
  CHECK(third.codes[1] == q::nearest_dynamic(q::dynamic_map_signed.data(), 1.0f * (1.0f / 3.0f)));
}

TEST_CASE("quant blockwise: all-zero blocks give code 0 and absmax 0, and decode to zero") {
  std::vector<float> input(96, 0.0f);
  input[70] = -3.0f;  // only the third block of 32 is non-zero
  for (q::format fmt : {q::format::nf4, q::format::fp4, q::format::int8}) {
    CAPTURE(q::to_string(fmt));
    const quantized out = quantize(fmt, input, 32);
    CHECK(out.absmax == std::vector<float>{0.0f, 0.0f, 3.0f});
    const std::int64_t zero_block_bytes = q::code_bytes(fmt, 64);
    for (std::int64_t i = 0; i < zero_block_bytes; ++i) CHECK(out.codes[static_cast<std::size_t>(i)] == 0);
    const std::vector<float> back = dequantize(fmt, out, 32, 96);
    for (int i = 0; i < 64; ++i) CHECK(back[static_cast<std::size_t>(i)] == 0.0f);
    // The block maximum decodes exactly in the 4-bit formats (codes +-1); the int8 map has no -1.
    if (q::is_four_bit(fmt)) CHECK(back[70] == -3.0f);
    else CHECK(back[70] == doctest::Approx(-3.0 * 0.99296875));
  }
}

TEST_CASE("quant blockwise: FP4 and int8 codes of hand-made inputs") {
  // FP4, absmax 12 so values are in units of the e2m1 magnitudes.
  const std::vector<float> input = {12.0f, -12.0f, 0.0f, -0.0f, 6.0f, -3.0f, 0.0625f, 1.0f, -7.0f};
  const quantized fp4 = quantize(q::format::fp4, input, 32);
  const std::uint8_t expected[9] = {0b0011, 0b1011, 0b0000, 0b0000, 0b0101, 0b1111, 0b0001, 0b0001, 0b1010};
  for (int i = 0; i < 9; ++i) CHECK(q::code_at<q::format::fp4>(fp4.codes.data(), i) == expected[i]);
  CHECK((fp4.codes[4] & 0x0f) == 0);  // pad: 0.0 -> code 0
  // 1/12 sits below the 0.0859375 midpoint (code 1, not 6); -7/12 = -0.58333335 lies just above
  // bitsandbytes' 0.583333 threshold, so magnitude 8 (0b010), not 6.
  // int8 with the signed dynamic map: the extremes and zero.
  const std::vector<float> int8_input = {-4.0f, 4.0f, 0.0f, 2.0f};
  const quantized int8 = quantize(q::format::int8, int8_input, 32);
  CHECK(int8.codes[0] == 0);  // -1 is not in the map; -0.99296875 is the nearest
  CHECK(int8.codes[1] == 255);
  CHECK(int8.codes[2] == 127);
  CHECK(q::dynamic_map_signed[int8.codes[3]] == doctest::Approx(0.5).epsilon(0.01));
}

TEST_CASE("quant blockwise: 1024x1024 standard-normal round trips stay within bitsandbytes' bounds") {
  const std::vector<float> data = standard_normal(1024 * 1024, 2024);
  struct bound {
    q::format fmt;
    std::int64_t block;
    double absolute, relative;
  } bounds[] = {{q::format::nf4, 64, 0.0733, 0.2057},  {q::format::nf4, 256, 0.0811, 0.2289},
                {q::format::nf4, 2048, 0.0914, 0.2594}, {q::format::fp4, 64, 0.0973, 0.2628},
                {q::format::int8, 256, 0.011, 0.018},   {q::format::int8, 4096, 0.011, 0.018}};
  for (const bound& b : bounds) {
    CAPTURE(q::to_string(b.fmt));
    CAPTURE(b.block);
    const quantized out = quantize(b.fmt, data, b.block);
    const auto e = round_trip_errors(data, dequantize(b.fmt, out, b.block, 1024 * 1024));
    CAPTURE(e.absolute);
    CAPTURE(e.relative);
    CHECK(e.absolute < b.absolute);
    CHECK(e.relative < b.relative);
    if (b.fmt == q::format::nf4 && b.block == 64) {
      CHECK(e.absolute == doctest::Approx(0.0728).epsilon(0.01));  // bitsandbytes' measured mean
      CHECK(e.relative == doctest::Approx(0.2033).epsilon(0.02));
    }
  }
}

TEST_CASE("quant blockwise: bf16 and fp16 inputs and outputs agree with the fp32 path") {
  const std::vector<float> data = standard_normal(1000 + 37, 5);  // not a multiple of the block, odd
  std::vector<bf16> as_bf16;
  std::vector<fp16> as_fp16;
  std::vector<float> from_bf16, from_fp16;
  for (float v : data) {
    as_bf16.emplace_back(v);
    as_fp16.emplace_back(v);
    from_bf16.push_back(static_cast<float>(as_bf16.back()));
    from_fp16.push_back(static_cast<float>(as_fp16.back()));
  }
  for (q::format fmt : {q::format::nf4, q::format::fp4, q::format::int8}) {
    CAPTURE(q::to_string(fmt));
    const quantized a = quantize(fmt, as_bf16, 128), b = quantize(fmt, from_bf16, 128);
    CHECK(a.codes == b.codes);
    CHECK(a.absmax == b.absmax);
    const quantized c = quantize(fmt, as_fp16, 128), d = quantize(fmt, from_fp16, 128);
    CHECK(c.codes == d.codes);
    CHECK(c.absmax == d.absmax);
    const std::vector<float> wide = dequantize(fmt, a, 128, 1037);
    const std::vector<bf16> narrow = dequantize<bf16>(fmt, a, 128, 1037);
    const std::vector<fp16> half = dequantize<fp16>(fmt, a, 128, 1037);
    for (std::size_t i = 0; i < wide.size(); ++i) {
      CHECK(narrow[i].bits == bf16(wide[i]).bits);
      CHECK(half[i].bits == fp16(wide[i]).bits);
    }
  }
}

TEST_CASE("quant blockwise: a tile dequantizes to the same values as the whole tensor") {
  const std::vector<float> data = standard_normal(777, 9);
  for (q::format fmt : {q::format::nf4, q::format::fp4, q::format::int8}) {
    CAPTURE(q::to_string(fmt));
    const quantized out = quantize(fmt, data, 32);
    const std::vector<float> whole = dequantize(fmt, out, 32, 777);
    for (std::int64_t first : {0, 1, 31, 32, 33, 500, 776}) {
      for (std::int64_t count : {1, 2, 7, 64, 100}) {
        if (first + count > 777) continue;
        const std::vector<float> tile = dequantize(fmt, out, 32, count, first);
        for (std::int64_t i = 0; i < count; ++i) CHECK(tile[static_cast<std::size_t>(i)] == whole[static_cast<std::size_t>(first + i)]);
      }
    }
  }
}

TEST_CASE("quant blockwise: every supported block size, and a clear error for the others") {
  const std::vector<float> data = standard_normal(5000, 3);
  for (std::int64_t block = 32; block <= 4096; block *= 2) {
    const quantized out = quantize(q::format::nf4, data, block);
    CHECK(out.absmax.size() == static_cast<std::size_t>((5000 + block - 1) / block));
    const auto e = round_trip_errors(data, dequantize(q::format::nf4, out, block, 5000));
    CHECK(e.absolute < 0.1);
  }
  for (std::int64_t bad : {0, 16, 48, 100, 8192}) {
    CAPTURE(bad);
    std::vector<std::uint8_t> codes(2500);
    std::vector<float> absmax(200);
    const std::string message = message_of([&] {
      q::quantize_blockwise(host, q::format::nf4, host_view(data.data(), {5000}), bad, host_view(codes),
                            host_view(absmax));
    });
    CHECK(message.find("block size " + std::to_string(bad) + " is not supported") != std::string::npos);
  }
}

TEST_CASE("quant blockwise: non-finite input names the tensor and the block and writes nothing of its group") {
  for (float poison : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()}) {
    std::vector<float> data = standard_normal(300, 4);
    data[200] = poison;
    std::vector<std::uint8_t> codes(150, 0xAB);
    std::vector<float> absmax(5, -7.0f);
    const std::string message = message_of([&] {
      q::quantize_blockwise(host, q::format::nf4, host_view(data.data(), {300}), 64, host_view(codes),
                            host_view(absmax), "model.layers.0.mlp.up_proj.weight");
    });
    CAPTURE(message);
    CHECK(message.find("model.layers.0.mlp.up_proj.weight") != std::string::npos);
    CHECK(message.find("element 200") != std::string::npos);
    CHECK(message.find("block 3 of 5") != std::string::npos);
    CHECK(codes == std::vector<std::uint8_t>(150, 0xAB));
    CHECK(absmax == std::vector<float>(5, -7.0f));
  }
  // bf16 Inf is caught too.
  std::vector<bf16> narrow(40, bf16(1.0f));
  narrow[39] = bf16::from_bits(0x7f80);
  std::vector<std::uint8_t> codes(20);
  std::vector<float> absmax(2);
  CHECK(message_of([&] {
          q::quantize_blockwise(host, q::format::fp4, host_view(narrow.data(), {40}), 32, host_view(codes),
                                host_view(absmax), "w");
        }).find("block 1 of 2") != std::string::npos);
}

TEST_CASE("quant blockwise: the finiteness check rides on the absmax pass, group by group, on any thread count") {
  // 3 groups of max_block_size values and a tail; the Inf sits in the third group (block 2 * 64 + 5 at block 64).
  const std::int64_t n = 3 * q::max_block_size + 100, bad = 2 * q::max_block_size + 5 * 64 + 7;
  std::vector<float> data = standard_normal(static_cast<std::size_t>(n), 9);
  data[static_cast<std::size_t>(bad)] = std::numeric_limits<float>::infinity();
  const quantized clean = [&] {
    std::vector<float> finite = data;
    finite[static_cast<std::size_t>(bad)] = 0.0f;
    return quantize(q::format::nf4, finite, 64);
  }();
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(q::code_bytes(q::format::nf4, n)), 0xAB);
  std::vector<float> absmax(static_cast<std::size_t>(q::block_count(n, 64)), -7.0f);
  const std::string message = message_of([&] {
    q::quantize_blockwise(host, q::format::nf4, host_view(data.data(), {n}), 64, host_view(codes), host_view(absmax), "w");
  });
  CHECK(message.find("flat element " + std::to_string(bad) + ", in block " + std::to_string(bad / 64)) != std::string::npos);
  // The groups before the offending one are quantized; nothing from its group on is written.
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(codes.size()); ++i) {
    const bool before = 2 * i < 2 * q::max_block_size;
    if (codes[static_cast<std::size_t>(i)] != (before ? clean.codes[static_cast<std::size_t>(i)] : 0xAB)) {
      CAPTURE(i);
      CHECK(false);
    }
  }
  for (std::size_t b = 0; b < absmax.size(); ++b) CHECK(absmax[b] == (b < 128 ? clean.absmax[b] : -7.0f));
  // Threads: the same codes for any count; an error names the first non-finite element whichever thread meets it.
  const std::int64_t big = std::int64_t{1} << 20;
  std::vector<float> wide = standard_normal(static_cast<std::size_t>(big) + 33, 10);
  const auto n_wide = static_cast<std::int64_t>(wide.size());
  for (q::format fmt : {q::format::nf4, q::format::int8}) {
    CAPTURE(q::to_string(fmt));
    const quantized one = quantize(fmt, wide, 256);
    for (int threads : {2, 3, 0}) {
      CAPTURE(threads);
      quantized many{std::vector<std::uint8_t>(one.codes.size()), std::vector<float>(one.absmax.size())};
      q::quantize_blockwise(host, fmt, host_view(std::as_const(wide).data(), {n_wide}), 256, host_view(many.codes),
                            host_view(many.absmax), "wide", q::signed_dynamic_table, threads);
      CHECK(many.codes == one.codes);
      CHECK(many.absmax == one.absmax);
      std::vector<float> poisoned = wide;
      poisoned[static_cast<std::size_t>(big - 3)] = std::numeric_limits<float>::quiet_NaN();
      poisoned[static_cast<std::size_t>(big / 3)] = -std::numeric_limits<float>::infinity();
      CHECK(message_of([&] {
              q::quantize_blockwise(host, fmt, host_view(std::as_const(poisoned).data(), {n_wide}), 256,
                                    host_view(many.codes), host_view(many.absmax), "wide", q::signed_dynamic_table, threads);
            }).find("(-inf) at flat element " + std::to_string(big / 3)) != std::string::npos);
    }
  }
}

TEST_CASE("quant blockwise: wrong output sizes are rejected before anything is written") {
  const std::vector<float> data(100, 1.0f);
  std::vector<std::uint8_t> codes(49, 0x11);
  std::vector<float> absmax(2);
  CHECK(message_of([&] {
          q::quantize_blockwise(host, q::format::nf4, host_view(data.data(), {100}), 64, host_view(codes),
                                host_view(absmax));
        }).find("`codes` has 49 bytes but 100 nf4 values need 50") != std::string::npos);
  CHECK(codes == std::vector<std::uint8_t>(49, 0x11));
  std::vector<std::uint8_t> enough(50);
  std::vector<float> one(1);
  CHECK(message_of([&] {
          q::quantize_blockwise(host, q::format::nf4, host_view(data.data(), {100}), 64, host_view(enough),
                                host_view(one));
        }).find("`absmax` has 1 entries") != std::string::npos);
  std::vector<float> out(10);
  CHECK(message_of([&] {
          q::dequantize_blockwise(host, q::format::int8, host_view(enough.data(), {50}), host_view(one.data(), {1}),
                                  64, 45, host_view(out));
        }).find("outside the 50 values") != std::string::npos);
  // Device memory handed to the host path is refused with a readable message.
  const memkit::tensor_view<const float> device_input{data.data(), {100}, memkit::memory_kind::device};
  CHECK(message_of([&] {
          q::quantize_blockwise(host, q::format::nf4, device_input, 64, host_view(enough), host_view(absmax));
        }).find("`input` is in device memory") != std::string::npos);
}

TEST_CASE("quant blockwise: the branchless int8 encoder agrees with bitsandbytes' search everywhere") {
  for (const auto* table : {&q::dynamic_map_signed, &q::dynamic_map_unsigned}) {
    const float* m = table->data();
    std::vector<float> probes = {0.0f, -0.0f, 2.0f, -2.0f, 1.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                                 std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
    for (int i = 0; i < 256; ++i) {
      probes.push_back(m[i]);
      probes.push_back(std::nextafter(m[i], 2.0f));
      probes.push_back(std::nextafter(m[i], -2.0f));
      if (i < 255) {
        const float tie = (m[i] + m[i + 1]) * 0.5f;
        probes.push_back(tie);
        probes.push_back(std::nextafter(tie, 2.0f));
        probes.push_back(std::nextafter(tie, -2.0f));
      }
    }
    std::mt19937 rng(21);
    std::uniform_real_distribution<float> uniform(-1.1f, 1.1f);
    for (int i = 0; i < 200000; ++i) probes.push_back(uniform(rng) * std::pow(10.0f, -static_cast<float>(i % 8)));
    for (float x : probes) {
      CAPTURE(x);
      REQUIRE(q::nearest_dynamic_counting(m, x) == q::nearest_dynamic(m, x));
    }
  }
}

TEST_CASE("quant blockwise: long blocks (the vectorized encoders) give exactly the per-element codes on every instruction set") {
  // Normal values plus exact thresholds, zeros of both signs, tiny and huge values, in fp32/bf16/fp16.
  std::vector<float> data = standard_normal(4096 * 3 + 50, 8);
  const float specials[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 0.8614784181118011f, -0.8480964004993439f, 0.583333f,
                            -0.0859375f, 0.00260417f, 0.29166667f};
  for (std::size_t i = 0; i < data.size(); i += 5) data[i] = specials[(i / 5) % 10];
  for (std::size_t i = 4096; i < 4096 + 64; ++i) data[i] = 0.0f;  // an all-zero block at block size 64
  // A block of subnormals: 1/absmax overflows to +Inf, so normalized values are +-Inf or NaN (0 * Inf).
  const float tiny[] = {1e-39f, -1e-39f, 3e-40f, -1e-45f, 0.0f, -0.0f, 5e-41f, 7e-39f};
  for (std::size_t i = 8192; i < 8192 + 64; ++i) data[i] = tiny[i % 8];
  // Values just around every threshold and tie, at absmax 1 (the block holds a 1.0).
  for (std::size_t i = 8192 + 64; i < 8192 + 128; ++i) data[i] = 0.0f;
  data[8192 + 64] = 1.0f;
  {
    std::size_t at = 8192 + 65;
    for (float t : {-0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
                    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
                    0.1202552504837513f, 0.2035212516784668f, 0.00260417f, 0.0859375f, 0.20833333f, 0.8333333f})
      for (float v : {t, std::nextafter(t, 2.0f), std::nextafter(t, -2.0f)})
        if (at < 8192 + 128) data[at++] = v;
  }
  auto check = [&](auto tag, q::format fmt, std::int64_t block) {
    using T = decltype(tag);
    const std::vector<T> input = memkit_test::convert<T>(data);
    const quantized out = quantize(fmt, input, block);
    for (std::size_t i = 0; i < input.size(); ++i) {
      const float absmax = out.absmax[i / static_cast<std::size_t>(block)];
      const float x = memkit::to_float(input[i]) * q::block_reciprocal(absmax);
      const auto e = static_cast<std::int64_t>(i);
      const std::uint8_t expected = fmt == q::format::nf4   ? q::encode<q::format::nf4>(x, nullptr)
                                    : fmt == q::format::fp4 ? q::encode<q::format::fp4>(x, nullptr)
                                                            : q::encode<q::format::int8>(x, q::dynamic_map_signed.data());
      const std::uint8_t got = fmt == q::format::nf4   ? q::code_at<q::format::nf4>(out.codes.data(), e)
                               : fmt == q::format::fp4 ? q::code_at<q::format::fp4>(out.codes.data(), e)
                                                       : q::code_at<q::format::int8>(out.codes.data(), e);
      if (got != expected) {
        CAPTURE(i);
        CHECK(got == expected);
      }
    }
  };
  // Each instruction set this CPU has in turn (core/host_simd.hpp): the AVX-512, AVX2 and portable encoders.
  memkit_test::on_each_host_isa([&](memkit::host_isa) {
    for (q::format fmt : {q::format::nf4, q::format::fp4, q::format::int8}) {
      CAPTURE(q::to_string(fmt));
      for (std::int64_t block : {32, 64, 4096}) {
        check(float{}, fmt, block);
        check(bf16{}, fmt, block);
        check(fp16{}, fmt, block);
      }
    }
  });
}

// encode<F> walks a comparison tree of selects (4 comparisons for NF4, 3 for FP4's magnitude); it must give
// bitsandbytes' codes (quant/codebooks.hpp: nearest_nf4 / nearest_fp4, its branchy tree) everywhere: on
// every threshold, one ulp either side, across [-1.25, 1.25], at the signed zeros, infinities and NaN.
TEST_CASE("quant blockwise: the NF4 and FP4 comparison trees give bitsandbytes' codes") {
  std::vector<float> xs = {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(), 1.0f, -1.0f};
  for (int i = -125000; i <= 125000; ++i) xs.push_back(static_cast<float>(i) * 1e-5f);
  for (int code = 0; code + 1 < 16; ++code)
    for (const auto& book : {q::nf4_codebook, q::fp4_codebook}) {
      const float mid = (book[static_cast<std::size_t>(code)] + book[static_cast<std::size_t>(code) + 1]) * 0.5f;
      for (float x : {mid, std::nextafter(mid, -2.0f), std::nextafter(mid, 2.0f), -mid}) xs.push_back(x);
    }
  int mismatches = 0;
  for (float x : xs) {
    mismatches += q::encode<q::format::nf4>(x, nullptr) != q::nearest_nf4(x);
    mismatches += q::encode<q::format::fp4>(x, nullptr) != q::nearest_fp4(x);
  }
  CHECK(mismatches == 0);
}

// dequantize_blockwise's vector paths (AVX-512, AVX2: chunks of 16 or 32 values after a head that aligns the
// output, chunks straddling a block boundary, the scalar tail) against decode() element by element, bit for bit, on every instruction set this CPU has: random codes (every code of every format),
// absmax including NaN, +-Inf, +-0, subnormals and values whose products overflow or round to bf16 ties.
namespace {
template <class T>
void check_dequantize_every_path(q::format fmt, std::int64_t block, std::int64_t numel,
                                 const std::vector<std::int64_t>& firsts, const std::vector<std::int64_t>& counts,
                                 const std::vector<std::int64_t>& offsets, std::uint32_t seed,
                                 const std::array<float, 256>& map_values = q::dynamic_map_signed) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(q::code_bytes(fmt, numel)));
  for (std::uint8_t& c : codes) c = static_cast<std::uint8_t>(rng());
  std::vector<float> absmax(static_cast<std::size_t>(q::block_count(numel, block)));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 0.0f, -0.0f, 1e-40f, 3e38f, -2.5f,
                            1.00390625f /* bf16 tie at 1.0 */, 1.01171875f, -std::numeric_limits<float>::quiet_NaN()};
  for (std::size_t b = 0; b < absmax.size(); ++b) absmax[b] = b % 3 == 1 ? specials[(b / 3) % 11] : std::fabs(normal(rng)) + 0.01f;
  const float* map = map_values.data();
  const auto map_table = q::make_code_table(map_values);
  for (std::int64_t first : firsts)
    for (std::int64_t count : counts) {
      if (count < 0) count = numel - first;
      if (first + count > numel) continue;
      for (std::int64_t offset : offsets) {
        CAPTURE(first);
        CAPTURE(count);
        CAPTURE(offset);
        std::vector<T> buffer(static_cast<std::size_t>(count + offset + 16));
        T* out = buffer.data() + offset;
        q::dequantize_blockwise(host, fmt, host_view(codes.data(), {static_cast<std::int64_t>(codes.size())}),
                                host_view(absmax.data(), {static_cast<std::int64_t>(absmax.size())}), block, first,
                                host_view(out, {count}), map_table);
        std::int64_t wrong = 0, first_wrong = -1;
        for (std::int64_t i = 0; i < count; ++i) {
          const std::int64_t e = first + i;
          const float scale = absmax[static_cast<std::size_t>(e / block)];
          const float value = fmt == q::format::nf4   ? q::decode<q::format::nf4>(q::code_at<q::format::nf4>(codes.data(), e), scale, map)
                              : fmt == q::format::fp4 ? q::decode<q::format::fp4>(q::code_at<q::format::fp4>(codes.data(), e), scale, map)
                                                      : q::decode<q::format::int8>(q::code_at<q::format::int8>(codes.data(), e), scale, map);
          const T expected = memkit::from_float<T>(value);
          // A NaN scale decodes to NaN; its sign bit is the compiler's choice (-(v * NaN) and (-v) * NaN are
          // the same expression to it: clang 14 flips it in the scalar loop too), so an fp32 NaN matches any
          // NaN. bf16 and fp16 conversions make every NaN 0x7fff: those bits must match.
          if (std::is_same_v<T, float> && std::isnan(value) && std::isnan(memkit::to_float(out[i]))) continue;
          if (std::memcmp(&expected, out + i, sizeof(T)) != 0 && wrong++ == 0) {
            first_wrong = i;
            std::uint32_t want = 0, got = 0;
            std::memcpy(&want, &expected, sizeof(T));
            std::memcpy(&got, out + i, sizeof(T));
            MESSAGE(std::string(q::to_string(fmt)), " block ", block, " first ", first, " offset ", offset, " ", sizeof(T), "-byte output: element ", e, " is ", got, ", decode() gives ", want);
          }
        }
        CAPTURE(first_wrong);
        CHECK(wrong == 0);
      }
    }
}
}  // namespace

TEST_CASE("quant blockwise: dequantize gives decode() bit for bit on every instruction set, aligned or not") {
  memkit_test::on_each_host_isa([](memkit::host_isa) {
    for (q::format fmt : {q::format::nf4, q::format::fp4, q::format::int8}) {
      CAPTURE(q::to_string(fmt));
      for (std::int64_t block : {32, 64, 256}) {
        CAPTURE(block);
        const std::vector<std::int64_t> firsts = {0, 1, 2, 17, 31, 32, 33, 100}, counts = {63, 64, 65, 100, 513, -1},
                                        offsets = {0, 1, 3, 8, 12};
        check_dequantize_every_path<float>(fmt, block, 3001, firsts, counts, offsets, 11);
        check_dequantize_every_path<bf16>(fmt, block, 3001, firsts, counts, offsets, 12);
        check_dequantize_every_path<fp16>(fmt, block, 3001, {0, 1, 33}, {64, -1}, {0, 1}, 13);
      }
      if (fmt == q::format::int8) {
        // A map of the caller's with Inf and NaN entries (the bf16 path's finite shortcut must not apply; from
        // block 256 on, AVX-512 rounds them into its per-block bf16 table).
        std::array<float, 256> odd_map = q::dynamic_map_signed;
        odd_map[3] = std::numeric_limits<float>::infinity();
        odd_map[200] = std::numeric_limits<float>::quiet_NaN();
        odd_map[255] = 3e38f;
        for (std::int64_t block : {64, 256}) {
          check_dequantize_every_path<float>(fmt, block, 3001, {0, 5}, {-1}, {0, 3}, 16, odd_map);
          check_dequantize_every_path<bf16>(fmt, block, 3001, {0, 5, 250}, {-1, 300}, {0, 3}, 17, odd_map);
        }
      }
    }
  });
}
