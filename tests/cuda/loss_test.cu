// loss::fused_linear_cross_entropy on CUDA against the host path (the reference, itself checked against a
// double-precision reference in tests/host). Cases in the "gpu" suite need a device; the others check the
// nvcc build of the shared row math and the device workspace count, and run anywhere.
#include <memkit/memkit.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "support/gpu_test.hpp"
#include "support/test_values.hpp"

namespace ls = memkit::loss;
namespace q = memkit::quant;
using memkit::host;
using memkit::host_view;
using memkit::tensor_view;

namespace {

template <class T>
std::vector<T> to_host(const T* device_pointer, std::size_t count) {
  std::vector<T> out(count);
  if (count) MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), device_pointer, count * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

template <class T>
memkit::buffer<T> to_device(memkit::memory_resource& resource, const std::vector<T>& values) {
  memkit::buffer<T> out(resource, memkit::shape{static_cast<std::int64_t>(values.size())});
  if (!values.empty())
    MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
  return out;
}

std::vector<std::int32_t> targets_for(std::int64_t N, std::int64_t V, std::int64_t ignore_index) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < N; ++i)
    t[static_cast<std::size_t>(i)] = i % 5 == 4 ? static_cast<std::int32_t>(ignore_index) : static_cast<std::int32_t>((i * 7919) % V);
  return t;
}

double max_abs_difference(const std::vector<float>& a, const std::vector<float>& b, double* scale) {
  double worst = 0;
  *scale = 1e-6;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::fabs(a[i] - b[i])));
    *scale = std::max(*scale, static_cast<double>(std::fabs(b[i])));
  }
  return worst;
}

template <class T>
std::vector<float> widen(const std::vector<T>& values) {
  std::vector<float> out;
  for (const T& v : values) out.push_back(memkit::to_float(v));
  return out;
}

// One device call's outputs, copied back.
template <class T>
struct device_outputs {
  float loss = 0;
  std::vector<T> d_hidden;
  std::vector<float> d_head;
};

