// Shared by the lora_linear host tests: a layer over any base format built from float values, and the
// dense double-precision reference the layer is checked against.
#pragma once

#include <memkit/lora/lora_linear.hpp>
#include <memkit/memory/tracking.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "support/test_values.hpp"

namespace lora_test {

namespace q = memkit::quant;
using memkit::bf16;
using memkit::fp16;
using memkit::host;
using memkit::host_view;
using memkit::shape;
using memkit::lora::lora_linear;
using memkit::lora::lora_options;

template <class Base>
constexpr bool is_quantized = memkit::lora::base_traits<Base>::quantized;

// The frozen base: the weight in its storage, the bias, and the weight as the layer sees it (fp32).
template <class Base, class T>
struct base_weight {
  std::int64_t in = 0, out = 0;
  std::vector<Base> dense;                  // dense bases
  std::unique_ptr<Base> quantized;          // quantized bases (Base is quant::quantized_tensor<F>)
  std::vector<T> bias;
  std::vector<float> effective;             // [out, in]: what the products use

  base_weight(std::int64_t in_features, std::int64_t out_features, bool with_bias, unsigned seed,
              memkit::memory_resource& resource = memkit::default_host_resource(), q::quant_options quant = {})
      : in(in_features), out(out_features) {
    const std::vector<float> values = memkit_test::uniform_values(in * out, seed);
    effective.resize(values.size());
    if constexpr (is_quantized<Base>) {
      quantized = std::make_unique<Base>(Base::quantize(host, host_view(values.data(), {out, in}), quant, resource));
      quantized->dequantize(host, host_view(effective));
    } else {
      dense = memkit_test::convert<Base>(values);
      for (std::size_t i = 0; i < dense.size(); ++i) effective[i] = memkit::to_float(dense[i]);
    }
    if (with_bias) bias = memkit_test::convert<T>(memkit_test::uniform_values(out, seed + 1));
  }

