// memkit/distributed/sharded_parameters.hpp — parameters split across ranks (ZeRO stage 3 / FSDP), dense
// or blockwise-quantized, and gathered whole for the layer that runs next.
//
//   shard_layout                 how a tensor of N elements splits: whole units, the same count per rank
//   sharded_dense<T>             rank r's slice of a dense tensor; gather() rebuilds the whole tensor
//   sharded_quantized<F>         rank r's slice of a quantized_tensor<F> (codes, block scales, and with double
//                                quantization the nested codes and group scales); gather() rebuilds the
//                                tensor bit for bit
//
// Units: one element of a dense tensor; one quantization block of a quantized one, or with double
// quantization one nested group of 256 blocks, so that each rank's second-level scales are its own and the
// offset (one float for the whole tensor) is the only replicated state. Every rank holds the same number of
// units (the last shards are padded with zeros) so that one all_gather per buffer moves them; the shards
// concatenated in rank order are the tensor's buffers followed by the padding.
//
// Every byte is said in advance: shard_bytes (what a rank keeps) and gather_workspace_bytes (the staging
// of one gather, released before gather returns). Shards are made from a whole tensor every rank holds
// (e.g. each rank quantizes or loads the same checkpoint piece by piece).
//
// Checkpoints: save(writer, name) adds a rank's shard to a safetensors file (name.codes / name.scales /
// name.groups as U8, and the layout as JSON metadata under `name`); load(images, name, rank, ranks) builds
// rank `rank` of `ranks` from the files of ALL ranks of a save made on any number of ranks (N -> M): units
// never straddle shards, so each new shard is old shards' bytes copied unit by unit. Every file is checked
// (format, shape, options, rank count, each rank once, piece sizes) before anything is allocated.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/distributed/communicator.hpp"
#include "memkit/distributed/sharded_parameters_bytes.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/io/json.hpp"
#include "memkit/io/safetensors.hpp"
#include "memkit/quant/quantized_tensor.hpp"

#include <bit>
#include <span>
#include <vector>

MEMKIT_NAMESPACE_BEGIN
namespace distributed {

namespace detail {

inline void check_rank(const char* what, int rank, int ranks) {
  require(ranks >= 1 && rank >= 0 && rank < ranks,
          std::string(what) + ": rank " + std::to_string(rank) + " of " + std::to_string(ranks) + " ranks");
}

// Copies `bytes` between host or device memory (synchronous: setup and the copies out of a gather's staging).
template <executor E>
void copy_bytes(const E& exec, void* to, const void* from, std::size_t bytes) {
  if (bytes == 0) return;
  if constexpr (!E::on_device) {
    (void)exec;
    std::memmove(to, from, bytes);
  } else {
#if MEMKIT_HAS_CUDA
    MEMKIT_CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, exec.stream));
#endif
  }
}
inline void copy_setup(void* to, const void* from, std::size_t bytes) {
  if (bytes == 0) return;
#if MEMKIT_HAS_CUDA
  MEMKIT_CUDA_CHECK(cudaMemcpy(to, from, bytes, cudaMemcpyDefault));
#else
  std::memcpy(to, from, bytes);
#endif
}
inline void zero_setup(void* to, std::size_t bytes, memory_kind where) {
  if (bytes == 0) return;
  if (where != memory_kind::device) {
    std::memset(to, 0, bytes);
    return;
  }
#if MEMKIT_HAS_CUDA
  MEMKIT_CUDA_CHECK(cudaMemset(to, 0, bytes));
#endif
}

// One all_gather of `shard_bytes` per rank into `staging` (ranks * shard_bytes), then the tensor's
// `valid_bytes` prefix copied into `to`.
template <executor E, class C>
void gather_bytes(const E& exec, const C& comm, const std::byte* shard, std::size_t shard_bytes, std::byte* staging,
                  std::byte* to, std::size_t valid_bytes) {
  comm.all_gather(exec, shard, staging, static_cast<std::int64_t>(shard_bytes));
  copy_bytes(exec, to, staging, valid_bytes);
}

