// lora_linear on the host: against a dense double-precision reference built from the merged weight, finite
// differences for every base format, exact memory predictions, dropout, merging, initialisation, bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "lora_support.hpp"

using namespace lora_test;
using memkit::activation_store;
using memkit::forward_context;
using memkit::memory_category;
using memkit::tracking_resource;

namespace {

template <class Base>
const char* base_name() {
  if constexpr (std::is_same_v<Base, float>) return "fp32";
  else if constexpr (std::is_same_v<Base, bf16>) return "bf16";
  else if constexpr (std::is_same_v<Base, fp16>) return "fp16";
  else return q::to_string(Base::quant_format);
}

// One forward and backward of a layer over `base` against reference_pass.
template <class Base, class T>
void check_against_reference(std::int64_t M, std::int64_t in, std::int64_t out, lora_options options,
                             forward_context ctx, bool with_bias, double tolerance) {
  CAPTURE(base_name<Base>());
  CAPTURE(sizeof(T));
  CAPTURE(M);
  CAPTURE(options.dropout);
  CAPTURE(ctx.training);
  base_weight<Base, T> base(in, out, with_bias, 11);
  lora_linear<Base, T> layer(base.ref(), base.bias_view(), options, memkit::default_host_resource(),
                             memkit::default_host_resource(), memkit::default_host_resource());
  randomize_b(layer, 12);
  const std::vector<T> x = memkit_test::convert<T>(memkit_test::uniform_values(M * in, 13));
  const std::vector<T> dy = memkit_test::convert<T>(memkit_test::uniform_values(M * out, 14));
  std::vector<T> y(static_cast<std::size_t>(M * out)), dx(static_cast<std::size_t>(M * in));
  activation_store store(memkit::default_host_resource());
  layer.forward(host, ctx, host_view(x.data(), {M, in}), host_view(y.data(), {M, out}), store);
  layer.backward(host, host_view(dy.data(), {M, out}), host_view(dx.data(), {M, in}), store);
  CHECK(store.empty());

  const reference ref = reference_pass(widened(x), dropout_mask(ctx, options.dropout, M * in),
                                       std::vector<double>(base.effective.begin(), base.effective.end()),
                                       widened(layer.lora_A()), widened(layer.lora_B()), widened(base.bias), widened(dy),
                                       M, in, out, options.rank, layer.scale());
  CHECK(worst_error(widened(y), ref.y, 1.0) <= tolerance);
  CHECK(worst_error(widened(dx), ref.dx, 1.0) <= tolerance);
  CHECK(worst_error(widened(layer.grad_A()), ref.dA, 1.0) <= tolerance);
  CHECK(worst_error(widened(layer.grad_B()), ref.dB, 1.0) <= tolerance);
  if (options.train_bias) CHECK(worst_error(widened(layer.grad_bias()), ref.dbias, 1.0) <= tolerance);

  // Without dropout the forward is the base with the merged weight: x (W + scale B A)^T + b.
  if (!layer.applies_dropout(ctx)) {
    std::vector<float> merged(static_cast<std::size_t>(out * in));
    layer.merged_weight(host, host_view(merged.data(), {out, in}));
    std::vector<double> y_merged(static_cast<std::size_t>(M * out));
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t o = 0; o < out; ++o) {
        double s = base.bias.empty() ? 0.0 : memkit::to_float(base.bias[static_cast<std::size_t>(o)]);
        for (std::int64_t i = 0; i < in; ++i)
          s += static_cast<double>(memkit::to_float(x[static_cast<std::size_t>(m * in + i)])) * merged[static_cast<std::size_t>(o * in + i)];
        y_merged[static_cast<std::size_t>(m * out + o)] = s;
      }
    CHECK(worst_error(widened(y), y_merged, 1.0) <= tolerance);
  }
}

