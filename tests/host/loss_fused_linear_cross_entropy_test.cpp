// loss::fused_linear_cross_entropy on the host against plain references (support/loss_reference.hpp): loss and
// gradients for every element type and option, ignore_index edge cases, finite differences, the quantized
// head, bad input, and the workspace it predicts against what a tracking_resource sees.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "memkit/loss/fused_linear_cross_entropy.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/memory/tracking.hpp"
#include "support/finite_differences.hpp"
#include "support/loss_reference.hpp"
#include "support/test_values.hpp"
#include "support/host_isa_scope.hpp"

namespace ls = memkit::loss;
namespace q = memkit::quant;
using memkit::host;
using memkit::host_view;
using memkit::tensor_view;

namespace {

template <class T>
std::vector<double> as_double(const std::vector<T>& values) {
  std::vector<double> out;
  out.reserve(values.size());
  for (const T& v : values) out.push_back(memkit::to_float(v));
  return out;
}

// Random targets in [0, V), every `ignore_every`-th token (if > 0) set to ignore_index.
std::vector<std::int32_t> random_targets(std::int64_t N, std::int64_t V, unsigned seed, int ignore_every,
                                         std::int64_t ignore_index = -100) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(N));
  std::uint32_t state = seed * 2654435761u + 12345u;
  for (std::int64_t i = 0; i < N; ++i) {
    state = state * 1664525u + 1013904223u;
    t[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((state >> 8) % static_cast<std::uint32_t>(V));
    if (ignore_every > 0 && i % ignore_every == ignore_every - 1) t[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(ignore_index);
  }
  return t;
}

// |actual - expected| <= tolerance * (max |expected| + floor), element by element.
template <class A>
void check_close(const std::vector<A>& actual, const std::vector<double>& expected, double tolerance, const char* what) {
  REQUIRE(actual.size() == expected.size());
  double scale = 1e-6;
  for (double e : expected) scale = std::max(scale, std::fabs(e));
  double worst = 0;
  for (std::size_t i = 0; i < actual.size(); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(memkit::to_float(actual[i])) - expected[i]));
  CAPTURE(what);
  CAPTURE(worst);
  CAPTURE(scale);
  CHECK(worst <= tolerance * scale);
}

struct run_outputs {
  float loss = 0;
  std::vector<float> d_hidden_f;  // as float
  std::vector<float> d_head;
};

template <class T>
struct problem {
  std::int64_t N, H, V;
  std::vector<T> hidden, head;
  std::vector<std::int32_t> targets;
  problem(std::int64_t n, std::int64_t h, std::int64_t v, unsigned seed, int ignore_every,
          std::int64_t ignore_index = -100)
      : N(n), H(h), V(v) {
    std::vector<float> x = memkit_test::uniform_values(N * H, seed), w = memkit_test::uniform_values(V * H, seed + 1);
    hidden = memkit_test::convert<T>(x);
    head = memkit_test::convert<T>(w);
    targets = random_targets(N, V, seed + 2, ignore_every, ignore_index);
  }
  memkit_test::naive_loss_result reference(const ls::cross_entropy_options& o) const {
    return memkit_test::naive_cross_entropy(as_double(hidden), as_double(head), targets, N, H, V,
                                            {o.ignore_index, o.label_smoothing, o.logit_softcap, o.z_loss});
  }
};

// Runs the fused loss with d_head starting at `d_head_start` (accumulated into).
template <class T, class Head>
run_outputs run_fused(const problem<T>& p, const Head& head, const ls::cross_entropy_options& o, bool want_head_grad,
                      float d_head_start, memkit::memory_resource& workspace) {
  run_outputs out;
  std::vector<T> d_hidden(static_cast<std::size_t>(p.N * p.H), memkit::from_float<T>(7.0f));
  out.d_head.assign(want_head_grad ? static_cast<std::size_t>(p.V * p.H) : 0, d_head_start);
  tensor_view<float> d_head_view;
  if (want_head_grad) d_head_view = host_view(out.d_head.data(), {p.V, p.H});
  ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {p.N, p.H}), head, host_view(p.targets.data(), {p.N}),
                                 host_view(&out.loss, {1}), host_view(d_hidden.data(), {p.N, p.H}), d_head_view, o,
                                 workspace);
  for (const T& v : d_hidden) out.d_hidden_f.push_back(memkit::to_float(v));
  return out;
}

template <class T>
run_outputs run_dense(const problem<T>& p, const ls::cross_entropy_options& o, float d_head_start = 0.0f) {
  return run_fused(p, host_view(p.head.data(), {p.V, p.H}), o, true, d_head_start, memkit::default_host_resource());
}

