// lora_linear under nvcc: the host path compiled by nvcc, and (suite "gpu") the CUDA path against the host
// path — dense and NF4 bases, fp32 and bf16 activations, dropout on and off — with the device memory the
// layer predicted.
#include <memkit/lora/lora_linear.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>
#include <memkit/memory/tracking.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/gpu_test.hpp"
#include "support/test_values.hpp"

namespace {

namespace q = memkit::quant;
using memkit::activation_store;
using memkit::forward_context;
using memkit::shape;
using memkit::tensor_view;

template <class T>
memkit::buffer<T> to_device(memkit::memory_resource& resource, const std::vector<T>& values, shape dims) {
  memkit::buffer<T> out(resource, dims);
  MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
  return out;
}
template <class T>
std::vector<std::remove_const_t<T>> to_host(tensor_view<T> view) {
  std::vector<std::remove_const_t<T>> out(static_cast<std::size_t>(view.size()));
  MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), view.data(), view.bytes(), cudaMemcpyDeviceToHost));
  return out;
}
template <class T>
double normwise_error(const std::vector<T>& a, const std::vector<T>& b) {
  double worst = 0.0, largest = 1e-6;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(memkit::to_float(a[i])) - memkit::to_float(b[i])));
    largest = std::max(largest, std::fabs(static_cast<double>(memkit::to_float(b[i]))));
  }
  return worst / largest;
}

}  // namespace

TEST_CASE("lora_linear compiled by nvcc: the host path runs and its adapter starts as a no-op") {
  const std::int64_t M = 5, in = 32, out = 16;
  const std::vector<float> w = memkit_test::uniform_values(in * out, 1), x = memkit_test::uniform_values(M * in, 2);
  std::vector<float> base_weight = w;
  memkit::lora::lora_linear<float> layer(memkit::host_view(base_weight.data(), {out, in}), {.rank = 4, .alpha = 8.0},
                                         memkit::default_host_resource(), memkit::default_host_resource(), memkit::default_host_resource());
  std::vector<float> y(static_cast<std::size_t>(M * out));
  activation_store store(memkit::default_host_resource());
  layer.forward(memkit::host, {}, memkit::host_view(x.data(), {M, in}), memkit::host_view(y.data(), {M, out}), store);
  CHECK(store.bytes() == layer.saved_bytes(shape{M, in}, {}));
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t o = 0; o < out; ++o) {  // B = 0: y is the base's output
      double s = 0.0;
      for (std::int64_t i = 0; i < in; ++i) s += static_cast<double>(x[m * in + i]) * w[o * in + i];
      CHECK(y[m * out + o] == doctest::Approx(s).epsilon(1e-5));
    }
}

