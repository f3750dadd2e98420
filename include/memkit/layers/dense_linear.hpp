// memkit/layers/dense_linear.hpp — a trainable dense linear layer, y = x W^T (+ b), on the host and (compiled
// by nvcc) on a cuda_executor.
//
//   dense_linear_arguments<T> args{rows, in, out, bias, weight_grad, on_device, options};
//   workspace_bytes(args) / saved_bytes(args) / bytes_required(args)      constexpr, found by ADL
//   dense_linear_forward(exec, x, weight, bias, y, options, workspace)
//   dense_linear_backward(exec, dy, x, weight, dx, weight_grad, bias_grad, options, workspace)
//   dense_linear<T>    the layer (core/layer.hpp): owns W [out, in] and the optional b [out] as
//                      basic_parameter<T>, saves x when W trains, register_parameters(registry)
//
// W, b, x and y are T, the training dtype (bf16, or float); the gradients of W and b are fp32 and
// accumulate (+=). Every product accumulates in fp32 (linalg::gemm: the host kernel, or cuBLAS on a
// cuda_executor). The bias is added after the product is rounded to T (torch adds it in the GEMM's fp32
// epilogue): in bf16 one more rounding, in fp32 only the order of one addition differs.
// Absent tensors are tensor_view<...>::none(): no bias, no input gradient wanted (dx), a frozen weight
// (weight_grad, and then x, none), a frozen bias (bias_grad).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "memkit/core/layer.hpp"
#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/layers/parameter.hpp"
#include "memkit/layers/tensor_ops.hpp"
#include "memkit/linalg/gemm.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace layers {

struct dense_linear_options {
  int host_threads = 1;  // of the host GEMMs (0 = every hardware thread); the results do not depend on it
};

// One dense_linear problem: `rows` rows of `in` features to `out` features, elements of T.
template <class T>
struct dense_linear_arguments {
  std::int64_t rows = 0, in = 0, out = 0;
  bool bias = false;         // y gets + b
  bool weight_grad = true;   // W trains: the forward saves x, the backward accumulates dW (and db)
  bool on_device = false;    // the tensors are device memory (cuBLAS, which takes no workspace)
  dense_linear_options options{};
};

// The most either call takes from its workspace resource: the host GEMMs' packing buffers; cuBLAS on the
// device takes nothing from it.
template <class T>
constexpr std::size_t workspace_bytes(const dense_linear_arguments<T>& a) noexcept {
  if (a.on_device) return 0;
  const linalg::gemm_options o{a.options.host_threads};
  return std::max({linalg::gemm_workspace_bytes<T, T, T>(a.rows, a.out, a.in, o),
                   linalg::gemm_workspace_bytes<T, T, float>(a.out, a.in, a.rows, o),
                   linalg::gemm_workspace_bytes<T, T, T>(a.rows, a.in, a.out, o)});
}
// What the forward leaves for the backward: x, when W trains.
template <class T>
constexpr std::size_t saved_bytes(const dense_linear_arguments<T>& a) noexcept {
  return a.weight_grad ? activation_store::bytes_required<T>(shape{a.rows, a.in}) : 0;
}
// What must be free when the forward starts: its workspace and the x it keeps.
template <class T>
constexpr std::size_t bytes_required(const dense_linear_arguments<T>& a) noexcept {
  return workspace_bytes(a) + saved_bytes(a);
}

// y = x W^T (+ b). x [..., in], weight [out, in], bias [out] or none, y [..., out].
template <executor E, class T>
void dense_linear_forward(const E& exec, tensor_view<const T> x, tensor_view<const T> weight, tensor_view<const T> bias,
                          tensor_view<T> y, const dense_linear_options& options, memory_resource& workspace);

// Accumulates weight_grad += dy^T x and bias_grad += the column sums of dy, then writes dx = dy W.
// dy [..., out]; x: the forward's input [..., in] (may be none when weight_grad is none); weight [out, in];
// dx [..., in] or none; weight_grad [out, in] fp32 or none; bias_grad [out] fp32 or none.
template <executor E, class T>
void dense_linear_backward(const E& exec, tensor_view<const T> dy, tensor_view<const T> x, tensor_view<const T> weight,
                           tensor_view<T> dx, tensor_view<float> weight_grad, tensor_view<float> bias_grad,
                           const dense_linear_options& options, memory_resource& workspace);

