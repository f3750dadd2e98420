// memkit/attention/detail/forward_pass.hpp — attention's forward pass: out and lse of one tile of queries.
// Each pass is here twice, side by side: the host routine of one tile (fp32 tiles, run over host threads and
// built for three instruction sets) and, under nvcc, the CUDA kernel of one CTA. Both mask with first_key /
// last_key and exponentiate with exp2_nonpositive (detail/common.hpp), so they compute the same softmax.
// Not a public header: flash_attention.hpp includes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "memkit/attention/detail/common.hpp"
#include "memkit/attention/detail/mma_forward.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace attention::detail {

// Forward of one (batch, query head, query tile).
template <class T>
inline void forward_item(const problem& p, const T* q, const T* k, const T* v, T* out, float* lse, std::int64_t item,
                         float* scratch) noexcept {
  const std::int64_t D = p.D, S = p.S, BQ = host_query_tile, BK = host_key_tile;
  const query_tile_place tile = query_tile_at(p, item);
  const auto [bh, i0, rows, bkv] = tile;
  float* Q = scratch;
  float* O = Q + BQ * D;
  float* Kt = O + BQ * D;
  float* V = Kt + BK * D;
  float* row = V + BK * D;
  float* m = row + BK;
  float* l = m + BQ;
  load_rows(q + (bh * S + i0) * D, rows, D, Q);
  for (std::int64_t e = 0; e < rows * D; ++e) {
    Q[e] *= p.scale_log2;
    O[e] = 0.0f;
  }
  for (std::int64_t r = 0; r < rows; ++r) m[r] = minus_infinity, l[r] = 0.0f;
  const T* kh = k + bkv * S * D;
  const T* vh = v + bkv * S * D;
  const auto load = [&](std::int64_t j0, std::int64_t cols) {
    load_transposed(kh + j0 * D, cols, D, BK, Kt);
    load_rows(vh + j0 * D, cols, D, V);
  };
  const auto online_softmax_row = [&](std::int64_t r, std::int64_t, std::int64_t cols, std::int64_t lo, std::int64_t hi) {
    row_times_transposed(Q + r * D, Kt, D, BK, cols, row);
    float tile_max = minus_infinity;
    for (std::int64_t j = lo; j < hi; ++j) tile_max = std::max(tile_max, row[j]);
    const float m_new = std::max(m[r], tile_max);
    const float correction = exp2_nonpositive(m[r] - m_new);
    float sum = 0.0f;
    for (std::int64_t j = lo; j < hi; ++j) {
      row[j] = exp2_nonpositive(row[j] - m_new);
      sum += row[j];
    }
    float* o_row = O + r * D;
    if (correction != 1.0f)
      for (std::int64_t d = 0; d < D; ++d) o_row[d] *= correction;
    for (std::int64_t j = lo; j < hi; ++j) axpy(row[j], V + j * D, D, o_row);
    l[r] = l[r] * correction + sum;
    m[r] = m_new;
  };
  for_each_visible_key_tile(p, tile, load, online_softmax_row);
  T* o_out = out + (bh * S + i0) * D;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / l[r];
    for (std::int64_t d = 0; d < D; ++d) o_out[r * D + d] = from_float<T>(O[r * D + d] * inv);
    lse[bh * S + i0 + r] = (m[r] + std::log2(l[r])) * ln2;
  }
}
MEMKIT_ATTENTION_ISA_VARIANTS(forward_item)

#if MEMKIT_HAS_CUDA
// The forward kernel's shared memory: its query rows Q, a key tile K and V, the scores Sc and their weights P,
// the fp32 output O, and m, l, correction (3 R floats).
template <class T>
struct forward_smem {
  static constexpr int R = cuda_tiles<T>::rows, N = cuda_tiles<T>::forward_cols;
  T* Q; T* K; T* V; float* Sc; T* P; float* O; float* m;
  std::int32_t* sees;  // [2 R]: the keys [begin, end) each query row sees (mask and document)
  MEMKIT_HOST_DEVICE forward_smem(smem_carver& c, int D)
      : Q(c.take<T>(R * D)), K(c.take<T>(N * D)), V(c.take<T>(N * D)), Sc(c.take<float>(R * N)), P(c.take<T>(R * N)),
        O(c.take<float>(R * D)), m(c.take<float>(3 * R)), sees(c.take<std::int32_t>(2 * R)) {}
};

