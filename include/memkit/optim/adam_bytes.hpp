// memkit/optim/adam_bytes.hpp — what an Adam state allocates, as constexpr functions, and nothing of its step.
//
// adam_state's memory is one allocation laid out as: the control block (adam_control), the gradient-norm
// scratch (one double per chunk of detail::reduction_chunk gradient elements), then per tensor its moment
// segments, each aligned to 64 bytes, m and v of a large tensor half a 4 KiB page apart modulo 4 KiB
// (detail::stagger_after), the absmax arrays last when the tensor is quantized. adam_layout<State, Block>
// computes that layout; adam_state (optim/adam_state.hpp) and sharded_adam_state (distributed/) allocate by it,
// and memory_budget (budget/component_bytes.hpp) charges by it, without compiling the optimizer's step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/protocol.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace detail {}
namespace optim {
// The optimizer's helpers live in optim::detail; memkit's own (bit_cast, mix64, with_device, ...) are found
// through it too, so `detail::x` names either inside optim.
namespace detail {
using namespace memkit::detail;
}  // namespace detail

// The flavour tag of 4-bit moments (adam_state<four_bit, 128>, torchao's AdamW4bit).
struct four_bit {};

// Tensors smaller than this keep fp32 moments in a quantized state (adam_options::min_quantized_size's default).
inline constexpr std::int64_t default_min_quantized_size = 4096;

// How a flavour stores its moments: the part of adam_state_traits (optim/state_codecs.hpp) the layout needs.
template <class State>
struct adam_moment_format;
namespace detail {
template <bool Quantized, int Bits, int DefaultBlock, class Moment>
struct moment_format {
  static constexpr bool quantized = Quantized;
  static constexpr int bits = Bits;
  static constexpr int default_block = DefaultBlock;  // 0: plain moments take no block
  using moment_type = Moment;                         // quantized: std::uint8_t codes (4-bit: two per byte)
};
}  // namespace detail
template <>
struct adam_moment_format<float> : detail::moment_format<false, 32, 0, float> {};
template <>
struct adam_moment_format<bf16> : detail::moment_format<false, 16, 0, bf16> {};
template <>
struct adam_moment_format<std::int8_t> : detail::moment_format<true, 8, 256, std::uint8_t> {};
template <>
struct adam_moment_format<four_bit> : detail::moment_format<true, 4, 128, std::uint8_t> {};

// What one step needs besides the per-group hyperparameters: written by the step's finalisation
// (detail::finalize_step) into the state's control block, which lives with the state, so the device
// can apply or skip a step without the host ever waiting for it.
struct adam_control {
  std::int64_t step = 0;               // steps applied so far (the t of the bias correction)
  std::int64_t skipped_steps = 0;      // steps refused because a gradient was not finite
  std::int64_t first_nonfinite_chunk = -1;  // of the last step; -1 when all gradients were finite
  double grad_norm = 0.0;              // global L2 norm of the last step's unscaled gradients
  float loss_scale = 1.0f;             // the scale the next backward pass should use
  std::int32_t good_steps = 0;         // finite steps since the scale last changed
  float grad_multiplier = 1.0f;        // 1/loss_scale times the clipping factor, for the step being applied
  std::int32_t applied = 0;            // 1 when the last step updated anything
};

namespace detail {

// Canonical gradient-norm reduction. A gradient is cut into chunks of reduction_chunk elements; lane l
// of reduction_lanes sums (in double) the squares of elements l, l + lanes, ... of its chunk, and the
// lanes are then added as a binary tree. The CUDA kernel (one block of `lanes` threads per chunk)
// and the host loop follow exactly this order, so both produce the same bits.
inline constexpr int reduction_lanes = 256;
inline constexpr std::int64_t reduction_chunk = 4096;

constexpr std::int64_t reduction_chunks(std::int64_t count) noexcept {
  return (count + reduction_chunk - 1) / reduction_chunk;
}


inline constexpr std::size_t adam_segment_alignment = 64;
constexpr std::size_t align_segment(std::size_t bytes) noexcept {
  return (bytes + adam_segment_alignment - 1) / adam_segment_alignment * adam_segment_alignment;
}

// The padding after a tensor's m segment (of `bytes`, a multiple of 64) that puts its v segment half a 4 KiB
// page away from m modulo 4 KiB. Without it, m and v of a tensor of 2^k elements lie exactly 2^(k+2) bytes apart,
// and the update's loads of one stream share their low 12 address bits with its stores to the other (4K
// aliasing: the core then waits on a false store-to-load dependency). Measured on a Cascade Lake (one thread,
// the fp32 update over 4M-64M elements, m and v 2^k bytes apart vs 2^k + 2048): 5-10% faster with the
// padding, on AVX-512 and AVX2. Segments under 256 KiB get none (the padding would be a sizeable share).
inline constexpr std::size_t adam_stagger_min_bytes = std::size_t{1} << 18;
constexpr std::size_t stagger_after(std::size_t bytes) noexcept {
  if (bytes < adam_stagger_min_bytes) return 0;
  constexpr std::size_t page = 4096, half_page = page / 2;
  return (half_page + page - bytes % page) % page;
}

// One tensor's segments, as offsets from its first byte, and the bytes it takes.
struct adam_segment_plan {
  std::size_t m_bytes = 0;  // m's segment (v's is as large); v starts at m_bytes + stagger_after(m_bytes)
  std::size_t v = 0, m_scale = 0, v_scale = 0, bytes = 0;

