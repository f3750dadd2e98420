// memkit/attention/bytes.hpp — attention's options, the protocol's arguments structs and their constexpr byte
// functions (docs/architecture.md, "The component protocol"), without the kernels: memory_budget includes this
// header alone. flash_attention.hpp (the operations) includes it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "memkit/config.hpp"
#include "memkit/core/hardware_threads.hpp"
#include "memkit/core/protocol.hpp"
#include "memkit/core/tensor_view.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace attention {

// Which CUDA kernels run (the host ignores it). `wmma`: the WMMA kernels, every dtype and head_dim <= 128. `mma`:
// the FlashAttention-2-structured kernels (mma.sync m16n8k16 + ldmatrix, cp.async double-buffered tiles, the
// accumulators in registers) for the forward and backward's dk/dv and dq passes, bf16 / fp16 at head_dim 64, 96,
// 128 or 256 with 16-byte-aligned tensors; other problems (and backward's small delta kernel) run the WMMA / plain
// kernels, except head_dim 256, which only `mma` runs (an error otherwise). `automatic` picks `wmma`
// today: the mma kernels were written without a GPU, and `automatic` switches to them only once a GPU run has
// passed tests/cuda/attention_test.cu with them (issue 29). Same saved tensors and byte functions under all.
enum class attention_kernel : std::uint8_t { automatic, wmma, mma };

struct attention_options {
  bool causal = true;
  std::int64_t window = 0;  // 0: no sliding window; else query i sees keys with |i - j| < window
  float scale = 0;          // 0: 1 / sqrt(head_dim)
  int host_threads = 0;     // 0: every hardware thread
  attention_kernel kernel = attention_kernel::automatic;  // CUDA only (above)
};

// Host tile sizes: a 64 x 64 fp32 score tile and 64-row K/V tiles (D = 128: 32 KiB each) stay in L1/L2.
inline constexpr std::int64_t host_query_tile = 64;
inline constexpr std::int64_t host_key_tile = 64;

namespace detail {

constexpr std::int64_t tiles_of(std::int64_t count, std::int64_t tile) noexcept { return (count + tile - 1) / tile; }
constexpr std::int64_t round_to_16(std::int64_t floats) noexcept { return (floats + 15) / 16 * 16; }

// The threads the host path runs: the option's count (all hardware threads for 0), never more than the items.
// Not a constant expression for host_threads == 0 (the hardware is asked at run time).
constexpr std::int64_t host_parts(std::int64_t items, int host_threads) noexcept {
  const std::int64_t threads = host_threads > 0 ? host_threads : hardware_threads();
  return std::max<std::int64_t>(1, std::min(threads, items));
}

// fp32 scratch of one thread: forward keeps Q, O (query tile), K^T, V (key tile), one score row, m and l.
constexpr std::int64_t forward_part_floats(std::int64_t D) noexcept {
  return round_to_16(2 * host_query_tile * D + 2 * host_key_tile * D + host_key_tile + 2 * host_query_tile);
}
// Backward: the key pass keeps K^T, V^T, dK, dV (key tile), Q, dO (query tile); the query pass K^T, V^T, K
// (key tile), Q, dO, dQ (query tile); both three score rows and lse, delta of the query tile.
constexpr std::int64_t backward_part_floats(std::int64_t D) noexcept {
  return round_to_16(4 * host_key_tile * D + 3 * host_query_tile * D + 3 * host_key_tile + 2 * host_query_tile);
}

}  // namespace detail

// Packed documents (varlen): offsets int32 [B, N + 1] per batch row, 0 = o[0] <= o[1] <= ... <= o[N] = S; document
// d is positions [o[d], o[d+1]) (empty documents pad rows with fewer of them). Attention never crosses a document
// boundary: its masks are intersected with the document of the query (forward, dq pass) or of the key (dk/dv
// pass); a model's rotary positions restart at each document's start (models/llama). Without offsets (null) a row
// is one document [0, S), and every bound is the one of before.
struct position_span {
  std::int64_t begin, end;
};
// The document holding position i of batch row b (offsets: `count` = N + 1 ints per row). Clamped into [0, S)
// and around i, so that offsets the host could not check (device memory) never make a kernel leave its row.
MEMKIT_HOST_DEVICE constexpr position_span document_of(const std::int32_t* offsets, std::int64_t count, std::int64_t b,
                                                    std::int64_t i, std::int64_t S) noexcept {
  if (offsets == nullptr) return {0, S};
  const std::int32_t* row = offsets + b * count;
  std::int64_t lo = 0, hi = count - 1;  // the last document d < N with row[d] <= i lies in [lo, hi)
  while (hi - lo > 1) {
    const std::int64_t mid = (lo + hi) / 2;
    if (row[mid] <= i) lo = mid;
    else hi = mid;
  }
  const std::int64_t begin = row[lo], end = row[lo + 1];
  return {begin < 0 ? 0 : (begin > i ? i : begin), end <= i ? i + 1 : (end > S ? S : end)};
}

