// Quantized matmul on the host against a dense reference built from the fully dequantized weight.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "memkit/core/host_simd.hpp"
#include "memkit/core/protocol.hpp"
#include "memkit/linalg/gemm.hpp"
#include "memkit/memory/tracking.hpp"
#include "memkit/quant/matmul.hpp"
#include "support/test_values.hpp"
#include "support/host_isa_scope.hpp"

namespace q = memkit::quant;
using memkit::host;
using memkit::host_view;

using memkit_test::uniform_values;

// The protocol's byte functions exist, are found by argument-dependent lookup and are constant expressions.
static_assert(memkit::operation_arguments<q::matmul_arguments>);
static_assert(saved_bytes(q::matmul_arguments{}) == 0);
static_assert(bytes_required(q::matmul_arguments{q::matmul_kind::input_grad, q::NF4, 64, 16, 64, 256, 2, true}) ==
              64 * 256 * 2);  // the CUDA tiled path: one tile holding all of W, in bf16
static_assert(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, 4, 64, 256, 4, false}) ==
              4 * 256 * 4);  // the host fused path: x in fp32

namespace {
// Checks out[r, c] (rows x cols) against sum over i of a[r, i] * b(i, c), summed in double, within
// `tolerance` times the sum of the terms' magnitudes.
template <class T, class B>
void check_product(const std::vector<T>& out, const std::vector<T>& a, std::int64_t rows, std::int64_t inner,
                   std::int64_t cols, B b, double tolerance) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      double expected = 0, magnitude = 0;
      for (std::int64_t i = 0; i < inner; ++i) {
        const double term = static_cast<double>(memkit::to_float(a[static_cast<std::size_t>(r * inner + i)])) * b(i, c);
        expected += term;
        magnitude += std::fabs(term);
      }
      CHECK(std::fabs(memkit::to_float(out[static_cast<std::size_t>(r * cols + c)]) - expected) <=
            tolerance * (magnitude + 1e-3));
    }
}

template <q::format F, class T>
void check_against_dense(std::int64_t M, std::int64_t N, std::int64_t K, q::quant_options options,
                         const q::matmul_config& config) {
  CAPTURE(q::to_string(F));
  CAPTURE(M);
  CAPTURE(N);
  CAPTURE(K);
  CAPTURE(options.double_quant);
  const std::vector<float> weights = uniform_values(N * K, 1);
  const auto w = q::quantized_tensor<F>::quantize(host, host_view(weights.data(), {N, K}), options,
                                                  memkit::default_host_resource());
  std::vector<float> dense(static_cast<std::size_t>(N * K));  // the reference may materialize W; matmul may not
  w.dequantize(host, host_view(dense));
  const std::vector<T> x = memkit_test::convert<T>(uniform_values(M * K, 2));
  const std::vector<T> dy = memkit_test::convert<T>(uniform_values(M * N, 3));
  const double tolerance = std::is_same_v<T, float> ? 1e-5 : 1e-2;  // fp32 sums vs bf16/fp16 outputs

  // The byte functions of the call's arguments against what a tracker counts (docs/architecture.md, "The
  // component protocol"): the workspace is the peak, nothing is saved, and nothing else is allocated.
  const q::matmul_arguments forward{q::matmul_kind::forward, F, options.block_size, M, N, K, sizeof(T), false, config};
  memkit::tracking_resource workspace(memkit::default_host_resource(), "matmul");
  std::vector<T> y(static_cast<std::size_t>(M * N));
  q::matmul(host, host_view(x.data(), {M, K}), w, host_view(y.data(), {M, N}), config, workspace);
  CHECK(workspace.peak_bytes() == workspace_bytes(forward));
  CHECK(workspace.peak_bytes() == bytes_required(forward));
  CHECK(workspace.current_bytes() == 0);
  CHECK(saved_bytes(forward) == 0);
  check_product(y, x, M, K, N, [&](std::int64_t k, std::int64_t n) { return dense[static_cast<std::size_t>(n * K + k)]; },
                tolerance);

  workspace.reset_peak();
  std::vector<T> dx(static_cast<std::size_t>(M * K));
  q::matmul_input_grad(host, host_view(dy.data(), {M, N}), w, host_view(dx.data(), {M, K}), config, workspace);
  q::matmul_arguments input_grad = forward;
  input_grad.kind = q::matmul_kind::input_grad;
  CHECK(workspace.peak_bytes() == workspace_bytes(input_grad));
  CHECK(workspace.peak_bytes() == bytes_required(input_grad));
  CHECK(workspace.current_bytes() == 0);
  check_product(dx, dy, M, N, K, [&](std::int64_t n, std::int64_t k) { return dense[static_cast<std::size_t>(n * K + k)]; },
                tolerance);
}
}  // namespace

