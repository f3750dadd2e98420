// memkit/distributed/consolidate.hpp — one checkpoint that a peer reads, made offline from the per-rank shard
// files of a sharded model (sharded_dense<T>::save / sharded_quantized<F>::save, or stage3_parameters::save, on
// every rank: a stage-3 unit's dense tensors are cut from the ranks' flat slices by its layout), or from the
// live shards (consolidated_export, at the end of this file: gathered tensor by tensor, one written at a time).
//
//   export_consolidated(rank_files, path, options, workspace)
//     a dense tensor    -> safetensors: its dtype and shape under its name;
//     an NF4/FP4 tensor -> bitsandbytes' serialized 4-bit layout as transformers saves it (quant/bnb_checkpoint.hpp:
//                          W, W.absmax, W.quant_map, W.nested_absmax, W.nested_quant_map,
//                          W.quant_state.bitsandbytes__nf4 / __fp4);
//   tensors in the order rank 0's file lists them, then the metadata `options.metadata` (transformers refuses
//   a file without {"format": "pt"}). The file is byte for byte what safetensors::writer writes for the
//   unsharded tensors added in that order (writer::add, quant::save_linear4bit) with that metadata.
//
// Memory: the output is streamed (safetensors::stream_writer) through one copy buffer of
// consolidate_workspace_bytes(options) = options.chunk_bytes from `workspace`; no tensor is ever whole in
// memory. Besides it: the readers' headers (already open), the names, layouts and quant_state JSON (a few
// hundred bytes a tensor) and 2 KiB of nested maps while they are compared.
//
// Everything is checked before the output is created: every rank file present once (ranks are read from the
// files' own layouts), all files of one save of one model (the same tensors, each with the same layout on
// every rank), every piece of the size its layout implies, formats and block sizes bitsandbytes can read. A
// failure while writing (a non-finite scale, which bitsandbytes' JSON cannot hold) removes the partial file.
// What the files cannot tell apart: two saves of the same model with the same layouts but different values;
// pass the files of one save.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/checked_math.hpp"
#include "memkit/core/rounded_math.hpp"
#include "memkit/distributed/sharded_adam_bytes.hpp"
#include "memkit/distributed/sharded_parameters.hpp"
#include "memkit/io/files.hpp"
#include "memkit/io/json.hpp"
#include "memkit/io/safetensors.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/bnb_checkpoint.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace distributed {

struct consolidate_options {
  std::uint64_t chunk_bytes = std::uint64_t{4} << 20;  // the copy buffer: a positive multiple of 4
  std::string original_dtype = "bfloat16";              // the 4-bit weights' quant_state "dtype"
  std::vector<std::pair<std::string, std::string>> metadata = {{"format", "pt"}};
};

// What export_consolidated takes from its workspace resource at once.
inline std::size_t consolidate_workspace_bytes(const consolidate_options& o) noexcept {
  return static_cast<std::size_t>(o.chunk_bytes);
}

struct consolidate_report {
  std::size_t tensors = 0;          // sharded tensors exported
  std::uint64_t data_bytes = 0;     // the output's data section
  int ranks = 0;                    // of the save
};

