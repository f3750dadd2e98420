// memkit/models/llama/parameter.hpp — the trainable tensors of the decoder and where their bytes go.
//
// A parameter is a value in the training dtype (what the forward reads: bf16, or fp32), an optional fp32
// master copy (what AdamW updates when a bf16 model trains in mixed precision; the value then receives its
// rounding) and an fp32 gradient, each a
// memkit::buffer from the resource of its tracking category, so the tracker sees every byte. The buffers are
// host or device memory, as the resources are: values are made on the host and copied in (copy_in), and
// for_each_index runs one MEMKIT_HOST_DEVICE function over an index range on either executor (a plain loop on
// the host, a grid-stride kernel on exec.stream under nvcc), which is how every layer of the example keeps
// one implementation of its elementwise and per-row math.
#pragma once

#include <memkit/core/execution.hpp>
#include <memkit/core/float16.hpp>
#include <memkit/core/random.hpp>
#include <memkit/core/tensor_view.hpp>
#include <memkit/linalg/gemm.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace memkit::models::llama {

using memkit::bf16;
using memkit::shape;
using memkit::tensor_view;

// Where the model's memory comes from: one resource per tracking category (tracking_resource::category).
// All host memory, or all device memory (then the workspace resource must be stream-ordered).
struct memory_resources {
  memkit::memory_resource* weights = &memkit::default_host_resource();
  memkit::memory_resource* gradients = &memkit::default_host_resource();
  memkit::memory_resource* optimizer = &memkit::default_host_resource();  // fp32 master weights live here too
  memkit::memory_resource* workspace = &memkit::default_host_resource();
  int host_threads = 1;  // of every GEMM
  bool on_device() const noexcept { return weights->kind() != memkit::memory_kind::host; }
};

// ---- one function over an index range, on either executor ----
#if MEMKIT_HAS_CUDA
template <class F>
__global__ void for_each_kernel(std::int64_t count, F f) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    f(i);
}
#endif

// f(i) for i in [0, count): in order on the host; one thread per index on exec.stream on a CUDA executor
// (f is copied to the device, so it holds plain pointers and sizes; it must not depend on the order).
template <memkit::executor E, class F>
void for_each_index(const E& exec, std::int64_t count, const F& f) {
  if constexpr (!E::on_device) {
    (void)exec;
    for (std::int64_t i = 0; i < count; ++i) f(i);
  } else {
#if MEMKIT_HAS_CUDA
    if (count <= 0) return;
    memkit::detail::with_device(exec.device, [&] {
      for_each_kernel<F><<<memkit::detail::grid_for(count, 256), 256, 0, exec.stream>>>(count, f);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    });
#endif
  }
}

// to = from (same element count), ordered on exec's stream.
template <memkit::executor E, class T>
void copy_view(const E& exec, tensor_view<const T> from, tensor_view<T> to) {
  memkit::require(from.size() == to.size(), "llama::copy_view: the views differ in size");
  if constexpr (!E::on_device) {
    (void)exec;
    std::copy(from.begin(), from.end(), to.begin());
  } else {
#if MEMKIT_HAS_CUDA
    MEMKIT_CUDA_CHECK(cudaMemcpyAsync(to.data(), from.data(), from.bytes(), cudaMemcpyDefault, exec.stream));
#endif
  }
}

// Zeroes a view, ordered on exec's stream.
template <memkit::executor E, class T>
void zero_view(const E& exec, tensor_view<T> to) {
  if constexpr (!E::on_device) {
    (void)exec;
    if (!to.empty()) std::memset(static_cast<void*>(to.data()), 0, to.bytes());
  } else {
#if MEMKIT_HAS_CUDA
    if (!to.empty()) MEMKIT_CUDA_CHECK(cudaMemsetAsync(static_cast<void*>(to.data()), 0, to.bytes(), exec.stream));
#endif
  }
}

// Setup-time copies between the host and a view in host or device memory (synchronous: cudaMemcpy on the
// legacy default stream, so ordered after everything enqueued on blocking streams).
template <class T>
void copy_in(const T* host, tensor_view<T> to) {
  if (to.where() == memkit::memory_kind::host) {
    if (!to.empty()) std::memcpy(static_cast<void*>(to.data()), host, to.bytes());
    return;
  }
#if MEMKIT_HAS_CUDA
  MEMKIT_CUDA_CHECK(cudaMemcpy(to.data(), host, to.bytes(), cudaMemcpyHostToDevice));
#else
  throw memkit::error("llama::copy_in: device memory in a build without CUDA");
#endif
}
template <class T>
std::vector<std::remove_const_t<T>> copy_out(tensor_view<T> from) {
  std::vector<std::remove_const_t<T>> out(static_cast<std::size_t>(from.size()));
  if (from.where() == memkit::memory_kind::host) {
    if (!from.empty()) std::memcpy(static_cast<void*>(out.data()), from.data(), from.bytes());
    return out;
  }
#if MEMKIT_HAS_CUDA
  MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), from.data(), from.bytes(), cudaMemcpyDeviceToHost));
#else
  throw memkit::error("llama::copy_out: device memory in a build without CUDA");
#endif
  return out;
}

enum class trainability : std::uint8_t {
  frozen,         // value only, no gradient
  bf16_master,    // bf16 value, fp32 master copy (AdamW updates the master), fp32 gradient; an fp32 value
                  // needs no master copy and trains in place
  bf16_rounding,  // bf16 value updated in place with stochastic rounding, fp32 gradient
};

// W is the value's element type: the model's training dtype (bf16 in the examples; float for fp32 training
// and for the parity tests against transformers, which hold the checkpoint's values exactly).
template <class W>
struct basic_parameter {
  using value_type = W;
  static constexpr bool value_is_fp32 = std::is_same_v<W, float>;

