// memkit::loss::fused_linear_cross_entropy with reduction none: per-token losses whose mean is the mean reduction's
// loss, gradients for per-token upstream weights d_loss (bit-identical to the mean's when d_loss = 1 / counted,
// central finite differences of sum_i d_loss_i * loss_i otherwise), dense and quantized heads, bad input, and
// the workspace a tracker sees against the prediction.
#include <doctest/doctest.h>

#include <memkit/loss/fused_linear_cross_entropy.hpp>
#include <memkit/memory/tracking.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "support/finite_differences.hpp"
#include "support/test_values.hpp"

namespace ls = memkit::loss;
using memkit::host;
using memkit::host_view;
using memkit::tensor_view;

namespace {

template <class T>
struct problem {
  std::int64_t N, H, V;
  std::vector<T> hidden, head;
  std::vector<std::int32_t> targets;
  std::vector<float> d_loss;  // per-token upstream gradients (token weights)
  problem(std::int64_t n, std::int64_t h, std::int64_t v, unsigned seed) : N(n), H(h), V(v) {
    hidden = memkit_test::convert<T>(memkit_test::uniform_values(N * H, seed));
    head = memkit_test::convert<T>(memkit_test::uniform_values(V * H, seed + 1));
    for (std::int64_t i = 0; i < N; ++i) {
      targets.push_back(i % 5 == 3 ? -100 : static_cast<std::int32_t>((i * 7 + seed) % static_cast<std::uint64_t>(V)));
      d_loss.push_back(0.25f + 0.1f * static_cast<float>(i % 7) - (i % 4 == 1 ? 0.6f : 0.0f));  // some negative
    }
  }
  std::int64_t counted() const {
    std::int64_t c = 0;
    for (std::int32_t t : targets) c += t != -100;
    return c;
  }
};

struct outputs {
  std::vector<float> loss, d_hidden, d_head;
};

// One call with the dense head; d_loss none() when `weights` is empty. Gradients only when `gradients`.
template <class T>
outputs run(const problem<T>& p, const ls::cross_entropy_options& o, const std::vector<float>& weights,
            bool gradients = true, memkit::memory_resource& workspace = memkit::default_host_resource()) {
  outputs out;
  out.loss.assign(o.reduction == ls::reduction_mode::none ? static_cast<std::size_t>(p.N) : 1, -1.0f);
  std::vector<T> d_hidden(static_cast<std::size_t>(p.N * p.H));
  out.d_head.assign(static_cast<std::size_t>(p.V * p.H), 0.0f);
  const tensor_view<const float> w = weights.empty() ? tensor_view<const float>::none() : host_view(weights.data(), {p.N});
  ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {p.N, p.H}), host_view(p.head.data(), {p.V, p.H}),
                                 host_view(p.targets.data(), {p.N}), w,
                                 host_view(out.loss.data(), {static_cast<std::int64_t>(out.loss.size())}),
                                 gradients ? host_view(d_hidden.data(), {p.N, p.H}) : tensor_view<T>::none(),
                                 gradients ? host_view(out.d_head.data(), {p.V, p.H}) : tensor_view<float>::none(), o,
                                 workspace);
  for (const T& v : d_hidden) out.d_hidden.push_back(memkit::to_float(v));
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

template <class T>
void check_against_mean(const ls::cross_entropy_options& base) {
  const problem<T> p(37, 24, 53, 3);
  ls::cross_entropy_options none = base;
  none.reduction = ls::reduction_mode::none;
  const outputs mean = run(p, base, {});
  // d_loss = 1 / counted on every token: the mean's gradient, bit for bit (the same scale reaches every row).
  const float inv = 1.0f / static_cast<float>(p.counted());
  const outputs each = run(p, none, std::vector<float>(static_cast<std::size_t>(p.N), inv));
  double total = 0;
  for (std::int64_t i = 0; i < p.N; ++i) {
    total += each.loss[static_cast<std::size_t>(i)];
    if (p.targets[static_cast<std::size_t>(i)] == -100) CHECK(each.loss[static_cast<std::size_t>(i)] == 0.0f);
  }
  CHECK(static_cast<float>(total / static_cast<double>(p.counted())) == mean.loss[0]);  // the mean's own sum
  CHECK(same_bits(each.d_hidden, mean.d_hidden));
  CHECK(same_bits(each.d_head, mean.d_head));
  // The losses alone (no gradients, no d_loss) are the same values.
  const outputs alone = run(p, none, {}, false);
  CHECK(same_bits(alone.loss, each.loss));
}

}  // namespace

