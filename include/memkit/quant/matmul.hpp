// memkit/quant/matmul.hpp — matrix products with a quantized weight, never dequantizing all of it.
//
//   y  = x  * dequant(W)^T     x [M, K], W [N, K] -> y  [M, N]    (the Linear forward)
//   dx = dy * dequant(W)       dy [M, N]           -> dx [M, K]   (the input gradient; W gets none)
//
// Host: batches of up to 32 rows (4-bit W, rows of whole blocks) decode W inside the dot products, up to 8
// rows per pass over W, several columns at a time, depth in L1-sized chunks (AVX-512, AVX2 + FMA or
// portable, chosen at run time by core/host_simd.hpp). Larger forward batches are linalg GEMMs whose B
// panels are decoded straight from W's codes (x packed once per 288 rows; no dequantized tile); the input gradient
// dequantizes tiles of W's rows (at least host_gemm_min_rows) and multiplies them with linalg's GEMM. All
// paths split the output columns over matmul_config::host_threads threads (core/host_threads.hpp), never
// the sum, so results do not depend on the thread count; fp32 accumulation throughout.
// CUDA: for M <= small_batch_limit (at most 8) a fused kernel decodes W on the fly (one warp per output
// column for y, one thread per input column for dx), reading the 4-bit codes once; larger batches
// dequantize row tiles (device_tile_floats values, 128 MiB of bf16 by default: the whole W of a layer up to
// 8192 x 8192) into workspace and call cuBLAS (tensor cores for bf16/fp16). One tile is one dequantize and one
// cuBLAS call that writes y or dx directly; when W takes several tiles, a 16-bit dx is accumulated in fp32.
// That workspace is allocated and released on the executor's stream, so the CUDA tiled path needs a
// stream-ordered workspace resource (device_async_resource, or a tracker over one) and refuses any other:
// a plain device_resource would free it with cudaFree, which waits for the whole device (docs/cuda.md).
// Users of the CUDA large-batch path link CUDA::cublas.
//
// Calls follow docs/architecture.md's protocol: matmul(exec, x, w, y, config, workspace), and
// workspace_bytes(matmul_arguments{...}) says exactly what a call takes from the workspace resource.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/cublas.hpp"
#include "memkit/core/device_vector.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/linalg/gemm.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/blockwise.hpp"
#include "memkit/quant/bytes.hpp"
#include "memkit/quant/detail/matmul_host.hpp"
#include "memkit/quant/detail/matmul_kernels.hpp"
#include "memkit/quant/formats.hpp"
#include "memkit/quant/quantized_tensor.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace quant {

// y = x * dequant(w)^T. x: [..., K] (T = float, bf16 or fp16), y: [..., N] of the same T. `workspace` serves
// the call's temporary buffers (workspace_bytes); the CUDA tiled path needs a stream-ordered one.
template <executor E, format F, float_storage T>
void matmul(const E& exec, tensor_view<const std::type_identity_t<T>> x, const quantized_tensor<F>& w, tensor_view<T> y,
            const matmul_config& config, memory_resource& workspace);

// dx = dy * dequant(w). dy: [..., N], dx: [..., K] of the same T; W gets no gradient.
template <executor E, format F, float_storage T>
void matmul_input_grad(const E& exec, tensor_view<const std::type_identity_t<T>> dy, const quantized_tensor<F>& w,
                       tensor_view<T> dx, const matmul_config& config, memory_resource& workspace);

// --- implementation: the two products (their plans and workspace_bytes are in quant/bytes.hpp) ---

