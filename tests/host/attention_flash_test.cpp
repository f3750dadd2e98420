// memkit::attention on the host: forward and gradients against a materialized double-precision reference
// (tolerances as in docs/attention.md), finite differences, GQA, windows, odd sizes, bad input, thread and
// instruction-set independence, and the workspace a tracking_resource sees against the prediction.
#include <doctest/doctest.h>

#include <memkit/attention/flash_attention.hpp>
#include <memkit/memory/tracking.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "host/attention_reference.hpp"
#include "support/test_values.hpp"
#include "support/host_isa_scope.hpp"

namespace {

namespace att = memkit::attention;
using memkit_test::attention_shape;
using memkit_test::materialized_attention;

template <class T>
memkit::tensor_view<T> view(std::vector<T>& data, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
  return memkit::host_view(data.data(), memkit::shape{a, b, c, d});
}

// Largest |x - reference| over the largest |reference|: the error relative to the tensor's scale.
template <class T>
double scaled_error(const std::vector<T>& x, const std::vector<double>& reference) {
  double worst = 0, largest = 1e-30;
  for (std::size_t i = 0; i < x.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(memkit::to_float(x[i])) - reference[i]));
    largest = std::max(largest, std::abs(reference[i]));
  }
  return worst / largest;
}

template <class T>
std::vector<double> widened(const std::vector<T>& x) {
  std::vector<double> out;
  for (T value : x) out.push_back(memkit::to_float(value));
  return out;
}

template <class T>
struct run_result {
  std::vector<T> out, dq, dk, dv;
  std::vector<float> lse;
};

template <class T>
struct problem_data {
  attention_shape s;
  std::vector<T> q, k, v, dout;
  explicit problem_data(attention_shape shape, unsigned seed = 1) : s(shape) {
    q = memkit_test::convert<T>(memkit_test::standard_normal(s.q_elems(), seed));
    k = memkit_test::convert<T>(memkit_test::standard_normal(s.kv_elems(), seed + 1));
    v = memkit_test::convert<T>(memkit_test::standard_normal(s.kv_elems(), seed + 2));
    dout = memkit_test::convert<T>(memkit_test::standard_normal(s.q_elems(), seed + 3));
  }

  run_result<T> run(const att::attention_options& o, memkit::memory_resource& workspace) {
    run_result<T> r;
    r.out.resize(q.size());
    r.dq.resize(q.size());
    r.dk.resize(k.size());
    r.dv.resize(v.size());
    r.lse.resize(static_cast<std::size_t>(s.B * s.Hq * s.S));
    const auto qv = view(q, s.B, s.Hq, s.S, s.D), kv = view(k, s.B, s.Hkv, s.S, s.D), vv = view(v, s.B, s.Hkv, s.S, s.D);
    const auto ov = view(r.out, s.B, s.Hq, s.S, s.D);
    const auto lv = memkit::host_view(r.lse.data(), memkit::shape{s.B, s.Hq, s.S});
    att::forward<T>(memkit::host, qv, kv, vv, ov, lv, o, workspace);
    att::backward<T>(memkit::host, {qv, kv, vv, ov, lv}, view(dout, s.B, s.Hq, s.S, s.D),
                     {view(r.dq, s.B, s.Hq, s.S, s.D), view(r.dk, s.B, s.Hkv, s.S, s.D),
                      view(r.dv, s.B, s.Hkv, s.S, s.D)},
                     o, workspace);
    return r;
  }
};

// Scaled errors of one configuration against the double reference.
struct errors {
  double out, lse, dq, dk, dv;
};

template <class T>
errors compare_with_reference(attention_shape s, att::attention_options o) {
  problem_data<T> data(s);
  const run_result<T> got = data.run(o, memkit::default_host_resource());
  materialized_attention<double> ref{s, o, {}, {}, {}};
  std::vector<double> dq, dk, dv;
  ref.forward(widened(data.q), widened(data.k), widened(data.v), memkit::default_host_resource());
  ref.backward(widened(data.q), widened(data.k), widened(data.v), widened(data.dout), dq, dk, dv,
               memkit::default_host_resource());
  return {scaled_error(got.out, ref.out), scaled_error(got.lse, ref.lse), scaled_error(got.dq, dq),
          scaled_error(got.dk, dk), scaled_error(got.dv, dv)};
}

