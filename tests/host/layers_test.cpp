// memkit/layers/: dense_linear against a naive reference (bias and none, absent gradients, the layer and its
// byte functions), the parameter registry (sizes, order, groups, refusals, adam_state through it), zero_grad,
// and the learning-rate schedules at known steps.
#include <doctest/doctest.h>
#include <memkit/core/protocol.hpp>
#include <memkit/layers/dense_linear.hpp>
#include <memkit/layers/parameters.hpp>
#include <memkit/layers/schedules.hpp>
#include <memkit/memory/tracking.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "support/tracked_memory.hpp"

namespace ml = memkit::layers;
using memkit::memory_kind;
using memkit::shape;
using memkit::tensor_view;

namespace {

static_assert(memkit::operation_arguments<ml::dense_linear_arguments<float>>);
static_assert(memkit::operation_arguments<ml::dense_linear_arguments<memkit::bf16>>);
static_assert(memkit::layer<ml::dense_linear<float>, memkit::host_executor>);
static_assert(memkit::layer<ml::dense_linear<memkit::bf16>, memkit::host_executor>);
// The byte functions are constant expressions of the arguments.
constexpr ml::dense_linear_arguments<float> frozen_args{.rows = 8, .in = 16, .out = 4, .bias = true, .weight_grad = false};
static_assert(saved_bytes(frozen_args) == 0);
static_assert(saved_bytes(ml::dense_linear_arguments<float>{.rows = 8, .in = 16, .out = 4}) == 8 * 16 * sizeof(float));
static_assert(workspace_bytes(ml::dense_linear_arguments<float>{.rows = 8, .in = 16, .out = 4, .on_device = true}) == 0);
static_assert(bytes_required(ml::dense_linear_arguments<float>{.rows = 8, .in = 16, .out = 4}) ==
              workspace_bytes(ml::dense_linear_arguments<float>{.rows = 8, .in = 16, .out = 4}) + 8 * 16 * sizeof(float));

// Deterministic values in [-1, 1).
std::vector<float> values(std::size_t n, std::uint64_t seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 2.0f * memkit::unit_float(memkit::random_word(seed, 0, i)) - 1.0f;
  return v;
}
template <class T>
tensor_view<T> view(std::vector<T>& v, shape s) {
  return {v.data(), s, memory_kind::host};
}
template <class T>
tensor_view<const T> cview(const std::vector<T>& v, shape s) {
  return {v.data(), s, memory_kind::host};
}

// The naive products in double: y = x W^T + b, dW = dy^T x, db = column sums of dy, dx = dy W.
struct reference {
  std::vector<double> y, dw, db, dx;
  reference(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>* b, const std::vector<float>& dy,
            std::int64_t rows, std::int64_t in, std::int64_t out)
      : y(rows * out), dw(out * in), db(out), dx(rows * in) {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t o = 0; o < out; ++o) {
        double s = b ? (*b)[o] : 0.0;
        for (std::int64_t i = 0; i < in; ++i) s += double(x[r * in + i]) * w[o * in + i];
        y[r * out + o] = s;
      }
    for (std::int64_t o = 0; o < out; ++o) {
      for (std::int64_t i = 0; i < in; ++i) {
        double s = 0;
        for (std::int64_t r = 0; r < rows; ++r) s += double(dy[r * out + o]) * x[r * in + i];
        dw[o * in + i] = s;
      }
      for (std::int64_t r = 0; r < rows; ++r) db[o] += dy[r * out + o];
    }
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t i = 0; i < in; ++i) {
        double s = 0;
        for (std::int64_t o = 0; o < out; ++o) s += double(dy[r * out + o]) * w[o * in + i];
        dx[r * in + i] = s;
      }
  }
};
void check_close(const std::vector<float>& got, const std::vector<double>& want, double plus = 0.0) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(double(got[i]) == doctest::Approx(want[i] + plus).epsilon(1e-5));
}

}  // namespace

