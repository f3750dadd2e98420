// memkit/quant/detail/blockwise_kernels.hpp — the host loop and the CUDA kernel of each blockwise operation,
// side by side: quantize, then dequantize, each ending in the function that picks the path for an executor.
// Both paths call the per-element math of quant/formats.hpp, so they write identical bytes; the host loops
// take the x86 vector kernels of quant/detail/blockwise_x86.hpp where the CPU has them.
// Callers have checked the arguments (quant/blockwise.hpp does). Not a public header: include
// memkit/quant/blockwise.hpp.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/device_vector.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/rounded_math.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/core/units.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/detail/blockwise_x86.hpp"
#include "memkit/quant/dynamic_index.hpp"
#include "memkit/quant/formats.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace quant::detail {

// --- shared by the operations ---


inline constexpr std::uint32_t infinity_bits = 0x7f800000u;

// Whether `map` is the signed dynamic map, whose codes the indexed encoder (quant/dynamic_index.hpp) finds.
inline bool is_signed_dynamic_map(const float* map) noexcept {
  for (int i = 0; i < 256; ++i)
    if (::memkit::detail::bit_cast<std::uint32_t>(map[i]) != ::memkit::detail::bit_cast<std::uint32_t>(dynamic_map_signed[static_cast<std::size_t>(i)]))
      return false;
  return true;
}

// Index of the first block whose absmax is not finite, or -1.
inline std::int64_t first_nonfinite(const float* absmax, std::int64_t blocks) {
  for (std::int64_t b = 0; b < blocks; ++b)
    if (!is_finite(absmax[b])) return b;
  return -1;
}

#if MEMKIT_HAS_CUDA
using memkit::detail::grid_for;  // the launch geometry every grid-stride kernel shares (core/execution.hpp)