// One saved shard: its pieces (name.suffix, U8) and the layout as JSON metadata under `name`.
struct saved_piece {
  const char* suffix;
  const std::uint8_t* data;
  std::size_t bytes;
};
inline void save_shard(safetensors::writer& out, const std::string& name, const std::string& layout_json,
                       std::span<const saved_piece> pieces) {
  for (const saved_piece& p : pieces) {
    std::vector<std::uint8_t> host(p.bytes);
    if (p.bytes > 0) copy_setup(host.data(), p.data, p.bytes);
    out.add_bytes(name + p.suffix, "U8", {static_cast<std::int64_t>(p.bytes)}, host.data(), p.bytes);
  }
  out.add_metadata(name, layout_json);
}

// The saved layout of `name` in every image, checked against `expected` (the JSON the current tensor would
// save, less "rank"): returns the images in rank order.
inline std::vector<const safetensors::reader*> order_images(std::span<const safetensors::reader* const> images,
                                                            const std::string& name, const std::string& what) {
  require(!images.empty(), what + ": no images");
  std::vector<const safetensors::reader*> by_rank(images.size(), nullptr);
  for (const safetensors::reader* image : images) {
    require(image != nullptr, what + ": a null image");
    const std::string* text = image->find_metadata(name);
    require(text != nullptr, what + ": '" + image->path() + "' holds no shard of '" + name + "'");
    const json::value layout = json::parse(*text, image->path());
    const json::value* ranks = layout.is_object() ? layout.find("ranks") : nullptr;
    const json::value* rank = layout.is_object() ? layout.find("rank") : nullptr;
    require(ranks != nullptr && rank != nullptr && ranks->is_number() && rank->is_number(),
            what + ": '" + image->path() + "': the layout of '" + name + "' has no rank / ranks");
    require(ranks->as_int() == static_cast<std::int64_t>(images.size()),
            what + ": '" + image->path() + "' was saved by " + ranks->number_text() + " ranks, but " +
                std::to_string(images.size()) + " images were given (all ranks of one save are needed)");
    const std::int64_t r = rank->as_int();
    require(r >= 0 && r < static_cast<std::int64_t>(images.size()), what + ": '" + image->path() + "': rank " + rank->number_text());
    require(by_rank[static_cast<std::size_t>(r)] == nullptr, what + ": rank " + std::to_string(r) + " appears twice");
    by_rank[static_cast<std::size_t>(r)] = image;
  }
  return by_rank;
}

// The layout JSON of a shard less its rank: what every rank of one save must agree on.
inline std::string layout_without_rank(const safetensors::reader& image, const std::string& name) {
  const std::string* value = image.find_metadata(name);
  if (value == nullptr) return {};
  const std::size_t at = value->find(",\"rank\":");
  return at == std::string::npos ? *value : value->substr(0, at);
}

// Rebuilds rank `rank` of `ranks` from the old shards (in rank order, each `old_units` units), piece by
// piece: `unit_bytes[i]` bytes per unit of piece i, the new shard `new_units` units long.
inline void reshard_pieces(std::span<const safetensors::reader* const> old_images, const std::string& name,
                           std::span<const char* const> suffixes, std::span<const std::size_t> unit_bytes,
                           std::int64_t old_units, std::int64_t new_units, std::int64_t total_units, int rank,
                           std::span<std::uint8_t* const> destination) {
  const std::int64_t first = std::min<std::int64_t>(total_units, rank * new_units);
  const std::int64_t last = std::min<std::int64_t>(total_units, first + new_units);
  for (std::size_t piece = 0; piece < suffixes.size(); ++piece) {
    if (unit_bytes[piece] == 0) continue;
    for (std::int64_t u = first; u < last;) {
      const std::int64_t k = u / old_units, end = std::min(last, (k + 1) * old_units);
      const safetensors::reader& image = *old_images[static_cast<std::size_t>(k)];
      const safetensors::tensor_info& t = image.info(name + suffixes[piece]);
      image.read_range(t, static_cast<std::uint64_t>(u - k * old_units) * unit_bytes[piece],
                       destination[piece] + static_cast<std::size_t>(u - first) * unit_bytes[piece],
                       static_cast<std::uint64_t>(end - u) * unit_bytes[piece]);
      u = end;
    }
  }
}

}  // namespace detail

