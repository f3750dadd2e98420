// memkit/models/llama/nf4_lora.hpp — one LoRA projection: memkit's lora_linear over a frozen base it owns.
//
// memkit::lora::lora_linear references its base weight (the caller owns it); lora_projection keeps the
// weight (NF4 for QLoRA, or dense in the training dtype) and the projection's frozen bias next to the layer
// (on the heap, so moving the wrapper keeps the layer's pointers valid) and adds the module path and the
// one workspace figure the decoder block adds up. Adapters are T (the activation type), their gradients
// fp32; AdamW updates bf16 adapters with stochastic rounding.
#pragma once

#include "layers.hpp"

#include <memkit/lora/lora_linear.hpp>
#include <memkit/quant/matmul.hpp>
#include <memkit/quant/quantized_tensor.hpp>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace memkit::models::llama {

// Base: quant::quantized_tensor<NF4> (QLoRA) or T (LoRA over a dense base in the training dtype). A
// projection built with rank 0 has no adapter (a PEFT adapter that targets fewer modules): it is the frozen
// base alone, y = x W^T (+ b), with only the input gradient in backward, and saves nothing.
template <class T, class Base>
struct lora_projection {
  using value_type = T;
  using layer_type = memkit::lora::lora_linear<Base, T>;
  static constexpr bool quantized_base = layer_type::quantized_base;
  // What the projection owns as its base: the quantized tensor, or a dense buffer.
  using base_type = std::conditional_t<quantized_base, Base, memkit::buffer<T>>;
  using adapter_type = T;
  static constexpr const char* description =
      quantized_base ? "memkit::lora::lora_linear<quantized_tensor<NF4>, T> (memkit/lora/lora_linear.hpp)"
                     : "memkit::lora::lora_linear<T, T> over a dense base (memkit/lora/lora_linear.hpp)";

  std::string path;  // the module's path in the base model, e.g. "model.layers.0.self_attn.q_proj"
  std::unique_ptr<base_type> base;
  std::unique_ptr<memkit::buffer<T>> bias;  // frozen [out], or null
  std::optional<layer_type> layer;          // the adapter; empty for a projection without one
  bool on_device = false;  // the layer's memory is device memory (its workspace figures are the CUDA ones)
  memkit::memory_resource* workspace = nullptr;
  int host_threads = 1;
  memkit::quant::matmul_config matmul{};  // of the frozen base's products without an adapter

  static memkit::lora::lora_options options_for(std::int64_t rank, float alpha, const layers::memory_resources& memory,
                                                std::uint64_t seed) {
    memkit::lora::lora_options o;
    o.rank = rank;
    o.alpha = alpha;
    o.init_seed = seed;
    o.host_threads = memory.host_threads;
    o.matmul.host_threads = memory.host_threads;  // the quantized base's products too (their default is 1)
    return o;
  }

  lora_projection(std::string path_, base_type&& base_, std::int64_t rank, float alpha, const layers::memory_resources& memory,
                  std::uint64_t seed, std::uint64_t stream, std::unique_ptr<memkit::buffer<T>> bias_ = nullptr)
      : lora_projection(std::move(path_), std::move(base_),
                        options_for(rank, alpha, memory, memkit::random_word(seed, stream, 0)), memory, std::move(bias_)) {}
  // With every LoRA option given (rsLoRA, dropout, init; options.host_threads is the caller's); rank 0: no adapter.
  lora_projection(std::string path_, base_type&& base_, const memkit::lora::lora_options& options,
                  const layers::memory_resources& memory, std::unique_ptr<memkit::buffer<T>> bias_ = nullptr)
      : path(std::move(path_)), base(std::make_unique<base_type>(std::move(base_))), bias(std::move(bias_)),
        on_device(memory.on_device()), workspace(memory.workspace), host_threads(memory.host_threads), matmul(options.matmul) {
    if (options.rank > 0) {
      layer.emplace(base_ref(), bias ? bias->view() : tensor_view<T>::none(), options, *memory.weights, *memory.gradients,
                    *memory.workspace);
    }
  }

  bool adapted() const noexcept { return layer.has_value(); }
  typename layer_type::weight_ref base_ref() {
    if constexpr (quantized_base) return base.get();
    else return base->view();
  }
  const base_type& base_weight() const noexcept { return *base; }
  shape weight_shape() const {
    if constexpr (quantized_base) return base->logical_shape();
    else return base->shape();
  }

  static constexpr std::size_t parameter_bytes(std::int64_t in, std::int64_t out, std::int64_t rank) {
    return rank > 0 ? layer_type::parameter_bytes(in, out, rank) : 0;
  }
  static constexpr std::size_t gradient_bytes(std::int64_t in, std::int64_t out, std::int64_t rank) {
    return rank > 0 ? layer_type::gradient_bytes(in, out, rank, false) : 0;
  }

