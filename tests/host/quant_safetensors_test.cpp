// safetensors reading and writing, corrupt files, the strict JSON reader, and bitsandbytes Linear4bit
// checkpoints round-tripping through them.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "memkit/io/json.hpp"
#include "memkit/io/safetensors.hpp"
#include "memkit/memory/tracking.hpp"
#include "memkit/quant/bnb_checkpoint.hpp"
#include "support/test_values.hpp"

namespace q = memkit::quant;
namespace st = memkit::safetensors;
using memkit::host;
using memkit::host_view;

namespace {

// A file in the temp directory, removed at scope exit.
struct temp_file {
  std::string path;
  explicit temp_file(const std::string& stem)
      : path("/tmp/memkit_test_" + stem + "_" + std::to_string(::getpid()) + ".safetensors") {}
  ~temp_file() { std::remove(path.c_str()); }
};

void write_raw(const std::string& path, const std::string& header, const std::string& data,
               std::uint64_t claimed_size = ~std::uint64_t{0}) {
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t size = claimed_size == ~std::uint64_t{0} ? header.size() : claimed_size;
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(size >> (8 * i)));
  out << header << data;
}

std::string open_error(const std::string& path) {
  try {
    st::reader r(path);
  } catch (const memkit::error& e) {
    return e.what();
  }
  return "(opened)";
}

using memkit_test::standard_normal;

}  // namespace