// ---- dense ----------------------------------------------------------------------------------------------

template <class T>
class sharded_dense {
 public:
  // (sharded_parameters_bytes.hpp: the same numbers without this class, for memory_budget)
  static constexpr shard_layout layout_of(const shape& dims, int ranks) noexcept { return dense_shard_layout(dims, ranks); }
  static constexpr std::size_t shard_bytes(const shape& dims, int ranks) noexcept {
    return dense_shard_bytes(dims, sizeof(T), ranks);
  }
  static constexpr std::size_t gather_workspace_bytes(const shape& dims, int ranks) noexcept {
    return dense_gather_workspace_bytes(dims, sizeof(T), ranks);
  }

  sharded_dense() = default;
  // Rank `rank`'s slice of `whole` (host or device memory) in a buffer from `resource`.
  sharded_dense(tensor_view<const T> whole, int rank, int ranks, memory_resource& resource)
      : shape_(whole.shape()), rank_(rank), layout_(layout_of(whole.shape(), ranks)) {
    detail::check_rank("sharded_dense", rank, ranks);
    shard_ = buffer<T>(resource, shape{layout_.shard_elements()});
    detail::zero_setup(shard_.data(), shard_.bytes(), shard_.where());
    detail::copy_setup(shard_.data(), whole.data() + layout_.first(rank), static_cast<std::size_t>(layout_.count(rank)) * sizeof(T));
  }

  const shape& logical_shape() const noexcept { return shape_; }
  const shard_layout& layout() const noexcept { return layout_; }
  int rank() const noexcept { return rank_; }
  tensor_view<T> shard() noexcept { return shard_.view(); }
  tensor_view<const T> shard() const noexcept { return shard_.view(); }

