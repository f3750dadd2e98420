// memkit/loss/fused_linear_cross_entropy.hpp — the LM head's matmul and the cross-entropy loss in one pass
// over chunks of tokens, so the [tokens, vocab] logits never exist.
//
//   logits = hidden [N, H] * head [V, H]^T          (fp32 accumulation, one chunk of tokens at a time)
//   z      = cap * tanh(logits / cap)               (optional soft-capping, cap = logit_softcap > 0)
//   loss_i = lse_i - (1 - eps) z_i,t - eps/V sum_j z_i,j + z_loss * lse_i^2     (lse_i = log sum_j exp z_i,j)
//   loss   = sum over counted tokens of loss_i / counted   (counted: targets != ignore_index)
//
// Per chunk of tokens the fp32 logits are computed, turned in place into their gradient, and at once
// multiplied back: d_hidden = dlogits * head (overwritten), d_head += dlogits^T * hidden (accumulated;
// only for a dense head that trains). The chunk's logits are the largest buffer; how many tokens a chunk
// holds follows from options.chunk_bytes. The head is either a dense tensor_view [V, H] or a frozen
// quant::quantized_tensor [V, H], dequantized a tile of rows at a time (the same tiling quant::matmul
// uses) so that it never exists dense either.
//
// Host: products through linalg::gemm (packed AVX2 / AVX-512 kernels), the per-row softmax over
// memkit's host threads with its exp passes 16 lanes wide (AVX-512, AVX2 or portable C++, chosen by
// core/host_simd.hpp, all giving the same bits); the result does not depend on the thread count. Bad input throws memkit::error
// before any output is written: shapes, target ids out of range, NaN/Inf in hidden or head, and values
// so large the fp32 logits could overflow.
// CUDA: cuBLAS (core/cublas.hpp) for the products and small kernels for counting, the softmax/gradient
// and the final mean, all on the executor's stream, with no synchronization: the loss stays in device
// memory. Shape errors still throw; target ids out of range make the loss NaN (checking them on the host
// would need a sync), and NaN/Inf in the inputs propagate into the loss.
//
// A batch in which every target is ignore_index counts 0 tokens: the loss is 0, d_hidden is 0 and
// d_head is left unchanged (a micro-batch of padding contributes nothing), on the host and on CUDA.
//
// workspace_bytes(fused_linear_cross_entropy_arguments{...}) says exactly what a call takes from `workspace`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/cublas.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/protocol.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/linalg/gemm.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/matmul.hpp"
#include "memkit/quant/quantized_tensor.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace loss {