TEST_CASE("quant matmul: y = x W^T and dx = dy W match a dense reference") {
  const q::matmul_config small_tiles{300, 8};  // several tiles, rows of W split across none
  const q::matmul_config default_tiles{};
  check_against_dense<q::NF4, float>(5, 37, 130, {64, true}, small_tiles);
  check_against_dense<q::NF4, float>(1, 64, 256, {64, false}, default_tiles);
  check_against_dense<q::FP4, memkit::bf16>(17, 40, 96, {32, false}, small_tiles);
  check_against_dense<q::INT8, memkit::fp16>(3, 33, 65, {128, true}, small_tiles);
  check_against_dense<q::NF4, memkit::bf16>(9, 128, 512, {256, true}, default_tiles);
  // Small batches with whole-block rows take the fused decode-in-the-dot-product path, in each of its
  // implementations (AVX-512, AVX2, portable; the SIMD ones where the CPU has them).
  for (int simd : {2, 1, 0}) {
    CAPTURE(simd);
    const q::matmul_config fused{1 << 16, 8, simd};
    check_against_dense<q::FP4, memkit::fp16>(3, 50, 128, {32, true}, fused);
    check_against_dense<q::NF4, memkit::bf16>(4, 20, 256, {128, false}, fused);
    check_against_dense<q::NF4, float>(2, 7, 4096, {4096, true}, fused);
    check_against_dense<q::NF4, memkit::bf16>(8, 16, 64, {64, true}, fused);
    check_against_dense<q::NF4, float>(1, 9, 64, {32, false}, fused);  // a column left over by the 4-column kernel
  }
}

TEST_CASE("quant matmul: every host path on any number of threads, and the GEMM path on each instruction set") {
  for (int threads : {1, 2, 3, 0}) {
    CAPTURE(threads);
    q::matmul_config config;
    config.host_threads = threads;
    config.tile_floats = 300;  // tiles of host_gemm_min_rows rows: several per thread for the wider weights
    check_against_dense<q::NF4, float>(9, 300, 64, {64, false}, config);     // fused path, two passes over W
    check_against_dense<q::NF4, float>(33, 300, 64, {64, false}, config);    // GEMM path, just past the fused one
    check_against_dense<q::FP4, memkit::bf16>(29, 100, 64, {32, true}, config);  // four fused passes
    check_against_dense<q::NF4, memkit::bf16>(33, 200, 128, {32, true}, config);
    check_against_dense<q::INT8, float>(64, 130, 96, {32, false}, config);
    check_against_dense<q::FP4, memkit::fp16>(12, 70, 300, {32, false}, config);  // rows not whole blocks
    check_against_dense<q::NF4, float>(3, 200, 256, {64, false}, config);    // fused path, columns split
    check_against_dense<q::NF4, memkit::bf16>(7, 45, 128, {128, true}, config);
    check_against_dense<q::NF4, float>(16, 200, 1280, {64, false}, config);  // fused, depth in 3 chunks per pass
    check_against_dense<q::NF4, memkit::bf16>(300, 70, 192, {64, false}, config);  // GEMM path, two slices of x
  }
  memkit_test::on_each_host_isa([](memkit::host_isa) {
    check_against_dense<q::NF4, float>(20, 150, 320, {64, false}, q::matmul_config{});
    check_against_dense<q::NF4, float>(5, 150, 320, {64, false}, q::matmul_config{});
    // The fused path with depth chunks (x rows kept in L1 between chunks) over groups of 32 columns, a
    // partial last group and a column tail.
    check_against_dense<q::NF4, float>(8, 100, 1600, {64, false}, q::matmul_config{});
    check_against_dense<q::FP4, memkit::bf16>(3, 70, 1600, {64, true}, q::matmul_config{});
    check_against_dense<q::NF4, float>(1, 45, 8192, {32, false}, q::matmul_config{});
    // The GEMM path: W decoded straight into packed panels (the vector decoders where K is whole 32-value
    // steps), two depth blocks, a partial last panel of columns and of rows.
    check_against_dense<q::NF4, float>(40, 150, 640, {64, false}, q::matmul_config{});
    check_against_dense<q::FP4, memkit::bf16>(37, 70, 576, {128, true}, q::matmul_config{});
    check_against_dense<q::NF4, float>(35, 45, 4160, {4096, false}, q::matmul_config{});  // a block wider than kc
    check_against_dense<q::INT8, float>(33, 40, 96, {32, false}, q::matmul_config{});
  });
}