namespace detail {

// One sharded tensor of the save, from its layout (the same in every rank file, less the rank).
struct saved_tensor {
  std::string name;
  bool quantized = false;
  quant::format format = quant::format::nf4;  // quantized
  std::string dtype;                          // dense: the safetensors dtype
  std::size_t element_bytes = 0;              // dense
  shape dims{};
  quant::quant_options options{};             // quantized
  float offset = 0;                           // quantized with double quantization
};

// Whether metadata entry `key` of `image` is a shard's layout: the file holds the shard's pieces.
inline bool names_a_shard(const safetensors::reader& image, const std::string& key) {
  return image.find(key + ".values") != nullptr || image.find(key + ".codes") != nullptr;
}

// The layout of `name` as rank 0 saved it, checked for what an export needs.
inline saved_tensor parse_saved_layout(const safetensors::reader& image, const std::string& name, const std::string& text,
                                       const std::string& what) {
  const std::string where = what + ": '" + image.path() + "': the layout of '" + name + "'";
  const json::value layout = json::parse(text, image.path());
  require(layout.is_object(), where + " is not a JSON object");
  const auto field = [&](const char* key) -> const json::value& {
    const json::value* v = layout.find(key);
    require(v != nullptr, where + " has no '" + key + "'");
    return *v;
  };
  saved_tensor t;
  t.name = name;
  require(field("format").is_string(), where + ": 'format' is not a string");
  const std::string format = field("format").as_string();
  const json::value& extents = field("shape");
  require(extents.is_array() && !extents.as_array().empty() && extents.as_array().size() <= 8,
          where + ": 'shape' is not a list of 1 to 8 extents");
  t.dims.rank = static_cast<int>(extents.as_array().size());
  std::int64_t numel = 1;
  for (int i = 0; i < t.dims.rank; ++i) {
    const json::value& e = extents.as_array()[static_cast<std::size_t>(i)];
    require(e.is_number() && e.as_double() >= 0 && e.as_double() <= double(std::int64_t{1} << 40),
            where + ": extent " + std::to_string(i) + " is not an integer in 0..2^40");
    t.dims.extents[i] = e.as_int();
    const checked<std::int64_t> product = try_mul(numel, t.dims.extents[i]);
    require(product && product.value <= (std::int64_t{1} << 40), where + ": more than 2^40 elements");
    numel = product.value;
  }
  if (safetensors::dtype_size(format) != 0) {
    t.dtype = format;
    t.element_bytes = safetensors::dtype_size(format);
    return t;
  }
  require(format == "nf4" || format == "fp4",
          where + ": format '" + format + "' has no bitsandbytes 4-bit layout (a dense dtype, nf4 or fp4 is exported)");
  t.quantized = true;
  t.format = format == "nf4" ? quant::format::nf4 : quant::format::fp4;
  require(t.dims.rank <= 4, where + ": bitsandbytes' quant_state holds shapes of rank 1 to 4");
  require(field("block_size").is_number() && quant::is_valid_block_size(field("block_size").as_int()),
          where + ": block size is not a power of two in 32..4096");
  require(field("double_quant").is_bool(), where + ": 'double_quant' is not true or false");
  t.options = {field("block_size").as_int(), field("double_quant").as_bool()};
  if (t.options.double_quant) {
    const json::value& bits = field("offset_bits");
    require(bits.is_number() && bits.as_double() >= 0 && bits.as_double() <= 4294967295.0,
            where + ": 'offset_bits' is not a 32-bit pattern");
    t.offset = std::bit_cast<float>(static_cast<std::uint32_t>(bits.as_int()));
    require(::memkit::detail::is_finite(t.offset), where + ": the double-quantization offset is not finite");
  }
  return t;
}

// Copies `bytes` bytes of `piece` in `image` (from its start) to `out` through `chunk`; with `floats`, every
// value must be finite (what save_linear4bit requires of scales).
inline void stream_piece(const safetensors::reader& image, const std::string& piece, std::uint64_t bytes,
                         std::span<std::byte> chunk, safetensors::stream_writer& out, bool floats, const std::string& what,
                         std::uint64_t first = 0) {  // first: where in the piece to start
  const safetensors::tensor_info& t = image.info(piece);
  for (std::uint64_t done = 0; done < bytes;) {
    const std::uint64_t n = std::min<std::uint64_t>(chunk.size(), bytes - done);
    image.read_range(t, first + done, chunk.data(), n);
    if (floats)
      for (std::uint64_t at = 0; at < n; at += 4) {
        float value;
        std::memcpy(&value, chunk.data() + at, sizeof value);
        require(::memkit::detail::is_finite(value), what + ": '" + image.path() + "': '" + piece + "' holds a non-finite scale");
      }
    out.write(chunk.data(), n);
    done += n;
  }
}

// A stage3_parameters::save unit (format "memkit.stage3": distributed/stage3.hpp): its dense tensors live in one
// flat buffer (each padded to the 4096-element granule), rank r's file holding elements [r * shard, (r + 1) *
// shard) as "<unit>.values". Each tensor is exported whole under its own name.
struct flat_tensor {
  saved_tensor tensor;
  std::int64_t flat_offset = 0;  // of element 0 in the unit's flat buffer
};
inline bool is_stage3_unit(const safetensors::reader& image, const std::string& key) {
  const std::string* text = image.find_metadata(key);
  return text != nullptr && text->find("\"format\":\"memkit.stage3\"") != std::string::npos;
}
inline std::vector<flat_tensor> parse_stage3_unit(const safetensors::reader& image, const std::string& key,
                                                  const std::string& what, std::int64_t& flat_size_out) {
  const std::string where = what + ": '" + image.path() + "': the stage-3 unit '" + key + "'";
  const json::value layout = json::parse(*image.find_metadata(key), image.path());
  require(layout.is_object(), where + " is not a JSON object");
  const auto list = [&](const char* field) -> const std::vector<json::value>& {
    const json::value* v = layout.find(field);
    require(v != nullptr && v->is_array(), where + " has no list '" + field + "' (saved before names were recorded?)");
    return v->as_array();
  };
  const json::value* dtype = layout.find("dtype");
  require(dtype != nullptr && dtype->is_string() && safetensors::dtype_size(dtype->as_string()) != 0,
          where + ": 'dtype' is not a safetensors dtype");
  const auto& sizes = list("sizes");
  const auto& names = list("names");
  const auto& shapes = list("shapes");
  require(names.size() == sizes.size() && shapes.size() == sizes.size(),
          where + ": " + std::to_string(sizes.size()) + " sizes, " + std::to_string(names.size()) + " names, " +
              std::to_string(shapes.size()) + " shapes");
  std::vector<flat_tensor> out;
  std::int64_t flat = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    require(names[i].is_string() && !names[i].as_string().empty(), where + ": name " + std::to_string(i) + " is not a string");
    require(sizes[i].is_number() && sizes[i].as_double() >= 1 && sizes[i].as_double() <= double(std::int64_t{1} << 40),
            where + ": size " + std::to_string(i) + " is not an integer in 1..2^40");
    require(shapes[i].is_array() && !shapes[i].as_array().empty() && shapes[i].as_array().size() <= 8,
            where + ": shape " + std::to_string(i) + " is not a list of 1 to 8 extents");
    flat_tensor t;
    t.tensor.name = names[i].as_string();
    t.tensor.dtype = dtype->as_string();
    t.tensor.element_bytes = safetensors::dtype_size(t.tensor.dtype);
    t.tensor.dims.rank = static_cast<int>(shapes[i].as_array().size());
    std::int64_t numel = 1;
    for (int d = 0; d < t.tensor.dims.rank; ++d) {
      const json::value& e = shapes[i].as_array()[static_cast<std::size_t>(d)];
      require(e.is_number() && e.as_double() >= 0 && e.as_double() <= double(std::int64_t{1} << 40),
              where + ": an extent of shape " + std::to_string(i) + " is not an integer in 0..2^40");
      t.tensor.dims.extents[d] = e.as_int();
      const checked<std::int64_t> product = try_mul(numel, e.as_int());
      require(product && product.value <= (std::int64_t{1} << 40), where + ": more than 2^40 elements");
      numel = product.value;
    }
    require(numel == sizes[i].as_int(), where + ": '" + t.tensor.name + "' has shape of " + std::to_string(numel) +
                                            " elements and size " + sizes[i].number_text());
    t.flat_offset = flat;
    flat += sharded_adam_layout<float>::padded(numel);
    out.push_back(std::move(t));
  }
  flat_size_out = flat;
  return out;
}