struct cross_entropy_options {
  std::int64_t ignore_index = -100;  // tokens with this target add nothing to the loss or the gradients
  float label_smoothing = 0;         // eps in [0, 1]: the target distribution is (1 - eps) one-hot + eps uniform
  float logit_softcap = 0;           // > 0: logits pass through cap * tanh(logit / cap) (Gemma 2); 0: off
  float z_loss = 0;                  // >= 0: adds z_loss * lse^2 per token (PaLM), keeping lse near 0
  std::size_t chunk_bytes = 0;       // budget of one chunk's logits buffers; 0: default_chunk_bytes
  int host_threads = 0;              // host: 0 = every hardware thread
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

// Tokens per chunk: as many as options.chunk_bytes holds (at least one, at most N).
constexpr std::int64_t chunk_tokens(std::int64_t N, std::int64_t V, std::size_t elem_size,
                                    const cross_entropy_options& options, bool on_device = false) noexcept {
  const std::size_t budget = options.chunk_bytes != 0 ? options.chunk_bytes : default_chunk_bytes;
  const std::size_t row = detail::chunk_row_bytes(V, elem_size, on_device);
  const std::int64_t rows = row > 0 ? static_cast<std::int64_t>(budget / row) : N;
  return std::max<std::int64_t>(1, std::min(rows, N));
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
  std::size_t bytes = static_cast<std::size_t>(c * V) * 4 + static_cast<std::size_t>(N) * 4;  // logits, row losses
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

// --- The math of one token's row, shared by the host loops and the CUDA kernels. ---
namespace detail {

struct row_math {
  float softcap = 0, z_loss = 0, smoothing = 0;
  std::int64_t vocab = 1;

  // The logit the softmax sees.
  MEMKIT_HOST_DEVICE float capped(float raw) const noexcept { return softcap > 0 ? softcap * tanhf(raw / softcap) : raw; }
  // loss_i from lse = log sum exp z, the target's z and the row's sum of z.
  MEMKIT_HOST_DEVICE float token_loss(float lse, float z_target, float z_sum) const noexcept {
    float loss = lse - (1.0f - smoothing) * z_target;
    if (smoothing > 0) loss -= smoothing / static_cast<float>(vocab) * z_sum;
    if (z_loss > 0) loss += z_loss * lse * lse;
    return loss;
  }
  // d loss_i / d raw logit j, times `scale` (1 / counted tokens). z is the capped logit.
  MEMKIT_HOST_DEVICE float gradient(float z, float lse, bool is_target, float scale) const noexcept {
    const float p = expf(z - lse);
    float g = p * (1.0f + 2.0f * z_loss * lse) - (is_target ? 1.0f - smoothing : 0.0f) -
              smoothing / static_cast<float>(vocab);
    if (softcap > 0) {
      const float t = z / softcap;  // tanh(raw / cap): d z / d raw = 1 - tanh^2
      g *= 1.0f - t * t;
    }
    return g * scale;
  }
};

inline row_math make_row_math(const cross_entropy_options& options, std::int64_t V) {
  return {options.logit_softcap, options.z_loss, options.label_smoothing, V};
}

// An output the caller does not want: a default-constructed view (rank 0, no data) or one with no elements.
struct loss_dims {
  std::int64_t N, H, V;
};

template <class T, class Td>
loss_dims check_arguments(const char* operation, const tensor_view<const T>& hidden, const shape& head_shape,
                          const tensor_view<const std::int32_t>& targets, const tensor_view<float>& loss,
                          const tensor_view<Td>& d_hidden, const tensor_view<float>& d_head,
                          const cross_entropy_options& options) {
  const std::string op(operation);
  require(hidden.shape().rank == 2, op + ": `hidden` must be [tokens, hidden], has shape " + to_string(hidden.shape()));
  require(head_shape.rank == 2, op + ": `head` must be [vocab, hidden], has shape " + to_string(head_shape));
  const std::int64_t N = hidden.shape()[0], H = hidden.shape()[1], V = head_shape[0];
  require(head_shape[1] == H, op + ": `head` has shape " + to_string(head_shape) + " but `hidden` " +
                                  to_string(hidden.shape()) + " needs [vocab, " + std::to_string(H) + "]");
  require(V > 0, op + ": the vocabulary is empty (`head` has shape " + to_string(head_shape) + ")");
  require(targets.shape() == shape{N}, op + ": `targets` has shape " + to_string(targets.shape()) + " but needs [" +
                                           std::to_string(N) + "], one id per token of `hidden`");
  require(loss.size() == 1, op + ": `loss` must hold 1 float, has shape " + to_string(loss.shape()));
  require(d_hidden.is_none() || d_hidden.shape() == hidden.shape(),
          op + ": `d_hidden` has shape " + to_string(d_hidden.shape()) + " but `hidden` has shape " +
              to_string(hidden.shape()) + " (pass tensor_view::none() to skip it)");
  require(d_head.is_none() || d_head.shape() == head_shape,
          op + ": `d_head` has shape " + to_string(d_head.shape()) + " but `head` has shape " + to_string(head_shape) +
              " (pass tensor_view::none() for a frozen head)");
  const auto has_data = [&](const void* data, std::int64_t size, const char* name) {
    require(size == 0 || data != nullptr, op + ": `" + name + "` has elements but no data pointer");
  };
  has_data(hidden.data(), hidden.size(), "hidden");
  has_data(targets.data(), targets.size(), "targets");
  has_data(loss.data(), loss.size(), "loss");
  if (!d_hidden.is_none()) has_data(d_hidden.data(), d_hidden.size(), "d_hidden");
  if (!d_head.is_none()) has_data(d_head.data(), d_head.size(), "d_head");
  require(options.label_smoothing >= 0 && options.label_smoothing <= 1,
          op + ": label_smoothing must be in [0, 1], got " + std::to_string(options.label_smoothing));
  require(options.logit_softcap >= 0 && std::isfinite(options.logit_softcap),
          op + ": logit_softcap must be >= 0 and finite, got " + std::to_string(options.logit_softcap));
  require(options.z_loss >= 0 && std::isfinite(options.z_loss),
          op + ": z_loss must be >= 0 and finite, got " + std::to_string(options.z_loss));
  require_host_threads(op, options.host_threads);
  return {N, H, V};
}

// --- Host ---

// Largest |value| of `count` values; throws naming `what` and the row if one is NaN or Inf.
template <class T>
double host_max_abs(const T* values, std::int64_t rows, std::int64_t cols, const char* operation, const char* what,
                    std::int64_t first_row = 0) {
  float largest = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    float row_largest = 0;
    bool finite = true;
    for (std::int64_t j = 0; j < cols; ++j) {
      const float v = to_float(values[r * cols + j]);
      finite &= std::isfinite(v);
      row_largest = std::max(row_largest, std::fabs(v));
    }
    if (!finite)
      throw error(std::string(operation) + ": `" + what + "` has a NaN or Inf value in row " +
                  std::to_string(first_row + r));
    largest = std::max(largest, row_largest);
  }
  return largest;
}

// --- The host row pass. The two exp passes and the gradient run 16 lanes wide: AVX-512 (one register), AVX2
//     (two) or portable C++ (an array), with the same operations in the same order, so every instruction set
//     gives the same bits. exp(x) = 2^n * e^r with n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts)
//     and e^r by its degree-7 Taylor polynomial (|r| <= ln 2 / 2: error below 1e-8 relative); arguments are
//     <= 0 here and are clamped at -87 (e^-87 ~ 1.6e-38, the smallest normal floats). ---
struct fast_exp {
  static constexpr float lower = -87.0f, log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
  static constexpr float taylor[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  static float scalar(float x) noexcept {
    x = std::max(x, lower);
    const float n = std::nearbyint(x * log2e);
    float r = std::fma(n, -ln2_hi, x);
    r = std::fma(n, -ln2_lo, r);
    float p = taylor[0];
    for (int k = 1; k < 8; ++k) p = std::fma(p, r, taylor[k]);
    const std::uint32_t bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
  }
};

// The gradient of one logit from its capped value z: (e^(z - lse) * a - b) [* (1 - (z / cap)^2)], where
// a = (1 + 2 z_loss lse) * scale and b = eps / V * scale; the target's extra -(1 - eps) * scale comes after.
struct row_gradient_terms {
  float lse, a, b, softcap;
};

inline float sum_lanes(const float* lanes) noexcept {
  float total = 0;
  for (int k = 0; k < 16; ++k) total += lanes[k];
  return total;
}

struct row_pass_portable {
  // Largest value and the 16-lane sum of the row.
  static void max_and_sum(const float* z, std::int64_t V, float& largest, float& total) noexcept {
    float lanes[16] = {};
    float m = -std::numeric_limits<float>::infinity();
    for (std::int64_t j = 0; j < V; ++j) {
      m = std::max(m, z[j]);
      lanes[j % 16] += z[j];
    }
    largest = m;
    total = sum_lanes(lanes);
  }
  static float exp_sum(const float* z, std::int64_t V, float shift) noexcept {
    float lanes[16] = {};
    for (std::int64_t j = 0; j < V; ++j) lanes[j % 16] += fast_exp::scalar(z[j] - shift);
    return sum_lanes(lanes);
  }
  static void gradient(float* z, std::int64_t V, const row_gradient_terms& t) noexcept {
    for (std::int64_t j = 0; j < V; ++j) {
      float g = std::fma(fast_exp::scalar(z[j] - t.lse), t.a, -t.b);
      if (t.softcap > 0) {
        const float u = z[j] / t.softcap;
        g *= std::fma(-u, u, 1.0f);
      }
      z[j] = g;
    }
  }
};

#if MEMKIT_X86_DISPATCH
struct row_pass_avx512 {
  // The zero-masked forms: GCC 12 warns about the unmasked ones' undefined pass-through operand.
  __attribute__((target("avx512f"))) static __m512 exp(__m512 x) noexcept {
    x = _mm512_maskz_max_ps(0xffff, x, _mm512_set1_ps(fast_exp::lower));
    const __m512 n = _mm512_maskz_roundscale_ps(0xffff, _mm512_mul_ps(x, _mm512_set1_ps(fast_exp::log2e)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-fast_exp::ln2_hi), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-fast_exp::ln2_lo), r);
    __m512 p = _mm512_set1_ps(fast_exp::taylor[0]);
    for (int k = 1; k < 8; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(fast_exp::taylor[k]));
    const __m512i bits = _mm512_maskz_slli_epi32(
        0xffff, _mm512_add_epi32(_mm512_maskz_cvtps_epi32(0xffff, n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  }
  static __mmask16 tail_mask(std::int64_t count) noexcept { return static_cast<__mmask16>((1u << count) - 1u); }
  __attribute__((target("avx512f"))) static void max_and_sum(const float* z, std::int64_t V, float& largest,
                                                             float& total) noexcept {
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s = _mm512_setzero_ps();
    std::int64_t j = 0;
    for (; j + 16 <= V; j += 16) {
      const __m512 v = _mm512_loadu_ps(z + j);
      m = _mm512_maskz_max_ps(0xffff, m, v);
      s = _mm512_add_ps(s, v);
    }
    if (j < V) {
      const __mmask16 k = tail_mask(V - j);
      const __m512 v = _mm512_maskz_loadu_ps(k, z + j);
      m = _mm512_mask_max_ps(m, k, m, v);
      s = _mm512_mask_add_ps(s, k, s, v);
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, m);
    largest = lanes[0];
    for (int i = 1; i < 16; ++i) largest = std::max(largest, lanes[i]);
    _mm512_store_ps(lanes, s);
    total = sum_lanes(lanes);
  }
  __attribute__((target("avx512f"))) static float exp_sum(const float* z, std::int64_t V, float shift) noexcept {
    const __m512 c = _mm512_set1_ps(shift);
    __m512 s = _mm512_setzero_ps();
    std::int64_t j = 0;
    for (; j + 16 <= V; j += 16) s = _mm512_add_ps(s, exp(_mm512_sub_ps(_mm512_loadu_ps(z + j), c)));
    if (j < V) {
      const __mmask16 k = tail_mask(V - j);
      s = _mm512_mask_add_ps(s, k, s, exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, z + j), c)));
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, s);
    return sum_lanes(lanes);
  }
  __attribute__((target("avx512f"))) static __m512 gradient_of(__m512 v, const row_gradient_terms& t) noexcept {
    __m512 g = _mm512_fmadd_ps(exp(_mm512_sub_ps(v, _mm512_set1_ps(t.lse))), _mm512_set1_ps(t.a), _mm512_set1_ps(-t.b));
    if (t.softcap > 0) {
      const __m512 u = _mm512_div_ps(v, _mm512_set1_ps(t.softcap));
      g = _mm512_mul_ps(g, _mm512_fnmadd_ps(u, u, _mm512_set1_ps(1.0f)));
    }
    return g;
  }
  __attribute__((target("avx512f"))) static void gradient(float* z, std::int64_t V, const row_gradient_terms& t) noexcept {
    std::int64_t j = 0;
    for (; j + 16 <= V; j += 16) _mm512_storeu_ps(z + j, gradient_of(_mm512_loadu_ps(z + j), t));
    if (j < V) {
      const __mmask16 k = tail_mask(V - j);
      _mm512_mask_storeu_ps(z + j, k, gradient_of(_mm512_maskz_loadu_ps(k, z + j), t));
    }
  }
};

struct row_pass_avx2 {
  __attribute__((target("avx2,fma"))) static __m256 exp(__m256 x) noexcept {
    x = _mm256_max_ps(x, _mm256_set1_ps(fast_exp::lower));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(fast_exp::log2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-fast_exp::ln2_hi), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-fast_exp::ln2_lo), r);
    __m256 p = _mm256_set1_ps(fast_exp::taylor[0]);
    for (int k = 1; k < 8; ++k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(fast_exp::taylor[k]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
  // Lanes [first, first + 8) of a 16-lane tail holding `count` values: all ones for the lanes that exist.
  __attribute__((target("avx2,fma"))) static __m256i tail_mask(std::int64_t count, int first) noexcept {
    const __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first));
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lane);
  }
  __attribute__((target("avx2,fma"))) static void max_and_sum(const float* z, std::int64_t V, float& largest,
                                                              float& total) noexcept {
    const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 m0 = lowest, m1 = lowest, s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    std::int64_t j = 0;
    for (; j + 16 <= V; j += 16) {
      const __m256 v0 = _mm256_loadu_ps(z + j), v1 = _mm256_loadu_ps(z + j + 8);
      m0 = _mm256_max_ps(m0, v0);
      m1 = _mm256_max_ps(m1, v1);
      s0 = _mm256_add_ps(s0, v0);
      s1 = _mm256_add_ps(s1, v1);
    }
    if (j < V) {
      const __m256i k0 = tail_mask(V - j, 0), k1 = tail_mask(V - j, 8);
      const __m256 v0 = _mm256_maskload_ps(z + j, k0), v1 = _mm256_maskload_ps(z + j + 8, k1);
      m0 = _mm256_blendv_ps(m0, _mm256_max_ps(m0, v0), _mm256_castsi256_ps(k0));
      m1 = _mm256_blendv_ps(m1, _mm256_max_ps(m1, v1), _mm256_castsi256_ps(k1));
      s0 = _mm256_blendv_ps(s0, _mm256_add_ps(s0, v0), _mm256_castsi256_ps(k0));
      s1 = _mm256_blendv_ps(s1, _mm256_add_ps(s1, v1), _mm256_castsi256_ps(k1));
    }
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, m0);
    _mm256_store_ps(lanes + 8, m1);
    largest = lanes[0];
    for (int i = 1; i < 16; ++i) largest = std::max(largest, lanes[i]);
    _mm256_store_ps(lanes, s0);
    _mm256_store_ps(lanes + 8, s1);
    total = sum_lanes(lanes);
  }
  __attribute__((target("avx2,fma"))) static float exp_sum(const float* z, std::int64_t V, float shift) noexcept {
    const __m256 c = _mm256_set1_ps(shift);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    std::int64_t j = 0;
    for (; j + 16 <= V; j += 16) {
      s0 = _mm256_add_ps(s0, exp(_mm256_sub_ps(_mm256_loadu_ps(z + j), c)));
      s1 = _mm256_add_ps(s1, exp(_mm256_sub_ps(_mm256_loadu_ps(z + j + 8), c)));
    }
    if (j < V) {
      const __m256i k0 = tail_mask(V - j, 0), k1 = tail_mask(V - j, 8);
      const __m256 e0 = exp(_mm256_sub_ps(_mm256_maskload_ps(z + j, k0), c));
      const __m256 e1 = exp(_mm256_sub_ps(_mm256_maskload_ps(z + j + 8, k1), c));
      s0 = _mm256_blendv_ps(s0, _mm256_add_ps(s0, e0), _mm256_castsi256_ps(k0));
      s1 = _mm256_blendv_ps(s1, _mm256_add_ps(s1, e1), _mm256_castsi256_ps(k1));
    }
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, s0);
    _mm256_store_ps(lanes + 8, s1);
    return sum_lanes(lanes);
  }
  __attribute__((target("avx2,fma"))) static __m256 gradient_of(__m256 v, const row_gradient_terms& t) noexcept {
    __m256 g = _mm256_fmadd_ps(exp(_mm256_sub_ps(v, _mm256_set1_ps(t.lse))), _mm256_set1_ps(t.a), _mm256_set1_ps(-t.b));
    if (t.softcap > 0) {
      const __m256 u = _mm256_div_ps(v, _mm256_set1_ps(t.softcap));
      g = _mm256_mul_ps(g, _mm256_fnmadd_ps(u, u, _mm256_set1_ps(1.0f)));
    }
    return g;
  }
  __attribute__((target("avx2,fma"))) static void gradient(float* z, std::int64_t V, const row_gradient_terms& t) noexcept {
    std::int64_t j = 0;
    for (; j + 8 <= V; j += 8) _mm256_storeu_ps(z + j, gradient_of(_mm256_loadu_ps(z + j), t));
    if (j < V) {
      const __m256i k = tail_mask(V - j, 0);
      _mm256_maskstore_ps(z + j, k, gradient_of(_mm256_maskload_ps(z + j, k), t));
    }
  }
};
#endif