TEST_CASE("layers::dense_linear_forward / _backward: y = x W^T (+ b) and its gradients against a naive reference") {
  const std::int64_t rows = 6, in = 37, out = 11;  // x [2, 3, in]
  const std::vector<float> x = values(rows * in, 1), w = values(out * in, 2), b = values(out, 3), dy = values(rows * out, 4);
  auto& workspace = memkit::default_host_resource();
  const ml::dense_linear_options options{};
  for (const bool with_bias : {false, true}) {
    CAPTURE(with_bias);
    const reference want(x, w, with_bias ? &b : nullptr, dy, rows, in, out);
    std::vector<float> y(rows * out, -7.0f);
    ml::dense_linear_forward(memkit::host, cview(x, shape{2, 3, in}), cview(w, shape{out, in}),
                             with_bias ? cview(b, shape{out}) : tensor_view<const float>::none(), view(y, shape{2, 3, out}),
                             options, workspace);
    check_close(y, want.y);

    // Gradients accumulate into what is there (1.0); dx is overwritten.
    std::vector<float> dw(out * in, 1.0f), db(out, 1.0f), dx(rows * in, -7.0f);
    ml::dense_linear_backward(memkit::host, cview(dy, shape{2, 3, out}), cview(x, shape{2, 3, in}), cview(w, shape{out, in}),
                              view(dx, shape{2, 3, in}), view(dw, shape{out, in}),
                              with_bias ? view(db, shape{out}) : tensor_view<float>::none(), options, workspace);
    check_close(dw, want.dw, 1.0);
    check_close(dx, want.dx);
    if (with_bias) check_close(db, want.db, 1.0);
    else CHECK(db == std::vector<float>(out, 1.0f));
  }

  SUBCASE("absent gradients: none is neither read nor written") {
    std::vector<float> dx(rows * in, -7.0f), dw(out * in, 1.0f);
    // Only dx: no x needed.
    ml::dense_linear_backward(memkit::host, cview(dy, shape{rows, out}), tensor_view<const float>::none(), cview(w, shape{out, in}),
                              view(dx, shape{rows, in}), tensor_view<float>::none(), tensor_view<float>::none(), options,
                              workspace);
    check_close(dx, reference(x, w, nullptr, dy, rows, in, out).dx);
    // Only dW.
    std::fill(dx.begin(), dx.end(), -7.0f);
    ml::dense_linear_backward(memkit::host, cview(dy, shape{rows, out}), cview(x, shape{rows, in}), cview(w, shape{out, in}),
                              tensor_view<float>::none(), view(dw, shape{out, in}), tensor_view<float>::none(), options,
                              workspace);
    CHECK(dx == std::vector<float>(rows * in, -7.0f));
    check_close(dw, reference(x, w, nullptr, dy, rows, in, out).dw, 1.0);
  }

  SUBCASE("wrong shapes are refused before anything is written, naming the argument") {
    std::vector<float> y(rows * out, -7.0f), dx(rows * in, -7.0f), dw(out * in, 1.0f);
    CHECK_THROWS_WITH_AS(ml::dense_linear_forward(memkit::host, cview(x, shape{rows * in}), cview(w, shape{out, in}),
                                                  tensor_view<const float>::none(), view(y, shape{rows, out}), options, workspace),
                         doctest::Contains("layers::dense_linear_forward: x must be [..., 37]"), memkit::error);
    CHECK_THROWS_WITH_AS(ml::dense_linear_forward(memkit::host, cview(x, shape{rows, in}), cview(w, shape{out, in}),
                                                  cview(b, shape{out - 1}), view(y, shape{rows, out}), options, workspace),
                         doctest::Contains("bias must be none or [11]"), memkit::error);
    CHECK_THROWS_WITH_AS(ml::dense_linear_forward(memkit::host, cview(x, shape{rows, in}), cview(w, shape{out, in}),
                                                  tensor_view<const float>::none(), view(y, shape{rows, out - 1}), options,
                                                  workspace),
                         doctest::Contains("y must hold 6 rows of 11"), memkit::error);
    CHECK(y == std::vector<float>(rows * out, -7.0f));
    CHECK_THROWS_WITH_AS(ml::dense_linear_backward(memkit::host, cview(dy, shape{rows, out}), tensor_view<const float>::none(),
                                                   cview(w, shape{out, in}), view(dx, shape{rows, in}), view(dw, shape{out, in}),
                                                   tensor_view<float>::none(), options, workspace),
                         doctest::Contains("layers::dense_linear_backward: x must hold 6 rows of 37"), memkit::error);
    CHECK_THROWS_WITH_AS(ml::dense_linear_backward(memkit::host, cview(dy, shape{rows, out}), cview(x, shape{rows, in}),
                                                   cview(w, shape{out, in}), view(dx, shape{rows, in - 1}),
                                                   tensor_view<float>::none(), tensor_view<float>::none(), options, workspace),
                         doctest::Contains("dx must be none or hold 6 rows of 37"), memkit::error);
    CHECK(dx == std::vector<float>(rows * in, -7.0f));
    CHECK(dw == std::vector<float>(out * in, 1.0f));
  }
}

