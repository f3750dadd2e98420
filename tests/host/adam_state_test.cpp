// adam_state on the host: the AdamW arithmetic, parameter types, memory accounting, the non-finite
// policy, loss scaling, clipping, bad input, gradient accumulation and save/load.
#include <doctest/doctest.h>
#include <memkit/memory/tracking.hpp>
#include <memkit/optim/adam_state.hpp>
#include <memkit/optim/grad_accumulation.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "host/adam_support.hpp"

using memkit::optim::adam_group;
using memkit::optim::adam_options;
using memkit::optim::adam_param;
using memkit::optim::adam_state;
using memkit::bf16;
using memkit::fp16;
using memkit::optim::four_bit;
using memkit::host;
using memkit::host_view;

namespace {

using int8_2048_state = adam_state<std::int8_t, 2048>;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

template <class S>
S make_state(const std::vector<std::int64_t>& sizes, adam_options options = {}) {
  return S(host, memkit::default_host_resource(), sizes, options);
}

// Bytes of the state that hold moments and scales (after the control block and norm scratch).
template <class S>
std::vector<std::byte> moment_bytes(const S& state, const std::vector<std::int64_t>& sizes) {
  std::int64_t chunks = 0;
  for (std::int64_t n : sizes) chunks += memkit::optim::detail::reduction_chunks(n);
  const auto all = adam_test::snapshot(state);
  return std::vector<std::byte>(all.begin() + static_cast<std::ptrdiff_t>(S::overhead_bytes(chunks)), all.end());
}

// Two tensors (one below, one above the quantization threshold) with float params and grads.
struct two_tensors {
  std::vector<std::int64_t> sizes{1000, 6000};
  std::vector<float> p0 = adam_test::normal(1000, 0.1f, 1), p1 = adam_test::normal(6000, 0.1f, 2);
  std::vector<float> g0 = adam_test::normal(1000, 0.01f, 3), g1 = adam_test::normal(6000, 0.01f, 4);
  std::vector<adam_param<float, float>> params() {
    return {{host_view(p0), host_view(g0), {}, 0}, {host_view(p1), host_view(g1), {}, 0}};
  }
};

}  // namespace

TEST_CASE("adam: fp32 state matches a double-precision AdamW, per group, with weight decay") {
  std::vector<float> pa = adam_test::normal(3000, 0.1f, 10), pb = adam_test::normal(5000, 0.1f, 11);
  adam_test::reference_adamw ref_a(pa), ref_b(pb);
  const std::vector<adam_group> groups{{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f},
                                       {.lr = 3e-3f, .beta1 = 0.8f, .beta2 = 0.99f, .eps = 1e-6f, .weight_decay = 0.1f}};
  auto state = make_state<adam_state<float>>({3000, 5000});
  for (int step = 0; step < 25; ++step) {
    auto ga = adam_test::normal(3000, 0.01f, 100 + step), gb = adam_test::normal(5000, 0.01f, 200 + step);
    const std::vector<adam_param<float, float>> params{{host_view(pa), host_view(ga), {}, 1},
                                                       {host_view(pb), host_view(gb), {}, 0}};
    state.step(host, params, groups);
    ref_a.step(ga, groups[1]);
    ref_b.step(gb, groups[0]);
  }
  int mismatches = 0;
  for (std::size_t i = 0; i < pa.size(); ++i)
    if (std::abs(pa[i] - ref_a.p[i]) > 1e-6 + 1e-5 * std::abs(ref_a.p[i])) ++mismatches;
  for (std::size_t i = 0; i < pb.size(); ++i)
    if (std::abs(pb[i] - ref_b.p[i]) > 1e-6 + 1e-5 * std::abs(ref_b.p[i])) ++mismatches;
  CHECK(mismatches == 0);
  std::vector<float> m, v;
  state.read_moments(host, 0, m, v);
  for (std::size_t i = 0; i < m.size(); i += 97) {
    CHECK(m[i] == doctest::Approx(ref_a.m[i]).epsilon(1e-5));
    CHECK(v[i] == doctest::Approx(ref_a.v[i]).epsilon(1e-5));
  }
  CHECK(state.report(host).step == 25);
}