template <class Base, class T>
void reference_cases(double tolerance) {
  lora_options options{.rank = 4, .alpha = 8.0, .dropout = 0.0f, .train_bias = true};
  for (std::int64_t M : {1, 5, 37}) {
    check_against_reference<Base, T>(M, 72, 40, options, forward_context{3, 5, true}, true, tolerance);
    options.dropout = 0.25f;
    check_against_reference<Base, T>(M, 72, 40, options, forward_context{3, 5, true}, true, tolerance);
    check_against_reference<Base, T>(M, 72, 40, options, forward_context{3, 5, false}, true, tolerance);
    options.dropout = 0.0f;
  }
  // rsLoRA, no bias, a rank above the tile sizes, K beyond one GEMM depth block.
  lora_options wide{.rank = 20, .alpha = 16.0, .use_rslora = true, .dropout = 0.1f, .host_threads = 2};
  check_against_reference<Base, T>(300, 264, 33, wide, forward_context{9, 1, true}, false, tolerance);
}

}  // namespace

TEST_CASE("lora_linear: forward and backward equal a dense reference over every base format") {
  reference_cases<float, float>(1e-5);
  reference_cases<bf16, float>(1e-5);
  reference_cases<fp16, float>(1e-5);
  reference_cases<q::quantized_tensor<q::NF4>, float>(1e-5);
  reference_cases<q::quantized_tensor<q::FP4>, float>(1e-5);
  reference_cases<q::quantized_tensor<q::INT8>, float>(1e-5);
  // 16-bit activations: every stored value rounds to 8 (bf16) or 11 (fp16) bits.
  reference_cases<bf16, bf16>(3e-2);
  reference_cases<fp16, fp16>(5e-3);
  reference_cases<q::quantized_tensor<q::NF4>, bf16>(3e-2);
}

namespace {

// sum(y * g) over one forward: the loss whose gradients backward computes for dy = g.
template <class L, class T>
double loss_of(L& layer, const std::vector<T>& x, const std::vector<T>& g, std::int64_t M, const forward_context& ctx) {
  std::vector<T> y(g.size());
  activation_store store(memkit::default_host_resource());
  layer.forward(host, ctx, host_view(x.data(), {M, layer.in_features()}), host_view(y.data(), {M, layer.out_features()}), store);
  double loss = 0.0;
  for (std::size_t i = 0; i < y.size(); ++i) loss += static_cast<double>(memkit::to_float(y[i])) * memkit::to_float(g[i]);
  return loss;
}

// Central differences of the loss in a few elements of `values`; the loss is linear in each of them (the
// dropout mask is fixed by the context), so the difference quotient is the derivative up to rounding.
template <class L, class V, class Grad>
void finite_differences(const char* what, L& layer, V* values, std::int64_t count, Grad analytic,
                        const std::vector<float>& x, const std::vector<float>& g, std::int64_t M,
                        const forward_context& ctx) {
  CAPTURE(what);
  const double step = 0.25;
  double magnitude = 0.0;
  for (float v : g) magnitude += std::fabs(v);
  for (std::int64_t probe = 0; probe < 9; ++probe) {
    const std::int64_t i = (probe * 7919) % count;
    CAPTURE(i);
    const V saved = values[i];
    values[i] = memkit::from_float<V>(memkit::to_float(saved) + static_cast<float>(step));
    const double plus = loss_of(layer, x, g, M, ctx);
    values[i] = memkit::from_float<V>(memkit::to_float(saved) - static_cast<float>(step));
    const double minus = loss_of(layer, x, g, M, ctx);
    values[i] = saved;
    const double numeric = (plus - minus) / (2 * step);
    CHECK(std::fabs(numeric - analytic(i)) <= 2e-6 * magnitude + 1e-4 * std::fabs(numeric));
  }
}

template <class Base>
void gradient_check() {
  CAPTURE(base_name<Base>());
  const std::int64_t M = 19, in = 80, out = 24;
  base_weight<Base, float> base(in, out, true, 21);
  const lora_options options{.rank = 6, .alpha = 12.0, .dropout = 0.3f, .train_bias = true};
  lora_linear<Base, float> layer(base.ref(), base.bias_view(), options, memkit::default_host_resource(),
                                 memkit::default_host_resource(), memkit::default_host_resource());
  randomize_b(layer, 22);
  std::vector<float> x = memkit_test::uniform_values(M * in, 23);
  const std::vector<float> g = memkit_test::uniform_values(M * out, 24);
  const forward_context ctx{77, 3, true};
  std::vector<float> y(g.size()), dx(x.size());
  activation_store store(memkit::default_host_resource());
  layer.forward(host, ctx, host_view(x.data(), {M, in}), host_view(y.data(), {M, out}), store);
  layer.backward(host, host_view(g.data(), {M, out}), host_view(dx.data(), {M, in}), store);
  const std::vector<float> dA(layer.grad_A().begin(), layer.grad_A().end());
  const std::vector<float> dB(layer.grad_B().begin(), layer.grad_B().end());
  const std::vector<float> db(layer.grad_bias().begin(), layer.grad_bias().end());

  finite_differences("A", layer, layer.lora_A().data(), layer.lora_A().size(), [&](std::int64_t i) { return dA[std::size_t(i)]; }, x, g, M, ctx);
  finite_differences("B", layer, layer.lora_B().data(), layer.lora_B().size(), [&](std::int64_t i) { return dB[std::size_t(i)]; }, x, g, M, ctx);
  finite_differences("bias", layer, base.bias.data(), out, [&](std::int64_t i) { return db[std::size_t(i)]; }, x, g, M, ctx);
  finite_differences("x", layer, x.data(), M * in, [&](std::int64_t i) { return dx[std::size_t(i)]; }, x, g, M, ctx);
}

}  // namespace

