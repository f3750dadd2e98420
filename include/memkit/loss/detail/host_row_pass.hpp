// memkit/loss/detail/host_row_pass.hpp — the host's softmax and gradient of one token's row of logits, in
// three builds (portable C++, AVX2, AVX-512) that give the same bits; host_row picks one at run time.
// Not a public header: fused_linear_cross_entropy.hpp includes it (through host_fused.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "memkit/config.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/loss/detail/common.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace loss::detail {

// --- The host row pass. The two exp passes and the gradient run 16 lanes wide: AVX-512 (one register), AVX2
//     (two) or portable C++ (an array), with the same operations in the same order, so every instruction set
//     gives the same bits. exp(x) = 2^n * e^r with n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts)
//     and e^r by its degree-7 Taylor polynomial (|r| <= ln 2 / 2: error below 1e-8 relative); arguments are
//     <= 0 here and are clamped at -87 (e^-87 ~ 1.6e-38, the smallest normal floats). ---
struct fast_exp {
  static constexpr float lower = -87.0f, log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
  static constexpr float taylor[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  static float scalar(float x) noexcept {
    x = std::max(x, lower);
    const float n = std::nearbyint(x * log2e);
    float r = std::fma(n, -ln2_hi, x);
    r = std::fma(n, -ln2_lo, r);
    float p = taylor[0];
    for (int k = 1; k < 8; ++k) p = std::fma(p, r, taylor[k]);
    const std::uint32_t bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
  }
};

// The gradient of one logit from its capped value z: (e^(z - lse) * a - b) [* (1 - (z / cap)^2)], where
// a = (1 + 2 z_loss lse) * scale and b = eps / V * scale; the target's extra -(1 - eps) * scale comes after.
struct row_gradient_terms {
  float lse, a, b, softcap;
};

inline float sum_lanes(const float* lanes) noexcept {
  float total = 0;
  for (int k = 0; k < 16; ++k) total += lanes[k];
  return total;
}

struct row_pass_portable {
  // Largest value and the 16-lane sum of the row.
  static void max_and_sum(const float* z, std::int64_t V, float& largest, float& total) noexcept {
    float lanes[16] = {};
    float m = -std::numeric_limits<float>::infinity();
    for (std::int64_t j = 0; j < V; ++j) {
      m = std::max(m, z[j]);
      lanes[j % 16] += z[j];
    }
    largest = m;
    total = sum_lanes(lanes);
  }
  static float exp_sum(const float* z, std::int64_t V, float shift) noexcept {
    float lanes[16] = {};
    for (std::int64_t j = 0; j < V; ++j) lanes[j % 16] += fast_exp::scalar(z[j] - shift);
    return sum_lanes(lanes);
  }
  static void gradient(float* z, std::int64_t V, const row_gradient_terms& t) noexcept {
    for (std::int64_t j = 0; j < V; ++j) {
      float g = std::fma(fast_exp::scalar(z[j] - t.lse), t.a, -t.b);
      if (t.softcap > 0) {
        const float u = z[j] / t.softcap;
        g *= std::fma(-u, u, 1.0f);
      }
      z[j] = g;
    }
  }
};

// row_pass_avx512 and row_pass_avx2 are one algorithm written twice on purpose (and once more as
// row_pass_portable): their intrinsics take different register types (one __m512 against two __m256), different
// tail masks (__mmask16 against blend vectors) and different target attributes, so one template body could only
// be shared through a vector-abstraction layer this header does not have. A change to one must be made to all
// three; the loss tests check that every instruction set gives the same bits.
#if MEMKIT_X86_DISPATCH
struct row_pass_avx512 {
  // The zero-masked forms: GCC 12 warns about the unmasked ones' undefined pass-through operand.
  __attribute__((target("avx512f"))) static __m512 exp(__m512 x) noexcept {
    x = _mm512_maskz_max_ps(0xffff, x, _mm512_set1_ps(fast_exp::lower));
    const __m512 n = _mm512_maskz_roundscale_ps(0xffff, _mm512_mul_ps(x, _mm512_set1_ps(fast_exp::log2e)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-fast_exp::ln2_hi), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-fast_exp::ln2_lo), r);
    __m512 p = _mm512_set1_ps(fast_exp::taylor[0]);
    for (int k = 1; k < 8; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(fast_exp::taylor[k]));
    const __m512i bits = _mm512_maskz_slli_epi32(
        0xffff, _mm512_add_epi32(_mm512_maskz_cvtps_epi32(0xffff, n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  }
  static __mmask16 tail_mask(std::int64_t count) noexcept { return static_cast<__mmask16>((1u << count) - 1u); }
  __attribute__((target("avx512f"))) static void max_and_sum(const float* z, std::int64_t V, float& largest,
                                                             float& total) noexcept {
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s = _mm512_setzero_ps();
    std::int64_t j = 0;
    for (; j + 16 <= V; j += 16) {
      const __m512 v = _mm512_loadu_ps(z + j);
      m = _mm512_maskz_max_ps(0xffff, m, v);
      s = _mm512_add_ps(s, v);
    }
    if (j < V) {
      const __mmask16 k = tail_mask(V - j);
      const __m512 v = _mm512_maskz_loadu_ps(k, z + j);
      m = _mm512_mask_max_ps(m, k, m, v);
      s = _mm512_mask_add_ps(s, k, s, v);
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, m);
    largest = lanes[0];
    for (int i = 1; i < 16; ++i) largest = std::max(largest, lanes[i]);
    _mm512_store_ps(lanes, s);
    total = sum_lanes(lanes);
  }
  __attribute__((target("avx512f"))) static float exp_sum(const float* z, std::int64_t V, float shift) noexcept {
    const __m512 c = _mm512_set1_ps(shift);
    __m512 s = _mm512_setzero_ps();
    std::int64_t j = 0;
    for (; j + 16 <= V; j += 16) s = _mm512_add_ps(s, exp(_mm512_sub_ps(_mm512_loadu_ps(z + j), c)));
    if (j < V) {
      const __mmask16 k = tail_mask(V - j);
      s = _mm512_mask_add_ps(s, k, s, exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, z + j), c)));
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, s);
    return sum_lanes(lanes);
  }
  __attribute__((target("avx512f"))) static __m512 gradient_of(__m512 v, const row_gradient_terms& t) noexcept {
    __m512 g = _mm512_fmadd_ps(exp(_mm512_sub_ps(v, _mm512_set1_ps(t.lse))), _mm512_set1_ps(t.a), _mm512_set1_ps(-t.b));
    if (t.softcap > 0) {
      const __m512 u = _mm512_div_ps(v, _mm512_set1_ps(t.softcap));
      g = _mm512_mul_ps(g, _mm512_fnmadd_ps(u, u, _mm512_set1_ps(1.0f)));
    }
    return g;
  }
  __attribute__((target("avx512f"))) static void gradient(float* z, std::int64_t V, const row_gradient_terms& t) noexcept {
    std::int64_t j = 0;
    for (; j + 16 <= V; j += 16) _mm512_storeu_ps(z + j, gradient_of(_mm512_loadu_ps(z + j), t));
    if (j < V) {
      const __mmask16 k = tail_mask(V - j);
      _mm512_mask_storeu_ps(z + j, k, gradient_of(_mm512_maskz_loadu_ps(k, z + j), t));
    }
  }
};

