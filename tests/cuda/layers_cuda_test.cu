// memkit/layers/ on a cuda_executor: dense_linear (the calls and the layer, fp32 and bf16, with and without
// bias) and zero_grad through a parameter_registry, against the host. cuBLAS sums in another order than the
// host GEMM, so the inputs here are small integers: every product and sum is exact in any order (and in
// bf16, whose integers are exact up to 256), the results must be the host's bit for bit, and any difference is
// a wiring error (a transpose, a stride, the bias, accumulate versus overwrite), never rounding.
#include <memkit/layers/dense_linear.hpp>
#include <memkit/layers/parameters.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "support/gpu_test.hpp"

namespace ml = memkit::layers;
using memkit::shape;
using memkit::tensor_view;

namespace {

// Integers in [-2, 2] as T.
template <class T>
std::vector<T> small_integers(std::size_t n, std::uint64_t seed) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = memkit::from_float<T>(static_cast<float>(static_cast<int>(memkit::random_word(seed, 0, i) % 5) - 2));
  return v;
}
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

struct device_memory {
  memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream();
  memkit::device_async_resource device{exec.stream, exec.device};
  ml::memory_resources memory;
  device_memory() { memory.weights = memory.gradients = memory.optimizer = memory.workspace = &device; }
};

// One forward and backward of a dense_linear layer on `exec` with `memory`: y, dx, dW, db back on the host.
template <class T, memkit::executor E>
void run_layer(const E& exec, const ml::memory_resources& memory, memkit::memory_resource& activations, bool with_bias,
               std::vector<T>& y, std::vector<T>& dx, std::vector<float>& dw, std::vector<float>& db) {
  const std::int64_t rows = 6, in = 24, out = 8;
  ml::dense_linear<T> layer("p.weight", in, out, memory, ml::trainability::bf16_rounding, with_bias);
  const std::vector<T> w = small_integers<T>(out * in, 1), b = small_integers<T>(out, 2);
  ml::copy_in(w.data(), layer.weight.value.view());
  if (with_bias) ml::copy_in(b.data(), layer.bias.value.view());
  memkit::buffer<T> x(activations, shape{2, 3, in}), dy(activations, shape{2, 3, out}), y_d(activations, shape{2, 3, out}),
      dx_d(activations, shape{2, 3, in});
  ml::copy_in(small_integers<T>(rows * in, 3).data(), x.view());
  ml::copy_in(small_integers<T>(rows * out, 4).data(), dy.view());
  memkit::activation_store store(activations);
  // Twice: the gradients accumulate.
  for (int pass = 0; pass < 2; ++pass) {
    layer.forward(exec, {}, std::as_const(x).view(), y_d.view(), store);
    layer.backward(exec, std::as_const(dy).view(), dx_d.view(), store);
  }
  if constexpr (E::on_device) exec.synchronize();
  y = ml::copy_out(std::as_const(y_d).view());
  dx = ml::copy_out(std::as_const(dx_d).view());
  dw = ml::copy_out(std::as_const(layer.weight.grad).view());
  db = with_bias ? ml::copy_out(std::as_const(layer.bias.grad).view()) : std::vector<float>{};
}

template <class T>
void check_layer_against_host() {
  device_memory d;
  for (const bool with_bias : {false, true}) {
    CAPTURE(with_bias);
    std::vector<T> y_h, dx_h, y_d, dx_d;
    std::vector<float> dw_h, db_h, dw_d, db_d;
    run_layer<T>(memkit::host, ml::memory_resources{}, memkit::default_host_resource(), with_bias, y_h, dx_h, dw_h, db_h);
    run_layer<T>(d.exec, d.memory, d.device, with_bias, y_d, dx_d, dw_d, db_d);
    CHECK(same_bits(y_h, y_d));
    CHECK(same_bits(dx_h, dx_d));
    CHECK(same_bits(dw_h, dw_d));
    CHECK(same_bits(db_h, db_d));
    bool nonzero = false;
    for (float g : dw_h) nonzero = nonzero || g != 0.0f;
    CHECK(nonzero);
  }
}

}  // namespace

TEST_CASE("layers::dense_linear_forward on a cuda_executor refuses wrong shapes before touching the device") {
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  const tensor_view<const float> x(nullptr, shape{4, 3}, memkit::memory_kind::device), w(nullptr, shape{2, 5}, memkit::memory_kind::device);
  const tensor_view<float> y(nullptr, shape{4, 2}, memkit::memory_kind::device);
  CHECK_THROWS_WITH_AS(ml::dense_linear_forward(gpu, x, w, tensor_view<const float>::none(), y, {}, memkit::default_host_resource()),
                       doctest::Contains("x must be [..., 5]"), memkit::error);
}

MEMKIT_GPU_TEST_CASE("layers::dense_linear on a cuda_executor: the host's bits, fp32 and bf16, with and without bias") {
  check_layer_against_host<float>();
  check_layer_against_host<memkit::bf16>();
}

MEMKIT_GPU_TEST_CASE("layers::zero_grad on a cuda_executor zeroes every registered gradient on exec.stream, nothing else") {
  device_memory d;
  ml::basic_parameter<float> p("p", shape{3, 5}, d.memory, ml::trainability::bf16_master);
  ml::basic_parameter<float> q("q", shape{7}, d.memory, ml::trainability::bf16_master);
  ml::basic_parameter<float> other("other", shape{4}, d.memory, ml::trainability::bf16_master);
  for (auto* x : {&p, &q, &other}) {
    const std::vector<float> ones(static_cast<std::size_t>(x->size()), 1.0f);
    ml::copy_in(ones.data(), x->grad.view());
  }
  ml::parameter_registry<float> registry;
  registry.add(p);
  registry.add(q);
  ml::zero_grad(d.exec, registry);
  d.exec.synchronize();
  CHECK(ml::copy_out(std::as_const(p.grad).view()) == std::vector<float>(15, 0.0f));
  CHECK(ml::copy_out(std::as_const(q.grad).view()) == std::vector<float>(7, 0.0f));
  CHECK(ml::copy_out(std::as_const(other.grad).view()) == std::vector<float>(4, 1.0f));
}
