// memkit/quant/blockwise.hpp — blockwise NF4 / FP4 / dynamic-int8 quantization, host and CUDA.
//
// A tensor is flattened row-major and cut into blocks of `block_size` consecutive elements (a block may
// straddle rows). Each block keeps its absolute maximum in fp32; each value is multiplied by the block's
// reciprocal 1/absmax (computed once per block, as bitsandbytes does) and mapped to the nearest code.
// 4-bit formats pack two codes per byte, the element at the even flat index in the high nibble; an odd
// element count pads the last byte with the code of 0.0. The int8 format stores one byte per value, an
// index into the signed dynamic 8-bit map. Results match bitsandbytes bit for bit.
//
// This header is the API. The formats, block sizes and per-element math (written once, MEMKIT_HOST_DEVICE)
// are in quant/formats.hpp; the host loops and CUDA kernels, which both call that math and so produce
// identical bytes, in quant/detail/blockwise_kernels.hpp, the x86 SIMD ones in quant/detail/blockwise_x86.hpp.
//
// Non-finite input: the host path throws memkit::error naming the tensor, the element and the block; it
// checks each group of blocks (up to max_block_size values) in the same pass that finds their absmax, before
// writing any of the group, so the input is read once (groups before the offending one are already written).
// The CUDA path cannot throw without synchronizing, so it marks the offending block by storing NaN as its
// absmax (every value of that block then decodes to NaN, never to silent garbage);
// find_nonfinite_block() locates it after the stream is synchronized (quantized_tensor does this for you).
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/checked_math.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/quant/detail/blockwise_kernels.hpp"
#include "memkit/quant/formats.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace quant {

// Quantizes `input` blockwise into `codes` (code_bytes(fmt, n) bytes) and `absmax` (block_count(n, b)
// floats). `tensor_name` names the tensor in error messages. `map` is the 8-bit map of the int8 format.
// `host_threads`: threads of the host path (0 = every hardware thread); the codes do not depend on it.
// Host, non-finite input: throws before writing the group of blocks (up to max_block_size values) that holds
// the value and every later group of its thread's range; groups already quantized keep their new contents.
template <executor E, class Input>
  requires float_storage<std::remove_const_t<Input>>
void quantize_blockwise(const E& exec, format fmt, tensor_view<Input> input, std::int64_t block_size,
                        tensor_view<std::uint8_t> codes, tensor_view<float> absmax,
                        const char* tensor_name = "input", const code_table<256>& map = signed_dynamic_table,
                        int host_threads = 1) {
  detail::quantize_blockwise_checked(exec, fmt, input, block_size, codes, absmax, tensor_name, map,
                                     "quant::quantize_blockwise", host_threads);
}

// Dequantizes flat elements [first_element, first_element + output.size()) of a blockwise-quantized tensor
// into `output` (fp32, bf16 or fp16). With first_element 0 and a full-size output it is the whole tensor;
// otherwise it is a tile, the building block of the quantized matmul.
template <executor E, float_storage T>
void dequantize_blockwise(const E& exec, format fmt, tensor_view<const std::uint8_t> codes,
                          tensor_view<const float> absmax, std::int64_t block_size, std::int64_t first_element,
                          tensor_view<T> output, const code_table<256>& map = signed_dynamic_table) {
  constexpr const char* operation = "quant::dequantize_blockwise";
  require_block_size(block_size, operation);
  const std::int64_t count = output.size();
  const std::int64_t capacity = is_four_bit(fmt) ? saturating_mul(std::int64_t{2}, codes.size()) : codes.size();
  // Compared without forming first_element + count, which wraps for first_element near INT64_MAX.
  require(within_range(first_element, count, capacity),
          std::string(operation) + ": " + std::to_string(count) + " elements from element " +
              std::to_string(first_element) + " are outside the " + std::to_string(capacity) + " values `codes` holds");
  const std::int64_t end = first_element + count;
  require(absmax.size() >= block_count(end, block_size),
          std::string(operation) + ": `absmax` has " + std::to_string(absmax.size()) + " entries but elements up to " +
              std::to_string(end) + " need " + std::to_string(block_count(end, block_size)));
  require_accessible(exec, codes, operation, "codes");
  require_accessible(exec, absmax, operation, "absmax");
  require_accessible(exec, output, operation, "output");
  block_scales scales;
  scales.absmax = absmax.data();
  detail::dequantize_with_scales(exec, fmt, codes.data(), scales, block_size, first_element, output, map,
                                 signed_dynamic_table);
}

// Host memory only: the first block whose absmax is not finite (how the CUDA quantizer marks a block that
// held Inf or NaN), or -1. Copy device absmax to the host first.
inline std::int64_t find_nonfinite_block(tensor_view<const float> absmax) {
  require_accessible(host, absmax, "quant::find_nonfinite_block", "absmax");
  return detail::first_nonfinite(absmax.data(), absmax.size());
}

}  // namespace quant

MEMKIT_NAMESPACE_END
