// memkit/models/llama/layers.hpp — the pieces of a Llama-style decoder as memkit layers (core/layer.hpp).
//
//   token_embedding    token ids -> hidden states (outside the layer stack: its input is not activations)
//   rms_norm           y = x / rms(x) * w                     saves x and the per-row 1/rms (fp32)
//   rotary             rotates pairs (i, i + d/2) of each head by position * theta^(-2i/d)   saves nothing
//   swiglu             y = silu(gate) * up over [.., 2f] -> [.., f]   saves its input
// The dense projection is memkit::layers::dense_linear (memkit/layers/dense_linear.hpp), its parameters
// memkit::layers::basic_parameter (memkit/layers/parameter.hpp).
//
// Activations and weights are T, the training dtype (bf16 in the example, float in the gradient and parity
// tests); every product accumulates in fp32 (linalg::gemm: the host kernel, or cuBLAS on a cuda_executor),
// elementwise math is fp32. Each layer says what it saves (saved_bytes) and what workspace it takes (workspace_bytes) before it runs, from the same
// shapes it allocates with. Every layer runs on the host and, compiled by nvcc, on a cuda_executor: its math
// is one MEMKIT_HOST_DEVICE function object per element, row or column (the *_row / *_column / *_element
// structs below), run by layers::for_each_index (memkit/layers/tensor_ops.hpp) as a loop on the host and as
// a kernel on exec.stream. Each layer hands its trainable parameters to a layers::parameter_registry with
// register_parameters(registry).
#pragma once

#include <memkit/attention/bytes.hpp>
#include <memkit/core/layer.hpp>
#include <memkit/core/execution.hpp>
#include <memkit/layers/dense_linear.hpp>
#include <memkit/layers/parameter.hpp>
#include <memkit/layers/tensor_ops.hpp>
#include <memkit/linalg/gemm.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace memkit::models::llama {

using memkit::activation_store;
using memkit::forward_context;
using memkit::host_executor;
namespace la = memkit::linalg;

namespace detail {
// A layer's weight must hold its values when the layer runs: under ZeRO stage 3 (distributed/stage3.hpp) they
// are there only between the layer's gather and its release.
template <class P>
void require_present(const P& weight, std::int64_t elements, const char* layer) {
  if (weight.value.size() == elements && weight.value.data() != nullptr) return;
  memkit::require(false, std::string(layer) + " '" + weight.name + "': its weight is not in memory (" +
                             std::to_string(weight.value.size()) + " of " + std::to_string(elements) +
                             " elements); under stage 3, gather the layer before it runs");
}
}  // namespace detail

template <class T>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float f32(T v) {
  return memkit::to_float(v);
}
template <class T>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE T narrow(float v) {
  return memkit::from_float<T>(v);
}
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float exp_f32(float v) { return ::expf(v); }   // std::exp(float) on the host
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE float sqrt_f32(float v) { return ::sqrtf(v); }  // std::sqrt(float) on the host

// ---------------------------------------------------------------------------------------------------------
// Token embedding: ids [B, S] -> hidden [B, S, H]; backward adds each row of dy into its token's gradient row.
// One token's row of y; an id outside the vocabulary gives NaN (device code cannot throw; the host path checks
// the ids first, the example checks them where it makes them).
template <class T, class W>
struct embedding_row {
  const std::int32_t* ids;
  const W* weight;
  T* y;
  std::int64_t vocab, hidden;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t t) const {
    const std::int32_t id = ids[t];
    const bool known = id >= 0 && id < vocab;
    const float quiet_nan = memkit::bf16_bits_to_float(0x7fc0);
    for (std::int64_t j = 0; j < hidden; ++j) y[t * hidden + j] = narrow<T>(known ? f32(weight[id * hidden + j]) : quiet_nan);
  }
};
// Column j of the gradient: the tokens in order, so the sums are the same on every executor and duplicate ids
// never race.
template <class T>
struct embedding_grad_column {
  const std::int32_t* ids;
  const T* dy;
  float* grad;
  std::int64_t tokens, vocab, hidden;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t j) const {
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int32_t id = ids[t];
      if (id >= 0 && id < vocab) grad[id * hidden + j] += f32(dy[t * hidden + j]);
    }
  }
};

