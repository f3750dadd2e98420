// memkit/budget/allocator.hpp — what an allocator reserves for the tensors a training step keeps live.
//
// memory_budget reports three figures (docs/memory_budget.md, "Which memory"):
//   allocated  the live tensors: torch.cuda.max_memory_allocated(), or a memkit tracking_resource's peak;
//   reserved   allocated plus what the allocator holds on top of them: torch.cuda.max_memory_reserved();
//   device     reserved plus what is outside any allocator (CUDA context, NCCL buffers): nvidia-smi.
// This header models the step from allocated to reserved.
//
// PyTorch (c10/cuda/CUDACachingAllocator.cpp, native allocator, default settings: no max_split_size,
// no roundup_power2_divisions, expandable_segments off, one stream):
//   - every request is rounded up to a multiple of 512 bytes (round_size);
//   - requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger requests
//     from the large pool: below 10 MiB a 20 MiB segment, from 10 MiB on one segment of the request
//     rounded up to 2 MiB (get_allocation_size);
//   - a request takes the smallest free block of its pool that holds it (best fit, ties by address)
//     before asking cudaMalloc for a new segment; the block is split when the rest is >= 512 bytes
//     (small pool) or > 1 MiB (large pool), otherwise the whole block is handed out and counted as
//     allocated (should_split; allocated_bytes adds block->size);
//   - a freed block merges with free neighbours of its segment and stays cached: reserved memory only
//     grows until empty_cache().
// caching_allocator_model below replays a sequence of allocations and frees with exactly these rules.
// The estimator cannot afford a replay in a constant expression (and does not know the order of every
// temporary), so it uses pool_usage: the segments a set of live tensors needs when they are allocated
// one after another with nothing freed in between. That is the steady-state cost of rounding and
// segment packing; fragmentation from frees across phases and steps (a freed block too small for the
// next request) is not in it, which is what overhead_settings::fragmentation_percent is for.
//
// memkit's own resources cache nothing: device_resource and device_async_resource hand every
// allocation to cudaMalloc / cudaMallocAsync and free it on release, and tracking_resource counts the
// exact bytes asked for (no rounding). For the memkit runtime reserved is allocated, phase by phase.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/units.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

// Which memory a figure (or a fit check, or a --max-* search) means.
enum class metric : std::uint8_t { allocated, reserved, device };
inline constexpr int metric_count = 3;
constexpr std::string_view to_string(metric m) noexcept {
  switch (m) {
    case metric::allocated: return "allocated";
    case metric::reserved: return "reserved";
    case metric::device: return "device";
  }
  return "?";
}

// The three figures of one moment of the step.
struct memory_figures {
  std::uint64_t allocated = 0;
  std::uint64_t reserved = 0;
  std::uint64_t device = 0;
  constexpr std::uint64_t operator[](metric m) const noexcept {
    return m == metric::allocated ? allocated : m == metric::reserved ? reserved : device;
  }
};

// Whose allocator serves the tensors.
enum class allocator_kind : std::uint8_t {
  pytorch_caching,  // PyTorch's CUDA caching allocator, default settings
  memkit_exact,     // memkit's resources: every allocation exactly its bytes, released on free
};

namespace torch_caching {
// The constants of c10/cuda/CUDACachingAllocator.cpp (same names without the k).
inline constexpr std::uint64_t min_block_size = 512;          // kMinBlockSize: all sizes rounded to it
inline constexpr std::uint64_t small_size = 1 * MiB;          // kSmallSize: largest small-pool request
inline constexpr std::uint64_t small_buffer = 2 * MiB;        // kSmallBuffer: small-pool segment
inline constexpr std::uint64_t large_buffer = 20 * MiB;       // kLargeBuffer: segment for 1..10 MiB requests
inline constexpr std::uint64_t min_large_alloc = 10 * MiB;    // kMinLargeAlloc
inline constexpr std::uint64_t round_large = 2 * MiB;         // kRoundLarge

// round_size(): the block size a request of `bytes` asks for (0 stays 0: malloc(0) allocates nothing).
constexpr std::uint64_t round_size(std::uint64_t bytes) noexcept {
  if (bytes == 0) return 0;
  if (bytes < min_block_size) return min_block_size;
  return (bytes + min_block_size - 1) / min_block_size * min_block_size;
}
constexpr bool is_small(std::uint64_t rounded) noexcept { return rounded <= small_size; }
// get_allocation_size(): the cudaMalloc a rounded request makes when no cached block holds it.
constexpr std::uint64_t segment_size(std::uint64_t rounded) noexcept {
  if (rounded <= small_size) return small_buffer;
  if (rounded < min_large_alloc) return large_buffer;
  return (rounded + round_large - 1) / round_large * round_large;
}
// should_split(): is the rest of a `block` bytes free block, after `rounded` is taken, split off?
constexpr bool should_split(std::uint64_t block, std::uint64_t rounded, bool small_pool) noexcept {
  const std::uint64_t remaining = block - rounded;
  return small_pool ? remaining >= min_block_size : remaining > small_size;
}
}  // namespace torch_caching