TEST_CASE("lora_linear: gradients match finite differences for every base format (dropout on)") {
  gradient_check<float>();
  gradient_check<bf16>();
  gradient_check<fp16>();
  gradient_check<q::quantized_tensor<q::NF4>>();
  gradient_check<q::quantized_tensor<q::FP4>>();
  gradient_check<q::quantized_tensor<q::INT8>>();
}

namespace {

// Forward and backward with a tracker: the store holds exactly saved_bytes, the workspace peaks are
// exactly the predicted ones, and the adapter's allocations are the predicted parameter/gradient bytes.
template <class Base, class T>
void check_memory(std::int64_t M, std::int64_t in, std::int64_t out, lora_options options, bool training,
                  bool want_dx, q::quant_options quant = {}) {
  CAPTURE(base_name<Base>());
  CAPTURE(sizeof(T));
  CAPTURE(M);
  CAPTURE(options.dropout);
  CAPTURE(options.host_threads);
  CAPTURE(want_dx);
  tracking_resource tracker(memkit::default_host_resource(), "lora");
  base_weight<Base, T> base(in, out, options.train_bias, 31, tracker.category(memory_category::weights), quant);
  lora_linear<Base, T> layer(base.ref(), base.bias_view(), options, tracker.category(memory_category::weights),
                             tracker.category(memory_category::gradients), tracker.category(memory_category::workspace));
  std::size_t base_bytes = 0;
  if constexpr (is_quantized<Base>) base_bytes = Base::bytes_required(shape{out, in}, quant);
  CHECK(tracker.stats(memory_category::weights).current_bytes ==
        base_bytes + lora_linear<Base, T>::parameter_bytes(in, out, options.rank));
  CHECK(tracker.stats(memory_category::gradients).current_bytes ==
        lora_linear<Base, T>::gradient_bytes(in, out, options.rank, options.train_bias));

  const std::vector<T> x = memkit_test::convert<T>(memkit_test::uniform_values(M * in, 32));
  const std::vector<T> dy = memkit_test::convert<T>(memkit_test::uniform_values(M * out, 33));
  std::vector<T> y(static_cast<std::size_t>(M * out)), dx(static_cast<std::size_t>(M * in));
  const forward_context ctx{1, 2, training};
  activation_store store(tracker.category(memory_category::activations));
  tracker.reset_peak();
  layer.forward(host, ctx, host_view(x.data(), {M, in}), host_view(y.data(), {M, out}), store);
  CHECK(store.bytes() == layer.saved_bytes(shape{M, in}, ctx));
  CHECK(tracker.stats(memory_category::activations).current_bytes == layer.saved_bytes(shape{M, in}, ctx));
  CHECK(tracker.stats(memory_category::workspace).peak_bytes == workspace_bytes(layer.forward_arguments(M)));
  CHECK(store.bytes() == saved_bytes(layer.forward_arguments(M)));
  CHECK(tracker.stats(memory_category::workspace).current_bytes == 0);
  tracker.reset_peak();
  layer.backward(host, host_view(dy.data(), {M, out}),
                 want_dx ? host_view(dx.data(), {M, in}) : memkit::tensor_view<T>::none(), store);
  CHECK(tracker.stats(memory_category::workspace).peak_bytes ==
        workspace_bytes(layer.backward_arguments(M, layer.applies_dropout(ctx), want_dx)));
  CHECK(tracker.stats(memory_category::activations).current_bytes == 0);
  CHECK(tracker.stats(memory_category::workspace).current_bytes == 0);
}

}  // namespace

