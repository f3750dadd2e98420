// memkit/attention/detail/mma_forward.hpp — the forward pass in FlashAttention-2's structure (attention_kernel::mma):
// bf16 / fp16 mma.sync m16n8k16 with fp32 accumulation, operands from shared memory by ldmatrix, K/V tiles brought
// in by cp.async and double-buffered, Q and the whole softmax state (running max, sum, output) in registers.
// Opt-in until a GPU run has passed the tests (attention_options::kernel). Not a public header: forward_pass.hpp
// includes it. Written from the PTX ISA's fragment layouts (mma.m16n8k16, ldmatrix) and FlashAttention-2's
// algorithm (Dao 2023), not from its code.
//
// Same mathematics as the WMMA kernel and the host (so backward and the byte functions hold): scores in fp32,
// scaled by scale * log2(e) after the product, masked with visible_keys, exp2_nonpositive, row sums of the unrounded
// fp32 weights, the weights rounded to T for the P V product, out = O / l, lse = (m + log2 l) ln 2.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "memkit/attention/detail/common.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace attention::detail {

#if MEMKIT_HAS_CUDA

// A CTA: 4 warps, 16 query rows each (64 rows); key tiles of 64. Shared rows are padded by 8 elements (16 bytes) so
// the 8 row addresses of each ldmatrix phase fall in 8 different 16-byte bank groups (no conflicts).
struct mma_tiles {
  static constexpr int warps = 4, rows = 16 * warps, cols = 64, threads = 32 * warps, pad = 8;
};
// Shared memory of the mma forward kernel, in elements of T: Q [rows][D + pad], K and V [2 buffers][cols][D + pad].
MEMKIT_HOST_DEVICE constexpr std::int64_t mma_forward_smem_bytes(int D, std::int64_t element_bytes) noexcept {
  return (std::int64_t{mma_tiles::rows} + 4 * mma_tiles::cols) * (D + mma_tiles::pad) * element_bytes;
}
// The problems the mma kernels run (bf16 / fp16 at the head_dims of mma_head_dims); others fall back to the WMMA
// kernels.
template <class T>
constexpr bool mma_forward_supports(std::int64_t D) noexcept {
  return !std::is_same_v<T, float> && is_mma_head_dim(D);
}
// Calls launch(std::integral_constant<int, D>{}) for the head_dim D of mma_head_dims equal to `head_dim` (the
// kernels take D as a template argument so every tile loop unrolls); callers checked mma_forward_supports.
template <class F>
void with_mma_head_dim(std::int64_t head_dim, F&& launch) {
  const bool launched = [&]<int... Ds>(std::integer_sequence<int, Ds...>) {
    return ((head_dim == Ds ? (launch(std::integral_constant<int, Ds>{}), true) : false) || ...);
  }(mma_head_dims{});
  require(launched, "attention (CUDA): no mma kernel for head_dim " + std::to_string(head_dim));
}
// Whether attention_options::kernel selects the mma kernels and they run this problem: bf16 / fp16, a head_dim of
// mma_head_dims, and every tensor they copy by cp.async 16-byte aligned. Otherwise the WMMA kernels run (documented),
// except above head_dim 128, which only the mma kernels run: there an unaligned tensor is an error.
template <class T>
bool use_mma_kernel(const attention_options& o, std::int64_t D, std::initializer_list<const void*> tensors,
                    const char* op) {
  if (o.kernel != attention_kernel::mma || !mma_forward_supports<T>(D)) return false;
  for (const void* t : tensors)
    if (reinterpret_cast<std::uintptr_t>(t) % 16 != 0) {
      require(D <= 128, std::string("attention::") + op + " (CUDA): head_dim " + std::to_string(D) +
                            " runs only on attention_kernel::mma's kernels, which copy by 16-byte cp.async: every "
                            "tensor (q, k, v, out, and in backward dout, dq, dk, dv) must be 16-byte aligned");
      return false;
    }
  return true;
}

__device__ inline std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared without passing through registers; `valid` false fills zeros and reads nothing.
__device__ inline void cp_async16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
#endif
}
__device__ inline void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int pending>
__device__ inline void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");  // no shared access moves above it
#endif
}
// Four 8x8 matrices of 16-bit elements; lane l gives the address of row l % 8 of matrix l / 8.
template <bool transposed>
__device__ inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (transposed)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
#endif
}
// c[16 x 8] += a[16 x 16] b[16 x 8], fp32 accumulators (the PTX ISA's m16n8k16 fragment layouts).
template <class T>
__device__ inline void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, bf16>)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// Two floats rounded to T (the same from_float as everywhere) packed low-first into one register.
template <class T>
__device__ inline std::uint32_t pack2(float lo, float hi) {
  return static_cast<std::uint32_t>(from_float<T>(lo).bits) | (static_cast<std::uint32_t>(from_float<T>(hi).bits) << 16);
}

