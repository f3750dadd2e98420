// Small host layers for the checkpointing tests: a linear (linalg::gemm), dropout, tanh, memkit's lora_linear, and mixed_layer,
// one type that is any of them (a std::vector<mixed_layer> is a stack whose layers differ in widths and
// saved bytes). Each counts its forward calls so tests can check the recomputations a schedule predicts.
#pragma once

#include <memkit/core/layer.hpp>
#include <memkit/core/random.hpp>
#include <memkit/linalg/gemm.hpp>
#include <memkit/lora/lora_linear.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

namespace checkpoint_test {

using memkit::activation_store;
using memkit::forward_context;
using memkit::host_executor;
using memkit::shape;
using memkit::tensor_view;

inline std::vector<float> random_values(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// y = x W^T + b over rows of x ([rows, in] -> [rows, out]); saves its input for the weight gradient.
struct linear {
  using value_type = float;
  std::int64_t in = 0, out = 0;
  std::vector<float> weight, bias, weight_grad, bias_grad;
  std::uint64_t forwards = 0;

  linear() = default;
  linear(std::int64_t in_features, std::int64_t out_features, std::uint32_t seed)
      : in(in_features), out(out_features), weight(random_values(in * out, seed, 1.0f / std::sqrt(float(in)))),
        bias(random_values(out, seed + 1, 0.1f)), weight_grad(in * out, 0.0f), bias_grad(out, 0.0f) {}

  shape output_shape(const shape& s) const { return {s[0], out}; }
  std::size_t saved_bytes(const shape& s, const forward_context&) const {
    return activation_store::bytes_required<float>(s);
  }
  void forward(const host_executor& exec, const forward_context&, tensor_view<const float> x, tensor_view<float> y,
               activation_store& store) {
    ++forwards;
    const std::int64_t rows = x.shape()[0];
    tensor_view<float> kept = store.save<float>(x.shape());
    std::memcpy(kept.data(), x.data(), x.bytes());
    namespace la = memkit::linalg;
    la::gemm(exec, la::transpose::no, la::transpose::yes, 1.0f, la::as_matrix(x, rows, in), weights(), 0.0f,
             la::as_matrix(y, rows, out), memkit::default_host_resource());
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t o = 0; o < out; ++o) y[r * out + o] += bias[o];
  }
  void backward(const host_executor& exec, tensor_view<const float> dy, tensor_view<float> dx,
                activation_store& store) {
    const std::int64_t rows = dy.shape()[0];
    memkit::saved_tensor<float> x = store.take<float>(shape{rows, in}, "linear");
    namespace la = memkit::linalg;
    la::gemm(exec, la::transpose::yes, la::transpose::no, 1.0f, la::as_matrix(dy, rows, out),
             la::as_matrix(tensor_view<const float>(x.view()), rows, in), 1.0f,
             la::matrix_ref<float>{weight_grad.data(), out, in, in, memkit::memory_kind::host},
             memkit::default_host_resource());
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t o = 0; o < out; ++o) bias_grad[o] += dy[r * out + o];
    if (!dx.is_none())
      la::gemm(exec, la::transpose::no, la::transpose::no, 1.0f, la::as_matrix(dy, rows, out), weights(), 0.0f,
               la::as_matrix(dx, rows, in), memkit::default_host_resource());
  }

  memkit::linalg::matrix_ref<const float> weights() const {
    return {weight.data(), out, in, in, memkit::memory_kind::host};
  }
};

// Inverted dropout with probability p; its mask comes from the forward_context alone.
struct dropout {
  using value_type = float;
  float p = 0.25f;
  std::uint64_t forwards = 0;
  bool masked = false;  // whether the last forward saved a mask (training)

