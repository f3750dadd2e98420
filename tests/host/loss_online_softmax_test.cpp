// loss::detail::online_softmax, the one-read max and sum of exp of the device's two-pass row kernel (#30), run on
// the host in that kernel's reduction structure: 1,024 threads, thread k taking four consecutive values per step
// (groups k, k + 1024, ...: add4) or one (add), then block_reduce_softmax's two xor-shuffle trees (within each warp,
// then over the warps' results). Checked against a double-precision log-sum-exp and against the classic kernel's
// form (the row's max first, then the sum of exp) in the same thread order: the kernel itself needs a GPU
// (tests/cuda/loss_test.cu), the arithmetic of its reduction does not.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <algorithm>
#include <vector>

#include "memkit/loss/detail/common.hpp"

namespace {

using memkit::loss::detail::online_softmax;

constexpr int threads = 1024;

// A 32-lane xor-shuffle tree: every lane merges with lane ^ offset, all lanes at once, offsets 16 .. 1.
online_softmax shuffle_tree(std::vector<online_softmax> lanes) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    std::vector<online_softmax> next = lanes;
    for (int l = 0; l < 32; ++l) next[l].merge(lanes[l ^ offset].max, lanes[l ^ offset].sum);
    lanes = next;
  }
  // The tree is symmetric: every lane holds the same state (the kernel relies on it).
  for (int l = 1; l < 32; ++l) {
    REQUIRE(std::memcmp(&lanes[l].max, &lanes[0].max, sizeof(float)) == 0);
    REQUIRE(std::memcmp(&lanes[l].sum, &lanes[0].sum, sizeof(float)) == 0);
  }
  return lanes[0];
}

// The two-pass kernel's state of one row after the block reduction (its lse() is the row's log-sum-exp).
online_softmax online_state(const std::vector<float>& z, bool vector) {
  const std::int64_t V = static_cast<std::int64_t>(z.size());
  std::vector<online_softmax> state(threads);
  for (int k = 0; k < threads; ++k) {
    if (vector)
      for (std::int64_t i = k; i < V / 4; i += threads) state[k].add4(z[4 * i], z[4 * i + 1], z[4 * i + 2], z[4 * i + 3]);
    else
      for (std::int64_t j = k; j < V; j += threads) state[k].add(z[j]);
  }
  std::vector<online_softmax> warps;
  for (int w = 0; w < threads / 32; ++w)
    warps.push_back(shuffle_tree(std::vector<online_softmax>(state.begin() + 32 * w, state.begin() + 32 * w + 32)));
  warps.resize(32);  // lanes past the warp count hold the empty state
  return shuffle_tree(warps);
}

// The classic kernel's: the row's max, then the sum of exp(z - max), each per thread in stride order and then
// summed over the block by the same tree shape.
online_softmax classic_state(const std::vector<float>& z) {
  const std::int64_t V = static_cast<std::int64_t>(z.size());
  const auto tree = [](std::vector<float> values, bool is_max) {
    const auto reduce32 = [&](std::vector<float> lanes) {
      for (int offset = 16; offset > 0; offset >>= 1) {
        std::vector<float> next = lanes;
        for (int l = 0; l < 32; ++l) next[l] = is_max ? std::fmax(lanes[l], lanes[l ^ offset]) : lanes[l] + lanes[l ^ offset];
        lanes = next;
      }
      return lanes[0];
    };
    std::vector<float> warps;
    for (int w = 0; w < threads / 32; ++w)
      warps.push_back(reduce32(std::vector<float>(values.begin() + 32 * w, values.begin() + 32 * w + 32)));
    warps.resize(32, is_max ? -INFINITY : 0.0f);
    return reduce32(warps);
  };
  std::vector<float> largest(threads, -INFINITY), sum(threads, 0.0f);
  for (int k = 0; k < threads; ++k)
    for (std::int64_t j = k; j < V; j += threads) largest[k] = std::fmax(largest[k], z[j]);
  const float row_max = tree(largest, true);
  for (int k = 0; k < threads; ++k)
    for (std::int64_t j = k; j < V; j += threads) sum[k] += std::exp(z[j] - row_max);
  return {row_max, tree(sum, false)};
}

// sum_j exp(z_j - shift) in double.
double reference_sum(const std::vector<float>& z, float shift) {
  double sum = 0;
  for (float v : z) sum += std::exp(static_cast<double>(v) - static_cast<double>(shift));
  return sum;
}