TEST_CASE("layers::dense_linear: the layer saves x when it trains, its byte functions are what it takes") {
  const std::int64_t rows = 6, in = 37, out = 11;
  memkit::tracking_resource tracker(memkit::default_host_resource(), "dense_linear");
  const ml::memory_resources memory = memkit_test::tracked_resources(tracker);
  const std::vector<float> x = values(rows * in, 1), w = values(out * in, 2), b = values(out, 3), dy = values(rows * out, 4);
  for (const bool with_bias : {false, true})
    for (const ml::trainability mode : {ml::trainability::frozen, ml::trainability::bf16_master}) {
      CAPTURE(with_bias);
      const bool trains = mode != ml::trainability::frozen;
      CAPTURE(trains);
      ml::dense_linear<float> layer("proj.weight", in, out, memory, mode, with_bias);
      CHECK(layer.weight.name == "proj.weight");
      CHECK(!layer.weight.has_master());  // an fp32 value is its own master
      layer.weight.assign(w.data());
      if (with_bias) {
        CHECK(layer.bias.name == "proj.bias");
        layer.bias.assign(b.data());
      }
      const shape in_shape{2, 3, in};
      const ml::dense_linear_arguments<float> args = layer.arguments(in_shape);
      CHECK(args.rows == rows);
      CHECK(args.bias == with_bias);
      CHECK(args.weight_grad == trains);
      CHECK(layer.output_shape(in_shape) == shape{2, 3, out});

      memkit::activation_store store(tracker.category(memkit::memory_category::activations));
      std::vector<float> y(rows * out), dx(rows * in);
      tracker.reset_peak();
      const std::size_t workspace_before = tracker.stats(memkit::memory_category::workspace).peak_bytes;
      layer.forward(memkit::host, {}, cview(x, in_shape), view(y, shape{2, 3, out}), store);
      CHECK(store.bytes() == layer.saved_bytes(in_shape, {}));
      CHECK(store.bytes() == (trains ? rows * in * sizeof(float) : 0));
      layer.backward(memkit::host, cview(dy, shape{2, 3, out}), view(dx, in_shape), store);
      CHECK(store.empty());
      CHECK(tracker.stats(memkit::memory_category::workspace).peak_bytes - workspace_before <= layer.workspace_bytes(in_shape));
      const reference want(x, w, with_bias ? &b : nullptr, dy, rows, in, out);
      check_close(y, want.y);
      check_close(dx, want.dx);
      if (trains) {
        check_close(ml::copy_out(std::as_const(layer.weight.grad).view()), want.dw);
        if (with_bias) check_close(ml::copy_out(std::as_const(layer.bias.grad).view()), want.db);
      }
      // No input gradient wanted: dx none (or an empty view) is skipped, the weight gradient still accumulates.
      layer.forward(memkit::host, {}, cview(x, in_shape), view(y, shape{2, 3, out}), store);
      layer.backward(memkit::host, cview(dy, shape{2, 3, out}), tensor_view<float>::none(), store);
      CHECK(store.empty());
      if (trains) {
        std::vector<double> twice = want.dw;
        for (double& v : twice) v *= 2;
        check_close(ml::copy_out(std::as_const(layer.weight.grad).view()), twice);
      }
    }
}