struct row_pass_avx2 {
  __attribute__((target("avx2,fma"))) static __m256 exp(__m256 x) noexcept {
    x = _mm256_max_ps(x, _mm256_set1_ps(fast_exp::lower));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(fast_exp::log2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-fast_exp::ln2_hi), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-fast_exp::ln2_lo), r);
    __m256 p = _mm256_set1_ps(fast_exp::taylor[0]);
    for (int k = 1; k < 8; ++k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(fast_exp::taylor[k]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
  // Lanes [first, first + 8) of a 16-lane tail holding `count` values: all ones for the lanes that exist.
  __attribute__((target("avx2,fma"))) static __m256i tail_mask(std::int64_t count, int first) noexcept {
    const __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first));
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lane);
  }
  __attribute__((target("avx2,fma"))) static void max_and_sum(const float* z, std::int64_t V, float& largest,
                                                              float& total) noexcept {
    const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 m0 = lowest, m1 = lowest, s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    std::int64_t j = 0;
    for (; j + 16 <= V; j += 16) {
      const __m256 v0 = _mm256_loadu_ps(z + j), v1 = _mm256_loadu_ps(z + j + 8);
      m0 = _mm256_max_ps(m0, v0);
      m1 = _mm256_max_ps(m1, v1);
      s0 = _mm256_add_ps(s0, v0);
      s1 = _mm256_add_ps(s1, v1);
    }
    if (j < V) {
      const __m256i k0 = tail_mask(V - j, 0), k1 = tail_mask(V - j, 8);
      const __m256 v0 = _mm256_maskload_ps(z + j, k0), v1 = _mm256_maskload_ps(z + j + 8, k1);
      m0 = _mm256_blendv_ps(m0, _mm256_max_ps(m0, v0), _mm256_castsi256_ps(k0));
      m1 = _mm256_blendv_ps(m1, _mm256_max_ps(m1, v1), _mm256_castsi256_ps(k1));
      s0 = _mm256_blendv_ps(s0, _mm256_add_ps(s0, v0), _mm256_castsi256_ps(k0));
      s1 = _mm256_blendv_ps(s1, _mm256_add_ps(s1, v1), _mm256_castsi256_ps(k1));
    }
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, m0);
    _mm256_store_ps(lanes + 8, m1);
    largest = lanes[0];
    for (int i = 1; i < 16; ++i) largest = std::max(largest, lanes[i]);
    _mm256_store_ps(lanes, s0);
    _mm256_store_ps(lanes + 8, s1);
    total = sum_lanes(lanes);
  }
  __attribute__((target("avx2,fma"))) static float exp_sum(const float* z, std::int64_t V, float shift) noexcept {
    const __m256 c = _mm256_set1_ps(shift);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    std::int64_t j = 0;
    for (; j + 16 <= V; j += 16) {
      s0 = _mm256_add_ps(s0, exp(_mm256_sub_ps(_mm256_loadu_ps(z + j), c)));
      s1 = _mm256_add_ps(s1, exp(_mm256_sub_ps(_mm256_loadu_ps(z + j + 8), c)));
    }
    if (j < V) {
      const __m256i k0 = tail_mask(V - j, 0), k1 = tail_mask(V - j, 8);
      const __m256 e0 = exp(_mm256_sub_ps(_mm256_maskload_ps(z + j, k0), c));
      const __m256 e1 = exp(_mm256_sub_ps(_mm256_maskload_ps(z + j + 8, k1), c));
      s0 = _mm256_blendv_ps(s0, _mm256_add_ps(s0, e0), _mm256_castsi256_ps(k0));
      s1 = _mm256_blendv_ps(s1, _mm256_add_ps(s1, e1), _mm256_castsi256_ps(k1));
    }
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, s0);
    _mm256_store_ps(lanes + 8, s1);
    return sum_lanes(lanes);
  }
  __attribute__((target("avx2,fma"))) static __m256 gradient_of(__m256 v, const row_gradient_terms& t) noexcept {
    __m256 g = _mm256_fmadd_ps(exp(_mm256_sub_ps(v, _mm256_set1_ps(t.lse))), _mm256_set1_ps(t.a), _mm256_set1_ps(-t.b));
    if (t.softcap > 0) {
      const __m256 u = _mm256_div_ps(v, _mm256_set1_ps(t.softcap));
      g = _mm256_mul_ps(g, _mm256_fnmadd_ps(u, u, _mm256_set1_ps(1.0f)));
    }
    return g;
  }
  __attribute__((target("avx2,fma"))) static void gradient(float* z, std::int64_t V, const row_gradient_terms& t) noexcept {
    std::int64_t j = 0;
    for (; j + 8 <= V; j += 8) _mm256_storeu_ps(z + j, gradient_of(_mm256_loadu_ps(z + j), t));
    if (j < V) {
      const __m256i k = tail_mask(V - j, 0);
      _mm256_maskstore_ps(z + j, k, gradient_of(_mm256_maskload_ps(z + j, k), t));
    }
  }
};
#endif

