// memkit/budget/component_bytes.hpp — bytes of quantized weights and optimizer state, taken from the
// components that allocate them.
//
// memory_budget predicts what memkit itself allocates, so these are not formulas of their own: each
// forwards to the component's constexpr byte functions (quant/bytes.hpp's quantized_tensor_bytes,
// optim/adam_bytes.hpp, distributed/sharded_adam_bytes.hpp). A change in a component's layout changes the budget with it, and the tests
// that compare the budget with a tracking_resource keep the two honest.
//   NF4/FP4 weight: ceil(n/2) packed bytes, and per block of `block_size` one fp32 absmax, or with double
//     quantization one uint8 code per block plus one fp32 absmax per 256 blocks and an fp32 offset.
//     (The 16-entry code map is a constant of the program, not an allocation.)
//   int8 weight: one byte per element and one fp32 absmax per block.
//   Adam state: two moments per tensor (fp32, bf16, or codes plus one fp32 absmax per block per moment),
//     each segment aligned to 64 bytes; tensors with fewer than 4096 elements keep fp32 moments.
//   Sharded Adam state (ZeRO 1/2/3): distributed/sharded_adam_bytes.hpp's max_bytes_per_rank.
//   ZeRO-3 weight shards and gather staging: distributed/sharded_parameters_bytes.hpp (used by estimate.hpp).
#pragma once

#include <cstdint>
#include <span>

#include "memkit/config.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/distributed/sharded_adam_bytes.hpp"
#include "memkit/distributed/sharded_parameters_bytes.hpp"
#include "memkit/optim/adam_bytes.hpp"
#include "memkit/quant/bytes.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

constexpr std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) noexcept { return b == 0 ? 0 : (a + b - 1) / b; }

namespace detail {
template <quant::format F>
constexpr std::uint64_t quantized_weight_bytes(std::uint64_t elements, std::uint64_t block_size, bool double_quant) noexcept {
  return quant::quantized_tensor_bytes(
      F, shape{static_cast<std::int64_t>(elements)},
      quant::quant_options{static_cast<std::int64_t>(block_size), double_quant});
}
}  // namespace detail

// An NF4 (or FP4) weight of `elements` values, quantized in blocks of `block_size`.
constexpr std::uint64_t nf4_bytes(std::uint64_t elements, std::uint64_t block_size, bool double_quant) noexcept {
  return detail::quantized_weight_bytes<quant::NF4>(elements, block_size, double_quant);
}
constexpr std::uint64_t fp4_bytes(std::uint64_t elements, std::uint64_t block_size, bool double_quant) noexcept {
  return detail::quantized_weight_bytes<quant::FP4>(elements, block_size, double_quant);
}
// An int8 weight with one fp32 absmax per block of `block_size` (the row length for LLM.int8-style rows).
constexpr std::uint64_t int8_bytes(std::uint64_t elements, std::uint64_t block_size) noexcept {
  return detail::quantized_weight_bytes<quant::INT8>(elements, block_size, false);
}

// Adam's two moments for one tensor of `elements`, as adam_state allocates them.
constexpr std::uint64_t adam_fp32_state_bytes(std::uint64_t elements) noexcept {
  return optim::adam_layout<float>::tensor_bytes(static_cast<std::int64_t>(elements));
}
constexpr std::uint64_t adam_bf16_state_bytes(std::uint64_t elements) noexcept {
  return optim::adam_layout<bf16>::tensor_bytes(static_cast<std::int64_t>(elements));
}
// Blockwise 8-bit (bitsandbytes' current block 256).
constexpr std::uint64_t adam_8bit_state_bytes(std::uint64_t elements) noexcept {
  return optim::adam_layout<std::int8_t, 256>::tensor_bytes(static_cast<std::int64_t>(elements));
}
// Blockwise 4-bit (torchao AdamW4bit, block 128).
constexpr std::uint64_t adam_4bit_state_bytes(std::uint64_t elements) noexcept {
  return optim::adam_layout<optim::four_bit, 128>::tensor_bytes(static_cast<std::int64_t>(elements));
}

// adam_state's fixed part, once per state: its control block and the gradient-norm scratch, which has
// adam_reduction_chunks(n) entries per tensor of n elements.
constexpr std::uint64_t adam_reduction_chunks(std::uint64_t elements) noexcept {
  return static_cast<std::uint64_t>(optim::detail::reduction_chunks(static_cast<std::int64_t>(elements)));
}
constexpr std::uint64_t adam_overhead_bytes(std::uint64_t total_reduction_chunks) noexcept {
  return optim::adam_layout<float>::overhead_bytes(static_cast<std::int64_t>(total_reduction_chunks));
}

// ZeRO stages 1/2: the most any of `ranks` ranks allocates for a distributed::sharded_adam_state over tensors of
// these sizes (its moments of 1/ranks of the elements, plus the control block and the norm scratch of all
// chunks), for each flavour as above.
template <class State, int Block>
constexpr std::uint64_t sharded_adam_state_bytes(std::span<const std::int64_t> sizes, std::uint64_t ranks) {
  return distributed::sharded_adam_layout<State, Block>::max_bytes_per_rank(sizes, static_cast<int>(ranks),
                                                                        optim::default_min_quantized_size);
}
// The fp32 master shard a rank keeps next to it (sharded_adam_state's shard_size elements).
constexpr std::uint64_t sharded_master_bytes(std::span<const std::int64_t> sizes, std::uint64_t ranks) {
  return 4 * static_cast<std::uint64_t>(distributed::sharded_adam_layout<float>::shard_size(sizes, static_cast<int>(ranks)));
}

}  // namespace budget
MEMKIT_NAMESPACE_END
