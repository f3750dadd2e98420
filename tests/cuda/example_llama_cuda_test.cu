// The main example's model (examples/llama) under nvcc: its layers are memkit layers on the cuda_executor too
// (checked at compile time, runs everywhere), and (suite "gpu") the same model on the device and on the host
// from the same weights: a decoder block's forward and backward, and a few training steps of a tiny
// pretraining run (checkpointed stack, fused linear cross-entropy, 8-bit AdamW), compared within stated
// tolerances. The device peak against memory_budget's memkit runtime (2%) is the example's own --check on the
// device: CTest memkit.example.train_llama_cuda_short (memkit_example_train_llama_cuda --device cuda --short --check).
#include <memkit/layers/parameters.hpp>
#include <memkit/models/llama/model.hpp>
#include <memkit/models/llama/nf4_lora.hpp>

#include <memkit/checkpoint/segment.hpp>
#include <memkit/loss/fused_linear_cross_entropy.hpp>
#include <memkit/memory/tracking.hpp>
#include <memkit/optim/adam_state.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "support/gpu_test.hpp"
#include "support/test_values.hpp"

namespace llama = memkit::models::llama;

namespace {

using memkit::shape;
using memkit::tensor_view;
using bf16 = memkit::bf16;
using dense = memkit::layers::dense_linear<bf16>;
using block_type = llama::decoder_block<bf16, dense>;
using model_type = llama::causal_lm<bf16, dense>;

static_assert(memkit::layer<block_type, memkit::cuda_executor>);
static_assert(memkit::layer<llama::rms_norm<bf16>, memkit::cuda_executor>);
static_assert(memkit::layer<llama::rotary<bf16>, memkit::cuda_executor>);
static_assert(memkit::layer<llama::swiglu<bf16>, memkit::cuda_executor>);
static_assert(memkit::layer<dense, memkit::cuda_executor>);
static_assert(memkit::layer<llama::nf4_lora_linear<bf16>, memkit::cuda_executor>);

// head_dim 16: a multiple of 16, the CUDA attention kernel's bf16 MMA shape.
llama::model_config tiny_config() {
  return {.vocab = 64, .hidden = 64, .layers = 2, .heads = 4, .kv_heads = 2, .head_dim = 16, .intermediate = 96,
          .max_positions = 32};
}

// Worst |a - b| over the largest |b| (b the host's result).
template <class T>
double normwise_error(const std::vector<T>& a, const std::vector<T>& b) {
  double worst = 0.0, largest = 1e-12;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::fabs(double(memkit::to_float(a[i])) - memkit::to_float(b[i])));
    largest = std::max(largest, std::fabs(double(memkit::to_float(b[i]))));
  }
  return worst / largest;
}

// One model and its memory, on the host or (device_memory given) on the device.
struct setup {
  memkit::tracking_resource tracker;
  memkit::layers::memory_resources memory;
  model_type model;

  static memkit::layers::memory_resources resources_of(memkit::tracking_resource& t) {
    memkit::layers::memory_resources m;
    m.weights = &t.category(memkit::memory_category::weights);
    m.gradients = &t.category(memkit::memory_category::gradients);
    m.optimizer = &t.category(memkit::memory_category::optimizer_state);
    m.workspace = &t.category(memkit::memory_category::workspace);
    m.host_threads = 1;
    return m;
  }
  explicit setup(memkit::memory_resource& upstream)
      : tracker(upstream, "example-llama-cuda-test"), memory(resources_of(tracker)),
        model(tiny_config(), memory, memkit::layers::trainability::bf16_master,
              [this](const llama::projection& p, std::int64_t, int) {
                return dense(p.path + ".weight", p.in, p.out, memory, memkit::layers::trainability::bf16_master);
              }) {
    // The same values on both sides: every parameter drawn from (seed, its index) on the host, then copied in;
    // the norm weights away from 1 so that their gradients are exercised.
    std::uint64_t stream = 0;
    for (memkit::layers::parameter* p : parameters()) {
      std::vector<float> values = memkit_test::standard_normal(p->size(), static_cast<unsigned>(++stream));
      const bool norm = p->value.shape().rank == 1;
      for (float& v : values) v = norm ? 1.0f + 0.2f * v : 0.05f * v;
      p->assign(values.data());
    }
  }
  std::vector<memkit::layers::parameter*> parameters() {
    std::vector<memkit::layers::parameter*> list = model.shared_parameters();
    for (dense* l : model.linears()) list.push_back(&l->weight);
    return list;
  }
};

