// examples/llama/plain_lora.hpp — a plain LoRA layer over a frozen NF4 weight for the example, used until
// memkit's lora_linear (memkit/lora/lora_linear.hpp, issue #9) is on main.
//
// NOT memkit's component: y = x dequant(W)^T + scale * (x A^T) B^T with the base through memkit's
// quant::matmul (tiles of W dequantized in workspace, never the whole weight), A [r, in] and B [out, r] in
// fp32, trained; the base gets no gradient. Saves x (for A's gradient) and x A^T (for B's). No dropout.
// The example prints which LoRA layer it ran.
#pragma once

#include "layers.hpp"

#include <memkit/quant/matmul.hpp>
#include <memkit/quant/quantized_tensor.hpp>

#include <algorithm>
#include <cmath>
#include <string>

namespace llama {

template <class T>
struct plain_nf4_lora_linear {
  using value_type = T;
  using base_type = memkit::quant::quantized_tensor<memkit::quant::NF4>;
  using adapter_type = float;
  static constexpr const char* description = "plain LoRA over NF4 in examples/llama/plain_lora.hpp (stand-in)";

  std::string path;  // the module's path in the base model, e.g. "model.layers.0.self_attn.q_proj"
  std::int64_t in = 0, out = 0, rank = 0;
  float scale = 1.0f;
  base_type base;
  memkit::buffer<float> A, B, grad_A_, grad_B_;
  memory_resources memory;

  plain_nf4_lora_linear() = default;
  plain_nf4_lora_linear(std::string path_, base_type&& base_, std::int64_t rank_, float alpha,
                        const memory_resources& memory_, std::uint64_t seed, std::uint64_t stream)
      : path(std::move(path_)), in(base_.logical_shape()[1]), out(base_.logical_shape()[0]), rank(rank_),
        scale(alpha / static_cast<float>(rank_)), base(std::move(base_)), A(*memory_.weights, shape{rank_, in}),
        B(*memory_.weights, shape{out, rank_}), grad_A_(*memory_.gradients, shape{rank_, in}),
        grad_B_(*memory_.gradients, shape{out, rank_}), memory(memory_) {
    // PEFT's default: A ~ kaiming-uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0.
    const float bound = 1.0f / std::sqrt(static_cast<float>(in));
    for (std::int64_t i = 0; i < A.size(); ++i)
      A.data()[i] = bound * (2.0f * memkit::unit_float(memkit::random_word(seed, stream, static_cast<std::uint64_t>(i))) - 1.0f);
    std::fill(B.data(), B.data() + B.size(), 0.0f);
    zero_grad();
  }

  tensor_view<float> lora_A() { return A.view(); }
  tensor_view<float> lora_B() { return B.view(); }
  tensor_view<float> grad_A() { return grad_A_.view(); }
  tensor_view<float> grad_B() { return grad_B_.view(); }
  void zero_grad() {
    std::fill(grad_A_.data(), grad_A_.data() + grad_A_.size(), 0.0f);
    std::fill(grad_B_.data(), grad_B_.data() + grad_B_.size(), 0.0f);
  }

  const base_type& base_weight() const noexcept { return base; }

  static constexpr std::size_t parameter_bytes(std::int64_t in, std::int64_t out, std::int64_t rank) {
    return memkit::buffer<float>::bytes_required(shape{rank, in}) + memkit::buffer<float>::bytes_required(shape{out, rank});
  }
  static constexpr std::size_t gradient_bytes(std::int64_t in, std::int64_t out, std::int64_t rank) {
    return parameter_bytes(in, out, rank);
  }

