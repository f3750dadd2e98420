// Regression tests for hostile input (issue #15): each case is a file or argument that, before the fix,
// was accepted, wrapped an integer, allocated from an untrusted size, read out of bounds or wrote a file
// that could not be read back. Each must now end in a memkit::error that says what is wrong, with nothing
// allocated or changed first.
#include <doctest/doctest.h>
#include <memkit/io/json.hpp>
#include <memkit/io/safetensors.hpp>
#include <memkit/memory/tracking.hpp>
#include <memkit/optim/adam_state.hpp>
#include <memkit/quant/bnb_checkpoint.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz/adam_image.hpp"

using memkit::host;
using memkit::host_view;
namespace q = memkit::quant;

namespace {

constexpr std::int64_t int64_max = std::numeric_limits<std::int64_t>::max();

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("memkit_hostile_" + name)).string();
}

// A safetensors file with the given header JSON and `data_bytes` zero bytes of data.
std::string write_raw_safetensors(const std::string& name, std::string header, std::size_t data_bytes) {
  while ((8 + header.size()) % 8 != 0) header += ' ';
  const std::string path = temp_path(name);
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t size = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(size >> (8 * i)));
  out << header << std::string(data_bytes, '\0');
  return path;
}

// A bitsandbytes NF4 weight "w" whose quant_state claims `shape_json`, with code and absmax tensors of the
// given sizes.
std::string write_bnb_file(const std::string& name, const std::string& shape_json, std::int64_t code_bytes,
                           std::int64_t blocks) {
  memkit::safetensors::writer out;
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(code_bytes), 0x77);
  std::vector<float> absmax(static_cast<std::size_t>(blocks), 1.0f);
  out.add("w", host_view(codes), {code_bytes, 1});
  out.add("w.absmax", host_view(absmax));
  out.add("w.quant_map", memkit::tensor_view<const float>(q::nf4_codebook.data(), memkit::shape{16}, memkit::memory_kind::host));
  const std::string state = "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": " + shape_json + "}";
  out.add_bytes("w.quant_state.bitsandbytes__nf4", "U8", {static_cast<std::int64_t>(state.size())}, state.data(), state.size());
  const std::string path = temp_path(name);
  out.write(path);
  return path;
}

}  // namespace