// One token's row on the host: raw logits in, their gradient (times `scale`) out, in place; returns loss_i.
template <class Pass>
float host_row_with(const row_math& math, float* z, std::int64_t V, std::int32_t target, float scale) {
  if (math.softcap > 0)
    for (std::int64_t j = 0; j < V; ++j) z[j] = math.capped(z[j]);
  float largest = 0, z_sum = 0;
  Pass::max_and_sum(z, V, largest, z_sum);
  const float lse = largest + std::log(Pass::exp_sum(z, V, largest));
  const float z_target = z[target];
  const float loss = math.token_loss(lse, z_target, z_sum);
  const row_gradient_terms terms{lse, (1.0f + 2.0f * math.z_loss * lse) * scale,
                                 math.smoothing / static_cast<float>(math.vocab) * scale, math.softcap};
  Pass::gradient(z, V, terms);
  // The target's own term, the same scalar operations on every instruction set.
  float g = std::fma(fast_exp::scalar(z_target - lse), terms.a, -terms.b) - (1.0f - math.smoothing) * scale;
  if (math.softcap > 0) {
    const float u = z_target / math.softcap;
    g *= std::fma(-u, u, 1.0f);
  }
  z[target] = g;
  return loss;
}

inline float host_row(const row_math& math, float* z, std::int64_t V, std::int32_t target, float scale) {
#if MEMKIT_X86_DISPATCH
  switch (host_isa_in_use()) {
    case host_isa::avx512: return host_row_with<row_pass_avx512>(math, z, V, target, scale);
    case host_isa::avx2: return host_row_with<row_pass_avx2>(math, z, V, target, scale);
    case host_isa::portable: break;
  }
#endif
  return host_row_with<row_pass_portable>(math, z, V, target, scale);
}