MEMKIT_DEVICE MEMKIT_FORCEINLINE float warp_max(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// Generic dequantization of elements [first, first + count): one element per thread.
// Copies the nested map into shared memory when the scales are double-quantized.
MEMKIT_DEVICE MEMKIT_FORCEINLINE void stage_nested_map(block_scales& scales, float* shared_map,
                                                        const code_table<256>& nested_map) {
  if (scales.nested())
    for (int i = threadIdx.x; i < 256; i += blockDim.x) shared_map[i] = nested_map.value[i];
  scales.nested_map = shared_map;
}

// The code values of format F in shared memory: the 16 of a 4-bit format (code_value, unscaled) or the 256
// of the int8 map. Thread 0 writes the 16 with constant indices (no local copy of the codebook).
template <format F>
MEMKIT_DEVICE MEMKIT_FORCEINLINE void stage_code_values(float* table, const code_table<256>& map_table) {
  if constexpr (F == format::int8) {
    for (int i = static_cast<int>(threadIdx.x); i < 256; i += static_cast<int>(blockDim.x)) table[i] = map_table.value[i];
  } else if (threadIdx.x == 0) {
#pragma unroll
    for (int c = 0; c < 16; ++c) table[c] = code_value<F>(static_cast<std::uint8_t>(c), nullptr);
  }
}

// log2 of a block size (a power of two: require_block_size), so a block index is a shift, not a division.
MEMKIT_DEVICE MEMKIT_FORCEINLINE int block_shift(std::int64_t block_size) { return __ffsll(block_size) - 1; }

// The prologue of every kernel that decodes codes (dequantize and the fused matmul kernels): F's code values
// and, for double-quantized scales, the nested map staged in the kernel's shared arrays, the thread block
// waited for; returns log2 of the block size.
template <format F>
MEMKIT_DEVICE MEMKIT_FORCEINLINE int stage_decoding(float* table, float* nested_map, block_scales& scales,
                                                    const code_table<256>& map_table,
                                                    const code_table<256>& nested_table, std::int64_t block_size) {
  stage_code_values<F>(table, map_table);
  stage_nested_map(scales, nested_map, nested_table);
  __syncthreads();
  return block_shift(block_size);
}

// The code of weight j (0..7) of a group of 8 stored in words[0] (4-bit) or words[0..1] (int8); 4-bit
// codes keep the even element in the high nibble.
template <format F>
MEMKIT_DEVICE MEMKIT_FORCEINLINE unsigned code_in_words(const std::uint32_t* words, int j) {
  if constexpr (F == format::int8) return (words[j >> 2] >> (8 * (j & 3))) & 0xffu;
  else return (words[0] >> (8 * (j >> 1) + ((j & 1) ? 0 : 4))) & 0x0fu;
}
#endif

// --- quantize: host loop, CUDA kernel, launcher ---

// Throws, naming the tensor, element and block, if any value is not finite. Reads only.
template <float_storage T>
void require_finite_host(const T* input, std::int64_t numel, std::int64_t block_size, const char* operation,
                         const char* tensor_name) {
  for (std::int64_t begin = 0; begin < numel; begin += block_size) {
    const std::int64_t end = begin + block_size < numel ? begin + block_size : numel;
    if (max_magnitude_bits(input + begin, end - begin) < infinity_bits) continue;
    for (std::int64_t i = begin; i < end; ++i) {
      const float value = to_float(input[i]);
      if (is_finite(value)) continue;
      throw error(std::string(operation) + ": tensor '" + tensor_name + "' has a non-finite value (" +
                  format_float(value) + ") at flat element " + std::to_string(i) + ", in block " +
                  std::to_string(begin / block_size) + " of " + std::to_string(block_count(numel, block_size)) +
                  " (block size " + std::to_string(block_size) + ")");
    }
  }
}

// Quantizes blocks [first_block, last_block) in one pass over the input, in groups of up to max_block_size
// values: per group, every block's largest magnitude (max_magnitude_bits, vectorized), which also tells whether
// the group holds an Inf or NaN; then the blocks' absmax, reciprocals and codes while the group is in L1/L2.
// Returns false at the first group holding a non-finite value, having written nothing of that group (earlier
// groups are written). The vector kernels are chosen at run time (core/host_simd.hpp); int8 with the signed
// dynamic map takes the indexed encoder. Every path gives the codes of encode<F>
// (tests/host/quant_blockwise_test.cpp compares them on each instruction set).
template <format F, float_storage T>
bool quantize_host(const T* input, std::int64_t numel, std::int64_t block_size, std::int64_t first_block,
                   std::int64_t last_block, std::uint8_t* codes, float* absmax, const float* map) {
#if MEMKIT_QUANT_X86_SIMD
  const host_isa isa = host_isa_in_use();
#endif
  const ::memkit::detail::dynamic_code_index* index = nullptr;
  if constexpr (F == format::int8)
    if (is_signed_dynamic_map(map)) index = &::memkit::detail::dynamic_code_index_for<true>();
  constexpr std::int64_t group_values = max_block_size;
  const std::int64_t group_blocks = block_size < group_values ? group_values / block_size : 1;
  std::uint32_t bits[group_values / min_block_size];
  float reciprocals[group_values / min_block_size];
  for (std::int64_t first = first_block; first < last_block; first += group_blocks) {
    const std::int64_t blocks = std::min(group_blocks, last_block - first);
    const std::int64_t group_begin = first * block_size;
    const T* group = input + group_begin;
    const std::int64_t whole = std::min(blocks, (numel - group_begin) / block_size);  // full-size blocks
    std::int64_t g = 0;
#if MEMKIT_QUANT_X86_SIMD
    if (isa == host_isa::avx512) block_max_bits_avx512(group, g = whole, block_size, bits);
    else if (isa == host_isa::avx2) block_max_bits_avx2(group, g = whole, block_size, bits);
#endif
    for (; g < blocks; ++g) {
      const std::int64_t begin = group_begin + g * block_size;
      bits[g] = max_magnitude_bits(input + begin, std::min(block_size, numel - begin));
    }
    std::uint32_t largest = 0;
    for (g = 0; g < blocks; ++g) largest = bits[g] > largest ? bits[g] : largest;
    if (largest >= infinity_bits) return false;
    for (g = 0; g < blocks; ++g) {
      const float block_max = ::memkit::detail::bit_cast<float>(bits[g]);
      absmax[first + g] = block_max;
      reciprocals[g] = block_reciprocal(block_max);
    }
    g = 0;
    // The next group of this range, read into the cache while this one is encoded (itself for the last one).
    const T* ahead = first + group_blocks < last_block ? group + group_blocks * block_size : group;
    (void)ahead;
    if constexpr (F != format::int8) {
#if MEMKIT_QUANT_X86_SIMD
      if (isa == host_isa::avx512) encode4_blocks_avx512<F>(group, g = whole, block_size, reciprocals, codes + group_begin / 2, ahead);
      else if (isa == host_isa::avx2) encode4_blocks_avx2<F>(group, g = whole, block_size, reciprocals, codes + group_begin / 2, ahead);
#endif
    }
    for (; g < blocks; ++g) {
      const std::int64_t begin = group_begin + g * block_size;
      const std::int64_t count = std::min(block_size, numel - begin);
      const T* values = input + begin;
      const float reciprocal = reciprocals[g];
      if constexpr (F == format::int8) {
        for (std::int64_t line = 0; line < count * static_cast<std::int64_t>(sizeof(T)); line += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(ahead + g * block_size) + line);
        if (index != nullptr) {
          if constexpr (std::is_same_v<T, float>) {
            ::memkit::detail::dynamic_codes_indexed(*index, values, reciprocal, count, codes + begin);
          } else {
            float widened[max_block_size];
            for (std::int64_t i = 0; i < count; ++i) widened[i] = to_float(values[i]);
            ::memkit::detail::dynamic_codes_indexed(*index, widened, reciprocal, count, codes + begin);
          }
        } else {
          for (std::int64_t i = 0; i < count; ++i) codes[begin + i] = encode<F>(stored_product(to_float(values[i]), reciprocal), map);
        }
      } else {
        std::uint8_t* out = codes + begin / 2;
        const std::int64_t pairs = count / 2;
        for (std::int64_t p = 0; p < pairs; ++p) {
          const std::uint8_t high = encode<F>(stored_product(to_float(values[2 * p]), reciprocal), map);
          const std::uint8_t low = encode<F>(stored_product(to_float(values[2 * p + 1]), reciprocal), map);
          out[p] = static_cast<std::uint8_t>((high << 4) | low);
        }
        if (count & 1) {  // odd tail of the tensor: pad with 0.0, which is scaled like any other value
          const std::uint8_t high = encode<F>(stored_product(to_float(values[count - 1]), reciprocal), map);
          const std::uint8_t low = encode<F>(stored_product(0.0f, reciprocal), map);
          out[pairs] = static_cast<std::uint8_t>((high << 4) | low);
        }
      }
    }
  }
  return true;
}

#if MEMKIT_HAS_CUDA
// One warp per block; lanes stride over the block's values.
// Lanes of a warp that quantize one block: each takes quantize_lane_values consecutive values per step
// (one or two 16-byte loads), so blocks of up to 256 values take one step and are read once, kept in
// registers between the absmax and the encoding; a warp takes 32 / lanes blocks at a time.
inline constexpr int quantize_lane_values = 8;
MEMKIT_HOST_DEVICE constexpr int quantize_lanes(std::int64_t block_size) noexcept {
  return block_size / quantize_lane_values < 32 ? static_cast<int>(block_size / quantize_lane_values) : 32;
}

template <format F, class T>
__global__ void quantize_kernel(const T* __restrict__ input, std::int64_t numel,
                                std::int64_t block_size, std::uint8_t* __restrict__ codes,
                                float* __restrict__ absmax, code_table<256> map_table) {
  constexpr int E = quantize_lane_values;
  __shared__ float map[256];
  if constexpr (F == format::int8)
    for (int i = threadIdx.x; i < 256; i += blockDim.x) map[i] = map_table.value[i];
  __syncthreads();
  const int lanes = quantize_lanes(block_size);  // a power of two, 4..32
  const int lane = static_cast<int>(threadIdx.x) & 31, sub = lane & (lanes - 1);
  const int per_warp = 32 / lanes;
  const std::int64_t steps = block_size / (static_cast<std::int64_t>(lanes) * E);
  const std::int64_t blocks = block_count(numel, block_size);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x >> 5);
  const bool vector_input = ::memkit::detail::vector_aligned(input);
  const bool vector_codes = (reinterpret_cast<std::uintptr_t>(codes) & (F == format::int8 ? 7u : 3u)) == 0;
  // Values e0 .. e0 + 8 of the block at `begin` (zeros past its end, which change neither the absmax nor
  // the finiteness; a 4-bit pair past the end is padded with 0.0 as on the host).
  auto load = [&](std::int64_t begin, std::int64_t count, std::int64_t e0, float* v) {
    if (vector_input && e0 + E <= count) {
      ::memkit::detail::load_floats<T, E, true>(input + begin + e0, v);
    } else {
#pragma unroll
      for (int j = 0; j < E; ++j) v[j] = e0 + j < count ? to_float(input[begin + e0 + j]) : 0.0f;
    }
  };
  // Warp-uniform loop: the shuffles below need every lane.
  for (std::int64_t first = (blockIdx.x * static_cast<std::int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5)) * per_warp;
       first < blocks; first += warps * per_warp) {
    const std::int64_t block = first + lane / lanes;
    const bool active = block < blocks;
    const std::int64_t begin = block * block_size;
    const std::int64_t count = !active ? 0 : numel - begin < block_size ? numel - begin : block_size;
    float cached[E];
    float block_max = 0.0f;
    int finite = 1;
    for (std::int64_t s = 0; s < steps; ++s) {
      float v[E];
      load(begin, count, (s * lanes + sub) * E, v);
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const float magnitude = abs_value(v[j]);
        finite &= is_finite(magnitude) ? 1 : 0;
        block_max = magnitude > block_max ? magnitude : block_max;
        if (s == 0) cached[j] = v[j];
      }
    }
    // The block's lanes: max is exact, so the order of reduction cannot change it.
    for (int offset = lanes / 2; offset > 0; offset >>= 1) {
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, offset));
      finite &= __shfl_xor_sync(0xffffffffu, finite, offset);
    }
    if (!active) continue;
    if (sub == 0) absmax[block] = finite ? block_max : __int_as_float(0x7fffffff);
    const float reciprocal = block_reciprocal(block_max);
    for (std::int64_t s = 0; s < steps; ++s) {
      const std::int64_t e0 = (s * lanes + sub) * E;
      if (e0 >= count) break;
      float v[E];
      if (s == 0) {
#pragma unroll
        for (int j = 0; j < E; ++j) v[j] = cached[j];
      } else {
        load(begin, count, e0, v);
      }
      unsigned c[E];
#pragma unroll
      for (int j = 0; j < E; ++j) c[j] = encode<F>(stored_product(v[j], reciprocal), map);
      if constexpr (F == format::int8) {
        if (vector_codes && e0 + E <= count) {
          *reinterpret_cast<uint2*>(codes + begin + e0) =
              make_uint2(c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24, c[4] | c[5] << 8 | c[6] << 16 | c[7] << 24);
        } else {
#pragma unroll
          for (int j = 0; j < E; ++j)
            if (e0 + j < count) codes[begin + e0 + j] = static_cast<std::uint8_t>(c[j]);
        }
      } else {
        std::uint8_t* out = codes + (begin + e0) / 2;
        if (vector_codes && e0 + E <= count) {
          *reinterpret_cast<std::uint32_t*>(out) = (c[0] << 4 | c[1]) | (c[2] << 4 | c[3]) << 8 | (c[4] << 4 | c[5]) << 16 |
                                                   (c[6] << 4 | c[7]) << 24;
        } else {
#pragma unroll
          for (int p = 0; p < E / 2; ++p)
            if (e0 + 2 * p < count) out[p] = static_cast<std::uint8_t>(c[2 * p] << 4 | c[2 * p + 1]);
        }
      }
    }
  }
}
#endif

