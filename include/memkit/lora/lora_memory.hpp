// memkit/lora/lora_memory.hpp — what a lora_linear saves for backward and how many parameters it trains, as
// constexpr functions with no dependencies, so that memory_budget (budget/activations.hpp) counts a LoRA
// adapter with the same arithmetic the layer (lora/lora_linear.hpp) allocates by.
#pragma once

#include <cstddef>
#include <cstdint>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace lora {

// The tensors one forward saves for its backward, in bytes.
struct saved_bytes_parts {
  std::size_t adapter_input = 0;   // dropout(x) [tokens, in]
  std::size_t adapter_output = 0;  // dropout(x) A^T [tokens, r]
  std::size_t record = 0;          // the dropout stream (seed, counter, applied, tokens)
  constexpr std::size_t total() const noexcept { return adapter_input + adapter_output + record; }
};

inline constexpr std::int64_t record_words = 4;

// Bytes saved by a forward over `tokens` rows (batch * sequence) with activations of `element_bytes`.
// Dropout on or off saves the same: the mask is drawn again in backward, not kept.
constexpr saved_bytes_parts saved_activation_bytes(std::int64_t tokens, std::int64_t in, std::int64_t rank,
                                                   std::size_t element_bytes) noexcept {
  saved_bytes_parts s;
  s.adapter_input = static_cast<std::size_t>(tokens * in) * element_bytes;
  s.adapter_output = static_cast<std::size_t>(tokens * rank) * element_bytes;
  s.record = static_cast<std::size_t>(record_words) * sizeof(std::uint64_t);
  return s;
}

// Trainable parameters of one adapter (A and B; the bias is counted by whoever owns it).
constexpr std::int64_t adapter_parameter_count(std::int64_t in, std::int64_t out, std::int64_t rank) noexcept {
  return rank * in + out * rank;
}

}  // namespace lora

MEMKIT_NAMESPACE_END