memkit::forward_context training(std::uint64_t step) { return {5, step, true}; }

// A block's forward and backward from host values x, dy: returns y, dx and the block's weight gradients.
template <memkit::executor E>
std::vector<std::vector<bf16>> block_pass(const E& exec, setup& s, const std::vector<bf16>& x, const std::vector<bf16>& dy,
                                          const shape& in) {
  block_type& block = s.model.blocks[0];
  memkit::memory_resource& acts = s.tracker.category(memkit::memory_category::activations);
  memkit::buffer<bf16> xb(acts, in), yb(acts, in), dyb(acts, in), dxb(acts, in);
  memkit::layers::copy_in(x.data(), xb.view());
  memkit::layers::copy_in(dy.data(), dyb.view());
  memkit::activation_store store(acts);
  block.forward(exec, training(0), std::as_const(xb).view(), yb.view(), store);
  CHECK(store.bytes() == block.saved_bytes(in, training(0)));
  block.backward(exec, std::as_const(dyb).view(), dxb.view(), store);
  CHECK(store.empty());
  std::vector<std::vector<bf16>> out{memkit::layers::copy_out(std::as_const(yb).view()), memkit::layers::copy_out(std::as_const(dxb).view())};
  for (memkit::layers::parameter* p : {&block.attn_norm.weight, &block.q.weight, &block.k.weight, &block.v.weight, &block.o.weight,
                              &block.mlp_norm.weight, &block.gate.weight, &block.up.weight, &block.down.weight}) {
    const std::vector<float> g = memkit::layers::copy_out(std::as_const(p->grad).view());
    out.push_back(memkit_test::convert<bf16>(g));
  }
  return out;
}

// `steps` optimizer steps of the tiny model (embedding, checkpointed blocks + final norm, fused loss, 8-bit
// AdamW with clipping): the loss of each step, and the gradients of the first micro-batch (before any update).
template <memkit::executor E>
std::vector<float> train(const E& exec, setup& s, int steps, std::vector<std::vector<float>>& first_grads) {
  const llama::model_config c = tiny_config();
  const std::int64_t batch = 2, seq = 32, tokens = batch * seq;
  memkit::memory_resource& acts = s.tracker.category(memkit::memory_category::activations);
  memkit::memory_resource& other = s.tracker.category(memkit::memory_category::other);
  memkit::buffer<std::int32_t> ids(other, shape{tokens}), targets(other, shape{tokens});
  memkit::buffer<float> loss(other, shape{1});
  memkit::buffer<bf16> h0(acts, shape{batch, seq, c.hidden}), hn(acts, shape{batch, seq, c.hidden}),
      dhn(acts, shape{batch, seq, c.hidden}), dh0(acts, shape{batch, seq, c.hidden});
  // The optimizer's tensors, registered by the model itself (one group, no weight decay).
  memkit::layers::parameter_registry<bf16> params;
  s.model.register_parameters(params);
  REQUIRE(params.size() == s.parameters().size());
  memkit::optim::adam_options adam_options;
  adam_options.max_grad_norm = 1.0f;
  adam_options.seed = 3;
  memkit::optim::adam_state<std::int8_t, 256> adam(exec, *s.memory.optimizer, params.sizes(), adam_options);
  const auto adam_params = params.adam_params();
  const std::vector<memkit::optim::adam_group> groups = params.adam_groups({.beta2 = 0.99f, .weight_decay = 0.0f}, 3e-3f);
  auto stack = memkit::checkpoint::segment(memkit::checkpoint::layer_sequence(s.model.blocks, s.model.final_norm),
                                          {.schedule = memkit::checkpoint::schedule::every_layer()});
  memkit::activation_store store(acts);
  memkit::loss::cross_entropy_options loss_options;
  loss_options.chunk_bytes = static_cast<std::size_t>(32 * c.vocab) * sizeof(float);  // two chunks
  std::vector<float> losses;
  for (int step = 0; step < steps; ++step) {
    memkit::layers::zero_grad(exec, params);
    // A repeating pattern the model can learn in a few steps: token t+1 follows t.
    std::vector<std::int32_t> id(static_cast<std::size_t>(tokens)), target(static_cast<std::size_t>(tokens));
    for (std::int64_t t = 0; t < tokens; ++t) {
      id[static_cast<std::size_t>(t)] = static_cast<std::int32_t>((t * 7 + step) % c.vocab);
      target[static_cast<std::size_t>(t)] = static_cast<std::int32_t>((t * 7 + step + 7) % c.vocab);
    }
    memkit::layers::copy_in(id.data(), ids.view());
    memkit::layers::copy_in(target.data(), targets.view());
    s.model.embed.forward(exec, std::as_const(ids).view(), h0.view());
    stack.forward(exec, training(static_cast<std::uint64_t>(step)), std::as_const(h0).view(), hn.view(), store);
    memkit::loss::fused_linear_cross_entropy(exec, std::as_const(hn).view().reshaped(shape{tokens, c.hidden}),
                                             std::as_const(s.model.head.value).view(), std::as_const(targets).view(),
                                             loss.view(), dhn.view().reshaped(shape{tokens, c.hidden}),
                                             s.model.head.grad.view(), loss_options, *s.memory.workspace);
    stack.backward(exec, std::as_const(dhn).view(), dh0.view(), store);
    s.model.embed.backward(exec, std::as_const(ids).view(), std::as_const(dh0).view());
    losses.push_back(memkit::layers::copy_out(std::as_const(loss).view())[0]);
    if (step == 0)
      for (const auto& p : params.entries()) first_grads.push_back(memkit::layers::copy_out(tensor_view<const float>(p.grad)));
    adam.step(exec, adam_params, groups, 1.0f);
  }
  return losses;
}

}  // namespace

