// The main example's model pieces (examples/llama): gradients against central finite differences, the
// saved bytes and workspace each layer states, and a checkpointed stack against the plain one.
#include <memkit/models/llama/block.hpp>

#include <memkit/loss/fused_linear_cross_entropy.hpp>

#include <memkit/checkpoint/segment.hpp>
#include <memkit/memory/tracking.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "support/tracked_memory.hpp"

namespace llama = memkit::models::llama;

namespace {

using memkit::shape;
using memkit::tensor_view;
using block_f = llama::decoder_block<float, memkit::layers::dense_linear<float>>;

llama::model_config small_config() {
  return {.vocab = 23, .hidden = 16, .layers = 2, .heads = 4, .kv_heads = 2, .head_dim = 4, .intermediate = 24,
          .max_positions = 8};
}

std::vector<float> random_vector(std::size_t n, std::uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

struct block_fixture {
  llama::model_config config = small_config();
  memkit::tracking_resource tracker{memkit::default_host_resource(), "example layers"};
  memkit::layers::memory_resources memory;
  llama::rotary<float> rope;
  block_f block;

  block_fixture()
      : memory(memkit_test::tracked_resources(tracker, 2)), rope(4, 8, 10000.0f, tracker.category(memkit::memory_category::other)) {
    const auto mode = memkit::layers::trainability::bf16_master;
    auto linear = [&](const char* name, std::int64_t in, std::int64_t out, std::uint64_t stream) {
      memkit::layers::dense_linear<float> l(name, in, out, memory, mode);
      l.weight.init_normal(0.4f, 7, stream);
      return l;
    };
    const std::int64_t h = config.hidden, q = config.heads * config.head_dim, kv = config.kv_heads * config.head_dim,
                       f = config.intermediate;
    block = block_f{config,
                    llama::rms_norm<float>("attn_norm", h, memory, mode),
                    llama::rms_norm<float>("mlp_norm", h, memory, mode),
                    linear("q", h, q, 1),
                    linear("k", h, kv, 2),
                    linear("v", h, kv, 3),
                    linear("o", q, h, 4),
                    linear("gate", h, f, 5),
                    linear("up", h, f, 6),
                    linear("down", f, h, 7),
                    {},
                    &rope,
                    memory,
                    {},
                    {},
                    0};
    // Norm weights away from 1, so their gradients are exercised.
    block.attn_norm.weight.init_normal(0.3f, 8, 8);
    block.mlp_norm.weight.init_normal(0.3f, 8, 9);
    for (std::int64_t i = 0; i < h; ++i) {
      block.attn_norm.weight.value.data()[i] = 1.0f + block.attn_norm.weight.value.data()[i];
      block.mlp_norm.weight.value.data()[i] = 1.0f + block.mlp_norm.weight.value.data()[i];
    }
  }

  // L = sum(y * r) in double.
  double loss(const std::vector<float>& x, const std::vector<float>& r, const shape& in) {
    memkit::activation_store store(tracker.category(memkit::memory_category::activations));
    std::vector<float> y(x.size());
    block.forward(memkit::host, {}, memkit::host_view(x.data(), in), memkit::host_view(y.data(), in), store);
    store.clear();
    double total = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) total += double(y[i]) * r[i];
    return total;
  }
};

}  // namespace

TEST_CASE("example llama: a decoder block's gradients match central finite differences") {
  block_fixture fx;
  const shape in{2, 5, 16};
  const std::vector<float> x = random_vector(2 * 5 * 16, 11, 1.0f);
  const std::vector<float> r = random_vector(2 * 5 * 16, 12, 1.0f);

  memkit::activation_store store(fx.tracker.category(memkit::memory_category::activations));
  std::vector<float> y(x.size()), dx(x.size());
  fx.block.forward(memkit::host, {}, memkit::host_view(x.data(), in), memkit::host_view(y.data(), in), store);
  CHECK(store.bytes() == fx.block.saved_bytes(in, {}));
  fx.block.backward(memkit::host, memkit::host_view(r.data(), in), memkit::host_view(dx.data(), in), store);
  CHECK(store.empty());

  // Input gradient.
  for (std::size_t i : {0u, 7u, 33u, 80u, 101u, 159u}) {
    std::vector<float> xp = x, xm = x;
    const float h = 1e-2f;
    xp[i] += h;
    xm[i] -= h;
    const double numeric = (fx.loss(xp, r, in) - fx.loss(xm, r, in)) / (2.0 * h);
    CAPTURE(i);
    CHECK(dx[i] == doctest::Approx(numeric).epsilon(2e-2).scale(1.0));
  }
  // Weight gradients (the block's weights are fp32, its training dtype).
  auto check_weight = [&](memkit::layers::basic_parameter<float>& p, std::int64_t i) {
    float& w = p.value.data()[i];
    const float saved = w;
    const float h = 1.0f / 32.0f;
    const float plus = saved + h;
    const float minus = saved - h;
    w = plus;
    const double lp = fx.loss(x, r, in);
    w = minus;
    const double lm = fx.loss(x, r, in);
    w = saved;
    const double numeric = (lp - lm) / (double(float(plus)) - double(float(minus)));
    CAPTURE(p.name);
    CAPTURE(i);
    CHECK(p.grad.data()[i] == doctest::Approx(numeric).epsilon(3e-2).scale(1.0));
  };
  for (memkit::layers::basic_parameter<float>* p : {&fx.block.q.weight, &fx.block.k.weight, &fx.block.v.weight, &fx.block.o.weight,
                              &fx.block.gate.weight, &fx.block.up.weight, &fx.block.down.weight})
    for (std::int64_t i : {0L, 5L, p->size() - 1}) check_weight(*p, i);
  for (memkit::layers::basic_parameter<float>* p : {&fx.block.attn_norm.weight, &fx.block.mlp_norm.weight})
    for (std::int64_t i : {0L, 9L}) check_weight(*p, i);
}