TEST_CASE("lora_linear: saved bytes, workspace and parameter memory are exactly as predicted") {
  for (int threads : {1, 2})
    for (float p : {0.0f, 0.1f})
      for (std::int64_t M : {3, 64, 700}) {
        const lora_options options{.rank = 8, .alpha = 16.0, .dropout = p, .train_bias = M == 64, .host_threads = threads};
        check_memory<float, float>(M, 96, 160, options, true, true);
        check_memory<bf16, bf16>(M, 300, 64, options, true, M != 64);
        check_memory<q::quantized_tensor<q::NF4>, float>(M, 128, 96, options, true, true);
        check_memory<q::quantized_tensor<q::NF4>, bf16>(M, 128, 96, options, M == 3, true, {64, true});
        check_memory<q::quantized_tensor<q::INT8>, fp16>(M, 64, 96, options, true, M == 3);
      }
  // The constexpr functions are usable at compile time (memory_budget calls them).
  static_assert(memkit::lora::saved_activation_bytes(4096, 4096, 16, 2).total() == 4096 * (4096 + 16) * 2 + 32);
  constexpr memkit::lora::forward_arguments<float> on_device{.tokens = 512, .in = 64, .out = 64, .rank = 8, .on_device = true};
  static_assert(memkit::operation_arguments<decltype(on_device)>);
  static_assert(memkit::lora::workspace_bytes(on_device) == 0);  // cuBLAS keeps its own
  static_assert(memkit::lora::bytes_required(on_device) == memkit::lora::saved_activation_bytes(512, 64, 8, 4).total());
}

TEST_CASE("lora_linear: dropout draws its mask from the forward context only") {
  const std::int64_t M = 16, in = 64, out = 32;
  base_weight<float, float> base(in, out, false, 41);
  lora_options options{.rank = 4, .alpha = 4.0, .dropout = 0.5f};
  lora_linear<float> layer(base.ref(), options, memkit::default_host_resource(), memkit::default_host_resource(), memkit::default_host_resource());
  randomize_b(layer, 42);
  const std::vector<float> x = memkit_test::uniform_values(M * in, 43);
  auto run = [&](forward_context ctx) {
    std::vector<float> y(static_cast<std::size_t>(M * out));
    activation_store store(memkit::default_host_resource());
    layer.forward(host, ctx, host_view(x.data(), {M, in}), host_view(y.data(), {M, out}), store);
    // The saved adapter input is x with the mask applied: count the kept elements.
    memkit::saved_tensor<float> down = store.take<float>(shape{M, 4});
    memkit::saved_tensor<float> kept = store.take<float>(shape{M, in});
    std::int64_t zeros = 0;
    for (float v : kept.view()) zeros += v == 0.0f;
    return std::pair{y, zeros};
  };
  const auto [y1, zeros1] = run({5, 1 << 20, true});
  const auto [y2, zeros2] = run({5, 1 << 20, true});
  CHECK(y1 == y2);  // same context, same mask: a recomputed forward is bit for bit the first one
  CHECK(zeros1 == zeros2);
  CHECK(std::abs(zeros1 - M * in / 2) < M * in / 10);  // about half dropped
  const auto [y3, zeros3] = run({5, 2 << 20, true});
  CHECK(y3 != y1);
  const auto [y4, zeros4] = run({6, 1 << 20, true});
  CHECK(y4 != y1);
  const auto [y5, zeros5] = run({5, 1 << 20, false});
  CHECK(zeros5 == 0);  // not training: no dropout
}