struct config {
  attention_shape s;
  bool causal;
  std::int64_t window;
};

const config configs[] = {
    {{1, 1, 1, 1, 1}, true, 0},       // one token
    {{2, 4, 2, 70, 64}, true, 0},     // GQA, seq not a multiple of the tile
    {{1, 4, 1, 130, 128}, false, 0},  // multi-query, head_dim 128, non-causal
    {{1, 3, 3, 65, 7}, true, 17},     // odd head_dim, causal window
    {{2, 2, 1, 100, 13}, false, 9},   // non-causal window
    {{1, 6, 3, 200, 5}, true, 50},    // window spanning tiles
    {{1, 2, 2, 64, 64}, false, 0},    // exactly one tile
};

// Tolerances on the error relative to each tensor's largest reference value (docs/attention.md).
template <class T>
constexpr double tolerance() {
  if constexpr (std::is_same_v<T, float>) return 1e-5;
  else if constexpr (std::is_same_v<T, memkit::fp16>) return 2e-3;
  else return 1e-2;
}

template <class T>
void check_against_reference(const char* type_name) {
  double worst = 0;
  for (const config& c : configs) {
    att::attention_options o;
    o.causal = c.causal;
    o.window = c.window;
    o.host_threads = 2;
    CAPTURE(c.s.Hq);
    CAPTURE(c.s.Hkv);
    CAPTURE(c.s.S);
    CAPTURE(c.s.D);
    CAPTURE(c.causal);
    CAPTURE(c.window);
    const errors e = compare_with_reference<T>(c.s, o);
    CHECK(e.out <= tolerance<T>());
    CHECK(e.lse <= 1e-5);  // lse is fp32 from the same T inputs
    CHECK(e.dq <= tolerance<T>());
    CHECK(e.dk <= tolerance<T>());
    CHECK(e.dv <= tolerance<T>());
    worst = std::max({worst, e.out, e.dq, e.dk, e.dv});
  }
  std::printf("attention %s vs double reference: worst scaled error %.3g (tolerance %.3g), ISA %s\n", type_name,
              worst, tolerance<T>(), memkit::to_string(memkit::host_isa_in_use()));
}

}  // namespace

TEST_CASE("attention: forward and gradients match the materialized reference (fp32, bf16, fp16)") {
  check_against_reference<float>("fp32");
  check_against_reference<memkit::bf16>("bf16");
  check_against_reference<memkit::fp16>("fp16");
}

TEST_CASE("attention: the AVX2 and portable paths agree with the widest one") {
  problem_data<float> data({1, 4, 2, 150, 40});
  att::attention_options o;
  o.window = 70;
  o.host_threads = 1;
  const run_result<float> widest = data.run(o, memkit::default_host_resource());
  for (memkit::host_isa isa : {memkit::host_isa::avx2, memkit::host_isa::portable}) {
    const run_result<float> other = [&] {
      const memkit_test::host_isa_cap cap(isa);
      return data.run(o, memkit::default_host_resource());
    }();
    const auto near = [](const std::vector<float>& a, const std::vector<float>& b) {
      double worst = 0;
      for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(a[i] - b[i])));
      return worst;
    };
    CAPTURE(memkit::to_string(isa));
    CHECK(near(widest.out, other.out) <= 1e-5);
    CHECK(near(widest.dq, other.dq) <= 1e-5);
    CHECK(near(widest.dk, other.dk) <= 1e-5);
    CHECK(near(widest.dv, other.dv) <= 1e-5);
  }
}

TEST_CASE("attention: results do not depend on the thread count") {
  problem_data<memkit::bf16> data({2, 4, 2, 131, 32});
  att::attention_options o;
  o.host_threads = 1;
  const run_result<memkit::bf16> one = data.run(o, memkit::default_host_resource());
  o.host_threads = 3;
  const run_result<memkit::bf16> three = data.run(o, memkit::default_host_resource());
  const auto same = [](const auto& a, const auto& b) {
    return std::equal(a.begin(), a.end(), b.begin(), [](auto x, auto y) { return x.bits == y.bits; });
  };
  CHECK(same(one.out, three.out));
  CHECK(same(one.dq, three.dq));
  CHECK(same(one.dk, three.dk));
  CHECK(same(one.dv, three.dv));
  CHECK(one.lse == three.lse);
}

