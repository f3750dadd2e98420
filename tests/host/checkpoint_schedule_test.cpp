// The schedule math of checkpoint/schedule.hpp: Revolve's closed forms against a dynamic program and against
// the plans themselves, for N up to 1000 layers and c up to 64 slots.
#include <doctest/doctest.h>
#include <memkit/checkpoint/cost.hpp>
#include <memkit/checkpoint/schedule.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>


// shared/REFERENCE.md's checks of the closed form, at compile time.
static_assert(memkit::checkpoint::revolve_forwards(6, 2) == 8);
static_assert(memkit::checkpoint::revolve_forwards(10, 1) == 10 * 9 / 2);
static_assert(memkit::checkpoint::revolve_forwards(10, 9) == 9 && memkit::checkpoint::revolve_forwards(10, 50) == 9);
static_assert(memkit::checkpoint::binomial_coefficient(64, 32) == 1832624140942590534ull);
static_assert(memkit::checkpoint::binomial_coefficient(200, 100) == ~std::uint64_t{0});  // saturates
static_assert(memkit::checkpoint::make_checkpoint_plan(memkit::checkpoint::schedule::binomial(2), 6).recomputed() == 8);
static_assert(memkit::checkpoint::segment_length(memkit::checkpoint::schedule::sqrt(), 32) == 6);
static_assert(memkit::checkpoint::segment_length(memkit::checkpoint::schedule::every_k_layers(5), 3) == 3);

namespace {

// r with C(c+r-1, c) < n <= C(c+r, c), and r*n - C(c+r, c+1), computed here independently of the header.
std::uint64_t closed_form(std::uint64_t n, std::uint64_t c) {
  auto choose = [](std::uint64_t a, std::uint64_t b) {
    long double v = 1;
    for (std::uint64_t i = 1; i <= b; ++i) v = v * static_cast<long double>(a - b + i) / static_cast<long double>(i);
    return v;
  };
  std::uint64_t r = 0;
  while (choose(c + r, c) < static_cast<long double>(n) - 0.5L) ++r;
  return static_cast<std::uint64_t>(static_cast<long double>(r) * n - choose(c + r, c + 1) + 0.5L);
}

}  // namespace

TEST_CASE("checkpoint schedules: the binomial plan recomputes exactly Griewank's minimum, N <= 1000, c <= 64" * doctest::test_suite("scale")) {
  for (std::uint64_t n = 1; n <= 1000; ++n)
    for (std::uint64_t c = 1; c <= 64; ++c) {
      const memkit::checkpoint::checkpoint_plan plan = memkit::checkpoint::make_checkpoint_plan(memkit::checkpoint::schedule::binomial(c), n);
      const std::uint64_t expected = closed_form(n, c);
      if (plan.recomputed() != expected || memkit::checkpoint::revolve_forwards(n, c) != expected || plan.most_checkpoints > c) {
        CAPTURE(n);
        CAPTURE(c);
        CHECK(plan.recomputed() == expected);
        CHECK(memkit::checkpoint::revolve_forwards(n, c) == expected);
        CHECK(plan.most_checkpoints <= c);
      }
    }
  CHECK(closed_form(1000, 1) == 1000 * 999 / 2);
  CHECK(closed_form(1000, 64) == memkit::checkpoint::make_checkpoint_plan(memkit::checkpoint::schedule::binomial(64), 1000).recomputed());
}

TEST_CASE("checkpoint schedules: the closed form is the optimum of the dynamic program") {
  // T(n, c) = min over the first checkpoint m of m + T(m, c) + T(n - m, c - 1); T(1, c) = 0; T(n, 1) = n(n-1)/2.
  constexpr int max_n = 160, max_c = 10;
  std::vector<std::vector<std::uint64_t>> t(max_n + 1, std::vector<std::uint64_t>(max_c + 1, 0));
  for (int n = 2; n <= max_n; ++n) {
    t[n][1] = static_cast<std::uint64_t>(n) * (n - 1) / 2;
    for (int c = 2; c <= max_c; ++c) {
      std::uint64_t best = ~std::uint64_t{0};
      for (int m = 1; m < n; ++m) best = std::min(best, m + t[m][c] + t[n - m][c - 1]);
      t[n][c] = best;
    }
  }
  for (int n = 1; n <= max_n; ++n)
    for (int c = 1; c <= max_c; ++c) {
      CAPTURE(n);
      CAPTURE(c);
      REQUIRE(memkit::checkpoint::revolve_forwards(n, c) == t[n][c]);
    }
}