// Device result vs host result for one element type and option set; `quantized` uses an NF4 head. The device runs
// once per row pass (options.row_pass: classic, staged), each held to the same tolerances against the host; where
// the staged pass stages the row in shared memory (V * 4 bytes within the device's limit) it must also give the
// classic kernel's bits, as it walks the row in the same order.
template <class T>
void check_device_against_host(std::int64_t N, std::int64_t H, std::int64_t V, const ls::cross_entropy_options& o,
                               bool quantized) {
  const std::vector<T> hidden = memkit_test::convert<T>(memkit_test::uniform_values(N * H, 1));
  const std::vector<T> head = memkit_test::convert<T>(memkit_test::uniform_values(V * H, 2));
  const std::vector<std::int32_t> targets = targets_for(N, V, o.ignore_index);
  const auto nf4 = q::quantized_tensor<q::NF4>::quantize(host, host_view(head.data(), {V, H}), {64, false},
                                                         memkit::default_host_resource());

  float host_loss = 0;
  std::vector<T> host_d_hidden(static_cast<std::size_t>(N * H));
  std::vector<float> host_d_head(static_cast<std::size_t>(V * H), 0.5f);
  const tensor_view<float> host_head_grad = quantized ? tensor_view<float>{} : host_view(host_d_head.data(), {V, H});
  if (quantized)
    ls::fused_linear_cross_entropy(host, host_view(hidden.data(), {N, H}), nf4, host_view(targets.data(), {N}),
                                   host_view(&host_loss, {1}), host_view(host_d_hidden.data(), {N, H}), host_head_grad, o,
                                   memkit::default_host_resource());
  else
    ls::fused_linear_cross_entropy(host, host_view(hidden.data(), {N, H}), host_view(head.data(), {V, H}),
                                   host_view(targets.data(), {N}), host_view(&host_loss, {1}),
                                   host_view(host_d_hidden.data(), {N, H}), host_head_grad, o,
                                   memkit::default_host_resource());

  memkit::device_resource device(0);
  auto d_hidden_in = to_device(device, hidden);
  auto d_head_w = to_device(device, head);
  auto d_targets = to_device(device, targets);
  // The host-quantized head's storage copied into a device tensor.
  q::quantized_tensor<q::NF4> nf4_device(device, memkit::shape{V, H}, {64, false});
  MEMKIT_CUDA_CHECK(cudaMemcpy(nf4_device.codes().data(), nf4.codes().data(), nf4.codes().size(), cudaMemcpyHostToDevice));
  MEMKIT_CUDA_CHECK(cudaMemcpy(nf4_device.absmax().data(), nf4.absmax().data(), nf4.absmax().bytes(), cudaMemcpyHostToDevice));
  const auto run_device = [&](const ls::cross_entropy_options& options) {
    memkit::tracking_resource workspace(device, "loss");
    memkit::buffer<float> d_loss(device, memkit::shape{1});
    memkit::buffer<T> d_grad_hidden(device, memkit::shape{N, H});
    auto d_grad_head = to_device(device, std::vector<float>(static_cast<std::size_t>(V * H), 0.5f));
    cudaStream_t stream = nullptr;
    MEMKIT_CUDA_CHECK(cudaStreamCreate(&stream));
    const memkit::cuda_executor exec{0, stream};
    const tensor_view<float> device_head_grad =
        quantized ? tensor_view<float>{} : tensor_view<float>(d_grad_head.data(), {V, H}, memkit::memory_kind::device);
    const tensor_view<const T> x(d_hidden_in.data(), {N, H}, memkit::memory_kind::device);
    const tensor_view<const std::int32_t> t(d_targets.data(), {N}, memkit::memory_kind::device);
    if (quantized)
      ls::fused_linear_cross_entropy(exec, x, nf4_device, t, d_loss.view(), d_grad_hidden.view(), device_head_grad,
                                     options, workspace);
    else
      ls::fused_linear_cross_entropy(exec, x, tensor_view<const T>(d_head_w.data(), {V, H}, memkit::memory_kind::device),
                                     t, d_loss.view(), d_grad_hidden.view(), device_head_grad, options, workspace);
    exec.synchronize();
    MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
    CHECK(workspace.peak_bytes() ==
          ls::workspace_bytes({.tokens = N, .hidden = H, .vocab = V, .hidden_element_bytes = sizeof(T),
                               .quantized_head = quantized, .head_grad = !quantized, .on_device = true,
                               .options = options}));
    device_outputs<T> out;
    out.loss = to_host(d_loss.data(), 1)[0];
    out.d_hidden = to_host(d_grad_hidden.data(), static_cast<std::size_t>(N * H));
    if (!quantized) out.d_head = to_host(d_grad_head.data(), static_cast<std::size_t>(V * H));
    return out;
  };

  std::vector<device_outputs<T>> results;
  for (const ls::device_row_pass pass : {ls::device_row_pass::classic, ls::device_row_pass::staged}) {
    CAPTURE(static_cast<int>(pass));
    ls::cross_entropy_options with_pass = o;
    with_pass.row_pass = pass;
    results.push_back(run_device(with_pass));
    const device_outputs<T>& out = results.back();
    // A 16-bit quantized head: the device dequantizes its tiles into T (cuBLAS takes one operand type), the host
    // into fp32, so each weight differs by up to 2^-9 relative (bf16) and the logits by the sum of those.
    const double loss_epsilon = quantized && !std::is_same_v<T, float> ? 1e-3 : 1e-5;
    CHECK(out.loss == doctest::Approx(host_loss).epsilon(loss_epsilon));
    // 16-bit: the device multiplies a 16-bit gradient of the logits (cuBLAS takes one operand type).
    const double tolerance = std::is_same_v<T, float> ? 1e-4 : 2e-2;
    // The difference first, then the scale it set: operands of <= are unordered.
    double scale = 0;
    const double hidden_difference = max_abs_difference(widen(out.d_hidden), widen(host_d_hidden), &scale);
    CHECK(hidden_difference <= tolerance * scale);
    if (!quantized) {
      std::vector<float> shifted_device = out.d_head;
      std::vector<float> shifted_host = host_d_head;
      for (float& v : shifted_device) v -= 0.5f;
      for (float& v : shifted_host) v -= 0.5f;
      const double head_difference = max_abs_difference(shifted_device, shifted_host, &scale);
      CHECK(head_difference <= tolerance * scale);
    }
  }
  if (ls::detail::staged_row_fits<T>(0, V)) {  // the staged kernel ran: the classic kernel's bits
    const auto bits = [](const auto& v) { return std::vector<unsigned char>(reinterpret_cast<const unsigned char*>(v.data()),
                                                                            reinterpret_cast<const unsigned char*>(v.data() + v.size())); };
    CHECK(std::memcmp(&results[0].loss, &results[1].loss, sizeof(float)) == 0);
    CHECK(bits(results[0].d_hidden) == bits(results[1].d_hidden));
    CHECK(bits(results[0].d_head) == bits(results[1].d_head));
  }
}

}  // namespace

