// memkit/attention/cudnn.hpp — attention through cuDNN's fused scaled-dot-product attention (opt-in).
//
// Define MEMKIT_USE_CUDNN (CMake: -DMEMKIT_USE_CUDNN=ON, which finds cuDNN 9 and links libcudnn) and compile with
// nvcc; without both this header declares nothing. memkit::attention::cudnn::forward / backward take the same
// arguments as memkit::attention::forward / backward, save the same tensors (out, and lse = cuDNN's "Stats": the
// natural-log log-sum-exp of each row's scaled scores, fp32 [B, Hq, S]) and write the same gradients, so they are
// drop-in replacements; either direction can run after the other path's forward.
//
// cuDNN runs bf16 / fp16 problems with contiguous 16-byte-aligned tensors, causal or not, with or without a
// sliding window, grouped-query heads (K/V with fewer heads) when its engines accept the graph (cuDNN decides:
// typically head_dim a multiple of 8, at most 128 or 256 by GPU). Anything else runs memkit's built-in kernel
// (attention::forward / backward) and says so once per configuration kind on stderr: fp32, packed documents
// (document_offsets: memkit's [B, N + 1] per-row offsets are not mapped onto cuDNN's per-sequence lengths / ragged
// offsets), unaligned tensors, and graphs cuDNN rejects (no engine from its heuristics, a plan that does not
// finalize). A host executor runs the host path, as attention::forward does.
//
// Bytes: cuDNN says its workspace only once a plan is built on the device, so the byte functions here are run-time
// functions of an executor (not constexpr): workspace_bytes<T>(exec, args) builds (and caches) the plan and returns
// exactly what forward / backward then take from `workspace` — forward: cuDNN's workspace; backward: cuDNN's
// workspace plus softmax_sum fp32 [B, Hq, S] (memkit's delta) and dQ's fp32 accumulator [B, Hq, S, D], each
// rounded up to 256 bytes; on a fallback, the built-in kernel's workspace_bytes. saved_bytes is attention's.
// They assume 16-byte-aligned tensors (memkit's resources give 256-byte-aligned allocations).
//
// NOT RUN ON A GPU YET: this path was written and compiled without a device. cuDNN finalized every tensor and
// operation descriptor of both graphs on the build machine (tests/cudnn/attention_cudnn_test.cu); the operation
// graph, engine selection, plans and execution have not run, and the GPU tests in that file have not either.
#pragma once

#include "memkit/config.hpp"

#if defined(MEMKIT_USE_CUDNN) && MEMKIT_HAS_CUDA
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "memkit/attention/bytes.hpp"
#include "memkit/attention/detail/common.hpp"
#include "memkit/attention/detail/cudnn_graph.hpp"
#include "memkit/attention/flash_attention.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace attention::cudnn {

// Which path a problem takes, and why when it is not cuDNN's.
struct path_choice {
  bool uses_cudnn = false;
  std::string reason;  // empty when uses_cudnn
  std::shared_ptr<const ::memkit::attention::detail::cudnn_sdpa::plan> plan;
};

