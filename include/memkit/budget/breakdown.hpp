// memkit/budget/breakdown.hpp — the categories memory_budget reports bytes in, and a breakdown of bytes by
// category: what budget::estimate (a transformer preset) and budget::layer_list (a model as a list of layers)
// both return.
#pragma once

#include <cstdint>
#include <string_view>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

enum class category : std::uint8_t {
  weights,
  gradients,
  master_weights,
  optimizer_state,
  activations,
  logits,
  workspace,
  overhead,
};
inline constexpr int category_count = 8;

constexpr std::string_view to_string(category c) noexcept {
  switch (c) {
    case category::weights: return "weights";
    case category::gradients: return "gradients";
    case category::master_weights: return "master_weights";
    case category::optimizer_state: return "optimizer_state";
    case category::activations: return "activations";
    case category::logits: return "logits";
    case category::workspace: return "workspace";
    case category::overhead: return "overhead";
  }
  return "?";
}

struct breakdown {
  std::uint64_t bytes[category_count]{};

  constexpr std::uint64_t& operator[](category c) noexcept { return bytes[static_cast<int>(c)]; }
  constexpr std::uint64_t operator[](category c) const noexcept { return bytes[static_cast<int>(c)]; }
  constexpr std::uint64_t total() const noexcept {
    std::uint64_t sum = 0;
    for (std::uint64_t b : bytes) sum += b;
    return sum;
  }
  constexpr category largest() const noexcept {
    int best = 0;
    for (int i = 1; i < category_count; ++i)
      if (bytes[i] > bytes[best]) best = i;
    return static_cast<category>(best);
  }
};

}  // namespace budget
MEMKIT_NAMESPACE_END