template <class W>
struct token_embedding {
  std::int64_t vocab = 0, hidden = 0;
  layers::basic_parameter<W> weight;  // [vocab, hidden]

  token_embedding() = default;
  token_embedding(std::int64_t vocab_, std::int64_t hidden_, const layers::memory_resources& memory, layers::trainability mode)
      : vocab(vocab_), hidden(hidden_), weight("model.embed_tokens.weight", shape{vocab_, hidden_}, memory, mode) {}

  template <class Registry>
  void register_parameters(Registry& registry) {
    registry.add(weight);
  }

  template <memkit::executor E, class T>
  void forward(const E& exec, tensor_view<const std::int32_t> ids, tensor_view<T> y) const {
    detail::require_present(weight, vocab * hidden, "token_embedding");
    memkit::require(y.size() == ids.size() * hidden, "token_embedding: y does not hold one row per token");
    if constexpr (!E::on_device)
      for (std::int64_t t = 0; t < ids.size(); ++t)
        memkit::require(ids[t] >= 0 && ids[t] < vocab,
                        "token_embedding: token id " + std::to_string(ids[t]) + " is outside the vocabulary");
    layers::for_each_index(exec, ids.size(), embedding_row<T, W>{ids.data(), weight.value.data(), y.data(), vocab, hidden});
  }
  template <memkit::executor E, class T>
  void backward(const E& exec, tensor_view<const std::int32_t> ids, tensor_view<const T> dy) {
    if (!weight.trains()) return;
    detail::require_present(weight, vocab * hidden, "token_embedding");
    if (weight.grad.size() != vocab * hidden)
      memkit::require(false, "token_embedding '" + weight.name + "': no gradient buffer (stage 3: gather it with its gradients)");
    layers::for_each_index(exec, hidden, embedding_grad_column<T>{ids.data(), dy.data(), weight.grad.data(), ids.size(), vocab, hidden});
  }
};

// ---------------------------------------------------------------------------------------------------------
// RMSNorm. Forward, one row: y = x * s * w with s = 1/rms(x); keeps x and s for backward.
template <class T>
struct rms_forward_row {
  const T* x;
  const T* w;
  T* y;
  T* kept;
  float* rstd;
  std::int64_t hidden;
  float eps;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t r) const {
    const T* xr = x + r * hidden;
    float sum = 0.0f;
    for (std::int64_t j = 0; j < hidden; ++j) sum += f32(xr[j]) * f32(xr[j]);
    const float s = 1.0f / sqrt_f32(sum / static_cast<float>(hidden) + eps);
    rstd[r] = s;
    for (std::int64_t j = 0; j < hidden; ++j) {
      kept[r * hidden + j] = xr[j];
      y[r * hidden + j] = narrow<T>(f32(xr[j]) * s * f32(w[j]));
    }
  }
};
// Backward, one row: dx = s * (g - x * s^2 * mean(g * x)), g = dy * w.
template <class T>
struct rms_backward_row {
  const T* dy;
  const T* x;
  const float* rstd;
  const T* w;
  T* dx;
  std::int64_t hidden;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t r) const {
    const float s = rstd[r];
    float dot = 0.0f;
    for (std::int64_t j = 0; j < hidden; ++j) dot += f32(dy[r * hidden + j]) * f32(w[j]) * f32(x[r * hidden + j]);
    const float mean = dot / static_cast<float>(hidden);
    for (std::int64_t j = 0; j < hidden; ++j) {
      const float g = f32(dy[r * hidden + j]) * f32(w[j]);
      dx[r * hidden + j] = narrow<T>(s * (g - f32(x[r * hidden + j]) * s * s * mean));
    }
  }
};
// Backward, one column of the weight gradient: dw[j] += sum over rows of dy * x * s, rows in order.
template <class T>
struct rms_weight_grad_column {
  const T* dy;
  const T* x;
  const float* rstd;
  float* grad;
  std::int64_t rows, hidden;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t j) const {
    float g = grad[j];
    for (std::int64_t r = 0; r < rows; ++r) g += f32(dy[r * hidden + j]) * f32(x[r * hidden + j]) * rstd[r];
    grad[j] = g;
  }
};