  std::string name;
  trainability mode = trainability::frozen;
  memkit::buffer<W> value;
  memkit::buffer<float> master;  // unallocated unless bf16_master with a 16-bit value
  memkit::buffer<float> grad;    // unallocated when frozen

  basic_parameter() = default;
  basic_parameter(std::string name_, shape dims, const memory_resources& memory, trainability mode_)
      : name(std::move(name_)), mode(mode_), value(*memory.weights, dims) {
    if (has_master()) master = memkit::buffer<float>(*memory.optimizer, dims);
    if (mode != trainability::frozen) grad = memkit::buffer<float>(*memory.gradients, dims);
    zero_grad();
  }

  bool trains() const noexcept { return mode != trainability::frozen; }
  bool has_master() const noexcept { return mode == trainability::bf16_master && !value_is_fp32; }
  std::int64_t size() const noexcept { return value.size(); }
  // The master copy for adam_param (an empty view when there is none).
  tensor_view<float> master_view() noexcept { return has_master() ? master.view() : tensor_view<float>{}; }

  // Bytes a parameter of `dims` allocates in each category.
  static constexpr std::size_t value_bytes(const shape& dims) noexcept { return memkit::buffer<W>::bytes_required(dims); }
  static constexpr std::size_t master_bytes(const shape& dims, trainability mode) noexcept {
    return mode == trainability::bf16_master && !value_is_fp32 ? memkit::buffer<float>::bytes_required(dims) : 0;
  }
  static constexpr std::size_t grad_bytes(const shape& dims, trainability mode) noexcept {
    return mode == trainability::frozen ? 0 : memkit::buffer<float>::bytes_required(dims);
  }

  // Sets value (and master) from fp32 values on the host.
  void assign(const float* values) {
    if constexpr (value_is_fp32) {
      copy_in(values, value.view());
    } else {
      std::vector<W> rounded(static_cast<std::size_t>(size()));
      for (std::int64_t i = 0; i < size(); ++i) rounded[static_cast<std::size_t>(i)] = memkit::from_float<W>(values[i]);
      copy_in(rounded.data(), value.view());
    }
    if (has_master()) copy_in(values, master.view());
  }
  void fill(float v) {
    const std::vector<float> values(static_cast<std::size_t>(size()), v);
    assign(values.data());
  }
  // Normal(0, stddev) values drawn from (seed, stream) with memkit::random_word (Box-Muller).
  void init_normal(float stddev, std::uint64_t seed, std::uint64_t stream) {
    std::vector<float> values(static_cast<std::size_t>(size()));
    for (std::int64_t i = 0; i < size(); ++i) {
      const float u1 = (static_cast<float>(memkit::random_word(seed, stream, 2 * i) >> 8) + 0.5f) * (1.0f / 16777216.0f);
      const float u2 = memkit::unit_float(memkit::random_word(seed, stream, 2 * i + 1));
      const float z = std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
      values[static_cast<std::size_t>(i)] = stddev * z;
    }
    assign(values.data());
  }
  // Setup (synchronous); zero_grad(exec) in the training loop.
  void zero_grad() {
    if (!trains()) return;
    const std::vector<float> zeros(static_cast<std::size_t>(grad.size()), 0.0f);
    copy_in(zeros.data(), grad.view());
  }
  template <memkit::executor E>
  void zero_grad(const E& exec) {
    if (trains()) zero_view(exec, grad.view());
  }
};

// The bf16 parameter the examples train.
using parameter = basic_parameter<bf16>;

// --- small helpers shared by the layers ---

// A contiguous row-major block as a linalg matrix, in `where` memory.
template <class T>
memkit::linalg::matrix_ref<const T> cmat(const T* data, std::int64_t rows, std::int64_t cols, memkit::memory_kind where) {
  return {data, rows, cols, cols, where};
}
template <class T>
memkit::linalg::matrix_ref<T> mat(T* data, std::int64_t rows, std::int64_t cols, memkit::memory_kind where) {
  return {data, rows, cols, cols, where};
}

// The shape `s` with its last extent replaced.
inline shape with_last(shape s, std::int64_t last) {
  s.extents[s.rank - 1] = last;
  return s;
}
inline std::int64_t rows_of(const shape& s) { return s.numel() / s[s.rank - 1]; }

// A bump allocator over one workspace buffer: a layer takes all its temporaries from one allocation whose
// size it can state in advance (each piece aligned to 64 bytes).
class scratch_arena {
 public:
  static constexpr std::size_t align(std::size_t bytes) noexcept { return (bytes + 63) / 64 * 64; }
  template <class T>
  static constexpr std::size_t bytes_for(const shape& dims) noexcept {
    return align(static_cast<std::size_t>(dims.numel()) * sizeof(T));
  }

  // On a CUDA executor the allocation is stream-ordered on exec.stream (memkit::workspace_buffer).
  template <memkit::executor E>
  scratch_arena(const E& exec, memkit::memory_resource& resource, std::size_t bytes)
      : storage_(memkit::workspace_buffer<std::byte>(exec, resource, shape{static_cast<std::int64_t>(bytes)})) {}
  template <class T>
  tensor_view<T> take(const shape& dims) {
    const std::size_t bytes = bytes_for<T>(dims);
    memkit::require(used_ + bytes <= storage_.bytes(), "scratch_arena: the layer asked for more scratch than it predicted");
    T* data = reinterpret_cast<T*>(storage_.data() + used_);
    used_ += bytes;
    return {data, dims, storage_.where()};
  }

 private:
  memkit::buffer<std::byte> storage_;
  std::size_t used_ = 0;
};

}  // namespace memkit::models::llama
