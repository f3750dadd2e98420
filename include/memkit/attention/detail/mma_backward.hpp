// memkit/attention/detail/mma_backward.hpp — backward's query pass (dQ) in FlashAttention-2's structure, for
// attention_kernel::mma: the same tiles and instructions as the mma forward (detail/mma_forward.hpp). The delta
// kernel and the key pass (dK, dV) stay the WMMA ones. Not a public header: backward_passes.hpp includes it.
//
// dQ is accumulated in fp32 registers by the one CTA that owns its query tile, walking the key tiles in order: no
// atomics, so dq is deterministic (bit-identical run to run), at the price of recomputing the scores once more
// than a single fused pass with atomic dQ would (the key pass computes them too) — the trade today's kernels make.
// Same mathematics as the WMMA query pass and the host: P = exp2(scale log2e q.k - lse log2e) on the visible keys,
// dS = P (dP - delta) scale rounded to T, dQ = dS K.
#pragma once

#include <cstdint>
#include <type_traits>

#include "memkit/attention/detail/common.hpp"
#include "memkit/attention/detail/mma_forward.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace attention::detail {

#if MEMKIT_HAS_CUDA

// Shared memory of the mma query pass: Q and dO [rows][D + pad], K and V [2 buffers][cols][D + pad].
MEMKIT_HOST_DEVICE constexpr std::int64_t mma_query_pass_smem_bytes(int D, std::int64_t element_bytes) noexcept {
  return (2 * std::int64_t{mma_tiles::rows} + 4 * mma_tiles::cols) * (D + mma_tiles::pad) * element_bytes;
}

