// memkit::checkpoint::segment on CUDA streams: gradients bit-identical to running the layers without checkpointing,
// every schedule, with and without offload to pinned memory; the tracked device and pinned bytes equal the
// prediction. Device cases are in the "gpu" suite; the first case runs the host path as nvcc compiles it.
#include <doctest/doctest.h>
#include <memkit/memkit.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

#include "host/checkpoint_layers.hpp"
#include "support/gpu_test.hpp"

namespace {

using memkit::activation_store;
using memkit::cuda_executor;
using memkit::forward_context;
using memkit::shape;
using memkit::tensor_view;

constexpr forward_context step_context{0xc0ffee, 0, true};

std::vector<memkit::checkpoint::schedule> schedules() {
  return {memkit::checkpoint::schedule::none(),       memkit::checkpoint::schedule::single_segment(),
          memkit::checkpoint::schedule::every_layer(), memkit::checkpoint::schedule::every_k_layers(2),
          memkit::checkpoint::schedule::sqrt(),        memkit::checkpoint::schedule::binomial(1),
          memkit::checkpoint::schedule::binomial(2),   memkit::checkpoint::schedule::binomial(16)};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// --- device layers: one thread per output element, fixed summation order (deterministic) ---

__global__ void linear_forward(const float* x, const float* w, const float* b, float* y, int rows, int in, int out) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows * out; i += gridDim.x * blockDim.x) {
    const int r = i / out, o = i % out;
    float acc = b[o];
    for (int k = 0; k < in; ++k) acc += x[r * in + k] * w[o * in + k];
    y[i] = acc;
  }
}
__global__ void linear_input_grad(const float* dy, const float* w, float* dx, int rows, int in, int out) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows * in; i += gridDim.x * blockDim.x) {
    const int r = i / in, k = i % in;
    float acc = 0.0f;
    for (int o = 0; o < out; ++o) acc += dy[r * out + o] * w[o * in + k];
    dx[i] = acc;
  }
}
__global__ void linear_param_grads(const float* dy, const float* x, float* dw, float* db, int rows, int in, int out) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < out * (in + 1); i += gridDim.x * blockDim.x) {
    const int o = i / (in + 1), k = i % (in + 1);
    float acc = 0.0f;
    for (int r = 0; r < rows; ++r) acc += dy[r * out + o] * (k == in ? 1.0f : x[r * in + k]);
    if (k == in)
      db[o] += acc;
    else
      dw[o * in + k] += acc;
  }
}
__global__ void dropout_forward(const float* x, float* y, std::uint8_t* mask, std::int64_t n, float p,
                                std::uint64_t seed, std::uint64_t counter) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const bool keep = memkit::unit_float(memkit::random_word(seed, counter, static_cast<std::uint64_t>(i))) >= p;
    mask[i] = keep;
    y[i] = keep ? x[i] / (1.0f - p) : 0.0f;
  }
}
__global__ void dropout_backward(const float* dy, const std::uint8_t* mask, float* dx, std::int64_t n, float p) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    dx[i] = mask[i] ? dy[i] / (1.0f - p) : 0.0f;
}
__global__ void tanh_forward(const float* x, float* y, float* kept, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    kept[i] = y[i] = tanhf(x[i]);
}
__global__ void tanh_backward(const float* dy, const float* y, float* dx, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    dx[i] = dy[i] * (1.0f - y[i] * y[i]);
}

constexpr int threads = 128;
int blocks_for(std::int64_t n) { return memkit::detail::grid_for(n, threads); }

struct device_linear {
  using value_type = float;
  int in, out;
  memkit::buffer<float> weight, bias, weight_grad, bias_grad;