template <class T>
void check_against_naive(const ls::cross_entropy_options& o, std::int64_t N, std::int64_t H, std::int64_t V) {
  const problem<T> p(N, H, V, 11, 4, o.ignore_index);
  const auto ref = p.reference(o);
  const float start = 0.25f;
  const run_outputs out = run_dense(p, o, start);
  const bool fp32 = std::is_same_v<T, float>;
  CHECK(std::fabs(out.loss - ref.loss) <= 2e-5 * std::max(1.0, std::fabs(ref.loss)));
  check_close(out.d_hidden_f, ref.d_hidden, fp32 ? 1e-4 : 1e-2, "d_hidden");  // 16-bit d_hidden is rounded
  std::vector<double> head_expected = ref.d_head;
  for (double& v : head_expected) v += start;
  check_close(out.d_head, head_expected, 1e-5, "d_head (accumulated onto 0.25)");
}

}  // namespace

TEST_CASE("loss: chunk size follows the byte budget") {
  ls::cross_entropy_options o;
  CHECK(ls::chunk_tokens(8192, 32000, 2, o) == static_cast<std::int64_t>(ls::default_chunk_bytes / (32000 * 4)));
  o.chunk_bytes = 10 * 1000 * 4 + 5;
  CHECK(ls::chunk_tokens(100, 1000, 4, o) == 10);
  CHECK(ls::chunk_tokens(5, 1000, 4, o) == 5);      // never more than N
  o.chunk_bytes = 1;
  CHECK(ls::chunk_tokens(100, 1000, 4, o) == 1);    // never less than one token
  o.chunk_bytes = 10 * 1000 * (4 + 2);               // a device with 16-bit hidden also holds the 16-bit gradient
  CHECK(ls::chunk_tokens(100, 1000, 2, o, true) == 10);
  CHECK(ls::chunk_tokens(100, 1000, 4, o, true) == 15);
}

TEST_CASE("loss: the chunk chosen from a memory budget fits it, one token more does not, and is what the call takes") {
  CHECK(ls::tokens_per_chunk(10 * 1000 * 4 + 5, 1000, 4) == 10);
  CHECK(ls::tokens_per_chunk(1000 * 4 - 1, 1000, 4) == 0);  // not even one token's logits
  CHECK(ls::chunk_bytes_for(10, 1000, 2, true) == 10 * 1000 * (4 + 2));
  CHECK(ls::tokens_per_chunk(ls::chunk_bytes_for(37, 1000, 2, true), 1000, 2, true) == 37);
  // Device, bf16: the workspace is linear in the chunk, so the answer is exact and easy to state.
  ls::fused_linear_cross_entropy_arguments d{.tokens = 4096, .hidden = 512, .vocab = 32000, .hidden_element_bytes = 2,
                                             .on_device = true};
  const auto with_chunk = [](ls::fused_linear_cross_entropy_arguments a, std::int64_t c) {
    a.options.chunk_bytes = ls::chunk_bytes_for(c, a.vocab, a.hidden_element_bytes, a.on_device);
    return ls::bytes_required(a);
  };
  const std::size_t fixed = with_chunk(d, 1) - 32000 * 6;  // per-token losses and counters
  CHECK(ls::chunk_tokens_within(d, fixed + 100 * 32000 * 6 + 5) == 100);
  CHECK(ls::chunk_tokens_within(d, fixed + 100 * 32000 * 6 + 5, 64) == 64);  // at most `most`
  CHECK(ls::chunk_tokens_within(d, fixed + 32000 * 6 - 1) == 0);              // one token's chunk does not fit
  CHECK(ls::chunk_tokens_within(d, std::size_t{1} << 40) == d.tokens);       // never more than N
  static_assert(ls::chunk_tokens_within({.tokens = 8192, .hidden = 4096, .vocab = 128256, .hidden_element_bytes = 2,
                                         .on_device = true},
                                        std::size_t{1} << 30) > 0);
  // Host: the GEMM's packing buffers depend on the chunk too; the tracker sees exactly bytes_required, at most
  // the budget, and one token more would not have fitted.
  const problem<memkit::bf16> p(300, 48, 700, 9, 5);
  ls::fused_linear_cross_entropy_arguments h{.tokens = p.N, .hidden = p.H, .vocab = p.V, .hidden_element_bytes = 2,
                                             .options = {.host_threads = 2}};
  for (std::size_t available : {std::size_t{200} << 10, std::size_t{400} << 10, std::size_t{1} << 20}) {
    CAPTURE(available);
    const std::int64_t c = ls::chunk_tokens_within(h, available);
    REQUIRE(c > 0);
    CHECK(with_chunk(h, c) <= available);
    if (c < p.N) CHECK(with_chunk(h, c + 1) > available);
    ls::cross_entropy_options o = h.options;
    o.chunk_bytes = ls::chunk_bytes_for(c, p.V, 2);
    CHECK(ls::chunk_tokens(p.N, p.V, 2, o) == c);
    memkit::tracking_resource workspace(memkit::default_host_resource(), "loss");
    run_fused(p, host_view(p.head.data(), {p.V, p.H}), o, true, 0.0f, workspace);
    CHECK(workspace.peak_bytes() == with_chunk(h, c));
  }
}

