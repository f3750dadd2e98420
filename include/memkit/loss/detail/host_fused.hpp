// memkit/loss/detail/host_fused.hpp — the host path of fused_linear_cross_entropy: the head as the products
// see it (dense, or tiles of a quantized head dequantized into fp32), the chunk loop (linalg::gemm products
// around host_row over the host threads) and the checks of the values made before anything is written.
// Not a public header: fused_linear_cross_entropy.hpp includes it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/linalg/gemm.hpp"
#include "memkit/loss/bytes.hpp"
#include "memkit/loss/detail/common.hpp"
#include "memkit/loss/detail/host_row_pass.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/quantized_tensor.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace loss::detail {

// Largest |value| of `count` values; throws naming `what` and the row if one is NaN or Inf.
template <class T>
double host_max_abs(const T* values, std::int64_t rows, std::int64_t cols, const char* operation, const char* what,
                    std::int64_t first_row = 0) {
  float largest = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    float row_largest = 0;
    bool finite = true;
    for (std::int64_t j = 0; j < cols; ++j) {
      const float v = to_float(values[r * cols + j]);
      finite &= std::isfinite(v);
      row_largest = std::max(row_largest, std::fabs(v));
    }
    if (!finite)
      throw error(std::string(operation) + ": `" + what + "` has a NaN or Inf value in row " +
                  std::to_string(first_row + r));
    largest = std::max(largest, row_largest);
  }
  return largest;
}

// The head as the host products see it: a dense matrix, or tiles of rows dequantized into fp32.
template <class W>
struct dense_head_source {
  tensor_view<const W> head;
  std::int64_t V, H;
  std::int64_t tile_rows() const noexcept { return V; }
  linalg::matrix_ref<const W> rows(std::int64_t first, std::int64_t count) const {
    return {head.data() + first * H, count, H, H, head.where()};
  }
};

template <quant::format F>
struct quantized_head_source {
  const quant::quantized_tensor<F>* head;
  std::int64_t V, H;
  float* tile;  // tile_rows() x H floats
  std::int64_t tile_rows() const noexcept { return head_tile_rows(V, H); }
  linalg::matrix_ref<const float> rows(std::int64_t first, std::int64_t count) const {
    head->dequantize_rows(host, first, tensor_view<float>{tile, shape{count * H}, memory_kind::host});
    return {tile, count, H, H, memory_kind::host};
  }
};