  // The adapter's tensors (the projection must be adapted()).
  tensor_view<T> lora_A() { return layer->lora_A(); }
  tensor_view<T> lora_B() { return layer->lora_B(); }
  tensor_view<float> grad_A() { return layer->grad_A(); }
  tensor_view<float> grad_B() { return layer->grad_B(); }
  // Hands the adapter's A and B (path + ".lora_A.weight" / ".lora_B.weight", PEFT's names without its
  // "base_model.model." prefix) to a layers::parameter_registry; nothing without an adapter.
  template <class Registry>
  void register_parameters(Registry& registry) {
    if (!layer) return;
    registry.add(path + ".lora_A.weight", lora_A(), grad_A());
    registry.add(path + ".lora_B.weight", lora_B(), grad_B());
  }
  void zero_grad() {
    if (layer) layer->zero_grad();
  }
#if MEMKIT_HAS_CUDA
  void zero_grad(const memkit::cuda_executor& exec) {
    if (layer) layer->zero_grad(exec);
  }
#endif
  void zero_grad(const memkit::host_executor&) { zero_grad(); }

  shape output_shape(const shape& s) const { return layers::with_last(s, weight_shape()[0]); }
  std::size_t saved_bytes(const shape& s, const forward_context& ctx) const { return layer ? layer->saved_bytes(s, ctx) : 0; }
  std::size_t workspace_bytes(const shape& s) const {
    const std::int64_t tokens = layers::rows_of(s);
    if (layer)
      return std::max(memkit::lora::workspace_bytes(layer->forward_arguments(tokens, on_device)),
                      memkit::lora::workspace_bytes(layer->backward_arguments(tokens, false, true, on_device)));
    const shape w = weight_shape();
    if constexpr (quantized_base) {
      namespace q = memkit::quant;
      const q::matmul_arguments forward{q::matmul_kind::forward, Base::quant_format, base->block_size(), tokens,
                                        w[0], w[1], sizeof(T), on_device, matmul};
      q::matmul_arguments input_grad = forward;
      input_grad.kind = q::matmul_kind::input_grad;
      return std::max(q::workspace_bytes(forward), q::workspace_bytes(input_grad));
    } else {
      if (on_device) return 0;
      const la::gemm_options o{host_threads};
      return std::max(la::gemm_workspace_bytes<T, T, T>(tokens, w[0], w[1], o),
                      la::gemm_workspace_bytes<T, T, T>(tokens, w[1], w[0], o));
    }
  }
  // Under ZeRO stage 3 (models/llama/stage3.hpp) the base is in memory only between its gather and release.
  void require_base_present() const {
    bool present = false;
    if constexpr (quantized_base) present = base->numel() > 0 && base->codes().data() != nullptr;
    else present = base->data() != nullptr;
    if (!present)
      memkit::require(false, "'" + path + "': its base weight is not in memory; under stage 3, gather the layer before it runs");
  }
  template <memkit::executor E>
  void forward(const E& exec, const forward_context& ctx, tensor_view<const T> x, tensor_view<T> y,
               activation_store& store) {
    require_base_present();
    if (layer) return layer->forward(exec, ctx, x, y, store);
    if constexpr (quantized_base) {
      const std::int64_t out = weight_shape()[0];
      memkit::quant::matmul(exec, x, *base, y, matmul, *workspace);
      if (bias)
        layers::for_each_index(exec, layers::rows_of(x.shape()) * out, layers::bias_add_element<T>{y.data(), bias->data(), out});
    } else {
      layers::dense_linear_forward(exec, x, std::as_const(*base).view(),
                                   bias ? std::as_const(*bias).view() : tensor_view<const T>::none(), y,
                                   layers::dense_linear_options{host_threads}, *workspace);
    }
  }
  template <memkit::executor E>
  void backward(const E& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
    require_base_present();
    if (layer) return layer->backward(exec, dy, dx, store);
    if (dx.is_none() || dx.empty()) return;
    if constexpr (quantized_base) {
      memkit::quant::matmul_input_grad(exec, dy, *base, dx, matmul, *workspace);
    } else {
      layers::dense_linear_backward(exec, dy, tensor_view<const T>::none(), std::as_const(*base).view(), dx,
                                    tensor_view<float>::none(), tensor_view<float>::none(),
                                    layers::dense_linear_options{host_threads}, *workspace);
    }
  }
};

// QLoRA's projection: LoRA over an NF4 weight.
template <class T>
using nf4_lora_linear = lora_projection<T, memkit::quant::quantized_tensor<memkit::quant::NF4>>;
// LoRA over a dense base in the training dtype.
template <class T>
using dense_lora_linear = lora_projection<T, T>;

}  // namespace memkit::models::llama