// The head as the host products see it: a dense matrix, or tiles of rows dequantized into fp32.
template <class W>
struct dense_head_source {
  tensor_view<const W> head;
  std::int64_t V, H;
  std::int64_t tile_rows() const noexcept { return V; }
  linalg::matrix_ref<const W> rows(std::int64_t first, std::int64_t count) const {
    return {head.data() + first * H, count, H, H, head.where()};
  }
};

template <quant::format F>
struct quantized_head_source {
  const quant::quantized_tensor<F>* head;
  std::int64_t V, H;
  float* tile;  // tile_rows() x H floats
  std::int64_t tile_rows() const noexcept { return head_tile_rows(V, H); }
  linalg::matrix_ref<const float> rows(std::int64_t first, std::int64_t count) const {
    head->dequantize_rows(host, first, tensor_view<float>{tile, shape{count * H}, memory_kind::host});
    return {tile, count, H, H, memory_kind::host};
  }
};

template <class T, class Source>
void host_fused(const tensor_view<const T>& hidden, const Source& source,
                const tensor_view<const std::int32_t>& targets, const tensor_view<float>& loss,
                const tensor_view<T>& d_hidden, const tensor_view<float>& d_head, const cross_entropy_options& options,
                const loss_dims& dims, float* hidden_accumulator, memory_resource& workspace) {
  const std::int64_t N = dims.N, H = dims.H, V = dims.V;  // not a binding: clang < 16 cannot capture one in a lambda
  const std::int64_t c = chunk_tokens(N, V, sizeof(T), options, false);
  const std::int64_t tile = source.tile_rows();
  const linalg::gemm_options g{options.host_threads};
  const int threads = resolve_host_threads(options.host_threads);
  const row_math math = make_row_math(options, V);
  std::int64_t counted = 0;
  for (std::int64_t i = 0; i < N; ++i) counted += targets[i] != options.ignore_index;
  const float scale = counted > 0 ? 1.0f / static_cast<float>(counted) : 0.0f;

  buffer<float> logits(workspace, shape{c * V});
  buffer<float> row_loss(workspace, shape{N});
  const auto logit_block = [&](std::int64_t rows, std::int64_t first_column, std::int64_t columns) {
    return linalg::matrix_ref<float>(logits.data() + first_column, rows, columns, V, memory_kind::host);
  };
  for (std::int64_t first = 0; first < N; first += c) {
    const std::int64_t rows = std::min(c, N - first);
    const linalg::matrix_ref<const T> x(hidden.data() + first * H, rows, H, H, hidden.where());
    for (std::int64_t n0 = 0; n0 < V; n0 += tile) {
      const std::int64_t nt = std::min(tile, V - n0);
      linalg::gemm(host, linalg::transpose::no, linalg::transpose::yes, 1.0f, x, source.rows(n0, nt), 0.0f,
                   logit_block(rows, n0, nt), workspace, g);
    }
    ::memkit::detail::run_in_parts(threads, rows, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        float* z = logits.data() + r * V;
        const std::int32_t target = targets[first + r];
        if (target == options.ignore_index) {
          std::fill(z, z + V, 0.0f);
          row_loss.data()[first + r] = 0.0f;
        } else {
          row_loss.data()[first + r] = host_row(math, z, V, target, scale);
        }
      }
    });
    // d_head before d_hidden: d_hidden may then alias hidden (this chunk's rows are not read again).
    if (!d_head.is_none())
      linalg::gemm(host, linalg::transpose::yes, linalg::transpose::no, 1.0f,
                   linalg::matrix_ref<const float>(logit_block(rows, 0, V)), x, 1.0f,
                   linalg::matrix_ref<float>(d_head.data(), V, H, H, d_head.where()), workspace, g);
    if (d_hidden.is_none()) continue;
    const linalg::matrix_ref<T> dx(d_hidden.data() + first * H, rows, H, H, d_hidden.where());
    if (tile >= V) {
      linalg::gemm(host, linalg::transpose::no, linalg::transpose::no, 1.0f,
                   linalg::matrix_ref<const float>(logit_block(rows, 0, V)), source.rows(0, V), 0.0f, dx, workspace, g);
      continue;
    }
    // Several tiles: their contributions add up in fp32 (in d_hidden itself when it is fp32).
    float* acc = std::is_same_v<T, float> ? reinterpret_cast<float*>(dx.data) : hidden_accumulator;
    const linalg::matrix_ref<float> acc_ref(acc, rows, H, H, memory_kind::host);
    for (std::int64_t n0 = 0; n0 < V; n0 += tile) {
      const std::int64_t nt = std::min(tile, V - n0);
      linalg::gemm(host, linalg::transpose::no, linalg::transpose::no, 1.0f,
                   linalg::matrix_ref<const float>(logit_block(rows, n0, nt)), source.rows(n0, nt),
                   n0 == 0 ? 0.0f : 1.0f, acc_ref, workspace, g);
    }
    if constexpr (!std::is_same_v<T, float>)
      for (std::int64_t i = 0; i < rows * H; ++i) dx.data[i] = from_float<T>(acc[i]);
  }
  double total = 0;
  for (std::int64_t i = 0; i < N; ++i) total += row_loss.data()[i];
  loss[0] = counted > 0 ? static_cast<float>(total / static_cast<double>(counted)) : 0.0f;
}

