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
#include <memkit/quant/quantized_tensor.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <type_traits>

namespace memkit::models::llama {

// Base: quant::quantized_tensor<NF4> (QLoRA) or T (LoRA over a dense base in the training dtype).
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
  layer_type layer;
  bool on_device = false;  // the layer's memory is device memory (its workspace figures are the CUDA ones)

  static memkit::lora::lora_options options_for(std::int64_t rank, float alpha, const memory_resources& memory,
                                                std::uint64_t seed) {
    memkit::lora::lora_options o;
    o.rank = rank;
    o.alpha = alpha;
    o.init_seed = seed;
    o.host_threads = memory.host_threads;
    return o;
  }

  lora_projection(std::string path_, base_type&& base_, std::int64_t rank, float alpha, const memory_resources& memory,
                  std::uint64_t seed, std::uint64_t stream, std::unique_ptr<memkit::buffer<T>> bias_ = nullptr)
      : lora_projection(std::move(path_), std::move(base_),
                        options_for(rank, alpha, memory, memkit::random_word(seed, stream, 0)), memory, std::move(bias_)) {}
  // With every LoRA option given (rsLoRA, dropout, init; options.host_threads is the caller's).
  lora_projection(std::string path_, base_type&& base_, const memkit::lora::lora_options& options,
                  const memory_resources& memory, std::unique_ptr<memkit::buffer<T>> bias_ = nullptr)
      : path(std::move(path_)), base(std::make_unique<base_type>(std::move(base_))), bias(std::move(bias_)),
        layer(base_ref(), bias ? bias->view() : tensor_view<T>{}, options, *memory.weights, *memory.gradients),
        on_device(memory.on_device()) {
    layer.set_workspace(*memory.workspace);
  }

  typename layer_type::weight_ref base_ref() {
    if constexpr (quantized_base) return base.get();
    else return base->view();
  }
  const base_type& base_weight() const noexcept { return *base; }

  static constexpr std::size_t parameter_bytes(std::int64_t in, std::int64_t out, std::int64_t rank) {
    return layer_type::parameter_bytes(in, out, rank);
  }
  static constexpr std::size_t gradient_bytes(std::int64_t in, std::int64_t out, std::int64_t rank) {
    return layer_type::gradient_bytes(in, out, rank, false);
  }

  tensor_view<T> lora_A() { return layer.lora_A(); }
  tensor_view<T> lora_B() { return layer.lora_B(); }
  tensor_view<float> grad_A() { return layer.grad_A(); }
  tensor_view<float> grad_B() { return layer.grad_B(); }
  void zero_grad() { layer.zero_grad(); }
#if MEMKIT_HAS_CUDA
  void zero_grad(const memkit::cuda_executor& exec) { layer.zero_grad(exec); }
#endif
  void zero_grad(const memkit::host_executor&) { layer.zero_grad(); }

  shape output_shape(const shape& s) const { return layer.output_shape(s); }
  std::size_t saved_bytes(const shape& s, const forward_context& ctx) const { return layer.saved_bytes(s, ctx); }
  std::size_t workspace_bytes(const shape& s) const {
    const std::int64_t tokens = rows_of(s);
    return std::max(layer.forward_workspace_bytes(tokens, on_device),
                    layer.backward_workspace_bytes(tokens, false, true, on_device));
  }
  template <memkit::executor E>
  void forward(const E& exec, const forward_context& ctx, tensor_view<const T> x, tensor_view<T> y,
               activation_store& store) {
    layer.forward(exec, ctx, x, y, store);
  }
  template <memkit::executor E>
  void backward(const E& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
    layer.backward(exec, dy, dx, store);
  }
};

// QLoRA's projection: LoRA over an NF4 weight.
template <class T>
using nf4_lora_linear = lora_projection<T, memkit::quant::quantized_tensor<memkit::quant::NF4>>;
// LoRA over a dense base in the training dtype.
template <class T>
using dense_lora_linear = lora_projection<T, T>;

}  // namespace memkit::models::llama
