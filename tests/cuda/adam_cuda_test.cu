// adam_state on CUDA against the host loop (suite "gpu": these need a device). Every comparison is bit
// for bit: the kernels call the same element functions as the host step.
#include <memkit/memkit.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "host/adam_support.hpp"
#include "support/gpu_test.hpp"

namespace {

using memkit::optim::adam_group;
using memkit::optim::adam_param;
using memkit::optim::adam_state;
using memkit::bf16;
using memkit::fp16;

using adam_test::convert;
using adam_test::normal;

// A host vector and its copy in memory of `resource`'s kind.
template <class T>
struct mirrored {
  std::vector<T> host;
  memkit::buffer<T> device;
  mirrored(memkit::memory_resource& resource, std::vector<T> values)
      : host(std::move(values)), device(resource, memkit::shape{static_cast<std::int64_t>(host.size())}) {
    MEMKIT_CUDA_CHECK(cudaMemcpy(device.data(), host.data(), host.size() * sizeof(T), cudaMemcpyDefault));
  }
  std::vector<T> device_copy() const {
    std::vector<T> out(host.size());
    MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), device.data(), out.size() * sizeof(T), cudaMemcpyDefault));
    return out;
  }
  bool same() const {
    const auto copy = device_copy();
    return std::memcmp(copy.data(), host.data(), host.size() * sizeof(T)) == 0;
  }
};

template <class S>
std::vector<std::byte> state_bytes(const S& state) {
  const auto view = state.arena_view();
  std::vector<std::byte> out(view.size());
  MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), view.data(), out.size(), cudaMemcpyDefault));
  return adam_test::without_scratch(state, std::move(out));
}

// Runs the same steps on the host and on the device (state in `state_resource`, tensors in
// `tensor_resource`) and checks parameters, master copies and the whole state image agree bit for bit.
// 20 tensors: two launches of the multi-tensor kernels; sizes straddle blocks and the threshold.
template <class S, class P, class G>
void check_host_device_agreement(memkit::memory_resource& state_resource, memkit::memory_resource& tensor_resource,
                                 bool with_master, memkit::optim::adam_options options = {}) {
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  std::vector<std::int64_t> sizes;
  for (int i = 0; i < 20; ++i) sizes.push_back(i % 3 == 0 ? 4096 * (i + 1) + 77 : 100 + 333 * i);
  S host_state(memkit::host, memkit::default_host_resource(), sizes, options);
  S device_state(gpu, state_resource, sizes, options);
  std::vector<mirrored<P>> params;
  std::vector<mirrored<float>> masters;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto values = normal(static_cast<std::size_t>(sizes[i]), 0.1f, static_cast<std::uint32_t>(i));
    params.emplace_back(tensor_resource, convert<P>(values));
    masters.emplace_back(tensor_resource, values);
  }
  const std::vector<adam_group> groups{adam_group{}, {.lr = 3e-3f, .beta1 = 0.8f, .weight_decay = 0.1f}};
  for (int step = 0; step < 3; ++step) {
    std::vector<mirrored<G>> grads;
    for (std::size_t i = 0; i < sizes.size(); ++i)
      grads.emplace_back(tensor_resource,
                         convert<G>(normal(static_cast<std::size_t>(sizes[i]), 0.01f, 1000u * step + i)));
    std::vector<adam_param<P, G>> on_host, on_device;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const int group = static_cast<int>(i % 2);
      on_host.push_back({memkit::host_view(params[i].host), memkit::host_view(grads[i].host),
                         with_master ? memkit::host_view(masters[i].host) : memkit::tensor_view<float>{}, group});
      on_device.push_back({params[i].device.view(), grads[i].device.view(),
                           with_master ? masters[i].device.view() : memkit::tensor_view<float>{}, group});
    }
    host_state.step(memkit::host, on_host, groups);
    device_state.step(gpu, on_device, groups);
  }
  gpu.synchronize();
  int differing = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    differing += !params[i].same();
    if (with_master) differing += !masters[i].same();
  }
  CHECK(differing == 0);
  const memkit::optim::adam_control host_control = host_state.control(memkit::host), device_control = device_state.control(gpu);
  CHECK(device_control.step == host_control.step);
  CHECK(device_control.skipped_steps == host_control.skipped_steps);
  CHECK(device_control.first_nonfinite_chunk == host_control.first_nonfinite_chunk);
  CHECK(std::bit_cast<std::uint64_t>(device_control.grad_norm) == std::bit_cast<std::uint64_t>(host_control.grad_norm));
  CHECK(std::bit_cast<std::uint32_t>(device_control.loss_scale) == std::bit_cast<std::uint32_t>(host_control.loss_scale));
  CHECK(device_control.good_steps == host_control.good_steps);
  CHECK(std::bit_cast<std::uint32_t>(device_control.grad_multiplier) ==
        std::bit_cast<std::uint32_t>(host_control.grad_multiplier));
  CHECK(device_control.applied == host_control.applied);
  int differing_moments = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::vector<float> host_m, host_v, device_m, device_v;
    host_state.read_moments(memkit::host, i, host_m, host_v);
    device_state.read_moments(gpu, i, device_m, device_v);
    differing_moments += !adam_test::same_bits(host_m, device_m) + !adam_test::same_bits(host_v, device_v);
  }
  CHECK(differing_moments == 0);
  // The saved images, not the raw arenas: the gradient-norm scratch holds the device's per-group step terms after
  // a CUDA step and the chunk sums after a host step, which no later step reads.
  const std::string host_image = adam_test::saved_image(memkit::host, host_state),
                    device_image = adam_test::saved_image(gpu, device_state);
  const auto mismatch = std::mismatch(host_image.begin(), host_image.end(), device_image.begin(), device_image.end());
  CAPTURE(host_image.size());
  CAPTURE(mismatch.first - host_image.begin());  // the first differing byte of the saved images, if any
  CHECK(device_image == host_image);
  CHECK(device_state.report(gpu).step == 3);
}

}  // namespace