// Host checks made before anything is written: target ids, NaN/Inf, and the bound on the logits.
template <class T, class Source>
void host_check_values(const char* operation, const tensor_view<const T>& hidden, const Source& source,
                       const tensor_view<const std::int32_t>& targets, const cross_entropy_options& options,
                       const loss_dims& dims) {
  const std::int64_t N = dims.N, H = dims.H, V = dims.V;  // not a binding: clang < 16 cannot capture one in a lambda
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int32_t t = targets[i];
    if (t != options.ignore_index && (t < 0 || t >= V))
      throw error(std::string(operation) + ": target id " + std::to_string(t) + " of token " + std::to_string(i) +
                  " is outside the vocabulary [0, " + std::to_string(V) + ") and is not ignore_index (" +
                  std::to_string(options.ignore_index) + ")");
  }
  const double hidden_max = host_max_abs(hidden.data(), N, H, operation, "hidden");
  double head_max = 0;
  for (std::int64_t n0 = 0; n0 < V; n0 += source.tile_rows()) {
    const std::int64_t nt = std::min(source.tile_rows(), V - n0);
    head_max = std::max(head_max, host_max_abs(source.rows(n0, nt).data, nt, H, operation, "head", n0));
  }
  const double bound = static_cast<double>(H) * hidden_max * head_max;
  require(bound <= max_logit_bound,
          std::string(operation) + ": the logits could overflow fp32 (hidden " + std::to_string(H) + " x max|hidden| " +
              std::to_string(hidden_max) + " x max|head| " + std::to_string(head_max) + " exceeds " +
              std::to_string(max_logit_bound) + ")");
}

