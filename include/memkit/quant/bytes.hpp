// memkit/quant/bytes.hpp — the sizes of blockwise-quantized storage and the byte functions of quant's operations,
// as constexpr functions with no kernels and no buffers (memory_budget includes this header alone):
//   the formats and block sizes, the code and scale counts of a tensor (quantized_tensor_bytes, which
//   quantized_tensor<F>::bytes_required returns);
//   quantize_arguments (quantized_tensor::quantize_into) and its byte functions;
//   matmul_config, matmul_arguments (quant::matmul / matmul_input_grad), the plans of their host and CUDA paths
//   and their byte functions.
// quant/formats.hpp, quantized_tensor.hpp and matmul.hpp include it; the operations are there.
#pragma once

#include <cstddef>
#include <cstdint>

#include "memkit/config.hpp"
#include "memkit/core/hardware_threads.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/linalg/gemm_bytes.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace quant {

// --- formats and block sizes ---

enum class format : std::uint8_t {
  nf4,   // 4-bit normal float (QLoRA)
  fp4,   // 4-bit float, bitsandbytes' e2m1 variant
  int8,  // 8-bit index into the signed dynamic map ("blockwise int8" of bitsandbytes' quantize_blockwise)
};

constexpr const char* to_string(format f) noexcept {
  switch (f) {
    case format::nf4: return "nf4";
    case format::fp4: return "fp4";
    case format::int8: return "int8";
  }
  return "unknown";
}

MEMKIT_HOST_DEVICE constexpr bool is_four_bit(format f) noexcept { return f != format::int8; }

inline constexpr std::int64_t min_block_size = 32;
inline constexpr std::int64_t max_block_size = 4096;
constexpr bool is_valid_block_size(std::int64_t block_size) noexcept {
  return block_size >= min_block_size && block_size <= max_block_size && (block_size & (block_size - 1)) == 0;
}

// Number of blocks (and so of absmax values) for `numel` elements.
MEMKIT_HOST_DEVICE constexpr std::int64_t block_count(std::int64_t numel, std::int64_t block_size) noexcept {
  return (numel + block_size - 1) / block_size;
}

// Bytes of codes for `numel` elements.
MEMKIT_HOST_DEVICE constexpr std::int64_t code_bytes(format f, std::int64_t numel) noexcept {
  return is_four_bit(f) ? (numel + 1) / 2 : numel;
}

// Block size of the second quantization level of double-quantized scales (bitsandbytes' "nested" state).
inline constexpr std::int64_t nested_block_size = 256;

// Number of fp32 second-level absmax values for `blocks` first-level scales.
MEMKIT_HOST_DEVICE constexpr std::int64_t nested_group_count(std::int64_t blocks) noexcept {
  return block_count(blocks, nested_block_size);
}

inline constexpr format NF4 = format::nf4;
inline constexpr format FP4 = format::fp4;
inline constexpr format INT8 = format::int8;

namespace detail {
// Weights per 16 bytes of codes.
template <format F>
inline constexpr int codes_per_16_bytes = F == format::int8 ? 16 : 32;
}  // namespace detail

// --- a quantized tensor's storage, and quantize_into ---

struct quant_options {
  std::int64_t block_size = 64;
  bool double_quant = false;  // quantize the block scales too ("compress_statistics" in bitsandbytes)
};

// One quantize_into call (and the temporaries of quantize), for the byte functions of the component protocol
// (docs/architecture.md): the tensor's format, shape and options.
struct quantize_arguments {
  format fmt = format::nf4;
  shape dims{};
  quant_options options{};
};
// What quantize_into takes from its workspace at once: the fp32 first-level scales while it double-quantizes
// them (one float per block), else nothing. quantize() holds the same on top of the tensor it allocates.
constexpr std::size_t workspace_bytes(const quantize_arguments& args) noexcept {
  return args.options.double_quant ? static_cast<std::size_t>(4 * block_count(args.dims.numel(), args.options.block_size))
                                   : 0;
}
// Quantizing keeps nothing for a backward pass.
constexpr std::size_t saved_bytes(const quantize_arguments&) noexcept { return 0; }
// What must be free when quantize_into starts: its workspace (the tensor's storage exists already).
constexpr std::size_t bytes_required(const quantize_arguments& args) noexcept { return workspace_bytes(args); }

