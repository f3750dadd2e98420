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
// (e.g. each rank quantizes or loads the same checkpoint piece by piece): shard_of.
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
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/quantized_tensor.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace distributed {

struct shard_layout {
  std::int64_t elements = 0;        // of the whole tensor
  std::int64_t unit = 1;            // elements that stay together
  std::int64_t units_per_rank = 0;  // the same on every rank
  int ranks = 1;

  constexpr std::int64_t shard_elements() const noexcept { return units_per_rank * unit; }
  // Rank r's elements [first(r), first(r) + count(r)); count may be less than shard_elements (padding) or 0.
  constexpr std::int64_t first(int rank) const noexcept { return std::min(elements, rank * shard_elements()); }
  constexpr std::int64_t count(int rank) const noexcept {
    return std::min(elements, first(rank) + shard_elements()) - first(rank);
  }
};

constexpr shard_layout make_shard_layout(std::int64_t elements, std::int64_t unit, int ranks) noexcept {
  const std::int64_t units = (elements + unit - 1) / unit;
  return {elements, unit, ranks > 0 ? (units + ranks - 1) / ranks : 0, ranks};
}

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

}  // namespace detail

// ---- dense ----------------------------------------------------------------------------------------------

template <class T>
class sharded_dense {
 public:
  static constexpr shard_layout layout_of(const shape& dims, int ranks) noexcept {
    return make_shard_layout(dims.numel(), 1, ranks);
  }
  static constexpr std::size_t shard_bytes(const shape& dims, int ranks) noexcept {
    return buffer<T>::bytes_required(shape{layout_of(dims, ranks).shard_elements()});
  }
  static constexpr std::size_t gather_workspace_bytes(const shape& dims, int ranks) noexcept {
    return buffer<T>::bytes_required(shape{layout_of(dims, ranks).shard_elements() * ranks});
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

 private:
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
  static constexpr std::int64_t groups_per_unit = 256;  // blocks per nested group (quantized_tensor's)

  static constexpr shard_layout layout_of(const shape& dims, const quant::quant_options& o, int ranks) noexcept {
    return make_shard_layout(dims.numel(), o.double_quant ? o.block_size * groups_per_unit : o.block_size, ranks);
  }
  // The pieces of one rank's shard, in bytes: codes, then the block scales (fp32, or uint8 nested codes),
  // then with double quantization one fp32 group scale per unit.
  struct pieces {
    std::size_t codes = 0, scales = 0, groups = 0;
    constexpr std::size_t total() const noexcept { return codes + scales + groups; }
  };
  static constexpr pieces shard_pieces(const shape& dims, const quant::quant_options& o, int ranks) noexcept {
    const shard_layout l = layout_of(dims, o, ranks);
    const std::int64_t blocks = l.shard_elements() / o.block_size;
    pieces p;
    p.codes = static_cast<std::size_t>(quant::code_bytes(F, l.shard_elements()));
    p.scales = static_cast<std::size_t>(o.double_quant ? blocks : 4 * blocks);
    p.groups = static_cast<std::size_t>(o.double_quant ? 4 * l.units_per_rank : 0);
    return p;
  }
  // What a rank keeps (one buffer per piece).
  static constexpr std::size_t shard_bytes(const shape& dims, const quant::quant_options& o, int ranks) noexcept {
    const pieces p = shard_pieces(dims, o, ranks);
    return buffer<std::uint8_t>::bytes_required(shape{static_cast<std::int64_t>(p.codes)}) +
           buffer<std::uint8_t>::bytes_required(shape{static_cast<std::int64_t>(p.scales)}) +
           buffer<std::uint8_t>::bytes_required(shape{static_cast<std::int64_t>(p.groups)});
  }
  // The staging of one gather: every rank's largest piece.
  static constexpr std::size_t gather_workspace_bytes(const shape& dims, const quant::quant_options& o, int ranks) noexcept {
    const pieces p = shard_pieces(dims, o, ranks);
    return buffer<std::byte>::bytes_required(shape{static_cast<std::int64_t>(std::max({p.codes, p.scales, p.groups}) * ranks)});
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