TEST_CASE("hostile safetensors: an element count whose byte size wraps to 0 is refused when the header is read") {
  // 2^61 F64 elements are 2^64 bytes, which wrapped to 0 and matched the empty range [0, 0).
  const std::string wraps = write_raw_safetensors(
      "wrap.safetensors", R"({"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", 0);
  CHECK_THROWS_WITH_AS(memkit::safetensors::reader{wraps}, doctest::Contains("byte size overflows 64 bits"),
                       memkit::error);
  const std::string split = write_raw_safetensors(
      "wrap2.safetensors", R"({"w":{"dtype":"F32","shape":[1073741824,1073741824,16],"data_offsets":[0,0]}})", 0);
  CHECK_THROWS_WITH_AS(memkit::safetensors::reader{split}, doctest::Contains("overflows 64 bits"), memkit::error);
  const std::string int64_wrap = write_raw_safetensors(
      "wrap3.safetensors", R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0);
  CHECK_THROWS_WITH_AS(memkit::safetensors::reader{int64_wrap}, doctest::Contains("element count overflows"),
                       memkit::error);
  // An honest empty tensor is still fine, and asking for the wrong type is refused before allocating.
  const std::string empty = write_raw_safetensors(
      "empty.safetensors", R"({"w":{"dtype":"F32","shape":[0,1099511627776],"data_offsets":[0,0]}})", 0);
  const memkit::safetensors::reader in(empty);
  CHECK(in.read_vector<float>("w").empty());
  CHECK_THROWS_WITH_AS(in.read_vector<double>("w"), doctest::Contains("is F32, not F64"), memkit::error);
  std::remove(wraps.c_str());
  std::remove(split.c_str());
  std::remove(int64_wrap.c_str());
  std::remove(empty.c_str());
}

TEST_CASE("hostile bitsandbytes: the quant_state shape is checked against the file before anything is allocated") {
  memkit::tracking_resource tracker(memkit::default_host_resource());
  // A 2^20 x 2^20 claim (512 GiB of codes) in a file holding 32 bytes: a corrupt file, not out of memory.
  const std::string huge = write_bnb_file("huge.safetensors", "[1048576, 1048576]", 32, 1);
  {
    const memkit::safetensors::reader in(huge);
    CHECK_THROWS_WITH_AS(q::load_linear4bit<q::NF4>(in, "w", tracker),
                         doctest::Contains("'w' has 32 elements, expected 549755813888"), memkit::error);
  }
  CHECK(tracker.peak_bytes() == 0);
  // 3 x 6148914691236517205 wraps to -1 in int64: it used to load "successfully" with numel -1.
  const std::string minus_one = write_bnb_file("minus_one.safetensors", "[3, 6148914691236517205]", 0, 0);
  {
    const memkit::safetensors::reader in(minus_one);
    CHECK_THROWS_WITH_AS(q::load_linear4bit<q::NF4>(in, "w", tracker), doctest::Contains("element count"),
                         memkit::error);
  }
  // Extents whose product overflows int64 outright.
  const std::string overflow = write_bnb_file("overflow.safetensors", "[4294967296, 4294967296, 2]", 0, 0);
  {
    const memkit::safetensors::reader in(overflow);
    CHECK_THROWS_WITH_AS(q::load_linear4bit<q::NF4>(in, "w", tracker), doctest::Contains("bad quant_state"),
                         memkit::error);
  }
  // Just below int64's limit: refused by the 2^62 cap before block counts could overflow.
  const std::string near_max = write_bnb_file("near_max.safetensors", "[9223372036854775807]", 0, 0);
  {
    const memkit::safetensors::reader in(near_max);
    CHECK_THROWS_WITH_AS(q::load_linear4bit<q::NF4>(in, "w", tracker), doctest::Contains("more than 2^62 elements"),
                         memkit::error);
  }
  CHECK(tracker.peak_bytes() == 0);
  // The same writer with a consistent shape loads.
  const std::string good = write_bnb_file("good.safetensors", "[8, 16]", 64, 2);
  {
    const memkit::safetensors::reader in(good);
    const auto weight = q::load_linear4bit<q::NF4>(in, "w", tracker);
    CHECK(weight.numel() == 128);
  }
  for (const std::string& path : {huge, minus_one, overflow, near_max, good}) std::remove(path.c_str());
}

TEST_CASE("hostile ranges: offsets near INT64_MAX cannot wrap past a bounds check") {
  std::vector<float> values(256);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = std::sin(0.1f * static_cast<float>(i));
  const auto weight = q::quantized_tensor<q::NF4>::quantize(host, host_view(values.data(), {16, 16}), {64, false},
                                                            memkit::default_host_resource());
  std::vector<float> out(4);
  // first + count wrapped negative and passed `first + count <= size`.
  CHECK_THROWS_WITH_AS(weight.dequantize_range(host, int64_max - 1, host_view(out)),
                       doctest::Contains("outside the tensor's 256"), memkit::error);
  CHECK_THROWS_AS(weight.dequantize_range(host, -1, host_view(out)), memkit::error);
  std::vector<float> row(16);
  CHECK_THROWS_WITH_AS(weight.dequantize_rows(host, int64_max / 16 + 1, host_view(row)),
                       doctest::Contains("rows from row"), memkit::error);
  CHECK_THROWS_AS(weight.dequantize_rows(host, 16, host_view(row)), memkit::error);
  weight.dequantize_rows(host, 15, host_view(row));  // the last row is in range
  CHECK_THROWS_WITH_AS(q::dequantize_blockwise(host, q::format::nf4, weight.codes(), weight.absmax(), 64, int64_max - 2,
                                               host_view(out)),
                       doctest::Contains("outside the 256 values"), memkit::error);
  const auto view = host_view(values);
  CHECK_THROWS_WITH_AS(view.flat_slice(int64_max, 2), doctest::Contains("outside a view of 256"), memkit::error);
  CHECK_THROWS_AS(view.flat_slice(2, int64_max), memkit::error);
  CHECK(view.flat_slice(250, 6).size() == 6);
  // A shape whose element count overflows int64 cannot be built at all.
  CHECK_THROWS_WITH_AS((memkit::shape{std::int64_t{1} << 32, std::int64_t{1} << 32}),
                       doctest::Contains("memkit::shape: element count"), memkit::error);
}

namespace {
template <class Field>
std::string forged_image(const std::string& image, std::size_t state_bytes, std::size_t field_offset, Field value) {
  std::string forged = image;
  std::memcpy(forged.data() + memkit_test::adam_image_state_offset(forged, state_bytes) + field_offset, &value,
              sizeof value);
  memkit_test::fix_adam_image_checksum(forged, state_bytes);
  return forged;
}
}  // namespace

TEST_CASE("hostile adam_state images: every control-block field and moment is validated, naming the field") {
  using memkit::optim::adam_control;
  using memkit::optim::adam_group;
  using memkit::optim::adam_param;
  const std::vector<std::int64_t> sizes{5, 3};
  const memkit::optim::adam_options options{.loss_scaling = {.enabled = true, .initial_scale = 256.0f}};
  memkit::optim::adam_state<float> state(host, memkit::default_host_resource(), sizes, options);
  std::vector<float> p0(5, 1.0f), p1(3, 1.0f), g0(5, 0.5f), g1(3, -0.5f);
  const std::vector<adam_param<float, float>> params{{host_view(p0), host_view(g0), {}, 0},
                                                     {host_view(p1), host_view(g1), {}, 0}};
  const std::vector<adam_group> groups{adam_group{}};
  state.step(host, params, groups);
  std::stringstream saved;
  state.save(host, saved);
  const std::string image = saved.str();
  const std::size_t n = state.bytes();

  memkit::optim::adam_state<float> target(host, memkit::default_host_resource(), sizes, options);
  std::stringstream before_image;
  target.save(host, before_image);
  auto refused = [&](const std::string& forged, const std::string& expected) {
    std::stringstream in(forged);
    CHECK_THROWS_WITH_AS(target.load(host, in), doctest::Contains(expected.c_str()), memkit::error);
    std::stringstream after;
    target.save(host, after);
    CHECK(after.str() == before_image.str());  // nothing changed
  };
  // A forged step of -5 made 1 - beta2^t negative: every parameter turned NaN after one step.
  refused(forged_image(image, n, offsetof(adam_control, step), std::int64_t{-5}), "step -5");
  refused(forged_image(image, n, offsetof(adam_control, step), int64_max), "step 9223372036854775807");
  refused(forged_image(image, n, offsetof(adam_control, skipped_steps), std::int64_t{-1}), "skipped_steps -1");
  refused(forged_image(image, n, offsetof(adam_control, first_nonfinite_chunk), std::int64_t{-2}),
          "first_nonfinite_chunk -2");
  refused(forged_image(image, n, offsetof(adam_control, first_nonfinite_chunk), std::int64_t{1000}),
          "first_nonfinite_chunk 1000");
  refused(forged_image(image, n, offsetof(adam_control, grad_norm), -1.0), "grad_norm -1");
  refused(forged_image(image, n, offsetof(adam_control, loss_scale), std::numeric_limits<float>::quiet_NaN()),
          "loss_scale nan");
  refused(forged_image(image, n, offsetof(adam_control, loss_scale), 0.0f), "loss_scale 0");
  refused(forged_image(image, n, offsetof(adam_control, loss_scale), -4.0f), "loss_scale -4");
  refused(forged_image(image, n, offsetof(adam_control, loss_scale), 1e30f), "outside this state's [min_scale");
  refused(forged_image(image, n, offsetof(adam_control, good_steps), std::int32_t{-3}), "good_steps -3");
  refused(forged_image(image, n, offsetof(adam_control, good_steps), std::int32_t{5000}), "good_steps 5000");
  refused(forged_image(image, n, offsetof(adam_control, applied), std::int32_t{7}), "applied 7");
  refused(forged_image(image, n, offsetof(adam_control, grad_multiplier), std::numeric_limits<float>::infinity()),
          "grad_multiplier inf");
  // The moments: a NaN first moment, a negative second moment.
  const auto layout0 = state.tensor_state(0);
  const std::size_t m_offset = static_cast<std::size_t>(reinterpret_cast<const std::byte*>(layout0.m.data()) -
                                                        reinterpret_cast<const std::byte*>(state.arena_view().data()));
  const std::size_t v_offset = static_cast<std::size_t>(reinterpret_cast<const std::byte*>(layout0.v.data()) -
                                                        reinterpret_cast<const std::byte*>(state.arena_view().data()));
  refused(forged_image(image, n, m_offset + 8, std::numeric_limits<float>::quiet_NaN()), "tensor 0: m[2] is nan");
  refused(forged_image(image, n, v_offset + 4, -1.0f), "tensor 0: v[1] is -1");
  // The untouched image still loads and continues bit for bit.
  std::stringstream good(image);
  target.load(host, good);
  std::stringstream again;
  target.save(host, again);
  CHECK(again.str() == image);
}

TEST_CASE("hostile output: save_linear4bit refuses non-finite values, and the JSON writer never writes invalid JSON") {
  std::vector<float> values(512);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = std::cos(0.05f * static_cast<float>(i));
  auto weight = q::quantized_tensor<q::NF4>::quantize(host, host_view(values.data(), {8, 64}), {64, true},
                                                      memkit::default_host_resource());
  weight.offset_view()[0] = std::numeric_limits<float>::quiet_NaN();  // was written as "-nan" / "nan"
  memkit::safetensors::writer out;
  const std::string empty_header = out.header();
  CHECK_THROWS_WITH_AS(q::save_linear4bit(out, "w", weight), doctest::Contains("non-finite"), memkit::error);
  CHECK(out.header() == empty_header);  // nothing was added
  CHECK_THROWS_WITH_AS(memkit::json::number(std::numeric_limits<double>::quiet_NaN()),
                       doctest::Contains("NaN cannot be written"), memkit::error);
  CHECK_THROWS_WITH_AS(memkit::json::number(-std::numeric_limits<double>::infinity()),
                       doctest::Contains("Inf cannot be written"), memkit::error);
  CHECK_THROWS_WITH_AS(memkit::json::quote("a\xC0\xAF"), doctest::Contains("not valid UTF-8 (byte 1)"), memkit::error);
  CHECK(memkit::json::quote("\xE2\x82\xAC") == "\"\xE2\x82\xAC\"");
}

TEST_CASE("hostile JSON: malformed UTF-8 and numbers beyond double are refused") {
  const char* malformed[] = {
      "\"\x80\"",              // a lone continuation byte
      "\"\xC0\xAF\"",          // overlong '/'
      "\"\xC1\xBF\"",          // overlong
      "\"\xE0\x80\xAF\"",      // overlong three-byte form
      "\"\xF0\x80\x80\xAF\"",  // overlong four-byte form
      "\"\xED\xA0\x80\"",      // a UTF-16 surrogate encoded as UTF-8
      "\"\xF4\x90\x80\x80\"",  // above U+10FFFF
      "\"\xF5\x80\x80\x80\"",  // never a lead byte
      "\"\xE2\x82\"",          // truncated
      "\"\xE2\x82x\"",         // a sequence broken by ASCII
      "{\"k\xFF\": 1}",        // in a key
  };
  for (const char* text : malformed) {
    CAPTURE(text);
    CHECK_THROWS_WITH_AS(memkit::json::parse(text), doctest::Contains("invalid UTF-8"), memkit::error);
  }
  CHECK(memkit::json::parse("\"\xE2\x82\xAC \xF0\x9D\x84\x9E \xC3\xA9 \xED\x9F\xBF \xF4\x8F\xBF\xBF\"").as_string() ==
        "\xE2\x82\xAC \xF0\x9D\x84\x9E \xC3\xA9 \xED\x9F\xBF \xF4\x8F\xBF\xBF");
  CHECK_THROWS_WITH_AS(memkit::json::parse("1e999").as_double(), doctest::Contains("outside the range of a double"),
                       memkit::error);
  CHECK(memkit::json::parse("1e-999").as_double() == 0.0);
}