TEST_CASE("lora_linear: merge and unmerge a dense base") {
  const std::int64_t in = 48, out = 40;
  SUBCASE("fp32: merged weight as the reference, unmerge within one ulp, exact on a coarse grid") {
    base_weight<float, float> base(in, out, false, 51);
    const std::vector<float> original = base.dense;
    lora_linear<float> layer(base.ref(), lora_options{.rank = 4, .alpha = 8.0}, memkit::default_host_resource(),
                             memkit::default_host_resource(), memkit::default_host_resource());
    randomize_b(layer, 52);
    std::vector<float> expected(original.size());
    layer.merged_weight(host, host_view(expected.data(), {out, in}));
    layer.merge(host);
    CHECK(layer.merged());
    CHECK(base.dense == expected);
    std::vector<float> x(static_cast<std::size_t>(in), 1.0f), y(static_cast<std::size_t>(out));
    activation_store store(memkit::default_host_resource());
    CHECK_THROWS_WITH_AS(layer.forward(host, {}, host_view(x.data(), {1, in}), host_view(y.data(), {1, out}), store),
                         doctest::Contains("unmerge() first"), memkit::error);
    CHECK(store.empty());
    CHECK_THROWS_AS(layer.merge(host), memkit::error);
    layer.unmerge(host);
    CHECK_FALSE(layer.merged());
    for (std::size_t i = 0; i < original.size(); ++i)
      CHECK(std::fabs(base.dense[i] - original[i]) <= std::nextafter(std::fabs(expected[i]), 1e30f) - std::fabs(expected[i]));
    CHECK_THROWS_AS(layer.unmerge(host), memkit::error);
  }
  SUBCASE("bf16: exact when every sum is representable") {
    // Weights on a grid of 1/4 within [-8, 8], A and B small powers of two: W + scale B A is exact in bf16.
    std::vector<bf16> w(static_cast<std::size_t>(out * in));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = bf16(static_cast<float>(static_cast<int>(i % 61) - 30) * 0.25f);
    const std::vector<bf16> original = w;
    lora_linear<bf16> layer(host_view(w.data(), {out, in}), lora_options{.rank = 2, .alpha = 2.0},
                            memkit::default_host_resource(), memkit::default_host_resource(), memkit::default_host_resource());
    for (std::int64_t i = 0; i < layer.lora_A().size(); ++i) layer.lora_A()[i] = bf16(i % 2 ? 0.5f : -0.25f);
    for (std::int64_t i = 0; i < layer.lora_B().size(); ++i) layer.lora_B()[i] = bf16(i % 3 ? 0.25f : 0.5f);
    layer.merge(host);
    CHECK(w != original);
    layer.unmerge(host);
    CHECK(w == original);
  }
}

TEST_CASE("lora_linear: merged_quantized re-quantizes the merged weight of a quantized base") {
  const std::int64_t in = 128, out = 32;
  base_weight<q::quantized_tensor<q::NF4>, float> base(in, out, false, 61);
  lora_linear<q::quantized_tensor<q::NF4>> layer(base.ref(), lora_options{.rank = 4, .alpha = 8.0},
                                                 memkit::default_host_resource(), memkit::default_host_resource(), memkit::default_host_resource());
  randomize_b(layer, 62, 2.0f);
  std::vector<float> merged(static_cast<std::size_t>(out * in)), requantized(merged.size());
  layer.merged_weight(host, host_view(merged.data(), {out, in}));
  const auto q2 = layer.merged_quantized(host, {64, false}, memkit::default_host_resource(), memkit::default_host_resource());
  q2.dequantize(host, host_view(requantized));
  const auto error = memkit_test::round_trip_errors(merged, requantized);
  CHECK(error.absolute < 0.1);  // an NF4 round trip of the merged weight (bitsandbytes' bound is 0.0733 * scale)
  CHECK(merged != base.effective);
}