namespace detail {
using namespace ::memkit::attention::detail::cudnn_sdpa;

inline constexpr std::size_t region_alignment = 256;
constexpr std::size_t round_region(std::size_t bytes) noexcept {
  return (bytes + region_alignment - 1) / region_alignment * region_alignment;
}
// The backward workspace's fixed regions (before cuDNN's own): softmax_sum, then dQ's fp32 accumulator.
constexpr std::size_t softmax_sum_bytes(const problem_arguments& a) noexcept {
  return round_region(static_cast<std::size_t>(a.batch * a.query_heads * a.sequence) * sizeof(float));
}
constexpr std::size_t dq_accum_bytes(const problem_arguments& a) noexcept {
  return round_region(static_cast<std::size_t>(a.batch * a.query_heads * a.sequence * a.head_dim) * sizeof(float));
}

template <class T>
std::string kind_of(bool backward, const problem_arguments& a) {
  const char* type = std::is_same_v<T, bf16> ? "bf16" : std::is_same_v<T, fp16> ? "fp16" : "fp32";
  std::string kind = std::string(backward ? "backward " : "forward ") + type;
  kind += " head_dim " + std::to_string(a.head_dim);
  kind += a.options.causal ? ", causal" : ", not causal";
  if (a.options.window > 0) kind += ", sliding window";
  if (a.kv_heads != a.query_heads) kind += ", grouped-query heads";
  return kind;
}

// The path for a problem on `exec` (builds and caches cuDNN's plan the first time). `packed`: document_offsets
// given; `aligned`: every tensor 16-byte aligned.
template <class T>
path_choice choose(const cuda_executor& exec, const problem_arguments& a, bool backward, bool packed, bool aligned) {
  path_choice choice;
  if constexpr (!std::is_same_v<T, bf16> && !std::is_same_v<T, fp16>) {
    choice.reason = "fp32 (cuDNN's fused attention takes bf16 / fp16)";
    return choice;
  } else {
    if (packed) {
      choice.reason = "packed documents (document_offsets are not mapped onto cuDNN's sequence lengths)";
      return choice;
    }
    if (!aligned) {
      choice.reason = "tensors not 16-byte aligned";
      return choice;
    }
    sdpa_key key;
    key.device = exec.device;
    key.backward = backward;
    key.io = std::is_same_v<T, bf16> ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
    key.batch = a.batch, key.query_heads = a.query_heads, key.kv_heads = a.kv_heads, key.sequence = a.sequence;
    key.head_dim = a.head_dim, key.causal = a.options.causal, key.window = a.options.window;
    choice.plan = plan_cache::instance().get(key);
    choice.uses_cudnn = choice.plan->supported;
    if (!choice.uses_cudnn) choice.reason = choice.plan->reason;
    return choice;
  }
}

inline bool aligned16(std::initializer_list<const void*> pointers) noexcept {
  for (const void* p : pointers)
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  return true;
}

template <class T>
problem_arguments arguments_of(const tensor_view<const T>& q, const tensor_view<const T>& k,
                               const attention_options& options) {
  problem_arguments a;
  a.batch = q.shape()[0], a.query_heads = q.shape()[1], a.sequence = q.shape()[2], a.head_dim = q.shape()[3];
  a.kv_heads = k.shape()[1];
  a.element_bytes = sizeof(T);
  a.on_device = true;
  a.options = options;
  return a;
}

// The variant pack's pointers by tensor id (cuDNN takes void*; inputs are only read).
using bindings = std::vector<std::pair<std::int64_t, void*>>;
template <class T>
bindings forward_bindings(const T* q, const T* k, const T* v, T* out, float* lse) {
  return {{uid_q, const_cast<T*>(q)}, {uid_k, const_cast<T*>(k)}, {uid_v, const_cast<T*>(v)}, {uid_o, out},
          {uid_stats, lse}};
}
template <class T>
bindings backward_bindings(const T* q, const T* k, const T* v, const T* out, const float* lse, const T* dout, T* dq,
                           T* dk, T* dv, void* softmax_sum, void* dq_accum) {
  return {{uid_q, const_cast<T*>(q)},         {uid_k, const_cast<T*>(k)},       {uid_v, const_cast<T*>(v)},
          {uid_o, const_cast<T*>(out)},       {uid_stats, const_cast<float*>(lse)}, {uid_dout, const_cast<T*>(dout)},
          {uid_dq, dq},                       {uid_dk, dk},                     {uid_dv, dv},
          {uid_softmax_sum, softmax_sum},     {uid_dq_accum, dq_accum}};
}

inline void require_matching(const problem_arguments& a, std::size_t element_bytes, const char* who) {
  require(a.on_device, std::string(who) + ": the cuDNN path's byte functions are for device problems (on_device)");
  require(a.element_bytes == element_bytes, std::string(who) + ": arguments' element_bytes (" +
                                                std::to_string(a.element_bytes) + ") is not sizeof(T) (" +
                                                std::to_string(element_bytes) + ")");
}
}  // namespace detail

