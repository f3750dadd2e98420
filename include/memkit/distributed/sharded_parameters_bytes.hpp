// memkit/distributed/sharded_parameters_bytes.hpp — how ZeRO-3 splits a parameter across ranks and the bytes
// each rank keeps and stages, as constexpr functions without the shards' code (what memory_budget includes).
//
//   shard_layout / make_shard_layout   a tensor of N elements in whole units, the same count on every rank
//   dense_shard_bytes                  what a rank keeps of a dense tensor (sharded_dense<T>::shard_bytes)
//   dense_gather_workspace_bytes       the staging of one gather of it (every rank's shard)
//   quantized_shard_pieces_of          a rank's codes / block scales / group scales of a quantized tensor
//   quantized_shard_bytes              their sum (sharded_quantized<F>::shard_bytes)
//   quantized_gather_workspace_bytes   the staging of one gather: every rank's largest piece
//
// distributed/sharded_parameters.hpp's classes forward their byte functions here, so the shards and the budget
// cannot disagree. Units: one element of a dense tensor; one quantization block of a quantized one, or with
// double quantization one nested group of 256 blocks (each rank's second-level scales are its own).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "memkit/config.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/quant/bytes.hpp"

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

// ---- dense: one element per unit ----

constexpr shard_layout dense_shard_layout(const shape& dims, int ranks) noexcept {
  return make_shard_layout(dims.numel(), 1, ranks);
}
// One buffer of the shard's elements (the last ranks' padded with zeros).
constexpr std::size_t dense_shard_bytes(const shape& dims, std::size_t element_bytes, int ranks) noexcept {
  return static_cast<std::size_t>(dense_shard_layout(dims, ranks).shard_elements()) * element_bytes;
}
// One all_gather's receive buffer: every rank's shard.
constexpr std::size_t dense_gather_workspace_bytes(const shape& dims, std::size_t element_bytes, int ranks) noexcept {
  return dense_shard_bytes(dims, element_bytes, ranks) * static_cast<std::size_t>(ranks > 0 ? ranks : 0);
}

// ---- quantized: whole blocks, or whole nested groups with double quantization ----

inline constexpr std::int64_t blocks_per_nested_group = 256;  // quantized_tensor's second-level block

constexpr shard_layout quantized_shard_layout(const shape& dims, const quant::quant_options& o, int ranks) noexcept {
  return make_shard_layout(dims.numel(), o.double_quant ? o.block_size * blocks_per_nested_group : o.block_size, ranks);
}

// The pieces of one rank's shard, in bytes: codes, then the block scales (fp32, or uint8 nested codes), then
// with double quantization one fp32 group scale per unit. Each is one buffer.
struct quantized_shard_pieces {
  std::size_t codes = 0, scales = 0, groups = 0;
  constexpr std::size_t total() const noexcept { return codes + scales + groups; }
};
constexpr quantized_shard_pieces quantized_shard_pieces_of(quant::format f, const shape& dims,
                                                           const quant::quant_options& o, int ranks) noexcept {
  const shard_layout l = quantized_shard_layout(dims, o, ranks);
  const std::int64_t blocks = l.shard_elements() / o.block_size;
  quantized_shard_pieces p;
  p.codes = static_cast<std::size_t>(quant::code_bytes(f, l.shard_elements()));
  p.scales = static_cast<std::size_t>(o.double_quant ? blocks : 4 * blocks);
  p.groups = static_cast<std::size_t>(o.double_quant ? 4 * l.units_per_rank : 0);
  return p;
}
// What a rank keeps of a quantized tensor. (The double-quantization offset, one float, and the 256-entry
// nested map are members of the shard object, not allocations.)
constexpr std::size_t quantized_shard_bytes(quant::format f, const shape& dims, const quant::quant_options& o,
                                            int ranks) noexcept {
  return quantized_shard_pieces_of(f, dims, o, ranks).total();
}
// The staging of one gather: the pieces are gathered one after another through one buffer of every rank's
// largest piece, released before gather returns.
constexpr std::size_t quantized_gather_workspace_bytes(quant::format f, const shape& dims, const quant::quant_options& o,
                                                       int ranks) noexcept {
  const quantized_shard_pieces p = quantized_shard_pieces_of(f, dims, o, ranks);
  return std::max({p.codes, p.scales, p.groups}) * static_cast<std::size_t>(ranks > 0 ? ranks : 0);
}

}  // namespace distributed
MEMKIT_NAMESPACE_END