// Exact bytes a quantized tensor of `dims` in format `fmt` allocates (codes and scales): what
// quantized_tensor<F>::bytes_required(dims, options) returns.
constexpr std::size_t quantized_tensor_bytes(format fmt, const shape& dims, const quant_options& options) noexcept {
  const std::int64_t blocks = block_count(dims.numel(), options.block_size);
  const std::int64_t scale_bytes =
      options.double_quant ? blocks + 4 * (nested_group_count(blocks) + 1) : 4 * blocks;
  return static_cast<std::size_t>(code_bytes(fmt, dims.numel()) + scale_bytes);
}

// --- quant::matmul and matmul_input_grad ---

// Options of a product; every field has a default that suits training shapes.
struct matmul_config {
  std::int64_t tile_floats = 1 << 16;   // host input gradient: dequantized values per tile (256 KiB of fp32)
  std::int64_t device_tile_floats = 1 << 26;  // CUDA large batch: values per tile (128 MiB of bf16): the whole
                                              // W of layers up to 8192 x 8192, so a training-shape product is one
                                              // dequantize and one cuBLAS call (4 tiles of 2^24 took 1.5-2.2x
                                              // dense bf16 at M = 1024 on an H200; docs/cuda.md)
  std::int64_t small_batch_limit = 8;   // CUDA: M up to this (and up to 8) uses the fused kernels
  bool device_gemv_shuffle = false;     // CUDA fused y (4-bit formats): true runs the register-codebook kernel (#30;
                                        // same bits, not yet run on a GPU: the verified shared-memory kernel stays
                                        // the default until tests/cuda/quant_test.cu has passed on one)
  int host_simd = 2;                    // host fused path: 2 best available, 1 at most AVX2, 0 portable C++
  int host_threads = 1;                 // host: threads over output columns, 0 = every hardware thread
};

// Which product: the forward y = x * dequant(W)^T, or the input gradient dx = dy * dequant(W).
enum class matmul_kind : std::uint8_t { forward, input_grad };

// One product's shape, for the byte functions (docs/architecture.md, "The component protocol"): M, N, K as in
// the header (W is [N, K]); `fmt` and `block_size` those of W; `element_bytes` is sizeof the activation type
// (4, or 2 for bf16 / fp16); `on_device` selects the CUDA plan; `config` the options the call will get.
struct matmul_arguments {
  matmul_kind kind = matmul_kind::forward;
  format fmt = format::nf4;
  std::int64_t block_size = 64;
  std::int64_t M = 0, N = 0, K = 0;
  std::size_t element_bytes = 4;
  bool on_device = false;
  matmul_config config{};
};

// Exactly the most a call takes from its workspace resource at once (all of it is returned by the end of the
// call, or on the CUDA path before work queued after it on the stream can run).
constexpr std::size_t workspace_bytes(const matmul_arguments& args) noexcept;
// A product keeps nothing for a backward pass: W gets no gradient, and the input gradient needs only dy.
constexpr std::size_t saved_bytes(const matmul_arguments&) noexcept { return 0; }
// What must be free when a call starts: its workspace (it allocates nothing else).
constexpr std::size_t bytes_required(const matmul_arguments& args) noexcept { return workspace_bytes(args); }

// --- the plans behind workspace_bytes (the kernels in quant/detail/ run them) ---