// Tensors smaller than this per thread are quantized on fewer threads (a thread start costs ~10-50 us).
inline constexpr std::int64_t quantize_values_per_thread = std::int64_t{1} << 18;

// quantize_blockwise; `operation` names the caller in error messages.
template <executor E, class Input>
void quantize_blockwise_checked(const E& exec, format fmt, tensor_view<Input> input_view, std::int64_t block_size,
                                tensor_view<std::uint8_t> codes, tensor_view<float> absmax, const char* tensor_name,
                                const code_table<256>& map, const char* operation, int host_threads) {
  const tensor_view<const std::remove_const_t<Input>> input = input_view;
  require_block_size(block_size, operation);
  const std::int64_t numel = input.size();
  require(codes.size() == code_bytes(fmt, numel),
          std::string(operation) + ": `codes` has " + std::to_string(codes.size()) + " bytes but " +
              std::to_string(numel) + " " + to_string(fmt) + " values need " + std::to_string(code_bytes(fmt, numel)));
  require(absmax.size() == block_count(numel, block_size),
          std::string(operation) + ": `absmax` has " + std::to_string(absmax.size()) + " entries but " +
              std::to_string(numel) + " values in blocks of " + std::to_string(block_size) + " need " +
              std::to_string(block_count(numel, block_size)));
  require_accessible(exec, input, operation, "input");
  require_accessible(exec, codes, operation, "codes");
  require_accessible(exec, absmax, operation, "absmax");
  if (numel == 0) return;
  if constexpr (!E::on_device) {
    // One pass: the finiteness check rides on the absmax pass. Threads take contiguous ranges of blocks, so the
    // codes do not depend on their number. A part that meets a non-finite value stops; the error then names
    // the first such element of the tensor, whichever thread met one.
    const std::int64_t blocks = block_count(numel, block_size);
    const int parts = static_cast<int>(std::max<std::int64_t>(
        1, std::min<std::int64_t>(resolve_host_threads(host_threads), numel / quantize_values_per_thread)));
    std::atomic<bool> nonfinite{false};
    dispatch_format(fmt, [&]<format F>() {
      ::memkit::detail::run_in_parts(parts, blocks, [&](std::int64_t first, std::int64_t last) {
        if (!quantize_host<F>(input.data(), numel, block_size, first, last, codes.data(), absmax.data(), map.value))
          nonfinite.store(true, std::memory_order_relaxed);
      });
    });
    if (nonfinite.load()) {
      require_finite_host(input.data(), numel, block_size, operation, tensor_name);
      throw error(std::string(operation) + ": internal error: a non-finite block was not found again");
    }
  } else {
#if MEMKIT_HAS_CUDA
    (void)tensor_name, (void)operation, (void)host_threads;
    constexpr int threads = 256;
    const std::int64_t warps = (block_count(numel, block_size) + 32 / detail::quantize_lanes(block_size) - 1) /
                               (32 / detail::quantize_lanes(block_size));
    const int grid = detail::grid_for(warps * 32, threads);
    ::memkit::detail::with_device(exec.device, [&] {
      detail::dispatch_format(fmt, [&]<format F>() {
        detail::quantize_kernel<F><<<grid, threads, 0, exec.stream>>>(input.data(), numel, block_size, codes.data(),
                                                                       absmax.data(), map);
      });
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    });
#endif
  }
}