TEST_CASE("loss: no chunk's logits span 2^31 elements (one cuBLAS operand), whatever the memory") {
  // Llama 3's 128,256-token vocabulary: 16,743 rows span 2,147,390,208 elements, 16,744 would span 2^31 + 34,816.
  constexpr std::int64_t V = 128256;
  static_assert(ls::max_chunk_tokens(V) == 16743);
  CHECK(16743 * V <= 2147483647);
  CHECK(16744 * V > 2147483647);
  CHECK(ls::max_chunk_tokens(2147483647) == 1);
  CHECK(ls::max_chunk_tokens(1) == 2147483647);
  // ~96K tokens of an 8B model on a device with all the memory in the world: the chunk stops at the limit.
  ls::cross_entropy_options o{.chunk_bytes = std::size_t{1} << 45};
  CHECK(ls::chunk_tokens(96 * 1024, V, 2, o, true) == 16743);
  CHECK(ls::chunk_tokens(96 * 1024, V, 4, o, false) == 16743);  // the host chunks alike
  CHECK(ls::chunk_tokens(1000, V, 2, o, true) == 1000);         // below it, the rule is unchanged
  ls::fused_linear_cross_entropy_arguments d{.tokens = 96 * 1024, .hidden = 4096, .vocab = V, .hidden_element_bytes = 2,
                                             .on_device = true};
  const auto with_chunk = [](ls::fused_linear_cross_entropy_arguments a, std::int64_t c) {
    a.options.chunk_bytes = ls::chunk_bytes_for(c, a.vocab, a.hidden_element_bytes, a.on_device);
    return ls::bytes_required(a);
  };
  CHECK(ls::chunk_tokens_within(d, std::size_t{80} << 30) == 16743);
  CHECK(ls::chunk_tokens_within(d, std::size_t{80} << 30, 20000) == 16743);  // `most` cannot lift it
  CHECK(ls::chunk_tokens_within(d, std::size_t{80} << 30, 9000) == 9000);
  // The byte functions count the chunk that runs: asking for more than the limit costs the limit's bytes.
  CHECK(with_chunk(d, 16744) == with_chunk(d, 16743));
  CHECK(with_chunk(d, 96 * 1024) == with_chunk(d, 16743));
  CHECK(with_chunk(d, 16742) < with_chunk(d, 16743));
  // Memory short of the limit: the memory decides, as before.
  const std::size_t fixed = with_chunk(d, 1) - static_cast<std::size_t>(V) * 6;
  CHECK(ls::chunk_tokens_within(d, fixed + std::size_t{5000} * V * 6) == 5000);
}

TEST_CASE("loss: matches the double-precision reference (fp32, bf16, fp16; every option; several chunks)") {
  struct named_options {
    std::string name;
    ls::cross_entropy_options options;
  };
  const named_options cases[] = {
      {"plain", {}},
      {"label smoothing 0.1", {.label_smoothing = 0.1f}},
      {"soft-cap 2", {.logit_softcap = 2.0f}},
      {"z-loss 1e-2", {.z_loss = 1e-2f}},
      {"all three, ignore_index 0", {.ignore_index = 0, .label_smoothing = 0.2f, .logit_softcap = 1.5f, .z_loss = 1e-3f}},
  };
  for (const auto& c : cases) {
    for (std::size_t chunk_bytes : {std::size_t{0}, std::size_t{7 * 70 * 4}}) {  // one chunk; chunks of 7 tokens
      ls::cross_entropy_options o = c.options;
      o.chunk_bytes = chunk_bytes;
      o.host_threads = 2;
      CAPTURE(c.name);
      CAPTURE(chunk_bytes);
      check_against_naive<float>(o, 37, 24, 70);
      check_against_naive<memkit::bf16>(o, 37, 24, 70);
      check_against_naive<memkit::fp16>(o, 37, 24, 70);
    }
  }
}

TEST_CASE("loss: a bf16 head under fp32 hidden states, and large H and V (several GEMM blocks)") {
  const problem<float> p(40, 300, 2100, 5, 3);
  problem<memkit::bf16> p16(40, 300, 2100, 5, 3);
  std::vector<memkit::bf16> head16 = memkit_test::convert<memkit::bf16>(memkit_test::uniform_values(2100 * 300, 6));
  ls::cross_entropy_options o{.label_smoothing = 0.05f, .chunk_bytes = 16 * 2100 * 4, .host_threads = 2};
  const auto ref = memkit_test::naive_cross_entropy(as_double(p.hidden), as_double(head16), p.targets, p.N, p.H, p.V,
                                                    {o.ignore_index, o.label_smoothing, 0, 0});
  const run_outputs out = run_fused(p, host_view(head16.data(), {p.V, p.H}), o, true, 0.0f, memkit::default_host_resource());
  CHECK(std::fabs(out.loss - ref.loss) <= 2e-5 * std::fabs(ref.loss));
  check_close(out.d_hidden_f, ref.d_hidden, 1e-4, "d_hidden");
  check_close(out.d_head, ref.d_head, 1e-4, "d_head");
}