TEST_CASE_TEMPLATE("adam: bytes_required is exactly what the tracking resource sees", S, adam_state<float>,
                   adam_state<bf16>, adam_state<std::int8_t>, int8_2048_state, adam_state<four_bit>) {
  static_assert(S::bytes_required(std::int64_t{1} << 20) > 0, "bytes_required must be usable in constant expressions");
  const std::vector<std::vector<std::int64_t>> cases{{1}, {33, 4095}, {4096}, {5000, 70001, 3}, {1 << 20}};
  for (const auto& sizes : cases) {
    memkit::tracking_resource tracker(memkit::default_host_resource(), "adam");
    {
      S state(host, tracker.category(memkit::memory_category::optimizer_state), sizes);
      CHECK(tracker.stats(memkit::memory_category::optimizer_state).current_bytes ==
            S::bytes_required(std::span<const std::int64_t>(sizes)));
      CHECK(state.bytes() == S::bytes_required(std::span<const std::int64_t>(sizes)));
      if (sizes.size() == 1) CHECK(S::bytes_required(sizes[0]) == state.bytes());
      // The protocol's form: the same number, and nothing from a workspace.
      const typename S::arguments args{std::span<const std::int64_t>(sizes)};
      static_assert(memkit::operation_arguments<typename S::arguments>);
      CHECK(bytes_required(args) == state.bytes());
      CHECK(workspace_bytes(args) == 0);
      CHECK(saved_bytes(args) == 0);
    }
    CHECK(tracker.current_bytes() == 0);
  }
}

TEST_CASE("adam: quantized states cost what the paper says per parameter") {
  constexpr std::int64_t n = std::int64_t{1} << 24;
  // 8-bit: 2 bytes of codes + 2 fp32 absmax per block; 4-bit: 1 byte + 2 absmax per 128.
  // Plus half a 4 KiB page between m and v (2^24-element segments are whole pages: detail::stagger_after).
  constexpr std::size_t stagger = 2048;
  CHECK(adam_state<std::int8_t, 256>::tensor_bytes(n) == static_cast<std::size_t>(2 * n + 2 * 4 * (n / 256)) + stagger);
  CHECK(adam_state<std::int8_t, 2048>::tensor_bytes(n) == static_cast<std::size_t>(2 * n + 2 * 4 * (n / 2048)) + stagger);
  CHECK(adam_state<four_bit>::tensor_bytes(n) == static_cast<std::size_t>(n + 2 * 4 * (n / 128)) + stagger);
  CHECK(adam_state<float>::tensor_bytes(n) == static_cast<std::size_t>(8 * n) + stagger);
  CHECK(adam_state<bf16>::tensor_bytes(n) == static_cast<std::size_t>(4 * n) + stagger);
  // Below the threshold a quantized state keeps fp32 moments; the threshold is configurable.
  CHECK(adam_state<std::int8_t>::tensor_bytes(4095) == adam_state<float>::tensor_bytes(4095));
  CHECK(adam_state<std::int8_t>::tensor_bytes(4095, 1024) < adam_state<float>::tensor_bytes(4095));
}

TEST_CASE("adam: bf16 moments track fp32 moments closely") {
  two_tensors a, b;
  auto fp32 = make_state<adam_state<float>>(a.sizes);
  auto half = make_state<adam_state<bf16>>(b.sizes);
  const std::vector<adam_group> groups{adam_group{}};
  for (int step = 0; step < 20; ++step) {
    fp32.step(host, a.params(), groups);
    half.step(host, b.params(), groups);
  }
  double error = 0.0;
  for (std::size_t i = 0; i < a.p1.size(); ++i) error += std::abs(a.p1[i] - b.p1[i]);
  // 20 steps of lr 1e-3 move a parameter ~2e-2; bf16 keeps ~3 significant digits of each moment.
  CHECK(error / static_cast<double>(a.p1.size()) < 6e-5);
}

TEST_CASE("adam: bf16 and fp16 parameters with an fp32 master copy follow fp32 parameters bit for bit") {
  const std::vector<std::int64_t> sizes{5000};
  std::vector<float> reference = adam_test::normal(5000, 0.1f, 5);
  std::vector<float> master_b = reference, master_h = reference;
  auto param_b = adam_test::convert<bf16>(reference);
  auto param_h = adam_test::convert<fp16>(reference);
  auto s_ref = make_state<adam_state<std::int8_t>>(sizes);
  auto s_b = make_state<adam_state<std::int8_t>>(sizes);
  auto s_h = make_state<adam_state<std::int8_t>>(sizes);
  const std::vector<adam_group> groups{adam_group{}};
  for (int step = 0; step < 10; ++step) {
    const auto g = adam_test::normal(5000, 0.01f, 50 + step);
    const auto g_b = adam_test::convert<bf16>(g);
    const auto g_f = adam_test::to_floats(g_b);  // the same gradient values as fp32
    s_ref.step(host, std::vector<adam_param<float, float>>{{host_view(reference), host_view(g_f)}}, groups);
    s_b.step(host, std::vector<adam_param<bf16, bf16>>{{host_view(param_b), host_view(g_b), host_view(master_b)}}, groups);
    s_h.step(host, std::vector<adam_param<fp16, bf16>>{{host_view(param_h), host_view(g_b), host_view(master_h)}}, groups);
  }
  CHECK(adam_test::same_bits(reference, master_b));
  CHECK(adam_test::same_bits(reference, master_h));
  int wrong = 0;
  for (std::size_t i = 0; i < reference.size(); ++i) {
    wrong += param_b[i].bits != bf16(reference[i]).bits;
    wrong += param_h[i].bits != fp16(reference[i]).bits;
  }
  CHECK(wrong == 0);
}

