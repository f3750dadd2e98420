// A plain materialized attention for the attention tests (never part of memkit): the full score matrix of each
// head, in the accumulation type Acc (double for accuracy checks, float to measure what materializing costs).
// Its two [B, Hq, S, S] matrices (probabilities, then the scores' gradient) come from `resource`, so a
// tracking_resource sees what an eager attention holds.
#pragma once

#include <memkit/attention/flash_attention.hpp>
#include <memkit/memory/buffer.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace memkit_test {

struct attention_shape {
  std::int64_t B, Hq, Hkv, S, D;
  std::int64_t q_elems() const { return B * Hq * S * D; }
  std::int64_t kv_elems() const { return B * Hkv * S * D; }
};

inline bool visible(std::int64_t i, std::int64_t j, const memkit::attention::attention_options& o) {
  if (o.causal && j > i) return false;
  if (o.window > 0 && (i - j >= o.window || j - i >= o.window)) return false;
  return true;
}

template <class Acc>
struct materialized_attention {
  attention_shape s;
  memkit::attention::attention_options o;
  memkit::buffer<Acc> probabilities;  // saved by forward
  std::vector<Acc> out, lse;

  Acc scale() const { return o.scale > 0 ? Acc(o.scale) : Acc(1) / std::sqrt(Acc(s.D)); }

  void forward(const std::vector<Acc>& q, const std::vector<Acc>& k, const std::vector<Acc>& v,
               memkit::memory_resource& resource) {
    const std::int64_t S = s.S, D = s.D, group = s.Hq / s.Hkv;
    probabilities = memkit::buffer<Acc>(resource, memkit::shape{s.B, s.Hq, S, S});
    out.assign(static_cast<std::size_t>(s.q_elems()), Acc(0));
    lse.assign(static_cast<std::size_t>(s.B * s.Hq * S), Acc(0));
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t h = 0; h < s.Hq; ++h) {
        const std::int64_t bh = b * s.Hq + h, bkv = b * s.Hkv + h / group;
        for (std::int64_t i = 0; i < S; ++i) {
          Acc* row = probabilities.data() + (bh * S + i) * S;
          Acc max = -std::numeric_limits<Acc>::infinity();
          for (std::int64_t j = 0; j < S; ++j) {
            Acc dot = 0;
            if (visible(i, j, o))
              for (std::int64_t d = 0; d < D; ++d) dot += q[(bh * S + i) * D + d] * k[(bkv * S + j) * D + d];
            row[j] = visible(i, j, o) ? dot * scale() : -std::numeric_limits<Acc>::infinity();
            if (row[j] > max) max = row[j];
          }
          Acc sum = 0;
          for (std::int64_t j = 0; j < S; ++j) sum += (row[j] = visible(i, j, o) ? std::exp(row[j] - max) : Acc(0));
          for (std::int64_t j = 0; j < S; ++j) row[j] /= sum;
          lse[bh * S + i] = max + std::log(sum);
          for (std::int64_t j = 0; j < S; ++j)
            if (row[j] != Acc(0))
              for (std::int64_t d = 0; d < D; ++d) out[(bh * S + i) * D + d] += row[j] * v[(bkv * S + j) * D + d];
        }
      }
  }

  // Gradients given dout; frees the probabilities at the end, as autograd would.
  void backward(const std::vector<Acc>& q, const std::vector<Acc>& k, const std::vector<Acc>& v,
                const std::vector<Acc>& dout, std::vector<Acc>& dq, std::vector<Acc>& dk, std::vector<Acc>& dv,
                memkit::memory_resource& resource) {
    const std::int64_t S = s.S, D = s.D, group = s.Hq / s.Hkv;
    memkit::buffer<Acc> dscores(resource, memkit::shape{s.B, s.Hq, S, S});
    dq.assign(static_cast<std::size_t>(s.q_elems()), Acc(0));
    dk.assign(static_cast<std::size_t>(s.kv_elems()), Acc(0));
    dv.assign(static_cast<std::size_t>(s.kv_elems()), Acc(0));
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t h = 0; h < s.Hq; ++h) {
        const std::int64_t bh = b * s.Hq + h, bkv = b * s.Hkv + h / group;
        for (std::int64_t i = 0; i < S; ++i) {
          const Acc* p = probabilities.data() + (bh * S + i) * S;
          Acc* ds = dscores.data() + (bh * S + i) * S;
          Acc dot_sum = 0;
          for (std::int64_t j = 0; j < S; ++j) {
            Acc dp = 0;
            if (p[j] != Acc(0))
              for (std::int64_t d = 0; d < D; ++d) dp += dout[(bh * S + i) * D + d] * v[(bkv * S + j) * D + d];
            ds[j] = dp;
            dot_sum += p[j] * dp;
          }
          for (std::int64_t j = 0; j < S; ++j) {
            ds[j] = p[j] * (ds[j] - dot_sum) * scale();
            if (p[j] == Acc(0)) continue;
            for (std::int64_t d = 0; d < D; ++d) {
              dv[(bkv * S + j) * D + d] += p[j] * dout[(bh * S + i) * D + d];
              dq[(bh * S + i) * D + d] += ds[j] * k[(bkv * S + j) * D + d];
              dk[(bkv * S + j) * D + d] += ds[j] * q[(bh * S + i) * D + d];
            }
          }
        }
      }
    probabilities = memkit::buffer<Acc>();
  }
};

}  // namespace memkit_test