TEST_CASE("layers::dense_linear in bf16: the layer gives the bits of the call it wraps") {
  const std::int64_t rows = 4, in = 24, out = 8;
  ml::memory_resources memory;
  std::vector<float> xf = values(rows * in, 5), dyf = values(rows * out, 6), w = values(out * in, 7), b = values(out, 8);
  std::vector<memkit::bf16> x(xf.size()), dy(dyf.size());
  std::transform(xf.begin(), xf.end(), x.begin(), memkit::from_float<memkit::bf16>);
  std::transform(dyf.begin(), dyf.end(), dy.begin(), memkit::from_float<memkit::bf16>);
  ml::dense_linear<memkit::bf16> layer("p.weight", in, out, memory, ml::trainability::bf16_master, true);
  layer.weight.assign(w.data());
  layer.bias.assign(b.data());
  memkit::activation_store store(memkit::default_host_resource());
  std::vector<memkit::bf16> y(rows * out), dx(rows * in), y2(rows * out), dx2(rows * in);
  layer.forward(memkit::host, {}, cview(x, shape{rows, in}), view(y, shape{rows, out}), store);
  layer.backward(memkit::host, cview(dy, shape{rows, out}), view(dx, shape{rows, in}), store);
  std::vector<float> dw(out * in, 0.0f), db(out, 0.0f);
  ml::dense_linear_forward(memkit::host, cview(x, shape{rows, in}), std::as_const(layer.weight.value).view(),
                           std::as_const(layer.bias.value).view(), view(y2, shape{rows, out}), {}, memkit::default_host_resource());
  ml::dense_linear_backward(memkit::host, cview(dy, shape{rows, out}), cview(x, shape{rows, in}),
                            std::as_const(layer.weight.value).view(), view(dx2, shape{rows, in}), view(dw, shape{out, in}),
                            view(db, shape{out}), {}, memkit::default_host_resource());
  const auto bits = [](const std::vector<memkit::bf16>& v) {
    std::vector<std::uint16_t> out;
    for (memkit::bf16 e : v) out.push_back(memkit::float_to_bf16_bits(memkit::to_float(e)));
    return out;
  };
  CHECK(bits(y) == bits(y2));
  CHECK(bits(dx) == bits(dx2));
  CHECK(ml::copy_out(std::as_const(layer.weight.grad).view()) == dw);
  CHECK(ml::copy_out(std::as_const(layer.bias.grad).view()) == db);
}

TEST_CASE("layers::parameter_registry: names, order, sizes and groups from the layers themselves") {
  ml::memory_resources memory;
  ml::dense_linear<float> a("a.weight", 4, 3, memory, ml::trainability::bf16_master, true);
  ml::dense_linear<float> frozen("f.weight", 4, 3, memory, ml::trainability::frozen, true);
  ml::dense_linear<float> c("c.weight", 3, 4, memory, ml::trainability::bf16_rounding);
  ml::basic_parameter<float> norm("norm.weight", shape{3}, memory, ml::trainability::bf16_master);

  ml::parameter_registry<float> registry({{.name = "decay", .weight_decay = 0.1f}, {.name = "no_decay", .weight_decay = 0.0f, .lr_scale = 0.5f}},
                                         [](const std::string&, const shape& s) { return s.rank >= 2 ? 0 : 1; });
  a.register_parameters(registry);
  frozen.register_parameters(registry);  // frozen: nothing
  c.register_parameters(registry);
  registry.add(norm);

  REQUIRE(registry.size() == 4);
  std::vector<std::string> names;
  for (const auto& e : registry.entries()) names.push_back(e.name);
  CHECK(names == std::vector<std::string>{"a.weight", "a.bias", "c.weight", "norm.weight"});
  CHECK(registry.sizes() == std::vector<std::int64_t>{12, 3, 12, 3});
  CHECK(registry.parameter_count() == 30);
  CHECK(registry.find("c.weight")->value.data() == c.weight.value.data());
  CHECK(registry.find("f.weight") == nullptr);

  const auto params = registry.adam_params();
  REQUIRE(params.size() == 4);
  CHECK(params[0].param.data() == a.weight.value.data());
  CHECK(params[0].grad.data() == a.weight.grad.data());
  CHECK(params[0].master.is_none());
  CHECK(params[1].param.data() == a.bias.value.data());
  CHECK(params[2].param.data() == c.weight.value.data());
  CHECK(params[3].grad.data() == norm.grad.data());
  CHECK(std::vector<int>{params[0].group, params[1].group, params[2].group, params[3].group} == std::vector<int>{0, 1, 0, 1});

  const memkit::optim::adam_group base{.lr = 99.0f, .beta1 = 0.8f, .beta2 = 0.99f, .eps = 1e-6f, .weight_decay = 0.3f};
  const std::vector<memkit::optim::adam_group> groups = registry.adam_groups(base, 0.25f);
  REQUIRE(groups.size() == 2);
  CHECK(groups[0].lr == 0.25f);
  CHECK(groups[1].lr == 0.125f);
  CHECK(groups[0].weight_decay == 0.1f);
  CHECK(groups[1].weight_decay == 0.0f);
  CHECK((groups[1].beta1 == 0.8f && groups[1].beta2 == 0.99f && groups[1].eps == 1e-6f));
  // A group without its own weight decay keeps the base's; lr * 1 is lr exactly.
  ml::parameter_registry<float> plain;
  CHECK(plain.groups().size() == 1);
  CHECK(plain.adam_groups(base, 0.3f)[0].weight_decay == 0.3f);
  CHECK(plain.adam_groups(base, 0.3f)[0].lr == 0.3f);
}

