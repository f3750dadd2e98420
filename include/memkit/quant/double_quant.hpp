// memkit/quant/double_quant.hpp — double quantization of block scales (QLoRA's "compress_statistics").
//
// The fp32 absmax of every block is itself quantized: offset = mean(absmax); the values absmax - offset
// are quantized blockwise with the signed dynamic 8-bit map in groups of 256 blocks, each group keeping
// one fp32 absmax. Decoding is map[code] * group_absmax + offset (block_scales in blockwise.hpp).
// At block 64 this costs 8/64 + 32/(64*256) bits per value instead of 32/64.
//
// The mean is summed in double in one fixed order (per group of 256 scales, then 256 interleaved partial
// sums, then those in order), on the host and on the device alike, so both get the same offset bit for bit.
// bitsandbytes takes torch's float32 mean, whose own summation order can differ from it in the last bit.
#pragma once

#include <cstdint>
#include <string>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/quant/blockwise.hpp"
#include "memkit/quant/codebooks.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace quant {

namespace detail {

inline constexpr int mean_lanes = 256;

// Sum of scales [group*256, min(blocks, group*256+256)) in order, in double.
MEMKIT_HOST_DEVICE inline double group_sum(const float* absmax, std::int64_t blocks, std::int64_t group) noexcept {
  const std::int64_t begin = group * nested_block_size;
  const std::int64_t end = begin + nested_block_size < blocks ? begin + nested_block_size : blocks;
  double sum = 0.0;
  for (std::int64_t b = begin; b < end; ++b) sum = dadd_rn(sum, static_cast<double>(absmax[b]));
  return sum;
}

// Where a lane's chain reads each group's sum: formed from the scales, or formed earlier (device).
struct group_sums_from_scales {
  const float* absmax;
  std::int64_t blocks;
  MEMKIT_HOST_DEVICE double operator()(std::int64_t group) const noexcept { return group_sum(absmax, blocks, group); }
};
struct group_sums_in_memory {
  const double* sums;
  MEMKIT_HOST_DEVICE double operator()(std::int64_t group) const noexcept { return sums[group]; }
};

// Partial sum of lane `lane`: its groups lane, lane + 256, ... in order.
template <class GroupSums>
MEMKIT_HOST_DEVICE inline double lane_sum(GroupSums group_sums, std::int64_t blocks, int lane) noexcept {
  double sum = 0.0;
  for (std::int64_t group = lane; group < nested_group_count(blocks); group += mean_lanes)
    sum = dadd_rn(sum, group_sums(group));
  return sum;
}

// Quantizes the scales of one group of 256 blocks, given the offset. Writes the group's codes and absmax.
MEMKIT_HOST_DEVICE inline float group_absmax(const float* absmax, std::int64_t begin, std::int64_t end,
                                             float offset) noexcept {
  float group_max = 0.0f;
  for (std::int64_t b = begin; b < end; ++b) {
    const float magnitude = abs_value(sub_rn(absmax[b], offset));
    group_max = magnitude > group_max ? magnitude : group_max;
  }
  return group_max;
}

MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE std::uint8_t nested_code(float scale, float offset, float group_reciprocal,
                                                              const float* map) noexcept {
  return encode<format::int8>(stored_product(sub_rn(scale, offset), group_reciprocal), map);
}

inline float host_mean_offset(const float* absmax, std::int64_t blocks) {
  double total = 0.0;
  for (int lane = 0; lane < mean_lanes; ++lane) total += lane_sum(group_sums_from_scales{absmax, blocks}, blocks, lane);
  return static_cast<float>(total / static_cast<double>(blocks));
}

#if MEMKIT_HAS_CUDA
// One CTA of 256 threads: thread t forms lane_sum(t); thread 0 adds the 256 partials in order. With the
// group sums formed beforehand (group_sums_kernel) each lane's chain is a few coalesced loads; from the scales
// it is 256 dependent loads per group, a single CTA walking every scale (725 us for the 1M scales of an
// 8192 x 8192 NF4 weight on an H200).
// Kernels in a header are templates so that every translation unit may instantiate them (ODR).
template <class GroupSums>
__global__ void mean_offset_kernel(GroupSums group_sums, std::int64_t blocks, float* offset) {
  __shared__ double partial[mean_lanes];
  partial[threadIdx.x] = lane_sum(group_sums, blocks, static_cast<int>(threadIdx.x));
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int lane = 0; lane < mean_lanes; ++lane) total = dadd_rn(total, partial[lane]);
    *offset = static_cast<float>(__ddiv_rn(total, static_cast<double>(blocks)));
  }
}