TEST_CASE("adam: bf16 parameters updated in place with stochastic rounding are unbiased and reproducible") {
  // Updates of ~1e-4 on weights of 1.0 are far below bf16's half-ulp (2^-8): round-to-nearest never
  // moves them, stochastic rounding moves them by the right amount on average.
  constexpr std::int64_t n = 8192;
  const std::vector<std::int64_t> sizes{n};
  const std::vector<adam_group> groups{{.lr = 1e-4f, .weight_decay = 0.0f}};
  const std::vector<float> ones(n, 1.0f);
  const std::vector<bf16> gradient(n, bf16(1.0f));
  auto run = [&](bool stochastic, std::uint64_t seed) {
    std::vector<bf16> p(n, bf16(1.0f));
    auto state = make_state<adam_state<float>>(sizes, {.stochastic_rounding = stochastic, .seed = seed});
    for (int step = 0; step < 100; ++step)
      state.step(host, std::vector<adam_param<bf16, bf16>>{{host_view(p), host_view(gradient)}}, groups);
    return p;
  };
  std::vector<float> fp32 = ones;
  {
    auto state = make_state<adam_state<float>>(sizes);
    const std::vector<float> g(n, 1.0f);
    for (int step = 0; step < 100; ++step)
      state.step(host, std::vector<adam_param<float, float>>{{host_view(fp32), host_view(g)}}, groups);
  }
  const auto nearest = run(false, 0);
  for (const bf16& x : nearest) REQUIRE(float(x) == 1.0f);
  const auto sr = run(true, 7);
  double mean = 0.0;
  for (const bf16& x : sr) mean += float(x);
  mean /= n;
  CHECK(fp32[0] == doctest::Approx(0.99).epsilon(1e-4));
  CHECK(std::abs(mean - fp32[0]) < 2e-4);  // ~3 standard errors of an 8192-sample mean of 2^-8-spaced values
  const auto again = run(true, 7), other = run(true, 8);
  CHECK(adam_test::same_bits(sr, again));
  CHECK_FALSE(adam_test::same_bits(sr, other));
}

TEST_CASE_TEMPLATE("adam: a NaN or Inf gradient skips the step and leaves parameters and moments bit-identical", S,
                   adam_state<float>, adam_state<bf16>, adam_state<std::int8_t>, adam_state<four_bit>) {
  two_tensors t;
  auto state = make_state<S>(t.sizes);
  const std::vector<adam_group> groups{adam_group{}};
  for (int step = 0; step < 3; ++step) state.step(host, t.params(), groups);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    const auto p0 = t.p0, p1 = t.p1;
    const auto moments = moment_bytes(state, t.sizes);
    const float saved = t.g1[4321];
    t.g1[4321] = bad;
    state.step(host, t.params(), groups);
    t.g1[4321] = saved;
    CHECK(adam_test::same_bits(p0, t.p0));
    CHECK(adam_test::same_bits(p1, t.p1));
    CHECK(moment_bytes(state, t.sizes) == moments);
    const auto report = state.report(host);
    CHECK_FALSE(report.applied);
    CHECK(report.step == 3);
    CHECK(report.first_nonfinite_tensor == 1);
    CHECK(contains(report.to_string(), "tensor 1 has a non-finite gradient"));
    CHECK(contains(report.to_string(), "unchanged"));
  }
  CHECK(state.report(host).skipped_steps == 3);
  state.step(host, t.params(), groups);  // a finite gradient applies again
  CHECK(state.report(host).applied);
  CHECK(state.report(host).step == 4);
}