TEST_CASE("example llama: a decoder block's workspace stays within what it states") {
  block_fixture fx;
  const shape in{2, 5, 16};
  const std::vector<float> x = random_vector(2 * 5 * 16, 21, 1.0f);
  std::vector<float> y(x.size()), dx(x.size());
  memkit::activation_store store(fx.tracker.category(memkit::memory_category::activations));
  fx.tracker.reset_peak();
  fx.block.forward(memkit::host, {}, memkit::host_view(x.data(), in), memkit::host_view(y.data(), in), store);
  fx.block.backward(memkit::host, memkit::host_view(std::as_const(y).data(), in), memkit::host_view(dx.data(), in), store);
  const std::size_t measured = fx.tracker.stats(memkit::memory_category::workspace).peak_bytes;
  CHECK(measured > fx.block.backward_scratch_bytes(in));
  CHECK(measured <= fx.block.workspace_bytes(in));
  CHECK(fx.tracker.stats(memkit::memory_category::activations).peak_bytes == fx.block.saved_bytes(in, {}));
}

TEST_CASE("example llama: checkpointed blocks give the plain stack's gradients bit for bit") {
  block_fixture a, b;
  const shape in{2, 5, 16};
  const std::vector<float> x = random_vector(2 * 5 * 16, 31, 1.0f);
  const std::vector<float> r = random_vector(2 * 5 * 16, 32, 1.0f);
  // Plain: the block twice in a row (the same layer object), taped.
  std::vector<float> h(x.size()), y(x.size()), dh(x.size()), dx_plain(x.size()), dx_ckpt(x.size());
  {
    memkit::activation_store store(memkit::default_host_resource());
    a.block.forward(memkit::host, {}, memkit::host_view(x.data(), in), memkit::host_view(h.data(), in), store);
    a.block.forward(memkit::host, {}, memkit::host_view(std::as_const(h).data(), in), memkit::host_view(y.data(), in), store);
    a.block.backward(memkit::host, memkit::host_view(r.data(), in), memkit::host_view(dh.data(), in), store);
    a.block.backward(memkit::host, memkit::host_view(std::as_const(dh).data(), in), memkit::host_view(dx_plain.data(), in), store);
  }
  {
    memkit::activation_store store(memkit::default_host_resource());
    auto stack = memkit::checkpoint::segment(memkit::checkpoint::layer_sequence(b.block, b.block),
                                            {.schedule = memkit::checkpoint::schedule::every_layer()});
    std::vector<float> y2(x.size());
    stack.forward(memkit::host, {}, memkit::host_view(x.data(), in), memkit::host_view(y2.data(), in), store);
    CHECK(y2 == y);
    stack.backward(memkit::host, memkit::host_view(r.data(), in), memkit::host_view(dx_ckpt.data(), in), store);
  }
  CHECK(dx_ckpt == dx_plain);
  for (std::int64_t i = 0; i < a.block.q.weight.size(); ++i) REQUIRE(a.block.q.weight.grad.data()[i] == b.block.q.weight.grad.data()[i]);
}