// rows x D of T from global (row `first` of a head at `head`, `valid` rows before S) into shared [rows][D + pad] by
// 16-byte cp.async chunks of the whole block; rows past S are zero-filled.
template <class T, int D>
__device__ inline void cp_async_tile(T* dst, const T* head, int first, int rows, int S) {
  constexpr int chunks = D * static_cast<int>(sizeof(T)) / 16, per_chunk = 16 / static_cast<int>(sizeof(T));
  for (int e = static_cast<int>(threadIdx.x); e < rows * chunks; e += mma_tiles::threads) {
    const int r = e / chunks, c = e % chunks;
    const bool valid = first + r < S;
    const T* src = head + (valid ? std::int64_t{first + r} * D + c * per_chunk : 0);
    cp_async16(dst + r * (D + mma_tiles::pad) + c * per_chunk, src, valid);
  }
}

// The fragment math shared by the forward and both backward passes, each formula once. An m16n8k16 product takes its
// A fragment (16 x 16) from registers and its B fragments from a shared tile by ldmatrix_x4, which yields b0, b1 of
// two 8-column blocks at once (so n steps by 2). LD is the shared row stride in elements (D + pad).
//
// Where this lane's ldmatrix_x4 row lies in a shared [rows][LD] tile, in elements: row + col + lane. Kept as three
// terms so every caller adds them in the same order; these helpers are force-inlined so the kernels compile as if
// the loops were written out (optimizing a helper before inlining it changes register allocation and scheduling).
struct fragment_offset {
  int row, col, lane;
};
// A: the 16 x 16 block of rows first.., k-step s (matrices: rows 0-7 / 8-15 x columns 0-7 / 8-15).
template <int LD>
__device__ MEMKIT_FORCEINLINE fragment_offset a_fragment(int lane, int first, int s) {
  return {(first + lane % 16) * LD, s * 16, (lane / 16) * 8};
}
// B of 8-column blocks n, n + 1 at k-step s. Not transposed: the tile is [column][k] (K, Q, V, dO for X Y^T
// products), B column-major. Transposed (ldmatrix.trans): the tile is [k][column] (V, K, dO, Q for P V-like
// products), B row-major.
template <bool transposed, int LD>
__device__ MEMKIT_FORCEINLINE fragment_offset b_fragment(int lane, int s, int n) {
  if constexpr (transposed)
    return {(s * 16 + ((lane / 8) % 2) * 8 + lane % 8) * LD, n * 8, (lane / 16) * 8};
  else
    return {(n * 8 + (lane / 16) * 8 + lane % 8) * LD, s * 16, ((lane / 8) % 2) * 8};
}
// One k-step s of c[n] += A B over the 8-column blocks n < nb: A fragment `a` in registers, B from `tile`.
template <class T, bool transposed, int LD, int nb>
__device__ MEMKIT_FORCEINLINE void mma_step(float (&c)[nb][4], const std::uint32_t (&a)[4], const T* tile, int lane,
    int s) {
  #pragma unroll
  for (int n = 0; n < nb; n += 2) {
    std::uint32_t b[4];
    const fragment_offset at = b_fragment<transposed, LD>(lane, s, n);
    ldmatrix_x4<transposed>(b, tile + at.row + at.col + at.lane);
    mma_16816<T>(c[n], a, b[0], b[1]);
    mma_16816<T>(c[n + 1], a, b[2], b[3]);
  }
}
// One k-step of two products over the same blocks, loads and MMAs interleaved: c1 += A1 B1, c2 += A2 B2.
template <class T, bool transposed, int LD, int nb>
__device__ MEMKIT_FORCEINLINE void mma_step2(float (&c1)[nb][4], const std::uint32_t (&a1)[4], const T* tile1,
    float (&c2)[nb][4], const std::uint32_t (&a2)[4], const T* tile2, int lane, int s) {
  #pragma unroll
  for (int n = 0; n < nb; n += 2) {
    std::uint32_t b1[4], b2[4];
    const fragment_offset f = b_fragment<transposed, LD>(lane, s, n);
    const int at = f.row + f.col + f.lane;
    ldmatrix_x4<transposed>(b1, tile1 + at);
    ldmatrix_x4<transposed>(b2, tile2 + at);
    mma_16816<T>(c1[n], a1, b1[0], b1[1]);
    mma_16816<T>(c1[n + 1], a1, b1[2], b1[3]);
    mma_16816<T>(c2[n], a2, b2[0], b2[1]);
    mma_16816<T>(c2[n + 1], a2, b2[2], b2[3]);
  }
}
// c[n] += A B over every k-step s < ks, the A fragments a[s] in registers.
template <class T, bool transposed, int LD, int ks, int nb>
__device__ MEMKIT_FORCEINLINE void mma_rows_by_tile(float (&c)[nb][4], const std::uint32_t (&a)[ks][4], const T* tile,
    int lane) {
  #pragma unroll
  for (int s = 0; s < ks; ++s) mma_step<T, transposed, LD>(c, a[s], tile, lane, s);
}
template <class T, bool transposed, int LD, int ks, int nb>
__device__ MEMKIT_FORCEINLINE void mma_rows_by_tile2(float (&c1)[nb][4], const std::uint32_t (&a1)[ks][4],
    const T* tile1, float (&c2)[nb][4], const std::uint32_t (&a2)[ks][4], const T* tile2, int lane) {
  #pragma unroll
  for (int s = 0; s < ks; ++s) mma_step2<T, transposed, LD>(c1, a1[s], tile1, c2, a2[s], tile2, lane, s);
}
// c += A B^T over ks k-steps with the A fragments re-read from shared memory per k-step (a: this lane's ldmatrix row
// at k-step 0): the forward's S at head_dims where Q's fragments would not fit in registers beside O.
template <class T, int LD, int ks, int nb>
__device__ MEMKIT_FORCEINLINE void mma_shared_rows_by_tile(float (&c)[nb][4], const T* a, const T* tile, int lane) {
  #pragma unroll
  for (int s = 0; s < ks; ++s) {
    std::uint32_t f[4];
    ldmatrix_x4<false>(f, a + s * 16);
    mma_step<T, false, LD>(c, f, tile, lane, s);
  }
}
// c1 += A1 B1^T, c2 += A2 B2^T over ks k-steps with the A fragments re-read from shared memory per k-step (a1, a2:
// this lane's ldmatrix rows at k-step 0), which keeps registers for the accumulators: backward's S and dP.
template <class T, int LD, int ks, int nb>
__device__ MEMKIT_FORCEINLINE void mma_shared_rows_by_tile2(float (&c1)[nb][4], const T* a1, const T* tile1,
    float (&c2)[nb][4], const T* a2, const T* tile2, int lane) {
  #pragma unroll
  for (int s = 0; s < ks; ++s) {
    std::uint32_t f1[4], f2[4];
    ldmatrix_x4<false>(f1, a1 + s * 16);
    ldmatrix_x4<false>(f2, a2 + s * 16);
    mma_step2<T, false, LD>(c1, f1, tile1, c2, f2, tile2, lane, s);
  }
}