namespace detail {

// An empty sum is zero: the output of a product whose inner dimension (K for y, N for dx) is 0.
template <executor E, class T>
void write_zeros(const E& exec, tensor_view<T> out) {
  if constexpr (!E::on_device) {
    (void)exec;
    for (std::int64_t i = 0; i < out.size(); ++i) out[i] = from_float<T>(0.0f);
  } else {
#if MEMKIT_HAS_CUDA
    // +0.0 is all zero bits in fp32, bf16 and fp16 alike.
    ::memkit::detail::with_device(exec.device, [&] {
      MEMKIT_CUDA_CHECK(cudaMemsetAsync(out.data(), 0, static_cast<std::size_t>(out.size()) * sizeof(T), exec.stream));
      return 0;
    });
#endif
  }
}

// The tiled paths: W's rows dequantized `rows` at a time into `tile` (flat, room for rows x K values), and
// use(n0, nt) called after each tile of nt rows from row n0.
template <executor E, format F, class T, class Use>
void for_each_tile(const E& exec, const quantized_tensor<F>& w, tensor_view<T> tile, std::int64_t rows, Use&& use) {
  const std::int64_t N = w.logical_shape()[0], K = w.logical_shape()[1];
  for (std::int64_t n0 = 0; n0 < N; n0 += rows) {
    const std::int64_t nt = N - n0 < rows ? N - n0 : rows;
    w.dequantize_range(exec, n0 * K, tile.flat_slice(0, nt * K));
    use(n0, nt);
  }
}

struct matmul_dims {
  std::int64_t M, N, K;
  bool done;  // nothing left to compute: the output is empty, or all zeros (an empty sum) and written
};

// The start both products share: checks the shapes and where the tensors live, and finishes an empty output
// or an empty sum (K = 0 for y, N = 0 for dx) at once.
template <executor E, format F, class T>
matmul_dims begin_matmul(const E& exec, const char* operation, const quantized_tensor<F>& w,
                         const tensor_view<const T>& in, const tensor_view<T>& out, matmul_kind kind) {
  const shape& ws = w.logical_shape();
  require(ws.rank == 2, std::string(operation) + ": the weight must be a matrix [N, K], has shape " + to_string(ws));
  const std::int64_t N = ws[0], K = ws[1];
  const std::int64_t in_cols = kind == matmul_kind::forward ? K : N;
  const std::int64_t out_cols = kind == matmul_kind::forward ? N : K;
  const shape& is = in.shape();
  require(is.rank >= 1 && is[is.rank - 1] == in_cols,
          std::string(operation) + ": input has shape " + to_string(is) + " but the weight " + to_string(ws) +
              " needs a last dimension of " + std::to_string(in_cols));
  // Rows: the product of the leading dimensions (not size / in_cols, which is 0 / 0 when K or N is 0).
  std::int64_t M = 1;
  for (int d = 0; d + 1 < is.rank; ++d) M *= is[d];
  require(out.size() == M * out_cols && out.shape()[out.shape().rank - 1] == out_cols,
          std::string(operation) + ": output has shape " + to_string(out.shape()) + " but needs " +
              std::to_string(M) + " rows of " + std::to_string(out_cols));
  const bool forward = kind == matmul_kind::forward;
  require_accessible(exec, in, operation, forward ? "x" : "dy");
  require_accessible(exec, w.codes(), operation, "w");
  require_accessible(exec, out, operation, forward ? "y" : "dx");
  if (M == 0 || out_cols == 0) return {M, N, K, true};
  if (in_cols == 0) {
    write_zeros(exec, out);
    return {M, N, K, true};
  }
  return {M, N, K, false};
}

}  // namespace detail