  // Every rank's slice into `whole` (the whole tensor's shape), through staging from `workspace`.
  template <executor E, class C>
  void gather(const E& exec, const C& comm, tensor_view<T> whole, memory_resource& workspace) const {
    require(comm.size() == layout_.ranks && comm.rank() == rank_,
            "sharded_dense::gather: the shard is rank " + std::to_string(rank_) + " of " + std::to_string(layout_.ranks) +
                ", the communicator rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()));
    require(whole.shape() == shape_, "sharded_dense::gather: `whole` has shape " + to_string(whole.shape()) +
                                         ", the tensor " + to_string(shape_));
    buffer<std::byte> staging = workspace_buffer<std::byte>(exec, workspace, shape{static_cast<std::int64_t>(gather_workspace_bytes(shape_, layout_.ranks))});
    detail::gather_bytes(exec, comm, reinterpret_cast<const std::byte*>(shard_.data()),
                         static_cast<std::size_t>(layout_.shard_elements()) * sizeof(T), staging.data(),
                         reinterpret_cast<std::byte*>(whole.data()), static_cast<std::size_t>(shape_.numel()) * sizeof(T));
  }

  // Adds this rank's shard to `out` under `name`: `name.values` (U8) and the layout as JSON metadata.
  void save(safetensors::writer& out, const std::string& name) const {
    const detail::saved_piece pieces[] = {{".values", reinterpret_cast<const std::uint8_t*>(shard_.data()), shard_.bytes()}};
    detail::save_shard(out, name, layout_json(shape_) + ",\"ranks\":" + std::to_string(layout_.ranks) +
                                      ",\"rank\":" + std::to_string(rank_) + "}",
                       pieces);
  }

  // Rank `rank` of `ranks` from the images of every rank of a save of a tensor of `dims` (any rank count).
  static sharded_dense load(std::span<const safetensors::reader* const> images, const std::string& name, const shape& dims,
                            int rank, int ranks, memory_resource& resource) {
    const std::string what = "sharded_dense::load('" + name + "')";
    detail::check_rank(what.c_str(), rank, ranks);
    const std::vector<const safetensors::reader*> old = detail::order_images(images, name, what);
    for (const safetensors::reader* image : old)
      require(detail::layout_without_rank(*image, name) == layout_json(dims) + ",\"ranks\":" + std::to_string(old.size()),
              what + ": '" + image->path() + "' holds another tensor (" + detail::layout_without_rank(*image, name) +
                  "}), not " + layout_json(dims) + "}");
    const shard_layout old_layout = layout_of(dims, static_cast<int>(old.size()));
    for (const safetensors::reader* image : old) {
      const safetensors::tensor_info* t = image->find(name + ".values");
      require(t != nullptr && t->dtype == "U8" &&
                  t->bytes() == static_cast<std::uint64_t>(old_layout.shard_elements()) * sizeof(T),
              what + ": '" + image->path() + "': '" + name + ".values' is missing or not " +
                  std::to_string(old_layout.shard_elements() * static_cast<std::int64_t>(sizeof(T))) + " bytes of U8");
    }
    sharded_dense out;
    out.shape_ = dims;
    out.rank_ = rank;
    out.layout_ = layout_of(dims, ranks);
    std::vector<std::uint8_t> values(static_cast<std::size_t>(out.layout_.shard_elements()) * sizeof(T), 0);
    const char* const suffixes[] = {".values"};
    const std::size_t unit_bytes[] = {sizeof(T)};
    std::uint8_t* const destination[] = {values.data()};
    detail::reshard_pieces(old, name, suffixes, unit_bytes, old_layout.units_per_rank, out.layout_.units_per_rank,
                           dims.numel(), rank, destination);
    out.shard_ = buffer<T>(resource, shape{out.layout_.shard_elements()});
    detail::copy_setup(out.shard_.data(), values.data(), values.size());
    return out;
  }

 private:
  // The layout's JSON up to (not including) the rank count: element type and shape.
  static std::string layout_json(const shape& dims) {
    std::string text = std::string("{\"format\":\"") + safetensors::dtype_of<T>() + "\",\"shape\":[";
    for (int i = 0; i < dims.rank; ++i) {
      text += i ? "," : "";  // two appends, not "," + to_string(...): GCC 12 at -O3 warns (-Wrestrict) on that
      text += std::to_string(dims[i]);
    }
    return text + "]";
  }

  shape shape_{};
  int rank_ = 0;
  shard_layout layout_{};
  buffer<T> shard_;
};

// ---- quantized ------------------------------------------------------------------------------------------

template <quant::format F>
class sharded_quantized {
 public:
  using tensor_type = quant::quantized_tensor<F>;
  static constexpr std::int64_t groups_per_unit = blocks_per_nested_group;  // blocks per nested group

  // (sharded_parameters_bytes.hpp: the same numbers without this class, for memory_budget)
  static constexpr shard_layout layout_of(const shape& dims, const quant::quant_options& o, int ranks) noexcept {
    return quantized_shard_layout(dims, o, ranks);
  }
  // The pieces of one rank's shard, in bytes: codes, block scales, group scales (one buffer each).
  using pieces = quantized_shard_pieces;
  static constexpr pieces shard_pieces(const shape& dims, const quant::quant_options& o, int ranks) noexcept {
    return quantized_shard_pieces_of(F, dims, o, ranks);
  }
  // What a rank keeps.
  static constexpr std::size_t shard_bytes(const shape& dims, const quant::quant_options& o, int ranks) noexcept {
    return quantized_shard_bytes(F, dims, o, ranks);
  }
  // The staging of one gather: every rank's largest piece.
  static constexpr std::size_t gather_workspace_bytes(const shape& dims, const quant::quant_options& o, int ranks) noexcept {
    return quantized_gather_workspace_bytes(F, dims, o, ranks);
  }