TEST_CASE("loss reduction none: per-token losses average to the mean; d_loss = 1/counted gives the mean's gradients") {
  check_against_mean<float>({.host_threads = 2});
  check_against_mean<memkit::bf16>({.chunk_bytes = 5 * 53 * 4, .host_threads = 2});
  check_against_mean<float>({.label_smoothing = 0.1f, .logit_softcap = 2.0f, .z_loss = 0.01f,
                             .chunk_bytes = 7 * 53 * 4, .host_threads = 1});
}

TEST_CASE("loss reduction none: gradients are those of sum_i d_loss_i * loss_i (finite differences)") {
  const problem<float> p(9, 5, 11, 7);
  const ls::cross_entropy_options o{.label_smoothing = 0.1f, .logit_softcap = 1.5f, .z_loss = 0.05f,
                                    .chunk_bytes = 2 * 11 * 4, .host_threads = 1,
                                    .reduction = ls::reduction_mode::none};
  const outputs analytic = run(p, o, p.d_loss);
  const auto objective = [&](const problem<float>& q) {
    const outputs r = run(q, o, {}, false);
    double j = 0;
    for (std::int64_t i = 0; i < q.N; ++i) j += double(p.d_loss[static_cast<std::size_t>(i)]) * r.loss[static_cast<std::size_t>(i)];
    return j;
  };
  const double worst =
      std::max(memkit_test::check_central_differences(p, &problem<float>::hidden, 2, 1e-2f, objective, analytic.d_hidden),
               memkit_test::check_central_differences(p, &problem<float>::head, 3, 1e-2f, objective, analytic.d_head));
  MESSAGE("reduction none vs finite differences: worst |difference| " << worst);
  // Ignored tokens get no gradient whatever their d_loss.
  for (std::int64_t i = 0; i < p.N; ++i)
    if (p.targets[static_cast<std::size_t>(i)] == -100)
      for (std::int64_t d = 0; d < p.H; ++d) CHECK(analytic.d_hidden[static_cast<std::size_t>(i * p.H + d)] == 0.0f);
}

TEST_CASE("loss reduction none: a quantized head gives the dense dequantized head's per-token losses and gradients") {
  problem<float> p(21, 64, 40, 5);
  namespace q = memkit::quant;
  const auto nf4 = q::quantized_tensor<q::NF4>::quantize(host, host_view(p.head.data(), {p.V, p.H}), {64, true},
                                                         memkit::default_host_resource());
  std::vector<float> dequantized(p.head.size());
  nf4.dequantize(host, host_view(dequantized));
  const ls::cross_entropy_options o{.host_threads = 1, .reduction = ls::reduction_mode::none};
  problem<float> dense = p;
  dense.head = dequantized;
  const outputs expected = run(dense, o, p.d_loss);
  std::vector<float> loss(static_cast<std::size_t>(p.N)), d_hidden(p.hidden.size());
  ls::fused_linear_cross_entropy(host, host_view(std::as_const(p.hidden).data(), {p.N, p.H}), nf4,
                                 host_view(p.targets.data(), {p.N}), host_view(p.d_loss.data(), {p.N}),
                                 host_view(loss.data(), {p.N}), host_view(d_hidden.data(), {p.N, p.H}),
                                 tensor_view<float>::none(), o, memkit::default_host_resource());
  for (std::size_t i = 0; i < loss.size(); ++i) CHECK(loss[i] == doctest::Approx(expected.loss[i]).epsilon(1e-5));
  for (std::size_t i = 0; i < d_hidden.size(); ++i)
    CHECK(d_hidden[i] == doctest::Approx(expected.d_hidden[i]).epsilon(1e-4).scale(1e-3));
}