TEST_CASE_TEMPLATE("adam: a finite gradient too large for fp32 moments skips the step, unless clipping tames it", S,
                   adam_state<float>, adam_state<std::int8_t>, adam_state<four_bit>) {
  two_tensors t;
  auto state = make_state<S>(t.sizes);
  const std::vector<adam_group> groups{adam_group{}};
  state.step(host, t.params(), groups);
  const auto p0 = t.p0, p1 = t.p1;
  const auto moments = moment_bytes(state, t.sizes);
  const float saved = t.g1[10];
  t.g1[10] = 2e19f;  // finite, but g * g = 4e38 overflows fp32 (tensor 1 is quantized)
  state.step(host, t.params(), groups);
  CHECK(adam_test::same_bits(p0, t.p0));
  CHECK(adam_test::same_bits(p1, t.p1));
  CHECK(moment_bytes(state, t.sizes) == moments);
  const auto report = state.report(host);
  CHECK_FALSE(report.applied);
  CHECK(report.step == 1);
  CHECK(report.skipped_steps == 1);
  CHECK(report.first_nonfinite_tensor == -1);
  CHECK(contains(report.to_string(), "too large for fp32 moments"));
  // Just below the bound the step applies, and the moments stay finite.
  t.g1[10] = 1.2e19f;
  state.step(host, t.params(), groups);
  CHECK(state.report(host).applied);
  std::vector<float> m, v;
  state.read_moments(host, 1, m, v);
  CHECK(std::isfinite(v[10]));
  // With clipping the same huge gradient is scaled down first, and the step applies.
  t.g1[10] = 2e19f;
  adam_options clipped;
  clipped.max_grad_norm = 1.0f;
  auto clipping = make_state<S>(t.sizes, clipped);
  clipping.step(host, t.params(), groups);
  CHECK(clipping.report(host).applied);
  t.g1[10] = saved;
}

TEST_CASE("adam: dynamic loss scaling unscales fp16 gradients exactly, backs off on overflow and grows back") {
  const std::vector<std::int64_t> sizes{6000};
  const adam_options scaled{.loss_scaling = {.enabled = true, .initial_scale = 1024.0f, .growth_interval = 3}};
  auto state = make_state<adam_state<std::int8_t>>(sizes, scaled);
  auto reference = make_state<adam_state<std::int8_t>>(sizes);
  std::vector<float> p = adam_test::normal(6000, 0.1f, 9), p_ref = p;
  const std::vector<adam_group> groups{adam_group{}};
  CHECK(state.loss_scale(host) == 1024.0f);
  for (int step = 0; step < 3; ++step) {
    const float scale = state.loss_scale(host);
    const auto g = adam_test::normal(6000, 0.01f, 70 + step);
    std::vector<fp16> g16;
    std::vector<float> g_ref;
    for (float x : g) {
      g16.push_back(fp16(x * scale));
      g_ref.push_back(float(g16.back()) / scale);  // exact: the scale is a power of two
    }
    state.step(host, std::vector<adam_param<float, fp16>>{{host_view(p), host_view(g16)}}, groups);
    reference.step(host, std::vector<adam_param<float, float>>{{host_view(p_ref), host_view(g_ref)}}, groups);
  }
  CHECK(adam_test::same_bits(p, p_ref));
  CHECK(state.loss_scale(host) == 2048.0f);  // three good steps in a row: the scale doubled
  std::vector<fp16> overflow(6000, fp16(1.0f));
  overflow[17] = fp16(1e6f);  // beyond fp16's range: Inf
  const auto before = p;
  state.step(host, std::vector<adam_param<float, fp16>>{{host_view(p), host_view(overflow)}}, groups);
  CHECK(adam_test::same_bits(before, p));
  CHECK(state.loss_scale(host) == 1024.0f);
  CHECK(state.report(host).skipped_steps == 1);

  memkit::optim::dynamic_loss_scaler scaler({.enabled = true, .initial_scale = 8.0f, .growth_interval = 2});
  CHECK_FALSE(scaler.update(false));
  CHECK(scaler.scale() == 4.0f);
  CHECK(scaler.update(true));
  CHECK(scaler.update(true));
  CHECK(scaler.scale() == 8.0f);
}