// --- dequantize: host loops, CUDA kernels, launcher ---

// Elements [first, first + count) one at a time (4-bit: one block's 16-entry table at a time, already in the
// output type): the portable path, and the head and tail of the vector one.
template <format F, float_storage T>
void dequantize_host_scalar(const std::uint8_t* codes, const block_scales& scales, std::int64_t block_size,
                            std::int64_t first, std::int64_t count, T* output, const float* map) {
  std::int64_t i = 0;
  while (i < count) {
    const std::int64_t element = first + i;
    const std::int64_t block = element / block_size;
    const std::int64_t block_end = (block + 1) * block_size;
    const std::int64_t run = (block_end - element) < (count - i) ? (block_end - element) : (count - i);
    const float scale = scales(block);
    if constexpr (F == format::int8) {
      for (std::int64_t k = 0; k < run; ++k) output[i + k] = from_float<T>(decode<F>(codes[element + k], scale, map));
    } else {
      // A 16-entry table of the block's decoded values, already in the output type: the same products
      // decode() forms and the same conversion, done 16 times per block instead of once per value.
      float decoded[16];  // decode() of each code: the same single products
      for (int c = 0; c < 16; ++c) decoded[c] = stored_product(four_bit_values<F>[static_cast<std::size_t>(c)], scale);
      T scaled[16];
#if MEMKIT_QUANT_X86_SIMD
      if constexpr (std::is_same_v<T, bf16>) bf16_bits_x16(decoded, reinterpret_cast<std::uint16_t*>(scaled));
      else
#endif
        for (int c = 0; c < 16; ++c) scaled[c] = from_float<T>(decoded[c]);
      std::int64_t k = 0;
      if (element & 1) {
        output[i] = scaled[codes[element >> 1] & 0x0f];
        k = 1;
      }
      const std::uint8_t* bytes = codes + ((element + k) >> 1);
      const std::int64_t pairs = (run - k) / 2;
      T* out = output + i + k;
      std::int64_t p = 0;
#if MEMKIT_QUANT_X86_SIMD
      if (pairs >= 16 && cpu_has_ssse3()) p = expand_nibbles_ssse3<static_cast<int>(sizeof(T))>(bytes, pairs, scaled, out);
#endif
      for (; p < pairs; ++p) {
        const std::uint8_t byte = bytes[p];
        out[2 * p] = scaled[byte >> 4];
        out[2 * p + 1] = scaled[byte & 0x0f];
      }
      if ((run - k) & 1) output[i + run - 1] = scaled[bytes[pairs] >> 4];
    }
    i += run;
  }
}