TEST_CASE("checkpoint schedules: every plan runs each layer forward, then backward exactly once in reverse") {
  for (std::uint64_t n : {1, 2, 3, 7, 32, 100})
    for (const memkit::checkpoint::schedule& s :
         {memkit::checkpoint::schedule::none(), memkit::checkpoint::schedule::every_layer(), memkit::checkpoint::schedule::every_k_layers(3),
          memkit::checkpoint::schedule::sqrt(), memkit::checkpoint::schedule::single_segment(), memkit::checkpoint::schedule::binomial(1),
          memkit::checkpoint::schedule::binomial(4), memkit::checkpoint::schedule::binomial(200)}) {
      CAPTURE(n);
      CAPTURE(memkit::checkpoint::to_string(s.kind));
      const memkit::checkpoint::checkpoint_plan plan = memkit::checkpoint::make_checkpoint_plan(s, n);
      // Walk the plan: the working state must be where each action reads it, every checkpoint restored must
      // be kept, backward j must find step j taped, and the backwards come in order n-1 .. 0.
      std::vector<std::uint64_t> kept;
      std::vector<bool> taped(n, false);
      std::uint64_t working = 0, next_backward = n, forwards = 0;
      bool has_working = true;
      for (std::size_t i = 0; i < plan.actions.size(); ++i) {
        const memkit::checkpoint::checkpoint_action& a = plan.actions[i];
        if (i < plan.forward_actions) CHECK(next_backward == n);  // no backward in the forward pass
        if (i == plan.forward_actions) CHECK((has_working && working == n));  // which ends at the output
        switch (a.op) {
          case memkit::checkpoint::checkpoint_op::store:
            REQUIRE((has_working && working == a.first));
            kept.push_back(a.first);
            break;
          case memkit::checkpoint::checkpoint_op::restore:
          case memkit::checkpoint::checkpoint_op::restore_last:
            REQUIRE(!kept.empty());
            REQUIRE(kept.back() == a.first);  // checkpoints are used last in, first out
            if (a.op == memkit::checkpoint::checkpoint_op::restore_last) kept.pop_back();
            working = a.first;
            has_working = true;
            break;
          case memkit::checkpoint::checkpoint_op::advance:
            REQUIRE((has_working && working == a.first && a.last > a.first));
            forwards += a.last - a.first;
            working = a.last;
            break;
          case memkit::checkpoint::checkpoint_op::tape:
            REQUIRE((has_working && working == a.first));
            taped[a.first] = true;
            ++forwards;
            working = a.first + 1;
            break;
          case memkit::checkpoint::checkpoint_op::backward:
            REQUIRE(a.first + 1 == next_backward);
            REQUIRE(taped[a.first]);
            taped[a.first] = false;
            next_backward = a.first;
            has_working = false;
            break;
        }
      }
      CHECK(next_backward == 0);
      CHECK(kept.empty());
      CHECK(forwards == plan.forwards);
      CHECK(plan.recomputed() == memkit::checkpoint::recomputed_forwards(s, n));
    }
}

TEST_CASE("checkpoint schedules: the budget's view keeps the checkpoints and taped layers the plan says") {
  // 32 layers in segments of 6: while layer i runs backward, the segments before its own are checkpoints
  // and its own segment is taped up to i.
  const memkit::checkpoint::checkpoint_trace every6 =
      memkit::checkpoint::trace_checkpointing(memkit::checkpoint::schedule::every_k_layers(6), 32, 10, 1000);
  CHECK(every6.after_forward == 6 * 10);
  for (std::uint64_t i = 0; i < 32; ++i) CHECK(every6.at_backward(i) == (i / 6) * 10 + (i % 6 + 1) * 1000);
  // Offloaded: no checkpoint stays on the device through the forward pass; host memory holds them all.
  const memkit::checkpoint::checkpoint_trace offloaded =
      memkit::checkpoint::trace_checkpointing(memkit::checkpoint::schedule::every_k_layers(6), 32, 10, 1000, true);
  CHECK(offloaded.after_forward == 0);
  CHECK(offloaded.host_bytes == 6 * 10);
  // Binomial with 3 slots: the first backward (layer 31) sees 3 checkpoints and its own taped layer.
  const memkit::checkpoint::checkpoint_trace revolve = memkit::checkpoint::trace_checkpointing(memkit::checkpoint::schedule::binomial(3), 32, 10, 1000);
  CHECK(revolve.after_forward == 3 * 10 + 1000);
  CHECK(revolve.at_backward(31) == 3 * 10 + 1000);
  CHECK(*std::max_element(revolve.backward_bytes.begin(), revolve.backward_bytes.end()) == 3 * 10 + 1000);
}