namespace {

// The same layer on the host and on the device (same base values, A and B), one forward and backward each.
template <class Base, class T>
void compare_host_and_device(std::int64_t M, float dropout, bool training, double tolerance) {
  CAPTURE(M);
  CAPTURE(sizeof(T));
  CAPTURE(dropout);
  const std::int64_t in = 192, out = 80;
  const memkit::lora::lora_options options{.rank = 8, .alpha = 16.0, .dropout = dropout};
  cudaStream_t stream;
  MEMKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const memkit::cuda_executor gpu{0, stream};
  memkit::device_resource device;
  memkit::tracking_resource tracker(device, "lora-gpu");
  auto& heap = memkit::default_host_resource();

  const std::vector<float> w = memkit_test::uniform_values(in * out, 3);
  constexpr bool quantized = memkit::lora::base_traits<Base>::quantized;
  using dense_type = std::conditional_t<quantized, float, Base>;
  using quantized_type = std::conditional_t<quantized, Base, q::quantized_tensor<q::NF4>>;
  std::vector<dense_type> host_dense;
  memkit::buffer<dense_type> device_dense;
  quantized_type host_q, device_q;
  typename memkit::lora::base_traits<Base>::weight_ref host_ref{}, device_ref{};
  if constexpr (quantized) {
    host_q = Base::quantize(memkit::host, memkit::host_view(w.data(), {out, in}), {64, true}, heap);
    // The host's codes and scales, copied: both layers see the same quantized weight.
    device_q = Base(device, shape{out, in}, {64, true});
    auto copy = [](auto target, auto source) {
      MEMKIT_CUDA_CHECK(cudaMemcpy(target.data(), source.data(), source.bytes(), cudaMemcpyHostToDevice));
    };
    copy(device_q.codes(), std::as_const(host_q).codes());
    copy(device_q.nested_codes(), std::as_const(host_q).nested_codes());
    copy(device_q.nested_group_absmax(), std::as_const(host_q).nested_group_absmax());
    copy(device_q.offset_view(), std::as_const(host_q).offset_view());
    host_ref = &host_q;
    device_ref = &device_q;
  } else {
    host_dense = memkit_test::convert<Base>(w);
    device_dense = to_device(device, host_dense, shape{out, in});
    host_ref = memkit::host_view(host_dense.data(), {out, in});
    device_ref = device_dense.view();
  }
  memkit::lora::lora_linear<Base, T> on_host(host_ref, options, heap, heap, heap);
  // The workspace is stream-ordered on the layer's stream (docs/cuda.md, "Workspace"), counted by its own tracker.
  memkit::device_async_resource device_async(stream);
  memkit::tracking_resource workspace_tracker(device_async, "lora-gpu-workspace");
  memkit::lora::lora_linear<Base, T> on_device(device_ref, options, tracker.category(memkit::memory_category::weights),
                                               tracker.category(memkit::memory_category::gradients),
                                               workspace_tracker.category(memkit::memory_category::workspace));
  const std::vector<T> b = memkit_test::convert<T>(memkit_test::uniform_values(out * options.rank, 4));
  std::copy(b.begin(), b.end(), on_host.lora_B().begin());
  MEMKIT_CUDA_CHECK(cudaMemcpy(on_device.lora_B().data(), b.data(), b.size() * sizeof(T), cudaMemcpyHostToDevice));
  CHECK(to_host(tensor_view<const T>(on_device.lora_A())) ==
        std::vector<T>(on_host.lora_A().begin(), on_host.lora_A().end()));  // the same initialisation

  const std::vector<T> x = memkit_test::convert<T>(memkit_test::uniform_values(M * in, 5));
  const std::vector<T> dy = memkit_test::convert<T>(memkit_test::uniform_values(M * out, 6));
  const forward_context ctx{7, 8, training};
  std::vector<T> y(static_cast<std::size_t>(M * out)), dx(static_cast<std::size_t>(M * in));
  activation_store host_store(heap);
  on_host.forward(memkit::host, ctx, memkit::host_view(x.data(), {M, in}), memkit::host_view(y.data(), {M, out}), host_store);
  on_host.backward(memkit::host, memkit::host_view(dy.data(), {M, out}), memkit::host_view(dx.data(), {M, in}), host_store);

  memkit::buffer<T> x_d = to_device(device, x, shape{M, in}), dy_d = to_device(device, dy, shape{M, out});
  memkit::buffer<T> y_d(device, shape{M, out}), dx_d(device, shape{M, in});
  activation_store device_store(tracker.category(memkit::memory_category::activations));
  workspace_tracker.reset_peak();
  on_device.forward(gpu, ctx, tensor_view<const T>(x_d.view()), y_d.view(), device_store);
  CHECK(device_store.bytes() == on_device.saved_bytes(shape{M, in}, ctx));
  CHECK(workspace_tracker.stats(memkit::memory_category::workspace).peak_bytes ==
        workspace_bytes(on_device.forward_arguments(M, true)));
  workspace_tracker.reset_peak();
  on_device.backward(gpu, tensor_view<const T>(dy_d.view()), dx_d.view(), device_store);
  CHECK(workspace_tracker.stats(memkit::memory_category::workspace).peak_bytes ==
        workspace_bytes(on_device.backward_arguments(M, dropout > 0.0f, true, true)));
  gpu.synchronize();

  CHECK(normwise_error(to_host(tensor_view<const T>(y_d.view())), y) <= tolerance);
  CHECK(normwise_error(to_host(tensor_view<const T>(dx_d.view())), dx) <= tolerance);
  CHECK(normwise_error(to_host(tensor_view<const float>(on_device.grad_A())),
                       std::vector<float>(on_host.grad_A().begin(), on_host.grad_A().end())) <= tolerance);
  CHECK(normwise_error(to_host(tensor_view<const float>(on_device.grad_B())),
                       std::vector<float>(on_host.grad_B().begin(), on_host.grad_B().end())) <= tolerance);
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace

MEMKIT_GPU_TEST_CASE("gpu: lora_linear on a stream agrees with the host path (dense and NF4 bases, dropout's mask "
                     "the same) and takes the device memory it predicts") {
  for (std::int64_t M : {4, 300})
    for (float p : {0.0f, 0.2f}) {
      compare_host_and_device<float, float>(M, p, true, 1e-3);  // cuBLAS may use TF32-free fp32 with its own order
      compare_host_and_device<memkit::bf16, memkit::bf16>(M, p, true, 2e-2);
      compare_host_and_device<q::quantized_tensor<q::NF4>, float>(M, p, true, 1e-3);
      compare_host_and_device<q::quantized_tensor<q::NF4>, memkit::bf16>(M, p, M == 4, 2e-2);
    }
}