// The path forward / backward would take for this problem on `exec` (builds cuDNN's plan the first time).
template <float_storage T>
path_choice path_for(const cuda_executor& exec, const problem_arguments& a, bool backward,
                     bool packed_documents = false) {
  return detail::choose<T>(exec, a, backward, packed_documents, true);
}

// Exactly what forward takes from `workspace` on `exec` (builds cuDNN's plan the first time; needs the device).
template <float_storage T>
std::size_t workspace_bytes(const cuda_executor& exec, const forward_arguments& a, bool packed_documents = false) {
  detail::require_matching(a, sizeof(T), "attention::cudnn::workspace_bytes");
  if (attention::detail::no_work(a)) return 0;
  const path_choice choice = detail::choose<T>(exec, a, false, packed_documents, true);
  if (!choice.uses_cudnn) return attention::workspace_bytes(a);
  return detail::round_region(static_cast<std::size_t>(choice.plan->workspace));
}
// Exactly what backward takes from `workspace` on `exec`.
template <float_storage T>
std::size_t workspace_bytes(const cuda_executor& exec, const backward_arguments& a, bool packed_documents = false) {
  detail::require_matching(a, sizeof(T), "attention::cudnn::workspace_bytes");
  if (attention::detail::no_work(a)) return 0;
  const path_choice choice = detail::choose<T>(exec, a, true, packed_documents, true);
  if (!choice.uses_cudnn) return attention::workspace_bytes(a);
  return detail::softmax_sum_bytes(a) + detail::dq_accum_bytes(a) +
         detail::round_region(static_cast<std::size_t>(choice.plan->workspace));
}

// attention::forward through cuDNN (same arguments, same results up to rounding; see above).
template <float_storage T, executor E>
void forward(const E& exec, tensor_view<const std::type_identity_t<T>> q, tensor_view<const std::type_identity_t<T>> k,
             tensor_view<const std::type_identity_t<T>> v, tensor_view<const std::int32_t> document_offsets,
             tensor_view<T> out, tensor_view<float> lse, const attention_options& options, memory_resource& workspace) {
  if constexpr (!std::is_same_v<E, cuda_executor>) {
    attention::forward<T>(exec, q, k, v, document_offsets, out, lse, options, workspace);
  } else {
    attention::detail::validate_forward<T>(exec, q, k, v, document_offsets, out, lse, options);
    const problem_arguments a = detail::arguments_of<T>(q, k, options);
    const path_choice choice =
        detail::choose<T>(exec, a, false, !document_offsets.is_none(),
                          detail::aligned16({q.data(), k.data(), v.data(), out.data(), lse.data()}));
    if (!choice.uses_cudnn) {
      detail::report_fallback_once(detail::kind_of<T>(false, a), choice.reason);
      attention::forward<T>(exec, q, k, v, document_offsets, out, lse, options, workspace);
      return;
    }
    const std::size_t bytes = detail::round_region(static_cast<std::size_t>(choice.plan->workspace));
    buffer<float> scratch;
    if (bytes > 0) {
      scratch = buffer<float>(workspace, shape{static_cast<std::int64_t>(bytes / sizeof(float))},
                              on_stream{exec.stream});
      // As backward: cuDNN would dereference a host workspace on the device.
      require(cuda_executor::can_access(scratch.where()), "attention::cudnn::forward: the workspace resource gives " +
                                                              std::string(to_string(scratch.where())) + " memory");
    }
    detail::execute(choice.plan->key, *choice.plan, exec.stream,
                    detail::forward_bindings(q.data(), k.data(), v.data(), out.data(), lse.data()),
                    attention::detail::resolved_scale(options, a.head_dim), bytes > 0 ? scratch.data() : nullptr);
  }
}
// One document per batch row (no offsets).
template <float_storage T, executor E>
void forward(const E& exec, tensor_view<const std::type_identity_t<T>> q, tensor_view<const std::type_identity_t<T>> k,
             tensor_view<const std::type_identity_t<T>> v, tensor_view<T> out, tensor_view<float> lse,
             const attention_options& options, memory_resource& workspace) {
  cudnn::forward<T>(exec, q, k, v, tensor_view<const std::int32_t>::none(), out, lse, options, workspace);
}