TEST_CASE("loss (nvcc): the shared row math and the device workspace count") {
  const ls::detail::row_math math{2.0f, 0.01f, 0.1f, 10};
  CHECK(math.capped(100.0f) == doctest::Approx(2.0f));
  CHECK(math.token_loss(1.0f, 0.5f, 3.0f) == doctest::Approx(1.0f - 0.9f * 0.5f - 0.01f * 3.0f + 0.01f));
  const ls::cross_entropy_options o{.chunk_bytes = 10 * 1000 * 6};
  CHECK(ls::workspace_bytes(ls::fused_linear_cross_entropy_arguments{
            .tokens = 100, .hidden = 64, .vocab = 1000, .hidden_element_bytes = 2, .on_device = true, .options = o}) ==
        10 * 1000 * 4 + 100 * 4 + 8 + 10 * 1000 * 2);
  // Reduction none writes the row losses into `loss` itself: no row-loss buffer.
  const ls::cross_entropy_options none{.chunk_bytes = 10 * 1000 * 6, .reduction = ls::reduction_mode::none};
  CHECK(ls::workspace_bytes(ls::fused_linear_cross_entropy_arguments{
            .tokens = 100, .hidden = 64, .vocab = 1000, .hidden_element_bytes = 2, .on_device = true, .options = none}) ==
        10 * 1000 * 4 + 8 + 10 * 1000 * 2);
}

MEMKIT_GPU_TEST_CASE("loss: CUDA matches the host path (fp32, bf16; options; chunks; NF4 head)") {
  const ls::cross_entropy_options plain{.chunk_bytes = 9 * 700 * 6};
  const ls::cross_entropy_options all{.ignore_index = 3, .label_smoothing = 0.1f, .logit_softcap = 2.0f,
                                      .z_loss = 1e-3f, .chunk_bytes = 9 * 700 * 6};
  for (const auto& o : {plain, all}) {
    check_device_against_host<float>(61, 96, 700, o, false);
    check_device_against_host<memkit::bf16>(61, 96, 700, o, false);
    check_device_against_host<float>(61, 96, 700, o, true);
  }
  // Several dequantized tiles (V * H above quantized_tile_values), bf16 with the fp32 accumulator.
  check_device_against_host<memkit::bf16>(17, 4096, 1100, plain, true);
  // V not a multiple of 4: the staged pass's scalar loads and stores.
  check_device_against_host<float>(61, 96, 701, all, false);
  check_device_against_host<memkit::bf16>(61, 96, 701, all, false);
}

MEMKIT_GPU_TEST_CASE("loss: CUDA's staged row pass on rows too long for shared memory (the two-pass kernel)") {
  // 60,000 fp32 logits (240,000 bytes) exceed every device's opt-in shared memory per block (227 KiB on sm_90):
  // the staged pass reads such a row twice (online softmax) instead; 60,002 takes its scalar path.
  CHECK_FALSE(ls::detail::staged_row_fits<float>(0, 60000));
  const ls::cross_entropy_options plain{.chunk_bytes = 3 * 60002 * 6};
  const ls::cross_entropy_options all{.ignore_index = 3, .label_smoothing = 0.1f, .logit_softcap = 2.0f,
                                      .z_loss = 1e-3f, .chunk_bytes = 3 * 60002 * 6};
  for (const auto& o : {plain, all}) {
    check_device_against_host<float>(7, 32, 60000, o, false);
    check_device_against_host<memkit::bf16>(7, 32, 60000, o, false);
    check_device_against_host<float>(7, 32, 60002, o, false);
  }
}

