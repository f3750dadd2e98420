// memkit/loss/bytes.hpp — the loss's options, the protocol's arguments struct, the chunk rule and the constexpr
// byte functions (docs/architecture.md, "The component protocol"), without the kernels: memory_budget includes
// this header alone. fused_linear_cross_entropy.hpp (the operation) includes it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "memkit/config.hpp"
#include "memkit/core/cublas.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/protocol.hpp"
// For gemm_workspace_bytes (the host products' packing buffers), without the GEMM kernels.
#include "memkit/linalg/gemm_bytes.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace loss {

// How the token losses become the output: their mean over the counted tokens (one float), or none: each token's
// loss (one float per token, 0 for ignored ones) for callers that weight tokens themselves; the gradients are then
// those of sum_i d_loss_i * loss_i for the per-token upstream gradient d_loss the caller passes.
enum class reduction_mode : std::uint8_t { mean, none };

// Which kernel turns a chunk's fp32 logits into their gradient on CUDA (the host ignores it). classic: three
// reads of each row and two writes (the capped logits written back, then the gradient). staged (#30, opt-in until
// a GPU has timed it): a row that fits in shared memory (V * 4 bytes within the device's opt-in limit) is read
// once into it and the gradient written once, with the classic kernel's reduction order (the same bits by
// construction; the GPU test that compares them has not run yet); a larger row is read twice (an online max and
// sum of exp, then the gradient) with nothing written back, in a different reduction order (docs/loss.md, "The
// device row pass").
enum class device_row_pass : std::uint8_t { classic, staged };

struct cross_entropy_options {
  std::int64_t ignore_index = -100;  // tokens with this target add nothing to the loss or the gradients
  float label_smoothing = 0;         // eps in [0, 1]: the target distribution is (1 - eps) one-hot + eps uniform
  float logit_softcap = 0;           // > 0: logits pass through cap * tanh(logit / cap) (Gemma 2); 0: off
  float z_loss = 0;                  // >= 0: adds z_loss * lse^2 per token (PaLM), keeping lse near 0
  std::size_t chunk_bytes = 0;       // budget of one chunk's logits buffers; 0: default_chunk_bytes
  int host_threads = 0;              // host: 0 = every hardware thread
  reduction_mode reduction = reduction_mode::mean;  // mean: loss [1]; none: loss [N] per token (above)
  device_row_pass row_pass = device_row_pass::classic;  // CUDA's row kernel (above); no effect on bytes
};

// 32 MiB: a few hundred tokens of a 32K-128K vocabulary per chunk, big enough for efficient products.
inline constexpr std::size_t default_chunk_bytes = std::size_t{32} << 20;
// Values of a dequantized tile of a quantized head (16 MiB of fp32 on the host, 8 MiB of bf16 on a device).
inline constexpr std::int64_t quantized_tile_values = std::int64_t{1} << 22;
// Host: inputs are rejected when H * max|hidden| * max|head| exceeds this, as the logits, lse^2 (z-loss)
// or the gradients could then overflow fp32.
inline constexpr double max_logit_bound = 1e30;

// The component protocol (docs/architecture.md): one call of fused_linear_cross_entropy, as a literal struct.
struct fused_linear_cross_entropy_arguments {
  std::int64_t tokens = 0, hidden = 0, vocab = 0;  // N, H, V
  std::size_t hidden_element_bytes = 4;            // 4: fp32 hidden states; 2: bf16 or fp16
  std::size_t head_element_bytes = 0;              // a dense head's element size; 0: the hidden states'
  bool quantized_head = false;                     // a quant::quantized_tensor head (never trains)
  bool head_grad = true;                           // d_head given (dense heads only)
  bool hidden_grad = true;                         // d_hidden given
  bool on_device = false;
  cross_entropy_options options{};
};

namespace detail {

// Bytes per token of a chunk: the fp32 logits, and on a device with 16-bit hidden also their 16-bit gradient
// (cuBLAS multiplies operands of one type).
constexpr std::size_t chunk_row_bytes(std::int64_t V, std::size_t elem_size, bool on_device) noexcept {
  return static_cast<std::size_t>(V) * (4 + (on_device && elem_size != 4 ? elem_size : 0));
}

// Rows of a quantized head dequantized per tile: at least one, at most V.
constexpr std::int64_t head_tile_rows(std::int64_t V, std::int64_t H) noexcept {
  const std::int64_t rows = H > 0 ? quantized_tile_values / H : V;
  return std::max<std::int64_t>(1, std::min(rows, V));
}

}  // namespace detail

