// memkit/quant/quantized_tensor.hpp — an owning, blockwise-quantized tensor (NF4, FP4 or int8).
//
// quantized_tensor<NF4> holds the codes and scales of one tensor, allocated from a memkit memory_resource
// (so a tracking_resource sees every byte), and remembers the tensor's logical shape. Options: block size
// (a power of two from 32 to 4096; 64 is QLoRA's) and double quantization of the scales.
//
// Storage, each one buffer:
//   codes          uint8[code_bytes]            two 4-bit codes per byte, or one int8 code per byte
//   scales         fp32[blocks]                 without double quantization, or with it:
//   nested codes   uint8[blocks]
//   nested absmax  fp32[groups + 1]             one per 256 blocks, then the offset
// bytes_required(shape, options) is exactly what a tensor allocates; quantize() and quantize_into()
// additionally hold workspace_bytes(quantize_arguments{...}) for the first-level scales while they
// double-quantize them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/blockwise.hpp"
#include "memkit/quant/bytes.hpp"
#include "memkit/quant/double_quant.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace quant {

template <format F>
class quantized_tensor {
 public:
  static constexpr format quant_format = F;

  // Exact bytes a tensor of `dims` allocates (codes and scales).
  static constexpr std::size_t bytes_required(const shape& dims, const quant_options& options) noexcept {
    return quantized_tensor_bytes(F, dims, options);
  }

  quantized_tensor() = default;

  // Storage for a tensor of `dims`, contents uninitialized (fill it with quantize_into() or a loader).
  quantized_tensor(memory_resource& resource, shape dims, quant_options options)
      : shape_(dims),
        options_(checked(options, "quantized_tensor")),
        // The unused kind of scales gets an empty buffer: shape {0} allocates nothing (a default buffer's
        // rank-0 shape would count as one element).
        codes_(resource, shape{code_bytes(F, dims.numel())}),
        absmax_(resource, shape{options.double_quant ? 0 : block_count(dims.numel(), options.block_size)}),
        nested_codes_(resource, shape{options.double_quant ? block_count(dims.numel(), options.block_size) : 0}),
        nested_absmax_(resource, shape{options.double_quant
                                           ? nested_group_count(block_count(dims.numel(), options.block_size)) + 1
                                           : 0}) {}

  // Quantizes `input` into a new tensor of the same shape, allocated from `resource`. `name` names the
  // tensor in errors. Host: non-finite input throws (naming the block) before anything is allocated.
  // CUDA: asynchronous; call require_finite() after synchronizing to learn about Inf/NaN input.
  template <executor E, class Input>
    requires float_storage<std::remove_const_t<Input>>
  static quantized_tensor quantize(const E& exec, tensor_view<Input> input, quant_options options,
                                   memory_resource& resource, const char* name = "weight") {
    checked(options, "quantized_tensor::quantize");
    require_accessible(exec, input, "quantized_tensor::quantize", "input");
    // The check reads the input once more than quantize_into (whose quantization checks in its single pass),
    // so that a rejected input costs no allocation.
    if constexpr (!E::on_device)
      detail::require_finite_host(input.data(), input.size(), options.block_size, "quantized_tensor::quantize", name);
    quantized_tensor result(resource, input.shape(), options);
    // Construction allocates the tensor anyway, so `resource` may be any device resource here (quantize_into,
    // the repeated operation, takes only a stream-ordered workspace).
    result.quantize_checked(exec, input, resource, name, "quantized_tensor::quantize", false);
    return result;
  }

  // Quantizes `input` (same shape) into this tensor's storage; `name` names the tensor in errors. `workspace`
  // serves the temporary scales (workspace_bytes(quantize_arguments{F, shape, options})). On CUDA they are
  // allocated and released on exec.stream, so the workspace must be stream-ordered (device_async_resource, or a
  // tracker over one; docs/cuda.md, "Workspace").
  template <executor E, class Input>
    requires float_storage<std::remove_const_t<Input>>
  void quantize_into(const E& exec, tensor_view<Input> input, const char* name, memory_resource& workspace) {
    require(input.shape() == shape_, std::string("quantized_tensor::quantize_into: input has shape ") +
                                         to_string(input.shape()) + " but the tensor has shape " + to_string(shape_));
    quantize_checked(exec, input, workspace, name, "quantized_tensor::quantize_into", true);
  }