template <executor E, format F, float_storage T>
void matmul(const E& exec, tensor_view<const std::type_identity_t<T>> x, const quantized_tensor<F>& w, tensor_view<T> y,
            const matmul_config& config, memory_resource& workspace) {
  constexpr const char* operation = "quant::matmul";
  // Named variables, not a structured binding: clang before 16 cannot capture bindings in the lambdas below.
  const detail::matmul_dims dims = detail::begin_matmul(exec, operation, w, x, y, matmul_kind::forward);
  if (dims.done) return;
  const std::int64_t M = dims.M, N = dims.N, K = dims.K;
  if constexpr (!E::on_device) {
    if constexpr (is_four_bit(F)) {
      if (detail::host_fused(matmul_kind::forward, F, w.block_size(), M, K)) {
        block_scales scales = w.scales();
        scales.nested_map = w.nested_map().value;
#if MEMKIT_QUANT_X86_SIMD
        host_isa isa = host_isa_in_use();
        if (config.host_simd < 2 && isa == host_isa::avx512) isa = host_isa::avx2;
        if (config.host_simd < 1) isa = host_isa::portable;
#else
        const host_isa isa = host_isa::portable;
#endif
        // x in fp32 and in the order the kernel's lanes take it, once, not once per row of W.
        buffer<float> widened(workspace, shape{M * K});
        detail::fused_input_layout(isa, x.data(), M * K, widened.data());
        const float* wide = widened.data();
        const std::int64_t parts = detail::host_column_parts(N, detail::host_matmul_threads(config));
        ::memkit::detail::run_in_parts(static_cast<int>(parts), parts, [&](std::int64_t first, std::int64_t last) {
          const std::int64_t n0 = detail::host_part_begin(N, parts, first), n1 = detail::host_part_begin(N, parts, last);
          // Passes over this part of W, each with up to host_fused_rows rows of x, as even as can be.
          const std::int64_t passes = (M + detail::host_fused_rows - 1) / detail::host_fused_rows;
          for (std::int64_t pass = 0; pass < passes; ++pass) {
            const std::int64_t m0 = M * pass / passes, rows = M * (pass + 1) / passes - m0;
            const float* x_rows = wide + m0 * K;
            T* y_rows = y.data() + m0 * N;
#if MEMKIT_QUANT_X86_SIMD
            if (isa != host_isa::portable) {
              detail::fused_gemv_simd<F>(isa, x_rows, rows, w.codes().data(), scales, w.block_size(), N, K, n0, n1, y_rows);
              continue;
            }
#endif
            detail::fused_gemv_host<F>(x_rows, rows, w.codes().data(), scales, w.block_size(), N, K, n0, n1, y_rows);
          }
        });
        return;
      }
    }
    const detail::host_forward_plan plan = detail::plan_host_forward(M, N, K, !std::is_same_v<T, float>, config);
    buffer<float> scratch(workspace, shape{plan.floats()});
    block_scales scales = w.scales();
    scales.nested_map = w.nested_map().value;
    linalg::detail::with_gemm_kernel([&](auto kernel) {
      detail::host_forward_gemm<typename decltype(kernel)::type, F>(x.data(), w.codes().data(), scales, w.block_size(),
                                                                    y.data(), M, N, K, plan, scratch.data());
    });
  } else {
#if MEMKIT_HAS_CUDA
    ::memkit::detail::require_cublas_span(M, K, operation, "x");
    ::memkit::detail::require_cublas_span(M, N, operation, "y");
    // The tiled path's workspace is allocated and released on exec.stream (docs/cuda.md, "Workspace").
    if (!detail::device_fused(M, config)) ::memkit::detail::require_stream_ordered(workspace, operation);
    ::memkit::detail::with_device(exec.device, [&] {
      if (detail::device_fused(M, config)) {
        constexpr int threads = 256;
        if constexpr (F != format::int8) {
          if (config.device_gemv_shuffle) {
            detail::fused_gemv_shuffle_kernel<F, T, detail::device_fused_rows>
                <<<detail::grid_for(N * 32, threads), threads, 0, exec.stream>>>(
                    x.data(), w.codes().data(), w.scales(), w.block_size(), M, N, K, y.data(), w.nested_map());
            MEMKIT_CUDA_CHECK(cudaGetLastError());
            return 0;
          }
        }
        detail::fused_gemv_kernel<F, T, detail::device_fused_rows><<<detail::grid_for(N * 32, threads), threads, 0, exec.stream>>>(
            x.data(), w.codes().data(), w.scales(), w.block_size(), M, N, K, y.data(), signed_dynamic_table,
            w.nested_map());
        MEMKIT_CUDA_CHECK(cudaGetLastError());
        return 0;
      }
      const std::int64_t rows = detail::tile_rows(N, K, config, true);
      buffer<T> tile(workspace, shape{rows * K}, on_stream{exec.stream});
      cublasHandle_t handle = ::memkit::detail::cublas_handle_for(exec);  // on exec.stream, its own workspace
      const float one = 1.0f, zero = 0.0f;
      detail::for_each_tile(exec, w, tile.view(), rows, [&](std::int64_t n0, std::int64_t nt) {
        // Column-major view: y^T[nt, M] (ld N) = tile[nt, K] * x^T[K, M].
        ::memkit::detail::cublas_check(
            cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(nt), static_cast<int>(M), static_cast<int>(K),
                         &one, tile.data(), ::memkit::detail::cuda_type<T>(), static_cast<int>(K), x.data(), ::memkit::detail::cuda_type<T>(),
                         static_cast<int>(K), &zero, y.data() + n0, ::memkit::detail::cuda_type<T>(), static_cast<int>(N),
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx");
      });
      return 0;
    });
#endif
  }
}

template <executor E, format F, float_storage T>
void matmul_input_grad(const E& exec, tensor_view<const std::type_identity_t<T>> dy, const quantized_tensor<F>& w,
                       tensor_view<T> dx, const matmul_config& config, memory_resource& workspace) {
  constexpr const char* operation = "quant::matmul_input_grad";
  // Named variables, not a structured binding: clang before 16 cannot capture bindings in the lambdas below.
  const detail::matmul_dims dims = detail::begin_matmul(exec, operation, w, dy, dx, matmul_kind::input_grad);
  if (dims.done) return;
  const std::int64_t M = dims.M, N = dims.N, K = dims.K;
  const std::int64_t rows = detail::tile_rows(N, K, config, E::on_device);
  if constexpr (!E::on_device) {
    (void)rows;
    buffer<float> accumulator;
    float* acc = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      acc = dx.data();
    } else {
      accumulator = buffer<float>(workspace, shape{M * K});
      acc = accumulator.data();
    }
    {
      // dx (+)= dy[:, n0 .. n0 + nt) * tile, tile by tile, the gemm's threads splitting dx's columns.
      const detail::host_tiled_plan plan = detail::plan_host_input_grad(M, N, K, config);
      buffer<float> scratch(workspace, shape{plan.part_floats()});
      float* tile = scratch.data();
      const tensor_view<float> tile_view(tile, shape{plan.tile_floats}, memory_kind::host);
      detail::for_each_tile(exec, w, tile_view, plan.rows, [&](std::int64_t n0, std::int64_t nt) {
        linalg::detail::gemm_host_on_scratch(
            linalg::transpose::no, linalg::transpose::no, 1.0f, linalg::matrix_ref<const T>(dy.data() + n0, M, nt, N, memory_kind::host),
            linalg::matrix_ref<const float>(tile, nt, K, K, memory_kind::host), n0 == 0 ? 0.0f : 1.0f,
            linalg::matrix_ref<float>(acc, M, K, K, memory_kind::host), {M, K, nt},
            plan.gemm, tile + plan.tile_floats);  // planned for a full tile: a shallower one fits its buffers
      });
    }
    if constexpr (!std::is_same_v<T, float>)
      for (std::int64_t i = 0; i < M * K; ++i) dx[i] = from_float<T>(acc[i]);
  } else {
#if MEMKIT_HAS_CUDA
    ::memkit::detail::require_cublas_span(M, N, operation, "dy");
    ::memkit::detail::require_cublas_span(M, K, operation, "dx");
    // The tiled path's workspace, and the fused kernel's partial sums when it splits N, are allocated and
    // released on exec.stream.
    if (workspace_bytes(matmul_arguments{matmul_kind::input_grad, F, w.block_size(), M, N, K, sizeof(T), true, config}) > 0)
      ::memkit::detail::require_stream_ordered(workspace, operation);
    ::memkit::detail::with_device(exec.device, [&] {
      constexpr int threads = 256;
      if (detail::device_fused(M, config)) {
        if (detail::gemv_t_vector<F>(K) && ::memkit::detail::vector_aligned(w.codes().data())) {
          const std::int64_t splits = detail::gemv_t_splits(N, K);
          const std::int64_t rows_per_split = (N + splits - 1) / splits;
          buffer<float> partial;
          if (splits > 1) partial = buffer<float>(workspace, shape{splits * M * K}, on_stream{exec.stream});
          const dim3 grid(static_cast<unsigned>((K + detail::gemv_t_columns - 1) / detail::gemv_t_columns),
                          static_cast<unsigned>(splits));
          detail::fused_gemv_t_tiled_kernel<F, T, detail::device_fused_rows><<<grid, threads, 0, exec.stream>>>(
              dy.data(), w.codes().data(), w.scales(), w.block_size(), M, N, K, dx.data(), partial.data(),
              rows_per_split, signed_dynamic_table, w.nested_map());
          MEMKIT_CUDA_CHECK(cudaGetLastError());
          if (splits > 1) {
            detail::gemv_t_reduce_kernel<T><<<detail::grid_for(M * K, threads), threads, 0, exec.stream>>>(
                partial.data(), splits, M * K, dx.data());
            MEMKIT_CUDA_CHECK(cudaGetLastError());
          }
          return 0;
        }
        detail::fused_gemv_t_kernel<F, T, detail::device_fused_rows><<<detail::grid_for(K, threads), threads, 0, exec.stream>>>(
            dy.data(), w.codes().data(), w.scales(), w.block_size(), M, N, K, dx.data(), signed_dynamic_table,
            w.nested_map());
        MEMKIT_CUDA_CHECK(cudaGetLastError());
        return 0;
      }
      buffer<T> tile(workspace, shape{rows * K}, on_stream{exec.stream});
      buffer<float> accumulator;
      void* c = dx.data();
      cudaDataType_t c_type = ::memkit::detail::cuda_type<T>();
      const bool accumulate_fp32 = !std::is_same_v<T, float> && rows < N;  // one tile: cuBLAS writes dx itself
      if (accumulate_fp32) {
        accumulator = buffer<float>(workspace, shape{M * K}, on_stream{exec.stream});
        c = accumulator.data();
        c_type = CUDA_R_32F;
      }
      cublasHandle_t handle = ::memkit::detail::cublas_handle_for(exec);  // on exec.stream, its own workspace
      const float one = 1.0f, zero = 0.0f;
      detail::for_each_tile(exec, w, tile.view(), rows, [&](std::int64_t n0, std::int64_t nt) {
        // Column-major: dx^T[K, M] (+)= tile^T[K, nt] * dy^T[nt, M] (dy columns n0.., ld N).
        ::memkit::detail::cublas_check(
            cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(K), static_cast<int>(M), static_cast<int>(nt),
                         &one, tile.data(), ::memkit::detail::cuda_type<T>(), static_cast<int>(K), dy.data() + n0,
                         ::memkit::detail::cuda_type<T>(), static_cast<int>(N), n0 == 0 ? &zero : &one, c, c_type,
                         static_cast<int>(K), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx");
      });
      if (accumulate_fp32) {
        detail::convert_kernel<T><<<detail::grid_for(M * K, threads), threads, 0, exec.stream>>>(
            accumulator.data(), dx.data(), M * K);
        MEMKIT_CUDA_CHECK(cudaGetLastError());
      }
      return 0;
    });
#endif
  }
}

}  // namespace quant

MEMKIT_NAMESPACE_END