  // Sets the m/v (and, when quantized, scale) offsets of a tensor placed at `offset` of the arena (any type
  // with adam_tensor_layout's offset fields: adam_state's and sharded_adam_state's); returns the next offset.
  template <class Offsets>
  constexpr std::size_t place(Offsets& t, std::size_t offset, bool quantized) const noexcept {
    t.m_offset = offset;
    t.v_offset = offset + v;
    if (quantized) {
      t.m_scale_offset = offset + m_scale;
      t.v_scale_offset = offset + v_scale;
    }
    return offset + bytes;
  }
};

// Elements per work unit of a tensor with fp32/bf16 moments (one CUDA block each).
inline constexpr std::int64_t plain_unit = 4096;

// One tensor of an Adam state as the step sees it (adam_state's tensors, sharded_adam_state's pieces).
struct adam_tensor_layout {
  std::int64_t size = 0;
  bool quantized = false;
  std::int64_t units = 0;  // quantization blocks, or plain units of plain_unit elements
  std::size_t m_offset = 0, v_offset = 0, m_scale_offset = 0, v_scale_offset = 0;
  std::int64_t first_chunk = 0, chunks = 0;  // gradient-norm chunks
};

}  // namespace detail

// The component protocol (docs/architecture.md) for the optimizer: a state for tensors of these sizes.
template <class State, int Block = adam_moment_format<State>::default_block>
struct state_arguments;

// The layout of an Adam state of flavour State (float, bf16, std::int8_t, four_bit) and block size Block.
template <class State, int Block = adam_moment_format<State>::default_block>
struct adam_layout {
  using arguments = state_arguments<State, Block>;
  using format = adam_moment_format<State>;
  static constexpr bool quantized = format::quantized;
  static_assert(quantized ? (Block >= 64 && Block <= 4096 && (Block & (Block - 1)) == 0) : Block == 0,
                "adam_state: quantized states take a power-of-two block in [64, 4096]; fp32/bf16 states take none");
  using moment_type = typename format::moment_type;  // float or bf16 for plain states, std::uint8_t codes otherwise
  // What a plain tensor's moments are stored as: a quantized state's small tensors keep fp32.
  using plain_moment_type = std::conditional_t<quantized, float, moment_type>;
  static constexpr std::int64_t divisor_block = Block > 0 ? Block : 1;  // plain states never divide by it