  sharded_quantized() = default;
  // Rank `rank`'s slice of `whole` (every rank holds the same tensor) in buffers from `resource`.
  sharded_quantized(const tensor_type& whole, int rank, int ranks, memory_resource& resource)
      : shape_(whole.logical_shape()), options_(whole.options()), rank_(rank), layout_(layout_of(shape_, options_, ranks)) {
    detail::check_rank("sharded_quantized", rank, ranks);
    const pieces p = shard_pieces(shape_, options_, ranks);
    codes_ = buffer<std::uint8_t>(resource, shape{static_cast<std::int64_t>(p.codes)});
    scales_ = buffer<std::uint8_t>(resource, shape{static_cast<std::int64_t>(p.scales)});
    groups_ = buffer<std::uint8_t>(resource, shape{static_cast<std::int64_t>(p.groups)});
    for (buffer<std::uint8_t>* b : {&codes_, &scales_, &groups_}) detail::zero_setup(b->data(), b->bytes(), b->where());
    const std::int64_t first = layout_.first(rank), count = layout_.count(rank), B = options_.block_size;
    const std::int64_t first_block = first / B, blocks = (count + B - 1) / B;
    detail::copy_setup(codes_.data(), whole.codes().data() + quant::code_bytes(F, first),
                       static_cast<std::size_t>(quant::code_bytes(F, count)));
    if (options_.double_quant) {
      detail::copy_setup(scales_.data(), whole.nested_codes().data() + first_block, static_cast<std::size_t>(blocks));
      const std::int64_t first_group = first_block / groups_per_unit, groups = (blocks + groups_per_unit - 1) / groups_per_unit;
      detail::copy_setup(groups_.data(), whole.nested_group_absmax().data() + first_group, static_cast<std::size_t>(4 * groups));
      float offset = 0;
      detail::copy_setup(&offset, whole.offset_view().data(), sizeof(float));
      offset_ = offset;
      nested_map_ = whole.nested_map();
    } else {
      detail::copy_setup(scales_.data(), whole.absmax().data() + first_block, static_cast<std::size_t>(4 * blocks));
    }
  }

  const shape& logical_shape() const noexcept { return shape_; }
  const quant::quant_options& options() const noexcept { return options_; }
  const shard_layout& layout() const noexcept { return layout_; }
  int rank() const noexcept { return rank_; }
  std::size_t bytes() const noexcept { return codes_.bytes() + scales_.bytes() + groups_.bytes(); }
  // With double quantization: the tensor's offset (replicated on every rank; 0 without).
  float nested_offset() const noexcept { return offset_; }

