// examples/llama/plain_attention.hpp — a plain causal grouped-query attention for the example, used until
// memkit's attention component (memkit/attention/flash_attention.hpp, issue #12) is on main.
//
// NOT memkit's component: a straightforward host loop with the component's interface (TEAM.md's contract):
// q [B, Hq, S, D], k and v [B, Hkv, S, D], out [B, Hq, S, D], lse fp32 [B, Hq, S]. Forward keeps only out
// and the per-row log-sum-exp; backward recomputes each row's probabilities from them. The example prints
// which attention it ran.
#pragma once

#include <memkit/core/execution.hpp>
#include <memkit/core/float16.hpp>
#include <memkit/core/host_threads.hpp>
#include <memkit/core/tensor_view.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace llama::plain_attention {

inline constexpr const char* description = "plain causal GQA attention in examples/llama/plain_attention.hpp (stand-in)";

struct attention_options {
  bool causal = true;
  std::int64_t window = 0;
  float scale = 0;
  int host_threads = 0;
};

// Which of run_in_parts' ranges starts at `first` (its bounds are count * part / parts).
inline std::int64_t part_starting_at(std::int64_t first, std::int64_t count, int parts) {
  for (std::int64_t part = 0; part < parts; ++part)
    if (count * part / parts == first) return part;
  return 0;
}

// Per part (one per thread): fp32 copies of one kv head's K (transposed, [D, S]) and V, and row buffers
// (forward); and of V transposed, K, their fp32 gradients and row buffers (backward). The copies make the
// inner loops contiguous fp32 multiply-adds, which the compiler vectorizes.
constexpr std::int64_t forward_part_floats(std::int64_t S, std::int64_t D) { return 2 * S * D + S + 2 * D; }
constexpr std::int64_t backward_part_floats(std::int64_t S, std::int64_t D) { return 5 * S * D + 3 * S + 3 * D; }
constexpr std::int64_t parts_for(std::int64_t groups, const attention_options& o) {
  return o.host_threads > 0 ? (groups < o.host_threads ? groups : o.host_threads) : 1;
}
constexpr std::size_t forward_workspace_bytes(std::int64_t B, std::int64_t Hq, std::int64_t Hkv, std::int64_t S,
                                              std::int64_t D, std::size_t, const attention_options& o) {
  (void)Hq;
  return static_cast<std::size_t>(parts_for(B * Hkv, o) * forward_part_floats(S, D)) * sizeof(float);
}
constexpr std::size_t backward_workspace_bytes(std::int64_t B, std::int64_t Hq, std::int64_t Hkv, std::int64_t S,
                                               std::int64_t D, std::size_t, const attention_options& o) {
  (void)Hq;
  return static_cast<std::size_t>(parts_for(B * Hkv, o) * backward_part_floats(S, D)) * sizeof(float);
}

namespace detail {
template <class T>
float f(T v) {
  return memkit::to_float(v);
}
inline void check_options(const attention_options& o) {
  memkit::require(o.host_threads > 0, "plain_attention: give host_threads > 0 (the workspace depends on it)");
  memkit::require(o.causal && o.window == 0, "plain_attention: only causal attention without a window");
}
// out[S, D] = in[S, D] as fp32; transposed: out[D, S].
template <class T>
void widen(const T* in, float* out, std::int64_t S, std::int64_t D, bool transposed) {
  for (std::int64_t j = 0; j < S; ++j)
    for (std::int64_t d = 0; d < D; ++d) (transposed ? out[d * S + j] : out[j * D + d]) = f(in[j * D + d]);
}
}  // namespace detail

