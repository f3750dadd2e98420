// memkit's one absmax rule (core/rounded_math.hpp: max_magnitude), which the 8-bit and 4-bit optimizer
// state's host loop (max_magnitude_bits over a block) and its CUDA kernel (max_abs per thread, then a tree
// across the CTA) both apply. These cases pin the rule, NaN included, and check that the device's order of
// reduction, replayed here on the host, gives the host's bits.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "memkit/core/rounded_math.hpp"
#include "memkit/optim/state_codecs.hpp"

namespace {
using memkit::optim::detail::max_abs;
using memkit::detail::max_magnitude;
using memkit::detail::max_magnitude_bits;

std::uint32_t bits(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
float from_bits(std::uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// The CUDA 8-bit/4-bit Adam kernel's order (optim/adam_state.hpp): thread t folds elements t, t + T, ...
// with max_abs, then the CTA halves its T partial results until one is left.
float device_order_absmax(const std::vector<float>& block, int threads) {
  std::vector<float> partial(static_cast<std::size_t>(threads), 0.0f);
  for (std::size_t e = 0; e < block.size(); ++e) partial[e % threads] = max_abs(partial[e % threads], block[e]);
  for (int stride = threads / 2; stride > 0; stride /= 2)
    for (int lane = 0; lane < stride; ++lane) partial[lane] = max_abs(partial[lane], partial[lane + stride]);
  return partial[0];
}
// A plain left-to-right fold, and the same fold from the right.
float fold_left(const std::vector<float>& block) {
  float m = 0.0f;
  for (float x : block) m = max_abs(m, x);
  return m;
}
float fold_right(const std::vector<float>& block) {
  float m = 0.0f;
  for (auto it = block.rbegin(); it != block.rend(); ++it) m = max_abs(m, *it);
  return m;
}
}  // namespace

TEST_CASE("absmax rule: magnitudes compare as IEEE bits; NaN beats Inf beats every finite value") {
  const float inf = std::numeric_limits<float>::infinity();
  const float qnan = from_bits(0x7fc00000u), big_payload = from_bits(0x7fc12345u);
  CHECK(bits(max_magnitude(0.0f, -3.5f)) == bits(3.5f));
  CHECK(bits(max_magnitude(2.0f, -1.0f)) == bits(2.0f));
  CHECK(bits(max_magnitude(0.0f, -0.0f)) == bits(0.0f));  // the sign is cleared: -0 is 0
  CHECK(bits(max_magnitude(3.0f, -inf)) == bits(inf));
  // NaN wins in either position (a float compare keeps it only when it is already the current maximum).
  CHECK(std::isnan(max_magnitude(1.0f, qnan)));
  CHECK(std::isnan(max_magnitude(qnan, 1.0f)));
  CHECK(std::isnan(max_magnitude(inf, qnan)));
  CHECK(std::isnan(max_magnitude(qnan, inf)));
  // Between NaNs the larger payload wins, and a negative NaN counts by its magnitude: order-free.
  CHECK(bits(max_magnitude(qnan, big_payload)) == 0x7fc12345u);
  CHECK(bits(max_magnitude(big_payload, qnan)) == 0x7fc12345u);
  CHECK(bits(max_magnitude(0.0f, from_bits(0xffc12345u))) == 0x7fc12345u);
  // The optimizer state's per-element helper is the same function.
  CHECK(bits(max_abs(qnan, 1.0f)) == bits(max_magnitude(qnan, 1.0f)));
  CHECK(bits(max_abs(1.0f, qnan)) == bits(max_magnitude(1.0f, qnan)));
}

TEST_CASE("absmax rule: the device's reduction order gives the host's absmax bit for bit, NaN anywhere") {
  std::mt19937 rng(14);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  const std::uint32_t specials[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fffffffu, 0x7f800000u, 0xff800000u};
  int mismatches = 0, nan_lost = 0;
  for (int block_size : {64, 256, 2048})
    for (int threads : {32, 128, 256})
      for (int trial = 0; trial < 24; ++trial) {
        std::vector<float> block(static_cast<std::size_t>(block_size));
        for (float& x : block) x = normal(rng);
        // Trials 0..5: one special value at a random place; 6..11: two of them; the rest finite only.
        const int specials_in_block = trial < 6 ? 1 : trial < 12 ? 2 : 0;
        for (int s = 0; s < specials_in_block; ++s) block[rng() % block.size()] = from_bits(specials[(trial + s) % 6]);
        bool has_nan = false;
        for (float x : block) has_nan |= std::isnan(x);
        const std::uint32_t host = max_magnitude_bits(block.data(), static_cast<std::int64_t>(block.size()));
        for (float device : {device_order_absmax(block, threads), fold_left(block), fold_right(block)}) {
          if (bits(device) != host) ++mismatches;
          if (has_nan && !std::isnan(device)) ++nan_lost;
        }
        if (has_nan) CHECK(std::isnan(from_bits(host)));
      }
  CHECK(mismatches == 0);
  CHECK(nan_lost == 0);
}