// Declares the output keys of `t` (see the header): for a 4-bit tensor bitsandbytes' keys, in
// save_linear4bit's order; returns the quant_state JSON to write last ("" for a dense tensor).
inline std::string declare_output(safetensors::stream_writer& out, const saved_tensor& t, const consolidate_options& options) {
  std::vector<std::int64_t> dims(t.dims.extents, t.dims.extents + t.dims.rank);
  if (!t.quantized) {
    out.declare(t.name, t.dtype, dims);
    return {};
  }
  const std::int64_t blocks = quant::block_count(t.dims.numel(), t.options.block_size);
  out.declare(t.name, "U8", {quant::code_bytes(t.format, t.dims.numel()), 1});
  out.declare(t.name + ".absmax", t.options.double_quant ? "U8" : "F32", {blocks});
  out.declare(t.name + ".quant_map", "F32", {16});
  if (t.options.double_quant) {
    out.declare(t.name + ".nested_absmax", "F32", {quant::nested_group_count(blocks)});
    out.declare(t.name + ".nested_quant_map", "F32", {256});
  }
  const quant::linear4bit_state state{options.original_dtype};
  const bool nf4 = t.format == quant::format::nf4;
  std::string json = nf4 ? quant::detail::linear4bit_state_json<quant::NF4>(t.dims, t.options, state, t.offset)
                         : quant::detail::linear4bit_state_json<quant::FP4>(t.dims, t.options, state, t.offset);
  out.declare(t.name + ".quant_state.bitsandbytes__" + (nf4 ? "nf4" : "fp4"), "U8", {static_cast<std::int64_t>(json.size())});
  return json;
}