// The segments PyTorch's allocator holds for a set of live tensors allocated one after another with
// nothing freed in between, kept as counts per request size so that a profile (one block's activations,
// one copy of every parameter) can be scaled to the bytes a phase really holds, in a constant expression:
//   small pool        requests of at most 1 MiB, in 2 MiB segments;
//   large, packed     requests over 1 MiB and under 10 MiB, in 20 MiB segments;
//   large, own        requests of 10 MiB and more: one segment each, rounded up to 2 MiB.
// In the two packed pools, sizes are placed largest first: floor(S / r) requests of r fill a segment of
// S bytes and leave a tail of S mod r, and a smaller request goes into such a tail when it fits there
// (an 8 MiB and two 2 MiB requests share a 20 MiB segment, as q, k, v, o of a grouped-query layer do).
// That is best fit without the order: a replay differs where the order matters (tests/host/
// budget_metrics_test.cpp compares both on real shapes: exact for GPT-2's training state, within 1% for
// TinyLlama's). Counts are doubles, so scaled profiles keep fractions; up to 32 sizes per pool are kept
// apart, further ones packed perfectly.
struct pool_usage {
  struct size_count {
    std::uint64_t size = 0;  // a request size after round_size
    double count = 0;
  };
  static constexpr int max_sizes = 32;
  struct packed_pool {
    size_count sizes[max_sizes]{};
    int used = 0;
    double overflow = 0;  // bytes of sizes past max_sizes, counted as perfectly packed

    constexpr void add(std::uint64_t size, double count) noexcept {
      for (int i = 0; i < used; ++i)
        if (sizes[i].size == size) {
          sizes[i].count += count;
          return;
        }
      if (used < max_sizes) sizes[used++] = size_count{size, count};
      else overflow += count * static_cast<double>(size);
    }
    // Segments of `segment` bytes, largest sizes first, smaller ones first into the tails they fit.
    constexpr std::uint64_t reserved(std::uint64_t segment) const noexcept {
      size_count order[max_sizes]{};
      for (int i = 0; i < used; ++i) {  // insertion sort, largest first
        int j = i;
        while (j > 0 && order[j - 1].size < sizes[i].size) {
          order[j] = order[j - 1];
          --j;
        }
        order[j] = sizes[i];
      }
      size_count tails[max_sizes]{};  // free tails: their size and how many
      int tail_kinds = 0;
      double segments = overflow / static_cast<double>(segment);
      for (int i = 0; i < used; ++i) {
        const std::uint64_t r = order[i].size;
        double left = order[i].count;
        for (int t = 0; t < tail_kinds && left > 0; ++t) {
          if (tails[t].size < r || tails[t].count <= 0) continue;
          const double per_tail = static_cast<double>(tails[t].size / r);
          const double taken = left < tails[t].count * per_tail ? left : tails[t].count * per_tail;
          left -= taken;
          tails[t].count -= taken / per_tail;
        }
        if (left <= 0) continue;
        const std::uint64_t per_segment = segment / r;
        const double opened = left / static_cast<double>(per_segment);
        segments += opened;
        const std::uint64_t tail = segment - per_segment * r;
        if (tail >= torch_caching::min_block_size && tail_kinds < max_sizes) tails[tail_kinds++] = size_count{tail, opened};
      }
      const auto whole = static_cast<std::uint64_t>(segments);
      return (static_cast<double>(whole) < segments ? whole + 1 : whole) * segment;
    }
  };

