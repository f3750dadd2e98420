// memkit::checkpoint::segment on the host: gradients bit-identical to running the layers without checkpointing under
// every schedule, with and without offload; the activation bytes a tracking_resource measures equal the
// prediction exactly; recomputed forwards counted on the layers equal the plan's; misuse is an error.
#include <doctest/doctest.h>
#include <memkit/checkpoint/segment.hpp>
#include <memkit/memory/tracking.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "host/checkpoint_layers.hpp"

namespace {

using namespace checkpoint_test;
using memkit::memory_category;

constexpr forward_context step_context{0x5eed, 0, true};

struct step_result {
  std::vector<float> y, dx;
  std::vector<float> grads;  // every linear's weight and bias gradients, in order
  std::uint64_t forwards = 0;
};

void zero_grads(std::vector<mixed_layer>& stack) {
  for (mixed_layer& l : stack) {
    for (std::vector<float>* g : {&l.lin.weight_grad, &l.lin.bias_grad}) std::fill(g->begin(), g->end(), 0.0f);
    l.adapter.zero_grad();
    l.lin.forwards = l.drop.forwards = l.act.forwards = l.adapter.forwards = 0;
  }
}

void collect(std::vector<mixed_layer>& stack, step_result& r) {
  for (mixed_layer& l : stack) {
    for (const std::vector<float>* g : {&l.lin.weight_grad, &l.lin.bias_grad}) r.grads.insert(r.grads.end(), g->begin(), g->end());
    l.adapter.append_grads(r.grads);
    r.forwards += l.forwards();
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The reference: the layers called one after the other, every activation kept.
step_result run_plain(std::vector<mixed_layer>& stack, const std::vector<float>& x, shape in,
                      const forward_context& ctx = step_context, bool zero = true) {
  if (zero) zero_grads(stack);
  activation_store store(memkit::default_host_resource());
  std::vector<std::vector<float>> hidden{x};
  std::vector<shape> shapes{in};
  for (std::size_t i = 0; i < stack.size(); ++i) {
    shapes.push_back(stack[i].output_shape(shapes.back()));
    hidden.emplace_back(shapes.back().numel());
    stack[i].forward(memkit::host, ctx.for_layer(i), memkit::host_view<const float>(hidden[i].data(), shapes[i]),
                     memkit::host_view(hidden[i + 1].data(), shapes[i + 1]), store);
  }
  std::vector<float> grad = random_values(hidden.back().size(), 99);
  for (std::size_t i = stack.size(); i-- > 0;) {
    std::vector<float> dx(shapes[i].numel());
    stack[i].backward(memkit::host, memkit::host_view<const float>(grad.data(), shapes[i + 1]),
                      memkit::host_view(dx.data(), shapes[i]), store);
    grad = std::move(dx);
  }
  REQUIRE(store.empty());
  step_result r{hidden.back(), grad, {}, 0};
  collect(stack, r);
  return r;
}

struct measured {
  step_result result;
  std::size_t saved_after_forward = 0;  // store.bytes()
  std::size_t device_after_forward = 0;
  std::size_t device_peak = 0;
  std::size_t host_peak = 0;
};

// One training step through a memkit::checkpoint::segment; activations charged to a tracker, offloaded checkpoints
// to another.
measured run_checkpointed(std::vector<mixed_layer>& stack, const std::vector<float>& x, shape in,
                          memkit::checkpoint::schedule schedule, bool offload) {
  zero_grads(stack);
  memkit::tracking_resource device(memkit::default_host_resource(), "activations");
  memkit::tracking_resource host(memkit::default_host_resource(), "offloaded");
  memkit::checkpoint::offload offloaded(host.category(memory_category::activations));
  activation_store store(device.category(memory_category::activations));
  memkit::checkpoint::segment segment(stack, {.schedule = schedule, .offload = offload ? &offloaded : nullptr});
  const shape out = segment.output_shape(in);
  measured m;
  m.result.y.resize(out.numel());
  segment.forward(memkit::host, step_context, memkit::host_view<const float>(x.data(), in),
                  memkit::host_view(m.result.y.data(), out), store);
  m.saved_after_forward = store.bytes();
  m.device_after_forward = device.current_bytes();
  std::vector<float> grad = random_values(m.result.y.size(), 99);
  m.result.dx.resize(in.numel());
  segment.backward(memkit::host, memkit::host_view<const float>(grad.data(), out),
                   memkit::host_view(m.result.dx.data(), in), store);
  CHECK(store.empty());
  CHECK(device.current_bytes() == 0);
  CHECK(offloaded.kept() == 0);
  m.device_peak = device.peak_bytes();
  m.host_peak = host.peak_bytes();
  collect(stack, m.result);
  return m;
}

std::vector<memkit::checkpoint::schedule> all_schedules(std::size_t layers) {
  std::vector<memkit::checkpoint::schedule> s{memkit::checkpoint::schedule::none(), memkit::checkpoint::schedule::single_segment(),
                                     memkit::checkpoint::schedule::every_layer(), memkit::checkpoint::schedule::every_k_layers(2),
                                     memkit::checkpoint::schedule::every_k_layers(3), memkit::checkpoint::schedule::sqrt()};
  for (std::uint64_t c : {1, 2, 3, 5}) s.push_back(memkit::checkpoint::schedule::binomial(c));
  s.push_back(memkit::checkpoint::schedule::binomial(layers + 2));
  return s;
}

std::string describe(const memkit::checkpoint::schedule& s, std::size_t layers, bool offload) {
  return std::string(memkit::checkpoint::to_string(s.kind)) + " every=" + std::to_string(s.every) +
         " slots=" + std::to_string(s.slots) + " layers=" + std::to_string(layers) + (offload ? " offload" : "");
}

}  // namespace

TEST_CASE("checkpoint::segment: every schedule, with and without offload, gives the uncheckpointed gradients bit for "
          "bit, and the tracker sees exactly the predicted bytes") {
  for (std::size_t layers : {1, 2, 3, 5, 8, 13}) {
    std::vector<mixed_layer> stack = mixed_stack(layers, 6, 17);
    const shape in{5, 6};
    const std::vector<float> x = random_values(in.numel(), 3);
    const step_result reference = run_plain(stack, x, in);
    REQUIRE(reference.forwards == layers);
    for (const memkit::checkpoint::schedule& schedule : all_schedules(layers))
      for (bool offload : {false, true}) {
        CAPTURE(describe(schedule, layers, offload));
        const measured m = run_checkpointed(stack, x, in, schedule, offload);
        CHECK(same_bits(m.result.y, reference.y));
        CHECK(same_bits(m.result.dx, reference.dx));
        CHECK(same_bits(m.result.grads, reference.grads));

        memkit::checkpoint::offload unused(memkit::default_host_resource());
        const memkit::checkpoint::segment segment(stack, {.schedule = schedule, .offload = offload ? &unused : nullptr});
        const memkit::checkpoint::checkpoint_cost cost = segment.cost(in, step_context);
        CHECK(m.result.forwards == layers + cost.recomputed_forwards);
        CHECK(cost.recomputed_forwards == memkit::checkpoint::recomputed_forwards(schedule, layers));
        CHECK(m.saved_after_forward == cost.saved_bytes);
        CHECK(m.device_after_forward == cost.saved_bytes);
        CHECK(segment.saved_bytes(in, step_context) == cost.saved_bytes);
        CHECK(m.device_peak == cost.peak_bytes);
        CHECK(m.host_peak == cost.host_bytes);
        if (!offload) CHECK(cost.host_bytes == 0);
      }
  }
}

TEST_CASE("checkpoint::segment: predictions of a uniform stack match the closed forms") {
  // N tanh layers of [4, 8] floats: every hidden state and every layer's saved tensor is 128 bytes.
  constexpr std::size_t layers = 9;
  constexpr std::uint64_t bytes = 4 * 8 * sizeof(float);
  std::vector<tanh_layer> stack(layers);
  const shape in{4, 8};
  using memkit::checkpoint::checkpoint_cost_of;
  using memkit::checkpoint::uniform_layer_bytes;
  const uniform_layer_bytes uniform{bytes, bytes};
  // none: every layer's saved tensor plus the hidden state between two of them.
  CHECK(checkpoint_cost_of(memkit::checkpoint::schedule::none(), layers, uniform).peak_bytes == layers * bytes + bytes);
  // every layer: N checkpoints; backward of the last layer adds its recomputed output and saved tensor.
  CHECK(checkpoint_cost_of(memkit::checkpoint::schedule::every_layer(), layers, uniform).peak_bytes ==
        (layers + 1) * bytes + bytes);
  CHECK(checkpoint_cost_of(memkit::checkpoint::schedule::every_layer(), layers, uniform).saved_bytes == layers * bytes);
  // binomial with 2 slots over 9 layers: C(2+r, 2) >= 9 at r = 3, so 3*9 - C(5, 3) = 17 recomputations.
  CHECK(checkpoint_cost_of(memkit::checkpoint::schedule::binomial(2), layers, uniform).recomputed_forwards == 17);
  for (const memkit::checkpoint::schedule& schedule : all_schedules(layers)) {
    CAPTURE(describe(schedule, layers, false));
    memkit::checkpoint::segment segment(stack, {.schedule = schedule});
    CHECK(segment.cost(in, step_context).peak_bytes == checkpoint_cost_of(schedule, layers, uniform).peak_bytes);
  }
  // Compile-time: a budget can be checked in a static_assert.
  static_assert(checkpoint_cost_of(memkit::checkpoint::schedule::binomial(3), 32, uniform_layer_bytes{1024, 4096}).checkpoints ==
                3);
  static_assert(checkpoint_cost_of(memkit::checkpoint::schedule::every_layer(), 32, uniform_layer_bytes{1024, 4096})
                    .recomputed_forwards == 32);
}

TEST_CASE("checkpoint::segment: heterogeneous layers, single and in ranges, in one sequence") {
  linear first(6, 9, 1), last(9, 4, 2);
  dropout drop{0.2f};
  tanh_layer act;
  // memkit's lora_linear itself, over a frozen base, with dropout on the adapter and a non-zero B.
  std::vector<float> adapter_base = random_values(81, 9, 1.0f / 3.0f);
  memkit::lora::lora_linear<float> adapter(memkit::host_view(adapter_base.data(), {9, 9}),
                                           {.rank = 3, .alpha = 6.0, .dropout = 0.1f, .init_seed = 9},
                                           memkit::default_host_resource(), memkit::default_host_resource(), memkit::default_host_resource());
  const std::vector<float> adapter_b = random_values(27, 11, 0.2f);
  std::copy(adapter_b.begin(), adapter_b.end(), adapter.lora_B().begin());
  std::vector<mixed_layer> middle;
  for (int i = 0; i < 4; ++i) middle.push_back(i % 2 ? mixed_layer::make_tanh() : mixed_layer::make_linear(9, 9, 10 + i));
  const shape in{3, 6};
  const std::vector<float> x = random_values(in.numel(), 5);
  const std::vector<float> dy = random_values(3 * 4, 6);

  // Reference: the same nine layers by hand.
  auto run_by_hand = [&] {
    activation_store store(memkit::default_host_resource());
    std::vector<std::vector<float>> h{x};
    std::vector<shape> shapes{in};
    auto forward = [&](auto& layer, std::size_t i) {
      shapes.push_back(layer.output_shape(shapes.back()));
      h.emplace_back(shapes.back().numel());
      layer.forward(memkit::host, step_context.for_layer(i), memkit::host_view<const float>(h[i].data(), shapes[i]),
                    memkit::host_view(h[i + 1].data(), shapes[i + 1]), store);
    };
    forward(first, 0);
    forward(drop, 1);
    for (std::size_t i = 0; i < middle.size(); ++i) forward(middle[i], 2 + i);
    forward(act, 6);
    forward(adapter, 7);
    forward(last, 8);
    std::vector<float> grad = dy;
    auto backward = [&](auto& layer, std::size_t i) {
      std::vector<float> dx(shapes[i].numel());
      layer.backward(memkit::host, memkit::host_view<const float>(grad.data(), shapes[i + 1]),
                     memkit::host_view(dx.data(), shapes[i]), store);
      grad = std::move(dx);
    };
    backward(last, 8);
    backward(adapter, 7);
    backward(act, 6);
    for (std::size_t i = middle.size(); i-- > 0;) backward(middle[i], 2 + i);
    backward(drop, 1);
    backward(first, 0);
    return grad;
  };
  auto grads = [&] {
    std::vector<float> g = first.weight_grad;
    g.insert(g.end(), last.weight_grad.begin(), last.weight_grad.end());
    g.insert(g.end(), adapter.grad_A().begin(), adapter.grad_A().end());
    g.insert(g.end(), adapter.grad_B().begin(), adapter.grad_B().end());
    for (mixed_layer& m : middle) g.insert(g.end(), m.lin.weight_grad.begin(), m.lin.weight_grad.end());
    return g;
  };
  auto reset = [&] {
    for (linear* l : {&first, &last, &middle[0].lin, &middle[2].lin}) {
      std::fill(l->weight_grad.begin(), l->weight_grad.end(), 0.0f);
      std::fill(l->bias_grad.begin(), l->bias_grad.end(), 0.0f);
    }
    adapter.zero_grad();
  };
  const std::vector<float> dx_reference = run_by_hand();
  const std::vector<float> grads_reference = grads();

  for (const memkit::checkpoint::schedule& schedule : all_schedules(9)) {
    CAPTURE(describe(schedule, 9, false));
    reset();
    auto sequence = memkit::checkpoint::layer_sequence(first, drop, middle, act, adapter, last);
    static_assert(std::is_same_v<decltype(sequence), memkit::checkpoint::layer_list<linear&, dropout&, std::span<mixed_layer>,
                                                                        tanh_layer&, memkit::lora::lora_linear<float>&, linear&>>);
    CHECK(sequence.size() == 9);
    memkit::checkpoint::segment segment(sequence, {.schedule = schedule});
    static_assert(memkit::layer<decltype(segment), memkit::host_executor>);
    activation_store store(memkit::default_host_resource());
    std::vector<float> y(3 * 4), dx(in.numel());
    segment.forward(memkit::host, step_context, memkit::host_view<const float>(x.data(), in),
                    memkit::host_view(y.data(), {3, 4}), store);
    segment.backward(memkit::host, memkit::host_view<const float>(dy.data(), {3, 4}), memkit::host_view(dx.data(), in),
                     store);
    CHECK(same_bits(dx, dx_reference));
    CHECK(same_bits(grads(), grads_reference));
  }
}

TEST_CASE("checkpoint::segment: segments in a hand-written loop share one offload, prefetching across segments") {
  // Four segments of three layers each, the way a loop over decoder blocks would use them.
  std::vector<mixed_layer> stack = mixed_stack(12, 6, 23);
  const shape in{4, 6};
  const std::vector<float> x = random_values(in.numel(), 8);
  const step_result reference = run_plain(stack, x, in);

  memkit::tracking_resource host(memkit::default_host_resource(), "offloaded");
  memkit::checkpoint::offload offload(host.category(memory_category::activations));
  std::vector<memkit::checkpoint::segment<memkit::checkpoint::layer_list<std::span<mixed_layer>>>> segments;
  segments.reserve(4);
  for (std::size_t s = 0; s < 4; ++s)
    segments.emplace_back(std::span(stack).subspan(3 * s, 3), memkit::checkpoint::segment_options{.first_layer = 3 * s, .offload = &offload});

  for (int step = 0; step < 2; ++step) {
    zero_grads(stack);
    activation_store store(memkit::default_host_resource());
    std::vector<std::vector<float>> h{x};
    std::vector<shape> shapes{in};
    for (auto& segment : segments) {
      shapes.push_back(segment.output_shape(shapes.back()));
      h.emplace_back(shapes.back().numel());
      segment.forward(memkit::host, step_context, memkit::host_view<const float>(h[h.size() - 2].data(), shapes[h.size() - 2]),
                      memkit::host_view(h.back().data(), shapes.back()), store);
    }
    CHECK(offload.kept() == 4);
    CHECK(store.bytes() == 0);  // every checkpoint is on the "host"
    std::vector<float> grad = random_values(h.back().size(), 99);
    for (std::size_t s = segments.size(); s-- > 0;) {
      std::vector<float> dx(shapes[s].numel());
      segments[s].backward(memkit::host, memkit::host_view<const float>(grad.data(), shapes[s + 1]),
                           memkit::host_view(dx.data(), shapes[s]), store);
      grad = std::move(dx);
    }
    CHECK(offload.kept() == 0);
    step_result r{h.back(), grad, {}, 0};
    collect(stack, r);
    CHECK(same_bits(r.y, reference.y));
    CHECK(same_bits(r.dx, reference.dx));
    CHECK(same_bits(r.grads, reference.grads));
    // The pool holds one buffer per checkpoint of the step; the second step reuses them.
    CHECK(host.total().total_allocations == 4);
    CHECK(offload.host_bytes() == host.current_bytes());
  }
  offload.release_unused();
  CHECK(host.current_bytes() == 0);
}

TEST_CASE("checkpoint::segment: two forward passes in flight (two micro-batches), backward in reverse order") {
  std::vector<mixed_layer> stack = mixed_stack(9, 5, 41);
  const shape in{3, 5};
  const std::vector<float> x1 = random_values(in.numel(), 11), x2 = random_values(in.numel(), 12);
  const forward_context ctx1{1, 0, true}, ctx2{2, 0, true};
  // Reference: micro-batch 2's step, then micro-batch 1's, accumulating into the same gradients (the order
  // in which the checkpointed backwards below run).
  const step_result second = run_plain(stack, x2, in, ctx2);
  const step_result first = run_plain(stack, x1, in, ctx1, false);
  for (const memkit::checkpoint::schedule& schedule : all_schedules(9))
    for (bool offload : {false, true}) {
      CAPTURE(describe(schedule, 9, offload));
      zero_grads(stack);
      memkit::checkpoint::offload offloaded(memkit::default_host_resource());
      activation_store store(memkit::default_host_resource());
      memkit::checkpoint::segment segment(stack, {.schedule = schedule, .offload = offload ? &offloaded : nullptr});
      const shape out = segment.output_shape(in);
      std::vector<float> y1(out.numel()), y2(out.numel()), dx1(in.numel()), dx2(in.numel());
      segment.forward(memkit::host, ctx1, memkit::host_view<const float>(x1.data(), in), memkit::host_view(y1.data(), out),
                      store);
      segment.forward(memkit::host, ctx2, memkit::host_view<const float>(x2.data(), in), memkit::host_view(y2.data(), out),
                      store);
      CHECK(segment.pending_backwards() == 2);
      const std::vector<float> dy = random_values(out.numel(), 99);  // what run_plain uses
      segment.backward(memkit::host, memkit::host_view<const float>(dy.data(), out), memkit::host_view(dx2.data(), in),
                       store);
      segment.backward(memkit::host, memkit::host_view<const float>(dy.data(), out), memkit::host_view(dx1.data(), in),
                       store);
      CHECK(store.empty());
      CHECK(same_bits(y1, first.y));
      CHECK(same_bits(y2, second.y));
      CHECK(same_bits(dx1, first.dx));
      CHECK(same_bits(dx2, second.dx));
      step_result r;
      collect(stack, r);
      CHECK(same_bits(r.grads, first.grads));  // both micro-batches' gradients, accumulated in the same order
    }
}

TEST_CASE("checkpoint::segment: misuse is a clear error, never a silent wrong gradient") {
  std::vector<mixed_layer> stack = mixed_stack(6, 4, 31);
  const shape in{2, 4};
  const std::vector<float> x = random_values(in.numel(), 1);
  std::vector<float> y(2 * 4), dy(2 * 4, 1.0f), dx(in.numel());
  auto x_view = memkit::host_view<const float>(x.data(), in);
  auto y_view = memkit::host_view(y.data(), {2, 4});
  auto dy_view = memkit::host_view<const float>(dy.data(), {2, 4});
  auto dx_view = memkit::host_view(dx.data(), in);

  SUBCASE("backward before forward, and backward twice") {
    for (const memkit::checkpoint::schedule& schedule : all_schedules(6)) {
      activation_store store(memkit::default_host_resource());
      memkit::checkpoint::segment segment(stack, {.schedule = schedule});
      CHECK_THROWS_WITH_AS(segment.backward(memkit::host, dy_view, dx_view, store),
                           doctest::Contains("backward before forward, or twice"), memkit::error);
      segment.forward(memkit::host, step_context, x_view, y_view, store);
      segment.backward(memkit::host, dy_view, dx_view, store);
      CHECK_THROWS_WITH_AS(segment.backward(memkit::host, dy_view, dx_view, store),
                           doctest::Contains("backward before forward, or twice"), memkit::error);
    }
  }

  SUBCASE("a layer whose recomputed forward saves something else") {
    // A layer that changes between forward and backward: its recomputation saves other bytes.
    for (const memkit::checkpoint::schedule& schedule : {memkit::checkpoint::schedule::single_segment(), memkit::checkpoint::schedule::sqrt(),
                                                memkit::checkpoint::schedule::binomial(2)}) {
      std::vector<mixed_layer> changing = mixed_stack(6, 4, 31);
      activation_store store(memkit::default_host_resource());
      memkit::checkpoint::segment segment(changing, {.schedule = schedule});
      segment.forward(memkit::host, step_context, x_view, y_view, store);
      changing[1].what = mixed_layer::kind::tanh;  // layer 1 now saves a float output, not a byte mask
      CHECK_THROWS_WITH_AS(segment.backward(memkit::host, dy_view, dx_view, store),
                           doctest::Contains("recomputed forward saved"), memkit::error);
      CHECK(store.empty());  // the failed pass released what it kept
    }
  }

  SUBCASE("a layer whose saved_bytes() does not match its forward") {
    struct lying : tanh_layer {
      std::size_t saved_bytes(const shape&, const forward_context&) const { return 8; }
    };
    std::vector<lying> liars(3);
    activation_store store(memkit::default_host_resource());
    memkit::checkpoint::segment segment(liars, {.schedule = memkit::checkpoint::schedule::none()});
    CHECK_THROWS_WITH_AS(segment.forward(memkit::host, step_context, x_view, memkit::host_view(y.data(), in), store),
                         doctest::Contains("saved_bytes() says 8"), memkit::error);
    CHECK(store.empty());
    CHECK(segment.pending_backwards() == 0);
  }

  SUBCASE("a backward that leaves what its forward saved") {
    struct forgetful : tanh_layer {
      void backward(const host_executor&, tensor_view<const float> dy, tensor_view<float> dx, activation_store&) {
        std::memcpy(dx.data(), dy.data(), dy.bytes());
      }
    };
    std::vector<forgetful> layers(2);
    activation_store store(memkit::default_host_resource());
    memkit::checkpoint::segment segment(layers, {.schedule = memkit::checkpoint::schedule::every_layer()});
    segment.forward(memkit::host, step_context, x_view, memkit::host_view(y.data(), in), store);
    CHECK_THROWS_WITH_AS(
        segment.backward(memkit::host, memkit::host_view<const float>(dy.data(), in), dx_view, store),
        doctest::Contains("layer 1's backward took 0 tensors from the store but its forward saved 1"), memkit::error);
  }

  SUBCASE("a layer that throws: the pass frees everything it kept, offloaded or not") {
    struct failing : tanh_layer {
      bool fail = false;
      void forward(const host_executor& exec, const forward_context& ctx, tensor_view<const float> in,
                   tensor_view<float> out, activation_store& store) {
        if (fail) throw memkit::error("failing layer");
        tanh_layer::forward(exec, ctx, in, out, store);
      }
    };
    std::vector<failing> layers(5);
    layers[3].fail = true;
    for (const memkit::checkpoint::schedule& schedule : all_schedules(5))
      for (bool offload : {false, true}) {
        memkit::tracking_resource device(memkit::default_host_resource(), "activations");
        memkit::checkpoint::offload offloaded(memkit::default_host_resource());
        activation_store store(device.category(memory_category::activations));
        memkit::checkpoint::segment segment(layers, {.schedule = schedule, .offload = offload ? &offloaded : nullptr});
        CHECK_THROWS_WITH_AS(segment.forward(memkit::host, step_context, x_view, memkit::host_view(y.data(), in), store),
                             "failing layer", memkit::error);
        CHECK(store.empty());
        CHECK(device.current_bytes() == 0);
        CHECK(offloaded.kept() == 0);
        CHECK(segment.pending_backwards() == 0);
      }
  }

  SUBCASE("shapes, schedules and offload order") {
    activation_store store(memkit::default_host_resource());
    CHECK_THROWS_WITH_AS(memkit::checkpoint::segment(stack, {.schedule = memkit::checkpoint::schedule::binomial(0)}),
                         doctest::Contains("at least 1 checkpoint slot"), memkit::error);
    CHECK_THROWS_WITH_AS(memkit::checkpoint::segment(stack, {.schedule = memkit::checkpoint::schedule::every_k_layers(0)}),
                         doctest::Contains("at least 1 layer per segment"), memkit::error);
    std::vector<mixed_layer> none;
    CHECK_THROWS_WITH_AS(memkit::checkpoint::segment(none, {}), doctest::Contains("no layers"), memkit::error);
    memkit::checkpoint::segment segment(stack);
    CHECK_THROWS_WITH_AS(segment.forward(memkit::host, step_context, x_view, memkit::host_view(y.data(), {4, 2}), store),
                         doctest::Contains("y has shape [4, 2] but the layers output [2, 4]"), memkit::error);
    segment.forward(memkit::host, step_context, x_view, y_view, store);
    CHECK_THROWS_WITH_AS(segment.backward(memkit::host, dy_view, memkit::host_view(dx.data(), {8}), store),
                         doctest::Contains("dx has shape [8]"), memkit::error);
    // An empty view is a tensor of the wrong shape, not "no gradient": only none() is absent.
    CHECK_THROWS_WITH_AS(segment.backward(memkit::host, dy_view, memkit::host_view<float>(nullptr, {0}), store),
                         doctest::Contains("dx has shape [0]"), memkit::error);
    CHECK(segment.pending_backwards() == 1);
    segment.backward(memkit::host, dy_view, memkit::tensor_view<float>::none(), store);  // no input gradient
    CHECK(store.empty());

    memkit::checkpoint::offload offload(memkit::default_host_resource());
    const std::span<mixed_layer> all(stack);
    memkit::checkpoint::segment a(all.first(3), {.offload = &offload});
    memkit::checkpoint::segment b(all.subspan(3), {.first_layer = 3, .offload = &offload});
    std::vector<float> h(a.output_shape(in).numel());
    a.forward(memkit::host, step_context, x_view, memkit::host_view(h.data(), a.output_shape(in)), store);
    b.forward(memkit::host, step_context, memkit::host_view<const float>(h.data(), a.output_shape(in)), y_view, store);
    std::vector<float> dh(h.size());
    CHECK_THROWS_WITH_AS(a.backward(memkit::host, memkit::host_view<const float>(dh.data(), a.output_shape(in)),
                                    dx_view, store),
                         doctest::Contains("out of order"), memkit::error);
  }
}

TEST_CASE("checkpoint::segment: moving or assigning a segment rebinds it, never touching the layers") {
  std::vector<tanh_layer> a(3), b(5);
  const tanh_layer* const a_data = a.data();
  linear x(4, 4, 1), y(4, 4, 2);
  const std::vector<float> x_weight = x.weight;
  memkit::checkpoint::segment first(memkit::checkpoint::layer_sequence(x, a)), second(memkit::checkpoint::layer_sequence(y, b));
  first = std::move(second);
  CHECK(first.size() == 6);
  CHECK(x.weight == x_weight);  // x was not assigned from y
  CHECK(a.data() == a_data);
  memkit::checkpoint::segment moved(std::move(first));
  CHECK(moved.size() == 6);
  // The moved-to segment runs the second sequence's layers.
  activation_store store(memkit::default_host_resource());
  const std::vector<float> in = random_values(8, 3);
  std::vector<float> out(8), grad(8, 1.0f), dx(8);
  moved.forward(memkit::host, step_context, memkit::host_view<const float>(in.data(), {2, 4}),
                memkit::host_view(out.data(), {2, 4}), store);
  moved.backward(memkit::host, memkit::host_view<const float>(grad.data(), {2, 4}), memkit::host_view(dx.data(), {2, 4}),
                 store);
  CHECK(y.forwards == 2);  // forward, then recomputed
  CHECK(x.forwards == 0);
  // A moved-from segment still runs its own (last assigned) layers.
  CHECK(first.size() == 6);
  first.forward(memkit::host, step_context, memkit::host_view<const float>(in.data(), {2, 4}),
                memkit::host_view(out.data(), {2, 4}), store);
  first.backward(memkit::host, memkit::host_view<const float>(grad.data(), {2, 4}), memkit::host_view(dx.data(), {2, 4}),
                 store);
  CHECK(y.forwards == 4);
}

TEST_CASE("explain_layer names the requirement a type misses") {
  static_assert(memkit::explain_layer<linear, host_executor>());
  static_assert(memkit::explain_layer<memkit::checkpoint::segment<memkit::checkpoint::layer_list<std::span<tanh_layer>>>,
                                      host_executor>());
}

TEST_CASE("checkpoint::segment: destroying a segment with backwards pending frees what their forwards kept") {
  static_assert(std::is_nothrow_destructible_v<memkit::checkpoint::segment<memkit::checkpoint::layer_list<std::span<mixed_layer>>>>);
  std::vector<mixed_layer> stack = mixed_stack(6, 4, 31);
  const shape in{2, 4};
  const std::vector<float> x = random_values(in.numel(), 1);
  std::vector<float> y(2 * 4);
  auto x_view = memkit::host_view<const float>(x.data(), in);
  auto y_view = memkit::host_view(y.data(), {2, 4});

  for (const memkit::checkpoint::schedule& schedule : all_schedules(6))
    for (bool offload : {false, true}) {
      CAPTURE(describe(schedule, 6, offload));
      memkit::tracking_resource device(memkit::default_host_resource(), "activations");
      memkit::checkpoint::offload offloaded(memkit::default_host_resource());
      activation_store store(device.category(memory_category::activations));
      // Tensors of other owners below and above the segment's passes stay.
      store.save<float>(shape{3});
      {
        memkit::checkpoint::segment segment(stack, {.schedule = schedule, .offload = offload ? &offloaded : nullptr});
        segment.forward(memkit::host, step_context, x_view, y_view, store);
        segment.forward(memkit::host, forward_context{7, 0, true}, x_view, y_view, store);
        store.save<double>(shape{5});
        CHECK(segment.pending_backwards() == 2);
      }
      CHECK(store.size() == 2);
      CHECK(store.bytes() == 3 * sizeof(float) + 5 * sizeof(double));
      CHECK(device.current_bytes() == store.bytes());
      CHECK(offloaded.kept() == 0);
      CHECK_NOTHROW(store.take<double>(shape{5}));
      CHECK_NOTHROW(store.take<float>(shape{3}));
    }

  SUBCASE("the store was moved, or destroyed first") {
    memkit::checkpoint::segment segment(stack, {.schedule = memkit::checkpoint::schedule::every_layer()});
    {
      activation_store store(memkit::default_host_resource());
      segment.forward(memkit::host, step_context, x_view, y_view, store);
      activation_store moved(std::move(store));
      memkit::checkpoint::segment<memkit::checkpoint::layer_list<std::span<mixed_layer>>> other(std::move(segment));
      CHECK(!moved.empty());
      other.discard_forward(moved);  // the pass follows its store
      CHECK(moved.empty());
      CHECK(other.pending_backwards() == 0);
    }
    {
      auto store = std::make_unique<activation_store>(memkit::default_host_resource());
      segment.forward(memkit::host, step_context, x_view, y_view, *store);
      store.reset();  // the segment's destructor must not touch it
      CHECK(segment.pending_backwards() == 1);
      activation_store fresh(memkit::default_host_resource());
      std::vector<float> dy(8, 1.0f), dx(in.numel());
      CHECK_THROWS_WITH_AS(segment.backward(memkit::host, memkit::host_view<const float>(dy.data(), {2, 4}),
                                            memkit::host_view(dx.data(), in), fresh),
                           doctest::Contains("the activation_store the forward saved its tensors in no longer exists"),
                           memkit::error);
      CHECK(segment.pending_backwards() == 0);  // that pass could never run backward
    }
  }
}

TEST_CASE("checkpoint::segment: backward given another store than its forward says so") {
  std::vector<mixed_layer> stack = mixed_stack(6, 4, 31);
  const shape in{2, 4};
  const std::vector<float> x = random_values(in.numel(), 1);
  std::vector<float> y(2 * 4), dy(2 * 4, 1.0f), dx(in.numel());
  for (bool offload : {false, true}) {
    memkit::checkpoint::offload offloaded(memkit::default_host_resource());
    activation_store store(memkit::default_host_resource()), other(memkit::default_host_resource());
    memkit::checkpoint::segment segment(stack, {.schedule = memkit::checkpoint::schedule::sqrt(), .offload = offload ? &offloaded : nullptr});
    segment.forward(memkit::host, step_context, memkit::host_view<const float>(x.data(), in),
                    memkit::host_view(y.data(), {2, 4}), store);
    CHECK_THROWS_WITH_AS(segment.backward(memkit::host, memkit::host_view<const float>(dy.data(), {2, 4}),
                                          memkit::host_view(dx.data(), in), other),
                         doctest::Contains("given another activation_store than the one its forward saved its tensors in"),
                         memkit::error);
    CHECK(segment.pending_backwards() == 1);  // nothing lost: backward with the right store still works
    segment.backward(memkit::host, memkit::host_view<const float>(dy.data(), {2, 4}), memkit::host_view(dx.data(), in),
                     store);
    CHECK(store.empty());
    CHECK(offloaded.kept() == 0);
  }
}

namespace {

using inner_segment = memkit::checkpoint::segment<memkit::checkpoint::layer_list<std::span<mixed_layer>>>;

enum class nested_offload { none, inner, shared };

struct nested_step {
  step_result result;
  std::size_t saved_after_forward = 0, device_peak = 0;
};

}  // namespace

TEST_CASE("checkpoint::segment: segments nest (a segment of segments): gradients bit-identical, peaks as predicted, "
          "no stale passes, no offloaded checkpoints piling up") {
  // 12 layers in 4 inner segments of 3; inner segment k runs at outer step k, so it gets the context
  // ctx.for_layer(k), and counters add: first_layer 2k makes its layer i draw from ctx.for_layer(3k + i),
  // as the plain loop over the 12 layers does.
  std::vector<mixed_layer> stack = mixed_stack(12, 6, 23);
  const shape in{4, 6};
  const std::vector<float> x = random_values(in.numel(), 8);
  const step_result reference = run_plain(stack, x, in);
  const std::vector<memkit::checkpoint::schedule> outer_schedules{memkit::checkpoint::schedule::single_segment(), memkit::checkpoint::schedule::none(),
                                                         memkit::checkpoint::schedule::every_layer(), memkit::checkpoint::schedule::binomial(2),
                                                         memkit::checkpoint::schedule::binomial(1)};
  const std::vector<memkit::checkpoint::schedule> inner_schedules{memkit::checkpoint::schedule::single_segment(), memkit::checkpoint::schedule::none(),
                                                         memkit::checkpoint::schedule::every_layer(), memkit::checkpoint::schedule::binomial(1)};
  for (const memkit::checkpoint::schedule& outer_schedule : outer_schedules)
    for (const memkit::checkpoint::schedule& inner_schedule : inner_schedules)
      for (nested_offload mode : {nested_offload::none, nested_offload::inner, nested_offload::shared}) {
        CAPTURE(describe(outer_schedule, 4, mode == nested_offload::shared));
        CAPTURE(describe(inner_schedule, 3, mode != nested_offload::none));
        memkit::tracking_resource host(memkit::default_host_resource(), "offloaded");
        memkit::checkpoint::offload offload(host.category(memory_category::activations));
        std::vector<inner_segment> inners;
        inners.reserve(4);
        for (std::size_t k = 0; k < 4; ++k)
          inners.emplace_back(std::span(stack).subspan(3 * k, 3),
                              memkit::checkpoint::segment_options{.schedule = inner_schedule, .first_layer = 2 * k,
                                                 .offload = mode == nested_offload::none ? nullptr : &offload});
        memkit::checkpoint::segment outer(inners, {.schedule = outer_schedule,
                                          .offload = mode == nested_offload::shared ? &offload : nullptr});
        static_assert(memkit::layer<decltype(outer), memkit::host_executor>);
        const memkit::checkpoint::checkpoint_cost cost = outer.cost(in, step_context);
        const shape out = outer.output_shape(in);
        const std::size_t largest_hidden = activation_store::bytes_required<float>(shape{4, 9});
        std::size_t host_after_first_step = 0;
        for (int step = 0; step < 3; ++step) {
          CAPTURE(step);
          zero_grads(stack);
          memkit::tracking_resource device(memkit::default_host_resource(), "activations");
          activation_store store(device.category(memory_category::activations));
          step_result r;
          r.y.resize(out.numel());
          outer.forward(memkit::host, step_context, memkit::host_view<const float>(x.data(), in),
                        memkit::host_view(r.y.data(), out), store);
          CHECK(store.bytes() == cost.saved_bytes);
          const std::vector<float> dy = random_values(out.numel(), 99);
          r.dx.resize(in.numel());
          outer.backward(memkit::host, memkit::host_view<const float>(dy.data(), out), memkit::host_view(r.dx.data(), in),
                         store);
          collect(stack, r);
          CHECK(same_bits(r.y, reference.y));
          CHECK(same_bits(r.dx, reference.dx));
          CHECK(same_bits(r.grads, reference.grads));
          CHECK(store.empty());
          CHECK(device.current_bytes() == 0);
          if (mode != nested_offload::shared) {
            CHECK(device.peak_bytes() == cost.peak_bytes);
          } else {
            // One offload shared by outer and inner segments holds one prefetched copy at a time: an inner
            // segment's fetch can replace the outer's prefetch, so the prediction is an upper bound, at most
            // one hidden state above.
            CHECK(device.peak_bytes() <= cost.peak_bytes);
            CHECK(device.peak_bytes() + largest_hidden >= cost.peak_bytes);
          }
          CHECK(outer.pending_backwards() == 0);
          for (const inner_segment& inner : inners) CHECK(inner.pending_backwards() == 0);
          CHECK(offload.kept() == 0);
          if (step == 0) host_after_first_step = host.current_bytes();
          CHECK(host.current_bytes() == host_after_first_step);  // the pool is reused, nothing piles up
        }
      }
}

TEST_CASE("activation_store: marks free one pass's tensors wherever they sit; a ref follows moves and expires") {
  activation_store store(memkit::default_host_resource());
  store.save<float>(shape{1});
  const std::uint64_t from = store.mark();
  store.save<float>(shape{2});
  store.save<float>(shape{3});
  const std::uint64_t to = store.mark();
  store.save<double>(shape{4});
  store.release_between(from, to);
  CHECK(store.size() == 2);
  CHECK(store.bytes() == sizeof(float) + 4 * sizeof(double));
  store.release_between(from, to);  // nothing left there
  CHECK(store.size() == 2);
  CHECK_NOTHROW(store.take<double>(shape{4}));
  CHECK_NOTHROW(store.take<float>(shape{1}));

  memkit::activation_store_ref ref = store.ref();
  CHECK(ref.get() == &store);
  {
    activation_store moved(std::move(store));
    CHECK(ref.get() == &moved);
  }
  CHECK(ref.get() == nullptr);

  // memkit::discard_forward on a plain layer frees what its forward saved.
  tanh_layer act;
  activation_store s(memkit::default_host_resource());
  std::vector<float> x(6, 0.5f), y(6);
  const std::size_t before = s.size();
  act.forward(memkit::host, step_context, memkit::host_view<const float>(x.data(), {2, 3}),
              memkit::host_view(y.data(), {2, 3}), s);
  memkit::discard_forward(act, s, before);
  CHECK(s.empty());
}