namespace detail {

// The host forward's fused path (detail/matmul_host.hpp) serves M up to this many rows.
inline constexpr std::int64_t host_fused_limit = 32;

// x is packed host_forward_rows rows at a time (so the workspace does not grow with the batch: 4.5 MiB of
// packed x for K = 4096), W decoded again for each such slice of rows.
inline constexpr std::int64_t host_forward_rows = 288;
struct host_forward_plan {
  linalg::detail::gemm_plan gemm{};  // one slice's product; its a_floats are 0: the A panels are the packed x
  std::int64_t rows = 0;             // rows of x per slice
  std::int64_t x_rows = 0;           // rows rounded up to linalg's row unit: packed x holds x_rows x K
  std::int64_t depth = 0;            // K
  std::int64_t decode_floats = 0;    // one part's decoded rows of W
  constexpr std::int64_t x_floats() const noexcept { return linalg::detail::round_up(x_rows * depth, 16); }
  constexpr std::int64_t floats() const noexcept {
    return x_floats() + gemm.parts() * (gemm.part_floats() + decode_floats);
  }
};

// The tiles of matmul_input_grad: each holds `rows` rows of W dequantized (at least host_gemm_min_rows, so
// packing dy for each tile stays small against the tile's products), multiplied into dx by linalg's gemm.
inline constexpr std::int64_t host_gemm_min_rows = 128;
struct host_tiled_plan {
  std::int64_t rows = 0;
  std::int64_t tile_floats = 0;      // the tile, rounded up to 64 bytes
  linalg::detail::gemm_plan gemm{};  // the product with a full tile
  constexpr std::int64_t part_floats() const noexcept { return tile_floats + gemm.parts() * gemm.part_floats(); }
};

// The CUDA fused kernels keep one accumulator per row of the batch: they serve M up to this many rows,
// and only when matmul_config::small_batch_limit allows; larger batches take the tiled cuBLAS path.
inline constexpr int device_fused_rows = 8;

// The tiled input-gradient kernel's geometry: a block of 256 threads owns 256 columns of dx; W is read in
// tiles of 8 KiB of codes (64 rows of 4-bit or 32 rows of int8 codes), 16 bytes per load.
inline constexpr int gemv_t_columns = 256;
inline constexpr int gemv_t_tile_bytes = 8192;

// Whether W's rows start 16-byte aligned, as the tiled kernel loads them (the codes pointer is checked too).
template <format F>
constexpr bool gemv_t_vector(std::int64_t K) noexcept {
  return K % codes_per_16_bytes<F> == 0;
}

// Ranges of W's rows the tiled kernel splits N into, so that small K still gives enough blocks: about 264
// blocks (two per SM of a 132-SM H100), at least 256 rows per range. A function of the shape alone, so
// the sums (and their bits) do not depend on the GPU.
constexpr std::int64_t gemv_t_splits(std::int64_t N, std::int64_t K) noexcept {
  constexpr std::int64_t target_blocks = 264, min_rows = 256;
  const std::int64_t column_blocks = (K + gemv_t_columns - 1) / gemv_t_columns;
  const std::int64_t wanted = (target_blocks + column_blocks - 1) / column_blocks;
  const std::int64_t most = (N + min_rows - 1) / min_rows;
  const std::int64_t splits = wanted < most ? wanted : most;
  return splits > 1 ? splits : 1;
}

// Rows of W dequantized per tile: at least one, at most N.
constexpr std::int64_t tile_rows(std::int64_t N, std::int64_t K, const matmul_config& config, bool on_device) noexcept {
  const std::int64_t floats = on_device ? config.device_tile_floats : config.tile_floats;
  const std::int64_t rows = K > 0 ? floats / K : 1;
  return rows < 1 ? 1 : rows < N ? rows : N;
}

// The host forward's fused path (detail/matmul_host.hpp): 4-bit W, rows of whole blocks, M up to host_fused_limit.
constexpr bool host_fused(matmul_kind kind, format fmt, std::int64_t block_size, std::int64_t M,
                          std::int64_t K) noexcept {
  return kind == matmul_kind::forward && is_four_bit(fmt) && M <= host_fused_limit && block_size > 0 &&
         K % block_size == 0;
}

// The host's threads (0 = every hardware thread, known only at run time).
constexpr std::int64_t host_matmul_threads(const matmul_config& config) noexcept {
  if (config.host_threads > 0) return config.host_threads;
  return config.host_threads == 0 ? resolve_host_threads(0) : 1;
}

constexpr host_forward_plan plan_host_forward(std::int64_t M, std::int64_t N, std::int64_t K, bool y_is_16_bit,
                                              const matmul_config& config) noexcept {
  using blocking = linalg::detail::gemm_blocking;
  host_forward_plan plan;
  plan.rows = M < host_forward_rows ? M : host_forward_rows;
  plan.gemm = linalg::detail::plan_gemm(plan.rows, N, K, host_matmul_threads(config), y_is_16_bit);
  plan.gemm.a_floats = 0;
  plan.depth = K;
  plan.x_rows = linalg::detail::round_up(plan.rows, blocking::row_unit);
  plan.decode_floats = linalg::detail::round_up(blocking::column_unit * (K < blocking::kc ? K : blocking::kc), 16);
  return plan;
}

// The input gradient: one tile of `rows` rows of W, multiplied into the fp32 dx (or its fp32 accumulator)
// by a gemm whose threads split dx's columns.
constexpr host_tiled_plan plan_host_input_grad(std::int64_t M, std::int64_t N, std::int64_t K,
                                               const matmul_config& config) noexcept {
  host_tiled_plan plan;
  const std::int64_t cache_rows = tile_rows(N, K, config, false);
  const std::int64_t rows = cache_rows > host_gemm_min_rows ? cache_rows : host_gemm_min_rows;
  plan.rows = rows < N ? rows : N;
  plan.tile_floats = linalg::detail::round_up(plan.rows * K, 16);
  plan.gemm = linalg::detail::plan_gemm(M, K, plan.rows, host_matmul_threads(config), false);
  return plan;
}

// The CUDA fused kernels (detail/matmul_kernels.hpp) serve M up to device_fused_rows when config allows.
constexpr bool device_fused(std::int64_t M, const matmul_config& config) noexcept {
  return M <= config.small_batch_limit && M <= device_fused_rows;
}

}  // namespace detail

