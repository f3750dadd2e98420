// memkit/lora/lora_linear.hpp — a linear layer with a frozen base weight and a trainable low-rank adapter
// (LoRA), over a dense fp32/bf16/fp16 base or a blockwise-quantized one (NF4/FP4: QLoRA; int8).
//
//   y = x W^T + b + scale * (dropout(x) A^T) B^T        W [out, in] frozen, A [r, in], B [out, r] trained
//   scale = alpha / r, or alpha / sqrt(r) with rsLoRA
//
// lora_linear<Base, T> — Base is the weight's storage: float, bf16 or fp16 (a dense weight, viewed, not
// owned) or quant::quantized_tensor<F> (referenced, not owned); T is the activation type (value_type:
// the base's element type for a dense base, float for a quantized one unless given). The adapters A and B
// are T, owned by the layer; their gradients are fp32 (so accumulation over micro-batches loses nothing),
// owned by the layer. All four are plain tensor_views an adam_state steps. The optional bias [out] is the
// caller's view; it trains (gets grad_bias()) only with lora_options::train_bias.
//
// Saved for backward, exactly (saved_activation_bytes, lora/bytes.hpp): the adapter's input dropout(x) [tokens, in] and its
// down-projection dropout(x) A^T [tokens, r], both T, plus a 32-byte record of the dropout stream. The
// dropout mask is not saved: backward draws it again from (seed, counter) — core/random.hpp, the same on
// host and CUDA, and the same when activation checkpointing recomputes the forward. The frozen base keeps
// nothing: its backward needs only the weight, and a quantized weight is dequantized again in backward,
// tile by tile, by quant::matmul_input_grad — never held dequantized between the passes.
//
// Host: the dense products run on linalg::gemm (packed, cache-blocked, AVX2/AVX-512 micro-kernels, memkit's
// host threads); the quantized base's on quant::matmul / matmul_input_grad. CUDA: cuBLAS (fp32 accumulation,
// tensor cores for bf16/fp16) and quant's matmul, all on the executor's stream, no synchronization.
// workspace_bytes(layer.forward_arguments(tokens)) / workspace_bytes(layer.backward_arguments(...)) say exactly
// what the passes take from the workspace resource given to the constructor (cuBLAS's own workspace, kept by
// its handle, is not counted).
//
// Merging: merge() adds scale * B A into a dense base in place and unmerge() subtracts it again. The
// product is computed once in fp32, in the same order both times, so unmerge(merge(W)) == W bit for bit
// whenever W + scale*B*A is exact in the weight's type (e.g. B = 0, or values on a coarse enough grid);
// otherwise each of the two roundings may move an element by half an ulp, and unmerge restores W to
// within one ulp of the merged value. A merged layer refuses forward (the adapter would be counted twice).
// A quantized base is never modified: merged_weight() writes dequant(W) + scale*B*A into a dense view,
// and merged_quantized() quantizes that again.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "memkit/core/layer.hpp"
#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/random.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/protocol.hpp"
#include "memkit/linalg/gemm.hpp"
#include "memkit/lora/bytes.hpp"
#include "memkit/lora/detail/kernels.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/matmul.hpp"
#include "memkit/quant/quantized_tensor.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace lora {

template <class Base, float_storage T = typename base_traits<Base>::default_activation>
class lora_linear {
  using traits = base_traits<Base>;

 public:
  using value_type = T;
  using base_type = Base;
  using weight_ref = typename traits::weight_ref;
  static constexpr bool quantized_base = traits::quantized;

