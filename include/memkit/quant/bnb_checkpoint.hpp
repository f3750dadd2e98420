// memkit/quant/bnb_checkpoint.hpp — load and save a bitsandbytes 4-bit Linear weight as transformers does.
//
// For a weight key W (e.g. "model.layers.0.mlp.down_proj.weight") a safetensors checkpoint holds:
//   W                                    U8  [ceil(N*K/2), 1]   packed codes, even element in the high nibble
//   W.absmax                             F32 [blocks]           or U8 [blocks] when the scales are nested
//   W.quant_map                          F32 [16]               the NF4 / FP4 table
//   W.nested_absmax                      F32 [groups]           nested only: one per 256 blocks
//   W.nested_quant_map                   F32 [256]              nested only: the signed dynamic map
//   W.quant_state.bitsandbytes__nf4      U8  [bytes]            UTF-8 JSON: quant_type, blocksize, dtype,
//                                                               shape, and nested_blocksize, nested_dtype,
//                                                               nested_offset when nested
// Loading validates the JSON state (shape within int64, block size, dtypes) and every tensor's dtype and size
// against it before allocating anything, then reads; errors name the key at fault. Saving refuses a weight
// with a non-finite scale or offset (JSON cannot hold it) before adding anything. Host memory only.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/units.hpp"
#include "memkit/io/json.hpp"
#include "memkit/io/safetensors.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/quantized_tensor.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace quant {

// What the quant_state says besides the tensors.
struct linear4bit_state {
  std::string dtype = "bfloat16";  // the dtype of the original weight ("float32", "float16", "bfloat16")
};

namespace detail {
template <format F>
constexpr const char* bnb_type_name() noexcept {
  static_assert(F != format::int8, "bitsandbytes' Linear4bit stores NF4 or FP4");
  return F == format::nf4 ? "nf4" : "fp4";
}
template <format F>
const std::array<float, 16>& four_bit_table() noexcept {
  if constexpr (F == format::nf4) return nf4_codebook;
  else return fp4_codebook;
}
inline std::vector<std::int64_t> dims_of(const shape& s) {
  std::vector<std::int64_t> dims;
  for (int i = 0; i < s.rank; ++i) dims.push_back(s[i]);
  return dims;
}

// The quant_state JSON of a weight: json.dumps' layout and key order, so the bytes match what bitsandbytes
// writes. `nested_offset` (double quantization only) must be finite.
template <format F>
std::string linear4bit_state_json(const shape& dims, const quant_options& options, const linear4bit_state& state,
                                  float nested_offset) {
  std::string text = std::string("{\"quant_type\": \"") + bnb_type_name<F>() + "\", \"blocksize\": " +
                     std::to_string(options.block_size) + ", \"dtype\": " + json::quote(state.dtype) + ", \"shape\": [";
  for (int i = 0; i < dims.rank; ++i) {
    if (i) text += ", ";
    text += std::to_string(dims[i]);
  }
  text += "]";
  if (options.double_quant)
    text += ", \"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": " +
            json::number(static_cast<double>(nested_offset));
  text += "}";
  return text;
}
}  // namespace detail

// Adds the keys of weight `key` to `out`. The tensor must be in host-accessible memory.
template <format F>
void save_linear4bit(safetensors::writer& out, const std::string& key, const quantized_tensor<F>& weight,
                     const linear4bit_state& state = {}) {
  require(weight.where() != memory_kind::device, "save_linear4bit: '" + key + "' is in device memory; copy it to the host");
  // Checked before the first add, so a refused weight leaves `out` as it was.
  const std::string what = "save_linear4bit: '" + key + "'";
  weight.require_finite_scales(what.c_str());
  const std::int64_t blocks = weight.blocks();
  out.add(key, weight.codes(), {weight.codes().size(), 1});
  const bool nested = weight.options().double_quant;
  if (nested) out.add(key + ".absmax", weight.nested_codes(), {blocks});
  else out.add(key + ".absmax", weight.absmax(), {blocks});
  const auto& table = detail::four_bit_table<F>();
  out.add(key + ".quant_map", tensor_view<const float>(table.data(), shape{16}, memory_kind::host));
  if (nested) {
    out.add(key + ".nested_absmax", weight.nested_group_absmax());
    out.add(key + ".nested_quant_map", tensor_view<const float>(weight.nested_map().value, shape{256}, memory_kind::host));
  }
  const std::string text = detail::linear4bit_state_json<F>(weight.logical_shape(), weight.options(), state,
                                                            nested ? weight.offset_view()[0] : 0.0f);  // finite: checked above
  out.add_bytes(key + ".quant_state.bitsandbytes__" + detail::bnb_type_name<F>(), "U8",
                {static_cast<std::int64_t>(text.size())}, text.data(), text.size());
}

