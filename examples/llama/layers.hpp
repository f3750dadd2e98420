// examples/llama/layers.hpp — the pieces of a Llama-style decoder as memkit layers (checkpoint/layer.hpp).
//
//   token_embedding    token ids -> hidden states (outside the layer stack: its input is not activations)
//   rms_norm           y = x / rms(x) * w                     saves x and the per-row 1/rms (fp32)
//   rotary             rotates pairs (i, i + d/2) of each head by position * theta^(-2i/d)   saves nothing
//   dense_linear       y = x W^T, W bf16 [out, in]             saves x when W trains
//   swiglu             y = silu(gate) * up over [.., 2f] -> [.., f]   saves its input
//
// Activations are T (bf16 in the example, float in the gradient tests); every product accumulates in fp32
// (linalg::gemm), elementwise math is fp32. Each layer says what it saves (saved_bytes) and what workspace
// it takes (workspace_bytes) before it runs, from the same shapes it allocates with.
#pragma once

#include "parameters.hpp"

#include <memkit/checkpoint/layer.hpp>
#include <memkit/core/execution.hpp>
#include <memkit/linalg/gemm.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace llama {

using memkit::activation_store;
using memkit::forward_context;
using memkit::host_executor;
namespace la = memkit::linalg;

template <class T>
float f32(T v) {
  return memkit::to_float(v);
}
template <class T>
T narrow(float v) {
  return memkit::from_float<T>(v);
}

// ---------------------------------------------------------------------------------------------------------
// Token embedding: ids [B, S] -> hidden [B, S, H]; backward adds each row of dy into its token's gradient row.
struct token_embedding {
  std::int64_t vocab = 0, hidden = 0;
  parameter weight;  // [vocab, hidden]

  token_embedding() = default;
  token_embedding(std::int64_t vocab_, std::int64_t hidden_, const memory_resources& memory, trainability mode)
      : vocab(vocab_), hidden(hidden_), weight("model.embed_tokens.weight", shape{vocab_, hidden_}, memory, mode) {}

  template <class T>
  void forward(const host_executor&, tensor_view<const std::int32_t> ids, tensor_view<T> y) const {
    memkit::require(y.size() == ids.size() * hidden, "token_embedding: y does not hold one row per token");
    for (std::int64_t t = 0; t < ids.size(); ++t) {
      const std::int32_t id = ids[t];
      memkit::require(id >= 0 && id < vocab, "token_embedding: token id " + std::to_string(id) + " is outside the vocabulary");
      const bf16* row = weight.value.data() + id * hidden;
      for (std::int64_t j = 0; j < hidden; ++j) y[t * hidden + j] = narrow<T>(f32(row[j]));
    }
  }
  template <class T>
  void backward(const host_executor&, tensor_view<const std::int32_t> ids, tensor_view<const T> dy) {
    if (!weight.trains()) return;
    for (std::int64_t t = 0; t < ids.size(); ++t) {
      float* row = weight.grad.data() + static_cast<std::int64_t>(ids[t]) * hidden;
      for (std::int64_t j = 0; j < hidden; ++j) row[j] += f32(dy[t * hidden + j]);
    }
  }
};

// ---------------------------------------------------------------------------------------------------------
template <class T>
struct rms_norm {
  using value_type = T;
  std::int64_t hidden = 0;
  float eps = 1e-5f;
  parameter weight;  // [hidden], starts at 1

  rms_norm() = default;
  rms_norm(std::string name, std::int64_t hidden_, const memory_resources& memory, trainability mode)
      : hidden(hidden_), weight(std::move(name), shape{hidden_}, memory, mode) {
    weight.fill(1.0f);
  }

  shape output_shape(const shape& in) const { return in; }
  std::size_t saved_bytes(const shape& in, const forward_context&) const {
    return activation_store::bytes_required<T>(in) + activation_store::bytes_required<float>(shape{rows_of(in)});
  }
  std::size_t workspace_bytes(const shape&) const { return 0; }