TEST_CASE("loss: ignored tokens are exact zeros; an all-ignored batch has loss 0 and leaves d_head alone") {
  const problem<float> p(20, 16, 50, 3, 3);
  const ls::cross_entropy_options o{.label_smoothing = 0.1f, .z_loss = 1e-3f, .chunk_bytes = 6 * 50 * 4};
  const run_outputs out = run_dense(p, o);
  for (std::int64_t i = 0; i < p.N; ++i) {
    if (p.targets[static_cast<std::size_t>(i)] != o.ignore_index) continue;
    for (std::int64_t k = 0; k < p.H; ++k) CHECK(out.d_hidden_f[static_cast<std::size_t>(i * p.H + k)] == 0.0f);
  }
  // The loss over the counted tokens alone is the same loss: the ignored ones add nothing.
  problem<float> counted_only = p;
  counted_only.hidden.clear();
  counted_only.targets.clear();
  for (std::int64_t i = 0; i < p.N; ++i) {
    if (p.targets[static_cast<std::size_t>(i)] == o.ignore_index) continue;
    counted_only.targets.push_back(p.targets[static_cast<std::size_t>(i)]);
    counted_only.hidden.insert(counted_only.hidden.end(), p.hidden.begin() + i * p.H, p.hidden.begin() + (i + 1) * p.H);
  }
  counted_only.N = static_cast<std::int64_t>(counted_only.targets.size());
  const run_outputs without = run_dense(counted_only, o);
  CHECK(without.loss == doctest::Approx(out.loss).epsilon(1e-6));
  check_close(out.d_head, std::vector<double>(without.d_head.begin(), without.d_head.end()), 1e-6, "d_head");

  problem<float> all_ignored = p;
  for (auto& t : all_ignored.targets) t = static_cast<std::int32_t>(o.ignore_index);
  const run_outputs none = run_dense(all_ignored, o, 0.5f);
  CHECK(none.loss == 0.0f);
  for (float v : none.d_hidden_f) CHECK(v == 0.0f);
  for (float v : none.d_head) CHECK(v == 0.5f);

  problem<float> no_tokens(0, 16, 50, 3, 0);
  const run_outputs empty = run_dense(no_tokens, o);
  CHECK(empty.loss == 0.0f);
}

TEST_CASE("loss: gradients agree with central finite differences of the loss") {
  problem<float> p(6, 5, 9, 21, 5);
  const ls::cross_entropy_options o{.label_smoothing = 0.1f, .logit_softcap = 1.5f, .z_loss = 0.05f,
                                    .chunk_bytes = 2 * 9 * 4, .host_threads = 1};
  const run_outputs analytic = run_dense(p, o);
  const auto loss_at = [&](const problem<float>& q) {
    float l = 0;
    ls::fused_linear_cross_entropy(host, host_view(q.hidden.data(), {q.N, q.H}), host_view(q.head.data(), {q.V, q.H}),
                                   host_view(q.targets.data(), {q.N}), host_view(&l, {1}), tensor_view<float>{},
                                   tensor_view<float>{}, o, memkit::default_host_resource());
    return static_cast<double>(l);
  };
  memkit_test::check_central_differences(p, &problem<float>::hidden, 3, 1e-2f, loss_at, analytic.d_hidden_f);
  memkit_test::check_central_differences(p, &problem<float>::head, 4, 1e-2f, loss_at, analytic.d_head);
}

TEST_CASE("loss: the result does not depend on the thread count; d_hidden may alias hidden") {
  const problem<memkit::bf16> p(53, 40, 300, 8, 6);
  ls::cross_entropy_options o{.logit_softcap = 3.0f, .chunk_bytes = 9 * 300 * 4, .host_threads = 1};
  const run_outputs one = run_dense(p, o);
  for (int threads : {2, 3}) {
    o.host_threads = threads;
    const run_outputs many = run_dense(p, o);
    CHECK(std::memcmp(&many.loss, &one.loss, sizeof(float)) == 0);
    CHECK(many.d_hidden_f == one.d_hidden_f);
    CHECK(many.d_head == one.d_head);
  }
  std::vector<memkit::bf16> in_place = p.hidden;
  std::vector<float> d_head(static_cast<std::size_t>(p.V * p.H), 0.0f);
  float l = 0;
  ls::fused_linear_cross_entropy(host, host_view(in_place.data(), {p.N, p.H}), host_view(p.head.data(), {p.V, p.H}),
                                 host_view(p.targets.data(), {p.N}), host_view(&l, {1}),
                                 host_view(in_place.data(), {p.N, p.H}), host_view(d_head.data(), {p.V, p.H}), o,
                                 memkit::default_host_resource());
  CHECK(l == one.loss);
  for (std::size_t i = 0; i < in_place.size(); ++i) CHECK(memkit::to_float(in_place[i]) == one.d_hidden_f[i]);
  CHECK(d_head == one.d_head);
}