namespace detail {
inline constexpr std::int64_t max_linear4bit_elements = std::int64_t{1} << 62;

struct linear4bit_header {
  shape dims;
  quant_options options;
  std::string dtype;
  double nested_offset = 0;
};

// Reads and checks the JSON quant_state of weight `key`.
template <format F>
linear4bit_header read_linear4bit_state(const safetensors::reader& in, const std::string& key, const std::string& where) {
  const std::string state_key = key + ".quant_state.bitsandbytes__" + bnb_type_name<F>();
  if (in.find(state_key) == nullptr) {
    const char* other = F == format::nf4 ? "fp4" : "nf4";
    require(in.find(key + ".quant_state.bitsandbytes__" + other) == nullptr,
            where + ": the weight is " + other + ", not " + bnb_type_name<F>());
    throw error(where + ": missing key '" + state_key + "'");
  }
  const safetensors::tensor_info& state_info = in.info(state_key);
  require(state_info.dtype == "U8", where + ": '" + state_key + "' is " + state_info.dtype + ", not U8");
  const std::vector<std::uint8_t> state_bytes = in.read_vector<std::uint8_t>(state_key);
  linear4bit_header header;
  try {
    const json::value qs = json::parse(std::string(state_bytes.begin(), state_bytes.end()), "quant_state");
    require(qs.is_object(), "quant_state is not a JSON object");
    auto field = [&](const char* name) -> const json::value& {
      const json::value* v = qs.find(name);
      require(v != nullptr, "quant_state lacks \"" + std::string(name) + "\"");
      return *v;
    };
    require(field("quant_type").as_string() == bnb_type_name<F>(),
            "quant_type is \"" + field("quant_type").as_string() + "\"");
    header.options.block_size = field("blocksize").as_int();
    require(is_valid_block_size(header.options.block_size),
            "blocksize " + std::to_string(header.options.block_size) + " is not a power of two from 32 to 4096");
    const auto& extents = field("shape").as_array();
    require(!extents.empty() && extents.size() <= 4, "shape must have rank 1 to 4");
    // Rebuilt through shape's own constructor, which keeps the rank within its bounds.
    std::int64_t extent[4] = {0, 0, 0, 0};
    for (std::size_t i = 0; i < extents.size(); ++i) {
      extent[i] = extents[i].as_int();
      require(extent[i] >= 0, "negative extent in shape");
    }
    // shape's constructor refuses an element count beyond int64; the cap below keeps the block and byte
    // counts derived from it (numel + block_size - 1, ...) far from overflow. The file's tensors, checked
    // next, bound it much more tightly.
    switch (extents.size()) {
      case 1: header.dims = shape{extent[0]}; break;
      case 2: header.dims = shape{extent[0], extent[1]}; break;
      case 3: header.dims = shape{extent[0], extent[1], extent[2]}; break;
      default: header.dims = shape{extent[0], extent[1], extent[2], extent[3]}; break;
    }
    require(header.dims.numel() <= max_linear4bit_elements,
            "shape " + to_string(header.dims) + " has more than 2^62 elements");
    header.dtype = field("dtype").as_string();
    require(header.dtype == "float32" || header.dtype == "float16" || header.dtype == "bfloat16",
            "dtype \"" + header.dtype + "\" is not float32, float16 or bfloat16");
    header.options.double_quant = qs.find("nested_offset") != nullptr;
    if (header.options.double_quant) {
      require(field("nested_blocksize").as_int() == nested_block_size,
              "nested_blocksize must be 256, is " + std::to_string(field("nested_blocksize").as_int()));
      require(field("nested_dtype").as_string() == "float32", "nested_dtype must be \"float32\"");
      header.nested_offset = field("nested_offset").as_double();
    }
  } catch (const error& e) {
    throw error(where + ": bad quant_state: " + e.what());
  }
  return header;
}

// Checks that `name` exists with `dtype_name` and `numel` elements.
inline void expect_tensor(const safetensors::reader& in, const std::string& name, const char* dtype_name,
                          std::int64_t numel, const std::string& where, const linear4bit_header& header) {
  const safetensors::tensor_info* info = in.find(name);
  require(info != nullptr, where + ": missing key '" + name + "'");
  require(info->dtype == dtype_name, where + ": '" + name + "' is " + info->dtype + ", expected " + dtype_name);
  require(info->numel() == numel, where + ": '" + name + "' has " + std::to_string(info->numel()) +
                                      " elements, expected " + std::to_string(numel) + " for shape " +
                                      to_string(header.dims) + " and blocksize " +
                                      std::to_string(header.options.block_size));
}

// Every tensor the header implies, present with the right dtype and size: checked before anything is
// allocated, so a header claiming a huge shape is reported as a corrupt file, not as out of memory.
template <format F>
void expect_linear4bit_tensors(const safetensors::reader& in, const std::string& key, const std::string& where,
                               const linear4bit_header& header) {
  const std::int64_t blocks = block_count(header.dims.numel(), header.options.block_size);
  expect_tensor(in, key, "U8", code_bytes(F, header.dims.numel()), where, header);
  expect_tensor(in, key + ".quant_map", "F32", 16, where, header);
  if (header.options.double_quant) {
    expect_tensor(in, key + ".absmax", "U8", blocks, where, header);
    expect_tensor(in, key + ".nested_absmax", "F32", nested_group_count(blocks), where, header);
    expect_tensor(in, key + ".nested_quant_map", "F32", 256, where, header);
  } else {
    expect_tensor(in, key + ".absmax", "F32", blocks, where, header);
  }
}

template <format F>
void read_linear4bit_tensors(const safetensors::reader& in, const std::string& key, const std::string& where,
                             const linear4bit_header& header, quantized_tensor<F>& weight) {
  const std::int64_t blocks = weight.blocks();
  expect_linear4bit_tensors<F>(in, key, where, header);
  in.read(key, weight.codes());
  const std::vector<float> table = in.read_vector<float>(key + ".quant_map");
  for (std::size_t c = 0; c < 16; ++c)
    require(table[c] == four_bit_table<F>()[c], where + ": quant_map entry " + std::to_string(c) + " is " +
                                                    format_float(table[c], 9) + ", not the standard " +
                                                    bnb_type_name<F>() + " value " +
                                                    format_float(four_bit_table<F>()[c], 9));
  if (header.options.double_quant) {
    in.read(key + ".absmax", weight.nested_codes());
    in.read(key + ".nested_absmax", weight.nested_group_absmax());
    const std::vector<float> map = in.read_vector<float>(key + ".nested_quant_map");
    code_table<256> nested_map{};
    for (std::size_t i = 0; i < 256; ++i) {
      nested_map.value[i] = map[i];
      require(is_finite(map[i]), where + ": nested_quant_map entry " + std::to_string(i) + " is not finite");
    }
    weight.set_nested_map(nested_map);
    weight.offset_view()[0] = static_cast<float>(header.nested_offset);
    for (float a : weight.nested_group_absmax())
      require(is_finite(a), where + ": nested_absmax holds a non-finite value");
    require(is_finite(weight.offset_view()[0]), where + ": nested_offset is not finite");
  } else {
    in.read(key + ".absmax", weight.absmax());
    const std::int64_t bad = first_nonfinite(weight.absmax().data(), blocks);
    require(bad < 0, where + ": absmax of block " + std::to_string(bad) + " is not finite");
  }
}
}  // namespace detail

// Loads weight `key` from `in` into a new host tensor allocated from `resource`.
template <format F>
quantized_tensor<F> load_linear4bit(const safetensors::reader& in, const std::string& key, memory_resource& resource,
                                    linear4bit_state* state = nullptr) {
  const std::string where = "load_linear4bit: '" + key + "' in '" + in.path() + "'";
  const detail::linear4bit_header header = detail::read_linear4bit_state<F>(in, key, where);
  require(resource.kind() != memory_kind::device, where + ": load into host memory, then copy to the device");
  detail::expect_linear4bit_tensors<F>(in, key, where, header);  // before allocating
  quantized_tensor<F> weight(resource, header.dims, header.options);
  detail::read_linear4bit_tensors(in, key, where, header, weight);
  if (state) state->dtype = header.dtype;
  return weight;
}

}  // namespace quant

MEMKIT_NAMESPACE_END