namespace detail {
// The offsets' contents: each row starts at 0, never decreases and ends at `sequence`. Host-readable memory only.
inline void check_document_offsets(const std::string& who, const tensor_view<const std::int32_t>& offsets,
                                   std::int64_t batch, std::int64_t sequence) {
  require(offsets.shape().rank == 2 && offsets.shape()[0] == batch && offsets.shape()[1] >= 2,
          who + ": document_offsets must be int32 [batch = " + std::to_string(batch) +
              ", documents + 1 >= 2], got " + to_string(offsets.shape()));
  require(offsets.data() != nullptr, who + ": document_offsets has no data (null pointer)");
  require(offsets.where() != memory_kind::device,
          who + ": document_offsets' contents can only be checked in host-readable memory");
  const std::int64_t count = offsets.shape()[1];
  // Messages are built only on failure: this runs on every call (each block, forward and backward).
  const auto fail = [&](std::int64_t b, const std::string& problem) {
    throw error(who + ": document_offsets of batch row " + std::to_string(b) + " " + problem);
  };
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int32_t* row = offsets.data() + b * count;
    if (row[0] != 0) fail(b, "must start at 0, got " + std::to_string(row[0]));
    for (std::int64_t d = 1; d < count; ++d)
      if (row[d] < row[d - 1])
        fail(b, "must not decrease: offset " + std::to_string(d) + " is " + std::to_string(row[d]) + " after " +
                    std::to_string(row[d - 1]));
    if (row[count - 1] != sequence)
      fail(b, "must end at the sequence length " + std::to_string(sequence) + ", got " + std::to_string(row[count - 1]));
  }
}

}  // namespace detail

// Checks packed-document offsets in host-readable memory (a loader's copy before it goes to the device): int32
// [batch, N + 1], each row starting at 0, never decreasing, ending at `sequence`. Throws memkit::error naming the
// row and offset otherwise.
inline void check_document_offsets(tensor_view<const std::int32_t> document_offsets, std::int64_t batch,
                                   std::int64_t sequence) {
  detail::check_document_offsets("attention::check_document_offsets", document_offsets, batch, sequence);
}

// --- The component protocol (docs/architecture.md): the problem of one call, and three byte functions. ---

// q [B, Hq, S, D], k and v [B, Hkv, S, D] of element_bytes each (4: fp32, 2: bf16 / fp16).
struct problem_arguments {
  std::int64_t batch = 0, query_heads = 0, kv_heads = 0, sequence = 0, head_dim = 0;
  std::size_t element_bytes = 2;
  bool on_device = false;
  attention_options options{};
};
struct forward_arguments : problem_arguments {};
struct backward_arguments : problem_arguments {};

namespace detail {
constexpr bool no_work(const problem_arguments& a) noexcept {
  return a.batch <= 0 || a.query_heads <= 0 || a.sequence <= 0 || a.head_dim <= 0;
}
constexpr std::int64_t host_items(const problem_arguments& a) noexcept {
  return a.batch * a.query_heads * tiles_of(a.sequence, host_query_tile);
}
}  // namespace detail

// Bytes forward takes from `workspace` (host: per-thread tiles; CUDA: none).
constexpr std::size_t workspace_bytes(const forward_arguments& a) noexcept {
  if (a.on_device || detail::no_work(a)) return 0;
  return static_cast<std::size_t>(detail::host_parts(detail::host_items(a), a.options.host_threads) *
                                  detail::forward_part_floats(a.head_dim)) *
         sizeof(float);
}
// What forward leaves for backward, in tensors the caller holds: out [B, Hq, S, D] and lse fp32 [B, Hq, S]
// (plus q, k, v, which its caller owns or saves anyway).
constexpr std::size_t saved_bytes(const forward_arguments& a) noexcept {
  const std::int64_t rows = a.batch * a.query_heads * a.sequence;
  return static_cast<std::size_t>(rows * a.head_dim) * a.element_bytes + static_cast<std::size_t>(rows) * sizeof(float);
}
// Forward allocates nothing it keeps: out and lse are the caller's.
constexpr std::size_t bytes_required(const forward_arguments& a) noexcept { return workspace_bytes(a); }

// Bytes backward takes from `workspace`: delta fp32 [B, Hq, S], plus per-thread tiles on the host.
constexpr std::size_t workspace_bytes(const backward_arguments& a) noexcept {
  if (detail::no_work(a)) return 0;
  const std::size_t delta =
      static_cast<std::size_t>(detail::round_to_16(a.batch * a.query_heads * a.sequence)) * sizeof(float);
  if (a.on_device) return delta;
  return delta + static_cast<std::size_t>(detail::host_parts(detail::host_items(a), a.options.host_threads) *
                                          detail::backward_part_floats(a.head_dim)) *
                     sizeof(float);
}
constexpr std::size_t saved_bytes(const backward_arguments&) noexcept { return 0; }
constexpr std::size_t bytes_required(const backward_arguments& a) noexcept { return workspace_bytes(a); }

// What a materialized (eager) attention holds at its peak besides q, k, v, out and their gradients: the fp32
// probabilities [B, Hq, S, S] saved by forward, and the fp32 gradient of the scores in backward.
constexpr std::size_t eager_attention_bytes(std::int64_t B, std::int64_t Hq, std::int64_t S) noexcept {
  return 2 * static_cast<std::size_t>(B * Hq * S * S) * sizeof(float);
}

static_assert(operation_arguments<forward_arguments> && operation_arguments<backward_arguments>);

}  // namespace attention
MEMKIT_NAMESPACE_END