// row_pass picks a CUDA kernel; the host has one row pass, so `staged` must neither be refused there nor change a
// bit or a byte (docs/loss.md, "The device row pass"). The device's classic-vs-staged bits are tests/cuda's.
TEST_CASE("loss: row_pass = staged is accepted on the host and changes no bit and no byte count") {
  const problem<memkit::bf16> p(37, 24, 250, 5, 5);
  ls::cross_entropy_options classic{.logit_softcap = 2.0f, .z_loss = 1e-3f, .chunk_bytes = 7 * 250 * 4};
  ls::cross_entropy_options staged = classic;
  staged.row_pass = ls::device_row_pass::staged;
  const run_outputs a = run_dense(p, classic), b = run_dense(p, staged);
  CHECK(std::memcmp(&a.loss, &b.loss, sizeof(float)) == 0);
  CHECK(a.d_hidden_f == b.d_hidden_f);
  CHECK(a.d_head == b.d_head);
  for (const bool on_device : {false, true}) {
    ls::fused_linear_cross_entropy_arguments args{.tokens = p.N, .hidden = p.H, .vocab = p.V,
                                                   .hidden_element_bytes = 2, .on_device = on_device,
                                                   .options = classic};
    const std::size_t classic_bytes = ls::workspace_bytes(args);
    args.options = staged;
    CHECK(ls::workspace_bytes(args) == classic_bytes);
  }
}
TEST_CASE("loss: a quantized head (NF4, int8; one tile and several) matches the dense dequantized head") {
  // V * H above quantized_tile_values makes several tiles.
  for (std::int64_t V : {std::int64_t{300}, std::int64_t{1100}}) {
    const std::int64_t H = V == 300 ? 64 : 4096;
    CAPTURE(V);
    const problem<float> p(12, H, V, 31, 5);
    const auto nf4 = q::quantized_tensor<q::NF4>::quantize(host, host_view(p.head.data(), {V, H}), {64, true},
                                                           memkit::default_host_resource());
    const auto int8 = q::quantized_tensor<q::INT8>::quantize(host, host_view(p.head.data(), {V, H}), {256, false},
                                                             memkit::default_host_resource());
    CHECK((ls::detail::head_tile_rows(V, H) < V) == (V == 1100));
    const ls::cross_entropy_options o{.label_smoothing = 0.1f, .chunk_bytes = 5 * 1100 * 4, .host_threads = 2};
    const auto check_head = [&](const auto& quantized, auto hidden_type) {
      using T = decltype(hidden_type);
      problem<T> pt(12, H, V, 31, 5);
      std::vector<float> dense(static_cast<std::size_t>(V * H));
      quantized.dequantize(host, host_view(dense));
      const auto ref = memkit_test::naive_cross_entropy(as_double(pt.hidden), std::vector<double>(dense.begin(), dense.end()),
                                                        pt.targets, pt.N, H, V, {o.ignore_index, o.label_smoothing, 0, 0});
      memkit::tracking_resource workspace(memkit::default_host_resource(), "loss");
      const run_outputs out = run_fused(pt, quantized, o, false, 0.0f, workspace);
      CHECK(std::fabs(out.loss - ref.loss) <= 2e-5 * std::fabs(ref.loss));
      check_close(out.d_hidden_f, ref.d_hidden, std::is_same_v<T, float> ? 1e-4 : 1e-2, "d_hidden");
      CHECK(workspace.peak_bytes() ==
            ls::workspace_bytes({.tokens = pt.N, .hidden = H, .vocab = V, .hidden_element_bytes = sizeof(T),
                                 .quantized_head = true, .head_grad = false, .options = o}));
      CHECK(workspace.current_bytes() == 0);
    };
    check_head(nf4, float{});
    check_head(nf4, memkit::bf16{});
    check_head(int8, float{});
  }
}