TEST_CASE("example llama: memkit's fused linear cross-entropy, chunked as the example runs it, matches a direct computation") {
  const std::int64_t N = 7, H = 5, V = 11;
  const std::vector<float> hidden = random_vector(N * H, 41, 1.0f);
  const std::vector<float> head_f = random_vector(V * H, 42, 1.0f);
  std::vector<memkit::bf16> head(head_f.size());
  for (std::size_t i = 0; i < head.size(); ++i) head[i] = memkit::from_float<memkit::bf16>(head_f[i]);
  const std::vector<std::int32_t> targets{3, -100, 0, 10, 5, 5, 1};
  memkit::loss::cross_entropy_options options;
  options.chunk_bytes = 3 * V * 4;  // 3 rows per chunk
  options.host_threads = 1;
  float loss = 0;
  std::vector<float> d_hidden(N * H), d_head(V * H, 0.0f);
  memkit::tracking_resource tracker(memkit::default_host_resource());
  memkit::loss::fused_linear_cross_entropy(
      memkit::host, memkit::host_view(hidden.data(), shape{N, H}), memkit::host_view(std::as_const(head).data(), shape{V, H}),
      memkit::host_view(targets.data(), shape{N}), memkit::host_view(&loss, shape{1}),
      memkit::host_view(d_hidden.data(), shape{N, H}), memkit::host_view(d_head.data(), shape{V, H}), options, tracker);
  CHECK(tracker.peak_bytes() == memkit::loss::workspace_bytes(memkit::loss::fused_linear_cross_entropy_arguments{
                                    .tokens = N, .hidden = H, .vocab = V, .hidden_element_bytes = sizeof(float),
                                    .head_element_bytes = sizeof(memkit::bf16), .options = options}));
  auto direct = [&](const std::vector<float>& hs) {
    double total = 0;
    int counted = 0;
    for (std::int64_t i = 0; i < N; ++i) {
      if (targets[i] == -100) continue;
      std::vector<double> z(V);
      double m = -1e30;
      for (std::int64_t v = 0; v < V; ++v) {
        for (std::int64_t j = 0; j < H; ++j) z[v] += double(hs[i * H + j]) * float(head[v * H + j]);
        m = std::max(m, z[v]);
      }
      double s = 0;
      for (double zv : z) s += std::exp(zv - m);
      total += m + std::log(s) - z[targets[i]];
      ++counted;
    }
    return total / counted;
  };
  CHECK(loss == doctest::Approx(direct(hidden)).epsilon(1e-5));
  for (std::int64_t i : {0L, 6L, 13L, 34L}) {
    std::vector<float> p = hidden, m = hidden;
    p[i] += 1e-2f;
    m[i] -= 1e-2f;
    CHECK(d_hidden[i] == doctest::Approx((direct(p) - direct(m)) / 2e-2).epsilon(1e-3).scale(1.0));
  }
  CHECK(d_hidden[1 * H + 2] == 0.0f);  // ignored token
}

TEST_CASE("example llama: the token embedding gathers rows, sums the gradient of repeated tokens, and refuses unknown ids") {
  memkit::tracking_resource tracker{memkit::default_host_resource(), "embedding"};
  memkit::layers::memory_resources memory;
  memory.weights = &tracker.category(memkit::memory_category::weights);
  memory.gradients = &tracker.category(memkit::memory_category::gradients);
  const std::int64_t V = 5, H = 3;
  llama::token_embedding<memkit::bf16> embed(V, H, memory, memkit::layers::trainability::bf16_master);
  embed.weight.init_normal(1.0f, 3, 4);
  const std::vector<std::int32_t> ids{4, 0, 4, 2};
  std::vector<float> y(ids.size() * H);
  embed.forward(memkit::host, memkit::host_view(ids.data(), {4}), memkit::host_view(y.data(), {4, H}));
  for (std::size_t t = 0; t < ids.size(); ++t)
    for (std::int64_t j = 0; j < H; ++j) CHECK(y[t * H + j] == float(embed.weight.value.data()[ids[t] * H + j]));
  std::vector<float> dy(ids.size() * H);
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = 0.25f * float(i + 1);
  embed.backward(memkit::host, memkit::host_view(ids.data(), {4}), memkit::host_view(std::as_const(dy).data(), {4, H}));
  for (std::int64_t j = 0; j < H; ++j) {
    CHECK(embed.weight.grad.data()[4 * H + j] == dy[0 * H + j] + dy[2 * H + j]);  // token 4 twice
    CHECK(embed.weight.grad.data()[0 * H + j] == dy[1 * H + j]);
    CHECK(embed.weight.grad.data()[2 * H + j] == dy[3 * H + j]);
    CHECK(embed.weight.grad.data()[1 * H + j] == 0.0f);
  }
  const std::vector<std::int32_t> bad{1, 5};
  CHECK_THROWS_WITH_AS(embed.forward(memkit::host, memkit::host_view(bad.data(), {2}), memkit::host_view(y.data(), {2, H})),
                       doctest::Contains("outside the vocabulary"), memkit::error);
  // The shared row function (what the device kernel runs) writes NaN for an unknown id instead of reading
  // outside the table.
  float out[H] = {};
  llama::embedding_row<float, memkit::bf16>{bad.data() + 1, embed.weight.value.data(), out, V, H}(0);
  for (float v : out) CHECK(std::isnan(v));
}