// One token's row on the host: raw logits in, their gradient (times `scale`) out, in place; returns loss_i.
template <class Pass>
float host_row_with(const row_math& math, float* z, std::int64_t V, std::int32_t target, float scale) {
  if (math.softcap > 0)
    for (std::int64_t j = 0; j < V; ++j) z[j] = math.capped(z[j]);
  float largest = 0, z_sum = 0;
  Pass::max_and_sum(z, V, largest, z_sum);
  const float lse = largest + std::log(Pass::exp_sum(z, V, largest));
  const float z_target = z[target];
  const float loss = math.token_loss(lse, z_target, z_sum);
  const row_gradient_terms terms{lse, (1.0f + 2.0f * math.z_loss * lse) * scale,
                                 math.smoothing / static_cast<float>(math.vocab) * scale, math.softcap};
  Pass::gradient(z, V, terms);
  // The target's own term, the same scalar operations on every instruction set.
  float g = std::fma(fast_exp::scalar(z_target - lse), terms.a, -terms.b) - (1.0f - math.smoothing) * scale;
  if (math.softcap > 0) {
    const float u = z_target / math.softcap;
    g *= std::fma(-u, u, 1.0f);
  }
  z[target] = g;
  return loss;
}

inline float host_row(const row_math& math, float* z, std::int64_t V, std::int32_t target, float scale) {
#if MEMKIT_X86_DISPATCH
  switch (host_isa_in_use()) {
    case host_isa::avx512: return host_row_with<row_pass_avx512>(math, z, V, target, scale);
    case host_isa::avx2: return host_row_with<row_pass_avx2>(math, z, V, target, scale);
    case host_isa::portable: break;
  }
#endif
  return host_row_with<row_pass_portable>(math, z, V, target, scale);
}

}  // namespace loss::detail
MEMKIT_NAMESPACE_END