inline const std::array<float, 16>& four_bit_table(quant::format f) noexcept {
  return f == quant::format::nf4 ? quant::detail::four_bit_table<quant::NF4>() : quant::detail::four_bit_table<quant::FP4>();
}

}  // namespace detail

// Writes `path` from the shard files of every rank of one save (any order). See the header.
inline consolidate_report export_consolidated(std::span<const safetensors::reader* const> rank_files,
                                              const std::string& path, const consolidate_options& options,
                                              memory_resource& workspace) {
  const std::string what = "export_consolidated('" + path + "')";
  require(options.chunk_bytes > 0 && options.chunk_bytes % 4 == 0 && options.chunk_bytes <= (std::uint64_t{1} << 40),
          what + ": chunk_bytes must be a positive multiple of 4");
  require(!rank_files.empty(), what + ": no rank files");
  require(workspace.kind() != memory_kind::device, what + ": the copy buffer (workspace) must be host memory");
  for (const safetensors::reader* image : rank_files) require(image != nullptr, what + ": a null rank file");

  // The tensors, in the order the first file lists them; every file must list the same ones.
  const auto shard_names = [&](const safetensors::reader& image) {
    std::vector<std::string> names;
    for (const auto& entry : image.metadata())
      if (detail::names_a_shard(image, entry.first)) names.push_back(entry.first);
    return names;
  };
  const std::vector<std::string> names = shard_names(*rank_files[0]);
  require(!names.empty(), what + ": '" + rank_files[0]->path() + "' holds no shards");
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  for (const safetensors::reader* image : rank_files) {
    std::vector<std::string> mine = shard_names(*image);
    std::sort(mine.begin(), mine.end());
    if (mine == sorted) continue;
    std::vector<std::string> only_first, only_mine;
    std::set_difference(sorted.begin(), sorted.end(), mine.begin(), mine.end(), std::back_inserter(only_first));
    std::set_difference(mine.begin(), mine.end(), sorted.begin(), sorted.end(), std::back_inserter(only_mine));
    throw error(what + ": '" + image->path() + "' and '" + rank_files[0]->path() +
                "' hold shards of different tensors (files of different models?): " +
                (only_first.empty() ? "'" + only_mine[0] + "' is only in the first"
                                    : "'" + only_first[0] + "' is only in the second"));
  }

  // Each tensor: every rank once, one layout, pieces of the sizes it implies.
  struct planned {
    detail::saved_tensor tensor;
    std::vector<const safetensors::reader*> by_rank;
    std::string unit;  // a stage-3 unit's tensor: the unit's key ("" otherwise), its flat offset and shard size
    std::int64_t flat_offset = 0, shard_elements = 0;
  };
  std::vector<planned> plan;
  plan.reserve(names.size());
  for (const std::string& name : names) {
    planned p;
    p.by_rank = detail::order_images(rank_files, name, what);  // ranks from the layouts; each rank once
    const std::string agreed = detail::layout_without_rank(*p.by_rank[0], name);
    for (const safetensors::reader* image : p.by_rank)
      require(detail::layout_without_rank(*image, name) == agreed,
              what + ": '" + image->path() + "' and '" + p.by_rank[0]->path() + "' hold different layouts of '" + name +
                  "' (files of different models or saves?)");
    if (detail::is_stage3_unit(*p.by_rank[0], name)) {
      // A stage-3 unit: its tensors, each whole under its name, from the ranks' flat slices.
      std::int64_t logical = 0;
      const std::vector<detail::flat_tensor> tensors = detail::parse_stage3_unit(*p.by_rank[0], name, what, logical);
      std::vector<std::int64_t> sizes;
      for (const detail::flat_tensor& t : tensors) sizes.push_back(t.tensor.dims.numel());
      const int unit_ranks = static_cast<int>(p.by_rank.size());
      const std::int64_t shard = sizes.empty() ? 0 : sharded_adam_layout<float>::shard_size(sizes, unit_ranks);
      const std::uint64_t bytes =
          static_cast<std::uint64_t>(shard) * (tensors.empty() ? 0 : tensors.front().tensor.element_bytes);
      for (const safetensors::reader* image : p.by_rank) {
        const safetensors::tensor_info* t = image->find(name + ".values");
        require(t != nullptr && t->dtype == "U8" && t->bytes() == bytes,
                what + ": '" + image->path() + "': '" + name + ".values' is missing or not " + std::to_string(bytes) +
                    " bytes of U8, as its layout implies");
      }
      for (const detail::flat_tensor& t : tensors) {
        planned q;
        q.tensor = t.tensor;
        q.by_rank = p.by_rank;
        q.unit = name;
        q.flat_offset = t.flat_offset;
        q.shard_elements = shard;
        plan.push_back(std::move(q));
      }
      continue;
    }
    p.tensor = detail::parse_saved_layout(*p.by_rank[0], name, *p.by_rank[0]->find_metadata(name), what);  // present: order_images
    const int ranks = static_cast<int>(p.by_rank.size());
    std::vector<std::pair<const char*, std::uint64_t>> pieces;
    if (!p.tensor.quantized) {
      pieces.emplace_back(".values", dense_shard_bytes(p.tensor.dims, p.tensor.element_bytes, ranks));
    } else {
      const quantized_shard_pieces q = quantized_shard_pieces_of(p.tensor.format, p.tensor.dims, p.tensor.options, ranks);
      pieces = {{".codes", q.codes}, {".scales", q.scales}, {".groups", q.groups}, {".nested_map", 256 * 4}};
    }
    for (const safetensors::reader* image : p.by_rank)
      for (const auto& [suffix, bytes] : pieces) {
        const safetensors::tensor_info* t = image->find(name + suffix);
        require(t != nullptr && t->dtype == "U8" && t->bytes() == bytes,
                what + ": '" + image->path() + "': '" + name + suffix + "' is missing or not " + std::to_string(bytes) +
                    " bytes of U8, as its layout implies");
      }
    if (p.tensor.quantized && p.tensor.options.double_quant) {
      // The nested map: finite, and every rank's copy the same (a rank's file from another quantization otherwise).
      float map[256], other[256];
      p.by_rank[0]->read_bytes(name + ".nested_map", map, sizeof map);
      for (float v : map) require(::memkit::detail::is_finite(v), what + ": '" + name + "': the nested map holds a non-finite value");
      for (const safetensors::reader* image : p.by_rank) {
        image->read_bytes(name + ".nested_map", other, sizeof other);
        require(std::memcmp(map, other, sizeof map) == 0, what + ": '" + image->path() + "' and '" + p.by_rank[0]->path() +
                                                              "' hold different nested maps of '" + name + "'");
      }
    }
    plan.push_back(std::move(p));
  }

  // The output's tensors, declared (and their names checked) before the file exists.
  const int ranks = static_cast<int>(rank_files.size());
  safetensors::stream_writer out;
  for (const auto& [key, value] : options.metadata) out.add_metadata(key, value);
  std::vector<std::string> states;  // each tensor's quant_state JSON ("" when dense)
  for (const planned& p : plan) states.push_back(detail::declare_output(out, p.tensor, options));

  buffer<std::byte> chunk(workspace, shape{static_cast<std::int64_t>(options.chunk_bytes)});
  const std::span<std::byte> copy(chunk.data(), static_cast<std::size_t>(options.chunk_bytes));
  io::write_via_temporary(path, what, [&](const std::string& temporary) {
    out.open(temporary);
    for (std::size_t i = 0; i < plan.size(); ++i) {
      const planned& p = plan[i];
      const detail::saved_tensor& t = p.tensor;
      if (!p.unit.empty()) {
        // Rank r holds flat elements [r * shard, (r + 1) * shard) of the unit: the tensor's part of each, in order.
        const std::int64_t begin = p.flat_offset, end = begin + t.dims.numel();
        for (int r = 0; r < ranks; ++r) {
          const std::int64_t low = std::max(begin, r * p.shard_elements), high = std::min(end, (r + 1) * p.shard_elements);
          if (low >= high) continue;
          detail::stream_piece(*p.by_rank[static_cast<std::size_t>(r)], p.unit + ".values",
                               static_cast<std::uint64_t>(high - low) * t.element_bytes, copy, out, false, what,
                               static_cast<std::uint64_t>(low - r * p.shard_elements) * t.element_bytes);
        }
        continue;
      }
      if (!t.quantized) {
        const shard_layout l = dense_shard_layout(t.dims, ranks);
        for (int r = 0; r < ranks; ++r)
          detail::stream_piece(*p.by_rank[static_cast<std::size_t>(r)], t.name + ".values",
                               static_cast<std::uint64_t>(l.count(r)) * t.element_bytes, copy, out, false, what);
        continue;
      }
      // Each rank's pieces hold its elements [first, first + count) in whole units, so the tensor's codes,
      // block scales and group scales are the ranks' prefixes of valid bytes in rank order.
      const shard_layout l = quantized_shard_layout(t.dims, t.options, ranks);
      const std::int64_t B = t.options.block_size;
      const auto each_rank = [&](const char* suffix, bool floats, auto valid_bytes) {
        for (int r = 0; r < ranks; ++r)
          detail::stream_piece(*p.by_rank[static_cast<std::size_t>(r)], t.name + suffix,
                               static_cast<std::uint64_t>(valid_bytes(l.count(r))), copy, out, floats, what);
      };
      each_rank(".codes", false, [&](std::int64_t count) { return quant::code_bytes(t.format, count); });
      if (t.options.double_quant) each_rank(".scales", false, [&](std::int64_t count) { return quant::block_count(count, B); });
      else each_rank(".scales", true, [&](std::int64_t count) { return 4 * quant::block_count(count, B); });
      out.write(detail::four_bit_table(t.format).data(), sizeof(float) * 16);
      if (t.options.double_quant) {
        each_rank(".groups", true, [&](std::int64_t count) {
          return 4 * quant::nested_group_count(quant::block_count(count, B));
        });
        float map[256];  // checked above: finite, the same on every rank
        p.by_rank[0]->read_bytes(t.name + ".nested_map", map, sizeof map);
        out.write(map, sizeof map);
      }
      out.write(states[i].data(), states[i].size());
    }
    out.close();
  });
  return {plan.size(), out.data_bytes(), ranks};
}