template <class T>
struct rms_norm {
  using value_type = T;
  std::int64_t hidden = 0;
  float eps = 1e-5f;
  layers::basic_parameter<T> weight;  // [hidden], starts at 1

  rms_norm() = default;
  rms_norm(std::string name, std::int64_t hidden_, const layers::memory_resources& memory, layers::trainability mode)
      : hidden(hidden_), weight(std::move(name), shape{hidden_}, memory, mode) {
    weight.fill(1.0f);
  }

  shape output_shape(const shape& in) const { return in; }
  std::size_t saved_bytes(const shape& in, const forward_context&) const {
    return activation_store::bytes_required<T>(in) + activation_store::bytes_required<float>(shape{layers::rows_of(in)});
  }
  std::size_t workspace_bytes(const shape&) const { return 0; }
  template <class Registry>
  void register_parameters(Registry& registry) {
    registry.add(weight);
  }

  template <memkit::executor E>
  void forward(const E& exec, const forward_context&, tensor_view<const T> x, tensor_view<T> y, activation_store& store) {
    detail::require_present(weight, hidden, "rms_norm");
    const std::int64_t rows = layers::rows_of(x.shape());
    tensor_view<T> kept = store.save<T>(x.shape());
    tensor_view<float> rstd = store.save<float>(shape{rows});
    layers::for_each_index(exec, rows, rms_forward_row<T>{x.data(), weight.value.data(), y.data(), kept.data(), rstd.data(), hidden, eps});
  }

  template <memkit::executor E>
  void backward(const E& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
    detail::require_present(weight, hidden, "rms_norm");
    const std::int64_t rows = layers::rows_of(dy.shape());
    const auto rstd = store.take<float>(shape{rows}, "rms_norm");
    const auto x = store.take<T>(dy.shape(), "rms_norm");
    if (!dx.is_none())
      layers::for_each_index(exec, rows, rms_backward_row<T>{dy.data(), x.view().data(), rstd.view().data(), weight.value.data(), dx.data(), hidden});
    if (weight.trains()) {
      if (weight.grad.size() != hidden)
        memkit::require(false, "rms_norm '" + weight.name + "': no gradient buffer (stage 3: gather it with its gradients)");
      layers::for_each_index(exec, hidden, rms_weight_grad_column<T>{dy.data(), x.view().data(), rstd.view().data(), weight.grad.data(), rows, hidden});
    }
  }
};

// ---------------------------------------------------------------------------------------------------------
// Rotary position embedding on [B, S, heads * head_dim] (HF's rotate_half layout). The cos/sin table
// [max_positions, head_dim / 2] is computed once (fp32, on the host, then copied where the weights live) and
// is a constant of the model, not an activation.
// One head at one position, its pairs (i, i + d/2): y = R(direction * pos) x; x and y may be the same memory.
// pos is the token's place in its row, or with packed documents (offsets int32 [B, offsets_per_row]) in its
// document: positions restart at each document's first token, as if the document were a sequence of its own.
template <class T>
struct rotary_row {
  const T* x;
  T* y;
  const float* table;  // cos then sin, each [max_positions, half]
  std::int64_t seq, width, head_dim, max_positions;
  float direction;
  const std::int32_t* offsets = nullptr;  // document offsets, or null: one document per row
  std::int64_t offsets_per_row = 0;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t row) const {  // row = token * heads + head
    const std::int64_t token = row / (width / head_dim), i = token % seq;
    const std::int64_t start = memkit::attention::document_of(offsets, offsets_per_row, token / seq, i, seq).begin;
    const std::int64_t half = head_dim / 2, p = i - start, at = row * head_dim;
    const float* c = table + p * half;
    const float* sn = table + (max_positions + p) * half;
    for (std::int64_t i = 0; i < half; ++i) {
      const float a = f32(x[at + i]), b = f32(x[at + i + half]);
      const float sine = direction * sn[i];
      y[at + i] = narrow<T>(a * c[i] - b * sine);
      y[at + i + half] = narrow<T>(b * c[i] + a * sine);
    }
  }
};