// The forward's S = Q K^T with Q's fragments in registers (qa), or (std::false_type) re-read from the shared Q tile
// per k-step. Overloads, not `if constexpr` in the kernel: with the `if constexpr` the PTX of the kernels at
// head_dim 64 and 128 changed (CUDA 13.0), with these it is the same as before head_dim 256 existed.
template <class T, int LD, int ks, int nb>
__device__ MEMKIT_FORCEINLINE void forward_scores(std::true_type, float (&c)[nb][4], const std::uint32_t (&qa)[ks][4],
                                                  const T*, const T* tile, int lane, int) {
  mma_rows_by_tile<T, false, LD>(c, qa, tile, lane);
}
template <class T, int LD, int ks, int nb, int qa_steps>
__device__ MEMKIT_FORCEINLINE void forward_scores(std::false_type, float (&c)[nb][4],
                                                  const std::uint32_t (&)[qa_steps][4], const T* Qs, const T* tile,
                                                  int lane, int warp) {
  const fragment_offset qw = a_fragment<LD>(lane, warp * 16, 0);  // this lane's ldmatrix row of Q
  mma_shared_rows_by_tile<T, LD, ks>(c, Qs + qw.row + qw.lane, tile, lane);
}

// Stores this thread's accumulator rows of an [S][D] output at row offset `base` (head * S): row r0 gets c[n][0..1],
// row r1 c[n][2..3], divided by div0 / div1 (1 where nothing divides: x / 1 is exact), rows at or past S skipped.
template <class T, int D>
__device__ MEMKIT_FORCEINLINE void store_accumulator_rows(T* out, std::int64_t base, const float (&c)[D / 8][4],
                                                         int r0, int r1, int S, int t, float div0 = 1.0f,
                                                         float div1 = 1.0f) {
  #pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int d = n * 8 + 2 * t;
    if (r0 < S) {
      out[(base + r0) * D + d] = from_float<T>(c[n][0] / div0);
      out[(base + r0) * D + d + 1] = from_float<T>(c[n][1] / div0);
    }
    if (r1 < S) {
      out[(base + r1) * D + d] = from_float<T>(c[n][2] / div1);
      out[(base + r1) * D + d + 1] = from_float<T>(c[n][3] / div1);
    }
  }
}