TEST_CASE("quant matmul: shape errors name the operation and the shapes") {
  const std::vector<float> weights = uniform_values(8 * 16, 4);
  const auto w = q::quantized_tensor<q::NF4>::quantize(host, host_view(weights.data(), {8, 16}), {32, false},
                                                       memkit::default_host_resource());
  std::vector<float> x(2 * 15), y(2 * 8);
  CHECK_THROWS_WITH_AS(q::matmul(host, host_view(x.data(), {2, 15}), w, host_view(y.data(), {2, 8}),
                                 q::matmul_config{}, memkit::default_host_resource()),
                       doctest::Contains("quant::matmul: input has shape [2, 15] but the weight [8, 16] needs a last dimension of 16"),
                       memkit::error);
  std::vector<float> x2(2 * 16), y2(2 * 7);
  CHECK_THROWS_WITH_AS(q::matmul(host, host_view(x2.data(), {2, 16}), w, host_view(y2.data(), {2, 7}),
                                 q::matmul_config{}, memkit::default_host_resource()),
                       doctest::Contains("output has shape [2, 7] but needs 2 rows of 8"), memkit::error);
}

// The CUDA plan (no GPU needed to check the prediction): the fused kernels take batches of at most 8 rows
// whatever small_batch_limit says, so a larger batch under a larger limit takes the tiled path and needs
// its tile (and, for dx in 16 bits, the fp32 accumulator).
TEST_CASE("quant matmul: the CUDA workspace prediction follows the path the CUDA matmul takes") {
  const std::int64_t N = 64, K = 256;
  q::matmul_config limit_16;
  limit_16.small_batch_limit = 16;
  const std::size_t tile = static_cast<std::size_t>(N * K) * 2;  // the device tile holds the whole W, in bf16
  for (std::int64_t M : {1, 8}) {
    CAPTURE(M);
    CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, M, N, K, 2, true, limit_16}) == 0);
    CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::input_grad, q::NF4, 64, M, N, K, 2, true, limit_16}) == 0);
  }
  for (std::int64_t M : {9, 12, 16, 17}) {
    CAPTURE(M);
    CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, M, N, K, 2, true, limit_16}) == tile);
    // One tile holds all of W: cuBLAS writes the 16-bit dx itself, no fp32 accumulator.
    CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::input_grad, q::NF4, 64, M, N, K, 2, true, limit_16}) == tile);
    // Several tiles: a 16-bit dx is summed over them in an fp32 accumulator; an fp32 dx is its own.
    q::matmul_config two_tiles = limit_16;
    two_tiles.device_tile_floats = (N / 2) * K;
    CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::input_grad, q::NF4, 64, M, N, K, 2, true, two_tiles}) ==
          tile / 2 + static_cast<std::size_t>(M * K) * 4);
    CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::input_grad, q::NF4, 64, M, N, K, 4, true, two_tiles}) == tile);
  }
  // A short K against a tall W: the tiled input-gradient kernel splits N so that 256-column blocks still
  // give about 264 blocks of threads, each range writing fp32 partial sums (K = 4096: 16 column blocks, so
  // 17 ranges wanted and 4096 / 256 = 16 allowed). A K that is not a multiple of 32 takes the untiled
  // kernel, which needs nothing.
  for (std::int64_t M : {1, 8}) {
    CAPTURE(M);
    CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::input_grad, q::NF4, 64, M, 4096, 4096, 2, true}) ==
          static_cast<std::size_t>(16 * M * 4096) * 4);
    CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::input_grad, q::INT8, 64, M, 4096, 4096, 2, true}) ==
          static_cast<std::size_t>(16 * M * 4096) * 4);
    CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::input_grad, q::NF4, 64, M, 4096, 4100, 2, true}) == 0);
    CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, M, 4096, 4096, 2, true}) == 0);
  }
  q::matmul_config limit_4;
  limit_4.small_batch_limit = 4;
  CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, 4, N, K, 2, true, limit_4}) == 0);
  CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, 5, N, K, 2, true, limit_4}) == tile);
}