// How the inverse frequencies are made: theta^(-2i/d) (rope_type "default"), or Llama 3.1's scaling
// (rope_type "llama3": long wavelengths divided by `factor`, a smooth blend between the two cut-offs).
struct rope_config {
  float theta = 10000.0f;
  float llama3_factor = 0.0f;  // 0: no scaling
  float low_freq_factor = 1.0f, high_freq_factor = 4.0f;
  std::int64_t original_max_positions = 8192;
};

// The head_dim / 2 inverse frequencies, each step in fp32 as transformers computes them
// (modeling_rope_utils: 1 / base^(2i/d), then the llama3 blend), so the rotation angles are the same floats.
inline std::vector<float> rope_inverse_frequencies(std::int64_t head_dim, const rope_config& rope) {
  const std::int64_t half = head_dim / 2;
  std::vector<float> inv(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv[static_cast<std::size_t>(i)] = 1.0f / std::pow(rope.theta, exponent);
  }
  if (rope.llama3_factor == 0.0f) return inv;
  const float factor = rope.llama3_factor, low = rope.low_freq_factor, high = rope.high_freq_factor;
  const float old_context = static_cast<float>(rope.original_max_positions);
  const float low_freq_wavelen = old_context / low, high_freq_wavelen = old_context / high;
  for (float& f : inv) {
    const float wavelen = 6.283185307179586f / f;
    const float scaled = wavelen > low_freq_wavelen ? f / factor : f;
    if (wavelen < high_freq_wavelen || wavelen > low_freq_wavelen) {
      f = scaled;
    } else {
      const float smooth = (old_context / wavelen - low) / (high - low);
      f = (1.0f - smooth) * scaled / factor + smooth * scaled;
    }
  }
  return inv;
}

template <class T>
struct rotary {
  using value_type = T;
  std::int64_t head_dim = 0, max_positions = 0;
  memkit::buffer<float> table;  // cos then sin, each [max_positions, head_dim / 2]

  rotary() = default;
  rotary(std::int64_t head_dim_, std::int64_t max_positions_, float theta, memkit::memory_resource& resource)
      : rotary(head_dim_, max_positions_, rope_config{theta}, resource) {}
  // angle(p, i) = fp32(p * inv_freq[i]), its cosine and sine rounded once to fp32 (transformers' fp32 path).
  rotary(std::int64_t head_dim_, std::int64_t max_positions_, const rope_config& rope, memkit::memory_resource& resource)
      : head_dim(head_dim_), max_positions(max_positions_), table(resource, shape{2 * max_positions_ * (head_dim_ / 2)}) {
    const std::int64_t half = head_dim / 2;
    const std::vector<float> inv = rope_inverse_frequencies(head_dim, rope);
    std::vector<float> values(static_cast<std::size_t>(table.size()));
    for (std::int64_t p = 0; p < max_positions; ++p)
      for (std::int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(p) * inv[static_cast<std::size_t>(i)];
        values[static_cast<std::size_t>(p * half + i)] = static_cast<float>(std::cos(static_cast<double>(angle)));
        values[static_cast<std::size_t>((max_positions + p) * half + i)] = static_cast<float>(std::sin(static_cast<double>(angle)));
      }
    layers::copy_in(values.data(), table.view());
  }
  static constexpr std::size_t table_bytes(std::int64_t head_dim, std::int64_t max_positions) noexcept {
    return memkit::buffer<float>::bytes_required(shape{2 * max_positions * (head_dim / 2)});
  }

  shape output_shape(const shape& in) const { return in; }
  std::size_t saved_bytes(const shape&, const forward_context&) const { return 0; }
  std::size_t workspace_bytes(const shape&) const { return 0; }

