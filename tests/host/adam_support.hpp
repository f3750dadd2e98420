// Helpers shared by the adam_state tests: random tensors, an independent double-precision AdamW,
// and byte snapshots of a state.
#pragma once

#include <memkit/optim/adam_state.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "support/test_values.hpp"

namespace adam_test {

using memkit_test::convert;

// Normal values with standard deviation `scale`.
inline std::vector<float> normal(std::size_t count, float scale, std::uint32_t seed) {
  std::vector<float> values = memkit_test::standard_normal(static_cast<std::int64_t>(count), seed);
  for (float& x : values) x *= scale;
  return values;
}

inline std::vector<float> to_floats(const auto& values) {
  std::vector<float> out;
  out.reserve(values.size());
  for (auto x : values) out.push_back(memkit::to_float(x));
  return out;
}

// AdamW as PyTorch defines it, in double, written independently of memkit's element function.
struct reference_adamw {
  std::vector<double> p, m, v;
  std::int64_t t = 0;

  explicit reference_adamw(const std::vector<float>& params)
      : p(params.begin(), params.end()), m(params.size(), 0.0), v(params.size(), 0.0) {}

  void step(const std::vector<float>& grad, const memkit::optim::adam_group& g) {
    ++t;
    const double lr = g.lr, b1 = g.beta1, b2 = g.beta2, eps = g.eps, wd = g.weight_decay;
    const double bias1 = 1.0 - std::pow(b1, static_cast<double>(t));
    const double bias2 = 1.0 - std::pow(b2, static_cast<double>(t));
    for (std::size_t i = 0; i < p.size(); ++i) {
      const double gi = grad[i];
      p[i] *= 1.0 - lr * wd;
      m[i] = b1 * m[i] + (1.0 - b1) * gi;
      v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
      p[i] -= lr / bias1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bias2) + eps);
    }
  }
};

// The arena's bytes with the gradient-norm scratch zeroed: it is no state (each step's leftovers, which differ
// between the host and a device), and save() writes it as zeros.
template <class S>
std::vector<std::byte> without_scratch(const S& state, std::vector<std::byte> bytes) {
  const auto [begin, end] = state.scratch_range();
  std::fill(bytes.begin() + static_cast<std::ptrdiff_t>(begin), bytes.begin() + static_cast<std::ptrdiff_t>(end),
            std::byte{0});
  return bytes;
}

template <class S>
std::vector<std::byte> snapshot(const S& state) {
  const auto view = state.arena_view();
  std::vector<std::byte> bytes(view.data(), view.data() + view.size());
  return without_scratch(state, std::move(bytes));
}

// The state as save() writes it (control block, moments and scales; the scratch as zeros).
template <class S, class E>
std::string saved_image(const E& exec, const S& state) {
  std::ostringstream out;
  state.save(exec, out);
  return out.str();
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace adam_test