  // Every rank's slice into `whole` (a tensor of the same shape and options), bit for bit the tensor the
  // shards were made from; staging from `workspace` (gather_workspace_bytes), released before returning.
  template <executor E, class C>
  void gather(const E& exec, const C& comm, tensor_type& whole, memory_resource& workspace) const {
    require(comm.size() == layout_.ranks && comm.rank() == rank_,
            "sharded_quantized::gather: the shard is rank " + std::to_string(rank_) + " of " + std::to_string(layout_.ranks) +
                ", the communicator rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()));
    require(whole.logical_shape() == shape_ && whole.options().block_size == options_.block_size &&
                whole.options().double_quant == options_.double_quant,
            "sharded_quantized::gather: `whole` is " + to_string(whole.logical_shape()) + " (block " +
                std::to_string(whole.options().block_size) + (whole.options().double_quant ? ", double quantization" : "") +
                "), the sharded tensor " + to_string(shape_) + " (block " + std::to_string(options_.block_size) +
                (options_.double_quant ? ", double quantization" : "") + ")");
    const pieces p = shard_pieces(shape_, options_, layout_.ranks);
    buffer<std::byte> staging = workspace_buffer<std::byte>(
        exec, workspace, shape{static_cast<std::int64_t>(gather_workspace_bytes(shape_, options_, layout_.ranks))});
    const auto bytes_of = [](auto view) { return reinterpret_cast<std::byte*>(view.data()); };
    detail::gather_bytes(exec, comm, reinterpret_cast<const std::byte*>(codes_.data()), p.codes, staging.data(),
                         bytes_of(whole.codes()), whole.codes().bytes());
    if (options_.double_quant) {
      detail::gather_bytes(exec, comm, reinterpret_cast<const std::byte*>(scales_.data()), p.scales, staging.data(),
                           bytes_of(whole.nested_codes()), whole.nested_codes().bytes());
      detail::gather_bytes(exec, comm, reinterpret_cast<const std::byte*>(groups_.data()), p.groups, staging.data(),
                           bytes_of(whole.nested_group_absmax()), whole.nested_group_absmax().bytes());
      detail::copy_bytes(exec, whole.offset_view().data(), &offset_, sizeof(float));
      whole.set_nested_map(nested_map_);
    } else {
      detail::gather_bytes(exec, comm, reinterpret_cast<const std::byte*>(scales_.data()), p.scales, staging.data(),
                           bytes_of(whole.absmax()), whole.absmax().bytes());
    }
    if constexpr (E::on_device) exec.synchronize();  // `offset_` is host memory read by an async copy
  }

  // Adds this rank's shard to `out` under `name` (see the header).
  void save(safetensors::writer& out, const std::string& name) const {
    std::string dims = "[";
    for (int i = 0; i < shape_.rank; ++i) {
      dims += i ? "," : "";  // two appends, not "," + to_string(...): GCC 12 at -O3 warns (-Wrestrict) on that
      dims += std::to_string(shape_[i]);
    }
    const std::string layout = std::string("{\"format\":\"") + quant::to_string(F) + "\",\"shape\":" + dims +
                               "],\"block_size\":" + std::to_string(options_.block_size) +
                               ",\"double_quant\":" + (options_.double_quant ? "true" : "false") +
                               ",\"offset_bits\":" + std::to_string(std::bit_cast<std::uint32_t>(offset_)) +
                               ",\"ranks\":" + std::to_string(layout_.ranks) + ",\"rank\":" + std::to_string(rank_) + "}";
    const detail::saved_piece pieces[] = {
        {".codes", codes_.data(), codes_.bytes()},
        {".scales", scales_.data(), scales_.bytes()},
        {".groups", groups_.data(), groups_.bytes()},
        {".nested_map", reinterpret_cast<const std::uint8_t*>(nested_map_.value), sizeof(nested_map_.value)}};
    detail::save_shard(out, name, layout, pieces);
  }

  // Rank `rank` of `ranks` from the images of every rank of a save (any order, any rank count).
  static sharded_quantized load(std::span<const safetensors::reader* const> images, const std::string& name, int rank,
                                int ranks, memory_resource& resource) {
    const std::string what = "sharded_quantized::load('" + name + "')";
    detail::check_rank(what.c_str(), rank, ranks);
    const std::vector<const safetensors::reader*> old = detail::order_images(images, name, what);
    const std::string agreed = detail::layout_without_rank(*old[0], name);
    for (const safetensors::reader* image : old)
      require(detail::layout_without_rank(*image, name) == agreed,
              what + ": '" + image->path() + "' holds a different tensor or save than '" + old[0]->path() + "'");
    const json::value layout = json::parse(*old[0]->find_metadata(name), old[0]->path());  // present: order_images
    const auto field = [&](const char* key) -> const json::value& {
      const json::value* v = layout.find(key);
      require(v != nullptr, what + ": the saved layout has no '" + key + "'");
      return *v;
    };
    require(field("format").is_string() && field("format").as_string() == quant::to_string(F),
            what + ": saved as " + (field("format").is_string() ? field("format").as_string() : std::string("?")) +
                ", loading as " + quant::to_string(F));
    shape dims{};
    const json::value& extents = field("shape");
    require(extents.is_array() && !extents.as_array().empty() && extents.as_array().size() <= 8,
            what + ": the saved shape is not a list of 1 to 8 extents");
    dims.rank = static_cast<int>(extents.as_array().size());
    for (int i = 0; i < dims.rank; ++i) {
      const json::value& e = extents.as_array()[static_cast<std::size_t>(i)];
      require(e.is_number() && e.as_double() >= 0 && e.as_double() <= double(std::int64_t{1} << 40),
              what + ": a saved extent is out of range");
      dims.extents[i] = e.as_int();
    }
    require(dims.numel() <= (std::int64_t{1} << 40), what + ": the saved tensor has too many elements");
    quant::quant_options options;
    options.block_size = field("block_size").as_int();
    options.double_quant = field("double_quant").as_bool();
    require(options.block_size >= 16 && options.block_size <= 4096 && (options.block_size & (options.block_size - 1)) == 0,
            what + ": saved block size " + std::to_string(options.block_size));
    const int old_ranks = static_cast<int>(old.size());
    const pieces old_pieces = shard_pieces(dims, options, old_ranks);
    const std::size_t expected[] = {old_pieces.codes, old_pieces.scales, old_pieces.groups, sizeof(quant::code_table<256>::value)};
    const char* const suffixes[] = {".codes", ".scales", ".groups", ".nested_map"};
    for (const safetensors::reader* image : old)
      for (int i = 0; i < 4; ++i) {
        const safetensors::tensor_info* t = image->find(name + suffixes[i]);
        require(t != nullptr && t->dtype == "U8" && t->bytes() == expected[i],
                what + ": '" + image->path() + "': '" + name + suffixes[i] + "' is missing or not " +
                    std::to_string(expected[i]) + " bytes of U8");
      }
    // Everything checked: the new shard, unit by unit from the old ones.
    sharded_quantized out;
    out.shape_ = dims;
    out.options_ = options;
    out.rank_ = rank;
    out.layout_ = layout_of(dims, options, ranks);
    out.offset_ = std::bit_cast<float>(static_cast<std::uint32_t>(field("offset_bits").as_int()));
    const pieces p = shard_pieces(dims, options, ranks);
    std::vector<std::uint8_t> codes(p.codes, 0), scales(p.scales, 0), groups(p.groups, 0);
    const shard_layout old_layout = layout_of(dims, options, old_ranks);
    const std::int64_t units = (dims.numel() + out.layout_.unit - 1) / out.layout_.unit;
    const std::size_t blocks_per_unit = static_cast<std::size_t>(out.layout_.unit / options.block_size);
    const std::size_t unit_bytes[] = {static_cast<std::size_t>(quant::code_bytes(F, out.layout_.unit)),
                                      options.double_quant ? blocks_per_unit : 4 * blocks_per_unit,
                                      options.double_quant ? std::size_t{4} : std::size_t{0}};
    std::uint8_t* const destination[] = {codes.data(), scales.data(), groups.data()};
    detail::reshard_pieces(old, name, std::span<const char* const>(suffixes, 3), unit_bytes, old_layout.units_per_rank,
                           out.layout_.units_per_rank, units, rank, destination);
    std::vector<std::uint8_t> map(sizeof(quant::code_table<256>::value));
    old[0]->read_bytes(name + ".nested_map", map.data(), map.size());
    std::memcpy(out.nested_map_.value, map.data(), map.size());
    out.codes_ = buffer<std::uint8_t>(resource, shape{static_cast<std::int64_t>(p.codes)});
    out.scales_ = buffer<std::uint8_t>(resource, shape{static_cast<std::int64_t>(p.scales)});
    out.groups_ = buffer<std::uint8_t>(resource, shape{static_cast<std::int64_t>(p.groups)});
    detail::copy_setup(out.codes_.data(), codes.data(), codes.size());
    detail::copy_setup(out.scales_.data(), scales.data(), scales.size());
    detail::copy_setup(out.groups_.data(), groups.data(), groups.size());
    return out;
  }

 private:
  shape shape_{};
  quant::quant_options options_{};
  int rank_ = 0;
  shard_layout layout_{};
  buffer<std::uint8_t> codes_, scales_, groups_;
  float offset_ = 0;
  quant::code_table<256> nested_map_{};
};

}  // namespace distributed
MEMKIT_NAMESPACE_END