TEST_CASE("json: strict parsing of valid and invalid documents") {
  const memkit::json::value v = memkit::json::parse(R"( {"a": [1, -2.5e3, true, null], "b": "x\u00e9\ud83d\ude00\n"} )");
  CHECK(v.at("a").as_array()[0].as_int() == 1);
  CHECK(v.at("a").as_array()[1].as_double() == -2500.0);
  CHECK(v.at("a").as_array()[2].as_bool());
  CHECK(v.at("a").as_array()[3].is_null());
  CHECK(v.at("b").as_string() == "x\xc3\xa9\xf0\x9f\x98\x80\n");
  CHECK(memkit::json::parse("9007199254740993").as_int() == 9007199254740993);  // exact, not via double
  const char* invalid[] = {"", "{", "{\"a\":1,}", "[1,]", "{\"a\":1 \"b\":2}", "{\"a\":1,\"a\":2}", "01", "1.",
                           "-", "\"\\x\"", "\"a\nb\"", "\"\\ud800\"", "tru", "{} {}", "[1] x", "{'a':1}", "1e"};
  for (const char* text : invalid) {
    CAPTURE(text);
    CHECK_THROWS_AS(memkit::json::parse(text), memkit::error);
  }
  CHECK_THROWS_WITH_AS(memkit::json::parse("{\"a\":1,\"a\":2}", "hdr"), doctest::Contains("hdr: invalid JSON at byte"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(memkit::json::parse("12.5").as_int(), doctest::Contains("not an integer"), memkit::error);
  CHECK(memkit::json::parse(memkit::json::quote("a\"b\\c\x01")).as_string() == "a\"b\\c\x01");
  for (double d : {0.1, 1.0 / 3.0, 1e-30, 0.012299999594688416, -5.0})
    CHECK(memkit::json::parse(memkit::json::number(d)).as_double() == d);
}

TEST_CASE("safetensors: write and read back, one tensor at a time, with metadata") {
  temp_file file("roundtrip");
  const std::vector<float> a = standard_normal(6, 1);
  std::vector<memkit::bf16> b;
  for (float v : standard_normal(5, 2)) b.emplace_back(v);
  const std::vector<std::uint8_t> c = {1, 2, 3};
  st::writer w;
  w.add("a", host_view(a.data(), {2, 3}));
  w.add("b", host_view(b.data(), {5}));
  w.add("empty", host_view(c.data(), {0}));
  w.add("c", host_view(c.data(), {3}));
  w.add_metadata("format", "pt");
  w.write(file.path);
  CHECK((8 + w.header().size()) % 8 == 0);

  const st::reader r(file.path);
  CHECK(r.tensors().size() == 4);
  CHECK(r.metadata() == std::vector<std::pair<std::string, std::string>>{{"format", "pt"}});
  REQUIRE(r.find_metadata("format") != nullptr);
  CHECK(*r.find_metadata("format") == "pt");
  CHECK(r.find_metadata("form") == nullptr);
  CHECK(r.info("a").shape == std::vector<std::int64_t>{2, 3});
  CHECK(r.info("a").dtype == "F32");
  CHECK(r.read_vector<float>("a") == a);
  const std::vector<memkit::bf16> b2 = r.read_vector<memkit::bf16>("b");
  for (std::size_t i = 0; i < b.size(); ++i) CHECK(b2[i].bits == b[i].bits);
  CHECK(r.read_vector<std::uint8_t>("c") == c);
  CHECK(r.read_vector<std::uint8_t>("empty").empty());
  std::vector<float> wrong(5);
  CHECK_THROWS_WITH_AS(r.read("a", host_view(wrong)), doctest::Contains("has 6 elements, the destination 5"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(r.read_vector<float>("b"), doctest::Contains("is BF16, not F32"), memkit::error);
  CHECK_THROWS_WITH_AS(r.info("zzz"), doctest::Contains("no tensor named 'zzz'"), memkit::error);
  CHECK_THROWS_WITH_AS(r.read_vector<float>("zzz"), doctest::Contains("no tensor named 'zzz'"), memkit::error);
}

TEST_CASE("safetensors: corrupt and truncated files name the problem") {
  temp_file file("corrupt");
  const std::string four = std::string(4, '\0');
  struct corrupt_case {
    const char* header;
    std::string data;
    const char* problem;
  } cases[] = {
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(4, '\0'), "truncated"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(12, '\0'), "trailing bytes"},
      {R"({"t":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", four, "unknown dtype 'F33'"},
      {R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", four, "negative extent"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", four, "spans 4 bytes but F32 of its shape needs 8"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", four, "end before begin"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"u":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       four, "(overlap)"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0'), "(gap)"},
      {R"({"t":{"dtype":"F32","shape":[1]}})", four, "lacks data_offsets"},
      {R"({"t":{"shape":[1],"data_offsets":[0,4]}})", four, "lacks a string dtype"},
      {R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", four, "not an integer"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})", four, "unknown field 'extra'"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},})", four, "invalid JSON"},
      {R"({"t":1})", "", "is not an object"},
      {R"({"__metadata__":{"k":1}})", "", "__metadata__ value of 'k' is not a string"},
      {R"([1,2])", "", "does not start with '{'"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       four, "duplicate key"},
  };
  for (const corrupt_case& c : cases) {
    CAPTURE(c.header);
    write_raw(file.path, c.header, c.data);
    const std::string message = open_error(file.path);
    CAPTURE(message);
    CHECK(message.find(c.problem) != std::string::npos);
    CHECK(message.find(file.path) != std::string::npos);
  }
  // The size field itself: larger than the file, absurdly large, and a file too short to hold it.
  write_raw(file.path, "{}", "", 1000);
  CHECK(open_error(file.path).find("runs past the end") != std::string::npos);
  write_raw(file.path, "{}", "", std::uint64_t{1} << 40);
  CHECK(open_error(file.path).find("exceeds the 100 MB limit") != std::string::npos);
  {
    std::ofstream out(file.path, std::ios::binary);
    out << "abc";
  }
  CHECK(open_error(file.path).find("shorter than the 8-byte header size") != std::string::npos);
  CHECK(open_error("/nonexistent/memkit.safetensors").find("cannot open") != std::string::npos);
  // A valid file cut short loses its last tensor: caught when the header is checked against the size.
  st::writer w;
  const std::vector<float> values(100, 1.0f);
  w.add("x", host_view(values.data(), {100}));
  w.write(file.path);
  REQUIRE(::truncate(file.path.c_str(), static_cast<off_t>(8 + w.header().size() + 200)) == 0);
  CHECK(open_error(file.path).find("truncated") != std::string::npos);
}

TEST_CASE("bitsandbytes Linear4bit: save and load round-trip, keys and quant_state as transformers writes them") {
  temp_file file("linear4bit");
  const memkit::shape dims{96, 200};
  const std::vector<float> data = standard_normal(dims.numel(), 5);
  memkit::tracking_resource tracker(memkit::default_host_resource(), "ckpt");
  const auto nf4 = q::quantized_tensor<q::NF4>::quantize(host, host_view(data.data(), dims), {64, true}, tracker);
  const auto fp4 = q::quantized_tensor<q::FP4>::quantize(host, host_view(data.data(), dims), {128, false}, tracker);
  st::writer w;
  q::save_linear4bit(w, "model.layers.0.mlp.down_proj.weight", nf4, {"bfloat16"});
  q::save_linear4bit(w, "lm_head.weight", fp4, {"float16"});
  w.write(file.path);

  const st::reader r(file.path);
  const std::string k = "model.layers.0.mlp.down_proj.weight";
  CHECK(r.info(k).dtype == "U8");
  CHECK(r.info(k).shape == std::vector<std::int64_t>{96 * 200 / 2, 1});
  CHECK(r.info(k + ".absmax").dtype == "U8");  // nested: the scales are uint8 codes
  CHECK(r.info(k + ".absmax").numel() == 300);
  CHECK(r.info(k + ".quant_map").numel() == 16);
  CHECK(r.info(k + ".nested_absmax").numel() == 2);
  CHECK(r.info(k + ".nested_quant_map").numel() == 256);
  CHECK(r.info("lm_head.weight.absmax").dtype == "F32");
  CHECK(r.find("lm_head.weight.nested_absmax") == nullptr);
  const std::vector<std::uint8_t> state_bytes = r.read_vector<std::uint8_t>(k + ".quant_state.bitsandbytes__nf4");
  const std::string state(state_bytes.begin(), state_bytes.end());
  CHECK(state.rfind(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [96, 200], )"
                    R"("nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": )", 0) == 0);
  CHECK(static_cast<float>(memkit::json::parse(state).at("nested_offset").as_double()) == nf4.offset_view()[0]);

  q::linear4bit_state loaded_state;
  const auto nf4_back = q::load_linear4bit<q::NF4>(r, k, tracker, &loaded_state);
  CHECK(loaded_state.dtype == "bfloat16");
  CHECK(nf4_back.logical_shape() == dims);
  CHECK(nf4_back.options().block_size == 64);
  CHECK(nf4_back.options().double_quant);
  std::vector<float> original(static_cast<std::size_t>(dims.numel())), restored(original.size());
  nf4.dequantize(host, host_view(original));
  nf4_back.dequantize(host, host_view(restored));
  CHECK(original == restored);
  const auto fp4_back = q::load_linear4bit<q::FP4>(r, "lm_head.weight", tracker);
  fp4.dequantize(host, host_view(original));
  fp4_back.dequantize(host, host_view(restored));
  CHECK(original == restored);

  CHECK_THROWS_WITH_AS(q::load_linear4bit<q::FP4>(r, k, tracker), doctest::Contains("the weight is nf4, not fp4"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(q::load_linear4bit<q::NF4>(r, "nope.weight", tracker),
                       doctest::Contains("missing key 'nope.weight.quant_state.bitsandbytes__nf4'"), memkit::error);
}

TEST_CASE("bitsandbytes Linear4bit: inconsistent checkpoints are rejected naming the key") {
  temp_file file("linear4bit_bad");
  const memkit::shape dims{8, 64};
  const std::vector<float> data = standard_normal(dims.numel(), 6);
  const auto w4 = q::quantized_tensor<q::NF4>::quantize(host, host_view(data.data(), dims), {64, false},
                                                        memkit::default_host_resource());
  auto save_with_state = [&](const std::string& json, bool bad_map = false) {
    st::writer w;
    w.add("w", w4.codes(), {256, 1});
    w.add("w.absmax", w4.absmax());
    std::array<float, 16> map = q::nf4_codebook;
    if (bad_map) map[3] += 1e-3f;
    w.add("w.quant_map", memkit::tensor_view<const float>(map.data(), {16}, memkit::memory_kind::host));
    w.add_bytes("w.quant_state.bitsandbytes__nf4", "U8", {static_cast<std::int64_t>(json.size())}, json.data(), json.size());
    w.write(file.path);
  };
  auto load_error = [&]() -> std::string {
    try {
      st::reader r(file.path);
      (void)q::load_linear4bit<q::NF4>(r, "w", memkit::default_host_resource());
    } catch (const memkit::error& e) {
      return e.what();
    }
    return "(loaded)";
  };
  save_with_state(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [8, 64]})");
  CHECK(load_error() == "(loaded)");
  save_with_state(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [8, 65]})");
  CHECK(load_error().find("'w' has 256 elements, expected 260") != std::string::npos);
  save_with_state(R"({"quant_type": "nf4", "blocksize": 32, "dtype": "bfloat16", "shape": [8, 64]})");
  CHECK(load_error().find("'w.absmax' has 8 elements, expected 16") != std::string::npos);
  save_with_state(R"({"quant_type": "nf4", "blocksize": 48, "dtype": "bfloat16", "shape": [8, 64]})");
  CHECK(load_error().find("blocksize 48") != std::string::npos);
  save_with_state(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16"})");
  CHECK(load_error().find("quant_state lacks \"shape\"") != std::string::npos);
  save_with_state(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "int8", "shape": [8, 64]})");
  CHECK(load_error().find("dtype \"int8\"") != std::string::npos);
  save_with_state(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [8, 64]} x)");
  CHECK(load_error().find("bad quant_state") != std::string::npos);
  save_with_state(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [8, 64]})", true);
  CHECK(load_error().find("quant_map entry 3") != std::string::npos);
  // Both values to 9 digits, so a map that differs only in its last bits does not print as the standard one.
  CHECK(load_error().find(", not the standard nf4 value " + memkit::format_float(q::nf4_value(3), 9)) != std::string::npos);
  save_with_state(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [8, 64], "nested_offset": 0.5, )"
                  R"("nested_blocksize": 256, "nested_dtype": "float32"})");
  CHECK(load_error().find("'w.absmax' is F32, expected U8") != std::string::npos);
}