TEST_CASE("loss: bad input is a clear memkit::error and writes nothing") {
  problem<float> p(8, 6, 10, 4, 0);
  const ls::cross_entropy_options o{};
  std::vector<float> d_hidden(static_cast<std::size_t>(p.N * p.H), 3.0f), d_head(static_cast<std::size_t>(p.V * p.H), 2.0f);
  float l = 9.0f;
  const auto call = [&](const problem<float>& q, const ls::cross_entropy_options& options) {
    ls::fused_linear_cross_entropy(host, host_view(q.hidden.data(), {q.N, q.H}), host_view(q.head.data(), {q.V, q.H}),
                                   host_view(q.targets.data(), {q.N}), host_view(&l, {1}),
                                   host_view(d_hidden.data(), {p.N, p.H}), host_view(d_head.data(), {p.V, p.H}), options,
                                   memkit::default_host_resource());
  };
  const auto untouched = [&] {
    CHECK(l == 9.0f);
    for (float v : d_hidden) CHECK(v == 3.0f);
    for (float v : d_head) CHECK(v == 2.0f);
  };
  {
    problem<float> bad = p;
    bad.targets[3] = 10;
    CHECK_THROWS_WITH_AS(call(bad, o), doctest::Contains("target id 10 of token 3 is outside the vocabulary [0, 10)"),
                         memkit::error);
    bad.targets[3] = -1;
    CHECK_THROWS_WITH_AS(call(bad, o), doctest::Contains("target id -1 of token 3"), memkit::error);
    untouched();
  }
  {
    problem<float> bad = p;
    bad.hidden[2 * p.H + 1] = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS_WITH_AS(call(bad, o), doctest::Contains("`hidden` has a NaN or Inf value in row 2"), memkit::error);
    bad = p;
    bad.head[7 * p.H] = std::numeric_limits<float>::infinity();
    CHECK_THROWS_WITH_AS(call(bad, o), doctest::Contains("`head` has a NaN or Inf value in row 7"), memkit::error);
    bad = p;
    bad.hidden[0] = 1e20f;
    bad.head[0] = 1e20f;
    CHECK_THROWS_WITH_AS(call(bad, o), doctest::Contains("the logits could overflow fp32"), memkit::error);
    untouched();
  }
  {
    // NaN in an ignored token's hidden state still poisons d_head (0 * NaN), so it is rejected too.
    problem<float> bad = p;
    bad.targets[5] = -100;
    bad.hidden[5 * p.H] = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS_AS(call(bad, o), memkit::error);
    untouched();
  }
  // Shapes and options.
  const auto expect = [&](auto&& body, const char* message) {
    CHECK_THROWS_WITH_AS(body(), doctest::Contains(message), memkit::error);
    untouched();
  };
  expect([&] {
    ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {p.N, p.H}), host_view(p.head.data(), {p.H, p.V}),
                                   host_view(p.targets.data(), {p.N}), host_view(&l, {1}), tensor_view<float>{},
                                   tensor_view<float>{}, o, memkit::default_host_resource());
  }, "`head` has shape [6, 10] but `hidden` [8, 6] needs [vocab, 6]");
  expect([&] {
    ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {p.N, p.H}), host_view(p.head.data(), {p.V, p.H}),
                                   host_view(p.targets.data(), {p.N - 1}), host_view(&l, {1}), tensor_view<float>{},
                                   tensor_view<float>{}, o, memkit::default_host_resource());
  }, "`targets` has shape [7] but needs [8]");
  expect([&] {
    ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {p.N, p.H}), host_view(p.head.data(), {p.V, p.H}),
                                   host_view(p.targets.data(), {p.N}), host_view(&l, {1}),
                                   host_view(d_hidden.data(), {p.H, p.N}), tensor_view<float>{}, o,
                                   memkit::default_host_resource());
  }, "`d_hidden` has shape [6, 8]");
  expect([&] {
    ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {p.N, p.H}), host_view(p.head.data(), {p.V, p.H}),
                                   host_view(p.targets.data(), {p.N}), host_view(&l, {1}), tensor_view<float>{},
                                   host_view(d_head.data(), {p.V * p.H}), o, memkit::default_host_resource());
  }, "`d_head` has shape [60]");
  expect([&] {
    ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {p.N, p.H}), host_view(p.head.data(), {p.V, p.H}),
                                   host_view(p.targets.data(), {p.N}), host_view(d_head.data(), {2}),
                                   tensor_view<float>{}, tensor_view<float>{}, o, memkit::default_host_resource());
  }, "`loss` must hold 1 float");
  expect([&] { call(p, {.label_smoothing = 1.5f}); }, "label_smoothing must be in [0, 1]");
  expect([&] { call(p, {.logit_softcap = -1.0f}); }, "logit_softcap must be >= 0");
  expect([&] { call(p, {.z_loss = std::numeric_limits<float>::quiet_NaN()}); }, "z_loss must be >= 0 and finite");
  expect([&] {
    ls::fused_linear_cross_entropy(host, tensor_view<const float>(p.hidden.data(), {p.N, p.H}, memkit::memory_kind::device),
                                   host_view(p.head.data(), {p.V, p.H}), host_view(p.targets.data(), {p.N}),
                                   host_view(&l, {1}), tensor_view<float>{}, tensor_view<float>{}, o,
                                   memkit::default_host_resource());
  }, "`hidden` is in device memory");
  // A quantized head: frozen, and its scales are checked like a dense head's values.
  auto nf4 = q::quantized_tensor<q::NF4>::quantize(host, host_view(p.head.data(), {p.V, p.H}), {32, false},
                                                   memkit::default_host_resource());
  expect([&] {
    ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {p.N, p.H}), nf4, host_view(p.targets.data(), {p.N}),
                                   host_view(&l, {1}), tensor_view<float>{}, host_view(d_head.data(), {p.V, p.H}), o,
                                   memkit::default_host_resource());
  }, "a quantized head is frozen");
  nf4.absmax()[1] = std::numeric_limits<float>::quiet_NaN();
  expect([&] {
    ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {p.N, p.H}), nf4, host_view(p.targets.data(), {p.N}),
                                   host_view(&l, {1}), host_view(d_hidden.data(), {p.N, p.H}), tensor_view<float>{}, o,
                                   memkit::default_host_resource());
  }, "`head` has a NaN or Inf value in row");
}