#if MEMKIT_HAS_CUDA
inline constexpr int loss_block_threads = 256;
// The row pass: one CTA per token row, as wide as a CTA goes. A chunk has a few hundred rows, so 256-thread
// CTAs left an H200 at 17% occupancy and 4% of its memory bandwidth (120 us for 174 rows of 32,000 logits).
inline constexpr int logit_row_threads = 1024;

struct sum_op {
  template <class V>
  MEMKIT_DEVICE V operator()(V a, V b) const { return a + b; }
};
struct max_op {
  MEMKIT_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Reduces one value per thread over the block (blockDim.x a multiple of 32, at most 1024); every thread gets
// the result. The order is fixed by blockDim, so the result is the same on every run.
template <class V, class Op>
MEMKIT_DEVICE V block_reduce(V value, Op op, V identity, V* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : identity;
  for (int offset = 16; offset > 0; offset >>= 1) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// counters[0] = tokens whose target is not ignore_index and in range; counters[1] = 1 if one is out of range.
// (Kernels here are templates so that a header included by several .cu files defines each once.)
template <int Unused = 0>
__global__ void count_targets_kernel(const std::int32_t* __restrict__ targets, std::int64_t N, std::int64_t V,
                                     std::int64_t ignore_index, int* __restrict__ counters) {
  __shared__ int scratch[32];
  int counted = 0, bad = 0;
  for (std::int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    const std::int64_t t = targets[i];
    if (t == ignore_index) continue;
    if (t < 0 || t >= V) bad = 1;
    else ++counted;
  }
  counted = block_reduce(counted, sum_op{}, 0, scratch);
  bad = block_reduce(bad, sum_op{}, 0, scratch);
  if (threadIdx.x == 0) {
    counters[0] = counted;
    counters[1] = bad;
  }
}

// One block per token row: raw fp32 logits in, their gradient (times 1 / counted) out as D, which may be the
// same memory when D is float.
template <class D>
__global__ void __launch_bounds__(logit_row_threads) logit_rows_kernel(float* logits, D* gradient, std::int64_t rows, std::int64_t V,
                                  const std::int32_t* __restrict__ targets, std::int64_t ignore_index, row_math math,
                                  const int* __restrict__ counters, float* __restrict__ row_loss) {
  __shared__ float scratch[32];
  const int counted = counters[0];
  const float scale = counted > 0 ? 1.0f / static_cast<float>(counted) : 0.0f;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* z = logits + r * V;
    D* g = gradient + r * V;
    const std::int64_t t = targets[r];
    if (t == ignore_index || t < 0 || t >= V) {  // out of range: counted as bad, the loss becomes NaN
      for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) g[j] = from_float<D>(0.0f);
      if (threadIdx.x == 0) row_loss[r] = 0.0f;
      continue;
    }
    float largest = -INFINITY, z_sum = 0.0f;
    for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float value = math.capped(z[j]);
      z[j] = value;
      largest = fmaxf(largest, value);
      z_sum += value;
    }
    largest = block_reduce(largest, max_op{}, -INFINITY, scratch);
    z_sum = block_reduce(z_sum, sum_op{}, 0.0f, scratch);
    float sum = 0.0f;
    for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) sum += expf(z[j] - largest);
    sum = block_reduce(sum, sum_op{}, 0.0f, scratch);  // its barriers also make every z[j] visible
    const float lse = largest + logf(sum);
    if (threadIdx.x == 0) row_loss[r] = math.token_loss(lse, z[t], z_sum);
    __syncthreads();  // z[t] is read before it is overwritten
    for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) g[j] = from_float<D>(math.gradient(z[j], lse, j == t, scale));
  }
}

// loss = sum of row losses / counted (0 when nothing is counted, NaN when a target was out of range).
template <int Unused = 0>
__global__ void mean_loss_kernel(const float* __restrict__ row_loss, std::int64_t N, const int* __restrict__ counters,
                                 float* __restrict__ loss) {
  __shared__ double scratch[32];
  double total = 0;
  for (std::int64_t i = threadIdx.x; i < N; i += blockDim.x) total += row_loss[i];
  total = block_reduce(total, sum_op{}, 0.0, scratch);
  if (threadIdx.x == 0)
    loss[0] = counters[1] != 0 ? NAN : counters[0] > 0 ? static_cast<float>(total / counters[0]) : 0.0f;
}