constexpr std::size_t workspace_bytes(const matmul_arguments& args) noexcept {
  const matmul_kind kind = args.kind;
  const format fmt = args.fmt;
  const std::int64_t block_size = args.block_size, M = args.M, N = args.N, K = args.K;
  const std::size_t element_bytes = args.element_bytes;
  const bool on_device = args.on_device;
  const matmul_config& config = args.config;
  if (M == 0 || N == 0 || K == 0) return 0;  // an empty product only writes zeros (or nothing)
  const std::int64_t rows = detail::tile_rows(N, K, config, on_device);
  const bool fp32 = element_bytes == 4;
  if (!on_device) {
    if (detail::host_fused(kind, fmt, block_size, M, K)) return static_cast<std::size_t>(M * K) * 4;
    if (kind == matmul_kind::forward)
      return static_cast<std::size_t>(detail::plan_host_forward(M, N, K, !fp32, config).floats()) * 4;
    const detail::host_tiled_plan plan = detail::plan_host_input_grad(M, N, K, config);
    return static_cast<std::size_t>(plan.part_floats()) * 4 + (fp32 ? 0 : static_cast<std::size_t>(M * K) * 4);
  }
  if (detail::device_fused(M, config)) {
    // The tiled input-gradient kernel's partial sums, when it splits N (a function of the shape alone).
    if (kind != matmul_kind::input_grad || M == 0 || N == 0 || K == 0) return 0;
    const bool tiled = fmt == format::int8 ? detail::gemv_t_vector<format::int8>(K) : detail::gemv_t_vector<format::nf4>(K);
    const std::int64_t splits = tiled ? detail::gemv_t_splits(N, K) : 1;
    return splits > 1 ? static_cast<std::size_t>(splits * M * K) * 4 : 0;
  }
  const std::size_t tile = static_cast<std::size_t>(rows * K) * element_bytes;
  // A 16-bit dx summed over several tiles is accumulated in fp32; one tile writes dx directly.
  return tile + (kind == matmul_kind::input_grad && !fp32 && rows < N ? static_cast<std::size_t>(M * K) * 4 : 0);
}

}  // namespace quant

MEMKIT_NAMESPACE_END