  shape output_shape(const shape& s) const { return s; }
  std::size_t saved_bytes(const shape& s, const forward_context& ctx) const {
    return ctx.training ? activation_store::bytes_required<std::uint8_t>(s) : 0;
  }
  void forward(const host_executor&, const forward_context& ctx, tensor_view<const float> x, tensor_view<float> y,
               activation_store& store) {
    ++forwards;
    masked = ctx.training;
    if (!masked) {
      std::memcpy(y.data(), x.data(), x.bytes());
      return;
    }
    tensor_view<std::uint8_t> mask = store.save<std::uint8_t>(x.shape());
    const float scale = 1.0f / (1.0f - p);
    for (std::int64_t i = 0; i < x.size(); ++i) {
      mask[i] = memkit::unit_float(memkit::random_word(ctx.seed, ctx.counter, static_cast<std::uint64_t>(i))) >= p;
      y[i] = mask[i] ? x[i] * scale : 0.0f;
    }
  }
  void backward(const host_executor&, tensor_view<const float> dy, tensor_view<float> dx, activation_store& store) {
    if (!masked) {
      if (!dx.is_none()) std::memcpy(dx.data(), dy.data(), dy.bytes());
      return;
    }
    memkit::saved_tensor<std::uint8_t> mask = store.take<std::uint8_t>(dy.shape(), "dropout");
    const float scale = 1.0f / (1.0f - p);
    if (!dx.is_none())
      for (std::int64_t i = 0; i < dy.size(); ++i) dx[i] = mask.view()[i] ? dy[i] * scale : 0.0f;
  }
};

// y = tanh(x); saves y.
struct tanh_layer {
  using value_type = float;
  std::uint64_t forwards = 0;

  shape output_shape(const shape& s) const { return s; }
  std::size_t saved_bytes(const shape& s, const forward_context&) const {
    return activation_store::bytes_required<float>(s);
  }
  void forward(const host_executor&, const forward_context&, tensor_view<const float> x, tensor_view<float> y,
               activation_store& store) {
    ++forwards;
    tensor_view<float> kept = store.save<float>(x.shape());
    for (std::int64_t i = 0; i < x.size(); ++i) kept[i] = y[i] = std::tanh(x[i]);
  }
  void backward(const host_executor&, tensor_view<const float> dy, tensor_view<float> dx, activation_store& store) {
    memkit::saved_tensor<float> y = store.take<float>(dy.shape(), "tanh");
    if (!dx.is_none())
      for (std::int64_t i = 0; i < dy.size(); ++i) dx[i] = dy[i] * (1.0f - y.view()[i] * y.view()[i]);
  }
};

// memkit's lora_linear (lora/lora_linear.hpp) over a frozen fp32 base W [out, in], with dropout on the adapter
// branch (its mask from the forward_context, drawn again in backward) and a non-zero B, counting its forwards
// as the other test layers do.
struct lora_adapter {
  using value_type = float;
  std::vector<float> weight;  // the frozen base; a vector's move keeps its data where the layer's view points
  std::unique_ptr<memkit::lora::lora_linear<float>> layer;
  std::uint64_t forwards = 0;

  lora_adapter() = default;
  lora_adapter(std::int64_t in, std::int64_t out, std::int64_t r, std::uint32_t seed)
      : weight(random_values(static_cast<std::size_t>(in * out), seed, 1.0f / std::sqrt(float(in)))),
        layer(std::make_unique<memkit::lora::lora_linear<float>>(
            memkit::host_view(weight.data(), {out, in}),
            memkit::lora::lora_options{.rank = r, .alpha = 2.0 * static_cast<double>(r), .dropout = 0.1f, .init_seed = seed},
            memkit::default_host_resource(), memkit::default_host_resource(), memkit::default_host_resource())) {
    const std::vector<float> b = random_values(static_cast<std::size_t>(out * r), seed + 2, 0.2f);
    std::copy(b.begin(), b.end(), layer->lora_B().begin());
  }

  shape output_shape(const shape& s) const { return layer->output_shape(s); }
  std::size_t saved_bytes(const shape& s, const forward_context& ctx) const { return layer->saved_bytes(s, ctx); }
  void forward(const host_executor& exec, const forward_context& ctx, tensor_view<const float> x, tensor_view<float> y,
               activation_store& store) {
    ++forwards;
    layer->forward(exec, ctx, x, y, store);
  }
  void backward(const host_executor& exec, tensor_view<const float> dy, tensor_view<float> dx, activation_store& store) {
    layer->backward(exec, dy, dx, store);
  }
  void zero_grad() {
    if (layer) layer->zero_grad();
  }
  // A's and B's gradients, appended to `out`.
  void append_grads(std::vector<float>& out) const {
    if (!layer) return;
    out.insert(out.end(), layer->grad_A().begin(), layer->grad_A().end());
    out.insert(out.end(), layer->grad_B().begin(), layer->grad_B().end());
  }
};