TEST_CASE("adam: global-norm clipping scales every tensor by max_norm / norm, and only above max_norm") {
  two_tensors t, u, w;
  double sum = 0.0;
  for (float g : t.g0) sum += double(g) * g;
  for (float g : t.g1) sum += double(g) * g;
  const double norm = std::sqrt(sum);
  auto clipped = make_state<adam_state<float>>(t.sizes, {.max_grad_norm = static_cast<float>(norm / 4)});
  auto loose = make_state<adam_state<float>>(t.sizes, {.max_grad_norm = static_cast<float>(norm * 2)});
  auto plain = make_state<adam_state<float>>(t.sizes);
  const std::vector<adam_group> groups{{.weight_decay = 0.0f}};
  clipped.step(host, t.params(), groups);
  CHECK(clipped.report(host).grad_norm == doctest::Approx(norm).epsilon(1e-12));
  loose.step(host, u.params(), groups);
  plain.step(host, w.params(), groups);
  CHECK(adam_test::same_bits(u.p1, w.p1));  // below the threshold nothing changes
  // Adam's first step is scale-invariant in g up to eps: check the moments instead.
  std::vector<float> m_clip, v_clip, m_plain, v_plain;
  clipped.read_moments(host, 1, m_clip, v_clip);
  plain.read_moments(host, 1, m_plain, v_plain);
  for (std::size_t i = 0; i < m_clip.size(); i += 101) CHECK(m_clip[i] == doctest::Approx(m_plain[i] / 4).epsilon(1e-5));
  clipped.set_max_grad_norm(0.0f);
  CHECK_THROWS_AS(clipped.set_max_grad_norm(-1.0f), memkit::error);
}

TEST_CASE("adam: bad input is refused with a clear message and leaves the state untouched") {
  two_tensors t;
  auto state = make_state<adam_state<std::int8_t>>(t.sizes);
  const std::vector<adam_group> groups{adam_group{}};
  state.step(host, t.params(), groups);
  const auto bytes = adam_test::snapshot(state);
  const auto p1 = t.p1;
  auto refused = [&](const auto& params, const std::vector<adam_group>& gs, const std::string& expected) {
    try {
      state.step(host, params, gs);
      FAIL("no error; expected: " << expected);
    } catch (const memkit::error& e) {
      CHECK_MESSAGE(contains(e.what(), expected), std::string(e.what()));
    }
    CHECK(adam_test::snapshot(state) == bytes);
    CHECK(adam_test::same_bits(p1, t.p1));
  };
  auto params = t.params();
  refused(std::vector<adam_param<float, float>>{params[0]}, groups, "got 1 parameter tensors, the state was made for 2");
  std::vector<float> short_p(5999), short_g(5999);
  refused(std::vector<adam_param<float, float>>{params[0], {host_view(short_p), host_view(short_g)}}, groups,
          "tensor 1 has 5999 elements");
  auto wrong_grad = params;
  wrong_grad[1].grad = wrong_grad[1].grad.reshaped(memkit::shape{60, 100});
  refused(wrong_grad, groups, "shape [6000] but `tensor 1 grad` has shape [60, 100]");
  auto wrong_group = params;
  wrong_group[0].group = 3;
  refused(wrong_group, groups, "tensor 0 names group 3 but only 1 groups were given");
  refused(params, {{.beta1 = 1.0f}}, "beta1 must be in [0, 1)");
  refused(params, {{.lr = std::numeric_limits<float>::quiet_NaN()}}, "lr must be finite");
  refused(params, {{.eps = -1e-9f}}, "eps must be finite and >= 0, got -1e-09");  // not "-0.000000"
  refused(params, {}, "no parameter groups");
  auto device_grad = params;
  device_grad[1].grad = memkit::tensor_view<const float>(t.g1.data(), memkit::shape{6000}, memkit::memory_kind::device);
  refused(device_grad, groups, "`tensor 1 grad` is in device memory, which the host executor cannot access");
  std::vector<float> master(6000);
  auto fp32_master = params;
  fp32_master[1].master = host_view(master);
  refused(fp32_master, groups, "fp32 parameters, which are their own master copy");
  try {
    state.step(host, t.params(), groups, 0.0f);
    FAIL("gradient_scale 0 accepted");
  } catch (const memkit::error& e) {
    CHECK(contains(e.what(), "gradient_scale must be finite and > 0"));
  }
  CHECK_THROWS_WITH_AS(make_state<adam_state<float>>({10, 0}), doctest::Contains("tensor 1 has 0 elements"), memkit::error);
  CHECK_THROWS_WITH_AS(make_state<adam_state<float>>({10}, {.loss_scaling = {.enabled = true, .backoff_factor = 1.5f}}),
                       doctest::Contains("backoff_factor must be in (0, 1), got 1.5"), memkit::error);
}