// ---- live: from a sharded model in memory ---------------------------------------------------------------

// The same file from the shards themselves, without rank files: every rank makes one consolidated_export,
// add()s the same tensors in the same order and calls write(); each tensor in turn is gathered on every rank
// (the all_gather is collective) into a buffer from `gathered`, and rank `writer_rank` streams it into `path`
// through its copy buffer, then the buffer is released. So no rank ever holds more than one whole tensor:
// per rank, write() takes at most bytes_required() = the largest tensor whole (quantized_tensor_bytes or
// numel x element size) plus its gather's staging (gather_workspace_bytes), and on the writer the copy
// buffer (consolidate_workspace_bytes). Device memory works too (the writer copies it out a chunk at a
// time; compiled under nvcc, tested on the host). The shards must outlive write().
template <executor E, class C>
class consolidated_export {
 public:
  consolidated_export(const E& exec, const C& comm, consolidate_options options = {}, int writer_rank = 0)
      : exec_(exec), comm_(&comm), options_(std::move(options)), writer_rank_(writer_rank) {
    detail::check_rank("consolidated_export: writer", writer_rank, comm.size());
  }

  template <class T>
  void add(const std::string& name, const sharded_dense<T>& shard) {
    detail::saved_tensor t;
    t.name = name;
    t.dtype = safetensors::dtype_of<T>();
    t.element_bytes = sizeof(T);
    t.dims = shard.logical_shape();
    const std::size_t whole = static_cast<std::size_t>(t.dims.numel()) * sizeof(T);
    note(whole + sharded_dense<T>::gather_workspace_bytes(t.dims, comm_->size()));
    tensors_.push_back(std::move(t));
    gathers_.push_back([this, &shard](safetensors::stream_writer* out, std::span<std::byte> chunk, memory_resource& gathered,
                                      memory_resource& workspace) {
      buffer<T> whole_tensor(gathered, shard.logical_shape());
      shard.gather(exec_, *comm_, whole_tensor.view(), workspace);
      if constexpr (E::on_device) exec_.synchronize();
      if (out != nullptr) emit(*out, whole_tensor.data(), whole_tensor.bytes(), chunk);
    });
  }