// Dequantizes elements [first, first + count) of codes into output[0, count): from_float<T>(decode<F>(...)) of
// each. fp32 and bf16 outputs take the vector chunks of the instruction set in use (core/host_simd.hpp) after
// a scalar head that aligns the output to 64 bytes where it can (4-bit: at an even element); fp16 outputs and
// the portable path take the scalar loop.
// Every path gives the same bits (tests/host/quant_blockwise_test.cpp compares them on each instruction set).
template <format F, float_storage T>
void dequantize_host(const std::uint8_t* codes, const block_scales& scales, std::int64_t block_size,
                     std::int64_t first, std::int64_t count, T* output, const float* map) {
#if MEMKIT_QUANT_X86_SIMD
  if constexpr (!std::is_same_v<T, fp16>) {
    const host_isa isa = host_isa_in_use();
    if (isa != host_isa::portable && count >= 64) {
      const auto misalignment = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(output) & 63);
      std::int64_t head = misalignment % static_cast<std::int64_t>(sizeof(T)) == 0
                              ? ((64 - misalignment) & 63) / static_cast<std::int64_t>(sizeof(T))
                              : -1;
      if (head < 0 || (is_four_bit(F) && ((first + head) & 1)))
        head = is_four_bit(F) ? (first & 1) : 0;  // unaligned stores from the first even element
      const int shift = __builtin_ctzll(static_cast<unsigned long long>(block_size));  // a power of two
      dequantize_host_scalar<F>(codes, scales, block_size, first, head, output, map);
      std::int64_t done = head;
      if constexpr (is_four_bit(F)) {
        if (isa == host_isa::avx512) done += dequantize4_avx512<F>(codes, scales, shift, first + head, count - head, output + head);
        else done += dequantize4_avx2<F>(codes, scales, shift, first + head, count - head, output + head);
      } else {
        if (isa == host_isa::avx512) done += dequantize8_avx512(codes, scales, shift, first + head, count - head, output + head, map);
        else done += dequantize8_avx2(codes, scales, shift, first + head, count - head, output + head, map);
      }
      dequantize_host_scalar<F>(codes, scales, block_size, first + done, count - done, output + done, map);
      return;
    }
  }