TEST_CASE("adam: accumulated micro-batches scaled once by the step equal a step on the mean gradient") {
  const std::vector<std::int64_t> sizes{5000};
  std::vector<float> p = adam_test::normal(5000, 0.1f, 3), p_ref = p;
  std::vector<float> sum(5000), mean(5000);
  auto state = make_state<adam_state<std::int8_t>>(sizes);
  auto reference = make_state<adam_state<std::int8_t>>(sizes);
  const std::vector<adam_group> groups{adam_group{}};
  memkit::optim::gradient_accumulation accumulation;
  std::vector<std::vector<float>> micro;
  for (int k = 0; k < 4; ++k) micro.push_back(adam_test::normal(5000, 0.01f, 400 + k));
  for (const auto& g : micro) {
    memkit::optim::accumulate_gradient(host, host_view(sum), memkit::tensor_view<const float>(host_view(g)), accumulation.first());
    accumulation.add();
  }
  for (std::size_t i = 0; i < mean.size(); ++i) mean[i] = (((micro[0][i] + micro[1][i]) + micro[2][i]) + micro[3][i]) * 0.25f;
  CHECK(accumulation.step_scale() == 0.25f);
  state.step(host, std::vector<adam_param<float, float>>{{host_view(p), host_view(sum)}}, groups, accumulation.step_scale());
  reference.step(host, std::vector<adam_param<float, float>>{{host_view(p_ref), host_view(mean)}}, groups);
  CHECK(adam_test::same_bits(p, p_ref));
  accumulation.reset();
  CHECK_THROWS_AS((void)accumulation.step_scale(), memkit::error);
}

TEST_CASE_TEMPLATE("adam: save and load round-trip the whole state bit for bit", S, adam_state<float>, adam_state<bf16>,
                   adam_state<std::int8_t>, int8_2048_state, adam_state<four_bit>) {
  two_tensors t;
  auto state = make_state<S>(t.sizes, {.loss_scaling = {.enabled = true, .initial_scale = 256.0f}});
  const std::vector<adam_group> groups{adam_group{}};
  for (int step = 0; step < 4; ++step) state.step(host, t.params(), groups);
  std::stringstream image;
  state.save(host, image);
  auto restored = make_state<S>(t.sizes, {.loss_scaling = {.enabled = true, .initial_scale = 256.0f}});
  restored.load(host, image);
  CHECK(adam_test::snapshot(restored) == adam_test::snapshot(state));
  CHECK(restored.report(host).step == 4);
  // The gradient-norm scratch is saved as zeros (it held this step's chunk sums), so a state saves the same bytes
  // whether the host or a device stepped it.
  const auto [scratch_begin, scratch_end] = state.scratch_range();
  REQUIRE(scratch_end > scratch_begin);
  const auto stepped = state.arena_view(), loaded = restored.arena_view();
  CHECK_FALSE(std::all_of(stepped.data() + scratch_begin, stepped.data() + scratch_end, [](std::byte b) { return b == std::byte{0}; }));
  CHECK(std::all_of(loaded.data() + scratch_begin, loaded.data() + scratch_end, [](std::byte b) { return b == std::byte{0}; }));
  two_tensors t2 = t;
  state.step(host, t.params(), groups);
  restored.step(host, t2.params(), groups);
  CHECK(adam_test::same_bits(t.p1, t2.p1));
  CHECK(adam_test::snapshot(restored) == adam_test::snapshot(state));
}

