// memkit/lora/bytes.hpp — lora_linear's options, the arguments of its passes (forward_arguments,
// backward_arguments, merge_arguments) and their byte functions, with what a forward saves
// (saved_activation_bytes) and how many parameters an adapter trains: constexpr functions with no kernels and
// no buffers, so that memory_budget counts a LoRA adapter with the arithmetic the layer (lora/lora_linear.hpp,
// which includes this header) allocates by.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/linalg/gemm_bytes.hpp"
#include "memkit/quant/bytes.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace quant {
template <format F>
class quantized_tensor;  // quant/quantized_tensor.hpp; a base_traits key here, never used as a complete type
}  // namespace quant

namespace lora {

// How A is initialised (B always starts at zero, so a fresh adapter leaves the base's output unchanged).
enum class init_method : std::uint8_t {
  kaiming_uniform,  // PEFT's default: kaiming_uniform_(a = sqrt(5)) by fan-in, i.e. U(-1/sqrt(in), 1/sqrt(in))
  gaussian,         // PEFT's init_lora_weights="gaussian": N(0, (1/r)^2)
};

struct lora_options {
  std::int64_t rank = 8;
  double alpha = 8.0;
  bool use_rslora = false;      // scale alpha / sqrt(r) instead of alpha / r
  float dropout = 0.0f;         // probability of dropping an element of the adapter's input, in [0, 1)
  bool train_bias = false;      // the bias (when there is one) gets a gradient
  init_method init = init_method::kaiming_uniform;
  std::uint64_t init_seed = 0;  // A's random stream (core/random.hpp)
  int host_threads = 1;         // host GEMM threads, 0 = every hardware thread
  quant::matmul_config matmul{};  // tiles of the quantized base's products
};

// Which storage a base weight has.
template <class Base>
struct base_traits {
  static_assert(float_storage<Base>, "lora_linear<Base>: Base is float, bf16, fp16 or quant::quantized_tensor<F>");
  static constexpr bool quantized = false;
  using default_activation = Base;
  using weight_ref = tensor_view<Base>;  // [out, in], the caller's memory
};
template <quant::format F>
struct base_traits<quant::quantized_tensor<F>> {
  static constexpr bool quantized = true;
  static constexpr quant::format format = F;
  using default_activation = float;
  using weight_ref = const quant::quantized_tensor<F>*;
};

// --- What the layer allocates, as constexpr functions. ---

// The tensors one forward saves for its backward, in bytes.
struct saved_bytes_parts {
  std::size_t adapter_input = 0;   // dropout(x) [tokens, in]
  std::size_t adapter_output = 0;  // dropout(x) A^T [tokens, r]
  std::size_t record = 0;          // the dropout stream (seed, counter, applied, tokens)
  constexpr std::size_t total() const noexcept { return adapter_input + adapter_output + record; }
};

inline constexpr std::int64_t record_words = 4;

// Bytes saved by a forward over `tokens` rows (batch * sequence) with activations of `element_bytes`.
// Dropout on or off saves the same: the mask is drawn again in backward, not kept.
constexpr saved_bytes_parts saved_activation_bytes(std::int64_t tokens, std::int64_t in, std::int64_t rank,
                                                   std::size_t element_bytes) noexcept {
  saved_bytes_parts s;
  s.adapter_input = static_cast<std::size_t>(tokens * in) * element_bytes;
  s.adapter_output = static_cast<std::size_t>(tokens * rank) * element_bytes;
  s.record = static_cast<std::size_t>(record_words) * sizeof(std::uint64_t);
  return s;
}

// Trainable parameters of one adapter (A and B; the bias is counted by whoever owns it).
constexpr std::int64_t adapter_parameter_count(std::int64_t in, std::int64_t out, std::int64_t rank) noexcept {
  return rank * in + out * rank;
}

namespace detail {

// Rows of the adapter's input gradient handled at once when dropout masks it (bounds that temporary).
inline constexpr std::int64_t masked_rows = 256;

constexpr std::size_t max_of(std::size_t a, std::size_t b) noexcept { return a > b ? a : b; }

// The element type of the down-projection's gradient: fp32 on the host; T on CUDA, where cuBLAS wants
// both inputs of a product in one type.
template <float_storage T, bool OnDevice>
using down_grad_t = std::conditional_t<OnDevice, T, float>;

template <class TA, class TB, class TC>
constexpr std::size_t product_workspace(bool on_device, std::int64_t M, std::int64_t N, std::int64_t K,
                                        const linalg::gemm_options& g) noexcept {
  return on_device ? 0 : linalg::gemm_workspace_bytes<TA, TB, TC>(M, N, K, g);
}

}  // namespace detail

// --- The component protocol (docs/architecture.md): one arguments struct per pass, three byte functions. ---

// One forward of a lora_linear<Base, T> over `tokens` rows (batch * sequence).
template <class Base, float_storage T = typename base_traits<Base>::default_activation>
struct forward_arguments {
  std::int64_t tokens = 0, in = 0, out = 0, rank = 0;
  bool on_device = false;
  lora_options options{};
  std::int64_t block_size = 64;  // a quantized base's quantization block
};

// One backward. `dropout`: on the host, the forward applied dropout (training with p > 0); on CUDA, p > 0
// (the host cannot read the device's record of the forward without waiting, so the masked path runs
// whenever p > 0). `input_grad`: dx is wanted (not none).
template <class Base, float_storage T = typename base_traits<Base>::default_activation>
struct backward_arguments : forward_arguments<Base, T> {
  bool dropout = false;
  bool input_grad = true;
};

// merge / unmerge / merged_weight / merged_quantized.
template <class Base, float_storage T = typename base_traits<Base>::default_activation>
struct merge_arguments {
  std::int64_t in = 0, out = 0, rank = 0;
  bool on_device = false;
  lora_options options{};
};

namespace detail {
template <class Base, float_storage T>
constexpr std::size_t base_product_workspace(const forward_arguments<Base, T>& a, quant::matmul_kind kind,
                                             const linalg::gemm_options& g) noexcept {
  if constexpr (base_traits<Base>::quantized) {
    return quant::workspace_bytes(quant::matmul_arguments{kind, base_traits<Base>::format, a.block_size, a.tokens,
                                                          a.out, a.in, sizeof(T), a.on_device, a.options.matmul});
  } else if (kind == quant::matmul_kind::forward) {
    return product_workspace<T, Base, T>(a.on_device, a.tokens, a.out, a.in, g);
  } else {
    return product_workspace<T, Base, T>(a.on_device, a.tokens, a.in, a.out, g);
  }
}
}  // namespace detail

// Exact bytes a forward takes from its workspace resource (the peak; every piece is freed before it returns).
template <class Base, float_storage T>
constexpr std::size_t workspace_bytes(const forward_arguments<Base, T>& a) noexcept {
  const linalg::gemm_options g{a.options.host_threads};
  const std::size_t base = detail::base_product_workspace(a, quant::matmul_kind::forward, g);
  const std::size_t down = detail::product_workspace<T, T, T>(a.on_device, a.tokens, a.rank, a.in, g);
  const std::size_t up = detail::product_workspace<T, T, T>(a.on_device, a.tokens, a.out, a.rank, g);
  return detail::max_of(base, detail::max_of(down, up));
}
// What a forward saves for its backward (saved_activation_bytes: the same arithmetic memory_budget uses).
template <class Base, float_storage T>
constexpr std::size_t saved_bytes(const forward_arguments<Base, T>& a) noexcept {
  return saved_activation_bytes(a.tokens, a.in, a.rank, sizeof(T)).total();
}
template <class Base, float_storage T>
constexpr std::size_t bytes_required(const forward_arguments<Base, T>& a) noexcept {
  return saved_bytes(a) + workspace_bytes(a);
}

// Exact bytes a backward takes from its workspace resource.
template <class Base, float_storage T>
constexpr std::size_t workspace_bytes(const backward_arguments<Base, T>& a) noexcept {
  const linalg::gemm_options g{a.options.host_threads};
  const bool on_device = a.on_device;
  const std::int64_t tokens = a.tokens, in = a.in, out = a.out, rank = a.rank;
  if (tokens == 0) return 0;
  const std::size_t down_grad_bytes = on_device ? sizeof(T) : sizeof(float);
  using D = float;  // host: the down-projection gradient is fp32 (device workspace is 0 for products anyway)
  const std::size_t held = static_cast<std::size_t>(tokens * rank) * down_grad_bytes;
  std::size_t peak = detail::product_workspace<T, T, float>(on_device, out, rank, tokens, g);    // dB
  peak = detail::max_of(peak, detail::product_workspace<T, T, D>(on_device, tokens, rank, out, g));  // d(down)
  peak = detail::max_of(peak, detail::product_workspace<D, T, float>(on_device, rank, in, tokens, g));  // dA
  if (a.input_grad) {
    peak = detail::max_of(peak, detail::base_product_workspace(a, quant::matmul_kind::input_grad, g));
    if (!a.dropout) {
      peak = detail::max_of(peak, detail::product_workspace<D, T, T>(on_device, tokens, in, rank, g));
    } else {
      // Row chunks: a temporary [chunk, in] (fp32 on the host, T on CUDA) and its product.
      const std::int64_t chunk = tokens < detail::masked_rows ? tokens : detail::masked_rows;
      const std::int64_t last = tokens % chunk == 0 ? chunk : tokens % chunk;
      const std::size_t temp = static_cast<std::size_t>(chunk * in) * down_grad_bytes;
      const std::size_t product =
          detail::max_of(detail::product_workspace<D, T, float>(on_device, chunk, in, rank, g),
                         detail::product_workspace<D, T, float>(on_device, last, in, rank, g));
      peak = detail::max_of(peak, temp + product);
    }
  }
  return held + peak;
}
// A backward saves nothing; it frees what its forward saved.
template <class Base, float_storage T>
constexpr std::size_t saved_bytes(const backward_arguments<Base, T>&) noexcept {
  return 0;
}
template <class Base, float_storage T>
constexpr std::size_t bytes_required(const backward_arguments<Base, T>& a) noexcept {
  return workspace_bytes(a);
}

// Bytes merged_weight / merged_quantized / merge take from the workspace (host: the GEMM's packing; a
// quantized base's merge also holds the merged weight as fp32 when it re-quantizes: merged_quantized's staging).
template <class Base, float_storage T>
constexpr std::size_t workspace_bytes(const merge_arguments<Base, T>& a) noexcept {
  const linalg::gemm_options g{a.options.host_threads};
  if constexpr (base_traits<Base>::quantized) {
    return detail::product_workspace<T, T, float>(a.on_device, a.out, a.in, a.rank, g);
  } else {
    return detail::product_workspace<T, T, Base>(a.on_device, a.out, a.in, a.rank, g);
  }
}
template <class Base, float_storage T>
constexpr std::size_t saved_bytes(const merge_arguments<Base, T>&) noexcept {
  return 0;
}
template <class Base, float_storage T>
constexpr std::size_t bytes_required(const merge_arguments<Base, T>& a) noexcept {
  return workspace_bytes(a);
}

}  // namespace lora

MEMKIT_NAMESPACE_END