#endif
  dequantize_host_scalar<F>(codes, scales, block_size, first, count, output, map);
}

#if MEMKIT_HAS_CUDA
template <format F, class T>
__global__ void __launch_bounds__(256) dequantize_kernel(const std::uint8_t* __restrict__ codes, block_scales scales,
                                                         std::int64_t block_size, std::int64_t first, std::int64_t count,
                                                         T* __restrict__ output, code_table<256> map_table,
                                                         code_table<256> nested_table) {
  constexpr int entries = F == format::int8 ? 256 : 16;
  __shared__ float table[entries];
  __shared__ float nested_map[256];
  const int shift = stage_decoding<F>(table, nested_map, scales, map_table, nested_table, block_size);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t element = first + i;
    output[i] = from_float<T>(stored_product(table[code_at<F>(codes, element)], scales(element >> shift)));
  }
}

// The vector path. Each lane turns the codes of one 16-byte output store (8 bf16/fp16 or 4 fp32 values, from
// 4 or 2 bytes of 4-bit codes, 8 or 4 bytes of int8 codes) into that store, and a warp's lanes take
// consecutive stores: every load and store instruction of a warp covers one contiguous span (an earlier
// version gave each lane 16 bytes of codes and so 32-64 bytes of output, which left each of its stores
// spread over 1-2 KiB in half-sectors: 0.40 of the copy roofline for NF4 -> bf16 on an H200). A store never
// straddles a quantization block (blocks are powers of two >= 32 values). Each lane keeps Unroll stores'
// codes and scales in flight before it computes. Needs `first` a multiple of the store's values, the codes
// of element `first` aligned to their load and `output` 16-byte aligned; the launcher sends the rest
// through dequantize_kernel.
template <format F, class T>
struct dequantize_store {
  static constexpr int values = 16 / static_cast<int>(sizeof(T));
  static constexpr int code_bytes = F == format::int8 ? values : values / 2;  // 2, 4 or 8
  using word = std::conditional_t<code_bytes == 2, std::uint16_t,
                                  std::conditional_t<code_bytes == 4, std::uint32_t, unsigned long long>>;
  // The code of value k of the store (4-bit: the even element in a byte's high nibble).
  static MEMKIT_DEVICE MEMKIT_FORCEINLINE unsigned code(word codes, int k) {
    if constexpr (F == format::int8) return static_cast<unsigned>(codes >> (8 * k)) & 0xffu;
    else return static_cast<unsigned>(codes >> (8 * (k >> 1) + ((k & 1) ? 0 : 4))) & 0x0fu;
  }
};
// Stores in flight per lane, chosen on an H200 (NF4 / int8 -> bf16, 2^28 values, block 64, fraction of the
// copy roofline): plain scales 0.92 / 0.93 at 4 against 0.89 / 0.89 at 8; double-quantized scales, whose
// decoding adds two dependent loads per store, 0.90 at 8 against 0.87 at 4.
inline constexpr int dequantize_unroll_plain = 4, dequantize_unroll_nested = 8;