// Tolerances: the device's products are cuBLAS's (another summation order than the host GEMM's), its
// attention is the CUDA kernel, its exp is CUDA's expf (within 2 ulp of the host's), and activations are
// rounded to bf16 (2^-8 relative) after each layer: outputs and input gradients within 3% of their largest
// magnitude, weight gradients (rounded to bf16 here for the comparison) within 5%.
MEMKIT_GPU_TEST_CASE("example llama on a cuda_executor: a decoder block's forward and backward match the host's") {
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  memkit::device_async_resource device(gpu.stream, gpu.device);
  setup on_host(memkit::default_host_resource()), on_device(device);
  const shape in{2, 32, tiny_config().hidden};
  const std::vector<bf16> x = memkit_test::convert<bf16>(memkit_test::standard_normal(in.numel(), 21));
  const std::vector<bf16> dy = memkit_test::convert<bf16>(memkit_test::standard_normal(in.numel(), 22));
  const auto host = block_pass(memkit::host, on_host, x, dy, in);
  on_device.tracker.reset_peak();
  const auto dev = block_pass(gpu, on_device, x, dy, in);
  gpu.synchronize();
  // The block's own statement of its device workspace (cuBLAS and the attention kernel take none from it but
  // the backward's delta) bounds what it took.
  CHECK(on_device.tracker.stats(memkit::memory_category::workspace).peak_bytes <= on_device.model.blocks[0].workspace_bytes(in));
  REQUIRE(host.size() == dev.size());
  for (std::size_t i = 0; i < host.size(); ++i) {
    CAPTURE(i);  // 0: y, 1: dx, then the weight gradients in block order
    CHECK(normwise_error(dev[i], host[i]) <= (i < 2 ? 0.03 : 0.05));
  }
  memkit::release_cublas_resources();
}

MEMKIT_GPU_TEST_CASE("example llama on a cuda_executor: training steps of a tiny model follow the host's") {
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  memkit::device_async_resource device(gpu.stream, gpu.device);
  setup on_host(memkit::default_host_resource()), on_device(device);
  std::vector<std::vector<float>> host_grads, device_grads;
  const std::vector<float> host_losses = train(memkit::host, on_host, 4, host_grads);
  const std::vector<float> device_losses = train(gpu, on_device, 4, device_grads);
  gpu.synchronize();
  // The first step: the same weights, so the same loss up to rounding, and the same gradients.
  REQUIRE(host_grads.size() == device_grads.size());
  for (std::size_t i = 0; i < host_grads.size(); ++i) {
    CAPTURE(i);
    CHECK(normwise_error(device_grads[i], host_grads[i]) <= 0.05);
  }
  // Later steps: both learn the pattern; the losses stay within 2% of each other (the updates differ only as
  // far as the gradients do, through 8-bit AdamW's quantized state) and fall on both.
  for (std::size_t s = 0; s < host_losses.size(); ++s) {
    CAPTURE(s);
    CHECK(device_losses[s] == doctest::Approx(host_losses[s]).epsilon(0.02));
  }
  CHECK(host_losses.back() < host_losses.front());
  CHECK(device_losses.back() < device_losses.front());
  memkit::release_cublas_resources();
}