  template <quant::format F>
  void add(const std::string& name, const sharded_quantized<F>& shard) {
    static_assert(F != quant::format::int8, "bitsandbytes' 4-bit layout holds NF4 or FP4");
    detail::saved_tensor t;
    t.name = name;
    t.quantized = true;
    t.format = F;
    t.dims = shard.logical_shape();
    t.options = shard.options();
    t.offset = shard.nested_offset();
    require(quant::is_valid_block_size(t.options.block_size) && t.dims.rank <= 4,
            "consolidated_export: '" + name + "': bitsandbytes reads blocks of 32..4096 and shapes of rank 1 to 4");
    require(!t.options.double_quant || ::memkit::detail::is_finite(t.offset),
            "consolidated_export: '" + name + "': the double-quantization offset is not finite");
    note(quant::quantized_tensor_bytes(F, t.dims, t.options) +
         sharded_quantized<F>::gather_workspace_bytes(t.dims, t.options, comm_->size()));
    tensors_.push_back(std::move(t));
    gathers_.push_back([this, &shard, name](safetensors::stream_writer* out, std::span<std::byte> chunk,
                                            memory_resource& gathered, memory_resource& workspace) {
      quant::quantized_tensor<F> whole(gathered, shard.logical_shape(), shard.options());
      shard.gather(exec_, *comm_, whole, workspace);
      // Every rank checks the same gathered scales, so a non-finite one stops all ranks together.
      if constexpr (E::on_device) {
#if MEMKIT_HAS_CUDA
        whole.require_finite(exec_, name.c_str());
#endif
      } else {
        whole.require_finite_scales(name.c_str());
      }
      if (out == nullptr) return;
      const bool nested = shard.options().double_quant;
      emit(*out, whole.codes().data(), whole.codes().bytes(), chunk);
      if (nested) emit(*out, whole.nested_codes().data(), whole.nested_codes().bytes(), chunk);
      else emit(*out, whole.absmax().data(), whole.absmax().bytes(), chunk);
      out->write(detail::four_bit_table(F).data(), sizeof(float) * 16);
      if (nested) {
        emit(*out, whole.nested_group_absmax().data(), whole.nested_group_absmax().bytes(), chunk);
        out->write(whole.nested_map().value, sizeof(whole.nested_map().value));
      }
    });
  }