// One type for any of the four, so a std::vector of it is a stack of different layers.
struct mixed_layer {
  using value_type = float;
  enum class kind { linear, dropout, tanh, lora } what = kind::tanh;
  checkpoint_test::linear lin;
  checkpoint_test::dropout drop;
  tanh_layer act;
  lora_adapter adapter;

  static mixed_layer make_linear(std::int64_t in, std::int64_t out, std::uint32_t seed) {
    mixed_layer m;
    m.what = kind::linear;
    m.lin = linear(in, out, seed);
    return m;
  }
  static mixed_layer make_dropout(float p) {
    mixed_layer m;
    m.what = kind::dropout;
    m.drop.p = p;
    return m;
  }
  static mixed_layer make_tanh() { return mixed_layer{}; }
  static mixed_layer make_lora(std::int64_t features, std::uint32_t seed) {
    mixed_layer m;
    m.what = kind::lora;
    m.adapter = lora_adapter(features, features, 2, seed);
    return m;
  }

  template <class F>
  decltype(auto) with(F&& f) {
    switch (what) {
      case kind::linear: return f(lin);
      case kind::dropout: return f(drop);
      case kind::lora: return f(adapter);
      default: return f(act);
    }
  }
  template <class F>
  decltype(auto) with(F&& f) const {
    switch (what) {
      case kind::linear: return f(lin);
      case kind::dropout: return f(drop);
      case kind::lora: return f(adapter);
      default: return f(act);
    }
  }
  std::uint64_t forwards() const {
    return with([](const auto& l) { return l.forwards; });
  }
  shape output_shape(const shape& s) const {
    return with([&](const auto& l) { return l.output_shape(s); });
  }
  std::size_t saved_bytes(const shape& s, const forward_context& ctx) const {
    return with([&](const auto& l) { return l.saved_bytes(s, ctx); });
  }
  void forward(const host_executor& exec, const forward_context& ctx, tensor_view<const float> x, tensor_view<float> y,
               activation_store& store) {
    with([&](auto& l) { l.forward(exec, ctx, x, y, store); });
  }
  void backward(const host_executor& exec, tensor_view<const float> dy, tensor_view<float> dx, activation_store& store) {
    with([&](auto& l) { l.backward(exec, dy, dx, store); });
  }
};

static_assert(memkit::layer<linear, host_executor>);
static_assert(memkit::layer<dropout, host_executor>);
static_assert(memkit::layer<tanh_layer, host_executor>);
static_assert(memkit::layer<lora_adapter, host_executor>);
static_assert(memkit::layer<memkit::lora::lora_linear<float>, host_executor>);
static_assert(memkit::layer<mixed_layer, host_executor>);

// linear(width -> wider) dropout tanh lora linear(wider -> width) ... repeated: `layers` layers, hidden
// widths alternating so the stack's hidden states and saved bytes are not uniform.
inline std::vector<mixed_layer> mixed_stack(std::size_t layers, std::int64_t width, std::uint32_t seed) {
  std::vector<mixed_layer> stack;
  std::int64_t features = width;
  for (std::size_t i = 0; i < layers; ++i) {
    switch (i % 5) {
      case 0: {
        const std::int64_t next = (i / 5) % 2 == 0 ? width + 3 : width;
        stack.push_back(mixed_layer::make_linear(features, next, seed + static_cast<std::uint32_t>(i) * 7));
        features = next;
        break;
      }
      case 1: stack.push_back(mixed_layer::make_dropout(0.3f)); break;
      case 2: stack.push_back(mixed_layer::make_tanh()); break;
      case 3: stack.push_back(mixed_layer::make_lora(features, seed + static_cast<std::uint32_t>(i) * 7)); break;
      default: {
        stack.push_back(mixed_layer::make_linear(features, width, seed + static_cast<std::uint32_t>(i) * 7));
        features = width;
      }
    }
  }
  return stack;
}

}  // namespace checkpoint_test