  shape output_shape(const shape& s) const { return with_last(s, out); }
  std::size_t saved_bytes(const shape& s, const forward_context&) const {
    return activation_store::bytes_required<T>(s) + activation_store::bytes_required<T>(with_last(s, rank));
  }
  std::size_t workspace_bytes(const shape& s) const {
    namespace q = memkit::quant;
    const std::int64_t rows = rows_of(s);
    const la::gemm_options o{memory.host_threads};
    const std::size_t forward = std::max(
        {q::matmul_workspace_bytes(q::matmul_kind::forward, q::format::nf4, base.block_size(), rows, out, in, sizeof(T), false),
         la::gemm_workspace_bytes<T, float, T>(rows, rank, in, o), la::gemm_workspace_bytes<T, float, T>(rows, out, rank, o)});
    const std::size_t backward =
        memkit::buffer<float>::bytes_required(shape{rows, rank}) +
        std::max({la::gemm_workspace_bytes<T, T, float>(out, rank, rows, o),
                  la::gemm_workspace_bytes<T, float, float>(rows, rank, out, o),
                  la::gemm_workspace_bytes<float, T, float>(rank, in, rows, o),
                  q::matmul_workspace_bytes(q::matmul_kind::input_grad, q::format::nf4, base.block_size(), rows, out, in,
                                            sizeof(T), false),
                  la::gemm_workspace_bytes<float, float, T>(rows, in, rank, o)});
    return std::max(forward, backward);
  }

  void forward(const host_executor& exec, const forward_context&, tensor_view<const T> x, tensor_view<T> y,
               activation_store& store) {
    const std::int64_t rows = rows_of(x.shape());
    const la::gemm_options o{memory.host_threads};
    tensor_view<T> kept = store.save<T>(x.shape());
    std::copy(x.begin(), x.end(), kept.begin());
    tensor_view<T> xa = store.save<T>(with_last(x.shape(), rank));
    memkit::quant::matmul(exec, x, base, y, *memory.workspace);
    la::gemm(exec, la::transpose::no, la::transpose::yes, 1.0f, cmat(x.data(), rows, in), cmat<float>(A.data(), rank, in),
             0.0f, mat(xa.data(), rows, rank), *memory.workspace, o);
    la::gemm(exec, la::transpose::no, la::transpose::yes, scale, cmat<T>(xa.data(), rows, rank),
             cmat<float>(B.data(), out, rank), 1.0f, mat(y.data(), rows, out), *memory.workspace, o);
  }

  void backward(const host_executor& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
    const std::int64_t rows = rows_of(dy.shape());
    const la::gemm_options o{memory.host_threads};
    const auto xa = store.take<T>(with_last(dy.shape(), rank), "plain_nf4_lora_linear");
    const auto x = store.take<T>(with_last(dy.shape(), in), "plain_nf4_lora_linear");
    memkit::buffer<float> dxa(*memory.workspace, shape{rows, rank});
    // dB += scale * dy^T xa;  dxa = scale * dy B;  dA += dxa^T x
    la::gemm(exec, la::transpose::yes, la::transpose::no, scale, cmat(dy.data(), rows, out),
             cmat<T>(xa.view().data(), rows, rank), 1.0f, mat(grad_B_.data(), out, rank), *memory.workspace, o);
    la::gemm(exec, la::transpose::no, la::transpose::no, scale, cmat(dy.data(), rows, out),
             cmat<float>(B.data(), out, rank), 0.0f, mat(dxa.data(), rows, rank), *memory.workspace, o);
    la::gemm(exec, la::transpose::yes, la::transpose::no, 1.0f, cmat<float>(dxa.data(), rows, rank),
             cmat<T>(x.view().data(), rows, in), 1.0f, mat(grad_A_.data(), rank, in), *memory.workspace, o);
    if (dx.empty()) return;
    memkit::quant::matmul_input_grad(exec, dy, base, dx, *memory.workspace);
    la::gemm(exec, la::transpose::no, la::transpose::no, 1.0f, cmat<float>(dxa.data(), rows, rank),
             cmat<float>(A.data(), rank, in), 1.0f, mat(dx.data(), rows, in), *memory.workspace, o);
  }
};

}  // namespace llama