// attention::backward through cuDNN: dq, dk, dv overwritten; `saved` as attention::backward takes it.
template <float_storage T, executor E>
void backward(const E& exec, const forward_tensors<std::type_identity_t<T>>& saved,
              tensor_view<const std::type_identity_t<T>> dout, const gradients<std::type_identity_t<T>>& grads,
              const attention_options& options, memory_resource& workspace) {
  if constexpr (!std::is_same_v<E, cuda_executor>) {
    attention::backward<T>(exec, saved, dout, grads, options, workspace);
  } else {
    attention::detail::validate_backward<T>(exec, saved.q, saved.k, saved.v, saved.document_offsets, saved.out,
                                            saved.lse, dout, grads.dq, grads.dk, grads.dv, options);
    const problem_arguments a = detail::arguments_of<T>(saved.q, saved.k, options);
    const path_choice choice = detail::choose<T>(
        exec, a, true, !saved.document_offsets.is_none(),
        detail::aligned16({saved.q.data(), saved.k.data(), saved.v.data(), saved.out.data(), saved.lse.data(),
                           dout.data(), grads.dq.data(), grads.dk.data(), grads.dv.data()}));
    if (!choice.uses_cudnn) {
      detail::report_fallback_once(detail::kind_of<T>(true, a), choice.reason);
      attention::backward<T>(exec, saved, dout, grads, options, workspace);
      return;
    }
    // One allocation: softmax_sum, dQ's fp32 accumulator, cuDNN's workspace (each 256-byte aligned).
    const std::size_t sum_bytes = detail::softmax_sum_bytes(a), accum_bytes = detail::dq_accum_bytes(a);
    const std::size_t bytes =
        sum_bytes + accum_bytes + detail::round_region(static_cast<std::size_t>(choice.plan->workspace));
    buffer<float> scratch(workspace, shape{static_cast<std::int64_t>(bytes / sizeof(float))}, on_stream{exec.stream});
    require(cuda_executor::can_access(scratch.where()), "attention::cudnn::backward: the workspace resource gives " +
                                                            std::string(to_string(scratch.where())) + " memory");
    auto* base = reinterpret_cast<unsigned char*>(scratch.data());
    void* softmax_sum = base;
    void* dq_accum = base + sum_bytes;
    void* cudnn_workspace = choice.plan->workspace > 0 ? base + sum_bytes + accum_bytes : nullptr;
    // Before cuDNN 9.6 the engines expected dQ's accumulator zeroed (cudnn-frontend cleared it for them).
    if (cudnnGetVersion() < 90600)
      ::memkit::detail::with_device(exec.device, [&] {
        MEMKIT_CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, accum_bytes, exec.stream));
        return 0;
      });
    detail::execute(choice.plan->key, *choice.plan, exec.stream,
                    detail::backward_bindings(saved.q.data(), saved.k.data(), saved.v.data(), saved.out.data(),
                                              saved.lse.data(), dout.data(), grads.dq.data(), grads.dk.data(),
                                              grads.dv.data(), softmax_sum, dq_accum),
                    attention::detail::resolved_scale(options, a.head_dim), cudnn_workspace);
    // `scratch` is released here, stream-ordered on exec.stream (as attention::backward releases its delta).
  }
}

}  // namespace attention::cudnn
MEMKIT_NAMESPACE_END
#endif  // MEMKIT_USE_CUDNN && MEMKIT_HAS_CUDA