TEST_CASE("layers::parameter_registry refuses repeated names, mismatched gradients and unknown groups") {
  std::vector<float> v(6), g(6), g5(5), m(6);
  ml::parameter_registry<float> registry({{.name = "one"}, {.name = "two"}});
  registry.add("w", view(v, shape{2, 3}), view(g, shape{2, 3}), view(m, shape{2, 3}), 1);
  CHECK_THROWS_WITH_AS(registry.add("w", view(v, shape{2, 3}), view(g, shape{2, 3})),
                       doctest::Contains("\"w\" is already registered"), memkit::error);
  CHECK_THROWS_WITH_AS(registry.add("x", view(v, shape{2, 3}), view(g, shape{3, 2})),
                       doctest::Contains("the gradient has shape [3, 2], the parameter [2, 3]"), memkit::error);
  CHECK_THROWS_WITH_AS(registry.add("x", view(v, shape{2, 3}), view(g5, shape{5})), doctest::Contains("the gradient has shape"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(registry.add("x", view(v, shape{2, 3}), view(g, shape{2, 3}), view(m, shape{6})),
                       doctest::Contains("the master copy has shape [6]"), memkit::error);
  CHECK_THROWS_WITH_AS(registry.add("x", view(v, shape{2, 3}), tensor_view<float>(g.data(), shape{2, 3}, memory_kind::device)),
                       doctest::Contains("different kinds of memory"), memkit::error);
  CHECK_THROWS_WITH_AS(registry.add("x", view(v, shape{2, 3}), tensor_view<float>::none()),
                       doctest::Contains("no gradient"), memkit::error);
  CHECK_THROWS_WITH_AS(registry.add("x", view(v, shape{2, 3}), view(g, shape{2, 3}), tensor_view<float>::none(), 2),
                       doctest::Contains("group 2 does not exist (2 groups)"), memkit::error);
  CHECK_THROWS_WITH_AS(registry.add("", view(v, shape{2, 3}), view(g, shape{2, 3})), doctest::Contains("needs a name"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(registry.add("x", tensor_view<float>(v.data(), shape{0}, memory_kind::host), tensor_view<float>(g.data(), shape{0}, memory_kind::host)),
                       doctest::Contains("absent or empty"), memkit::error);
  CHECK(registry.size() == 1);  // nothing refused was added
  CHECK_THROWS_WITH_AS(ml::parameter_registry<float>({{.name = "a"}, {.name = "a"}}), doctest::Contains("two groups are named \"a\""),
                       memkit::error);
  CHECK_THROWS_AS(ml::parameter_registry<float>(std::vector<ml::parameter_group>{}), memkit::error);
}

TEST_CASE("layers::parameter_registry feeds adam_state: the same step as the hand-written list, and zero_grad") {
  ml::memory_resources memory;
  // Two tensors of equal size: the order a hand-written list gets wrong without anyone noticing.
  const auto make = [&](ml::basic_parameter<float>& p, ml::basic_parameter<float>& q) {
    p = ml::basic_parameter<float>("p", shape{4, 8}, memory, ml::trainability::bf16_master);
    q = ml::basic_parameter<float>("q", shape{32}, memory, ml::trainability::bf16_master);
    p.assign(values(32, 11).data());
    q.assign(values(32, 12).data());
    ml::copy_in(values(32, 13).data(), p.grad.view());
    ml::copy_in(values(32, 14).data(), q.grad.view());
  };
  ml::basic_parameter<float> p1, q1, p2, q2;
  make(p1, q1);
  make(p2, q2);
  const memkit::optim::adam_group base{.lr = 1e-2f, .weight_decay = 0.0f};

  ml::parameter_registry<float> registry({{.name = "decay", .weight_decay = 0.1f}, {.name = "no_decay"}},
                                         [](const std::string&, const shape& s) { return s.rank >= 2 ? 0 : 1; });
  registry.add(p1);
  registry.add(q1);
  memkit::optim::adam_state<float> from_registry(memkit::host, memkit::default_host_resource(), registry.sizes());
  from_registry.step(memkit::host, registry.adam_params(), registry.adam_groups(base, 1e-2f));

  const std::vector<std::int64_t> sizes{32, 32};
  memkit::optim::adam_state<float> by_hand(memkit::host, memkit::default_host_resource(), sizes);
  const std::vector<memkit::optim::adam_param<float, float>> params{{p2.value.view(), std::as_const(p2.grad).view(), p2.master_view(), 0},
                                                             {q2.value.view(), std::as_const(q2.grad).view(), q2.master_view(), 1}};
  const std::vector<memkit::optim::adam_group> groups{{.lr = 1e-2f, .weight_decay = 0.1f}, {.lr = 1e-2f, .weight_decay = 0.0f}};
  by_hand.step(memkit::host, params, groups);
  CHECK(ml::copy_out(std::as_const(p1.value).view()) == ml::copy_out(std::as_const(p2.value).view()));
  CHECK(ml::copy_out(std::as_const(q1.value).view()) == ml::copy_out(std::as_const(q2.value).view()));
  CHECK(ml::copy_out(std::as_const(p1.value).view()) != values(32, 11));

  ml::zero_grad(memkit::host, registry);
  CHECK(ml::copy_out(std::as_const(p1.grad).view()) == std::vector<float>(32, 0.0f));
  CHECK(ml::copy_out(std::as_const(q1.grad).view()) == std::vector<float>(32, 0.0f));
  CHECK(ml::copy_out(std::as_const(p2.grad).view()) == values(32, 13));  // not registered: untouched

  // A gradient the executor cannot reach: refused before anything is zeroed.
  ml::copy_in(values(32, 13).data(), p1.grad.view());
  std::vector<float> v(4), g(4);
  registry.add("on_device", tensor_view<float>(v.data(), shape{4}, memory_kind::device),
               tensor_view<float>(g.data(), shape{4}, memory_kind::device));
  CHECK_THROWS_WITH_AS(ml::zero_grad(memkit::host, registry), doctest::Contains("layers::zero_grad: `on_device` is in device memory"),
                       memkit::error);
  CHECK(ml::copy_out(std::as_const(p1.grad).view()) == values(32, 13));
}

TEST_CASE("layers schedules: warmup, decay and end values") {
  const ml::constant_schedule constant{.peak = 1.0f, .warmup_steps = 4};
  CHECK(constant(0) == 0.25f);
  CHECK(constant(3) == 1.0f);  // the last warmup step reaches the peak
  CHECK(constant(4) == 1.0f);
  CHECK(constant(1000) == 1.0f);
  static_assert(ml::constant_schedule{.peak = 2.0f}(0) == 2.0f);  // no warmup
  static_assert(ml::linear_schedule{.peak = 1.0f, .warmup_steps = 2, .total_steps = 6}(1) == 1.0f);

  const ml::linear_schedule linear{.peak = 1.0f, .warmup_steps = 2, .total_steps = 6, .final_fraction = 0.0f};
  CHECK(linear(0) == 0.5f);
  CHECK(linear(1) == 1.0f);
  CHECK(linear(2) == 1.0f);   // decay starts at the peak
  CHECK(linear(4) == 0.5f);
  CHECK(linear(6) == 0.0f);   // total_steps: the final value
  CHECK(linear(60) == 0.0f);  // and it stays there
  const ml::linear_schedule to_tenth{.peak = 2.0f, .warmup_steps = 0, .total_steps = 10, .final_fraction = 0.1f};
  CHECK(to_tenth(0) == 2.0f);
  CHECK(to_tenth(10) == doctest::Approx(0.2f));

  const ml::cosine_schedule cosine{.peak = 1.0f, .warmup_steps = 10, .total_steps = 110, .final_fraction = 0.0f};
  CHECK(cosine(0) == 0.1f);
  CHECK(cosine(9) == 1.0f);
  CHECK(cosine(10) == 1.0f);
  CHECK(cosine(60) == doctest::Approx(0.5f).epsilon(1e-6));  // half way
  CHECK(cosine(110) == doctest::Approx(0.0f).epsilon(1e-6));
  CHECK(cosine(500) == cosine(110));
  const ml::cosine_schedule floor{.peak = 3e-4f, .warmup_steps = 0, .total_steps = 100, .final_fraction = 0.1f};
  CHECK(floor(0) == 3e-4f);
  CHECK(floor(100) == doctest::Approx(3e-5f));
  for (std::int64_t s = 1; s < 100; ++s) CHECK(floor(s) <= floor(s - 1));
}

TEST_CASE("layers::cosine_schedule gives the floats of examples/train_llama.cpp's former warmup + cosine") {
  // The example's function before it used the schedule, verbatim.
  const auto former = [](float peak, std::int64_t step, std::int64_t steps) {
    const std::int64_t warmup = std::max<std::int64_t>(1, steps / 10);
    if (step < warmup) return peak * static_cast<float>(step + 1) / static_cast<float>(warmup);
    const float progress = static_cast<float>(step - warmup) / static_cast<float>(std::max<std::int64_t>(1, steps - warmup));
    return peak * (0.1f + 0.9f * 0.5f * (1.0f + std::cos(3.14159265f * progress)));
  };
  for (const float peak : {3e-3f, 1e-4f, 2e-4f, 1.0f})
    for (const std::int64_t steps : {1, 2, 7, 10, 30, 200, 1000, 4321}) {
      volatile float final_fraction = 0.1f;  // not folded at compile time: the run-time path is the one checked
      const ml::cosine_schedule schedule{.peak = peak, .warmup_steps = std::max<std::int64_t>(1, steps / 10), .total_steps = steps,
                                         .final_fraction = final_fraction};
      for (std::int64_t step = 0; step < steps; ++step) {
        const float a = schedule(step), b = former(peak, step, steps);
        if (std::memcmp(&a, &b, sizeof a) != 0) FAIL("step " << step << " of " << steps << ": " << a << " != " << b);
      }
    }
}

TEST_CASE("docs/layers.md's complete loop is examples/hand_written_loop.cpp") {
  const auto read = [](const std::string& path) {
    std::ifstream in(std::string(MEMKIT_TEST_SOURCE_DIR) + "/" + path);
    REQUIRE(in.good());
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
  };
  const std::string doc = read("docs/layers.md"), program = read("examples/hand_written_loop.cpp");
  const std::size_t open = doc.rfind("```cpp\n");
  REQUIRE(open != std::string::npos);
  const std::size_t start = open + 7, close = doc.find("```", start);
  REQUIRE(close != std::string::npos);
  CHECK(doc.substr(start, close - start) == program);
}