  // `weight` [out, in] (dense: a view the layer may merge into; quantized: a tensor that must outlive the
  // layer). `bias` [out] or tensor_view<T>::none(). A, B and their gradients are allocated from `parameters`
  // and `gradients` (e.g. a tracker's weights and gradients categories), A initialised by options.init, B
  // zero, gradients zero. The passes and merges take their temporaries from `workspace` (exact sizes:
  // workspace_bytes of forward_arguments / backward_arguments / merge_arguments); it and the base weight must
  // outlive the layer.
  lora_linear(weight_ref weight, tensor_view<T> bias, const lora_options& options, memory_resource& parameters,
              memory_resource& gradients, memory_resource& workspace)
      : weight_(weight), bias_(bias), options_(checked(options)), workspace_(&workspace) {
    const shape ws = weight_shape();
    require(ws.rank == 2 && ws[0] > 0 && ws[1] > 0,
            "lora_linear: the base weight must be a non-empty matrix [out, in], has shape " + to_string(ws));
    out_ = ws[0];
    in_ = ws[1];
    if constexpr (!quantized_base) {
      require(weight_.data() != nullptr, "lora_linear: the base weight view is null");
      if (weight_.where() != memory_kind::device) require_finite_weight();
    }
    require(!has_bias() || bias_.shape() == shape{out_},
            "lora_linear: the bias has shape " + to_string(bias_.shape()) + " but the base weight " + to_string(ws) +
                " needs [" + std::to_string(out_) + "]");
    require(!options_.train_bias || has_bias(), "lora_linear: train_bias is set but the layer has no bias");
    const memory_kind base_where = base_memory();
    require(parameters.kind() == gradients.kind(),
            std::string("lora_linear: parameters are in ") + to_string(parameters.kind()) + " memory but gradients in " +
                to_string(gradients.kind()));
    require((parameters.kind() == memory_kind::device) == (base_where == memory_kind::device),
            std::string("lora_linear: the base weight is in ") + to_string(base_where) +
                " memory but the adapter would be allocated in " + to_string(parameters.kind()) + " memory");
    require((workspace.kind() == memory_kind::device) == (base_where == memory_kind::device),
            std::string("lora_linear: the base weight is in ") + to_string(base_where) +
                " memory but the workspace resource hands out " + to_string(workspace.kind()) + " memory");
    scale_ = static_cast<float>(detail::scale_of(options_));
    a_ = buffer<T>(parameters, shape{options_.rank, in_});
    b_ = buffer<T>(parameters, shape{out_, options_.rank});
    grad_a_ = buffer<float>(gradients, shape{options_.rank, in_});
    grad_b_ = buffer<float>(gradients, shape{out_, options_.rank});
    // shape {0} without a trainable bias: allocates nothing (a default buffer's rank-0 shape counts one element).
    grad_bias_ = buffer<float>(gradients, shape{options_.train_bias ? out_ : 0});
    initialize(options_.init, options_.init_seed);
    zero_grad();
  }
  lora_linear(weight_ref weight, const lora_options& options, memory_resource& parameters, memory_resource& gradients,
              memory_resource& workspace)
      : lora_linear(weight, tensor_view<T>::none(), options, parameters, gradients, workspace) {}

  lora_linear(lora_linear&&) noexcept = default;
  lora_linear& operator=(lora_linear&&) noexcept = default;
  lora_linear(const lora_linear&) = delete;
  lora_linear& operator=(const lora_linear&) = delete;

  // --- shape, scale, parameters ---
  std::int64_t in_features() const noexcept { return in_; }
  std::int64_t out_features() const noexcept { return out_; }
  std::int64_t rank() const noexcept { return options_.rank; }
  float scale() const noexcept { return scale_; }
  const lora_options& options() const noexcept { return options_; }
  bool merged() const noexcept { return merged_; }
  weight_ref weight() const noexcept { return weight_; }

