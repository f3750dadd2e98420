// memkit/quant/detail/matmul_kernels.hpp — the CUDA kernels of quant::matmul for small batches, which decode
// W on the fly (one warp per output column for y; tiles of W's codes per block of input columns for dx), and
// their geometry (also used by the host to size the workspace). Larger batches dequantize tiles and call
// cuBLAS (quant/matmul.hpp). Not a public header: include memkit/quant/matmul.hpp.
#pragma once

#include <cstdint>

#include "memkit/config.hpp"
#include "memkit/core/device_vector.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/quant/blockwise.hpp"
#include "memkit/quant/bytes.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace quant::detail {

// The kernels' geometry (device_fused_rows, gemv_t_columns, gemv_t_tile_bytes, gemv_t_vector, gemv_t_splits) is
// in quant/bytes.hpp, beside the workspace_bytes that depends on it.

#if MEMKIT_HAS_CUDA
MEMKIT_DEVICE MEMKIT_FORCEINLINE float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// y[m, n] for m < M <= MaxRows: one warp per row n of W; lanes take 16 bytes of codes at a time (32 4-bit
// or 16 int8 weights, all in one quantization block since blocks are powers of two >= 32) with the
// matching 16-byte loads of x, decode each weight once for all rows (code value from shared memory times
// the block's scale, the rounding of decode()), and the warp adds its lanes' sums. Rows whose length or
// alignment does not allow 16-byte loads take one weight per lane at a time.
template <format F, class T, int MaxRows>
__global__ void fused_gemv_kernel(const T* __restrict__ x, const std::uint8_t* __restrict__ codes,
                                  block_scales scales, std::int64_t block_size, std::int64_t M,
                                  std::int64_t N, std::int64_t K, T* __restrict__ y,
                                  code_table<256> map_table, code_table<256> nested_table) {
  constexpr int entries = F == format::int8 ? 256 : 16;
  constexpr int per_load = codes_per_16_bytes<F>;
  constexpr int words_per_8 = F == format::int8 ? 2 : 1;  // 32-bit words of codes per 8 weights
  __shared__ float table[entries];
  __shared__ float nested_map[256];
  const int shift = stage_decoding<F>(table, nested_map, scales, map_table, nested_table, block_size);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t warps = blockDim.x >> 5;
  const bool vector = K % per_load == 0 && ::memkit::detail::vector_aligned(codes, x);
  for (std::int64_t n = blockIdx.x * warps + (threadIdx.x >> 5); n < N; n += gridDim.x * warps) {
    float acc[MaxRows] = {};
    const std::int64_t row = n * K;
    if (vector) {
      const uint4* row_codes = reinterpret_cast<const uint4*>(codes + (F == format::int8 ? row : row / 2));
      for (std::int64_t chunk = lane; chunk < K / per_load; chunk += 32) {
        const uint4 packed = __ldg(row_codes + chunk);
        const std::uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
        const std::int64_t k0 = chunk * per_load;
        const float scale = scales((row + k0) >> shift);
#pragma unroll
        for (int part = 0; part < per_load / 8; ++part) {
          float w[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) w[j] = stored_product(table[code_in_words<F>(words + part * words_per_8, j)], scale);
#pragma unroll
          for (int m = 0; m < MaxRows; ++m) {
            if (m >= M) break;
            float xv[8];
            ::memkit::detail::load_floats<T, 8, true>(x + m * K + k0 + 8 * part, xv);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[m] += xv[j] * w[j];
          }
        }
      }
    } else {
      for (std::int64_t k = lane; k < K; k += 32) {
        const std::int64_t element = row + k;
        const float w = stored_product(table[code_at<F>(codes, element)], scales(element >> shift));
#pragma unroll
        for (int m = 0; m < MaxRows; ++m)
          if (m < M) acc[m] += to_float(x[m * K + k]) * w;
      }
    }
#pragma unroll
    for (int m = 0; m < MaxRows; ++m) {
      if (m >= M) break;
      const float total = warp_sum(acc[m]);
      if (lane == 0) y[m * N + n] = from_float<T>(total);
    }
  }
}