  device_linear(memkit::memory_resource& params, int in_features, int out_features, std::uint32_t seed)
      : in(in_features), out(out_features), weight(params, {out, in}), bias(params, {out}),
        weight_grad(params, {out, in}), bias_grad(params, {out}) {
    const std::vector<float> w = checkpoint_test::random_values(weight.size(), seed, 0.3f);
    const std::vector<float> b = checkpoint_test::random_values(bias.size(), seed + 1, 0.1f);
    MEMKIT_CUDA_CHECK(cudaMemcpy(weight.data(), w.data(), weight.bytes(), cudaMemcpyHostToDevice));
    MEMKIT_CUDA_CHECK(cudaMemcpy(bias.data(), b.data(), bias.bytes(), cudaMemcpyHostToDevice));
  }
  shape output_shape(const shape& s) const { return {s[0], out}; }
  std::size_t saved_bytes(const shape& s, const forward_context&) const {
    return activation_store::bytes_required<float>(s);
  }
  void forward(const cuda_executor& exec, const forward_context&, tensor_view<const float> x, tensor_view<float> y,
               activation_store& store) {
    tensor_view<float> kept = store.save<float>(x.shape());
    MEMKIT_CUDA_CHECK(cudaMemcpyAsync(kept.data(), x.data(), x.bytes(), cudaMemcpyDefault, exec.stream));
    const int rows = static_cast<int>(x.shape()[0]);
    linear_forward<<<blocks_for(y.size()), threads, 0, exec.stream>>>(x.data(), weight.data(), bias.data(), y.data(),
                                                                      rows, in, out);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
  }
  void backward(const cuda_executor& exec, tensor_view<const float> dy, tensor_view<float> dx, activation_store& store) {
    const int rows = static_cast<int>(dy.shape()[0]);
    memkit::saved_tensor<float> x = store.take<float>(shape{rows, in}, "device_linear");
    linear_param_grads<<<blocks_for(out * (in + 1)), threads, 0, exec.stream>>>(
        dy.data(), x.view().data(), weight_grad.data(), bias_grad.data(), rows, in, out);
    if (!dx.is_none())
      linear_input_grad<<<blocks_for(dx.size()), threads, 0, exec.stream>>>(dy.data(), weight.data(), dx.data(), rows,
                                                                            in, out);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
  }
  void zero_grads(const cuda_executor& exec) {
    MEMKIT_CUDA_CHECK(cudaMemsetAsync(weight_grad.data(), 0, weight_grad.bytes(), exec.stream));
    MEMKIT_CUDA_CHECK(cudaMemsetAsync(bias_grad.data(), 0, bias_grad.bytes(), exec.stream));
  }
};

struct device_dropout {
  using value_type = float;
  float p = 0.3f;
  shape output_shape(const shape& s) const { return s; }
  std::size_t saved_bytes(const shape& s, const forward_context&) const {
    return activation_store::bytes_required<std::uint8_t>(s);
  }
  void forward(const cuda_executor& exec, const forward_context& ctx, tensor_view<const float> x, tensor_view<float> y,
               activation_store& store) {
    tensor_view<std::uint8_t> mask = store.save<std::uint8_t>(x.shape());
    dropout_forward<<<blocks_for(x.size()), threads, 0, exec.stream>>>(x.data(), y.data(), mask.data(), x.size(), p,
                                                                       ctx.seed, ctx.counter);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
  }
  void backward(const cuda_executor& exec, tensor_view<const float> dy, tensor_view<float> dx, activation_store& store) {
    memkit::saved_tensor<std::uint8_t> mask = store.take<std::uint8_t>(dy.shape(), "device_dropout");
    if (!dx.is_none())
      dropout_backward<<<blocks_for(dy.size()), threads, 0, exec.stream>>>(dy.data(), mask.view().data(), dx.data(),
                                                                           dy.size(), p);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
  }
};

struct device_tanh {
  using value_type = float;
  shape output_shape(const shape& s) const { return s; }
  std::size_t saved_bytes(const shape& s, const forward_context&) const {
    return activation_store::bytes_required<float>(s);
  }
  void forward(const cuda_executor& exec, const forward_context&, tensor_view<const float> x, tensor_view<float> y,
               activation_store& store) {
    tensor_view<float> kept = store.save<float>(x.shape());
    tanh_forward<<<blocks_for(x.size()), threads, 0, exec.stream>>>(x.data(), y.data(), kept.data(), x.size());
    MEMKIT_CUDA_CHECK(cudaGetLastError());
  }
  void backward(const cuda_executor& exec, tensor_view<const float> dy, tensor_view<float> dx, activation_store& store) {
    memkit::saved_tensor<float> y = store.take<float>(dy.shape(), "device_tanh");
    if (!dx.is_none())
      tanh_backward<<<blocks_for(dy.size()), threads, 0, exec.stream>>>(dy.data(), y.view().data(), dx.data(),
                                                                        dy.size());
    MEMKIT_CUDA_CHECK(cudaGetLastError());
  }
};