  tensor_view<T> lora_A() noexcept { return a_.view(); }  // [r, in]
  tensor_view<T> lora_B() noexcept { return b_.view(); }  // [out, r]
  tensor_view<const T> lora_A() const noexcept { return a_.view(); }
  tensor_view<const T> lora_B() const noexcept { return b_.view(); }
  tensor_view<float> grad_A() noexcept { return grad_a_.view(); }
  tensor_view<float> grad_B() noexcept { return grad_b_.view(); }
  bool has_bias() const noexcept { return !bias_.is_none(); }
  tensor_view<T> bias() const noexcept { return bias_; }  // none() without a bias
  tensor_view<float> grad_bias() noexcept { return grad_bias_.view(); }  // empty unless train_bias
  // Element counts of the trainable tensors in the order A, B[, bias]: what adam_state is built for.
  std::vector<std::int64_t> parameter_sizes() const {
    std::vector<std::int64_t> sizes{a_.size(), b_.size()};
    if (options_.train_bias) sizes.push_back(out_);
    return sizes;
  }
  // Bytes the constructor allocated from `parameters` and from `gradients`.
  std::size_t parameter_bytes() const noexcept { return a_.bytes() + b_.bytes(); }
  std::size_t gradient_bytes() const noexcept { return grad_a_.bytes() + grad_b_.bytes() + grad_bias_.bytes(); }
  static constexpr std::size_t parameter_bytes(std::int64_t in, std::int64_t out, std::int64_t rank) noexcept {
    return static_cast<std::size_t>(adapter_parameter_count(in, out, rank)) * sizeof(T);
  }
  static constexpr std::size_t gradient_bytes(std::int64_t in, std::int64_t out, std::int64_t rank,
                                              bool train_bias) noexcept {
    return static_cast<std::size_t>(adapter_parameter_count(in, out, rank) + (train_bias ? out : 0)) * sizeof(float);
  }

  // Sets A by `method` from `seed` (host: here; device parameters: drawn on the host and copied) and B to zero.
  void initialize(init_method method, std::uint64_t seed) {
    std::vector<T> a(static_cast<std::size_t>(a_.size()));
    if (method == init_method::kaiming_uniform) {
      // torch's kaiming_uniform_(a = sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in) = 1 / sqrt(in).
      const double bound = 1.0 / std::sqrt(static_cast<double>(in_));
      for (std::size_t i = 0; i < a.size(); ++i) {
        const double u = unit_float(random_word(seed, detail::init_counter, i));
        a[i] = from_float<T>(static_cast<float>((2.0 * u - 1.0) * bound));
      }
    } else {
      const double stddev = 1.0 / static_cast<double>(options_.rank);
      for (std::size_t i = 0; i < a.size(); ++i) {  // Box-Muller on two independent words per element
        const double u1 = (static_cast<double>(random_word(seed, detail::init_counter + 1, i)) + 1.0) / 4294967297.0;
        const double u2 = unit_float(random_word(seed, detail::init_counter + 2, i));
        a[i] = from_float<T>(static_cast<float>(stddev * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2)));
      }
    }
    std::vector<T> zeros(static_cast<std::size_t>(b_.size()), from_float<T>(0.0f));
    copy_in(a_.view(), a.data());
    copy_in(b_.view(), zeros.data());
  }

  // Zeroes the gradients (host memory here; device memory with cudaMemset, synchronous).
  void zero_grad() {
    for (buffer<float>* g : {&grad_a_, &grad_b_, &grad_bias_}) {
      if (g->size() == 0) continue;
      if (g->where() == memory_kind::device) {
#if MEMKIT_HAS_CUDA
        MEMKIT_CUDA_CHECK(cudaMemset(g->data(), 0, g->bytes()));
#else
        throw error("lora_linear::zero_grad: gradients in device memory need a CUDA build");
#endif
      } else {
        std::memset(g->data(), 0, g->bytes());
      }
    }
  }
#if MEMKIT_HAS_CUDA
  // Zeroes the gradients on exec's stream (no synchronization).
  void zero_grad(const cuda_executor& exec) {
    for (buffer<float>* g : {&grad_a_, &grad_b_, &grad_bias_})
      if (g->size() != 0) MEMKIT_CUDA_CHECK(cudaMemsetAsync(g->data(), 0, g->bytes(), exec.stream));
  }