MEMKIT_GPU_TEST_CASE("loss: CUDA reports a target out of range as a NaN loss; all ignored gives 0") {
  const std::int64_t N = 8, H = 16, V = 32;
  const std::vector<float> hidden = memkit_test::uniform_values(N * H, 3), head = memkit_test::uniform_values(V * H, 4);
  memkit::device_resource device(0);
  auto x = to_device(device, hidden);
  auto w = to_device(device, head);
  memkit::buffer<float> loss(device, memkit::shape{1});
  const memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream(0);
  for (int bad : {0, 1}) {
    std::vector<std::int32_t> targets(static_cast<std::size_t>(N), -100);
    if (bad) targets[2] = static_cast<std::int32_t>(V);
    auto t = to_device(device, targets);
    ls::fused_linear_cross_entropy(exec, tensor_view<const float>(x.data(), {N, H}, memkit::memory_kind::device),
                                   tensor_view<const float>(w.data(), {V, H}, memkit::memory_kind::device),
                                   tensor_view<const std::int32_t>(t.data(), {N}, memkit::memory_kind::device),
                                   loss.view(), tensor_view<float>{}, tensor_view<float>{}, {}, device);
    exec.synchronize();
    const float value = to_host(loss.data(), 1)[0];
    if (bad) CHECK(std::isnan(value));
    else CHECK(value == 0.0f);
  }
}

namespace {

// Reduction none on the device against the host: per-token losses, and the gradients for per-token weights d_loss.
template <class T>
void check_per_token_device_against_host(std::int64_t N, std::int64_t H, std::int64_t V, bool quantized,
                                         ls::device_row_pass pass = ls::device_row_pass::classic) {
  const ls::cross_entropy_options o{.label_smoothing = 0.1f, .z_loss = 1e-3f, .chunk_bytes = 9 * 700 * 6,
                                    .reduction = ls::reduction_mode::none, .row_pass = pass};
  const std::vector<T> hidden = memkit_test::convert<T>(memkit_test::uniform_values(N * H, 1));
  const std::vector<T> head = memkit_test::convert<T>(memkit_test::uniform_values(V * H, 2));
  const std::vector<std::int32_t> targets = targets_for(N, V, o.ignore_index);
  std::vector<float> weights(static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < N; ++i) weights[static_cast<std::size_t>(i)] = 0.5f - 0.03f * static_cast<float>(i % 11);
  const auto nf4 = q::quantized_tensor<q::NF4>::quantize(host, host_view(head.data(), {V, H}), {64, false},
                                                         memkit::default_host_resource());
  std::vector<float> host_loss(static_cast<std::size_t>(N));
  std::vector<T> host_d_hidden(static_cast<std::size_t>(N * H));
  std::vector<float> host_d_head(static_cast<std::size_t>(V * H), 0.0f);
  if (quantized)
    ls::fused_linear_cross_entropy(host, host_view(hidden.data(), {N, H}), nf4, host_view(targets.data(), {N}),
                                   host_view(weights.data(), {N}), host_view(host_loss.data(), {N}),
                                   host_view(host_d_hidden.data(), {N, H}), tensor_view<float>{}, o,
                                   memkit::default_host_resource());
  else
    ls::fused_linear_cross_entropy(host, host_view(hidden.data(), {N, H}), host_view(head.data(), {V, H}),
                                   host_view(targets.data(), {N}), host_view(weights.data(), {N}),
                                   host_view(host_loss.data(), {N}), host_view(host_d_hidden.data(), {N, H}),
                                   host_view(host_d_head.data(), {V, H}), o, memkit::default_host_resource());
  memkit::device_resource device(0);
  memkit::tracking_resource workspace(device, "loss");
  auto x_d = to_device(device, hidden);
  auto w_d = to_device(device, head);
  auto t_d = to_device(device, targets);
  auto weights_d = to_device(device, weights);
  memkit::buffer<float> loss_d(device, memkit::shape{N});
  memkit::buffer<T> d_hidden_d(device, memkit::shape{N, H});
  auto d_head_d = to_device(device, std::vector<float>(static_cast<std::size_t>(V * H), 0.0f));
  q::quantized_tensor<q::NF4> nf4_device(device, memkit::shape{V, H}, {64, false});
  MEMKIT_CUDA_CHECK(cudaMemcpy(nf4_device.codes().data(), nf4.codes().data(), nf4.codes().size(), cudaMemcpyHostToDevice));
  MEMKIT_CUDA_CHECK(cudaMemcpy(nf4_device.absmax().data(), nf4.absmax().data(), nf4.absmax().bytes(), cudaMemcpyHostToDevice));
  const memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream(0);
  const tensor_view<const T> x(x_d.data(), {N, H}, memkit::memory_kind::device);
  const tensor_view<const std::int32_t> t(t_d.data(), {N}, memkit::memory_kind::device);
  const tensor_view<const float> w(weights_d.data(), {N}, memkit::memory_kind::device);
  const tensor_view<float> head_grad =
      quantized ? tensor_view<float>{} : tensor_view<float>(d_head_d.data(), {V, H}, memkit::memory_kind::device);
  if (quantized)
    ls::fused_linear_cross_entropy(exec, x, nf4_device, t, w, loss_d.view(), d_hidden_d.view(), head_grad, o, workspace);
  else
    ls::fused_linear_cross_entropy(exec, x, tensor_view<const T>(w_d.data(), {V, H}, memkit::memory_kind::device), t, w,
                                   loss_d.view(), d_hidden_d.view(), head_grad, o, workspace);
  exec.synchronize();
  CHECK(workspace.peak_bytes() ==
        ls::workspace_bytes({.tokens = N, .hidden = H, .vocab = V, .hidden_element_bytes = sizeof(T),
                             .quantized_head = quantized, .head_grad = !quantized, .on_device = true, .options = o}));
  double scale = 0;
  const std::vector<float> device_loss = to_host(loss_d.data(), static_cast<std::size_t>(N));
  const double loss_tolerance = quantized && !std::is_same_v<T, float> ? 1e-3 : 1e-5;
  CHECK(max_abs_difference(device_loss, host_loss, &scale) <= loss_tolerance * scale);
  const double tolerance = std::is_same_v<T, float> ? 1e-4 : 2e-2;
  const double hidden_difference = max_abs_difference(
      widen(to_host(d_hidden_d.data(), static_cast<std::size_t>(N * H))), widen(host_d_hidden), &scale);
  CHECK(hidden_difference <= tolerance * scale);
  if (!quantized) {
    const double head_difference =
        max_abs_difference(to_host(d_head_d.data(), static_cast<std::size_t>(V * H)), host_d_head, &scale);
    CHECK(head_difference <= tolerance * scale);
  }
}

}  // namespace