TEST_CASE("lora_linear: PEFT's initialisation") {
  const std::int64_t in = 512, out = 64, r = 16;
  base_weight<float, float> base(in, out, false, 71);
  lora_linear<float> kaiming(base.ref(), lora_options{.rank = r, .alpha = 16.0, .init_seed = 7},
                             memkit::default_host_resource(), memkit::default_host_resource(), memkit::default_host_resource());
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  double sum = 0, squares = 0, largest = 0;
  for (float a : kaiming.lora_A()) {
    sum += a;
    squares += static_cast<double>(a) * a;
    largest = std::max(largest, std::fabs(static_cast<double>(a)));
  }
  const double n = static_cast<double>(r * in);
  CHECK(largest <= bound);
  CHECK(largest > 0.99 * bound);
  CHECK(std::fabs(sum / n) < 0.02 * bound);
  CHECK(squares / n == doctest::Approx(bound * bound / 3).epsilon(0.03));  // variance of U(-b, b)
  for (float b : kaiming.lora_B()) CHECK(b == 0.0f);
  CHECK(kaiming.scale() == 1.0f);

  lora_linear<float> gaussian(base.ref(), lora_options{.rank = r, .alpha = 32.0, .use_rslora = true,
                                                       .init = memkit::lora::init_method::gaussian, .init_seed = 7},
                              memkit::default_host_resource(), memkit::default_host_resource(), memkit::default_host_resource());
  sum = squares = 0;
  for (float a : gaussian.lora_A()) {
    sum += a;
    squares += static_cast<double>(a) * a;
  }
  CHECK(std::fabs(sum / n) < 0.02 / r);
  CHECK(std::sqrt(squares / n) == doctest::Approx(1.0 / r).epsilon(0.03));
  CHECK(gaussian.scale() == doctest::Approx(32.0 / 4.0));  // rsLoRA: alpha / sqrt(r)

  lora_linear<float> same(base.ref(), lora_options{.rank = r, .alpha = 16.0, .init_seed = 7},
                          memkit::default_host_resource(), memkit::default_host_resource(), memkit::default_host_resource());
  CHECK(std::equal(same.lora_A().begin(), same.lora_A().end(), kaiming.lora_A().begin()));
}