TEST_CASE("loss: the workspace a call takes is exactly the prediction") {
  struct config {
    std::string name;
    bool bf16_hidden, head_grad, hidden_grad;
    std::size_t chunk_bytes;
  };
  const config configs[] = {
      {"fp32, both gradients, chunks of 8", false, true, true, 8 * 500 * 4},
      {"bf16, both gradients, chunks of 5", true, true, true, 5 * 500 * 4},
      {"bf16, frozen head", true, false, true, 0},
      {"fp32, loss only", false, false, false, 3 * 500 * 4},
  };
  for (const config& c : configs) {
    CAPTURE(c.name);
    for (int threads : {1, 2}) {
      const ls::cross_entropy_options o{.chunk_bytes = c.chunk_bytes, .host_threads = threads};
      const auto measure = [&](auto hidden_type) {
        using T = decltype(hidden_type);
        problem<T> p(41, 280, 500, 2, 7);
        memkit::tracking_resource workspace(memkit::default_host_resource(), "loss");
        std::vector<T> d_hidden(static_cast<std::size_t>(p.N * p.H));
        std::vector<float> d_head(static_cast<std::size_t>(p.V * p.H), 0.0f);
        float l = 0;
        ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {p.N, p.H}), host_view(p.head.data(), {p.V, p.H}),
                                       host_view(p.targets.data(), {p.N}), host_view(&l, {1}),
                                       c.hidden_grad ? host_view(d_hidden.data(), {p.N, p.H}) : tensor_view<T>{},
                                       c.head_grad ? host_view(d_head.data(), {p.V, p.H}) : tensor_view<float>{}, o,
                                       workspace);
        const ls::fused_linear_cross_entropy_arguments args{.tokens = p.N, .hidden = p.H, .vocab = p.V,
                                                            .hidden_element_bytes = sizeof(T), .head_grad = c.head_grad,
                                                            .hidden_grad = c.hidden_grad, .options = o};
        static_assert(memkit::operation_arguments<ls::fused_linear_cross_entropy_arguments>);
        CHECK(workspace.peak_bytes() == ls::workspace_bytes(args));
        CHECK(ls::bytes_required(args) == ls::workspace_bytes(args));
        CHECK(ls::saved_bytes(args) == 0);
        CHECK(workspace.current_bytes() == 0);
      };
      if (c.bf16_hidden) measure(memkit::bf16{});
      else measure(float{});
    }
  }
  // The device count (cuBLAS takes no workspace from memkit): logits, row losses, counters, 16-bit gradient.
  const ls::cross_entropy_options o{.chunk_bytes = 10 * 1000 * 6};
  CHECK(ls::workspace_bytes({.tokens = 100, .hidden = 64, .vocab = 1000, .hidden_element_bytes = 2, .on_device = true,
                             .options = o}) == 10 * 1000 * 4 + 100 * 4 + 8 + 10 * 1000 * 2);
  static_assert(ls::workspace_bytes({.tokens = 8192, .hidden = 4096, .vocab = 128256, .hidden_element_bytes = 2,
                                     .on_device = true}) > 0);
}