// `kernel` picks CUDA kernels; the host has one path, so every choice is accepted there at any head_dim (256 and an
// odd one included, which CUDA runs only with mma or not at all) and gives the same bits.
TEST_CASE("attention: attention_options::kernel changes nothing on the host, at any head_dim") {
  const auto same = [](const auto& a, const auto& b) {
    return std::equal(a.begin(), a.end(), b.begin(), [](auto x, auto y) { return x.bits == y.bits; });
  };
  for (const std::int64_t D : {std::int64_t{256}, std::int64_t{40}}) {
    CAPTURE(D);
    problem_data<memkit::bf16> data({1, 2, 1, 70, D});
    att::attention_options o;
    const run_result<memkit::bf16> automatic = data.run(o, memkit::default_host_resource());
    for (const att::attention_kernel kernel : {att::attention_kernel::wmma, att::attention_kernel::mma}) {
      o.kernel = kernel;
      const run_result<memkit::bf16> chosen = data.run(o, memkit::default_host_resource());
      CHECK(same(chosen.out, automatic.out));
      CHECK(same(chosen.dq, automatic.dq));
      CHECK(same(chosen.dk, automatic.dk));
      CHECK(same(chosen.dv, automatic.dv));
      CHECK(chosen.lse == automatic.lse);
    }
  }
}

TEST_CASE("attention: gradients match finite differences of the forward (fp32, small shapes)") {
  for (bool causal : {true, false}) {
    const attention_shape s{1, 2, 1, 9, 3};
    problem_data<float> data(s, 7);
    att::attention_options o;
    o.causal = causal;
    o.window = causal ? 0 : 4;
    o.host_threads = 1;
    const run_result<float> analytic = data.run(o, memkit::default_host_resource());
    // loss = sum(out * dout); its gradient with respect to each input is what backward returns.
    const auto loss = [&] {
      std::vector<float> out(data.q.size()), lse(static_cast<std::size_t>(s.B * s.Hq * s.S));
      att::forward<float>(memkit::host, view(data.q, 1, 2, 9, 3), view(data.k, 1, 1, 9, 3), view(data.v, 1, 1, 9, 3),
                          view(out, 1, 2, 9, 3), memkit::host_view(lse.data(), memkit::shape{1, 2, 9}), o,
                          memkit::default_host_resource());
      double sum = 0;
      for (std::size_t i = 0; i < out.size(); ++i) sum += static_cast<double>(out[i]) * data.dout[i];
      return sum;
    };
    const float step = 1e-2f;
    double worst = 0;
    const auto check = [&](std::vector<float>& input, const std::vector<float>& gradient) {
      for (std::size_t i = 0; i < input.size(); ++i) {
        const float saved = input[i];
        input[i] = saved + step;
        const double up = loss();
        input[i] = saved - step;
        const double down = loss();
        input[i] = saved;
        const double numeric = (up - down) / (2.0 * step);
        CHECK(std::abs(numeric - gradient[i]) <= 2e-3 + 2e-3 * std::abs(numeric));
        worst = std::max(worst, std::abs(numeric - gradient[i]));
      }
    };
    check(data.q, analytic.dq);
    check(data.k, analytic.dk);
    check(data.v, analytic.dv);
    std::printf("attention finite differences (%s): worst |numeric - analytic| %.3g\n",
                causal ? "causal" : "non-causal window 4", worst);
  }
}