static_assert(memkit::explain_layer<device_linear, cuda_executor>());
static_assert(!memkit::layer<device_linear, memkit::host_executor>);

std::vector<float> to_host(const float* device, std::size_t n) {
  std::vector<float> v(n);
  MEMKIT_CUDA_CHECK(cudaMemcpy(v.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost));
  return v;
}

}  // namespace

TEST_CASE("checkpoint::segment compiled by nvcc: host schedules give the uncheckpointed gradients") {
  std::vector<checkpoint_test::mixed_layer> stack = checkpoint_test::mixed_stack(7, 5, 3);
  const shape in{3, 5};
  const std::vector<float> x = checkpoint_test::random_values(in.numel(), 2), dy = checkpoint_test::random_values(15, 4);
  std::vector<float> reference;
  for (const memkit::checkpoint::schedule& schedule : schedules())
    for (bool offload : {false, true}) {
      for (auto& l : stack) {
        std::fill(l.lin.weight_grad.begin(), l.lin.weight_grad.end(), 0.0f);
        l.adapter.zero_grad();
      }
      memkit::checkpoint::offload offloaded(memkit::default_host_resource());
      activation_store store(memkit::default_host_resource());
      memkit::checkpoint::segment segment(stack, {.schedule = schedule, .offload = offload ? &offloaded : nullptr});
      std::vector<float> y(15), dx(in.numel());
      segment.forward(memkit::host, step_context, memkit::host_view<const float>(x.data(), in),
                      memkit::host_view(y.data(), {3, 5}), store);
      segment.backward(memkit::host, memkit::host_view<const float>(dy.data(), {3, 5}), memkit::host_view(dx.data(), in),
                       store);
      for (auto& l : stack) {
        dx.insert(dx.end(), l.lin.weight_grad.begin(), l.lin.weight_grad.end());
        l.adapter.append_grads(dx);
      }
      if (reference.empty()) reference = dx;
      CHECK(same_bits(dx, reference));
    }
}