TEST_CASE("lora_linear: bad input is a clear error and changes nothing") {
  const std::int64_t in = 16, out = 8;
  base_weight<float, float> base(in, out, true, 81);
  auto& heap = memkit::default_host_resource();
  auto make = [&](lora_options o) { return lora_linear<float>(base.ref(), base.bias_view(), o, heap, heap, heap); };
  CHECK_THROWS_WITH_AS(make({.rank = 0}), doctest::Contains("rank must be positive"), memkit::error);
  CHECK_THROWS_WITH_AS(make({.rank = 2, .dropout = 1.0f}), doctest::Contains("dropout must be in [0, 1)"), memkit::error);
  CHECK_THROWS_WITH_AS(make({.rank = 2, .alpha = std::nan("")}), doctest::Contains("alpha must be finite"), memkit::error);
  std::vector<float> short_bias(3);
  CHECK_THROWS_WITH_AS(lora_linear<float>(base.ref(), host_view(short_bias.data(), {3}), {}, heap, heap, heap),
                       doctest::Contains("the bias has shape [3]"), memkit::error);
  CHECK_THROWS_WITH_AS(lora_linear<float>(base.ref(), {.train_bias = true}, heap, heap, heap),
                       doctest::Contains("no bias"), memkit::error);
  std::vector<float> bad_weight(static_cast<std::size_t>(in * out), 0.5f);
  bad_weight[19] = std::nanf("");
  CHECK_THROWS_WITH_AS(lora_linear<float>(host_view(bad_weight.data(), {out, in}), {}, heap, heap, heap),
                       doctest::Contains("at [1, 3]"), memkit::error);
  CHECK_THROWS_WITH_AS(lora_linear<float>(host_view(bad_weight.data(), {out * in}), {}, heap, heap, heap),
                       doctest::Contains("[out, in]"), memkit::error);
  CHECK_THROWS_WITH_AS(lora_linear<q::quantized_tensor<q::NF4>>(nullptr, {}, heap, heap, heap), doctest::Contains("null"),
                       memkit::error);

  lora_linear<float> layer = make({.rank = 2, .alpha = 2.0, .train_bias = true});
  randomize_b(layer, 82);
  std::vector<float> x(static_cast<std::size_t>(4 * in), 0.5f), y(static_cast<std::size_t>(4 * out)),
      dy(static_cast<std::size_t>(4 * out), 1.0f), dx(static_cast<std::size_t>(4 * in));
  activation_store store(heap);
  CHECK_THROWS_WITH_AS(layer.forward(host, {}, host_view(x.data(), {4, in - 1}), host_view(y.data(), {4, out}), store),
                       doctest::Contains("does not end in the layer's 16 input features"), memkit::error);
  CHECK_THROWS_WITH_AS(layer.forward(host, {}, host_view(x.data(), {4, in}), host_view(y.data(), {2, out}), store),
                       doctest::Contains("y has shape [2, 8] but x [4, 16] needs [4, 8]"), memkit::error);
  CHECK(store.empty());
  CHECK_THROWS_WITH_AS(layer.backward(host, host_view(dy.data(), {4, out}), host_view(dx.data(), {4, in}), store),
                       doctest::Contains("nothing is saved"), memkit::error);
  layer.forward(host, {}, host_view(x.data(), {4, in}), host_view(y.data(), {4, out}), store);
  CHECK_THROWS_WITH_AS(layer.backward(host, host_view(dy.data(), {4, out}), host_view(dx.data(), {2, 2 * in}), store),
                       doctest::Contains("dx has shape [2, 32] but dy [4, 8] needs [4, 16]"), memkit::error);
  CHECK_THROWS_WITH_AS(layer.backward(host, host_view(dy.data(), {4, out - 1}), host_view(dx.data(), {4, in}), store),
                       doctest::Contains("dy has shape [4, 7]"), memkit::error);
  CHECK_THROWS_WITH_AS(layer.backward(host, host_view(dy.data(), {2, out}), host_view(dx.data(), {2, in}), store),
                       doctest::Contains("backward asked for shape [2, 2]"), memkit::error);
  CHECK(store.size() == 3);  // the failed backwards took nothing
  for (float g : layer.grad_A()) CHECK(g == 0.0f);
  layer.backward(host, host_view(dy.data(), {4, out}), host_view(dx.data(), {4, in}), store);
  CHECK(store.empty());

  // Device memory is refused by the host executor, naming the argument.
  memkit::tensor_view<const float> on_device(x.data(), {4, in}, memkit::memory_kind::device);
  CHECK_THROWS_WITH_AS(layer.forward(host, {}, on_device, host_view(y.data(), {4, out}), store),
                       doctest::Contains("`x` is in device memory"), memkit::error);
  CHECK(store.empty());
}

TEST_CASE("lora_linear: a three-dimensional input [batch, sequence, in]") {
  const std::int64_t in = 24, out = 12;
  base_weight<float, float> base(in, out, false, 91);
  lora_linear<float> layer(base.ref(), lora_options{.rank = 3, .alpha = 6.0}, memkit::default_host_resource(),
                           memkit::default_host_resource(), memkit::default_host_resource());
  randomize_b(layer, 92);
  CHECK(layer.output_shape(shape{2, 5, in}) == shape{2, 5, out});
  const std::vector<float> x = memkit_test::uniform_values(2 * 5 * in, 93);
  std::vector<float> y3(static_cast<std::size_t>(2 * 5 * out)), y2(y3.size());
  activation_store store(memkit::default_host_resource());
  layer.forward(host, {}, host_view(x.data(), {2, 5, in}), host_view(y3.data(), {2, 5, out}), store);
  CHECK(store.bytes() == layer.saved_bytes(shape{2, 5, in}, {}));
  store.clear();
  layer.forward(host, {}, host_view(x.data(), {10, in}), host_view(y2.data(), {10, out}), store);
  CHECK(y3 == y2);
}