template <format F, class T, int Unroll>
__global__ void __launch_bounds__(256) dequantize_vector_kernel(const std::uint8_t* __restrict__ codes, block_scales scales,
                                                                std::int64_t block_size, std::int64_t first,
                                                                std::int64_t stores, T* __restrict__ output,
                                                                code_table<256> map_table, code_table<256> nested_table) {
  using store = dequantize_store<F, T>;
  constexpr int entries = F == format::int8 ? 256 : 16;
  __shared__ float table[entries];
  __shared__ float nested_map[256];
  const int shift = stage_decoding<F>(table, nested_map, scales, map_table, nested_table, block_size);
  const auto* packed = reinterpret_cast<const typename store::word*>(codes + (F == format::int8 ? first : first / 2));
  const bool nested = scales.nested();
  const float offset = nested ? *scales.offset : 0.0f;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t warp = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const std::int64_t warps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (std::int64_t base = warp * 32 * Unroll + lane; base < stores; base += warps * 32 * Unroll) {
    typename store::word words[Unroll];
    float scale[Unroll];
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      const std::int64_t s = base + 32 * u;
      words[u] = s < stores ? __ldg(packed + s) : 0;
      const std::int64_t block = (first + store::values * s) >> shift;
      scale[u] = s >= stores ? 0.0f : nested ? scales.nested_scale(block, offset) : scales.absmax[block];
    }
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      const std::int64_t s = base + 32 * u;
      if (s < stores) {
        float values[store::values];
#pragma unroll
        for (int k = 0; k < store::values; ++k) values[k] = stored_product(table[store::code(words[u], k)], scale[u]);
        ::memkit::detail::store_floats<T, store::values>(output + store::values * s, values);
      }
    }
  }
}
#endif