// The layer: W [out, in] and the optional bias [out] in the training dtype T, trained or frozen together.
template <class T>
struct dense_linear {
  using value_type = T;
  std::int64_t in = 0, out = 0;
  basic_parameter<T> weight;  // [out, in]
  basic_parameter<T> bias;    // [out]; unallocated unless with_bias
  memory_resources memory;
  bool with_bias = false;

  dense_linear() = default;
  // `name` is the weight's key ("....q_proj.weight"); the bias, when there is one, is "....q_proj.bias".
  dense_linear(std::string name, std::int64_t in_, std::int64_t out_, const memory_resources& memory_, trainability mode,
               bool with_bias_ = false);

  bool has_bias() const noexcept { return with_bias; }
  // The problem of an input of shape `s`.
  dense_linear_arguments<T> arguments(const shape& s) const {
    return {rows_of(s), in, out, has_bias(), weight.trains(), memory.on_device(), {memory.host_threads}};
  }
  shape output_shape(const shape& s) const { return with_last(s, out); }
  std::size_t saved_bytes(const shape& s, const forward_context&) const { return layers::saved_bytes(arguments(s)); }
  std::size_t workspace_bytes(const shape& s) const { return layers::workspace_bytes(arguments(s)); }

  // Hands the trainable weight (and bias) to a parameter_registry (parameters.hpp), weight first.
  template <class Registry>
  void register_parameters(Registry& registry) {
    registry.add(weight);
    if (has_bias()) registry.add(bias);
  }

  template <executor E>
  void forward(const E& exec, const forward_context&, tensor_view<const T> x, tensor_view<T> y, activation_store& store);
  // dx none or empty: no input gradient.
  template <executor E>
  void backward(const E& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store);
};

// ---- implementation ----------------------------------------------------------------------------------------
// y[r, j] += b[j], one element.
template <class T>
struct bias_add_element {
  T* y;
  const T* bias;
  std::int64_t out;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t i) const { y[i] = from_float<T>(to_float(y[i]) + to_float(bias[i % out])); }
};
// db[j] += sum over rows of dy[r, j], rows in order (the same sums on every executor).
template <class T>
struct bias_grad_column {
  const T* dy;
  float* grad;
  std::int64_t rows, out;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t j) const {
    float g = grad[j];
    for (std::int64_t r = 0; r < rows; ++r) g += to_float(dy[r * out + j]);
    grad[j] = g;
  }
};

namespace detail {
inline void require_dense(bool ok, const char* op, const char* argument, const std::string& what) {
  require(ok, std::string("layers::") + op + ": " + argument + " " + what);
}
struct dense_dims {
  std::int64_t rows, in, out;
};
// W [out, in] and the activation that fixes the rows: x [..., in] (forward) or dy [..., out] (backward).
inline dense_dims dense_problem(const char* op, const shape& weight, const char* name, const shape& activation, bool is_input) {
  require_dense(weight.rank == 2, op, "weight", "must be [out, in], got " + to_string(weight));
  const std::int64_t out = weight[0], in = weight[1], last = is_input ? in : out;
  require_dense(activation.rank >= 1 && activation[activation.rank - 1] == last, op, name,
                "must be [..., " + std::to_string(last) + "], got " + to_string(activation));
  return {rows_of(activation), in, out};
}
inline std::string rows_text(std::int64_t rows, std::int64_t width) {
  return std::to_string(rows) + " rows of " + std::to_string(width);
}
}  // namespace detail

template <executor E, class T>
void dense_linear_forward(const E& exec, tensor_view<const T> x, tensor_view<const T> weight, tensor_view<const T> bias,
                          tensor_view<T> y, const dense_linear_options& options, memory_resource& workspace) {
  constexpr const char* op = "dense_linear_forward";
  const auto [rows, in, out] = detail::dense_problem(op, weight.shape(), "x", x.shape(), true);
  detail::require_dense(y.size() == rows * out, op, "y",
                        "must hold " + detail::rows_text(rows, out) + ", got " + to_string(y.shape()));
  detail::require_dense(bias.is_none() || bias.size() == out, op, "bias",
                        "must be none or [" + std::to_string(out) + "], got " + to_string(bias.shape()));
  linalg::gemm(exec, linalg::transpose::no, linalg::transpose::yes, 1.0f, cmat(x.data(), rows, in, x.where()),
               cmat<T>(weight.data(), out, in, weight.where()), 0.0f, mat(y.data(), rows, out, y.where()), workspace,
               linalg::gemm_options{options.host_threads});
  if (!bias.is_none()) for_each_index(exec, rows * out, bias_add_element<T>{y.data(), bias.data(), out});
}