TEST_CASE("loss reduction none: bad input is a clear memkit::error") {
  const problem<float> p(6, 4, 9, 1);
  ls::cross_entropy_options none{.reduction = ls::reduction_mode::none};
  std::vector<float> loss(6), one(1), d_hidden(p.hidden.size()), d_head(p.head.size());
  const auto call = [&](const ls::cross_entropy_options& o, tensor_view<const float> w, tensor_view<float> l) {
    ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {6, 4}), host_view(p.head.data(), {9, 4}),
                                   host_view(p.targets.data(), {6}), w, l, host_view(d_hidden.data(), {6, 4}),
                                   host_view(d_head.data(), {9, 4}), o, memkit::default_host_resource());
  };
  CHECK_THROWS_WITH_AS(call(none, host_view(p.d_loss.data(), {6}), host_view(one.data(), {1})),
                       doctest::Contains("with reduction none `loss` must be [6], one float per token"), memkit::error);
  CHECK_THROWS_WITH_AS(call(none, tensor_view<const float>::none(), host_view(loss.data(), {6})),
                       doctest::Contains("with reduction none the gradients need `d_loss` [6]"), memkit::error);
  CHECK_THROWS_WITH_AS(call(none, host_view(p.d_loss.data(), {5}), host_view(loss.data(), {6})),
                       doctest::Contains("`d_loss` has shape [5] but needs [6]"), memkit::error);
  CHECK_THROWS_WITH_AS(call({}, host_view(p.d_loss.data(), {6}), host_view(one.data(), {1})),
                       doctest::Contains("`d_loss` (per-token upstream gradients) goes with reduction none"),
                       memkit::error);
  std::vector<float> nan_weights = p.d_loss;
  nan_weights[4] = NAN;
  CHECK_THROWS_WITH_AS(call(none, host_view(nan_weights.data(), {6}), host_view(loss.data(), {6})),
                       doctest::Contains("`d_loss` of token 4 is NaN or Inf"), memkit::error);
  CHECK(std::all_of(d_head.begin(), d_head.end(), [](float x) { return x == 0.0f; }));
  // An empty batch writes nothing.
  std::vector<float> none_loss;
  ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {0, 4}), host_view(p.head.data(), {9, 4}),
                                 host_view(p.targets.data(), {0}), host_view(p.d_loss.data(), {0}),
                                 host_view(none_loss.data(), {0}), host_view(d_hidden.data(), {0, 4}),
                                 host_view(d_head.data(), {9, 4}), none, memkit::default_host_resource());
}

TEST_CASE("loss reduction none: the workspace a call takes is exactly the prediction (no row-loss buffer)") {
  for (const bool bf16 : {false, true})
    for (const int threads : {1, 2}) {
      const ls::cross_entropy_options o{.chunk_bytes = 6 * 500 * 4, .host_threads = threads,
                                        .reduction = ls::reduction_mode::none};
      const auto measure = [&](auto hidden_type) {
        using T = decltype(hidden_type);
        const problem<T> p(41, 96, 500, 2);
        memkit::tracking_resource workspace(memkit::default_host_resource(), "loss");
        (void)run(p, o, p.d_loss, true, workspace);
        const ls::fused_linear_cross_entropy_arguments args{.tokens = p.N, .hidden = p.H, .vocab = p.V,
                                                            .hidden_element_bytes = sizeof(T), .options = o};
        CHECK(workspace.peak_bytes() == ls::workspace_bytes(args));
        CHECK(workspace.current_bytes() == 0);
        ls::fused_linear_cross_entropy_arguments mean = args;
        mean.options.reduction = ls::reduction_mode::mean;
        CHECK(ls::workspace_bytes(mean) == ls::workspace_bytes(args) + static_cast<std::size_t>(p.N) * 4);
      };
      if (bf16) measure(memkit::bf16{});
      else measure(float{});
    }
}