// Dequantization with either kind of scales; callers have checked the arguments.
template <executor E, float_storage T>
void dequantize_with_scales(const E& exec, format fmt, const std::uint8_t* codes, const block_scales& scales,
                            std::int64_t block_size, std::int64_t first_element, tensor_view<T> output,
                            const code_table<256>& map, const code_table<256>& nested_map) {
  const std::int64_t count = output.size();
  if (count == 0) return;
  if constexpr (!E::on_device) {
    (void)exec;
    block_scales host_scales = scales;
    if (host_scales.nested()) host_scales.nested_map = nested_map.value;
    dispatch_format(fmt, [&]<format F>() {
      dequantize_host<F>(codes, host_scales, block_size, first_element, count, output.data(), map.value);
    });
  } else {
#if MEMKIT_HAS_CUDA
    constexpr int threads = 256;
    ::memkit::detail::with_device(exec.device, [&] {
      dispatch_format(fmt, [&]<format F>() {
        // A scalar head up to the first element that starts a 16-byte output store, the vector body, a scalar tail.
        using store = dequantize_store<F, T>;
        constexpr std::int64_t per_store = store::values;
        const std::int64_t head = (per_store - first_element % per_store) % per_store;
        // After the head, the codes start at a multiple of store::code_bytes from `codes`.
        const bool vector = head < count && reinterpret_cast<std::uintptr_t>(codes) % store::code_bytes == 0 &&
                            ::memkit::detail::vector_aligned(output.data() + head);
        const std::int64_t stores = vector ? (count - head) / per_store : 0;
        const std::int64_t body_begin = vector ? head : 0, body_end = body_begin + stores * per_store;
        if (body_begin > 0)
          dequantize_kernel<F><<<grid_for(body_begin, threads), threads, 0, exec.stream>>>(
              codes, scales, block_size, first_element, body_begin, output.data(), map, nested_map);
        auto vector_body = [&]<int Unroll>() {
          dequantize_vector_kernel<F, T, Unroll><<<grid_for((stores + Unroll - 1) / Unroll, threads), threads, 0, exec.stream>>>(
              codes, scales, block_size, first_element + body_begin, stores, output.data() + body_begin, map, nested_map);
        };
        if (stores > 0 && scales.nested()) vector_body.template operator()<dequantize_unroll_nested>();
        else if (stores > 0) vector_body.template operator()<dequantize_unroll_plain>();
        if (body_end < count)
          dequantize_kernel<F><<<grid_for(count - body_end, threads), threads, 0, exec.stream>>>(
              codes, scales, block_size, first_element + body_end, count - body_end, output.data() + body_end, map,
              nested_map);
      });
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    });
#endif
  }
}

}  // namespace quant::detail

MEMKIT_NAMESPACE_END