  double rounded = 0;       // the requests after round_size
  packed_pool small;        // requests of at most 1 MiB
  packed_pool packed;       // requests of 1..10 MiB
  double own_segments = 0;  // the segments of the >= 10 MiB requests
  double unsplit = 0;       // of which tails of at most 1 MiB, not split off: counted as allocated

  constexpr void add(std::uint64_t bytes, std::uint64_t count = 1) noexcept { add_requests(bytes, static_cast<double>(count)); }
  // Adds `factor` times another profile: the same mix of tensors, scaled to other bytes.
  constexpr void add_scaled(const pool_usage& other, double factor) noexcept {
    rounded += factor * other.rounded;
    for (int i = 0; i < other.small.used; ++i) small.add(other.small.sizes[i].size, factor * other.small.sizes[i].count);
    for (int i = 0; i < other.packed.used; ++i) packed.add(other.packed.sizes[i].size, factor * other.packed.sizes[i].count);
    small.overflow += factor * other.small.overflow;
    packed.overflow += factor * other.packed.overflow;
    own_segments += factor * other.own_segments;
    unsplit += factor * other.unsplit;
  }
  // Scaled so that `rounded` becomes `bytes` (nothing when the profile is empty).
  constexpr void add_as(const pool_usage& profile, std::uint64_t bytes) noexcept {
    if (profile.rounded > 0) add_scaled(profile, static_cast<double>(bytes) / profile.rounded);
  }
  constexpr std::uint64_t reserved() const noexcept {
    return small.reserved(torch_caching::small_buffer) + packed.reserved(torch_caching::large_buffer) + up(own_segments);
  }
  // What the segments hold beyond the rounded requests.
  constexpr std::uint64_t slack() const noexcept {
    const std::uint64_t r = reserved(), a = up(rounded);
    return r > a ? r - a : 0;
  }
  // The part of the slack PyTorch counts as allocated (unsplit tails of large segments).
  constexpr std::uint64_t unsplit_tails() const noexcept { return up(unsplit); }

 private:
  constexpr void add_requests(std::uint64_t bytes, double n) noexcept {
    const std::uint64_t size = torch_caching::round_size(bytes);
    if (size == 0 || n <= 0) return;
    rounded += n * static_cast<double>(size);
    if (torch_caching::is_small(size)) small.add(size, n);
    else if (size < torch_caching::min_large_alloc) packed.add(size, n);
    else {
      const std::uint64_t segment = torch_caching::segment_size(size);
      own_segments += n * static_cast<double>(segment);
      if (!torch_caching::should_split(segment, size, false)) unsplit += n * static_cast<double>(segment - size);
    }
  }
  static constexpr std::uint64_t up(double x) noexcept {
    const auto v = static_cast<std::uint64_t>(x);
    return static_cast<double>(v) < x ? v + 1 : v;
  }
};

// A replay of PyTorch's caching allocator: allocate() and free() in program order, with the rules above.
// Deterministic: a new segment's address is above every earlier one (cudaMalloc's addresses are not, which
// only changes which of two equal-sized free blocks is taken). Cost O(blocks) per call; for tests, traces
// and small sequences (also in constant expressions).
class caching_allocator_model {
 public:
  using handle = std::uint64_t;