TEST_CASE("loss: at a realistic vocabulary the peak is a small fraction of the materialized logits'" * doctest::test_suite("scale")) {
  // 8192 tokens of a 32000-token vocabulary (Llama 2), a small hidden size so the test stays quick.
  const std::int64_t N = 8192, H = 16, V = 32000;
  const problem<memkit::bf16> p(N, H, V, 9, 10);
  const ls::cross_entropy_options o{.host_threads = 2};
  memkit::tracking_resource fused_workspace(memkit::default_host_resource(), "fused");
  std::vector<memkit::bf16> d_hidden(static_cast<std::size_t>(N * H));
  std::vector<float> d_head(static_cast<std::size_t>(V * H), 0.0f);
  float fused_loss = 0;
  ls::fused_linear_cross_entropy(host, host_view(p.hidden.data(), {N, H}), host_view(p.head.data(), {V, H}),
                                 host_view(p.targets.data(), {N}), host_view(&fused_loss, {1}),
                                 host_view(d_hidden.data(), {N, H}), host_view(d_head.data(), {V, H}), o, fused_workspace);
  CHECK(fused_workspace.peak_bytes() == ls::workspace_bytes({.tokens = N, .hidden = H, .vocab = V, .hidden_element_bytes = 2, .options = o}));

  memkit::tracking_resource materialized_workspace(memkit::default_host_resource(), "materialized");
  std::vector<memkit::bf16> d_hidden_m(static_cast<std::size_t>(N * H));
  std::vector<float> d_head_m(static_cast<std::size_t>(V * H), 0.0f);
  const float materialized_loss = memkit_test::materialized_cross_entropy(
      p.hidden.data(), p.head.data(), p.targets.data(), N, H, V, d_hidden_m.data(), d_head_m.data(),
      materialized_workspace, 2);
  CHECK(materialized_workspace.peak_bytes() == memkit_test::materialized_workspace_bytes<memkit::bf16, memkit::bf16>(N, H, V, 2));
  CHECK(fused_loss == doctest::Approx(materialized_loss).epsilon(1e-5));
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < d_head.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::fabs(d_head[i] - d_head_m[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(d_head_m[i])));
  }
  CHECK(worst <= 1e-4 * scale);
  const double ratio = static_cast<double>(fused_workspace.peak_bytes()) / static_cast<double>(materialized_workspace.peak_bytes());
  MESSAGE("N=8192 V=32000 H=16 bf16: fused peak " << fused_workspace.peak_bytes() << " B, materialized peak "
                                                  << materialized_workspace.peak_bytes() << " B, ratio " << ratio);
  CHECK(ratio < 0.05);
}

TEST_CASE("loss: the host row pass gives the same bits with AVX-512, AVX2 and portable C++") {
  const ls::cross_entropy_options options[] = {
      {.host_threads = 1},
      {.ignore_index = 5, .label_smoothing = 0.1f, .logit_softcap = 2.5f, .z_loss = 1e-2f, .host_threads = 1}};
  for (const auto& o : options) {
    const problem<float> p(19, 24, 203, 13, 4, o.ignore_index);  // V = 203: whole 16-lane blocks and a tail
    const run_outputs widest = run_dense(p, o);
    for (memkit::host_isa isa : {memkit::host_isa::avx2, memkit::host_isa::portable}) {
      CAPTURE(memkit::to_string(isa));
      const run_outputs narrower = [&] {
        const memkit_test::host_isa_cap cap(isa);
        return run_dense(p, o);
      }();
      // The loss comes from the row pass alone; the gradients also pass through the GEMM, whose AVX2 and
      // AVX-512 kernels agree bit for bit but whose portable kernel (no FMA) rounds differently.
      CHECK(std::memcmp(&narrower.loss, &widest.loss, sizeof(float)) == 0);
      if (isa == memkit::host_isa::avx2) {
        CHECK(narrower.d_hidden_f == widest.d_hidden_f);
        CHECK(narrower.d_head == widest.d_head);
      }
    }
  }
  // The row pass itself (logits in, gradient out) on every instruction set, with and without soft-capping.
  const std::vector<float> logits = memkit_test::uniform_values(203, 17);
  for (float softcap : {0.0f, 2.5f}) {
    const ls::detail::row_math math{softcap, 1e-2f, 0.1f, 203};
    std::vector<float> widest = logits;
    const float widest_loss = ls::detail::host_row(math, widest.data(), 203, 7, 0.01f);
    for (memkit::host_isa isa : {memkit::host_isa::avx2, memkit::host_isa::portable}) {
      CAPTURE(memkit::to_string(isa));
      std::vector<float> row = logits;
      const float loss = [&] {
        const memkit_test::host_isa_cap cap(isa);
        return ls::detail::host_row(math, row.data(), 203, 7, 0.01f);
      }();
      CHECK(std::memcmp(&loss, &widest_loss, sizeof(float)) == 0);
      CHECK(std::memcmp(row.data(), widest.data(), row.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("loss: the host pass's exp is within 2 ulp of std::exp over its whole range") {
  double worst = 0;
  for (float x = -87.0f; x <= 0.0f; x += 0.0013f) {
    const double expected = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(ls::detail::fast_exp::scalar(x) - expected) / expected);
  }
  CHECK(ls::detail::fast_exp::scalar(0.0f) == 1.0f);
  CHECK(ls::detail::fast_exp::scalar(-1000.0f) > 0.0f);  // clamped at -87, never 0 * Inf or a denormal
  MESSAGE("fast_exp: worst relative error " << worst);
  CHECK(worst <= 2.4e-7);
}