// C (col-major m x n, ld ldc) = alpha * op(A) * op(B) + beta * C on the executor's stream, fp32 accumulation.
inline void device_gemm(cublasHandle_t handle, cublasOperation_t op_a, cublasOperation_t op_b, std::int64_t m,
                        std::int64_t n, std::int64_t k, const void* a, cudaDataType_t a_type, std::int64_t lda,
                        const void* b, cudaDataType_t b_type, std::int64_t ldb, float beta, void* c,
                        cudaDataType_t c_type, std::int64_t ldc) {
  const float one = 1.0f;
  ::memkit::detail::cublas_check(
      cublasGemmEx(handle, op_a, op_b, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &one, a, a_type,
                   static_cast<int>(lda), b, b_type, static_cast<int>(ldb), &beta, c, c_type, static_cast<int>(ldc),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

// The device path. `head_rows(first, count)` returns a device pointer to rows of the head in T (a dense
// head's own rows, or a dequantized tile); `tile` is how many rows it serves at once (V for a dense head).
template <class T, class HeadRows>
void device_fused(const cuda_executor& exec, const tensor_view<const T>& hidden, HeadRows&& head_rows,
                  std::int64_t tile, const tensor_view<const std::int32_t>& targets, const tensor_view<float>& loss,
                  const tensor_view<T>& d_hidden, const tensor_view<float>& d_head, const cross_entropy_options& options,
                  const loss_dims& dims, memory_resource& workspace) {
  const std::int64_t N = dims.N, H = dims.H, V = dims.V;  // not a binding: clang < 16 cannot capture one in a lambda
  constexpr bool fp32 = std::is_same_v<T, float>;
  const cudaDataType_t t_type = ::memkit::detail::cuda_type<T>();
  const std::int64_t c = chunk_tokens(N, V, sizeof(T), options, true);
  const cudaStream_t stream = exec.stream;
  // Workspace stream-ordered on exec.stream (docs/cuda.md, "Workspace").
  const on_stream ordered{exec.stream};
  buffer<float> logits(workspace, shape{c * V}, ordered);
  buffer<float> row_loss(workspace, shape{N}, ordered);
  buffer<int> counters(workspace, shape{2}, ordered);
  buffer<T> gradient16;
  if constexpr (!fp32) gradient16 = buffer<T>(workspace, shape{c * V}, ordered);
  T* gradient = fp32 ? reinterpret_cast<T*>(logits.data()) : gradient16.data();
  buffer<float> accumulator;
  if (!fp32 && !d_hidden.is_none() && tile < V) accumulator = buffer<float>(workspace, shape{c * H}, ordered);

  count_targets_kernel<><<<1, loss_block_threads, 0, stream>>>(targets.data(), N, V, options.ignore_index,
                                                             counters.data());
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  cublasHandle_t handle = ::memkit::detail::cublas_handle_for(exec);  // on exec.stream, its own workspace
  const row_math math = make_row_math(options, V);
  for (std::int64_t first = 0; first < N; first += c) {
    const std::int64_t rows = std::min(c, N - first);
    const T* x = hidden.data() + first * H;
    // Column-major views: logits^T [V, rows] (ld V) = head rows^T * x^T, tile by tile.
    for (std::int64_t n0 = 0; n0 < V; n0 += tile) {
      const std::int64_t nt = std::min(tile, V - n0);
      device_gemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, nt, rows, H, head_rows(n0, nt), t_type, H, x, t_type, H, 0.0f,
                  logits.data() + n0, CUDA_R_32F, V);
    }
    logit_rows_kernel<T><<<::memkit::detail::grid_for(rows, 1), logit_row_threads, 0, stream>>>(
        logits.data(), gradient, rows, V, targets.data() + first, options.ignore_index, math, counters.data(),
        row_loss.data() + first);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    // d_head^T [H, V] += x^T [H, rows] * gradient [rows, V]   (before d_hidden, which may alias hidden)
    if (!d_head.is_none())
      device_gemm(handle, CUBLAS_OP_N, CUBLAS_OP_T, H, V, rows, x, t_type, H, gradient, t_type, V, 1.0f, d_head.data(),
                  CUDA_R_32F, H);
    if (d_hidden.is_none()) continue;
    T* dx = d_hidden.data() + first * H;
    if (tile >= V) {  // d_hidden^T [H, rows] = head^T [H, V] * gradient^T [V, rows]
      device_gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, H, rows, V, head_rows(0, V), t_type, H, gradient, t_type, V, 0.0f,
                  dx, t_type, H);
      continue;
    }
    void* acc = fp32 ? static_cast<void*>(dx) : static_cast<void*>(accumulator.data());
    for (std::int64_t n0 = 0; n0 < V; n0 += tile) {
      const std::int64_t nt = std::min(tile, V - n0);
      device_gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, H, rows, nt, head_rows(n0, nt), t_type, H, gradient + n0, t_type,
                  V, n0 == 0 ? 0.0f : 1.0f, acc, CUDA_R_32F, H);
    }
    if constexpr (!fp32) {
      quant::detail::convert_kernel<T><<<::memkit::detail::grid_for(rows * H, loss_block_threads), loss_block_threads,
                                         0, stream>>>(accumulator.data(), dx, rows * H);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
    }
  }
  mean_loss_kernel<><<<1, loss_block_threads, 0, stream>>>(row_loss.data(), N, counters.data(), loss.data());
  MEMKIT_CUDA_CHECK(cudaGetLastError());
}
#endif

template <executor E, class T>
void check_access(const E& exec, const char* operation, const tensor_view<const T>& hidden,
                  const tensor_view<const std::int32_t>& targets, const tensor_view<float>& loss,
                  const tensor_view<T>& d_hidden, const tensor_view<float>& d_head) {
  require_accessible(exec, hidden, operation, "hidden");
  require_accessible(exec, targets, operation, "targets");
  require_accessible(exec, loss, operation, "loss");
  if (!d_hidden.is_none()) require_accessible(exec, d_hidden, operation, "d_hidden");
  if (!d_head.is_none()) require_accessible(exec, d_head, operation, "d_head");
}