  // Whether a tensor of `count` elements gets quantized moments under this threshold.
  static constexpr bool quantizes(std::int64_t count, std::int64_t min_quantized_size) noexcept {
    return quantized && count >= min_quantized_size;
  }
  // Bytes of one tensor's moments (and scales), with alignment padding.
  static constexpr std::size_t tensor_bytes(std::int64_t count, std::int64_t min_quantized_size = default_min_quantized_size) noexcept {
    return segment_plan(count, quantizes(count, min_quantized_size)).bytes;
  }
  // Where a tensor's segments lie: m (or m's codes) first, then v at m's size plus detail::stagger_after, then
  // (quantized) the two absmax arrays.
  static constexpr detail::adam_segment_plan segment_plan(std::int64_t count, bool quantized_tensor) noexcept {
    const auto n = static_cast<std::size_t>(count);
    detail::adam_segment_plan plan;
    if (!quantized_tensor) {
      plan.m_bytes = detail::align_segment(n * sizeof(plain_moment_type));
      plan.v = plan.m_bytes + detail::stagger_after(plan.m_bytes);
      plan.bytes = plan.v + plan.m_bytes;
      return plan;
    }
    const std::size_t blocks = (n + divisor_block - 1) / divisor_block;
    plan.m_bytes = detail::align_segment(format::bits == 8 ? n : (n + 1) / 2);
    const std::size_t scales = detail::align_segment(blocks * sizeof(float));
    plan.v = plan.m_bytes + detail::stagger_after(plan.m_bytes);
    plan.m_scale = plan.v + plan.m_bytes;
    plan.v_scale = plan.m_scale + scales;
    plan.bytes = plan.v_scale + scales;
    return plan;
  }
  // Bytes of the control block and gradient-norm scratch for tensors of these sizes.
  static constexpr std::size_t overhead_bytes(std::int64_t total_reduction_chunks) noexcept {
    return detail::align_segment(sizeof(adam_control)) +
           detail::align_segment(static_cast<std::size_t>(total_reduction_chunks) * sizeof(double));
  }
  // Exactly what a state for one tensor of `parameter_count` elements allocates.
  static constexpr std::size_t bytes_required(std::int64_t parameter_count,
                                              std::int64_t min_quantized_size = default_min_quantized_size) noexcept {
    return overhead_bytes(detail::reduction_chunks(parameter_count)) + tensor_bytes(parameter_count, min_quantized_size);
  }
  // Exactly what a state for tensors of these sizes allocates.
  static constexpr std::size_t bytes_required(std::span<const std::int64_t> sizes, std::int64_t min_quantized_size) noexcept {
    std::int64_t chunks = 0;
    std::size_t bytes = 0;
    for (std::int64_t n : sizes) {
      chunks += detail::reduction_chunks(n);
      bytes += tensor_bytes(n, min_quantized_size);
    }
    return overhead_bytes(chunks) + bytes;
  }
};

// `sizes` views the caller's list (one entry per parameter tensor, in the optimizer's order): a constexpr
// array keeps the whole computation in a constant expression.
template <class State, int Block>
struct state_arguments {
  std::span<const std::int64_t> sizes;
  std::int64_t min_quantized_size = default_min_quantized_size;
};
// A step takes nothing from a workspace: its scratch (the gradient norm's partial sums, the control block) is
// part of the state, allocated once by the constructor.
template <class State, int Block>
constexpr std::size_t workspace_bytes(const state_arguments<State, Block>&) noexcept {
  return 0;
}
template <class State, int Block>
constexpr std::size_t saved_bytes(const state_arguments<State, Block>&) noexcept {
  return 0;
}
// What the constructor allocates: the moments (and scales) of every tensor, the control block, the scratch.
template <class State, int Block>
constexpr std::size_t bytes_required(const state_arguments<State, Block>& a) noexcept {
  return adam_layout<State, Block>::bytes_required(a.sizes, a.min_quantized_size);
}

}  // namespace optim
MEMKIT_NAMESPACE_END