 private:
  // quantize_into; `operation` names the caller in errors.
  // `stream_ordered_workspace`: the CUDA path requires a stream-ordered workspace (quantize_into).
  template <executor E, class Input>
  void quantize_checked(const E& exec, tensor_view<Input> input, memory_resource& workspace, const char* name,
                        const char* operation, bool stream_ordered_workspace) {
    if (!options_.double_quant) {
      detail::quantize_blockwise_checked(exec, F, input, options_.block_size, codes_.view(), absmax_.view(), name,
                                         signed_dynamic_table, operation, 1);
      return;
    }
    const std::int64_t blocks = block_count(numel(), options_.block_size);
    buffer<float> first_level;
    if constexpr (E::on_device) {
#if MEMKIT_HAS_CUDA
      if (stream_ordered_workspace && blocks > 0)
        ::memkit::detail::require_stream_ordered(workspace, "quantized_tensor::quantize_into");
      // Allocated and released on exec.stream, in order with the two kernels that use it.
      first_level = buffer<float>(workspace, shape{blocks}, on_stream{exec.stream});
#endif
    } else {
      (void)stream_ordered_workspace;
      first_level = buffer<float>(workspace, shape{blocks});
    }
    detail::quantize_blockwise_checked(exec, F, input, options_.block_size, codes_.view(), first_level.view(), name,
                                       signed_dynamic_table, operation, 1);
    quantize_scales(exec, std::as_const(first_level).view(), nested_codes_.view(), nested_group_absmax(),
                    offset_view(), nested_map_);
  }

 public:
  const shape& logical_shape() const noexcept { return shape_; }
  const quant_options& options() const noexcept { return options_; }
  std::int64_t numel() const noexcept { return shape_.numel(); }
  std::int64_t block_size() const noexcept { return options_.block_size; }
  std::int64_t blocks() const noexcept { return block_count(numel(), options_.block_size); }
  memory_kind where() const noexcept { return codes_.where(); }
  // Bytes this tensor holds, equal to bytes_required(logical_shape(), options()).
  std::size_t bytes() const noexcept {
    return codes_.bytes() + absmax_.bytes() + nested_codes_.bytes() + nested_absmax_.bytes();
  }

  tensor_view<std::uint8_t> codes() noexcept { return codes_.view(); }
  tensor_view<const std::uint8_t> codes() const noexcept { return codes_.view(); }
  // Plain fp32 scales (empty when double-quantized).
  tensor_view<float> absmax() noexcept { return absmax_.view(); }
  tensor_view<const float> absmax() const noexcept { return absmax_.view(); }
  // Double-quantized scales (empty otherwise): codes, one fp32 absmax per 256 blocks, and the offset.
  tensor_view<std::uint8_t> nested_codes() noexcept { return nested_codes_.view(); }
  tensor_view<const std::uint8_t> nested_codes() const noexcept { return nested_codes_.view(); }
  tensor_view<float> nested_group_absmax() noexcept { return nested_part(0, nested_group_count(blocks())); }
  tensor_view<const float> nested_group_absmax() const noexcept {
    return const_cast<quantized_tensor*>(this)->nested_group_absmax();
  }
  tensor_view<float> offset_view() noexcept { return nested_part(nested_group_count(blocks()), 1); }
  tensor_view<const float> offset_view() const noexcept { return const_cast<quantized_tensor*>(this)->offset_view(); }

  // The 256-entry map of the double-quantized scales: the signed dynamic map, or the one a checkpoint
  // stored (PyTorch builds it with float arithmetic whose last bits can depend on the CPU).
  const code_table<256>& nested_map() const noexcept { return nested_map_; }
  void set_nested_map(const code_table<256>& map) noexcept { nested_map_ = map; }

  // The scales as kernels and loops read them.
  block_scales scales() const noexcept {
    block_scales s;
    if (options_.double_quant) {
      s.nested_codes = nested_codes_.data();
      s.nested_absmax = nested_absmax_.data();
      s.offset = nested_absmax_.data() + nested_group_count(blocks());
    } else {
      s.absmax = absmax_.data();
    }
    return s;
  }

  // Dequantizes the whole tensor into `out` (same element count) as fp32, bf16 or fp16.
  template <executor E, float_storage T>
  void dequantize(const E& exec, tensor_view<T> out) const {
    require(out.size() == numel(), "quantized_tensor::dequantize: `out` has " + std::to_string(out.size()) +
                                       " elements but the tensor has " + std::to_string(numel()) + " " +
                                       to_string(shape_));
    dequantize_range(exec, 0, out);
  }