// m and v of a large tensor never lie a multiple of 4 KiB apart (4K aliasing between the update's loads and
// stores), whatever the tensor's size; the saved image leaves that padding out, so it keeps format 1's layout
// (the control block and norm scratch, then per tensor m's segment directly followed by v's and the scales).
TEST_CASE_TEMPLATE("adam: m and v of a large tensor are half a page apart modulo 4 KiB; images keep the unpadded layout", S,
                   adam_state<float>, adam_state<bf16>, adam_state<std::int8_t>, adam_state<four_bit>) {
  const std::vector<std::int64_t> sizes{1 << 16, 1000, (1 << 17) + 48, 1 << 20};
  std::vector<std::vector<float>> p, g;
  std::vector<adam_param<float, float>> params;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    p.push_back(adam_test::normal(static_cast<std::size_t>(sizes[i]), 0.1f, static_cast<std::uint32_t>(20 + i)));
    g.push_back(adam_test::normal(static_cast<std::size_t>(sizes[i]), 0.01f, static_cast<std::uint32_t>(30 + i)));
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) params.push_back({host_view(p[i]), host_view(g[i]), {}, 0});
  auto state = make_state<S>(sizes);
  const std::vector<adam_group> groups{adam_group{}};
  for (int step = 0; step < 2; ++step) state.step(host, params, groups);

  const auto* base = state.arena_view().data();
  std::vector<std::byte> unpadded = adam_test::snapshot(state);
  unpadded.resize(S::overhead_bytes([&] {
    std::int64_t chunks = 0;
    for (std::int64_t n : sizes) chunks += memkit::optim::detail::reduction_chunks(n);
    return chunks;
  }()));
  std::size_t padding = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto s = state.tensor_state(i);
    const auto* m = reinterpret_cast<const std::byte*>(s.quantized ? static_cast<const void*>(s.m_codes.data()) : s.m.data());
    const auto* v = reinterpret_cast<const std::byte*>(s.quantized ? static_cast<const void*>(s.v_codes.data()) : s.v.data());
    const std::size_t m_bytes = s.quantized ? s.m_codes.size() : s.m.size() * sizeof(*s.m.data());
    const auto distance = static_cast<std::size_t>(v - m);
    INFO("tensor " << i << " of " << sizes[i] << " elements, m segment " << m_bytes << " bytes");
    if (m_bytes >= memkit::optim::detail::adam_stagger_min_bytes) CHECK(distance % 4096 == 2048);
    else CHECK(distance == memkit::optim::detail::align_segment(m_bytes));
    padding += distance - memkit::optim::detail::align_segment(m_bytes);
    // The unpadded image of this tensor: m's segment, then everything from v to the next tensor.
    const std::byte* end = i + 1 < sizes.size()
                               ? reinterpret_cast<const std::byte*>(state.tensor_state(i + 1).quantized
                                                                        ? static_cast<const void*>(state.tensor_state(i + 1).m_codes.data())
                                                                        : state.tensor_state(i + 1).m.data())
                               : base + state.bytes();
    unpadded.insert(unpadded.end(), m, m + memkit::optim::detail::align_segment(m_bytes));
    unpadded.insert(unpadded.end(), v, end);
  }
  CHECK(padding > 0);
  std::stringstream image;
  state.save(host, image);
  const std::string text = image.str();
  // The payload sits just before the trailing 8-byte checksum.
  REQUIRE(text.size() > unpadded.size() + 8);
  CHECK(std::memcmp(text.data() + text.size() - 8 - unpadded.size(), unpadded.data(), unpadded.size()) == 0);
  auto restored = make_state<S>(sizes);
  restored.load(host, image);
  CHECK(adam_test::snapshot(restored) == adam_test::snapshot(state));
}

// The host norm pass sums whole chunks two at a time (two read streams); every chunk must still come out as the
// canonical order gives it (detail::lane_sum_of_squares per lane, then tree_sum), which the CUDA kernel follows.
TEST_CASE("adam: the gradient norm has the bits of the canonical chunk/lane/tree order, on 1 and 2 threads") {
  const std::vector<std::int64_t> sizes{300000, 4096 * 5, 77, 4096 * 4 + 1};
  std::vector<std::vector<float>> p, g;
  std::vector<adam_param<float, float>> params;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    p.push_back(adam_test::normal(static_cast<std::size_t>(sizes[i]), 0.1f, static_cast<std::uint32_t>(40 + i)));
    g.push_back(adam_test::normal(static_cast<std::size_t>(sizes[i]), 0.3f, static_cast<std::uint32_t>(50 + i)));
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) params.push_back({host_view(p[i]), host_view(g[i]), {}, 0});
  double total = 0.0;
  for (const auto& grad : g) {
    const auto n = static_cast<std::int64_t>(grad.size());
    for (std::int64_t begin = 0; begin < n; begin += memkit::optim::detail::reduction_chunk) {
      const std::int64_t count = std::min(memkit::optim::detail::reduction_chunk, n - begin);
      double lanes[memkit::optim::detail::reduction_lanes];
      for (int lane = 0; lane < memkit::optim::detail::reduction_lanes; ++lane)
        lanes[lane] = memkit::optim::detail::lane_sum_of_squares(grad.data() + begin, count, lane);
      total = memkit::detail::dadd_rn(total, memkit::optim::detail::tree_sum(lanes));
    }
  }
  const double expected = memkit::detail::dmul_rn(memkit::detail::dsqrt_rn(total), 1.0);
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    auto state = make_state<adam_state<float>>(sizes, {.host_threads = threads});
    state.step(host, params, std::vector<adam_group>{adam_group{}});
    const double norm = state.report(host).grad_norm;
    CHECK(std::memcmp(&norm, &expected, sizeof norm) == 0);
    CHECK(norm > 0.0);
  }
}