  void forward(const host_executor&, const forward_context&, tensor_view<const T> x, tensor_view<T> y,
               activation_store& store) {
    const std::int64_t rows = rows_of(x.shape());
    tensor_view<T> kept = store.save<T>(x.shape());
    std::copy(x.begin(), x.end(), kept.begin());
    tensor_view<float> rstd = store.save<float>(shape{rows});
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x.data() + r * hidden;
      float sum = 0.0f;
      for (std::int64_t j = 0; j < hidden; ++j) sum += f32(xr[j]) * f32(xr[j]);
      const float s = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      rstd[r] = s;
      for (std::int64_t j = 0; j < hidden; ++j) y[r * hidden + j] = narrow<T>(f32(xr[j]) * s * f32(weight.value.data()[j]));
    }
  }

  // dx = s * (g - x * s^2 * mean(g * x)), g = dy * w, s = 1/rms; dw += sum over rows of dy * x * s.
  void backward(const host_executor&, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
    const std::int64_t rows = rows_of(dy.shape());
    const auto rstd = store.take<float>(shape{rows}, "rms_norm");
    const auto x = store.take<T>(dy.shape(), "rms_norm");
    const T* xs = x.view().data();
    const float* w = nullptr;
    std::vector<float> weights(static_cast<std::size_t>(hidden));
    for (std::int64_t j = 0; j < hidden; ++j) weights[j] = f32(weight.value.data()[j]);
    w = weights.data();
    for (std::int64_t r = 0; r < rows; ++r) {
      const float s = rstd.view()[r];
      float dot = 0.0f;
      for (std::int64_t j = 0; j < hidden; ++j) dot += f32(dy[r * hidden + j]) * w[j] * f32(xs[r * hidden + j]);
      const float mean = dot / static_cast<float>(hidden);
      if (!dx.empty())
        for (std::int64_t j = 0; j < hidden; ++j) {
          const float g = f32(dy[r * hidden + j]) * w[j];
          dx[r * hidden + j] = narrow<T>(s * (g - f32(xs[r * hidden + j]) * s * s * mean));
        }
      if (weight.trains())
        for (std::int64_t j = 0; j < hidden; ++j) weight.grad.data()[j] += f32(dy[r * hidden + j]) * f32(xs[r * hidden + j]) * s;
    }
  }
};

// ---------------------------------------------------------------------------------------------------------
// Rotary position embedding on [B, S, heads * head_dim] (HF's rotate_half layout). The cos/sin table
// [max_positions, head_dim / 2] is computed once (fp32) and is a constant of the model, not an activation.
template <class T>
struct rotary {
  using value_type = T;
  std::int64_t head_dim = 0, max_positions = 0;
  memkit::buffer<float> table;  // cos then sin, each [max_positions, head_dim / 2]

  rotary() = default;
  rotary(std::int64_t head_dim_, std::int64_t max_positions_, float theta, memkit::memory_resource& resource)
      : head_dim(head_dim_), max_positions(max_positions_), table(resource, shape{2 * max_positions_ * (head_dim_ / 2)}) {
    const std::int64_t half = head_dim / 2;
    for (std::int64_t p = 0; p < max_positions; ++p)
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(p) * std::pow(static_cast<double>(theta), -2.0 * i / head_dim);
        table.data()[p * half + i] = static_cast<float>(std::cos(angle));
        table.data()[(max_positions + p) * half + i] = static_cast<float>(std::sin(angle));
      }
  }
  static constexpr std::size_t table_bytes(std::int64_t head_dim, std::int64_t max_positions) noexcept {
    return memkit::buffer<float>::bytes_required(shape{2 * max_positions * (head_dim / 2)});
  }

  shape output_shape(const shape& in) const { return in; }
  std::size_t saved_bytes(const shape&, const forward_context&) const { return 0; }
  std::size_t workspace_bytes(const shape&) const { return 0; }

  // y = R(pos) x; x and y may be the same memory.
  void rotate(tensor_view<const T> x, tensor_view<T> y, float direction) const {
    const shape& s = x.shape();
    const std::int64_t batch = s[0], seq = s[1], width = s[2], half = head_dim / 2;
    memkit::require(seq <= max_positions, "rotary: sequence " + std::to_string(seq) + " is longer than the table");
    memkit::require(width % head_dim == 0, "rotary: width is not a whole number of heads");
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t p = 0; p < seq; ++p) {
        const float* c = table.data() + p * half;
        const float* sn = table.data() + (max_positions + p) * half;
        const std::int64_t base = (b * seq + p) * width;
        for (std::int64_t h = 0; h < width; h += head_dim)
          for (std::int64_t i = 0; i < half; ++i) {
            const float a = f32(x[base + h + i]), bb = f32(x[base + h + i + half]);
            const float sine = direction * sn[i];
            y[base + h + i] = narrow<T>(a * c[i] - bb * sine);
            y[base + h + i + half] = narrow<T>(bb * c[i] + a * sine);
          }
      }
  }
  void forward(const host_executor&, const forward_context&, tensor_view<const T> x, tensor_view<T> y,
               activation_store&) {
    rotate(x, y, 1.0f);
  }
  // The rotation is orthogonal: its gradient is the rotation by the opposite angle.
  void backward(const host_executor&, tensor_view<const T> dy, tensor_view<T> dx, activation_store&) {
    if (!dx.empty()) rotate(dy, dx, -1.0f);
  }
};