  // y = R(pos) x on [B, S, heads * head_dim]; x and y may be the same memory. With document_offsets (int32
  // [B, N + 1], attention/bytes.hpp) pos counts from the start of the token's document.
  template <memkit::executor E>
  void rotate(const E& exec, tensor_view<const T> x, tensor_view<T> y, float direction,
              tensor_view<const std::int32_t> document_offsets = tensor_view<const std::int32_t>::none()) const {
    const shape& s = x.shape();
    const std::int64_t seq = s[1], width = s[2];
    memkit::require(seq <= max_positions, "rotary: sequence " + std::to_string(seq) + " is longer than the table");
    memkit::require(width % head_dim == 0, "rotary: width is not a whole number of heads");
    const bool packed = !document_offsets.is_none();
    memkit::require(!packed || (document_offsets.shape().rank == 2 && document_offsets.shape()[0] == s[0] &&
                                document_offsets.shape()[1] >= 2 && document_offsets.data() != nullptr),
                    "rotary: document_offsets must be int32 [batch = " + std::to_string(s[0]) +
                        ", documents + 1 >= 2], got " + to_string(document_offsets.shape()));
    if (packed) memkit::require_accessible(exec, document_offsets, "rotary", "document_offsets");
    layers::for_each_index(exec, x.size() / head_dim,
                           rotary_row<T>{x.data(), y.data(), table.data(), seq, width, head_dim, max_positions,
                                         direction, document_offsets.data(),
                                         packed ? document_offsets.shape()[1] : 0});
  }
  template <memkit::executor E>
  void forward(const E& exec, const forward_context&, tensor_view<const T> x, tensor_view<T> y, activation_store&) {
    rotate(exec, x, y, 1.0f);
  }
  // The rotation is orthogonal: its gradient is the rotation by the opposite angle.
  template <memkit::executor E>
  void backward(const E& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store&) {
    if (!dx.is_none()) rotate(exec, dy, dx, -1.0f);
  }
};

// ---------------------------------------------------------------------------------------------------------
// SwiGLU activation: [.., 2f] -> [.., f], y = silu(gate) * up. The input is planar: the first half of the
// buffer is gate [.., f], the second half up [.., f] (so two linears can write them). Saves its input.
// One element i of y: gate x[i], up x[n + i], n = rows * f.
template <class T>
struct swiglu_forward_element {
  const T* x;
  T* y;
  std::int64_t n;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t i) const {
    const float g = f32(x[i]), u = f32(x[n + i]);
    y[i] = narrow<T>(g / (1.0f + exp_f32(-g)) * u);
  }
};
template <class T>
struct swiglu_backward_element {
  const T* x;
  const T* dy;
  T* dx;
  std::int64_t n;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t i) const {
    const float g = f32(x[i]), u = f32(x[n + i]), d = f32(dy[i]);
    const float sig = 1.0f / (1.0f + exp_f32(-g));
    dx[i] = narrow<T>(d * u * sig * (1.0f + g * (1.0f - sig)));
    dx[n + i] = narrow<T>(d * g * sig);
  }
};

template <class T>
struct swiglu {
  using value_type = T;
  shape output_shape(const shape& s) const { return layers::with_last(s, s[s.rank - 1] / 2); }
  std::size_t saved_bytes(const shape& s, const forward_context&) const { return activation_store::bytes_required<T>(s); }
  std::size_t workspace_bytes(const shape&) const { return 0; }

  template <memkit::executor E>
  void forward(const E& exec, const forward_context&, tensor_view<const T> x, tensor_view<T> y, activation_store& store) {
    tensor_view<T> kept = store.save<T>(x.shape());
    layers::copy_view(exec, x, kept);
    layers::for_each_index(exec, y.size(), swiglu_forward_element<T>{kept.data(), y.data(), y.size()});
  }
  template <memkit::executor E>
  void backward(const E& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
    const std::int64_t f = dy.shape()[dy.shape().rank - 1];
    const auto x = store.take<T>(layers::with_last(dy.shape(), 2 * f), "swiglu");
    if (dx.is_none()) return;
    layers::for_each_index(exec, dy.size(), swiglu_backward_element<T>{x.view().data(), dy.data(), dx.data(), dy.size()});
  }
};

}  // namespace memkit::models::llama
