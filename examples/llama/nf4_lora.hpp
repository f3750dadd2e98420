// examples/llama/nf4_lora.hpp — one QLoRA projection: memkit's lora_linear over an NF4 weight it owns.
//
// memkit::lora::lora_linear references its quantized base (the caller owns it); this wrapper keeps the
// weight next to the layer (on the heap, so moving the wrapper keeps the layer's pointer valid) and adds
// the module path and the one workspace figure the decoder block adds up. Adapters are bf16 (the
// activation type), their gradients fp32; AdamW updates the bf16 adapters with stochastic rounding.
#pragma once

#include "layers.hpp"

#include <memkit/lora/lora_linear.hpp>
#include <memkit/quant/quantized_tensor.hpp>

#include <algorithm>
#include <memory>
#include <string>

namespace llama {

template <class T>
struct nf4_lora_linear {
  using value_type = T;
  using base_type = memkit::quant::quantized_tensor<memkit::quant::NF4>;
  using layer_type = memkit::lora::lora_linear<base_type, T>;
  using adapter_type = T;
  static constexpr const char* description =
      "memkit::lora::lora_linear<quantized_tensor<NF4>, bf16> (memkit/lora/lora_linear.hpp)";

  std::string path;  // the module's path in the base model, e.g. "model.layers.0.self_attn.q_proj"
  std::unique_ptr<base_type> base;
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

  nf4_lora_linear(std::string path_, base_type&& base_, std::int64_t rank, float alpha, const memory_resources& memory,
                  std::uint64_t seed, std::uint64_t stream)
      : path(std::move(path_)), base(std::make_unique<base_type>(std::move(base_))),
        layer(base.get(), options_for(rank, alpha, memory, memkit::random_word(seed, stream, 0)), *memory.weights,
              *memory.gradients),
        on_device(memory.on_device()) {
    layer.set_workspace(*memory.workspace);
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

}  // namespace llama