// #30's training shapes (bench/quant_cuda.cu, BM_cuda_matmul_nf4_vs_dense): with the default config, the CUDA path
// holds each Llama-8B layer's W whole in one tile, so a forward or input-gradient call at M = 1,024-8,192
// dequantizes every weight once and makes one cuBLAS call (no fp32 accumulator for a 16-bit dx). A Llama-70B MLP
// weight (28,672 x 8,192) does not fit: four tiles.
TEST_CASE("quant matmul: Llama-8B layers at training M take one dequantize of W per CUDA call") {
  const q::matmul_config config;
  for (const auto& shape : std::initializer_list<std::pair<std::int64_t, std::int64_t>>{{4096, 4096}, {4096, 14336}, {14336, 4096}}) {
    const std::int64_t K = shape.first, N = shape.second;  // no structured binding: clang 14 cannot capture one
    CAPTURE(K);
    CAPTURE(N);
    CHECK(q::detail::tile_rows(N, K, config, true) == N);
    for (std::int64_t M : {1024, 4096, 8192}) {
      CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, M, N, K, 2, true, config}) ==
            static_cast<std::size_t>(N * K) * 2);
      CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::input_grad, q::NF4, 64, M, N, K, 2, true, config}) ==
            static_cast<std::size_t>(N * K) * 2);
    }
  }
  const std::int64_t rows_70b = q::detail::tile_rows(28672, 8192, config, true);
  CHECK((28672 + rows_70b - 1) / rows_70b == 4);
}

// The CUDA large-batch path dequantizes device_tile_floats values per cuBLAS call (hundreds of rows of a
// large layer); the host's forward GEMM path has no dequantized tile (W is decoded into the gemm's packed
// panels), so its workspace does not depend on tile_floats.
TEST_CASE("quant matmul: the CUDA and host tiles are sized separately") {
  const std::int64_t M = 256, N = 4096, K = 8192;
  const q::matmul_config config;
  const std::size_t device_rows = static_cast<std::size_t>(config.device_tile_floats / K);
  CHECK(device_rows == 8192);  // the default device tile holds an 8192 x 8192 W whole
  CHECK(config.tile_floats / K == 8);
  CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, M, N, K, 2, true, config}) ==
        static_cast<std::size_t>(N * K) * 2);
  CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, M, 3 * N, K, 2, true, config}) == device_rows * K * 2);
  // The host forward: x packed once (M x K), the gemm's packing buffers, and one buffer of decoded rows of W.
  q::matmul_config other_tiles = config;
  other_tiles.tile_floats = 300;
  const std::size_t host = workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, M, N, K, 4, false, config});
  CHECK(host == workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, M, N, K, 4, false, other_tiles}));
  CHECK(host >= static_cast<std::size_t>(M * K) * 4);
  CHECK(host <= static_cast<std::size_t>(M * K) * 4 + memkit::linalg::gemm_workspace_bytes<float, float, float>(M, N, K) +
                    (std::size_t{64} << 10));
  // A layer narrower than the tile: the tile is the whole weight.
  CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, q::NF4, 64, M, 512, K, 2, true, config}) ==
        static_cast<std::size_t>(512 * K) * 2);
}