template <executor E, class T>
void dense_linear_backward(const E& exec, tensor_view<const T> dy, tensor_view<const T> x, tensor_view<const T> weight,
                           tensor_view<T> dx, tensor_view<float> weight_grad, tensor_view<float> bias_grad,
                           const dense_linear_options& options, memory_resource& workspace) {
  constexpr const char* op = "dense_linear_backward";
  const auto [rows, in, out] = detail::dense_problem(op, weight.shape(), "dy", dy.shape(), false);
  detail::require_dense(weight_grad.is_none() || weight_grad.size() == out * in, op, "weight_grad",
                        "must be none or [" + std::to_string(out) + ", " + std::to_string(in) + "], got " +
                            to_string(weight_grad.shape()));
  detail::require_dense(weight_grad.is_none() || x.size() == rows * in, op, "x",
                        "must hold " + detail::rows_text(rows, in) + " (the forward's input), got " + to_string(x.shape()));
  detail::require_dense(bias_grad.is_none() || bias_grad.size() == out, op, "bias_grad",
                        "must be none or [" + std::to_string(out) + "], got " + to_string(bias_grad.shape()));
  detail::require_dense(dx.is_none() || dx.size() == rows * in, op, "dx",
                        "must be none or hold " + detail::rows_text(rows, in) + ", got " + to_string(dx.shape()));
  if (!weight_grad.is_none())
    linalg::gemm(exec, linalg::transpose::yes, linalg::transpose::no, 1.0f, cmat(dy.data(), rows, out, dy.where()),
                 cmat<T>(x.data(), rows, in, x.where()), 1.0f, mat(weight_grad.data(), out, in, weight_grad.where()),
                 workspace, linalg::gemm_options{options.host_threads});
  if (!bias_grad.is_none()) for_each_index(exec, out, bias_grad_column<T>{dy.data(), bias_grad.data(), rows, out});
  if (!dx.is_none())
    linalg::gemm(exec, linalg::transpose::no, linalg::transpose::no, 1.0f, cmat(dy.data(), rows, out, dy.where()),
                 cmat<T>(weight.data(), out, in, weight.where()), 0.0f, mat(dx.data(), rows, in, dx.where()), workspace,
                 linalg::gemm_options{options.host_threads});
}

template <class T>
dense_linear<T>::dense_linear(std::string name, std::int64_t in_, std::int64_t out_, const memory_resources& memory_,
                              trainability mode, bool with_bias_)
    : in(in_), out(out_), memory(memory_), with_bias(with_bias_) {
  if (with_bias) {
    std::string bias_name = name;
    const std::string suffix = ".weight";
    if (bias_name.size() > suffix.size() && bias_name.compare(bias_name.size() - suffix.size(), suffix.size(), suffix) == 0)
      bias_name.resize(bias_name.size() - suffix.size());
    bias = basic_parameter<T>(bias_name + ".bias", shape{out_}, memory_, mode);
    bias.fill(0.0f);
  }
  weight = basic_parameter<T>(std::move(name), shape{out_, in_}, memory_, mode);
}

template <class T>
template <executor E>
void dense_linear<T>::forward(const E& exec, const forward_context&, tensor_view<const T> x, tensor_view<T> y,
                              activation_store& store) {
  if (weight.trains()) copy_view(exec, x, store.save<T>(x.shape()));
  dense_linear_forward(exec, x, std::as_const(weight.value).view(),
                       has_bias() ? std::as_const(bias.value).view() : tensor_view<const T>::none(), y,
                       dense_linear_options{memory.host_threads}, *memory.workspace);
}

template <class T>
template <executor E>
void dense_linear<T>::backward(const E& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
  saved_tensor<T> x;
  if (weight.trains()) x = store.take<T>(with_last(dy.shape(), in), "dense_linear");
  dense_linear_backward(exec, dy, weight.trains() ? std::as_const(x).view() : tensor_view<const T>::none(),
                        std::as_const(weight.value).view(), dx.is_none() || dx.empty() ? tensor_view<T>::none() : dx,
                        weight.grad_view(), has_bias() ? bias.grad_view() : tensor_view<float>::none(),
                        dense_linear_options{memory.host_threads}, *memory.workspace);
}

}  // namespace layers
MEMKIT_NAMESPACE_END
