// memkit/budget/component_bytes.hpp — bytes of quantized weights and quantized optimizer state.
//
// Stand-ins: the quantization and optimizer components (built on their own branches) will own the
// authoritative `bytes_required` functions for these layouts; when they are merged the budget
// switches over to them. Until then these follow the layouts in shared/REFERENCE.md:
//   NF4/FP4 weight (bitsandbytes): ceil(n/2) packed bytes, 16-entry fp32 code map, and per block of
//     `block_size` either one fp32 absmax, or with double quantization one uint8 code per block plus
//     per 256 blocks one fp32 second-level absmax, a 256-entry fp32 second-level map and an fp32 offset.
//   int8 weight: one byte per element and one fp32 scale per block (per row for LLM.int8).
//   8-bit / 4-bit blockwise optimizer state: codes plus one fp32 absmax per block; tensors with fewer
//     than 4096 elements keep fp32 state.
#pragma once

#include <cstdint>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

constexpr std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) noexcept { return b == 0 ? 0 : (a + b - 1) / b; }

inline constexpr std::uint64_t nested_block_size = 256;     // double quantization's second-level block
inline constexpr std::uint64_t small_tensor_elements = 4096;  // below this, optimizer state stays fp32

// An NF4 (or FP4) weight of `elements` values, quantized in blocks of `block_size`.
constexpr std::uint64_t nf4_bytes(std::uint64_t elements, std::uint64_t block_size, bool double_quant) noexcept {
  const std::uint64_t blocks = ceil_div(elements, block_size);
  const std::uint64_t packed = ceil_div(elements, 2);
  const std::uint64_t code_map = 16 * 4;
  if (!double_quant) return packed + blocks * 4 + code_map;
  const std::uint64_t nested = ceil_div(blocks, nested_block_size) * 4 + 256 * 4 + 4;
  return packed + blocks + nested + code_map;
}
constexpr std::uint64_t fp4_bytes(std::uint64_t elements, std::uint64_t block_size, bool double_quant) noexcept {
  return nf4_bytes(elements, block_size, double_quant);
}

// An int8 weight with one fp32 scale per block of `block_size` (the row length for LLM.int8).
constexpr std::uint64_t int8_bytes(std::uint64_t elements, std::uint64_t block_size) noexcept {
  return elements + ceil_div(elements, block_size) * 4;
}

// One optimizer state tensor quantized to `bits` (8 or 4) per element, fp32 absmax per block;
// small tensors keep the state in fp32.
constexpr std::uint64_t quantized_state_bytes(std::uint64_t elements, unsigned bits, std::uint64_t block_size) noexcept {
  if (elements < small_tensor_elements) return elements * 4;
  return ceil_div(elements * bits, 8) + ceil_div(elements, block_size) * 4;
}

// Adam's two states, blockwise 8-bit (bitsandbytes, block 256).
constexpr std::uint64_t adam_8bit_state_bytes(std::uint64_t elements, std::uint64_t block_size = 256) noexcept {
  return 2 * quantized_state_bytes(elements, 8, block_size);
}
// Adam's two states, blockwise 4-bit (torchao AdamW4bit, block 128).
constexpr std::uint64_t adam_4bit_state_bytes(std::uint64_t elements, std::uint64_t block_size = 128) noexcept {
  return 2 * quantized_state_bytes(elements, 4, block_size);
}

}  // namespace budget
MEMKIT_NAMESPACE_END