MEMKIT_GPU_TEST_CASE("gpu: adam host and CUDA steps agree bit for bit, every state flavour and parameter type") {
  memkit::device_resource device;
  check_host_device_agreement<adam_state<float>, float, float>(device, device, false);
  check_host_device_agreement<adam_state<bf16>, bf16, bf16>(device, device, false, {.seed = 11});  // stochastic rounding
  check_host_device_agreement<adam_state<std::int8_t, 256>, float, fp16>(device, device, false,
                                                                        {.max_grad_norm = 0.5f});
  check_host_device_agreement<adam_state<std::int8_t, 2048>, bf16, bf16>(device, device, true);
  check_host_device_agreement<adam_state<memkit::optim::four_bit, 128>, fp16, float>(
      device, device, true, {.loss_scaling = {.enabled = true, .initial_scale = 4.0f}});
}

// #30: the prefetching update kernel (opt-in until this has passed on a GPU) gives the host's bits.
MEMKIT_GPU_TEST_CASE("gpu: the prefetching adam update kernel (device_prefetch_update = true) agrees bit for bit too") {
  memkit::device_resource device;
  check_host_device_agreement<adam_state<float>, float, float>(device, device, false, {.device_prefetch_update = true});
  check_host_device_agreement<adam_state<bf16>, bf16, bf16>(device, device, false,
                                                           {.seed = 11, .device_prefetch_update = true});
  check_host_device_agreement<adam_state<std::int8_t, 256>, float, fp16>(
      device, device, false, {.max_grad_norm = 0.5f, .device_prefetch_update = true});
  check_host_device_agreement<adam_state<memkit::optim::four_bit, 128>, bf16, bf16>(device, device, true,
                                                                                  {.device_prefetch_update = true});
  // The 4-bit register tables and constant-midpoint codes with fp32 parameters, and with 2048-element blocks (256
  // lanes per block: eight warps' shuffles and the cross-warp absmax).
  check_host_device_agreement<adam_state<memkit::optim::four_bit, 128>, float, float>(device, device, false,
                                                                                    {.device_prefetch_update = true});
  check_host_device_agreement<adam_state<memkit::optim::four_bit, 2048>, float, float>(device, device, false,
                                                                                     {.device_prefetch_update = true});
}

MEMKIT_GPU_TEST_CASE("gpu: adam state in managed (paged) memory and in pinned host memory steps on the device") {
  memkit::device_resource device;
  memkit::managed_resource managed;
  memkit::pinned_host_resource pinned;
  check_host_device_agreement<adam_state<std::int8_t>, float, float>(managed, device, false);
  check_host_device_agreement<adam_state<std::int8_t>, float, float>(pinned, device, false);
  // Release the managed state to the host, then prefetch it back: the next step still agrees.
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  const std::vector<std::int64_t> sizes{70000};
  adam_state<std::int8_t> state(gpu, managed, sizes);
  mirrored<float> p(device, normal(70000, 0.1f, 1)), g(device, normal(70000, 0.01f, 2));
  const std::vector<adam_group> groups{adam_group{}};
  const std::vector<adam_param<float, float>> params{{p.device.view(), g.device.view()}};
  state.step(gpu, params, groups);
  state.release(gpu);
  state.prefetch(gpu);
  state.step(gpu, params, groups);
  CHECK(state.report(gpu).step == 2);
}