MEMKIT_GPU_TEST_CASE("loss: CUDA reduction none matches the host path (per-token losses, weighted gradients)") {
  check_per_token_device_against_host<float>(61, 96, 700, false);
  check_per_token_device_against_host<memkit::bf16>(61, 96, 700, false);
  check_per_token_device_against_host<float>(61, 96, 700, true);
  check_per_token_device_against_host<memkit::bf16>(17, 4096, 1100, true);
  // The staged row pass: the row in shared memory, and a row too long for it (two reads).
  check_per_token_device_against_host<float>(61, 96, 700, false, ls::device_row_pass::staged);
  check_per_token_device_against_host<memkit::bf16>(61, 96, 700, false, ls::device_row_pass::staged);
  check_per_token_device_against_host<memkit::bf16>(7, 32, 60000, false, ls::device_row_pass::staged);
}

MEMKIT_GPU_TEST_CASE("loss: CUDA reduction none reports a target out of range as that token's NaN loss") {
  const std::int64_t N = 8, H = 16, V = 32;
  const std::vector<float> hidden = memkit_test::uniform_values(N * H, 3), head = memkit_test::uniform_values(V * H, 4);
  memkit::device_resource device(0);
  auto x = to_device(device, hidden);
  auto w = to_device(device, head);
  std::vector<std::int32_t> targets(static_cast<std::size_t>(N), 1);
  targets[2] = static_cast<std::int32_t>(V);
  targets[5] = -100;
  auto t = to_device(device, targets);
  memkit::buffer<float> loss(device, memkit::shape{N});
  const memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream(0);
  ls::fused_linear_cross_entropy(exec, tensor_view<const float>(x.data(), {N, H}, memkit::memory_kind::device),
                                 tensor_view<const float>(w.data(), {V, H}, memkit::memory_kind::device),
                                 tensor_view<const std::int32_t>(t.data(), {N}, memkit::memory_kind::device),
                                 loss.view(), tensor_view<float>{}, tensor_view<float>{},
                                 {.reduction = ls::reduction_mode::none}, device);
  exec.synchronize();
  const std::vector<float> values = to_host(loss.data(), static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < N; ++i) {
    CAPTURE(i);
    if (i == 2) CHECK(std::isnan(values[static_cast<std::size_t>(i)]));
    else if (i == 5) CHECK(values[static_cast<std::size_t>(i)] == 0.0f);
    else CHECK(values[static_cast<std::size_t>(i)] > 0.0f);
  }
}