template <class T>
void forward(const memkit::host_executor&, memkit::tensor_view<const T> q, memkit::tensor_view<const T> k,
             memkit::tensor_view<const T> v, memkit::tensor_view<T> out, memkit::tensor_view<float> lse,
             const attention_options& o, memkit::memory_resource& workspace) {
  detail::check_options(o);
  const std::int64_t B = q.shape()[0], Hq = q.shape()[1], S = q.shape()[2], D = q.shape()[3], Hkv = k.shape()[1];
  memkit::require(Hq % Hkv == 0, "plain_attention: kv heads must divide the query heads");
  const float scale = o.scale != 0 ? o.scale : 1.0f / std::sqrt(static_cast<float>(D));
  const int parts = static_cast<int>(parts_for(B * Hkv, o));
  memkit::buffer<float> scratch(workspace, memkit::shape{static_cast<std::int64_t>(
                                               forward_workspace_bytes(B, Hq, Hkv, S, D, sizeof(T), o) / sizeof(float))});
  memkit::detail::run_in_parts(parts, B * Hkv, [&](std::int64_t first, std::int64_t last) {
    float* kt = scratch.data() + part_starting_at(first, B * Hkv, parts) * forward_part_floats(S, D);
    float* vf = kt + S * D;
    float* p = vf + S * D;
    float* acc = p + S;
    float* qi = acc + D;
    for (std::int64_t g = first; g < last; ++g) {
      const std::int64_t b = g / Hkv, kh = g % Hkv;
      detail::widen(k.data() + (b * Hkv + kh) * S * D, kt, S, D, true);
      detail::widen(v.data() + (b * Hkv + kh) * S * D, vf, S, D, false);
      for (std::int64_t h = kh * (Hq / Hkv); h < (kh + 1) * (Hq / Hkv); ++h) {
        const T* Q = q.data() + (b * Hq + h) * S * D;
        T* O = out.data() + (b * Hq + h) * S * D;
        for (std::int64_t i = 0; i < S; ++i) {
          for (std::int64_t d = 0; d < D; ++d) qi[d] = detail::f(Q[i * D + d]) * scale;
          for (std::int64_t j = 0; j <= i; ++j) p[j] = 0.0f;
          for (std::int64_t d = 0; d < D; ++d) {
            const float qd = qi[d];
            const float* krow = kt + d * S;
            for (std::int64_t j = 0; j <= i; ++j) p[j] += qd * krow[j];
          }
          float m = p[0];
          for (std::int64_t j = 1; j <= i; ++j) m = p[j] > m ? p[j] : m;
          float sum = 0.0f;
          for (std::int64_t j = 0; j <= i; ++j) {
            p[j] = std::exp(p[j] - m);
            sum += p[j];
          }
          for (std::int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
          for (std::int64_t j = 0; j <= i; ++j) {
            const float pj = p[j];
            const float* vrow = vf + j * D;
            for (std::int64_t d = 0; d < D; ++d) acc[d] += pj * vrow[d];
          }
          const float inv = 1.0f / sum;
          for (std::int64_t d = 0; d < D; ++d) O[i * D + d] = memkit::from_float<T>(acc[d] * inv);
          lse[(b * Hq + h) * S + i] = m + std::log(sum);
        }
      }
    }
  });
}

// dq, dk, dv are overwritten. P_ij = exp(s_ij - lse_i); dS_ij = P_ij (dout_i . v_j - dout_i . out_i).
template <class T>
void backward(const memkit::host_executor&, memkit::tensor_view<const T> q, memkit::tensor_view<const T> k,
              memkit::tensor_view<const T> v, memkit::tensor_view<const T> out, memkit::tensor_view<const float> lse,
              memkit::tensor_view<const T> dout, memkit::tensor_view<T> dq, memkit::tensor_view<T> dk,
              memkit::tensor_view<T> dv, const attention_options& o, memkit::memory_resource& workspace) {
  detail::check_options(o);
  const std::int64_t B = q.shape()[0], Hq = q.shape()[1], S = q.shape()[2], D = q.shape()[3], Hkv = k.shape()[1];
  const float scale = o.scale != 0 ? o.scale : 1.0f / std::sqrt(static_cast<float>(D));
  const int parts = static_cast<int>(parts_for(B * Hkv, o));
  memkit::buffer<float> scratch(workspace, memkit::shape{static_cast<std::int64_t>(
                                               backward_workspace_bytes(B, Hq, Hkv, S, D, sizeof(T), o) / sizeof(float))});
  memkit::detail::run_in_parts(parts, B * Hkv, [&](std::int64_t first, std::int64_t last) {
    float* kt = scratch.data() + part_starting_at(first, B * Hkv, parts) * backward_part_floats(S, D);
    float* vt = kt + S * D;
    float* kf = vt + S * D;
    float* dK = kf + S * D;
    float* dV = dK + S * D;
    float* p = dV + S * D;
    float* dp = p + S;
    float* t = dp + S;
    float* qi = t + S;
    float* doi = qi + D;
    float* dQ = doi + D;
    for (std::int64_t g = first; g < last; ++g) {
      const std::int64_t b = g / Hkv, kh = g % Hkv;
      const T* K = k.data() + (b * Hkv + kh) * S * D;
      detail::widen(K, kt, S, D, true);
      detail::widen(K, kf, S, D, false);
      detail::widen(v.data() + (b * Hkv + kh) * S * D, vt, S, D, true);
      for (std::int64_t e = 0; e < 2 * S * D; ++e) dK[e] = 0.0f;
      for (std::int64_t h = kh * (Hq / Hkv); h < (kh + 1) * (Hq / Hkv); ++h) {
        const T* Q = q.data() + (b * Hq + h) * S * D;
        const T* O = out.data() + (b * Hq + h) * S * D;
        const T* dO = dout.data() + (b * Hq + h) * S * D;
        T* dQo = dq.data() + (b * Hq + h) * S * D;
        for (std::int64_t i = 0; i < S; ++i) {
          const float l = lse[(b * Hq + h) * S + i];
          float delta = 0.0f;
          for (std::int64_t d = 0; d < D; ++d) {
            qi[d] = detail::f(Q[i * D + d]);
            doi[d] = detail::f(dO[i * D + d]);
            delta += doi[d] * detail::f(O[i * D + d]);
            dQ[d] = 0.0f;
          }
          for (std::int64_t j = 0; j <= i; ++j) p[j] = t[j] = 0.0f;
          for (std::int64_t d = 0; d < D; ++d) {
            const float qd = qi[d] * scale, dod = doi[d];
            const float* krow = kt + d * S;
            const float* vrow = vt + d * S;
            for (std::int64_t j = 0; j <= i; ++j) {
              p[j] += qd * krow[j];
              t[j] += dod * vrow[j];
            }
          }
          for (std::int64_t j = 0; j <= i; ++j) {
            p[j] = std::exp(p[j] - l);
            dp[j] = p[j] * (t[j] - delta) * scale;  // dS_ij, with the score's scale folded in
          }
          for (std::int64_t j = 0; j <= i; ++j) {
            const float dpj = dp[j], pj = p[j];
            const float* krow = kf + j * D;
            float* dkrow = dK + j * D;
            float* dvrow = dV + j * D;
            for (std::int64_t d = 0; d < D; ++d) {
              dQ[d] += dpj * krow[d];
              dkrow[d] += dpj * qi[d];
              dvrow[d] += pj * doi[d];
            }
          }
          for (std::int64_t d = 0; d < D; ++d) dQo[i * D + d] = memkit::from_float<T>(dQ[d]);
        }
      }
      T* dKo = dk.data() + (b * Hkv + kh) * S * D;
      T* dVo = dv.data() + (b * Hkv + kh) * S * D;
      for (std::int64_t e = 0; e < S * D; ++e) {
        dKo[e] = memkit::from_float<T>(dK[e]);
        dVo[e] = memkit::from_float<T>(dV[e]);
      }
    }
  });
}

}  // namespace llama::plain_attention

namespace llama {
// The attention a decoder_block calls: the example's stand-in.
struct plain_attention_policy {
  using options = plain_attention::attention_options;
  static constexpr const char* description = plain_attention::description;
  static constexpr std::size_t forward_workspace_bytes(std::int64_t B, std::int64_t Hq, std::int64_t Hkv,
                                                       std::int64_t S, std::int64_t D, std::size_t e, const options& o) {
    return plain_attention::forward_workspace_bytes(B, Hq, Hkv, S, D, e, o);
  }
  static constexpr std::size_t backward_workspace_bytes(std::int64_t B, std::int64_t Hq, std::int64_t Hkv,
                                                        std::int64_t S, std::int64_t D, std::size_t e, const options& o) {
    return plain_attention::backward_workspace_bytes(B, Hq, Hkv, S, D, e, o);
  }
  template <class... Args>
  static void forward(Args&&... args) {
    plain_attention::forward(std::forward<Args>(args)...);
  }
  template <class... Args>
  static void backward(Args&&... args) {
    plain_attention::backward(std::forward<Args>(args)...);
  }
};
}  // namespace llama
