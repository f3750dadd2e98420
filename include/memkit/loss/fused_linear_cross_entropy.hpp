// memkit/loss/fused_linear_cross_entropy.hpp — the LM head's matmul and the cross-entropy loss in one pass
// over chunks of tokens, so the [tokens, vocab] logits never exist.
//
//   logits = hidden [N, H] * head [V, H]^T          (fp32 accumulation, one chunk of tokens at a time)
//   z      = cap * tanh(logits / cap)               (optional soft-capping, cap = logit_softcap > 0)
//   loss_i = lse_i - (1 - eps) z_i,t - eps/V sum_j z_i,j + z_loss * lse_i^2     (lse_i = log sum_j exp z_i,j)
//   loss   = sum over counted tokens of loss_i / counted   (counted: targets != ignore_index)
//   or, with options.reduction = none, loss = [loss_i] per token (0 where ignored), and the gradients are those
//   of sum_i d_loss_i * loss_i for the caller's per-token upstream gradient d_loss [N] (token weights; a mean is
//   d_loss_i = 1 / counted). Ignored tokens get no gradient whatever their d_loss.
//
// Per chunk of tokens the fp32 logits are computed, turned in place into their gradient, and at once
// multiplied back: d_hidden = dlogits * head (overwritten), d_head += dlogits^T * hidden (accumulated;
// only for a dense head that trains). The chunk's logits are the largest buffer; how many tokens a chunk
// holds follows from options.chunk_bytes. The head is either a dense tensor_view [V, H] or a frozen
// quant::quantized_tensor [V, H], dequantized a tile of rows at a time (the same tiling quant::matmul
// uses) so that it never exists dense either.
//
// Host (detail/host_fused.hpp, detail/host_row_pass.hpp): products through linalg::gemm (packed AVX2 / AVX-512 kernels), the per-row softmax over
// memkit's host threads with its exp passes 16 lanes wide (AVX-512, AVX2 or portable C++, chosen by
// core/host_simd.hpp, all giving the same bits); the result does not depend on the thread count. Bad input throws memkit::error
// before any output is written: shapes, target ids out of range, NaN/Inf in hidden or head, and values
// so large the fp32 logits could overflow.
// CUDA (detail/device_fused.hpp): cuBLAS (core/cublas.hpp) for the products and small kernels for counting, the softmax/gradient
// and the final mean, all on the executor's stream, with no synchronization: the loss stays in device
// memory. Shape errors still throw; target ids out of range make the loss NaN (checking them on the host
// would need a sync), and NaN/Inf in the inputs propagate into the loss.
//
// A batch in which every target is ignore_index counts 0 tokens: the loss is 0, d_hidden is 0 and
// d_head is left unchanged (a micro-batch of padding contributes nothing), on the host and on CUDA.
//
// loss/bytes.hpp (which memory_budget includes alone) has the options, the arguments struct and the byte functions:
// workspace_bytes(fused_linear_cross_entropy_arguments{...}) says exactly what a call takes from `workspace`.
#pragma once

#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/loss/bytes.hpp"
#include "memkit/loss/detail/common.hpp"
#include "memkit/loss/detail/device_fused.hpp"
#include "memkit/loss/detail/host_fused.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/quantized_tensor.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace loss {

// Loss, d_hidden and d_head of the LM head `head` [V, H] (fp32, bf16 or fp16) applied to `hidden` [N, H].
// `targets` [N] int32; `loss` one float, or [N] floats with reduction none (host or device memory, as the
// executor reads); `d_loss` [N] fp32, the upstream gradient of each token's loss: reduction none only, needed
// there when a gradient is asked for (none() otherwise); `d_hidden` [N, H] of hidden's type, overwritten (none():
// not computed; it may alias `hidden`); `d_head` [V, H] fp32, accumulated into (none(): a frozen head). CUDA: the
// head must have hidden's element type.
template <executor E, class Hidden, class Head>
  requires float_storage<std::remove_const_t<Hidden>> && float_storage<std::remove_const_t<Head>>
void fused_linear_cross_entropy(const E& exec, tensor_view<Hidden> hidden, tensor_view<Head> head,
                                tensor_view<const std::int32_t> targets, tensor_view<const float> d_loss,
                                tensor_view<float> loss, tensor_view<std::remove_const_t<Hidden>> d_hidden,
                                tensor_view<float> d_head, const cross_entropy_options& options,
                                memory_resource& workspace) {
  using T = std::remove_const_t<Hidden>;
  using W = std::remove_const_t<Head>;
  constexpr const char* operation = "loss::fused_linear_cross_entropy";
  const tensor_view<const T> x = hidden;
  const tensor_view<const W> w = head;
  const detail::loss_dims dims =
      detail::check_arguments(operation, x, w.shape(), targets, d_loss, loss, d_hidden, d_head, options);
  detail::check_access(exec, operation, x, targets, d_loss, loss, d_hidden, d_head);
  require_accessible(exec, w, operation, "head");
  if constexpr (!E::on_device) {
    const detail::dense_head_source<W> source{w, dims.V, dims.H};
    detail::host_check_values(operation, x, source, targets, d_loss, options, dims);
    if (dims.N == 0) return detail::zero_loss<T>(exec, loss);
    detail::host_fused(x, source, targets, d_loss, loss, d_hidden, d_head, options, dims, nullptr, workspace);
  } else {
#if MEMKIT_HAS_CUDA
    require(std::is_same_v<T, W>, std::string(operation) + ": on CUDA the head must have the hidden states' element type");
    require(dims.V <= 2147483647 && dims.H <= 2147483647, std::string(operation) + ": vocab and hidden must fit cuBLAS's int");
    if (dims.N == 0) return detail::zero_loss<T>(exec, loss);
    if constexpr (std::is_same_v<T, W>) {
      ::memkit::detail::with_device(exec.device, [&] {
        detail::device_fused(exec, x, [&](std::int64_t first, std::int64_t) { return w.data() + first * dims.H; },
                             dims.V, targets, d_loss, loss, d_hidden, d_head, options, dims, workspace);
        return 0;
      });
    }
#endif
  }
}
// The mean (or per-token losses without gradients): no d_loss.
template <executor E, class Hidden, class Head>
  requires float_storage<std::remove_const_t<Hidden>> && float_storage<std::remove_const_t<Head>>