// Forward of one CTA: 64 query rows of one head, each warp 16 rows; thread (g = lane / 4, t = lane % 4) holds rows
// g and g + 8 of its warp's 16, and of each 8-column block the columns 2t, 2t + 1 (the m16n8 accumulator layout).
template <class T, int D>
__global__ void __launch_bounds__(mma_tiles::threads)
    mma_forward_kernel(cuda_problem p, const T* q, const T* k, const T* v, T* out, float* lse) {
  constexpr int R = mma_tiles::rows, N = mma_tiles::cols, LD = D + mma_tiles::pad;
  constexpr int dk = D / 16, on = D / 8, sn = N / 8;  // k-steps of Q K^T, 8-column blocks of O and of S
  extern __shared__ __align__(32) unsigned char smem[];  // ldmatrix and cp.async need 16
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = Qs + R * LD;  // [2][N][LD]
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
  // Q and the first K/V tile in flight together.
  cp_async_tile<T, D>(Qs, q + bh * S * D, i0, R, S);
  cp_async_commit();
  if (j_begin < j_end) {
    cp_async_tile<T, D>(Ks, kh, j_begin, N, S);
    cp_async_tile<T, D>(Vs, vh, j_begin, N, S);
  }
  cp_async_commit();

  // This thread's two rows: what they see, and the warp's span (tiles outside it are skipped by the warp).
  const int row0 = i0 + warp * 16 + g, row1 = row0 + 8;
  const position_span see0 = row0 < S ? visible_keys(p, b, row0) : position_span{0, 0};
  const position_span see1 = row1 < S ? visible_keys(p, b, row1) : position_span{0, 0};
  const position_span warp_keys = warp_span(p, b, i0 + warp * 16, S, true);
  const int lo0 = static_cast<int>(see0.begin), hi0 = static_cast<int>(see0.end);
  const int lo1 = static_cast<int>(see1.begin), hi1 = static_cast<int>(see1.end);

  cp_async_wait<1>();  // Q landed (the K/V group may still be in flight)
  __syncthreads();
  // Q's A fragments: in registers up to head_dim 128 (4 registers per k-step); above, O alone takes D / 2 registers
  // and Q's fragments are re-read from shared memory per key tile instead.
  constexpr bool q_in_registers = D <= 128;
  [[maybe_unused]] std::uint32_t qa[q_in_registers ? dk : 1][4];
  if constexpr (q_in_registers) {
    #pragma unroll
    for (int s = 0; s < dk; ++s)
    {
      const fragment_offset at = a_fragment<LD>(lane, warp * 16, s);
      ldmatrix_x4<false>(qa[s], Qs + at.row + at.col + at.lane);
    }
  }

  float o[on][4];
  #pragma unroll
  for (int n = 0; n < on; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m0 = minus_infinity, m1 = minus_infinity, l0 = 0.0f, l1 = 0.0f;

  int buffer = 0;
  for (int j0 = j_begin; j0 < j_end; j0 += N, buffer ^= 1) {
    // Bring the next tile into the other buffer while this one is used (its previous readers passed the
    // barrier at the end of the last iteration).
    if (j0 + N < j_end) {
      cp_async_tile<T, D>(Ks + (buffer ^ 1) * N * LD, kh, j0 + N, N, S);
      cp_async_tile<T, D>(Vs + (buffer ^ 1) * N * LD, vh, j0 + N, N, S);
    }
    cp_async_commit();
    cp_async_wait<1>();  // everything but the tile just issued
    __syncthreads();
    const T* Kt = Ks + buffer * N * LD;
    const T* Vt = Vs + buffer * N * LD;
    if (j0 < warp_keys.end && j0 + N > warp_keys.begin) {
      // S = Q K^T: K is [key][d], i.e. B (d x key) column-major: ldmatrix without transpose gives b0, b1 of two
      // 8-key blocks at once.
      float sc[sn][4];
      #pragma unroll
      for (int n = 0; n < sn; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
      forward_scores<T, LD, dk>(std::bool_constant<q_in_registers>{}, sc, qa, Qs, Kt, lane, warp);
      // Online softmax on the two rows; a row's 64 columns live in the 4 threads of its quad.
      const bool full = j0 >= lo0 && j0 >= lo1 && j0 + N <= hi0 && j0 + N <= hi1;  // no column masked
      float max0 = minus_infinity, max1 = minus_infinity;
      #pragma unroll
      for (int n = 0; n < sn; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = j0 + n * 8 + 2 * t + (e & 1);
          const bool upper = e < 2;
          const bool visible = full || (upper ? (j >= lo0 && j < hi0) : (j >= lo1 && j < hi1));
          const float x = visible ? sc[n][e] * p.scale_log2 : minus_infinity;
          sc[n][e] = x;
          if (upper) max0 = fmaxf(max0, x);
          else max1 = fmaxf(max1, x);
        }
      #pragma unroll
      for (int x = 1; x < 4; x <<= 1) {
        max0 = fmaxf(max0, __shfl_xor_sync(0xffffffffu, max0, x));
        max1 = fmaxf(max1, __shfl_xor_sync(0xffffffffu, max1, x));
      }
      const float n0 = fmaxf(m0, max0), n1 = fmaxf(m1, max1);
      const float c0 = n0 == minus_infinity ? 1.0f : exp2_nonpositive(m0 - n0);
      const float c1 = n1 == minus_infinity ? 1.0f : exp2_nonpositive(m1 - n1);
      float sum0 = 0.0f, sum1 = 0.0f;
      std::uint32_t pa[sn / 2][4];  // the weights as A fragments of P V (two 8-key blocks make one k-step)
      #pragma unroll
      for (int n = 0; n < sn; ++n) {
        const float p0 = n0 == minus_infinity ? 0.0f : exp2_nonpositive(sc[n][0] - n0);
        const float p1 = n0 == minus_infinity ? 0.0f : exp2_nonpositive(sc[n][1] - n0);
        const float p2 = n1 == minus_infinity ? 0.0f : exp2_nonpositive(sc[n][2] - n1);
        const float p3 = n1 == minus_infinity ? 0.0f : exp2_nonpositive(sc[n][3] - n1);
        sum0 += p0 + p1;  // unrounded, as the host sums
        sum1 += p2 + p3;
        pa[n / 2][(n % 2) * 2 + 0] = pack2<T>(p0, p1);
        pa[n / 2][(n % 2) * 2 + 1] = pack2<T>(p2, p3);
      }
      #pragma unroll
      for (int x = 1; x < 4; x <<= 1) {
        sum0 += __shfl_xor_sync(0xffffffffu, sum0, x);
        sum1 += __shfl_xor_sync(0xffffffffu, sum1, x);
      }
      l0 = l0 * c0 + sum0, l1 = l1 * c1 + sum1;
      m0 = n0, m1 = n1;
      #pragma unroll
      for (int n = 0; n < on; ++n) o[n][0] *= c0, o[n][1] *= c0, o[n][2] *= c1, o[n][3] *= c1;
      // O += P V: V is [key][d], B (key x d) row-major: ldmatrix.trans gives b0, b1 of two 8-wide d blocks.
      mma_rows_by_tile<T, true, LD>(o, pa, Vt, lane);
    }
    __syncthreads();  // the buffer is refilled by the next iteration's copy
  }
  cp_async_wait<0>();

  store_accumulator_rows<T, D>(out, bh * S, o, row0, row1, S, t, l0, l1);
  if (t == 0) {
    if (row0 < S) lse[bh * S + row0] = (m0 + log2f(l0)) * ln2;
    if (row1 < S) lse[bh * S + row1] = (m1 + log2f(l1)) * ln2;
  }
}

#endif  // MEMKIT_HAS_CUDA

}  // namespace attention::detail
MEMKIT_NAMESPACE_END