// The same product for the 4-bit formats with the codebook in registers: lane l holds code value l % 16, and a
// weight's value is a warp shuffle from the lane its code names (shfl.idx reads only the low 5 bits of the
// lane operand, and lanes l and l + 16 hold the same value, so the shifted word needs no mask). The previous
// kernel read table[code] from shared memory for every weight (an LDS plus its address arithmetic in the
// inner loop). Each lane also issues the 16-byte code loads and the scales of gemv_chunks chunks before
// decoding any: one load in flight per lane left the M = 1 product at 0.21 of its bandwidth bound on an H200
// (docs/cuda.md). Every lane still adds its chunks in increasing order with the same expressions, and the warp
// adds its lanes as before: the bits of fused_gemv_kernel. Loops are uniform across the warp (the shuffles
// need every lane); lanes past the row's end decode code 0 and add nothing.
inline constexpr int gemv_chunks = 4;
template <format F, class T, int MaxRows>
__global__ void __launch_bounds__(256) fused_gemv_shuffle_kernel(const T* __restrict__ x,
                                                                 const std::uint8_t* __restrict__ codes,
                                                                 block_scales scales, std::int64_t block_size,
                                                                 std::int64_t M, std::int64_t N, std::int64_t K,
                                                                 T* __restrict__ y, code_table<256> nested_table) {
  static_assert(F != format::int8, "the 256-entry int8 map stays in shared memory (fused_gemv_kernel)");
  constexpr int per_load = codes_per_16_bytes<F>;  // 32 weights per 16 bytes
  constexpr int U = gemv_chunks;
  __shared__ float nested_map[256];
  stage_nested_map(scales, nested_map, nested_table);
  __syncthreads();
  const int shift = block_shift(block_size);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  float entry = 0.0f;  // code value lane % 16, chosen with constant indices (no local copy of the codebook)
#pragma unroll
  for (int c = 0; c < 16; ++c)
    if ((lane & 15) == c) entry = code_value<F>(static_cast<std::uint8_t>(c), nullptr);
  auto value_of = [&](std::uint32_t shifted_word) { return __shfl_sync(0xffffffffu, entry, static_cast<int>(shifted_word)); };
  const std::int64_t warps = blockDim.x >> 5;
  const bool vector = K % per_load == 0 && ::memkit::detail::vector_aligned(codes, x);
  for (std::int64_t n = blockIdx.x * warps + (threadIdx.x >> 5); n < N; n += gridDim.x * warps) {
    float acc[MaxRows] = {};
    const std::int64_t row = n * K;
    if (vector) {
      const uint4* row_codes = reinterpret_cast<const uint4*>(codes + row / 2);
      const std::int64_t chunks = K / per_load;
      for (std::int64_t first = 0; first < chunks; first += 32 * U) {
        uint4 packed[U];
        float scale[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {  // every load of the group before any decoding
          const std::int64_t chunk = first + 32 * u + lane;
          packed[u] = make_uint4(0u, 0u, 0u, 0u);
          scale[u] = 0.0f;
          if (chunk < chunks) {
            packed[u] = __ldg(row_codes + chunk);
            scale[u] = scales((row + chunk * per_load) >> shift);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const std::int64_t chunk = first + 32 * u + lane;
          const bool valid = chunk < chunks;
          const std::int64_t k0 = chunk * per_load;
          const std::uint32_t words[4] = {packed[u].x, packed[u].y, packed[u].z, packed[u].w};
#pragma unroll
          for (int part = 0; part < per_load / 8; ++part) {
            float w[8];
#pragma unroll
            for (int j = 0; j < 8; ++j)  // code_in_words' nibble order: the even weight in the high nibble
              w[j] = stored_product(value_of(words[part] >> (8 * (j >> 1) + ((j & 1) ? 0 : 4))), scale[u]);
            if (!valid) continue;
#pragma unroll
            for (int m = 0; m < MaxRows; ++m) {
              if (m >= M) break;
              float xv[8];
              ::memkit::detail::load_floats<T, 8, true>(x + m * K + k0 + 8 * part, xv);
#pragma unroll
              for (int j = 0; j < 8; ++j) acc[m] += xv[j] * w[j];
            }
          }
        }
      }
    } else {
      for (std::int64_t first = 0; first < K; first += 32) {
        const std::int64_t k = first + lane, element = row + k;
        const bool valid = k < K;
        const float w = stored_product(value_of(valid ? code_at<F>(codes, element) : 0u), valid ? scales(element >> shift) : 0.0f);
        if (!valid) continue;
#pragma unroll
        for (int m = 0; m < MaxRows; ++m)
          if (m < M) acc[m] += to_float(x[m * K + k]) * w;
      }
    }
#pragma unroll
    for (int m = 0; m < MaxRows; ++m) {
      if (m >= M) break;
      const float total = warp_sum(acc[m]);
      if (lane == 0) y[m * N + n] = from_float<T>(total);
    }
  }
}

// dx[m, k] for m < M <= MaxRows when W's rows do not allow 16-byte loads (gemv_t_vector is false): one
// thread per column k, walking the rows of W (coalesced across threads).
template <format F, class T, int MaxRows>
__global__ void __launch_bounds__(256) fused_gemv_t_kernel(const T* __restrict__ dy, const std::uint8_t* __restrict__ codes,
                                                           block_scales scales, std::int64_t block_size, std::int64_t M,
                                                           std::int64_t N, std::int64_t K, T* __restrict__ dx,
                                                           code_table<256> map_table, code_table<256> nested_table) {
  constexpr int entries = F == format::int8 ? 256 : 16;
  __shared__ float table[entries];
  __shared__ float nested_map[256];
  const int shift = stage_decoding<F>(table, nested_map, scales, map_table, nested_table, block_size);
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < K;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float acc[MaxRows] = {};
    for (std::int64_t n = 0; n < N; ++n) {
      const std::int64_t element = n * K + k;
      const float w = stored_product(table[code_at<F>(codes, element)], scales(element >> shift));
#pragma unroll
      for (int m = 0; m < MaxRows; ++m)
        if (m < M) acc[m] += to_float(dy[m * N + n]) * w;
    }
#pragma unroll
    for (int m = 0; m < MaxRows; ++m)
      if (m < M) dx[m * K + k] = from_float<T>(acc[m]);
  }
}

// dx[m, k] = sum_n dy[m, n] W[n, k] for m < M <= MaxRows, W's rows 16-byte aligned. Block (x, y) owns
// columns [256x, 256x + 256) and the y-th range of rows_per_split rows. It walks its rows in tiles loaded
// with 16-byte loads one tile ahead (registers) and read back from shared memory: thread t owns the 8
// columns 8 (t % 32) .. + 8 and rows t / 32, t / 32 + 8, ... of each tile, so each weight is decoded once
// (code value times the block's scale, the rounding of decode()) for all M rows of dy. The 8 row phases
// are added in a fixed order; one range writes dx, several write fp32 partial sums [range][m][k] that
// gemv_t_reduce_kernel adds in range order: the same bits every run.
template <format F, class T, int MaxRows>
__global__ void __launch_bounds__(256) fused_gemv_t_tiled_kernel(const T* __restrict__ dy,
                                                                 const std::uint8_t* __restrict__ codes,
                                                                 block_scales scales, std::int64_t block_size,
                                                                 std::int64_t M, std::int64_t N, std::int64_t K,
                                                                 T* __restrict__ dx, float* __restrict__ partial,
                                                                 std::int64_t rows_per_split, code_table<256> map_table,
                                                                 code_table<256> nested_table) {
  constexpr int entries = F == format::int8 ? 256 : 16;
  constexpr int row_bytes = F == format::int8 ? gemv_t_columns : gemv_t_columns / 2;  // one row's codes in a tile
  constexpr int tile_rows = gemv_t_tile_bytes / row_bytes;
  constexpr int vectors_per_row = row_bytes / 16;
  constexpr int loads = gemv_t_tile_bytes / 16 / 256;  // 16-byte loads per thread per tile
  constexpr int words_per_8 = F == format::int8 ? 2 : 1;
  __shared__ float table[entries];
  __shared__ float nested_map[256];
  __shared__ uint4 tile[gemv_t_tile_bytes / 16];
  __shared__ float dy_tile[MaxRows][tile_rows];
  __shared__ float sums[MaxRows][gemv_t_columns];
  stage_code_values<F>(table, map_table);
  stage_nested_map(scales, nested_map, nested_table);
  const int t = static_cast<int>(threadIdx.x), lane = t & 31, phase = t >> 5;
  const int shift = block_shift(block_size);
  const std::int64_t first_column = static_cast<std::int64_t>(blockIdx.x) * gemv_t_columns;
  const std::int64_t n_begin = static_cast<std::int64_t>(blockIdx.y) * rows_per_split;
  const std::int64_t n_end = N - n_begin < rows_per_split ? N : n_begin + rows_per_split;
  const std::int64_t row_stride = F == format::int8 ? K : K / 2;  // bytes of codes per row of W
  const std::int64_t first_byte = F == format::int8 ? first_column : first_column / 2;
  const std::int64_t valid_bytes = row_stride - first_byte < row_bytes ? row_stride - first_byte : row_bytes;
  uint4 next[loads];
  auto load_tile = [&](std::int64_t n0) {
#pragma unroll
    for (int i = 0; i < loads; ++i) {
      const int q = t + 256 * i, r = q / vectors_per_row, c = q % vectors_per_row;
      next[i] = make_uint4(0u, 0u, 0u, 0u);
      if (n0 + r < n_end && 16 * c < valid_bytes)
        next[i] = __ldg(reinterpret_cast<const uint4*>(codes + (n0 + r) * row_stride + first_byte) + c);
    }
  };
  float acc[MaxRows][8] = {};
  const std::int64_t column = first_column + 8 * lane;  // this thread's first column; K % 8 == 0
  if (n_begin < n_end) load_tile(n_begin);
  for (std::int64_t n0 = n_begin; n0 < n_end; n0 += tile_rows) {
    __syncthreads();  // the previous tile is consumed (and the tables staged, the first time)
#pragma unroll
    for (int i = 0; i < loads; ++i) tile[t + 256 * i] = next[i];
    for (int i = t; i < MaxRows * tile_rows; i += 256) {
      const int m = i / tile_rows, r = i % tile_rows;
      dy_tile[m][r] = m < M && n0 + r < n_end ? to_float(dy[m * N + n0 + r]) : 0.0f;
    }
    __syncthreads();
    if (n0 + tile_rows < n_end) load_tile(n0 + tile_rows);  // in flight while this tile is used
    if (column >= K) continue;
    for (int r = phase; r < tile_rows && n0 + r < n_end; r += 8) {
      const float scale = scales(((n0 + r) * K + column) >> shift);  // 8 columns, one block (blocks >= 32)
      std::uint32_t words[2];
      if constexpr (F == format::int8) {
        const uint2 raw = reinterpret_cast<const uint2*>(tile)[r * (row_bytes / 8) + lane];
        words[0] = raw.x;
        words[1] = raw.y;
      } else {
        words[0] = reinterpret_cast<const std::uint32_t*>(tile)[r * (row_bytes / 4) + lane];
        words[1] = 0u;
      }
      float w[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) w[j] = stored_product(table[code_in_words<F>(words, j)], scale);
      (void)words_per_8;
#pragma unroll
      for (int m = 0; m < MaxRows; ++m) {
        if (m >= M) break;
        const float d = dy_tile[m][r];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[m][j] += d * w[j];
      }
    }
  }
  // The row phases' sums, added in phase order.
  for (int p = 0; p < 8; ++p) {
    if (phase == p) {
#pragma unroll
      for (int m = 0; m < MaxRows; ++m) {
        if (m >= M) break;
#pragma unroll
        for (int j = 0; j < 8; ++j) sums[m][8 * lane + j] = p == 0 ? acc[m][j] : sums[m][8 * lane + j] + acc[m][j];
      }
    }
    __syncthreads();
  }
  const std::int64_t k = first_column + t;
  if (k >= K) return;
  for (int m = 0; m < M; ++m) {
    if (partial != nullptr) partial[(static_cast<std::int64_t>(blockIdx.y) * M + m) * K + k] = sums[m][t];
    else dx[m * K + k] = from_float<T>(sums[m][t]);
  }
}

// dx = the sum over ranges of the tiled kernel's partial sums, in range order.
template <class T>
__global__ void gemv_t_reduce_kernel(const float* __restrict__ partial, std::int64_t splits, std::int64_t count,
                                     T* __restrict__ dx) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float sum = partial[i];
    for (std::int64_t s = 1; s < splits; ++s) sum += partial[s * count + i];
    dx[i] = from_float<T>(sum);
  }
}

template <class T>
__global__ void convert_kernel(const float* __restrict__ in, T* __restrict__ out, std::int64_t count) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(in[i]);
}

#endif

}  // namespace quant::detail

MEMKIT_NAMESPACE_END