// Each group's sum (group_sum's serial order), one thread per group.
template <class Float>
__global__ void group_sums_kernel(const Float* __restrict__ absmax, std::int64_t blocks, double* __restrict__ sums) {
  const std::int64_t group = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (group < nested_group_count(blocks)) sums[group] = group_sum(absmax, blocks, group);
}

// One warp per group of 256 scales.
template <class Float>
__global__ void quantize_scales_kernel(const Float* __restrict__ absmax, std::int64_t blocks,
                                       const float* __restrict__ offset_pointer, std::uint8_t* __restrict__ codes,
                                       float* __restrict__ nested_absmax, code_table<256> map_table) {
  __shared__ float map[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) map[i] = map_table.value[i];
  __syncthreads();
  const float offset = *offset_pointer;
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = blockDim.x >> 5;
  for (std::int64_t group = blockIdx.x * warps + (threadIdx.x >> 5); group < nested_group_count(blocks);
       group += gridDim.x * warps) {
    const std::int64_t begin = group * nested_block_size;
    const std::int64_t end = begin + nested_block_size < blocks ? begin + nested_block_size : blocks;
    float group_max = 0.0f;
    for (std::int64_t b = begin + lane; b < end; b += 32) {
      const float magnitude = abs_value(sub_rn(absmax[b], offset));
      group_max = magnitude > group_max ? magnitude : group_max;
    }
    group_max = warp_max(group_max);
    if (lane == 0) nested_absmax[group] = group_max;
    const float reciprocal = block_reciprocal(group_max);
    for (std::int64_t b = begin + lane; b < end; b += 32) codes[b] = nested_code(absmax[b], offset, reciprocal, map);
  }
}

template <class Float>
__global__ void dequantize_scales_kernel(block_scales scales, std::int64_t blocks, Float* __restrict__ out,
                                         code_table<256> nested_table) {
  __shared__ float nested_map[256];
  stage_nested_map(scales, nested_map, nested_table);
  __syncthreads();
  for (std::int64_t b = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; b < blocks;
       b += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[b] = scales(b);
}
#endif

}  // namespace detail