// ---------------------------------------------------------------------------------------------------------
template <class T>
struct dense_linear {
  using value_type = T;
  std::int64_t in = 0, out = 0;
  parameter weight;  // [out, in]
  memory_resources memory;

  dense_linear() = default;
  dense_linear(std::string name, std::int64_t in_, std::int64_t out_, const memory_resources& memory_, trainability mode)
      : in(in_), out(out_), weight(std::move(name), shape{out_, in_}, memory_, mode), memory(memory_) {}

  shape output_shape(const shape& s) const { return with_last(s, out); }
  std::size_t saved_bytes(const shape& s, const forward_context&) const {
    return weight.trains() ? activation_store::bytes_required<T>(s) : 0;
  }
  std::size_t workspace_bytes(const shape& s) const {
    const std::int64_t rows = rows_of(s);
    const la::gemm_options o{memory.host_threads};
    return std::max({la::gemm_workspace_bytes<T, bf16, T>(rows, out, in, o),
                     la::gemm_workspace_bytes<T, T, float>(out, in, rows, o),
                     la::gemm_workspace_bytes<T, bf16, T>(rows, in, out, o)});
  }

  void forward(const host_executor& exec, const forward_context&, tensor_view<const T> x, tensor_view<T> y,
               activation_store& store) {
    const std::int64_t rows = rows_of(x.shape());
    if (weight.trains()) {
      tensor_view<T> kept = store.save<T>(x.shape());
      std::copy(x.begin(), x.end(), kept.begin());
    }
    la::gemm(exec, la::transpose::no, la::transpose::yes, 1.0f, cmat(x.data(), rows, in),
             cmat<bf16>(weight.value.data(), out, in), 0.0f, mat(y.data(), rows, out), *memory.workspace,
             la::gemm_options{memory.host_threads});
  }
  void backward(const host_executor& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
    const std::int64_t rows = rows_of(dy.shape());
    if (weight.trains()) {
      const auto x = store.take<T>(with_last(dy.shape(), in), "dense_linear");
      la::gemm(exec, la::transpose::yes, la::transpose::no, 1.0f, cmat(dy.data(), rows, out),
               cmat<T>(x.view().data(), rows, in), 1.0f, mat(weight.grad.data(), out, in), *memory.workspace,
               la::gemm_options{memory.host_threads});
    }
    if (!dx.empty())
      la::gemm(exec, la::transpose::no, la::transpose::no, 1.0f, cmat(dy.data(), rows, out),
               cmat<bf16>(weight.value.data(), out, in), 0.0f, mat(dx.data(), rows, in), *memory.workspace,
               la::gemm_options{memory.host_threads});
  }
};

// ---------------------------------------------------------------------------------------------------------
// SwiGLU activation: [.., 2f] -> [.., f], y = silu(gate) * up. The input is planar: the first half of the
// buffer is gate [.., f], the second half up [.., f] (so two linears can write them). Saves its input.
template <class T>
struct swiglu {
  using value_type = T;
  shape output_shape(const shape& s) const { return with_last(s, s[s.rank - 1] / 2); }
  std::size_t saved_bytes(const shape& s, const forward_context&) const { return activation_store::bytes_required<T>(s); }
  std::size_t workspace_bytes(const shape&) const { return 0; }

  void forward(const host_executor&, const forward_context&, tensor_view<const T> x, tensor_view<T> y,
               activation_store& store) {
    tensor_view<T> kept = store.save<T>(x.shape());
    std::copy(x.begin(), x.end(), kept.begin());
    const std::int64_t rows = rows_of(x.shape()), f = y.shape()[y.shape().rank - 1];
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < f; ++j) {
        const float g = f32(x[r * f + j]), u = f32(x[(rows + r) * f + j]);
        y[r * f + j] = narrow<T>(g / (1.0f + std::exp(-g)) * u);
      }
  }
  void backward(const host_executor&, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
    const std::int64_t rows = rows_of(dy.shape()), f = dy.shape()[dy.shape().rank - 1];
    const auto x = store.take<T>(with_last(dy.shape(), 2 * f), "swiglu");
    if (dx.empty()) return;
    const T* xs = x.view().data();
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < f; ++j) {
        const float g = f32(xs[r * f + j]), u = f32(xs[(rows + r) * f + j]), d = f32(dy[r * f + j]);
        const float sig = 1.0f / (1.0f + std::exp(-g));
        dx[r * f + j] = narrow<T>(d * u * sig * (1.0f + g * (1.0f - sig)));
        dx[(rows + r) * f + j] = narrow<T>(d * g * sig);
      }
  }
};

}  // namespace llama