// dQ of one CTA: 64 query rows of one head, 16 per warp, against the key tiles its rows see. Q and dO stay in
// shared memory (their fragments are re-read by ldmatrix per tile, which keeps the registers for dQ, S and dP).
template <class T, int D>
__global__ void __launch_bounds__(mma_tiles::threads)
    mma_query_pass_kernel(cuda_problem p, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                          const float* delta, T* dq) {
  constexpr int R = mma_tiles::rows, N = mma_tiles::cols, LD = D + mma_tiles::pad;
  constexpr int dk = D / 16, on = D / 8, sn = N / 8;
  extern __shared__ __align__(32) unsigned char smem[];  // ldmatrix and cp.async need 16
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + R * LD;
  T* Ks = dOs + R * LD;  // [2][N][LD]
  T* Vs = Ks + 2 * N * LD;
  const int S = p.S;
  const block_tile place = block_tile_of<R>(S);
  const std::int64_t bh = place.head, bkv = kv_head_of(p, bh), b = bh / p.Hq;
  const int i0 = place.first;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int g = lane / 4, t = lane % 4;
  const T* kh = k + bkv * S * D;
  const T* vh = v + bkv * S * D;

  const int last_row = (i0 + R < S ? i0 + R : S) - 1;
  const int j_begin = static_cast<int>(visible_keys(p, b, i0).begin) / N * N;
  const int j_end = static_cast<int>(visible_keys(p, b, last_row).end);
  cp_async_tile<T, D>(Qs, q + bh * S * D, i0, R, S);
  cp_async_tile<T, D>(dOs, dout + bh * S * D, i0, R, S);
  if (j_begin < j_end) {
    cp_async_tile<T, D>(Ks, kh, j_begin, N, S);
    cp_async_tile<T, D>(Vs, vh, j_begin, N, S);
  }
  cp_async_commit();

  const int row0 = i0 + warp * 16 + g, row1 = row0 + 8;
  const position_span see0 = row0 < S ? visible_keys(p, b, row0) : position_span{0, 0};
  const position_span see1 = row1 < S ? visible_keys(p, b, row1) : position_span{0, 0};
  const position_span warp_keys = warp_span(p, b, i0 + warp * 16, S, true);
  const int lo0 = static_cast<int>(see0.begin), hi0 = static_cast<int>(see0.end);
  const int lo1 = static_cast<int>(see1.begin), hi1 = static_cast<int>(see1.end);
  const float lse0 = row0 < S ? lse[bh * S + row0] * log2e : 0.0f, lse1 = row1 < S ? lse[bh * S + row1] * log2e : 0.0f;
  const float delta0 = row0 < S ? delta[bh * S + row0] : 0.0f, delta1 = row1 < S ? delta[bh * S + row1] : 0.0f;
  const T* Qw = Qs + (warp * 16 + lane % 16) * LD + (lane / 16) * 8;  // this lane's ldmatrix row of Q / dO
  const T* dOw = dOs + (warp * 16 + lane % 16) * LD + (lane / 16) * 8;

  float dqa[on][4];
#pragma unroll
  for (int n = 0; n < on; ++n) dqa[n][0] = dqa[n][1] = dqa[n][2] = dqa[n][3] = 0.0f;

  int buffer = 0;
  for (int j0 = j_begin; j0 < j_end; j0 += N, buffer ^= 1) {
    if (j0 + N < j_end) {
      cp_async_tile<T, D>(Ks + (buffer ^ 1) * N * LD, kh, j0 + N, N, S);
      cp_async_tile<T, D>(Vs + (buffer ^ 1) * N * LD, vh, j0 + N, N, S);
    }
    cp_async_commit();
    cp_async_wait<1>();  // Q, dO and this tile landed; the next tile may be in flight
    __syncthreads();
    const T* Kt = Ks + buffer * N * LD;
    const T* Vt = Vs + buffer * N * LD;
    if (j0 < warp_keys.end && j0 + N > warp_keys.begin) {
      // S = Q K^T and dP = dO V^T: K and V are [key][d], B column-major, ldmatrix without transpose.
      float sc[sn][4], dp[sn][4];
#pragma unroll
      for (int n = 0; n < sn; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[n][e] = dp[n][e] = 0.0f;
#pragma unroll
      for (int s = 0; s < dk; ++s) {
        std::uint32_t qa[4], da[4];
        ldmatrix_x4<false>(qa, Qw + s * 16);
        ldmatrix_x4<false>(da, dOw + s * 16);
#pragma unroll
        for (int n = 0; n < sn; n += 2) {
          std::uint32_t kb[4], vb[4];
          const int at = (n * 8 + (lane / 16) * 8 + lane % 8) * LD + s * 16 + ((lane / 8) % 2) * 8;
          ldmatrix_x4<false>(kb, Kt + at);
          ldmatrix_x4<false>(vb, Vt + at);
          mma_16816<T>(sc[n], qa, kb[0], kb[1]);
          mma_16816<T>(sc[n + 1], qa, kb[2], kb[3]);
          mma_16816<T>(dp[n], da, vb[0], vb[1]);
          mma_16816<T>(dp[n + 1], da, vb[2], vb[3]);
        }
      }
      // dS = P (dP - delta) scale on the visible keys, rounded to T, as A fragments of dQ += dS K.
      const bool full = j0 >= lo0 && j0 >= lo1 && j0 + N <= hi0 && j0 + N <= hi1;
      std::uint32_t dsa[sn / 2][4];
#pragma unroll
      for (int n = 0; n < sn; ++n) {
        float ds[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = j0 + n * 8 + 2 * t + (e & 1);
          const bool upper = e < 2;
          const bool visible = full || (upper ? (j >= lo0 && j < hi0) : (j >= lo1 && j < hi1));
          const float pr = visible ? exp2_nonpositive(sc[n][e] * p.scale_log2 - (upper ? lse0 : lse1)) : 0.0f;
          ds[e] = pr * (dp[n][e] - (upper ? delta0 : delta1)) * p.scale;
        }
        dsa[n / 2][(n % 2) * 2 + 0] = pack2<T>(ds[0], ds[1]);
        dsa[n / 2][(n % 2) * 2 + 1] = pack2<T>(ds[2], ds[3]);
      }
      // dQ += dS K: K is [key][d], B (key x d) row-major: ldmatrix.trans.
#pragma unroll
      for (int s = 0; s < sn / 2; ++s)
#pragma unroll
        for (int n = 0; n < on; n += 2) {
          std::uint32_t kb[4];
          ldmatrix_x4<true>(kb, Kt + (s * 16 + ((lane / 8) % 2) * 8 + lane % 8) * LD + n * 8 + (lane / 16) * 8);
          mma_16816<T>(dqa[n], dsa[s], kb[0], kb[1]);
          mma_16816<T>(dqa[n + 1], dsa[s], kb[2], kb[3]);
        }
    }
    __syncthreads();  // the buffer is refilled by the next iteration's copy
  }
  cp_async_wait<0>();

#pragma unroll
  for (int n = 0; n < on; ++n) {
    const int d = n * 8 + 2 * t;
    if (row0 < S) {
      dq[(bh * S + row0) * D + d] = from_float<T>(dqa[n][0]);
      dq[(bh * S + row0) * D + d + 1] = from_float<T>(dqa[n][1]);
    }
    if (row1 < S) {
      dq[(bh * S + row1) * D + d] = from_float<T>(dqa[n][2]);
      dq[(bh * S + row1) * D + d + 1] = from_float<T>(dqa[n][3]);
    }
  }
}

#endif  // MEMKIT_HAS_CUDA

}  // namespace attention::detail
MEMKIT_NAMESPACE_END