// The relative error of a state's sum against the double sum at the state's own max, in units of 2^-24.
double sum_error(const online_softmax& state, const std::vector<float>& z) {
  const double exact = reference_sum(z, state.max);
  return std::fabs(static_cast<double>(state.sum) - exact) / exact / std::ldexp(1.0, -24);
}

std::vector<float> row(std::int64_t V, int kind) {
  std::vector<float> z(static_cast<std::size_t>(V));
  std::uint64_t state = 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(kind);
  for (std::int64_t j = 0; j < V; ++j) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const float u = static_cast<float>(state >> 40) / static_cast<float>(1 << 24);  // [0, 1)
    const float x = static_cast<float>(j) / static_cast<float>(V);
    switch (kind) {
      case 0: z[j] = 60.0f * u - 30.0f; break;                 // logits of a trained head's scale
      case 1: z[j] = 40.0f * x - 20.0f + 0.01f * u; break;      // rising: the max grows at every step
      case 2: z[j] = 20.0f - 40.0f * x + 0.01f * u; break;      // falling: the first value is the max
      case 3: z[j] = j == V / 3 ? 50.0f : 4.0f * u - 2.0f; break;  // one dominant logit (a confident row)
      default: z[j] = 1.5f; break;                              // all equal: lse = 1.5 + log V
    }
  }
  return z;
}

}  // namespace

TEST_CASE("loss: the two-pass row kernel's online softmax against double precision and the classic form") {
  // The sum of exp against the double sum at the same max, relative, in units of 2^-24 (with the host's expf; the
  // device's adds its own 2-ulp error to both forms alike). Measured (g++ 12, glibc): classic 1.77, online 1.93 (a
  // rounding more per rescale); both are held to 4.
  double worst_classic = 0, worst_online = 0;
  for (const std::int64_t V : {std::int64_t{128256}, std::int64_t{60002}, std::int64_t{32000}, std::int64_t{37}}) {
    for (int kind = 0; kind < 5; ++kind) {
      CAPTURE(V);
      CAPTURE(kind);
      const std::vector<float> z = row(V, kind);
      const online_softmax classic = classic_state(z);
      worst_classic = std::max(worst_classic, sum_error(classic, z));
      for (const bool vector : {true, false}) {
        if (vector && V % 4 != 0) continue;
        CAPTURE(vector);
        const online_softmax online = online_state(z, vector);
        CHECK(online.max == classic.max);  // the max is exact whatever the order
        worst_online = std::max(worst_online, sum_error(online, z));
        // And the log-sum-exp: within one fp32 spacing of the classic form's.
        const float lse = online.lse(), classic_lse = classic.lse();
        CHECK(std::fabs(lse - classic_lse) <= std::nextafter(std::fabs(classic_lse), INFINITY) - std::fabs(classic_lse));
      }
    }
  }
  MESSAGE("sum of exp, worst relative error in 2^-24: classic " << worst_classic << ", online " << worst_online);
  CHECK(worst_classic <= 4);
  CHECK(worst_online <= 4);
}

TEST_CASE("loss: online_softmax's edge cases (empty lanes, masked logits, a row of -inf, NaN)") {
  online_softmax empty;
  CHECK(empty.max == -INFINITY);
  CHECK(empty.sum == 0.0f);
  online_softmax first;
  first.add(3.0f);
  CHECK(first.max == 3.0f);
  CHECK(first.sum == 1.0f);
  // An empty state merged either way changes nothing (the lanes past the warp count, threads without values).
  online_softmax a = first;
  a.merge(empty.max, empty.sum);
  CHECK(a.max == 3.0f);
  CHECK(a.sum == 1.0f);
  online_softmax b = empty;
  b.merge(first.max, first.sum);
  CHECK(b.max == 3.0f);
  CHECK(b.sum == 1.0f);
  // -inf entries (masked logits) add exp(-inf) = 0 once a finite value is seen, in either order.
  online_softmax masked;
  masked.add4(-INFINITY, 2.0f, -INFINITY, 2.0f);
  masked.add(-INFINITY);
  CHECK(masked.lse() == doctest::Approx(2.0 + std::log(2.0)));
  // A row of -inf only: NaN, as the classic kernel's exp(-inf - -inf).
  online_softmax none;
  none.add(-INFINITY);
  CHECK(std::isnan(none.lse()));
  // NaN in the row reaches the result.
  online_softmax with_nan;
  with_nan.add4(1.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f, 0.0f);
  CHECK(std::isnan(with_nan.lse()));
}