MEMKIT_GPU_TEST_CASE("gpu: memkit::checkpoint::segment on a stream gives the uncheckpointed gradients bit for bit, every "
                     "schedule, with and without offload to pinned memory, and allocates what it predicts") {
  cudaStream_t stream;
  MEMKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const cuda_executor exec{0, stream};
  memkit::device_resource params;
  memkit::device_async_resource device(stream);
  memkit::pinned_host_resource pinned;
  {
    device_linear first(params, 64, 96, 1), middle(params, 96, 96, 2), last(params, 96, 48, 3);
    device_dropout drop_a, drop_b;
    device_tanh act_a, act_b;
    auto sequence = memkit::checkpoint::layer_sequence(first, drop_a, act_a, middle, drop_b, act_b, last);
    const int rows = 32;
    const shape in{rows, 64}, out{rows, 48};
    memkit::buffer<float> x(params, in), y(params, out), dy(params, out), dx(params, in);
    const std::vector<float> x_host = checkpoint_test::random_values(x.size(), 7);
    const std::vector<float> dy_host = checkpoint_test::random_values(dy.size(), 8);
    MEMKIT_CUDA_CHECK(cudaMemcpy(x.data(), x_host.data(), x.bytes(), cudaMemcpyHostToDevice));
    MEMKIT_CUDA_CHECK(cudaMemcpy(dy.data(), dy_host.data(), dy.bytes(), cudaMemcpyHostToDevice));
    auto results = [&] {
      MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<float> r = to_host(y.data(), y.size()), d = to_host(dx.data(), dx.size());
      r.insert(r.end(), d.begin(), d.end());
      for (device_linear* l : {&first, &middle, &last}) {
        const std::vector<float> w = to_host(l->weight_grad.data(), l->weight_grad.size());
        const std::vector<float> b = to_host(l->bias_grad.data(), l->bias_grad.size());
        r.insert(r.end(), w.begin(), w.end());
        r.insert(r.end(), b.begin(), b.end());
      }
      return r;
    };
    auto zero = [&] {
      for (device_linear* l : {&first, &middle, &last}) l->zero_grads(exec);
    };

    // Reference: the seven layers by hand, everything kept, on the same stream.
    zero();
    {
      activation_store store(device);
      std::vector<memkit::buffer<float>> h;
      h.emplace_back();
      std::vector<shape> shapes{in};
      std::size_t i = 0;
      auto run_forward = [&](auto& layer) {
        shapes.push_back(layer.output_shape(shapes.back()));
        const bool last_layer = i == 6;
        if (!last_layer) h.emplace_back(device, shapes.back());
        const tensor_view<const float> input = i == 0 ? tensor_view<const float>(x.view()) : h[i].view();
        layer.forward(exec, step_context.for_layer(i), input, last_layer ? y.view() : h[i + 1].view(), store);
        ++i;
      };
      run_forward(first), run_forward(drop_a), run_forward(act_a), run_forward(middle), run_forward(drop_b),
          run_forward(act_b), run_forward(last);
      memkit::buffer<float> grad;
      auto run_backward = [&](auto& layer) {
        --i;
        memkit::buffer<float> g = i == 0 ? memkit::buffer<float>() : memkit::buffer<float>(device, shapes[i]);
        const tensor_view<const float> incoming = i == 6 ? tensor_view<const float>(dy.view()) : grad.view();
        layer.backward(exec, incoming, i == 0 ? dx.view() : g.view(), store);
        grad = std::move(g);
      };
      run_backward(last), run_backward(act_b), run_backward(drop_b), run_backward(middle), run_backward(act_a),
          run_backward(drop_a), run_backward(first);
    }
    const std::vector<float> reference = results();

    for (const memkit::checkpoint::schedule& schedule : schedules())
      for (bool offload : {false, true}) {
        CAPTURE(memkit::checkpoint::to_string(schedule.kind));
        CAPTURE(schedule.slots);
        CAPTURE(offload);
        zero();
        memkit::tracking_resource activations(device, "activations");
        memkit::tracking_resource host(pinned, "offloaded");
        memkit::checkpoint::offload offloaded(host.category(memkit::memory_category::activations));
        activation_store store(activations.category(memkit::memory_category::activations));
        memkit::checkpoint::segment segment(sequence, {.schedule = schedule, .offload = offload ? &offloaded : nullptr});
        segment.forward(exec, step_context, x.view(), y.view(), store);
        segment.backward(exec, dy.view(), dx.view(), store);
        CHECK(same_bits(results(), reference));
        const memkit::checkpoint::checkpoint_cost cost = segment.cost(in, step_context);
        CHECK(activations.peak_bytes() == cost.peak_bytes);
        CHECK(host.peak_bytes() == cost.host_bytes);
        CHECK(activations.current_bytes() == 0);
      }
  }
  MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}

MEMKIT_GPU_TEST_CASE("gpu: checkpoint offload refuses pageable host memory on a CUDA stream") {
  cudaStream_t stream;
  MEMKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    const cuda_executor exec{0, stream};
    memkit::device_resource device;
    device_tanh act;
    memkit::checkpoint::offload pageable(memkit::default_host_resource());
    activation_store store(device);
    memkit::checkpoint::segment segment(memkit::checkpoint::layer_sequence(act), {.offload = &pageable});
    memkit::buffer<float> x(device, {4, 4}), y(device, {4, 4});
    MEMKIT_CUDA_CHECK(cudaMemsetAsync(x.data(), 0, x.bytes(), stream));
    CHECK_THROWS_WITH_AS(segment.forward(exec, step_context, x.view(), y.view(), store),
                         doctest::Contains("needs pinned host memory"), memkit::error);
    CHECK(store.empty());
    MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}