// The chunk rule, one function for the host pass, the device pass and the byte functions: the tokens whose
// chunk buffers (detail::chunk_row_bytes each) fit in `chunk_bytes`; 0 when not even one token's do.
constexpr std::int64_t tokens_per_chunk(std::size_t chunk_bytes, std::int64_t V, std::size_t elem_size,
                                        bool on_device = false) noexcept {
  const std::size_t row = detail::chunk_row_bytes(V, elem_size, on_device);
  return row > 0 ? static_cast<std::int64_t>(chunk_bytes / row) : std::int64_t{1} << 62;
}
// Its inverse: the chunk budget (cross_entropy_options::chunk_bytes) whose chunks hold `tokens` tokens.
constexpr std::size_t chunk_bytes_for(std::int64_t tokens, std::int64_t V, std::size_t elem_size,
                                      bool on_device = false) noexcept {
  return static_cast<std::size_t>(tokens) * detail::chunk_row_bytes(V, elem_size, on_device);
}

// The most tokens one chunk may hold, whatever the memory (#31): on a device a chunk's logits [rows, V] and
// their gradient are each one operand of a cuBLAS call, which may span at most INT32_MAX elements
// (detail::cublas_operand_elements, core/cublas.hpp), so rows * V stays within it: 16,743 tokens for a
// 128,256-token vocabulary (an 8 GiB fp32 chunk, far past where a larger chunk still buys speed). The host
// keeps the same limit, so host, device and memory_budget choose the same chunk. At least one token.
constexpr std::int64_t max_chunk_tokens(std::int64_t V) noexcept {
  constexpr std::int64_t most = ::memkit::detail::cublas_operand_elements;  // INT32_MAX
  return V > 0 ? std::max<std::int64_t>(1, most / V) : std::int64_t{1} << 62;
}

// Tokens per chunk of a call over N tokens: tokens_per_chunk of options.chunk_bytes (0: default_chunk_bytes),
// at least one, at most N and at most max_chunk_tokens(V).
constexpr std::int64_t chunk_tokens(std::int64_t N, std::int64_t V, std::size_t elem_size,
                                    const cross_entropy_options& options, bool on_device = false) noexcept {
  const std::size_t budget = options.chunk_bytes != 0 ? options.chunk_bytes : default_chunk_bytes;
  return std::max<std::int64_t>(1, std::min({tokens_per_chunk(budget, V, elem_size, on_device), N, max_chunk_tokens(V)}));
}