  // Dequantizes flat elements [first_element, first_element + out.size()), e.g. a range of rows of a matrix.
  template <executor E, float_storage T>
  void dequantize_range(const E& exec, std::int64_t first_element, tensor_view<T> out) const {
    constexpr const char* operation = "quantized_tensor::dequantize_range";
    require(within_range(first_element, out.size(), numel()),
            std::string(operation) + ": " + std::to_string(out.size()) + " elements from element " +
                std::to_string(first_element) + " are outside the tensor's " + std::to_string(numel()));
    require_accessible(exec, codes(), operation, "the tensor");
    require_accessible(exec, out, operation, "out");
    detail::dequantize_with_scales(exec, F, codes_.data(), scales(), options_.block_size, first_element, out,
                                   signed_dynamic_table, nested_map_);
  }

  // Rows [first_row, first_row + out rows) of a tensor seen as a matrix [shape[0], numel / shape[0]].
  template <executor E, float_storage T>
  void dequantize_rows(const E& exec, std::int64_t first_row, tensor_view<T> out) const {
    const std::int64_t columns = shape_.rank > 0 && shape_[0] > 0 ? numel() / shape_[0] : numel();
    require(columns > 0 && out.size() % columns == 0,
            "quantized_tensor::dequantize_rows: `out` has " + std::to_string(out.size()) +
                " elements, not a whole number of rows of " + std::to_string(columns));
    const std::int64_t rows = numel() / columns;
    require(within_range(first_row, out.size() / columns, rows),
            "quantized_tensor::dequantize_rows: " + std::to_string(out.size() / columns) + " rows from row " +
                std::to_string(first_row) + " are outside the tensor's " + std::to_string(rows));
    dequantize_range(exec, first_row * columns, out);
  }

  // Host memory: throws if a block's scale is not finite, naming the tensor and the block. This is how
  // Inf/NaN input quantized on a device is reported (the device marks the block); synchronizes nothing
  // itself, so call it on host-accessible storage or copy the scales first (see require_finite below).
  void require_finite_scales(const char* name) const {
    require(codes_.where() != memory_kind::device,
            "quantized_tensor::require_finite_scales: the tensor is in device memory; use require_finite(exec, name)");
    std::int64_t bad = -1;
    if (options_.double_quant) {
      // The group absmax values and, last, the offset, which every block's scale adds.
      const std::int64_t groups = nested_group_count(blocks());
      const std::int64_t g = detail::first_nonfinite(nested_absmax_.data(), groups + 1);
      if (g >= 0) bad = g < groups ? g * nested_block_size : 0;
    } else {
      bad = detail::first_nonfinite(absmax_.data(), blocks());
    }
    require(bad < 0, "quantized_tensor: tensor '" + std::string(name) + "' has a non-finite value in block " +
                         std::to_string(bad) + " of " + std::to_string(blocks()) + " (block size " +
                         std::to_string(options_.block_size) + ")");
  }

#if MEMKIT_HAS_CUDA
  // Device tensors: synchronizes `exec`'s stream (the caller asked for a verdict), copies the scales and
  // throws like require_finite_scales. With double quantization a bad block poisons the offset, so the
  // error can only say that the tensor, not which block, held the value.
  void require_finite(const cuda_executor& exec, const char* name) const {
    exec.synchronize();
    const std::int64_t count = options_.double_quant ? nested_absmax_.size() : absmax_.size();
    const float* source = options_.double_quant ? nested_absmax_.data() : absmax_.data();
    std::vector<float> copy(static_cast<std::size_t>(count));
    if (count) MEMKIT_CUDA_CHECK(cudaMemcpy(copy.data(), source, copy.size() * sizeof(float), cudaMemcpyDefault));
    const std::int64_t bad = detail::first_nonfinite(copy.data(), count);
    require(bad < 0, "quantized_tensor: tensor '" + std::string(name) + "' has a non-finite value " +
                         (options_.double_quant ? std::string("(its double-quantized scales are all non-finite)")
                                                : "in block " + std::to_string(bad) + " of " + std::to_string(blocks())));
  }
#endif

 private:
  static quant_options checked(const quant_options& options, const char* operation) {
    require_block_size(options.block_size, operation);
    return options;
  }
  tensor_view<float> nested_part(std::int64_t begin, std::int64_t count) noexcept {
    if (!options_.double_quant) return {};
    return {nested_absmax_.data() + begin, shape{count}, nested_absmax_.where()};
  }

  shape shape_{};
  quant_options options_{};
  buffer<std::uint8_t> codes_;
  buffer<float> absmax_;
  buffer<std::uint8_t> nested_codes_;
  buffer<float> nested_absmax_;
  code_table<256> nested_map_ = signed_dynamic_table;
};

}  // namespace quant

MEMKIT_NAMESPACE_END