void fused_linear_cross_entropy(const E& exec, tensor_view<Hidden> hidden, tensor_view<Head> head,
                                tensor_view<const std::int32_t> targets, tensor_view<float> loss,
                                tensor_view<std::remove_const_t<Hidden>> d_hidden, tensor_view<float> d_head,
                                const cross_entropy_options& options, memory_resource& workspace) {
  fused_linear_cross_entropy(exec, hidden, head, targets, tensor_view<const float>::none(), loss, d_hidden, d_head,
                             options, workspace);
}

// The same with a frozen, quantized head: it is dequantized a tile of rows at a time (head_tile_rows rows;
// fp32 on the host, hidden's type on CUDA) and gets no gradient, so `d_head` must be none().
template <executor E, class Hidden, quant::format F>
  requires float_storage<std::remove_const_t<Hidden>>
void fused_linear_cross_entropy(const E& exec, tensor_view<Hidden> hidden, const quant::quantized_tensor<F>& head,
                                tensor_view<const std::int32_t> targets, tensor_view<const float> d_loss,
                                tensor_view<float> loss, tensor_view<std::remove_const_t<Hidden>> d_hidden,
                                tensor_view<float> d_head, const cross_entropy_options& options,
                                memory_resource& workspace) {
  using T = std::remove_const_t<Hidden>;
  constexpr const char* operation = "loss::fused_linear_cross_entropy";
  const tensor_view<const T> x = hidden;
  const detail::loss_dims dims =
      detail::check_arguments(operation, x, head.logical_shape(), targets, d_loss, loss, d_hidden, d_head, options);
  require(d_head.is_none(), std::string(operation) + ": a quantized head is frozen; pass tensor_view<float>::none() as `d_head`");
  detail::check_access(exec, operation, x, targets, d_loss, loss, d_hidden, d_head);
  require_accessible(exec, head.codes(), operation, "head");
  if (dims.N == 0) return detail::zero_loss<T>(exec, loss);
  const std::int64_t tile = detail::head_tile_rows(dims.V, dims.H);
  if constexpr (!E::on_device) {
    buffer<float> tile_buffer(workspace, shape{tile * dims.H});
    buffer<float> accumulator;
    if (!std::is_same_v<T, float> && !d_hidden.is_none() && tile < dims.V)
      accumulator = buffer<float>(workspace, shape{chunk_tokens(dims.N, dims.V, sizeof(T), options) * dims.H});
    const detail::quantized_head_source<F> source{&head, dims.V, dims.H, tile_buffer.data()};
    detail::host_check_values(operation, x, source, targets, d_loss, options, dims);
    detail::host_fused(x, source, targets, d_loss, loss, d_hidden, d_head, options, dims, accumulator.data(),
                       workspace);
  } else {
#if MEMKIT_HAS_CUDA
    require(dims.V <= 2147483647 && dims.H <= 2147483647, std::string(operation) + ": vocab and hidden must fit cuBLAS's int");
    ::memkit::detail::with_device(exec.device, [&] {
      buffer<T> tile_buffer(workspace, shape{tile * dims.H}, on_stream{exec.stream});
      detail::device_fused(
          exec, x,
          [&](std::int64_t first, std::int64_t count) -> const T* {
            head.dequantize_rows(exec, first, tile_buffer.view().flat_slice(0, count * dims.H));
            return tile_buffer.data();
          },
          tile, targets, d_loss, loss, d_hidden, d_head, options, dims, workspace);
      return 0;
    });
#endif
  }
}
// The same without d_loss (the mean, or per-token losses without gradients).
template <executor E, class Hidden, quant::format F>
  requires float_storage<std::remove_const_t<Hidden>>
void fused_linear_cross_entropy(const E& exec, tensor_view<Hidden> hidden, const quant::quantized_tensor<F>& head,
                                tensor_view<const std::int32_t> targets, tensor_view<float> loss,
                                tensor_view<std::remove_const_t<Hidden>> d_hidden, tensor_view<float> d_head,
                                const cross_entropy_options& options, memory_resource& workspace) {
  fused_linear_cross_entropy(exec, hidden, head, targets, tensor_view<const float>::none(), loss, d_hidden, d_head,
                             options, workspace);
}

}  // namespace loss

MEMKIT_NAMESPACE_END