#endif

  // --- memkit::layer ---
  shape output_shape(const shape& in) const {
    require(in.rank >= 1 && in[in.rank - 1] == in_, "lora_linear: input of shape " + to_string(in) +
                                                        " does not end in the layer's " + std::to_string(in_) +
                                                        " input features");
    shape out = in;
    out.extents[in.rank - 1] = out_;
    return out;
  }
  std::size_t saved_bytes(const shape& in, const forward_context&) const {
    return saved_activation_bytes(tokens_of(in), in_, options_.rank, sizeof(T)).total();
  }
  // This layer's passes as protocol arguments: workspace_bytes(layer.forward_arguments(tokens)) etc.
  lora::forward_arguments<Base, T> forward_arguments(std::int64_t tokens, bool on_device = false) const noexcept {
    return {.tokens = tokens, .in = in_, .out = out_, .rank = options_.rank, .on_device = on_device,
            .options = options_, .block_size = block_size()};
  }
  lora::backward_arguments<Base, T> backward_arguments(std::int64_t tokens, bool dropout, bool input_grad = true,
                                                       bool on_device = false) const noexcept {
    return {forward_arguments(tokens, on_device), dropout, input_grad};
  }
  lora::merge_arguments<Base, T> merge_arguments(bool on_device = false) const noexcept {
    return {.in = in_, .out = out_, .rank = options_.rank, .on_device = on_device, .options = options_};
  }
  // Whether a forward with `ctx` applies dropout.
  bool applies_dropout(const forward_context& ctx) const noexcept { return ctx.training && options_.dropout > 0.0f; }

  // The workspace resource the passes and merges take their temporaries from (given to the constructor).
  memory_resource& workspace() const noexcept { return *workspace_; }

  template <executor E>
  void forward(const E& exec, const forward_context& ctx, tensor_view<const T> x, tensor_view<T> y,
               activation_store& store) {
    constexpr const char* op = "lora_linear::forward";
    require(!merged_, std::string(op) + ": the adapter is merged into the base weight; unmerge() first (a merged "
                                        "layer's weight serves a plain linear)");
    const shape expected = output_shape(x.shape());
    require(y.shape() == expected, std::string(op) + ": y has shape " + to_string(y.shape()) + " but x " +
                                       to_string(x.shape()) + " needs " + to_string(expected));
    check_access(exec, op, x, "x");
    check_access(exec, op, y, "y");
    require(exec.can_access(store.resource().kind()),
            std::string(op) + ": the activation store's memory (" + to_string(store.resource().kind()) +
                ") is not accessible to the " + E::name() + " executor");
    const std::int64_t M = tokens_of(x.shape()), r = options_.rank;
    const bool dropout = applies_dropout(ctx);
    const float keep_scale = dropout ? 1.0f / (1.0f - options_.dropout) : 1.0f;
    const std::size_t saved_before = store.size();
    try {
      // The record first, so backward takes it last: a backward whose dy does not match fails on the
      // first take, before anything has left the store.
      tensor_view<std::uint64_t> record = store.save<std::uint64_t>(shape{record_words});
      tensor_view<T> adapter_in = store.save<T>(shape{M, in_});
      tensor_view<T> down = store.save<T>(shape{M, r});
      memory_resource& ws = workspace();
      const auto x2 = detail::matrix<const T>(x.data(), M, in_, x.where());
      const auto y2 = detail::matrix<T>(y.data(), M, out_, y.where());
      const auto ain = detail::matrix<const T>(adapter_in.data(), M, in_, adapter_in.where());
      const auto down2 = detail::matrix<T>(down.data(), M, r, down.where());
      if constexpr (!E::on_device) {
        record[0] = ctx.seed;
        record[1] = ctx.counter;
        record[2] = dropout ? 1 : 0;
        record[3] = static_cast<std::uint64_t>(M);
        if (dropout) {
          for (std::int64_t i = 0; i < M * in_; ++i)
            adapter_in[i] = detail::dropout_keeps(ctx.seed, ctx.counter, static_cast<std::uint64_t>(i), options_.dropout)
                                ? from_float<T>(to_float(x[i]) * keep_scale)
                                : from_float<T>(0.0f);
        } else {
          std::memcpy(adapter_in.data(), x.data(), x.bytes());
        }
      } else {
#if MEMKIT_HAS_CUDA
        ::memkit::detail::with_device(exec.device, [&] {
          detail::write_record_kernel<std::uint64_t><<<1, 1, 0, exec.stream>>>(
              record.data(), ctx.seed, ctx.counter, dropout ? 1 : 0, static_cast<std::uint64_t>(M));
          MEMKIT_CUDA_CHECK(cudaGetLastError());
          if (dropout) {
            detail::dropout_input_kernel<T><<<::memkit::detail::grid_for(M * in_, 256), 256, 0, exec.stream>>>(
                x.data(), adapter_in.data(), M * in_, ctx.seed, ctx.counter, options_.dropout, keep_scale);
            MEMKIT_CUDA_CHECK(cudaGetLastError());
          } else {
            MEMKIT_CUDA_CHECK(cudaMemcpyAsync(adapter_in.data(), x.data(), x.bytes(), cudaMemcpyDefault, exec.stream));
          }
          return 0;
        });
#endif
      }
      // y = x W^T (+ b)
      if constexpr (quantized_base) {
        quant::matmul(exec, x, *weight_, y, options_.matmul, ws);
      } else {
        product(exec, linalg::transpose::no, linalg::transpose::yes, 1.0f, x2, base_matrix(), 0.0f, y2, ws);
      }
      if (has_bias()) add_bias(exec, y, M);
      // down = dropout(x) A^T; y += scale * down B^T
      product(exec, linalg::transpose::no, linalg::transpose::yes, 1.0f, ain, a_matrix(), 0.0f, down2, ws);
      product(exec, linalg::transpose::no, linalg::transpose::yes, scale_, linalg::matrix_ref<const T>(down2),
              b_matrix(), 1.0f, y2, ws);
    } catch (...) {
      store.release_to(saved_before);  // a failed forward leaves the store as it found it
      throw;
    }
  }

  template <executor E>
  void backward(const E& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
    constexpr const char* op = "lora_linear::backward";
    require(dy.shape().rank >= 1 && dy.shape()[dy.shape().rank - 1] == out_,
            std::string(op) + ": dy has shape " + to_string(dy.shape()) + " but the layer has " +
                std::to_string(out_) + " output features");
    const std::int64_t M = tokens_of_output(dy.shape()), r = options_.rank;
    const bool want_dx = !dx.is_none();  // none(): no input gradient wanted
    if (want_dx) {
      shape in_shape = dy.shape();
      in_shape.extents[in_shape.rank - 1] = in_;
      require(dx.shape() == in_shape, std::string(op) + ": dx has shape " + to_string(dx.shape()) + " but dy " +
                                          to_string(dy.shape()) + " needs " + to_string(in_shape));
    }
    check_access(exec, op, dy, "dy");
    check_access(exec, op, dx, "dx");
    saved_tensor<T> down = store.take<T>(shape{M, r}, op);
    saved_tensor<T> adapter_in = store.take<T>(shape{M, in_}, op);
    saved_tensor<std::uint64_t> record = store.take<std::uint64_t>(shape{record_words}, op);
    memory_resource& ws = workspace();
    using D = detail::down_grad_t<T, E::on_device>;
    const auto dy2 = detail::matrix<const T>(dy.data(), M, out_, dy.where());
    const auto down2 = detail::matrix<const T>(down.view().data(), M, r, down.view().where());
    const auto ain = detail::matrix<const T>(adapter_in.view().data(), M, in_, adapter_in.view().where());
    buffer<D> d_down = workspace_buffer<D>(exec, ws, shape{M, r});  // on exec.stream under CUDA
    const auto dd = detail::matrix<D>(d_down.data(), M, r, d_down.where());
    // dB += scale * dy^T down;  d(down) = scale * dy B;  dA += d(down)^T dropout(x)
    product(exec, linalg::transpose::yes, linalg::transpose::no, scale_, dy2, down2, 1.0f,
            detail::matrix<float>(grad_b_.data(), out_, r, grad_b_.where()), ws);
    product(exec, linalg::transpose::no, linalg::transpose::no, scale_, dy2, b_matrix(), 0.0f, dd, ws);
    product(exec, linalg::transpose::yes, linalg::transpose::no, 1.0f, linalg::matrix_ref<const D>(dd), ain, 1.0f,
            detail::matrix<float>(grad_a_.data(), r, in_, grad_a_.where()), ws);
    if (options_.train_bias) accumulate_bias_grad(exec, dy, M);
    if (!want_dx) return;
    // dx = dy W, then the adapter's part: dropout'(d(down) A)
    if constexpr (quantized_base) {
      quant::matmul_input_grad(exec, dy, *weight_, dx, options_.matmul, ws);
    } else {
      product(exec, linalg::transpose::no, linalg::transpose::no, 1.0f, dy2, base_matrix(), 0.0f,
              detail::matrix<T>(dx.data(), M, in_, dx.where()), ws);
    }
    bool dropout = false;
    if constexpr (!E::on_device) dropout = record.view()[2] != 0;
    else dropout = options_.dropout > 0.0f;  // the host cannot read the device's record without waiting: with
                                             // p > 0 the masked path runs, and its kernel reads the record's flag
    if (!dropout) {
      product(exec, linalg::transpose::no, linalg::transpose::no, 1.0f, linalg::matrix_ref<const D>(dd), a_matrix(),
              1.0f, detail::matrix<T>(dx.data(), M, in_, dx.where()), ws);
      return;
    }
    const float keep_scale = 1.0f / (1.0f - options_.dropout);
    const std::int64_t chunk = std::min(M, detail::masked_rows);
    buffer<D> temp = workspace_buffer<D>(exec, ws, shape{chunk, in_});
    for (std::int64_t row0 = 0; row0 < M; row0 += chunk) {
      const std::int64_t rows = std::min(chunk, M - row0);
      product(exec, linalg::transpose::no, linalg::transpose::no, 1.0f,
              linalg::matrix_ref<const D>(detail::matrix<D>(dd.data + row0 * r, rows, r, dd.where)), a_matrix(), 0.0f,
              detail::matrix<D>(temp.data(), rows, in_, temp.where()), ws);
      if constexpr (!E::on_device) {
        const std::uint64_t seed = record.view()[0], counter = record.view()[1];
        for (std::int64_t i = 0; i < rows * in_; ++i) {
          const std::int64_t flat = row0 * in_ + i;
          if (detail::dropout_keeps(seed, counter, static_cast<std::uint64_t>(flat), options_.dropout))
            dx[flat] = from_float<T>(to_float(dx[flat]) + temp.data()[i] * keep_scale);
        }
      } else {
#if MEMKIT_HAS_CUDA
        ::memkit::detail::with_device(exec.device, [&] {
          detail::masked_add_kernel<T, D><<<::memkit::detail::grid_for(rows * in_, 256), 256, 0, exec.stream>>>(
              dx.data() + row0 * in_, temp.data(), rows, in_, row0, record.view().data(), options_.dropout, keep_scale);
          MEMKIT_CUDA_CHECK(cudaGetLastError());
          return 0;
        });
#endif
      }
    }
  }

  // --- merging ---

  // Dense base: W += scale * B A, in place. Throws if already merged.
  template <executor E>
  void merge(const E& exec) requires(!quantized_base) {
    require(!merged_, "lora_linear::merge: the adapter is already merged");
    check_access(exec, "lora_linear::merge", weight_, "weight");
    product(exec, linalg::transpose::no, linalg::transpose::no, scale_, b_matrix(), a_matrix(), 1.0f,
            detail::matrix<Base>(weight_.data(), out_, in_, weight_.where()), workspace());
    merged_ = true;
  }
  // Dense base: W -= scale * B A (the same fp32 product merge added). Throws unless merged.
  template <executor E>
  void unmerge(const E& exec) requires(!quantized_base) {
    require(merged_, "lora_linear::unmerge: the adapter is not merged");
    product(exec, linalg::transpose::no, linalg::transpose::no, -scale_, b_matrix(), a_matrix(), 1.0f,
            detail::matrix<Base>(weight_.data(), out_, in_, weight_.where()), workspace());
    merged_ = false;
  }

  // Writes the merged weight W + scale * B A into `out` [out, in] (any float type), leaving the base as it is.
  template <executor E, float_storage W>
  void merged_weight(const E& exec, tensor_view<W> out) const {
    constexpr const char* op = "lora_linear::merged_weight";
    require(out.shape() == shape{out_, in_}, std::string(op) + ": out has shape " + to_string(out.shape()) +
                                                 ", expected [" + std::to_string(out_) + ", " + std::to_string(in_) + "]");
    check_access(exec, op, out, "out");
    if constexpr (quantized_base) {
      weight_->dequantize(exec, out);
    } else {
      require(!merged_, std::string(op) + ": the adapter is already merged into the base; read the base weight");
      copy_weight(exec, out);
    }
    product(exec, linalg::transpose::no, linalg::transpose::no, scale_, b_matrix(), a_matrix(), 1.0f,
            detail::matrix<W>(out.data(), out_, in_, out.where()), workspace());
  }

  // Quantized base: the merged weight quantized again in the base's format with `quant_options`, allocated
  // from `resource`; `staging` holds the fp32 merged weight meanwhile (out * in * 4 bytes).
  template <executor E>
  Base merged_quantized(const E& exec, const quant::quant_options& quant_options, memory_resource& resource,
                        memory_resource& staging) const
    requires(quantized_base)
  {
    buffer<float> dense(staging, shape{out_, in_});
    merged_weight(exec, dense.view());
    return Base::quantize(exec, tensor_view<const float>(dense.view()), quant_options, resource, "merged weight");
  }

 private:
  static lora_options checked(const lora_options& o) {
    require(o.rank > 0, "lora_linear: rank must be positive, got " + std::to_string(o.rank));
    require(std::isfinite(o.alpha) && o.alpha != 0.0, "lora_linear: alpha must be finite and non-zero, got " +
                                                          std::to_string(o.alpha));
    require(o.dropout >= 0.0f && o.dropout < 1.0f,
            "lora_linear: dropout must be in [0, 1), got " + std::to_string(o.dropout));
    require_host_threads("lora_linear", o.host_threads);
    return o;
  }

  shape weight_shape() const {
    if constexpr (quantized_base) {
      require(weight_ != nullptr, "lora_linear: the quantized base weight is null");
      return weight_->logical_shape();
    } else {
      return weight_.shape();
    }
  }
  memory_kind base_memory() const noexcept {
    if constexpr (quantized_base) return weight_->where();
    else return weight_.where();
  }
  std::int64_t block_size() const noexcept {
    if constexpr (quantized_base) return weight_->block_size();
    else return 64;
  }
  std::int64_t tokens_of(const shape& s) const {
    require(s.rank >= 1 && s[s.rank - 1] == in_, "lora_linear: input of shape " + to_string(s) +
                                                     " does not end in the layer's " + std::to_string(in_) +
                                                     " input features");
    return s.numel() / in_;
  }
  std::int64_t tokens_of_output(const shape& s) const { return s.numel() / out_; }

  void require_finite_weight() const {
    for (std::int64_t i = 0; i < weight_.size(); ++i)
      if (!std::isfinite(to_float(weight_[i])))
        throw error("lora_linear: the base weight holds " + std::to_string(to_float(weight_[i])) + " at [" +
                    std::to_string(i / in_) + ", " + std::to_string(i % in_) + "]");
  }

  template <executor E, class V>
  static void check_access(const E& exec, const char* op, const tensor_view<V>& view, const char* name) {
    require_accessible(exec, view, op, name);
  }

  linalg::matrix_ref<const T> a_matrix() const noexcept { return detail::matrix<const T>(a_.data(), options_.rank, in_, a_.where()); }
  linalg::matrix_ref<const T> b_matrix() const noexcept { return detail::matrix<const T>(b_.data(), out_, options_.rank, b_.where()); }
  auto base_matrix() const noexcept requires(!quantized_base) {
    return detail::matrix<const Base>(weight_.data(), out_, in_, weight_.where());
  }

  // One product on the executor: linalg::gemm (the host kernel, or cuBLAS on a cuda_executor).
  template <executor E, class TA, class TB, class TC>
  void product(const E& exec, linalg::transpose op_a, linalg::transpose op_b, float alpha, linalg::matrix_ref<const TA> A,
               linalg::matrix_ref<const TB> B, float beta, linalg::matrix_ref<TC> C, memory_resource& ws) const {
    linalg::gemm(exec, op_a, op_b, alpha, A, B, beta, C, ws, linalg::gemm_options{options_.host_threads});
  }

  template <executor E>
  void add_bias([[maybe_unused]] const E& exec, tensor_view<T> y, std::int64_t M) const {
    check_access(exec, "lora_linear::forward", bias_, "bias");
    if constexpr (!E::on_device) {
      for (std::int64_t m = 0; m < M; ++m)
        for (std::int64_t o = 0; o < out_; ++o) y[m * out_ + o] = from_float<T>(to_float(y[m * out_ + o]) + to_float(bias_[o]));
    } else {
#if MEMKIT_HAS_CUDA
      ::memkit::detail::with_device(exec.device, [&] {
        detail::add_bias_kernel<T><<<::memkit::detail::grid_for(M * out_, 256), 256, 0, exec.stream>>>(y.data(), bias_.data(), M, out_);
        MEMKIT_CUDA_CHECK(cudaGetLastError());
        return 0;
      });
#endif
    }
  }

  template <executor E>
  void accumulate_bias_grad([[maybe_unused]] const E& exec, tensor_view<const T> dy, std::int64_t M) {
    if constexpr (!E::on_device) {
      float* g = grad_bias_.data();
      for (std::int64_t m = 0; m < M; ++m)
        for (std::int64_t o = 0; o < out_; ++o) g[o] += to_float(dy[m * out_ + o]);
    } else {
#if MEMKIT_HAS_CUDA
      ::memkit::detail::with_device(exec.device, [&] {
        detail::bias_grad_kernel<T><<<::memkit::detail::grid_for(out_, 256), 256, 0, exec.stream>>>(dy.data(), grad_bias_.data(), M, out_);
        MEMKIT_CUDA_CHECK(cudaGetLastError());
        return 0;
      });
#endif
    }
  }

  template <executor E, float_storage W>
  void copy_weight([[maybe_unused]] const E& exec, tensor_view<W> out) const requires(!quantized_base) {
    if constexpr (!E::on_device) {
      for (std::int64_t i = 0; i < out.size(); ++i) out[i] = from_float<W>(to_float(weight_[i]));
    } else {
#if MEMKIT_HAS_CUDA
      static_assert(std::is_same_v<W, Base>, "lora_linear::merged_weight on CUDA writes the base's own type");
      MEMKIT_CUDA_CHECK(cudaMemcpyAsync(out.data(), weight_.data(), weight_.bytes(), cudaMemcpyDefault, exec.stream));
#endif
    }
  }

  template <class V>
  static void copy_in(tensor_view<V> target, const V* source) {
    if (target.where() == memory_kind::device) {
#if MEMKIT_HAS_CUDA
      MEMKIT_CUDA_CHECK(cudaMemcpy(target.data(), source, target.bytes(), cudaMemcpyHostToDevice));
#else
      throw error("lora_linear: parameters in device memory need a CUDA build");
#endif
    } else {
      std::memcpy(target.data(), source, target.bytes());
    }
  }

  weight_ref weight_{};
  tensor_view<T> bias_{};
  lora_options options_{};
  std::int64_t in_ = 0, out_ = 0;
  float scale_ = 1.0f;
  bool merged_ = false;
  buffer<T> a_, b_;
  buffer<float> grad_a_, grad_b_, grad_bias_;
  memory_resource* workspace_;
};

static_assert(layer<lora_linear<float>, host_executor>);
static_assert(layer<lora_linear<bf16>, host_executor>);
static_assert(layer<lora_linear<quant::quantized_tensor<quant::NF4>>, host_executor>);
#if MEMKIT_HAS_CUDA
static_assert(layer<lora_linear<bf16>, cuda_executor>);
static_assert(layer<lora_linear<quant::quantized_tensor<quant::NF4>, bf16>, cuda_executor>);
#endif

}  // namespace lora

MEMKIT_NAMESPACE_END
