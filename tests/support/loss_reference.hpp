// Plain references for memkit::loss (tests and benchmarks only).
//
// naive_cross_entropy: the whole loss in double, straight from the definitions (logits, soft-capping,
// log-softmax, label smoothing, z-loss, the mean over counted tokens) with its gradients written out by hand.
// materialized_cross_entropy: what a training loop without the fused loss does: the fp32 logits of every
// token at once ([N, V] from the workspace resource), softmax, then the two gradient products.
#pragma once

#include <memkit/core/execution.hpp>
#include <memkit/core/float16.hpp>
#include <memkit/core/tensor_view.hpp>
#include <memkit/linalg/gemm.hpp>
#include <memkit/memory/buffer.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace memkit_test {

struct naive_loss_options {
  std::int64_t ignore_index = -100;
  double label_smoothing = 0, logit_softcap = 0, z_loss = 0;
};

struct naive_loss_result {
  double loss = 0;
  std::int64_t counted = 0;
  std::vector<double> d_hidden;  // [N, H]
  std::vector<double> d_head;    // [V, H]
};

// hidden [N, H] and head [V, H] as doubles (already rounded to the types under test).
inline naive_loss_result naive_cross_entropy(const std::vector<double>& hidden, const std::vector<double>& head,
                                             const std::vector<std::int32_t>& targets, std::int64_t N, std::int64_t H,
                                             std::int64_t V, const naive_loss_options& o) {
  naive_loss_result r;
  r.d_hidden.assign(static_cast<std::size_t>(N * H), 0.0);
  r.d_head.assign(static_cast<std::size_t>(V * H), 0.0);
  for (std::int64_t i = 0; i < N; ++i) r.counted += targets[static_cast<std::size_t>(i)] != o.ignore_index;
  if (r.counted == 0) return r;
  std::vector<double> raw(static_cast<std::size_t>(V)), z(raw.size()), g(raw.size());
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int32_t t = targets[static_cast<std::size_t>(i)];
    if (t == o.ignore_index) continue;
    for (std::int64_t j = 0; j < V; ++j) {
      double s = 0;
      for (std::int64_t k = 0; k < H; ++k)
        s += hidden[static_cast<std::size_t>(i * H + k)] * head[static_cast<std::size_t>(j * H + k)];
      raw[static_cast<std::size_t>(j)] = s;
      z[static_cast<std::size_t>(j)] = o.logit_softcap > 0 ? o.logit_softcap * std::tanh(s / o.logit_softcap) : s;
    }
    const double m = *std::max_element(z.begin(), z.end());
    double sum = 0, z_sum = 0;
    for (double v : z) sum += std::exp(v - m), z_sum += v;
    const double lse = m + std::log(sum);
    const double eps = o.label_smoothing;
    r.loss += lse - (1 - eps) * z[static_cast<std::size_t>(t)] - eps / static_cast<double>(V) * z_sum + o.z_loss * lse * lse;
    for (std::int64_t j = 0; j < V; ++j) {
      const double p = std::exp(z[static_cast<std::size_t>(j)] - lse);
      double d = p * (1 + 2 * o.z_loss * lse) - (j == t ? 1 - eps : 0.0) - eps / static_cast<double>(V);
      if (o.logit_softcap > 0) {
        const double th = std::tanh(raw[static_cast<std::size_t>(j)] / o.logit_softcap);
        d *= 1 - th * th;
      }
      g[static_cast<std::size_t>(j)] = d / static_cast<double>(r.counted);
    }
    for (std::int64_t j = 0; j < V; ++j)
      for (std::int64_t k = 0; k < H; ++k) {
        r.d_hidden[static_cast<std::size_t>(i * H + k)] += g[static_cast<std::size_t>(j)] * head[static_cast<std::size_t>(j * H + k)];
        r.d_head[static_cast<std::size_t>(j * H + k)] += g[static_cast<std::size_t>(j)] * hidden[static_cast<std::size_t>(i * H + k)];
      }
  }
  r.loss /= static_cast<double>(r.counted);
  return r;
}

// Plain cross-entropy (no smoothing, soft-capping or z-loss) with all N x V fp32 logits materialized in
// `workspace`. d_hidden is overwritten, d_head accumulated (pass nullptr to skip either). Returns the loss.
template <class T, class W>
float materialized_cross_entropy(const T* hidden, const W* head, const std::int32_t* targets, std::int64_t N,
                                 std::int64_t H, std::int64_t V, T* d_hidden, float* d_head,
                                 memkit::memory_resource& workspace, int host_threads, std::int64_t ignore_index = -100) {
  namespace la = memkit::linalg;
  const memkit::memory_kind h = memkit::memory_kind::host;
  const la::gemm_options g{host_threads};
  memkit::buffer<float> logits(workspace, memkit::shape{N * V});
  la::gemm(memkit::host, la::transpose::no, la::transpose::yes, 1.0f, la::matrix_ref<const T>(hidden, N, H, H, h),
           la::matrix_ref<const W>(head, V, H, H, h), 0.0f, la::matrix_ref<float>(logits.data(), N, V, V, h), workspace, g);
  std::int64_t counted = 0;
  for (std::int64_t i = 0; i < N; ++i) counted += targets[i] != ignore_index;
  const float inv = counted > 0 ? 1.0f / static_cast<float>(counted) : 0.0f;
  double total = 0;
  for (std::int64_t i = 0; i < N; ++i) {
    float* z = logits.data() + i * V;
    if (targets[i] == ignore_index) {
      std::fill(z, z + V, 0.0f);
      continue;
    }
    const float m = *std::max_element(z, z + V);
    float sum = 0;
    for (std::int64_t j = 0; j < V; ++j) sum += std::exp(z[j] - m);
    const float lse = m + std::log(sum);
    total += lse - z[targets[i]];
    for (std::int64_t j = 0; j < V; ++j) z[j] = std::exp(z[j] - lse) * inv;
    z[targets[i]] -= inv;
  }
  if (d_head)
    la::gemm(memkit::host, la::transpose::yes, la::transpose::no, 1.0f,
             la::matrix_ref<const float>(logits.data(), N, V, V, h), la::matrix_ref<const T>(hidden, N, H, H, h), 1.0f,
             la::matrix_ref<float>(d_head, V, H, H, h), workspace, g);
  if (d_hidden)
    la::gemm(memkit::host, la::transpose::no, la::transpose::no, 1.0f,
             la::matrix_ref<const float>(logits.data(), N, V, V, h), la::matrix_ref<const W>(head, V, H, H, h), 0.0f,
             la::matrix_ref<T>(d_hidden, N, H, H, h), workspace, g);
  return counted > 0 ? static_cast<float>(total / static_cast<double>(counted)) : 0.0f;
}

// Exact workspace bytes of materialized_cross_entropy (both gradients).
template <class T, class W>
std::size_t materialized_workspace_bytes(std::int64_t N, std::int64_t H, std::int64_t V, int host_threads) {
  namespace la = memkit::linalg;
  const la::gemm_options g{host_threads};
  return static_cast<std::size_t>(N * V) * 4 + std::max({la::gemm_workspace_bytes<T, W, float>(N, V, H, g),
                                                         la::gemm_workspace_bytes<float, T, float>(V, H, N, g),
                                                         la::gemm_workspace_bytes<float, W, T>(N, H, V, g)});
}

}  // namespace memkit_test