template <class T, class Source>
void host_fused(const tensor_view<const T>& hidden, const Source& source,
                const tensor_view<const std::int32_t>& targets, const tensor_view<const float>& d_loss,
                const tensor_view<float>& loss,
                const tensor_view<T>& d_hidden, const tensor_view<float>& d_head, const cross_entropy_options& options,
                const loss_dims& dims, float* hidden_accumulator, memory_resource& workspace) {
  const std::int64_t N = dims.N, H = dims.H, V = dims.V;  // not a binding: clang < 16 cannot capture one in a lambda
  const std::int64_t c = chunk_tokens(N, V, sizeof(T), options, false);
  const std::int64_t tile = source.tile_rows();
  const linalg::gemm_options g{options.host_threads};
  const int threads = resolve_host_threads(options.host_threads);
  const row_math math = make_row_math(options, V);
  std::int64_t counted = 0;
  for (std::int64_t i = 0; i < N; ++i) counted += targets[i] != options.ignore_index;
  const float scale = counted > 0 ? 1.0f / static_cast<float>(counted) : 0.0f;
  // Reduction none: each row's loss goes straight into `loss`, and its gradient is scaled by its own d_loss
  // (1 / counted is the mean's d_loss of every counted token).
  const bool per_token = options.reduction == reduction_mode::none;
  const float* row_scale = per_token && !d_loss.is_none() ? d_loss.data() : nullptr;

  buffer<float> logits(workspace, shape{c * V});
  buffer<float> row_loss_buffer;
  if (!per_token) row_loss_buffer = buffer<float>(workspace, shape{N});
  float* row_loss = per_token ? loss.data() : row_loss_buffer.data();
  const auto logit_block = [&](std::int64_t rows, std::int64_t first_column, std::int64_t columns) {
    return linalg::matrix_ref<float>(logits.data() + first_column, rows, columns, V, memory_kind::host);
  };
  for (std::int64_t first = 0; first < N; first += c) {
    const std::int64_t rows = std::min(c, N - first);
    const linalg::matrix_ref<const T> x(hidden.data() + first * H, rows, H, H, hidden.where());
    for (std::int64_t n0 = 0; n0 < V; n0 += tile) {
      const std::int64_t nt = std::min(tile, V - n0);
      linalg::gemm(host, linalg::transpose::no, linalg::transpose::yes, 1.0f, x, source.rows(n0, nt), 0.0f,
                   logit_block(rows, n0, nt), workspace, g);
    }
    ::memkit::detail::run_in_parts(threads, rows, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        float* z = logits.data() + r * V;
        const std::int32_t target = targets[first + r];
        if (target == options.ignore_index) {
          std::fill(z, z + V, 0.0f);
          row_loss[first + r] = 0.0f;
        } else {
          row_loss[first + r] = host_row(math, z, V, target, row_scale != nullptr ? row_scale[first + r] : scale);
        }
      }
    });
    // d_head before d_hidden: d_hidden may then alias hidden (this chunk's rows are not read again).
    if (!d_head.is_none())
      linalg::gemm(host, linalg::transpose::yes, linalg::transpose::no, 1.0f,
                   linalg::matrix_ref<const float>(logit_block(rows, 0, V)), x, 1.0f,
                   linalg::matrix_ref<float>(d_head.data(), V, H, H, d_head.where()), workspace, g);
    if (d_hidden.is_none()) continue;
    const linalg::matrix_ref<T> dx(d_hidden.data() + first * H, rows, H, H, d_hidden.where());
    if (tile >= V) {
      linalg::gemm(host, linalg::transpose::no, linalg::transpose::no, 1.0f,
                   linalg::matrix_ref<const float>(logit_block(rows, 0, V)), source.rows(0, V), 0.0f, dx, workspace, g);
      continue;
    }
    // Several tiles: their contributions add up in fp32 (in d_hidden itself when it is fp32).
    float* acc = std::is_same_v<T, float> ? reinterpret_cast<float*>(dx.data) : hidden_accumulator;
    const linalg::matrix_ref<float> acc_ref(acc, rows, H, H, memory_kind::host);
    for (std::int64_t n0 = 0; n0 < V; n0 += tile) {
      const std::int64_t nt = std::min(tile, V - n0);
      linalg::gemm(host, linalg::transpose::no, linalg::transpose::no, 1.0f,
                   linalg::matrix_ref<const float>(logit_block(rows, n0, nt)), source.rows(n0, nt),
                   n0 == 0 ? 0.0f : 1.0f, acc_ref, workspace, g);
    }
    if constexpr (!std::is_same_v<T, float>)
      for (std::int64_t i = 0; i < rows * H; ++i) dx.data[i] = from_float<T>(acc[i]);
  }
  if (per_token) return;
  double total = 0;
  for (std::int64_t i = 0; i < N; ++i) total += row_loss[i];
  loss[0] = counted > 0 ? static_cast<float>(total / static_cast<double>(counted)) : 0.0f;
}

// Host checks made before anything is written: target ids, NaN/Inf, and the bound on the logits.
template <class T, class Source>
void host_check_values(const char* operation, const tensor_view<const T>& hidden, const Source& source,
                       const tensor_view<const std::int32_t>& targets, const tensor_view<const float>& d_loss,
                       const cross_entropy_options& options, const loss_dims& dims) {
  const std::int64_t N = dims.N, H = dims.H, V = dims.V;  // not a binding: clang < 16 cannot capture one in a lambda
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int32_t t = targets[i];
    if (t != options.ignore_index && (t < 0 || t >= V))
      throw error(std::string(operation) + ": target id " + std::to_string(t) + " of token " + std::to_string(i) +
                  " is outside the vocabulary [0, " + std::to_string(V) + ") and is not ignore_index (" +
                  std::to_string(options.ignore_index) + ")");
  }
  if (!d_loss.is_none())
    for (std::int64_t i = 0; i < N; ++i)
      if (!std::isfinite(d_loss[i]))
        throw error(std::string(operation) + ": `d_loss` of token " + std::to_string(i) + " is NaN or Inf");
  const double hidden_max = host_max_abs(hidden.data(), N, H, operation, "hidden");
  double head_max = 0;
  for (std::int64_t n0 = 0; n0 < V; n0 += source.tile_rows()) {
    const std::int64_t nt = std::min(source.tile_rows(), V - n0);
    head_max = std::max(head_max, host_max_abs(source.rows(n0, nt).data, nt, H, operation, "head", n0));
  }
  const double bound = static_cast<double>(H) * hidden_max * head_max;
  require(bound <= max_logit_bound,
          std::string(operation) + ": the logits could overflow fp32 (hidden " + std::to_string(H) + " x max|hidden| " +
              std::to_string(hidden_max) + " x max|head| " + std::to_string(head_max) + " exceeds " +
              std::to_string(max_logit_bound) + ")");
}

}  // namespace loss::detail
MEMKIT_NAMESPACE_END