TEST_CASE("attention: bad input is a clear memkit::error and writes nothing") {
  std::vector<float> q(2 * 3 * 8 * 4, 0.5f), k(2 * 2 * 8 * 4, 0.5f), v = k, out(q.size(), 7.0f), lse(2 * 3 * 8, 7.0f);
  att::attention_options o;
  auto& ws = memkit::default_host_resource();
  const auto lv = memkit::host_view(lse.data(), memkit::shape{2, 3, 8});
  // 2 kv heads do not divide 3 query heads.
  CHECK_THROWS_WITH_AS(att::forward<float>(memkit::host, view(q, 2, 3, 8, 4), view(k, 2, 2, 8, 4), view(v, 2, 2, 8, 4),
                                           view(out, 2, 3, 8, 4), lv, o, ws),
                       doctest::Contains("must divide query heads"), memkit::error);
  // Sequence length 0.
  CHECK_THROWS_WITH_AS(att::forward<float>(memkit::host, view(q, 2, 3, 0, 4), view(k, 2, 3, 0, 4), view(v, 2, 3, 0, 4),
                                           view(out, 2, 3, 0, 4), memkit::host_view(lse.data(), memkit::shape{2, 3, 0}),
                                           o, ws),
                       doctest::Contains("sequence length is 0"), memkit::error);
  // k's head_dim differs from q's.
  CHECK_THROWS_WITH_AS(att::forward<float>(memkit::host, view(q, 2, 3, 8, 4), view(k, 2, 1, 16, 2),
                                           view(v, 2, 1, 16, 2), view(out, 2, 3, 8, 4), lv, o, ws),
                       doctest::Contains("does not match q"), memkit::error);
  // out's shape differs from q's; lse of the wrong shape; a negative window.
  CHECK_THROWS_AS(att::forward<float>(memkit::host, view(q, 2, 3, 8, 4), view(k, 2, 1, 8, 8), view(v, 2, 1, 8, 8),
                                      view(out, 2, 3, 4, 8), lv, o, ws),
                  memkit::error);
  CHECK_THROWS_WITH_AS(att::forward<float>(memkit::host, view(q, 2, 3, 8, 4), view(k, 2, 1, 8, 4), view(v, 2, 1, 8, 4),
                                           view(out, 2, 3, 8, 4), memkit::host_view(lse.data(), memkit::shape{2, 3, 4}),
                                           o, ws),
                       doctest::Contains("lse must be fp32"), memkit::error);
  att::attention_options negative;
  negative.window = -1;
  CHECK_THROWS_WITH_AS(att::forward<float>(memkit::host, view(q, 2, 3, 8, 4), view(k, 2, 1, 8, 4), view(v, 2, 1, 8, 4),
                                           view(out, 2, 3, 8, 4), lv, negative, ws),
                       doctest::Contains("window"), memkit::error);
  // A negative thread count (#35: accepted silently before; the one rule of core/host_threads.hpp).
  att::attention_options negative_threads;
  negative_threads.host_threads = -3;
  CHECK_THROWS_WITH_AS(att::forward<float>(memkit::host, view(q, 2, 3, 8, 4), view(k, 2, 1, 8, 4), view(v, 2, 1, 8, 4),
                                           view(out, 2, 3, 8, 4), lv, negative_threads, ws),
                       doctest::Contains("attention::forward: host_threads must be >= 0 (0: every hardware thread), got -3"),
                       memkit::error);
  // Device memory handed to the host path.
  const memkit::tensor_view<float> on_device(q.data(), memkit::shape{2, 3, 8, 4}, memkit::memory_kind::device);
  CHECK_THROWS_WITH_AS(att::forward<float>(memkit::host, on_device, view(k, 2, 1, 8, 4), view(v, 2, 1, 8, 4),
                                           view(out, 2, 3, 8, 4), lv, o, ws),
                       doctest::Contains("cannot access"), memkit::error);
  // Backward: dk of the wrong shape.
  std::vector<float> dq(q.size()), dk(k.size()), dv(v.size());
  CHECK_THROWS_WITH_AS(att::backward<float>(memkit::host,
                                            {view(q, 2, 3, 8, 4), view(k, 2, 1, 8, 4), view(v, 2, 1, 8, 4),
                                             view(out, 2, 3, 8, 4), lv},
                                            view(q, 2, 3, 8, 4),
                                            {view(dq, 2, 3, 8, 4), view(dk, 2, 2, 8, 2), view(dv, 2, 1, 8, 4)}, o, ws),
                       doctest::Contains("`dk`"), memkit::error);
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; }));
  CHECK(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 7.0f; }));
}