TEST_CASE("adam: loading an image of another format, block size, map, version or shape fails and changes nothing") {
  two_tensors t;
  const std::vector<adam_group> groups{adam_group{}};
  auto saved = [&](auto& state) {
    for (int step = 0; step < 2; ++step) state.step(host, t.params(), groups);
    std::stringstream image;
    state.save(host, image);
    return image.str();
  };
  auto s256 = make_state<adam_state<std::int8_t, 256>>(t.sizes);
  auto s2048 = make_state<adam_state<std::int8_t, 2048>>(t.sizes);
  auto s4 = make_state<adam_state<four_bit>>(t.sizes);
  const std::string image256 = saved(s256), image2048 = saved(s2048), image4 = saved(s4);
  auto target = make_state<adam_state<std::int8_t, 256>>(t.sizes);
  const auto before = adam_test::snapshot(target);
  auto refused = [&](const std::string& image, const std::string& expected) {
    std::stringstream in(image);
    try {
      target.load(host, in);
      FAIL("loaded; expected: " << expected);
    } catch (const memkit::error& e) {
      CHECK_MESSAGE(contains(e.what(), expected), std::string(e.what()));
    }
    CHECK(adam_test::snapshot(target) == before);
  };
  refused(image2048, "saved with block size 2048, this state uses 256");
  refused(image4, "image holds 'memkit.adam_state.int4.dynamic3-m.linear-v' state");
  // The header layout: magic string (4 + 17 bytes), version (4), name (4 + length), bits (4), block (4),
  // map fingerprint (8), threshold (8), tensor count (8), sizes, length (8), state, checksum (8).
  const std::size_t version_at = 4 + 17;
  const std::size_t name_length = adam_state<std::int8_t>::format_name().size();
  const std::size_t fingerprint_at = version_at + 4 + 4 + name_length + 4 + 4;
  std::string bad = image256;
  bad[version_at] = 2;
  refused(bad, "format version 2, this build reads version 1");
  bad = image256;
  bad[fingerprint_at] ^= 1;
  refused(bad, "quantization maps differ");
  bad = image256;
  bad[bad.size() - 20] ^= 0x40;
  refused(bad, "checksum does not match");
  refused(image256.substr(0, image256.size() / 2), "truncated");
  refused("not an image at all", "not a memkit adam_state image");
  auto other_shape = make_state<adam_state<std::int8_t, 256>>({1000, 6001});
  std::stringstream in(image256);
  CHECK_THROWS_WITH_AS(other_shape.load(host, in), doctest::Contains("tensor 1 has 6000 elements in the image, 6001 here"),
                       memkit::error);
  auto other_threshold = make_state<adam_state<std::int8_t, 256>>(t.sizes, {.min_quantized_size = 512});
  std::stringstream in2(image256);
  CHECK_THROWS_WITH_AS(other_threshold.load(host, in2), doctest::Contains("min_quantized_size 4096"), memkit::error);
  std::stringstream good(image256);
  target.load(host, good);
  CHECK(adam_test::snapshot(target) == adam_test::snapshot(s256));
}

// The finalisation's chain adds without a test per sum and searches for the first non-finite one only once
// the total is non-finite; the total and the index must be what a test per sum gives, split into ranges at
// any point (the device adds one shared-memory tile at a time).
TEST_CASE("adam: the chunk-sum chain gives the total and the first non-finite chunk of a test per sum") {
  constexpr double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> sums(1000);
  for (std::size_t i = 0; i < sums.size(); ++i) sums[i] = 1e30 * static_cast<double>((i * 7919) % 1013) + 0.1 * static_cast<double>(i);
  auto reference = [](const std::vector<double>& s, double& total, std::int64_t& first_bad) {
    total = 0.0;
    first_bad = -1;
    for (std::size_t c = 0; c < s.size(); ++c) {
      if (first_bad < 0 && !std::isfinite(s[c])) first_bad = static_cast<std::int64_t>(c);
      total = memkit::detail::dadd_rn(total, s[c]);
    }
  };
  for (std::vector<std::size_t> bad : {std::vector<std::size_t>{}, {0}, {5}, {8}, {999}, {300, 17}, {511, 512}}) {
    for (double poison : {nan, inf}) {
      std::vector<double> s = sums;
      for (std::size_t b : bad) s[b] = poison;
      double expected_total;
      std::int64_t expected_bad;
      reference(s, expected_total, expected_bad);
      for (std::int64_t tile : {std::int64_t{1000}, std::int64_t{512}, std::int64_t{7}}) {
        CAPTURE(tile);
        double total = 0.0;
        std::int64_t first_bad = -1;
        for (std::int64_t first = 0; first < 1000; first += tile)
          memkit::optim::detail::add_chunk_sums(s.data() + first, std::min<std::int64_t>(tile, 1000 - first), first, total, first_bad);
        CHECK(first_bad == expected_bad);
        CHECK(std::memcmp(&total, &expected_total, sizeof total) == 0);
      }
    }
  }
}