  // Returns a handle for free(); 0 bytes returns the handle 0 and allocates nothing.
  constexpr handle allocate(std::uint64_t bytes) {
    const std::uint64_t size = torch_caching::round_size(bytes);
    if (size == 0) return 0;
    const bool small = torch_caching::is_small(size);
    std::size_t best = blocks_.size();
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      const block& b = blocks_[i];
      if (b.allocated || b.small != small || b.size < size) continue;
      if (best == blocks_.size() || b.size < blocks_[best].size ||
          (b.size == blocks_[best].size && b.address < blocks_[best].address))
        best = i;
    }
    if (best == blocks_.size()) {  // no cached block holds it: a new segment
      const std::uint64_t segment = torch_caching::segment_size(size);
      blocks_.push_back(block{next_address_, segment, small, false, true, 0});
      next_address_ += segment;
      reserved_ += segment;
      if (reserved_ > peak_reserved_) peak_reserved_ = reserved_;
      best = blocks_.size() - 1;
    }
    block& chosen = blocks_[best];
    if (torch_caching::should_split(chosen.size, size, small)) {
      const block rest{chosen.address + size, chosen.size - size, small, false, false, 0};
      chosen.size = size;
      blocks_.insert(blocks_.begin() + static_cast<std::ptrdiff_t>(best) + 1, rest);
    }
    block& taken = blocks_[best];
    taken.allocated = true;
    taken.id = ++last_id_;
    allocated_ += taken.size;
    if (allocated_ > peak_allocated_) peak_allocated_ = allocated_;
    return taken.id;
  }

  // Releases a handle from allocate() to the cache, merging it with free neighbours of its segment.
  constexpr void free(handle h) {
    if (h == 0) return;
    std::size_t i = 0;
    while (i < blocks_.size() && !(blocks_[i].allocated && blocks_[i].id == h)) ++i;
    if (i == blocks_.size()) return;  // not live: ignored
    blocks_[i].allocated = false;
    allocated_ -= blocks_[i].size;
    // Blocks are kept in address order, so a block's neighbours in its segment are its neighbours in
    // the vector, unless that neighbour starts the next segment (or this block starts its own).
    if (i + 1 < blocks_.size() && !blocks_[i + 1].allocated && !blocks_[i + 1].segment_start) {
      blocks_[i].size += blocks_[i + 1].size;
      blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    }
    if (i > 0 && !blocks_[i - 1].allocated && !blocks_[i].segment_start) {
      blocks_[i - 1].size += blocks_[i].size;
      blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }

  constexpr std::uint64_t allocated_bytes() const noexcept { return allocated_; }
  constexpr std::uint64_t reserved_bytes() const noexcept { return reserved_; }
  constexpr std::uint64_t peak_allocated_bytes() const noexcept { return peak_allocated_; }
  constexpr std::uint64_t peak_reserved_bytes() const noexcept { return peak_reserved_; }
  constexpr std::size_t segments() const noexcept {
    std::size_t count = 0;
    for (const block& b : blocks_) count += b.segment_start ? 1 : 0;
    return count;
  }
  // Bytes of free blocks in the cache (reserved - allocated), and the largest of them.
  constexpr std::uint64_t largest_free_block() const noexcept {
    std::uint64_t largest = 0;
    for (const block& b : blocks_)
      if (!b.allocated && b.size > largest) largest = b.size;
    return largest;
  }

 private:
  struct block {
    std::uint64_t address = 0, size = 0;
    bool small = false, allocated = false;
    bool segment_start = false;  // the first block of a cudaMalloc'd segment
    handle id = 0;
  };

  std::vector<block> blocks_;  // every block of every segment, in address order
  std::uint64_t next_address_ = 0, last_id_ = 0;
  std::uint64_t allocated_ = 0, reserved_ = 0, peak_allocated_ = 0, peak_reserved_ = 0;
};

// memkit's resources as a model of the same interface: each allocation is exactly its bytes (what
// tracking_resource counts) and goes back to the driver when freed, so reserved is what is live.
class exact_allocator_model {
 public:
  using handle = std::uint64_t;
  constexpr handle allocate(std::uint64_t bytes) {
    if (bytes == 0) return 0;
    live_.push_back(entry{++last_id_, bytes});
    allocated_ += bytes;
    if (allocated_ > peak_) peak_ = allocated_;
    return last_id_;
  }
  constexpr void free(handle h) {
    for (std::size_t i = 0; i < live_.size(); ++i)
      if (live_[i].id == h) {
        allocated_ -= live_[i].bytes;
        live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
  }
  constexpr std::uint64_t allocated_bytes() const noexcept { return allocated_; }
  constexpr std::uint64_t reserved_bytes() const noexcept { return allocated_; }
  constexpr std::uint64_t peak_allocated_bytes() const noexcept { return peak_; }
  constexpr std::uint64_t peak_reserved_bytes() const noexcept { return peak_; }

 private:
  struct entry {
    handle id;
    std::uint64_t bytes;
  };
  std::vector<entry> live_;
  std::uint64_t last_id_ = 0, allocated_ = 0, peak_ = 0;
};

}  // namespace budget
MEMKIT_NAMESPACE_END
