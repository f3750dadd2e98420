// memkit/attention/flash_attention.hpp — memory-efficient scaled-dot-product attention (FlashAttention).
//
// q [B, Hq, S, D], k and v [B, Hkv, S, D] with Hq % Hkv == 0 (grouped-query attention: query head h reads kv head
// h / (Hq / Hkv); k and v are never expanded), out [B, Hq, S, D], lse fp32 [B, Hq, S]. Causal or not, with an
// optional sliding window: query i sees key j when (not causal or j <= i) and (window == 0 or |i - j| < window).
//
// The algorithm: a tile of queries meets the key tiles one at a time, keeping each row's running maximum and
// sum, so the [S, S] scores never exist. Forward saves only out and each row's log-sum-exp; backward
// recomputes the tile scores from them, with delta = rowsum(dout * out). Memory is O(S): the workspace is a few
// tiles per thread plus delta. Backward runs two passes so no two threads ever write the same element: one over
// key tiles (dk, dv: a kv head's tile sums over its whole query-head group) and one over query tiles (dq).
// dq, dk and dv are overwritten, not accumulated.
//
// Every byte is said before it is allocated (attention/bytes.hpp, which memory_budget includes alone):
// workspace_bytes(forward_arguments / backward_arguments) is exactly what forward / backward take from
// `workspace`, saved_bytes(forward_arguments) what a layer keeps for backward, and eager_attention_bytes what a
// materialized attention (scores as an fp32 [B, Hq, S, S] matrix) would hold.
//
// Where the code is: detail/forward_pass.hpp and detail/backward_passes.hpp hold each pass twice, side by side:
// the host routine of one tile (fp32 tiles, K and V transposed so every inner loop is a contiguous multiply-add,
// a vectorizable exp2, compiled for AVX-512, AVX2 and plain x86-64 and chosen at run time by core/host_simd.hpp;
// threads over (batch, head, tile) with core/host_threads.hpp) and, under nvcc, the CUDA kernel of one CTA
// (tensor-core tiles for bf16 / fp16; head_dim <= 128, a multiple of 16 for bf16 / fp16, and 256 on the opt-in mma
// kernels, detail/mma_forward.hpp and detail/mma_backward.hpp). detail/common.hpp holds
// what both share: the masking and exp2 math, the checks and the geometry.
#pragma once

#include <cstdint>
#include <type_traits>

#include "memkit/attention/bytes.hpp"
#include "memkit/attention/detail/backward_passes.hpp"
#include "memkit/attention/detail/common.hpp"
#include "memkit/attention/detail/forward_pass.hpp"
#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace attention {

// out = softmax(scale * q k^T + mask) v per head; lse = the log-sum-exp of each row's scaled scores.
// T is fp32, bf16 or fp16 (lse is always fp32). `exec` is memkit::host or a cuda_executor (enqueued on its
// stream, nothing synchronized). Takes workspace_bytes(forward_arguments{...}) from `workspace` (host: per-thread
// tiles; CUDA: none). Throws memkit::error for bad shapes, options, offsets or memory kinds before touching memory.
// document_offsets: int32 [B, N + 1] (packed documents, above) or none().
template <float_storage T, executor E>
void forward(const E& exec, tensor_view<const std::type_identity_t<T>> q, tensor_view<const std::type_identity_t<T>> k,
             tensor_view<const std::type_identity_t<T>> v, tensor_view<const std::int32_t> document_offsets,
             tensor_view<T> out, tensor_view<float> lse, const attention_options& options, memory_resource& workspace) {
  detail::validate_forward<T>(exec, q, k, v, document_offsets, out, lse, options);
  detail::run_forward<T>(exec, q, k, v, document_offsets, out, lse, options, workspace);
}
// One document per batch row (no offsets).
template <float_storage T, executor E>
void forward(const E& exec, tensor_view<const std::type_identity_t<T>> q, tensor_view<const std::type_identity_t<T>> k,
             tensor_view<const std::type_identity_t<T>> v, tensor_view<T> out, tensor_view<float> lse,
             const attention_options& options, memory_resource& workspace) {
  forward<T>(exec, q, k, v, tensor_view<const std::int32_t>::none(), out, lse, options, workspace);
}

// What backward reads of the forward pass: its inputs q, k, v and its outputs out, lse, and the document offsets
// forward was given (none() when it had none; last, so {q, k, v, out, lse} still names a call without them).
template <class T>
struct forward_tensors {
  tensor_view<const T> q, k, v, out;
  tensor_view<const float> lse;
  tensor_view<const std::int32_t> document_offsets{};
};
// What backward writes: the gradients of q, k and v (overwritten, never accumulated).
template <class T>
struct gradients {
  tensor_view<T> dq, dk, dv;
};

// Gradients of forward's out with respect to q, k and v, given dout: grads.dq, grads.dk, grads.dv are overwritten
// (dk, dv hold the sum over each kv head's query-head group). `saved` is forward's q, k, v, out, lse (and offsets). Takes
// workspace_bytes(backward_arguments{...}) from `workspace`: delta fp32 [B, Hq, S], plus per-thread tiles on the
// host; on CUDA it is allocated stream-ordered on exec.stream. Called as
//   attention::backward<T>(exec, {q, k, v, out, lse}, dout, {dq, dk, dv}, options, workspace);
template <float_storage T, executor E>
void backward(const E& exec, const forward_tensors<std::type_identity_t<T>>& saved,
              tensor_view<const std::type_identity_t<T>> dout, const gradients<std::type_identity_t<T>>& grads,
              const attention_options& options, memory_resource& workspace) {
  detail::validate_backward<T>(exec, saved.q, saved.k, saved.v, saved.document_offsets, saved.out, saved.lse, dout,
                               grads.dq, grads.dk, grads.dv, options);
  detail::run_backward<T>(exec, saved.q, saved.k, saved.v, saved.document_offsets, saved.out, saved.lse, dout,
                          grads.dq, grads.dk, grads.dv, options, workspace);
}

}  // namespace attention
MEMKIT_NAMESPACE_END