template <class T>
void zero_loss(const host_executor&, const tensor_view<float>& loss) {
  loss[0] = 0.0f;
}
#if MEMKIT_HAS_CUDA
template <class T>
void zero_loss(const cuda_executor& exec, const tensor_view<float>& loss) {
  ::memkit::detail::with_device(exec.device, [&] {
    MEMKIT_CUDA_CHECK(cudaMemsetAsync(loss.data(), 0, sizeof(float), exec.stream));
    return 0;
  });
}
#endif
}  // namespace detail

// Loss, d_hidden and d_head of the LM head `head` [V, H] (fp32, bf16 or fp16) applied to `hidden` [N, H].
// `targets` [N] int32; `loss` one float (host or device memory, as the executor reads); `d_hidden` [N, H] of
// hidden's type, overwritten (none(): not computed; it may alias `hidden`); `d_head` [V, H] fp32, accumulated
// into (none(): a frozen head). CUDA: the head must have hidden's element type.
template <executor E, class Hidden, class Head>
  requires float_storage<std::remove_const_t<Hidden>> && float_storage<std::remove_const_t<Head>>
void fused_linear_cross_entropy(const E& exec, tensor_view<Hidden> hidden, tensor_view<Head> head,
                                tensor_view<const std::int32_t> targets, tensor_view<float> loss,
                                tensor_view<std::remove_const_t<Hidden>> d_hidden, tensor_view<float> d_head,
                                const cross_entropy_options& options, memory_resource& workspace) {
  using T = std::remove_const_t<Hidden>;
  using W = std::remove_const_t<Head>;
  constexpr const char* operation = "loss::fused_linear_cross_entropy";
  const tensor_view<const T> x = hidden;
  const tensor_view<const W> w = head;
  const detail::loss_dims dims = detail::check_arguments(operation, x, w.shape(), targets, loss, d_hidden, d_head, options);
  detail::check_access(exec, operation, x, targets, loss, d_hidden, d_head);
  require_accessible(exec, w, operation, "head");
  if constexpr (!E::on_device) {
    const detail::dense_head_source<W> source{w, dims.V, dims.H};
    detail::host_check_values(operation, x, source, targets, options, dims);
    if (dims.N == 0) return detail::zero_loss<T>(exec, loss);
    detail::host_fused(x, source, targets, loss, d_hidden, d_head, options, dims, nullptr, workspace);
  } else {
#if MEMKIT_HAS_CUDA
    require(std::is_same_v<T, W>, std::string(operation) + ": on CUDA the head must have the hidden states' element type");
    require(dims.V <= 2147483647 && dims.H <= 2147483647, std::string(operation) + ": vocab and hidden must fit cuBLAS's int");
    if (dims.N == 0) return detail::zero_loss<T>(exec, loss);
    if constexpr (std::is_same_v<T, W>) {
      ::memkit::detail::with_device(exec.device, [&] {
        detail::device_fused(exec, x, [&](std::int64_t first, std::int64_t) { return w.data() + first * dims.H; },
                             dims.V, targets, loss, d_hidden, d_head, options, dims, workspace);
        return 0;
      });
    }
#endif
  }
}

// The same with a frozen, quantized head: it is dequantized a tile of rows at a time (head_tile_rows rows;
// fp32 on the host, hidden's type on CUDA) and gets no gradient, so `d_head` must be none().
template <executor E, class Hidden, quant::format F>
  requires float_storage<std::remove_const_t<Hidden>>
void fused_linear_cross_entropy(const E& exec, tensor_view<Hidden> hidden, const quant::quantized_tensor<F>& head,
                                tensor_view<const std::int32_t> targets, tensor_view<float> loss,
                                tensor_view<std::remove_const_t<Hidden>> d_hidden, tensor_view<float> d_head,
                                const cross_entropy_options& options, memory_resource& workspace) {
  using T = std::remove_const_t<Hidden>;
  constexpr const char* operation = "loss::fused_linear_cross_entropy";
  const tensor_view<const T> x = hidden;
  const detail::loss_dims dims =
      detail::check_arguments(operation, x, head.logical_shape(), targets, loss, d_hidden, d_head, options);
  require(d_head.is_none(), std::string(operation) + ": a quantized head is frozen; pass tensor_view<float>::none() as `d_head`");
  detail::check_access(exec, operation, x, targets, loss, d_hidden, d_head);
  require_accessible(exec, head.codes(), operation, "head");
  if (dims.N == 0) return detail::zero_loss<T>(exec, loss);
  const std::int64_t tile = detail::head_tile_rows(dims.V, dims.H);
  if constexpr (!E::on_device) {
    buffer<float> tile_buffer(workspace, shape{tile * dims.H});
    buffer<float> accumulator;
    if (!std::is_same_v<T, float> && !d_hidden.is_none() && tile < dims.V)
      accumulator = buffer<float>(workspace, shape{chunk_tokens(dims.N, dims.V, sizeof(T), options) * dims.H});
    const detail::quantized_head_source<F> source{&head, dims.V, dims.H, tile_buffer.data()};
    detail::host_check_values(operation, x, source, targets, options, dims);
    detail::host_fused(x, source, targets, loss, d_hidden, d_head, options, dims, accumulator.data(),
                       workspace);
  } else {
#if MEMKIT_HAS_CUDA
    require(dims.V <= 2147483647 && dims.H <= 2147483647, std::string(operation) + ": vocab and hidden must fit cuBLAS's int");
    ::memkit::detail::with_device(exec.device, [&] {
      buffer<T> tile_buffer(workspace, shape{tile * dims.H}, on_stream{exec.stream});
      detail::device_fused(
          exec, x,
          [&](std::int64_t first, std::int64_t count) -> const T* {
            head.dequantize_rows(exec, first, tile_buffer.view().flat_slice(0, count * dims.H));
            return tile_buffer.data();
          },
          tile, targets, loss, d_hidden, d_head, options, dims, workspace);
      return 0;
    });
#endif
  }
}

}  // namespace loss

MEMKIT_NAMESPACE_END
