// memkit/distributed/sharded_adam_bytes.hpp — the flat layout of sharded_adam_state and the bytes each rank
// allocates, as constexpr functions, without the optimizer's step (what memory_budget needs).
//
// Collectives move one contiguous buffer in equal parts per rank, so parameters and gradients live in one flat
// buffer each: tensor i starts at its flat offset, each tensor padded to a multiple of `granule` = 4096
// elements, the total padded to a multiple of ranks * granule. Rank r owns the flat range
// [r * shard_size, (r + 1) * shard_size): the pieces of the tensors that fall in it, each laid out as
// adam_layout lays out a tensor (optim/adam_bytes.hpp), after adam_state's control block and the
// gradient-norm scratch of ALL chunks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "memkit/config.hpp"
#include "memkit/optim/adam_bytes.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace distributed {

// The elements [begin, end) of tensor `tensor` that a rank owns.
struct shard_piece {
  std::int64_t tensor = 0;
  std::int64_t begin = 0, end = 0;  // within the tensor; begin is a multiple of the granule
  std::int64_t flat = 0;            // flat offset of the tensor (element 0)
  std::int64_t first_chunk = 0;     // global index of the gradient-norm chunk holding element `begin`
  bool quantized = false;           // decided by the whole tensor's size, as adam_state decides it
  std::size_t m_offset = 0, v_offset = 0, m_scale_offset = 0, v_scale_offset = 0;  // within the arena
  constexpr std::int64_t count() const noexcept { return end - begin; }
};

// The layout of a sharded_adam_state<State, Block>.
template <class State, int Block = optim::adam_moment_format<State>::default_block>
struct sharded_adam_layout {
 private:
  using unsharded = optim::adam_layout<State, Block>;

 public:
  // Pieces start on multiples of this many elements of their tensor (adam_state's norm chunk).
  static constexpr std::int64_t granule = optim::detail::reduction_chunk;
  static_assert(granule % unsharded::divisor_block == 0, "sharded_adam_state: a granule must hold whole blocks");
  // A tensor of n elements in the flat buffers: padded to whole granules.
  static constexpr std::int64_t padded(std::int64_t n) noexcept { return (n + granule - 1) / granule * granule; }

  // Elements of the flat parameter / gradient buffers every rank holds.
  static constexpr std::int64_t flat_size(std::span<const std::int64_t> sizes, int ranks) noexcept {
    std::int64_t total = 0;
    for (std::int64_t n : sizes) total += padded(n);
    const std::int64_t unit = granule * (ranks > 0 ? ranks : 1);
    return std::max<std::int64_t>(unit, (total + unit - 1) / unit * unit);
  }
  static constexpr std::int64_t shard_size(std::span<const std::int64_t> sizes, int ranks) noexcept {
    return flat_size(sizes, ranks) / (ranks > 0 ? ranks : 1);
  }
  // Bytes of the moments of a piece of `count` elements of a tensor quantized or not.
  static constexpr std::size_t piece_bytes(std::int64_t count, bool piece_quantized) noexcept {
    return unsharded::segment_plan(count, piece_quantized).bytes;
  }
  // Lays out rank `rank`'s state, calling visit(piece) for each piece; returns the arena's bytes.
  template <class Visit>
  static constexpr std::size_t plan(std::span<const std::int64_t> sizes, int rank, int ranks,
                                    std::int64_t min_quantized_size, Visit&& visit) {
    const std::int64_t shard = shard_size(sizes, ranks);
    const std::int64_t low = static_cast<std::int64_t>(rank) * shard, high = low + shard;
    std::int64_t chunks = 0;
    for (std::int64_t n : sizes) chunks += optim::detail::reduction_chunks(n);
    std::size_t offset = unsharded::overhead_bytes(chunks);
    std::int64_t flat = 0, first_chunk = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::int64_t n = sizes[i];
      const std::int64_t begin = std::clamp<std::int64_t>(low - flat, 0, n);
      const std::int64_t end = std::clamp<std::int64_t>(high - flat, 0, n);
      if (begin < end) {
        shard_piece p;
        p.tensor = static_cast<std::int64_t>(i);
        p.begin = begin;
        p.end = end;
        p.flat = flat;
        p.first_chunk = first_chunk + begin / granule;
        p.quantized = unsharded::quantizes(n, min_quantized_size);
        // adam_state's segment layout (m and v of a large piece half a page apart modulo 4 KiB).
        offset = unsharded::segment_plan(end - begin, p.quantized).place(p, offset, p.quantized);
        visit(p);
      }
      flat += padded(n);
      first_chunk += optim::detail::reduction_chunks(n);
    }
    return offset;
  }
  // Exactly what rank `rank` of `ranks` allocates for tensors of these sizes.
  static constexpr std::size_t bytes_required(std::span<const std::int64_t> sizes, int rank, int ranks,
                                              std::int64_t min_quantized_size) {
    return plan(sizes, rank, ranks, min_quantized_size, [](const shard_piece&) {});
  }
  // The most any rank allocates (what a budget must plan for on every device).
  static constexpr std::size_t max_bytes_per_rank(std::span<const std::int64_t> sizes, int ranks,
                                                  std::int64_t min_quantized_size) {
    std::size_t most = 0;
    for (int r = 0; r < ranks; ++r) most = std::max(most, bytes_required(sizes, r, ranks, min_quantized_size));
    return most;
  }
};

}  // namespace distributed
MEMKIT_NAMESPACE_END