  typename memkit::lora::base_traits<Base>::weight_ref ref() {
    if constexpr (is_quantized<Base>) return quantized.get();
    else return host_view(dense.data(), {out, in});
  }
  memkit::tensor_view<T> bias_view() { return bias.empty() ? memkit::tensor_view<T>::none() : host_view(bias.data(), {out}); }
};

template <class V>
std::vector<double> widened(memkit::tensor_view<V> v) {
  std::vector<double> out(static_cast<std::size_t>(v.size()));
  for (std::int64_t i = 0; i < v.size(); ++i) out[static_cast<std::size_t>(i)] = memkit::to_float(v[i]);
  return out;
}
template <class V>
std::vector<double> widened(const std::vector<V>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = memkit::to_float(v[i]);
  return out;
}

// Fills B with random values (a fresh adapter's B is zero, which would hide half the products).
template <class L>
void randomize_b(L& layer, unsigned seed, float magnitude = 0.5f) {
  const std::vector<float> values = memkit_test::uniform_values(layer.lora_B().size(), seed);
  for (std::int64_t i = 0; i < layer.lora_B().size(); ++i)
    layer.lora_B()[i] = memkit::from_float<typename L::value_type>(values[static_cast<std::size_t>(i)] * magnitude);
}

// The dense reference in double: y = x W^T + b + scale * (m . x) A^T B^T with m the keep mask scaled by
// 1/(1-p) (all ones without dropout), and its gradients for dy.
struct reference {
  std::vector<double> y, dx, dA, dB, dbias;
};

inline reference reference_pass(const std::vector<double>& x, const std::vector<double>& mask, const std::vector<double>& W,
                                 const std::vector<double>& A, const std::vector<double>& B, const std::vector<double>& bias,
                                 const std::vector<double>& dy, std::int64_t M, std::int64_t in, std::int64_t out,
                                 std::int64_t r, double scale) {
  reference ref;
  auto at = [](const std::vector<double>& v, std::int64_t i) { return v[static_cast<std::size_t>(i)]; };
  std::vector<double> xin(static_cast<std::size_t>(M * in)), down(static_cast<std::size_t>(M * r), 0.0);
  for (std::int64_t i = 0; i < M * in; ++i) xin[static_cast<std::size_t>(i)] = at(x, i) * at(mask, i);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t k = 0; k < r; ++k)
      for (std::int64_t i = 0; i < in; ++i) down[static_cast<std::size_t>(m * r + k)] += at(xin, m * in + i) * at(A, k * in + i);
  ref.y.assign(static_cast<std::size_t>(M * out), 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t o = 0; o < out; ++o) {
      double s = bias.empty() ? 0.0 : at(bias, o);
      for (std::int64_t i = 0; i < in; ++i) s += at(x, m * in + i) * at(W, o * in + i);
      for (std::int64_t k = 0; k < r; ++k) s += scale * at(down, m * r + k) * at(B, o * r + k);
      ref.y[static_cast<std::size_t>(m * out + o)] = s;
    }
  std::vector<double> d_down(static_cast<std::size_t>(M * r), 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t k = 0; k < r; ++k)
      for (std::int64_t o = 0; o < out; ++o) d_down[static_cast<std::size_t>(m * r + k)] += scale * at(dy, m * out + o) * at(B, o * r + k);
  ref.dB.assign(static_cast<std::size_t>(out * r), 0.0);
  for (std::int64_t o = 0; o < out; ++o)
    for (std::int64_t k = 0; k < r; ++k)
      for (std::int64_t m = 0; m < M; ++m) ref.dB[static_cast<std::size_t>(o * r + k)] += scale * at(dy, m * out + o) * at(down, m * r + k);
  ref.dA.assign(static_cast<std::size_t>(r * in), 0.0);
  for (std::int64_t k = 0; k < r; ++k)
    for (std::int64_t i = 0; i < in; ++i)
      for (std::int64_t m = 0; m < M; ++m) ref.dA[static_cast<std::size_t>(k * in + i)] += at(d_down, m * r + k) * at(xin, m * in + i);
  ref.dx.assign(static_cast<std::size_t>(M * in), 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t i = 0; i < in; ++i) {
      double s = 0.0, a = 0.0;
      for (std::int64_t o = 0; o < out; ++o) s += at(dy, m * out + o) * at(W, o * in + i);
      for (std::int64_t k = 0; k < r; ++k) a += at(d_down, m * r + k) * at(A, k * in + i);
      ref.dx[static_cast<std::size_t>(m * in + i)] = s + a * at(mask, m * in + i);
    }
  ref.dbias.assign(static_cast<std::size_t>(out), 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t o = 0; o < out; ++o) ref.dbias[static_cast<std::size_t>(o)] += at(dy, m * out + o);
  return ref;
}

// The keep mask (scaled by 1/(1-p)) a forward with `ctx` applies, drawn as the layer documents it.
inline std::vector<double> dropout_mask(const memkit::forward_context& ctx, float p, std::int64_t count) {
  std::vector<double> mask(static_cast<std::size_t>(count), 1.0);
  if (!ctx.training || p == 0.0f) return mask;
  const float keep_scale = 1.0f / (1.0f - p);
  for (std::int64_t i = 0; i < count; ++i)
    mask[static_cast<std::size_t>(i)] =
        memkit::unit_float(memkit::random_word(ctx.seed, ctx.counter, static_cast<std::uint64_t>(i))) >= p ? keep_scale : 0.0;
  return mask;
}

// Normwise relative error: max |a - b| / max(|b|, floor). (Elementwise relative error would punish sums
// whose terms cancel: a gradient summed over hundreds of rows is small next to the terms it adds.)
inline double worst_error(const std::vector<double>& a, const std::vector<double>& b, double floor) {
  double worst = 0.0, largest = floor;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::fabs(a[i] - b[i]));
    largest = std::max(largest, std::fabs(b[i]));
  }
  return worst / largest;
}

}  // namespace lora_test