// Forward of one CTA: R query rows of one head against the key tiles, one warp per 16 rows.
template <class T>
__global__ void flash_forward_kernel(cuda_problem p, const T* q, const T* k, const T* v, T* out, float* lse) {
  using C = cuda_tiles<T>;
  constexpr int R = C::rows, N = C::forward_cols;
  extern __shared__ __align__(32) unsigned char smem[];
  const int D = p.D, S = p.S;
  const block_tile place = block_tile_of<R>(S);
  const std::int64_t bh = place.head, bkv = kv_head_of(p, bh), b = bh / p.Hq;
  const int i0 = place.first;
  smem_carver carve{smem};
  const auto [Q, K, V, Sc, P, O, m, sees] = forward_smem<T>(carve, D);
  float* l = m + R;
  float* correction = l + R;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int w0 = warp * 16;
  load_tile(Q, q + (bh * S + i0) * D, S - i0, R, D);
  for (int e = static_cast<int>(threadIdx.x); e < R * D; e += static_cast<int>(blockDim.x)) O[e] = 0.0f;
  for (int r = static_cast<int>(threadIdx.x); r < R; r += static_cast<int>(blockDim.x)) {
    m[r] = minus_infinity, l[r] = 0;
    const position_span keys = i0 + r < S ? visible_keys(p, b, i0 + r) : position_span{0, 0};
    sees[r] = static_cast<std::int32_t>(keys.begin);
    sees[R + r] = static_cast<std::int32_t>(keys.end);
  }
  const int last_row = (i0 + R < S ? i0 + R : S) - 1;
  // Key tiles no row of the CTA sees (before its first row's document or window, after its last row's) are skipped.
  const int j_begin = static_cast<int>(visible_keys(p, b, i0).begin);
  const int j_end = static_cast<int>(visible_keys(p, b, last_row).end);
  // Two lanes per row, 32 columns each.
  const int r = w0 + lane / 2, c0 = (lane % 2) * (N / 2);
  const int i = i0 + r;
  const position_span warp_keys = warp_span(p, b, i0 + w0, S, true);
  const int warp_begin = static_cast<int>(warp_keys.begin), warp_end = static_cast<int>(warp_keys.end);
  for (int j0 = j_begin / N * N; j0 < j_end; j0 += N) {
    __syncthreads();  // the previous tile's K and V are no longer read
    load_tile(K, k + (bkv * S + j0) * D, S - j0, N, D);
    load_tile(V, v + (bkv * S + j0) * D, S - j0, N, D);
    __syncthreads();
    if (j0 >= warp_end || j0 + N <= warp_begin) continue;  // no row of this warp sees the tile
    warp_product<true>(Sc + w0 * N, N, Q + w0 * D, D, K, D, N, D, false);
    __syncwarp();
    const int lo = sees[r] - j0, hi = sees[R + r] - j0;  // the row's visible keys (empty past S)
    float row_max = minus_infinity;
    for (int c = c0; c < c0 + N / 2; ++c)
      if (i < S && c >= lo && c < hi) row_max = fmaxf(row_max, Sc[r * N + c] * p.scale_log2);
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    const float m_old = m[r];
    const float m_new = fmaxf(m_old, row_max);
    float sum = 0.0f;
    for (int c = c0; c < c0 + N / 2; ++c) {
      const bool valid = i < S && c >= lo && c < hi && m_new != minus_infinity;
      const float pc = valid ? exp2_nonpositive(Sc[r * N + c] * p.scale_log2 - m_new) : 0.0f;
      P[r * N + c] = from_float<T>(pc);
      sum += pc;  // unrounded, as the host sums: lse is the fp32 log-sum-exp, not that of 16-bit weights
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    __syncwarp();
    if (lane % 2 == 0) {
      const float corr = m_new == minus_infinity ? 1.0f : exp2_nonpositive(m_old - m_new);
      correction[r] = corr;
      l[r] = l[r] * corr + sum;
      m[r] = m_new;
    }
    __syncwarp();
    for (int e = lane; e < 16 * D; e += 32) O[w0 * D + e] *= correction[w0 + e / D];
    __syncwarp();
    warp_product<false>(O + w0 * D, D, P + w0 * N, N, V, D, D, N, true);
  }
  __syncwarp();
  for (int e = lane; e < 16 * D; e += 32) {
    const int r = w0 + e / D, i = i0 + r;
    if (i < S) out[(bh * S + i) * D + e % D] = from_float<T>(O[w0 * D + e] / l[r]);
  }
  if (lane < 16 && i0 + w0 + lane < S)
    lse[bh * S + i0 + w0 + lane] = (m[w0 + lane] + log2f(l[w0 + lane])) * ln2;
}
#endif  // MEMKIT_HAS_CUDA

// forward on the host: the (batch, head, query tile) items over the host threads, each thread with its own
// forward_part_floats of scratch from `workspace`.
template <class T>
void run_forward(const host_executor&, const tensor_view<const T>& q, const tensor_view<const T>& k,
                 const tensor_view<const T>& v, const tensor_view<const std::int32_t>& documents,
                 const tensor_view<T>& out, const tensor_view<float>& lse, const attention_options& options,
                 memory_resource& workspace) {
  const problem p = make_problem(q.shape(), k.shape()[1], options, documents);
  const std::int64_t items = p.B * p.Hq * tiles_of(p.S, host_query_tile);
  const std::int64_t parts = host_parts(items, options.host_threads);
  const std::int64_t part_floats = forward_part_floats(p.D);
  buffer<float> scratch(workspace, shape{parts * part_floats});
  float* base = scratch.data();
  ::memkit::detail::run_in_parts(static_cast<int>(parts), items, [&](std::int64_t first, std::int64_t last) {
    float* mine = base + part_starting_at(first, items, parts) * part_floats;
    for (std::int64_t item = first; item < last; ++item)
      MEMKIT_ATTENTION_DISPATCH(forward_item, p, q.data(), k.data(), v.data(), out.data(), lse.data(), item,
                                mine)
  });
}

#if MEMKIT_HAS_CUDA
template <class T, int D>
void launch_mma_forward(const cuda_executor& exec, const cuda_problem& p, const T* q, const T* k, const T* v, T* out,
                        float* lse) {
  const std::int64_t smem = mma_forward_smem_bytes(D, sizeof(T));
  prepare_smem(exec, mma_forward_kernel<T, D>, smem, "forward");
  const std::int64_t blocks = std::int64_t{p.B} * p.Hq * ((p.S + mma_tiles::rows - 1) / mma_tiles::rows);
  mma_forward_kernel<T, D><<<static_cast<unsigned>(blocks), mma_tiles::threads, static_cast<std::size_t>(smem),
                             exec.stream>>>(p, q, k, v, out, lse);
  MEMKIT_CUDA_CHECK(cudaGetLastError());
}

// forward on CUDA: one CTA per (batch, head, query tile); no workspace.
template <class T>
void run_forward(const cuda_executor& exec, const tensor_view<const T>& q, const tensor_view<const T>& k,
                 const tensor_view<const T>& v, const tensor_view<const std::int32_t>& documents,
                 const tensor_view<T>& out, const tensor_view<float>& lse, const attention_options& options,
                 memory_resource&) {
  const cuda_problem p = make_cuda_problem<T>(q.shape(), k.shape()[1], options, documents, "forward");
  if constexpr (!std::is_same_v<T, float>) {
    if (use_mma_kernel<T>(options, p.D, {q.data(), k.data(), v.data(), out.data()}, "forward")) {
      ::memkit::detail::with_device(exec.device, [&] {
        with_mma_head_dim(p.D, [&](auto D) {
          launch_mma_forward<T, decltype(D)::value>(exec, p, q.data(), k.data(), v.data(), out.data(), lse.data());
        });
        return 0;
      });
      return;
    }
  }
  using C = cuda_tiles<T>;
  const std::int64_t smem = smem_bytes<forward_smem<T>>(p.D);
  ::memkit::detail::with_device(exec.device, [&] {
    prepare_smem(exec, flash_forward_kernel<T>, smem, "forward");
    const std::int64_t blocks = std::int64_t{p.B} * p.Hq * ((p.S + C::rows - 1) / C::rows);
    flash_forward_kernel<T><<<static_cast<unsigned>(blocks), C::threads, static_cast<std::size_t>(smem),
                                      exec.stream>>>(p, q.data(), k.data(), v.data(), out.data(), lse.data());
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    return 0;
  });
}
#endif  // MEMKIT_HAS_CUDA

}  // namespace attention::detail
MEMKIT_NAMESPACE_END
