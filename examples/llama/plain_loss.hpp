// examples/llama/plain_loss.hpp — a plain chunked linear + cross-entropy for the example, used until memkit's
// fused_linear_cross_entropy (memkit/loss/fused_linear_cross_entropy.hpp, issue #12) is on main.
//
// NOT memkit's component: a straightforward host loop with the component's interface (TEAM.md's contract).
// Per chunk of tokens it computes the fp32 logits [chunk, V] with linalg::gemm, their softmax, the mean
// loss, and at once the gradients: d_hidden = dlogits * head, d_head += dlogits^T * hidden. The full
// [tokens, V] logits never exist. The example prints which loss it ran.
#pragma once

#include <memkit/core/execution.hpp>
#include <memkit/core/float16.hpp>
#include <memkit/core/tensor_view.hpp>
#include <memkit/linalg/gemm.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace llama::plain_loss {

inline constexpr const char* description = "plain chunked linear + cross-entropy in examples/llama/plain_loss.hpp (stand-in)";

struct cross_entropy_options {
  std::int64_t ignore_index = -100;
  float label_smoothing = 0;
  float logit_softcap = 0;
  float z_loss = 0;
  std::size_t chunk_bytes = 0;  // fp32 logits per chunk; 0: 1 MiB
  int host_threads = 0;
};

constexpr std::int64_t chunk_rows(std::int64_t N, std::int64_t V, const cross_entropy_options& o) {
  const std::size_t bytes = o.chunk_bytes != 0 ? o.chunk_bytes : (std::size_t{1} << 20);
  std::int64_t rows = static_cast<std::int64_t>(bytes / (static_cast<std::size_t>(V) * 4));
  if (rows < 1) rows = 1;
  return rows < N ? rows : N;
}

// Exact workspace for hidden of H (element type T) and a head of element type W.
template <class T, class W>
constexpr std::size_t workspace_bytes(std::int64_t N, std::int64_t H, std::int64_t V, const cross_entropy_options& o) {
  namespace la = memkit::linalg;
  const std::int64_t c = chunk_rows(N, V, o);
  const la::gemm_options g{o.host_threads > 0 ? o.host_threads : 1};
  const std::size_t gemms = std::max({la::gemm_workspace_bytes<T, W, float>(c, V, H, g),
                                      la::gemm_workspace_bytes<float, W, T>(c, H, V, g),
                                      la::gemm_workspace_bytes<float, T, float>(V, H, c, g)});
  return memkit::buffer<float>::bytes_required(memkit::shape{c * V}) + gemms;
}

template <class T, class W>
void fused_linear_cross_entropy(const memkit::host_executor& exec, memkit::tensor_view<const T> hidden,
                                memkit::tensor_view<const W> head, memkit::tensor_view<const std::int32_t> targets,
                                memkit::tensor_view<float> loss, memkit::tensor_view<T> d_hidden,
                                memkit::tensor_view<float> d_head, const cross_entropy_options& o,
                                memkit::memory_resource& workspace) {
  namespace la = memkit::linalg;
  memkit::require(o.label_smoothing == 0 && o.logit_softcap == 0 && o.z_loss == 0,
                  "plain_loss: label smoothing, soft-capping and z-loss are not implemented in the stand-in");
  const std::int64_t N = hidden.shape()[0], H = hidden.shape()[1], V = head.shape()[0];
  const std::int64_t c = chunk_rows(N, V, o);
  const la::gemm_options g{o.host_threads > 0 ? o.host_threads : 1};
  std::int64_t counted = 0;
  for (std::int64_t i = 0; i < N; ++i) {
    if (targets[i] == o.ignore_index) continue;
    memkit::require(targets[i] >= 0 && targets[i] < V, "plain_loss: target id out of range");
    ++counted;
  }
  memkit::buffer<float> logits(workspace, memkit::shape{c * V});
  double total = 0.0;
  const float inv = counted > 0 ? 1.0f / static_cast<float>(counted) : 0.0f;
  for (std::int64_t first = 0; first < N; first += c) {
    const std::int64_t rows = std::min(c, N - first);
    la::gemm(exec, la::transpose::no, la::transpose::yes, 1.0f,
             la::matrix_ref<const T>(hidden.data() + first * H, rows, H, H, hidden.where()),
             la::matrix_ref<const W>(head.data(), V, H, H, head.where()), 0.0f,
             la::matrix_ref<float>(logits.data(), rows, V, V, memkit::memory_kind::host), workspace, g);
    for (std::int64_t r = 0; r < rows; ++r) {
      float* z = logits.data() + r * V;
      const std::int32_t t = targets[first + r];
      if (t == o.ignore_index) {
        std::fill(z, z + V, 0.0f);
        continue;
      }
      float m = z[0];
      for (std::int64_t j = 1; j < V; ++j) m = std::max(m, z[j]);
      double sum = 0.0;
      for (std::int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(z[j] - m));
      const double lse = m + std::log(sum);
      total += lse - z[t];
      // dlogits = (softmax - onehot) / counted
      for (std::int64_t j = 0; j < V; ++j) z[j] = static_cast<float>(std::exp(z[j] - lse)) * inv;
      z[t] -= inv;
    }
    if (!d_hidden.empty())
      la::gemm(exec, la::transpose::no, la::transpose::no, 1.0f,
               la::matrix_ref<const float>(logits.data(), rows, V, V, memkit::memory_kind::host),
               la::matrix_ref<const W>(head.data(), V, H, H, head.where()), 0.0f,
               la::matrix_ref<T>(d_hidden.data() + first * H, rows, H, H, d_hidden.where()), workspace, g);
    if (!d_head.empty())
      la::gemm(exec, la::transpose::yes, la::transpose::no, 1.0f,
               la::matrix_ref<const float>(logits.data(), rows, V, V, memkit::memory_kind::host),
               la::matrix_ref<const T>(hidden.data() + first * H, rows, H, H, hidden.where()), 1.0f,
               la::matrix_ref<float>(d_head.data(), V, H, H, d_head.where()), workspace, g);
  }
  loss[0] = static_cast<float>(total * inv);
}

}  // namespace llama::plain_loss