// Double-quantizes `absmax` (first-level fp32 scales, all finite) into `nested_codes` (one byte per scale),
// `nested_absmax` (nested_group_count floats) and `offset` (one float).
template <executor E>
void quantize_scales(const E& exec, tensor_view<const float> absmax, tensor_view<std::uint8_t> nested_codes,
                     tensor_view<float> nested_absmax, tensor_view<float> offset,
                     const code_table<256>& map = signed_dynamic_table) {
  constexpr const char* operation = "quant::quantize_scales";
  const std::int64_t blocks = absmax.size();
  require(nested_codes.size() == blocks, std::string(operation) + ": `nested_codes` has " +
                                             std::to_string(nested_codes.size()) + " entries for " +
                                             std::to_string(blocks) + " scales");
  require(nested_absmax.size() == nested_group_count(blocks),
          std::string(operation) + ": `nested_absmax` has " + std::to_string(nested_absmax.size()) +
              " entries but " + std::to_string(blocks) + " scales need " + std::to_string(nested_group_count(blocks)));
  require(offset.size() == 1, std::string(operation) + ": `offset` must hold exactly one value");
  require_accessible(exec, absmax, operation, "absmax");
  require_accessible(exec, nested_codes, operation, "nested_codes");
  require_accessible(exec, nested_absmax, operation, "nested_absmax");
  require_accessible(exec, offset, operation, "offset");
  if (blocks == 0) {
    // No scales: the offset is 0 on both paths (a finiteness check reads it later, so it must be written).
    if constexpr (!E::on_device) {
      offset[0] = 0.0f;
    } else {
#if MEMKIT_HAS_CUDA
      ::memkit::detail::with_device(exec.device, [&] {
        MEMKIT_CUDA_CHECK(cudaMemsetAsync(offset.data(), 0, sizeof(float), exec.stream));
        return 0;
      });
#endif
    }
    return;
  }
  if constexpr (!E::on_device) {
    (void)exec;
    const std::int64_t bad = detail::first_nonfinite(absmax.data(), blocks);
    require(bad < 0, std::string(operation) + ": scale of block " + std::to_string(bad) + " is not finite");
    const float mean = detail::host_mean_offset(absmax.data(), blocks);
    for (std::int64_t group = 0; group < nested_group_count(blocks); ++group) {
      const std::int64_t begin = group * nested_block_size;
      const std::int64_t end = begin + nested_block_size < blocks ? begin + nested_block_size : blocks;
      const float group_max = detail::group_absmax(absmax.data(), begin, end, mean);
      nested_absmax[group] = group_max;
      const float reciprocal = block_reciprocal(group_max);
      for (std::int64_t b = begin; b < end; ++b)
        nested_codes[b] = detail::nested_code(absmax[b], mean, reciprocal, map.value);
    }
    offset[0] = mean;
  } else {
#if MEMKIT_HAS_CUDA
    constexpr int threads = 256;
    ::memkit::detail::with_device(exec.device, [&] {
      // The nested codes (one byte per scale) are written last: until then they hold the group sums (8 bytes
      // per 256 scales), when aligned for doubles.
      const std::int64_t groups = nested_group_count(blocks);
      auto* group_sums = reinterpret_cast<double*>(nested_codes.data());
      if (blocks >= 8 * groups && reinterpret_cast<std::uintptr_t>(group_sums) % alignof(double) == 0) {
        detail::group_sums_kernel<float><<<detail::grid_for(groups, threads), threads, 0, exec.stream>>>(
            absmax.data(), blocks, group_sums);
        detail::mean_offset_kernel<<<1, detail::mean_lanes, 0, exec.stream>>>(detail::group_sums_in_memory{group_sums},
                                                                              blocks, offset.data());
      } else {
        detail::mean_offset_kernel<<<1, detail::mean_lanes, 0, exec.stream>>>(
            detail::group_sums_from_scales{absmax.data(), blocks}, blocks, offset.data());
      }
      detail::quantize_scales_kernel<float><<<detail::grid_for(groups * 32, threads), threads, 0,
                                       exec.stream>>>(absmax.data(), blocks, offset.data(), nested_codes.data(),
                                                      nested_absmax.data(), map);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    });
#endif
  }
}

// Decodes double-quantized scales into fp32 (what bitsandbytes hands to its dequantize kernel).
template <executor E>
void dequantize_scales(const E& exec, tensor_view<const std::uint8_t> nested_codes,
                       tensor_view<const float> nested_absmax, tensor_view<const float> offset, tensor_view<float> out,
                       const code_table<256>& map = signed_dynamic_table) {
  constexpr const char* operation = "quant::dequantize_scales";
  const std::int64_t blocks = out.size();
  require(nested_codes.size() == blocks && nested_absmax.size() == nested_group_count(blocks) && offset.size() == 1,
          std::string(operation) + ": " + std::to_string(blocks) + " scales need " + std::to_string(blocks) +
              " nested codes, " + std::to_string(nested_group_count(blocks)) + " nested absmax and one offset; got " +
              std::to_string(nested_codes.size()) + ", " + std::to_string(nested_absmax.size()) + " and " +
              std::to_string(offset.size()));
  require_accessible(exec, nested_codes, operation, "nested_codes");
  require_accessible(exec, nested_absmax, operation, "nested_absmax");
  require_accessible(exec, offset, operation, "offset");
  require_accessible(exec, out, operation, "out");
  block_scales scales;
  scales.nested_codes = nested_codes.data();
  scales.nested_absmax = nested_absmax.data();
  scales.offset = offset.data();
  if (blocks == 0) return;
  if constexpr (!E::on_device) {
    (void)exec;
    scales.nested_map = map.value;
    for (std::int64_t b = 0; b < blocks; ++b) out[b] = scales(b);
  } else {
#if MEMKIT_HAS_CUDA
    constexpr int threads = 256;
    ::memkit::detail::with_device(exec.device, [&] {
      detail::dequantize_scales_kernel<float><<<detail::grid_for(blocks, threads), threads, 0, exec.stream>>>(
          scales, blocks, out.data(), map);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    });
#endif
  }
}

}  // namespace quant

MEMKIT_NAMESPACE_END