MEMKIT_GPU_TEST_CASE("gpu: a NaN gradient on the device skips the step without touching parameters or state") {
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  const std::vector<std::int64_t> sizes{5000, 9000};
  adam_state<std::int8_t> state(gpu, device, sizes);
  mirrored<float> p0(device, normal(5000, 0.1f, 1)), p1(device, normal(9000, 0.1f, 2));
  auto bad = normal(9000, 0.01f, 4);
  mirrored<float> g0(device, normal(5000, 0.01f, 3)), g1(device, bad);
  const std::vector<adam_group> groups{adam_group{}};
  const std::vector<adam_param<float, float>> params{{p0.device.view(), g0.device.view()},
                                                     {p1.device.view(), g1.device.view()}};
  state.step(gpu, params, groups);
  const auto before = state_bytes(state);
  const auto p1_before = p1.device_copy();
  bad[1234] = std::numeric_limits<float>::quiet_NaN();
  MEMKIT_CUDA_CHECK(cudaMemcpy(g1.device.data(), bad.data(), bad.size() * sizeof(float), cudaMemcpyDefault));
  state.step(gpu, params, groups);
  const auto report = state.report(gpu);
  CHECK_FALSE(report.applied);
  CHECK(report.first_nonfinite_tensor == 1);
  CHECK(p1.device_copy() == p1_before);
  const std::size_t moments = adam_state<std::int8_t>::overhead_bytes(memkit::optim::detail::reduction_chunks(5000) +
                                                                        memkit::optim::detail::reduction_chunks(9000));
  const auto after = state_bytes(state);
  CHECK(std::equal(after.begin() + static_cast<std::ptrdiff_t>(moments), after.end(),
                   before.begin() + static_cast<std::ptrdiff_t>(moments)));
}

MEMKIT_GPU_TEST_CASE("gpu: adam refuses pageable host tensors on the CUDA executor and saves/loads device state") {
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  const std::vector<std::int64_t> sizes{5000};
  adam_state<std::int8_t> state(gpu, device, sizes);
  std::vector<float> p = normal(5000, 0.1f, 1), g = normal(5000, 0.01f, 2);
  const std::vector<adam_group> groups{adam_group{}};
  const auto before = state_bytes(state);
  CHECK_THROWS_WITH_AS(state.step(gpu, std::vector<adam_param<float, float>>{{memkit::host_view(p), memkit::host_view(g)}},
                                  groups),
                       doctest::Contains("is in host memory, which the cuda executor cannot access"), memkit::error);
  CHECK(state_bytes(state) == before);
  mirrored<float> pd(device, p), gd(device, g);
  state.step(gpu, std::vector<adam_param<float, float>>{{pd.device.view(), gd.device.view()}}, groups);
  std::stringstream image;
  state.save(gpu, image);
  adam_state<std::int8_t> restored(gpu, device, sizes);
  restored.load(gpu, image);
  CHECK(state_bytes(restored) == state_bytes(state));
}

namespace {
template <class S, class P, class G>
void check_offload_matches_host() {
  memkit::device_resource device;
  memkit::pinned_host_resource pinned;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  const std::vector<std::int64_t> sizes{3000, 70001, 8192};
  S host_state(memkit::host, memkit::default_host_resource(), sizes);
  S offloaded(memkit::host, pinned, sizes);  // CPU offload: the state lives in pinned host memory
  std::vector<std::vector<float>> host_masters;
  std::vector<std::vector<P>> host_params;
  std::vector<mirrored<P>> device_params;
  std::vector<mirrored<float>> masters;
  std::vector<memkit::buffer<G>> grad_staging;
  std::vector<memkit::buffer<P>> param_staging;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto values = normal(static_cast<std::size_t>(sizes[i]), 0.1f, 77u + static_cast<std::uint32_t>(i));
    host_masters.push_back(values);
    host_params.push_back(convert<P>(values));
    device_params.emplace_back(device, convert<P>(values));
    masters.emplace_back(pinned, values);
    grad_staging.emplace_back(pinned, memkit::shape{sizes[i]});
    param_staging.emplace_back(pinned, memkit::shape{sizes[i]});
  }
  const std::vector<adam_group> groups{adam_group{}};
  for (int step = 0; step < 3; ++step) {
    std::vector<mirrored<G>> grads;
    std::vector<adam_param<P, G>> on_host;
    std::vector<memkit::optim::adam_offload_param<P, G>> on_device;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      grads.emplace_back(device, convert<G>(normal(static_cast<std::size_t>(sizes[i]), 0.01f, 500u * step + i)));
      on_host.push_back({memkit::host_view(host_params[i]), memkit::host_view(grads[i].host),
                         std::is_same_v<P, float> ? memkit::tensor_view<float>{} : memkit::host_view(host_masters[i])});
      on_device.push_back({device_params[i].device.view(), grads[i].device.view(), masters[i].device.view(),
                           grad_staging[i].view(), param_staging[i].view()});
    }
    host_state.step(memkit::host, on_host, groups);
    offloaded.offload_step(gpu, on_device, groups);
    gpu.synchronize();  // the test reuses the gradient buffers' memory next step
  }
  int differing = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto device_copy = device_params[i].device_copy();
    differing += std::memcmp(device_copy.data(), host_params[i].data(), device_copy.size() * sizeof(P)) != 0;
    if (!std::is_same_v<P, float>)
      differing += std::memcmp(masters[i].device.data(), host_masters[i].data(), host_masters[i].size() * 4) != 0;
  }
  CHECK(differing == 0);
  const auto a = host_state.arena_view(), b = offloaded.arena_view();
  CHECK(std::memcmp(a.data(), b.data(), a.size()) == 0);
}
}  // namespace