  // The most write() takes at once on any rank from `gathered` and `staging` together (the largest tensor
  // whole and its gather's staging); the writer takes its copy buffer (consolidate_workspace_bytes) from
  // `host` besides.
  std::size_t bytes_required() const noexcept { return largest_; }

  // Every rank calls it (the gathers are collective): whole tensors from `gathered`, the gathers' staging
  // from `staging` (both memory the executor and the communicator use), the writer's copy buffer from
  // `host` (host memory; on the host executor it may be the same resource). A failure on one rank alone
  // (the writer's disk) leaves the others waiting in the next gather, as any collective does; a non-finite
  // scale is seen by every rank, which all throw.
  consolidate_report write(const std::string& path, memory_resource& gathered, memory_resource& staging,
                           memory_resource& host) {
    const std::string what = "consolidated_export::write('" + path + "')";
    require(options_.chunk_bytes > 0 && options_.chunk_bytes % 4 == 0 && options_.chunk_bytes <= (std::uint64_t{1} << 40),
            what + ": chunk_bytes must be a positive multiple of 4");
    require(!tensors_.empty(), what + ": no tensors added");
    require(host.kind() != memory_kind::device, what + ": the copy buffer must be host memory");
    const bool writer = comm_->rank() == writer_rank_;
    safetensors::stream_writer out;
    for (const auto& [key, value] : options_.metadata) out.add_metadata(key, value);
    std::vector<std::string> states;
    for (const detail::saved_tensor& t : tensors_) states.push_back(detail::declare_output(out, t, options_));
    if (!writer) {
      for (auto& gather : gathers_) gather(nullptr, {}, gathered, staging);
      return {tensors_.size(), out.data_bytes(), comm_->size()};
    }
    buffer<std::byte> chunk(host, shape{static_cast<std::int64_t>(options_.chunk_bytes)});
    const std::span<std::byte> copy(chunk.data(), static_cast<std::size_t>(options_.chunk_bytes));
    io::write_via_temporary(path, what, [&](const std::string& temporary) {
      out.open(temporary);
      for (std::size_t i = 0; i < gathers_.size(); ++i) {
        gathers_[i](&out, copy, gathered, staging);
        out.write(states[i].data(), states[i].size());  // "" for a dense tensor
      }
      out.close();
    });
    return {tensors_.size(), out.data_bytes(), comm_->size()};
  }

 private:
  void note(std::size_t bytes) noexcept { largest_ = std::max(largest_, bytes); }
  // Host or device bytes to the file through the (host) copy buffer.
  static void emit(safetensors::stream_writer& out, const void* data, std::size_t bytes, std::span<std::byte> chunk) {
    const std::byte* from = static_cast<const std::byte*>(data);
    for (std::size_t done = 0; done < bytes;) {
      const std::size_t n = std::min(chunk.size(), bytes - done);
      detail::copy_setup(chunk.data(), from + done, n);
      out.write(chunk.data(), n);
      done += n;
    }
  }

  E exec_;
  const C* comm_;
  consolidate_options options_;
  int writer_rank_;
  std::vector<detail::saved_tensor> tensors_;
  std::vector<std::function<void(safetensors::stream_writer*, std::span<std::byte>, memory_resource&, memory_resource&)>> gathers_;
  std::size_t largest_ = 0;
};

}  // namespace distributed
MEMKIT_NAMESPACE_END