TEST_CASE("attention: the workspace taken equals the prediction; at seq 8192 a small fraction of materialized" * doctest::test_suite("scale")) {
  SUBCASE("prediction == tracked peak, several shapes and thread counts") {
    for (const config& c : configs)
      for (int threads : {1, 2, 5}) {
        att::attention_options o;
        o.causal = c.causal;
        o.window = c.window;
        o.host_threads = threads;
        problem_data<memkit::bf16> data(c.s);
        memkit::tracking_resource tracker(memkit::default_host_resource());
        data.run(o, tracker.category(memkit::memory_category::workspace));
        const auto& s = c.s;
        const att::problem_arguments problem{.batch = s.B, .query_heads = s.Hq, .kv_heads = s.Hkv, .sequence = s.S,
                                             .head_dim = s.D, .element_bytes = 2, .options = o};
        static_assert(memkit::operation_arguments<att::forward_arguments> &&
                      memkit::operation_arguments<att::backward_arguments>);
        CHECK(tracker.peak_bytes() == std::max(att::workspace_bytes(att::forward_arguments{problem}),
                                               att::workspace_bytes(att::backward_arguments{problem})));
        CHECK(tracker.current_bytes() == 0);
      }
  }
  SUBCASE("seq 8192: flash vs materialized, every tensor of forward + backward tracked") {
    const attention_shape s{1, 1, 1, 8192, 32};
    att::attention_options o;
    o.host_threads = 2;
    problem_data<float> data(s);
    // Flash: inputs, saved out and lse, gradients and workspace, all from the tracker.
    memkit::tracking_resource flash(memkit::default_host_resource(), "flash");
    {
      memkit::buffer<float> q(flash, {1, 1, 8192, 32}), k(flash, {1, 1, 8192, 32}), v(flash, {1, 1, 8192, 32}),
          out(flash, {1, 1, 8192, 32}), lse(flash, {1, 1, 8192}), dout(flash, {1, 1, 8192, 32}),
          dq(flash, {1, 1, 8192, 32}), dk(flash, {1, 1, 8192, 32}), dv(flash, {1, 1, 8192, 32});
      std::copy(data.q.begin(), data.q.end(), q.data());
      std::copy(data.k.begin(), data.k.end(), k.data());
      std::copy(data.v.begin(), data.v.end(), v.data());
      std::copy(data.dout.begin(), data.dout.end(), dout.data());
      att::forward<float>(memkit::host, q.view(), k.view(), v.view(), out.view(), lse.view(), o, flash);
      att::backward<float>(memkit::host, {q.view(), k.view(), v.view(), out.view(), lse.view()}, dout.view(),
                           {dq.view(), dk.view(), dv.view()}, o, flash);
    }
    const std::size_t tensors = 8 * s.q_elems() * sizeof(float) + s.S * sizeof(float);  // 8 x [S, D] + lse
    const att::problem_arguments problem{.batch = 1, .query_heads = 1, .kv_heads = 1, .sequence = 8192, .head_dim = 32,
                                         .element_bytes = 4, .options = o};
    CHECK(tensors == 7 * s.q_elems() * sizeof(float) + att::saved_bytes(att::forward_arguments{problem}));
    CHECK(flash.peak_bytes() == tensors + att::workspace_bytes(att::backward_arguments{problem}));
    // Materialized (fp32): the same tensors plus the probabilities and the scores' gradient.
    memkit::tracking_resource eager(memkit::default_host_resource(), "materialized");
    {
      memkit::buffer<float> held(eager, {static_cast<std::int64_t>(tensors / sizeof(float))});
      materialized_attention<float> ref{s, o, {}, {}, {}};
      std::vector<float> dq, dk, dv;
      ref.forward(data.q, data.k, data.v, eager);
      ref.backward(data.q, data.k, data.v, data.dout, dq, dk, dv, eager);
    }
    CHECK(eager.peak_bytes() == tensors + att::eager_attention_bytes(1, 1, 8192));
    const double ratio = static_cast<double>(flash.peak_bytes()) / static_cast<double>(eager.peak_bytes());
    std::printf("attention seq 8192 (B1 H1 D32 fp32, causal): flash peak %zu bytes, materialized %zu bytes, ratio %.4f\n",
                flash.peak_bytes(), eager.peak_bytes(), ratio);
    CHECK(ratio < 0.05);
  }
}