MEMKIT_GPU_TEST_CASE("gpu: CPU-offloaded steps (state and master in pinned memory) equal the host step bit for bit") {
  check_offload_matches_host<adam_state<std::int8_t>, bf16, bf16>();
  check_offload_matches_host<adam_state<float>, float, float>();
  check_offload_matches_host<adam_state<memkit::optim::four_bit>, fp16, fp16>();
}

MEMKIT_GPU_TEST_CASE("gpu: CPU offload refuses pageable staging buffers and device-resident state") {
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  const std::vector<std::int64_t> sizes{5000};
  adam_state<std::int8_t> on_device(gpu, device, sizes);
  mirrored<bf16> p(device, convert<bf16>(normal(5000, 0.1f, 1))), g(device, convert<bf16>(normal(5000, 0.01f, 2)));
  std::vector<float> master(5000);
  std::vector<bf16> grad_staging(5000), param_staging(5000);
  const std::vector<memkit::optim::adam_offload_param<bf16, bf16>> params{
      {p.device.view(), g.device.view(), memkit::host_view(master), memkit::host_view(grad_staging),
       memkit::host_view(param_staging)}};
  const std::vector<adam_group> groups{adam_group{}};
  CHECK_THROWS_WITH_AS(on_device.offload_step(gpu, params, groups), doctest::Contains("CPU offload keeps it in host memory"),
                       memkit::error);
  adam_state<std::int8_t> on_host(memkit::host, memkit::default_host_resource(), sizes);
  CHECK_THROWS_WITH_AS(on_host.offload_step(gpu, params, groups), doctest::Contains("must be pinned_host"), memkit::error);
}

// Runs without a device: the host step, compiled by nvcc's host pass (where MEMKIT_HAS_CUDA is 1),
// still matches an independent double-precision AdamW.
TEST_CASE("cuda build: the host step compiled under nvcc matches a double-precision AdamW") {
  std::vector<float> p = normal(6000, 0.1f, 8);
  std::vector<double> ref_p(p.begin(), p.end()), ref_m(p.size(), 0.0), ref_v(p.size(), 0.0);
  adam_state<float> state(memkit::host, memkit::default_host_resource(), std::vector<std::int64_t>{6000});
  const adam_group group{.lr = 2e-3f, .weight_decay = 0.05f};
  for (int t = 1; t <= 10; ++t) {
    const auto g = normal(6000, 0.01f, 90u + t);
    state.step(memkit::host, std::vector<adam_param<float, float>>{{memkit::host_view(p), memkit::host_view(g)}},
               std::vector<adam_group>{group});
    const double b1 = group.beta1, b2 = group.beta2;
    for (std::size_t i = 0; i < p.size(); ++i) {
      ref_p[i] *= 1.0 - double(group.lr) * group.weight_decay;
      ref_m[i] = b1 * ref_m[i] + (1 - b1) * g[i];
      ref_v[i] = b2 * ref_v[i] + (1 - b2) * double(g[i]) * g[i];
      ref_p[i] -= group.lr / (1 - std::pow(b1, t)) * ref_m[i] /
                  (std::sqrt(ref_v[i]) / std::sqrt(1 - std::pow(b2, t)) + group.eps);
    }
  }
  int mismatches = 0;
  for (std::size_t i = 0; i < p.size(); ++i) mismatches += std::abs(p[i] - ref_p[i]) > 1e-6 + 1e-5 * std::abs(ref_p[i]);
  CHECK(mismatches == 0);
}

MEMKIT_GPU_TEST_CASE("gpu: accumulate_gradient on the device equals the host bit for bit") {
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  for (const std::size_t n : {std::size_t{1}, std::size_t{70001}}) {  // one CTA, and several
    mirrored<bf16> sum(device, std::vector<bf16>(n));
    for (std::uint32_t k = 0; k < 3; ++k) {
      const mirrored<float> micro(device, normal(n, 0.01f, 700 + k));
      memkit::optim::accumulate_gradient(memkit::host, memkit::host_view(sum.host), memkit::host_view(micro.host), k == 0);
      memkit::optim::accumulate_gradient(gpu, sum.device.view(), micro.device.view(), k == 0);
    }
    gpu.synchronize();
    CHECK(sum.same());
  }
}