namespace detail {
// Exact bytes one call takes from its workspace resource, for hidden of element type T and a dense head of
// element type W (W is ignored for a quantized head).
template <float_storage T, float_storage W>
constexpr std::size_t workspace_bytes_of(const fused_linear_cross_entropy_arguments& a) noexcept {
  const std::int64_t N = a.tokens, H = a.hidden, V = a.vocab;
  const cross_entropy_options& options = a.options;
  if (N <= 0) return 0;
  const std::size_t e = sizeof(T);
  const std::int64_t c = chunk_tokens(N, V, e, options, a.on_device);
  const bool head_grad = a.head_grad && !a.quantized_head;
  const std::int64_t tile = a.quantized_head ? head_tile_rows(V, H) : V;
  const bool tiled = tile < V;  // the hidden gradient sums over several tiles: an fp32 accumulator for 16-bit T
  // The chunk's logits, and for the mean the row losses it sums (reduction none writes them into `loss` itself).
  const bool mean = options.reduction == reduction_mode::mean;
  std::size_t bytes = static_cast<std::size_t>(c * V) * 4 + (mean ? static_cast<std::size_t>(N) * 4 : 0);
  if (a.on_device) {
    bytes += 2 * sizeof(int);                                              // counted tokens, bad-target flag
    if (e != 4) bytes += static_cast<std::size_t>(c * V) * e;              // 16-bit gradient of the logits
    if (a.quantized_head) bytes += static_cast<std::size_t>(tile * H) * e;  // dequantized tile
    if (a.hidden_grad && tiled && e != 4) bytes += static_cast<std::size_t>(c * H) * 4;
    return bytes;
  }
  const linalg::gemm_options g{options.host_threads};
  std::size_t gemm = 0;
  if (a.quantized_head) {
    bytes += static_cast<std::size_t>(tile * H) * 4;  // fp32 tile
    gemm = linalg::gemm_workspace_bytes<T, float, float>(c, tile, H, g);
    if (a.hidden_grad) {
      if (tiled) {
        if (e != 4) bytes += static_cast<std::size_t>(c * H) * 4;
        gemm = std::max(gemm, linalg::gemm_workspace_bytes<float, float, float>(c, H, tile, g));
      } else {
        gemm = std::max(gemm, linalg::gemm_workspace_bytes<float, float, T>(c, H, V, g));
      }
    }
  } else {
    gemm = linalg::gemm_workspace_bytes<T, W, float>(c, V, H, g);
    if (head_grad) gemm = std::max(gemm, linalg::gemm_workspace_bytes<float, T, float>(V, H, c, g));
    if (a.hidden_grad) gemm = std::max(gemm, linalg::gemm_workspace_bytes<float, W, T>(c, H, V, g));
  }
  return bytes + gemm;
}
}  // namespace detail

// Exact bytes one call takes from its workspace resource. The host count depends only on whether each
// operand is fp32 or 16-bit (bf16 and fp16 pack alike). With options.host_threads = 0 it depends on the
// machine (the GEMM's packing buffers are per thread), so it is known only at run time.
constexpr std::size_t workspace_bytes(const fused_linear_cross_entropy_arguments& a) noexcept {
  const std::size_t head = a.head_element_bytes != 0 ? a.head_element_bytes : a.hidden_element_bytes;
  if (a.hidden_element_bytes == 4)
    return head == 4 ? detail::workspace_bytes_of<float, float>(a) : detail::workspace_bytes_of<float, bf16>(a);
  return head == 4 ? detail::workspace_bytes_of<bf16, float>(a) : detail::workspace_bytes_of<bf16, bf16>(a);
}
// The loss saves nothing for a later pass: it computes the gradients in the same call.
constexpr std::size_t saved_bytes(const fused_linear_cross_entropy_arguments&) noexcept { return 0; }
constexpr std::size_t bytes_required(const fused_linear_cross_entropy_arguments& a) noexcept {
  return workspace_bytes(a);
}

static_assert(operation_arguments<fused_linear_cross_entropy_arguments>);

// The chunk from a memory budget (#30, #31): the most tokens per chunk, at most `most` (0: N) and
// max_chunk_tokens(vocab), for which the whole call (bytes_required: the chunk buffers, the per-token losses,
// the host GEMM's packing) fits in `available` bytes; 0 when even a one-token chunk does not. a.options.chunk_bytes is ignored; pass
// chunk_bytes_for(result, ...) to the call. A bisection over bytes_required that only ever keeps a chunk it
// checked, so bytes_required(result) <= available holds even where the host GEMM's thread split makes the
// bytes not quite monotone in the chunk.
constexpr std::int64_t chunk_tokens_within(fused_linear_cross_entropy_arguments a, std::size_t available,
                                           std::int64_t most = 0) noexcept {
  const std::size_t e = a.hidden_element_bytes;
  const auto fits = [&](std::int64_t c) {
    a.options.chunk_bytes = chunk_bytes_for(c, a.vocab, e, a.on_device);
    return bytes_required(a) <= available;
  };
  std::int64_t high = std::min(a.tokens, max_chunk_tokens(a.vocab));  // no larger chunk is ever run
  if (most > 0 && most < high) high = most;
  if (high <= 0) return 0;
  if (fits(high)) return high;
  std::int64_t low = 0;  // low == 0 or fits(low)
  while (high - low > 1) {
    const std::int64_t mid = low + (high - low) / 2;
    (fits(mid) ? low : high) = mid;
  }
  return low;
}

}  // namespace loss
MEMKIT_NAMESPACE_END
