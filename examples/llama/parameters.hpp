// examples/llama/parameters.hpp — the trainable tensors of the example model and where their bytes go.
//
// A parameter is a bf16 value (what the forward reads), an optional fp32 master copy (what AdamW updates
// when training in mixed precision; the value then receives its rounding) and an fp32 gradient, each a
// memkit::buffer from the resource of its tracking category, so the tracker sees every byte.
#pragma once

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
#include <utility>

namespace llama {

using memkit::bf16;
using memkit::shape;
using memkit::tensor_view;

// Where the model's memory comes from: one resource per tracking category (tracking_resource::category).
struct memory_resources {
  memkit::memory_resource* weights = &memkit::default_host_resource();
  memkit::memory_resource* gradients = &memkit::default_host_resource();
  memkit::memory_resource* optimizer = &memkit::default_host_resource();  // fp32 master weights live here too
  memkit::memory_resource* workspace = &memkit::default_host_resource();
  int host_threads = 1;  // of every GEMM
};

enum class trainability : std::uint8_t {
  frozen,         // value only, no gradient
  bf16_master,    // bf16 value, fp32 master copy (AdamW updates the master), fp32 gradient
  bf16_rounding,  // bf16 value updated in place with stochastic rounding, fp32 gradient
};

struct parameter {
  std::string name;
  trainability mode = trainability::frozen;
  memkit::buffer<bf16> value;
  memkit::buffer<float> master;  // unallocated unless bf16_master
  memkit::buffer<float> grad;    // unallocated when frozen

  parameter() = default;
  parameter(std::string name_, shape dims, const memory_resources& memory, trainability mode_)
      : name(std::move(name_)), mode(mode_), value(*memory.weights, dims) {
    if (mode == trainability::bf16_master) master = memkit::buffer<float>(*memory.optimizer, dims);
    if (mode != trainability::frozen) grad = memkit::buffer<float>(*memory.gradients, dims);
    zero_grad();
  }

  bool trains() const noexcept { return mode != trainability::frozen; }
  bool has_master() const noexcept { return mode == trainability::bf16_master; }
  std::int64_t size() const noexcept { return value.size(); }
  // The master copy for adam_param (an empty view when there is none).
  tensor_view<float> master_view() noexcept { return has_master() ? master.view() : tensor_view<float>{}; }

  // Bytes a parameter of `dims` allocates in each category.
  static constexpr std::size_t value_bytes(const shape& dims) noexcept { return memkit::buffer<bf16>::bytes_required(dims); }
  static constexpr std::size_t master_bytes(const shape& dims, trainability mode) noexcept {
    return mode == trainability::bf16_master ? memkit::buffer<float>::bytes_required(dims) : 0;
  }
  static constexpr std::size_t grad_bytes(const shape& dims, trainability mode) noexcept {
    return mode == trainability::frozen ? 0 : memkit::buffer<float>::bytes_required(dims);
  }

  // Sets value (and master) from fp32 values.
  void assign(const float* values) {
    for (std::int64_t i = 0; i < size(); ++i) value.data()[i] = memkit::from_float<bf16>(values[i]);
    if (has_master()) std::memcpy(master.data(), values, master.bytes());
  }
  void fill(float v) {
    for (std::int64_t i = 0; i < size(); ++i) value.data()[i] = memkit::from_float<bf16>(v);
    if (has_master()) std::fill(master.data(), master.data() + master.size(), v);
  }
  // Normal(0, stddev) values drawn from (seed, stream) with memkit::random_word (Box-Muller).
  void init_normal(float stddev, std::uint64_t seed, std::uint64_t stream) {
    for (std::int64_t i = 0; i < size(); ++i) {
      const float u1 = (static_cast<float>(memkit::random_word(seed, stream, 2 * i) >> 8) + 0.5f) * (1.0f / 16777216.0f);
      const float u2 = memkit::unit_float(memkit::random_word(seed, stream, 2 * i + 1));
      const float z = std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
      const float v = stddev * z;
      value.data()[i] = memkit::from_float<bf16>(v);
      if (has_master()) master.data()[i] = v;
    }
  }
  void zero_grad() {
    if (trains()) std::memset(grad.data(), 0, grad.bytes());
  }
};

// --- small helpers shared by the layers ---

// A contiguous row-major block as a linalg matrix.
template <class T>
memkit::linalg::matrix_ref<const T> cmat(const T* data, std::int64_t rows, std::int64_t cols) {
  return {data, rows, cols, cols, memkit::memory_kind::host};
}
template <class T>
memkit::linalg::matrix_ref<T> mat(T* data, std::int64_t rows, std::int64_t cols) {
  return {data, rows, cols, cols, memkit::memory_kind::host};
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

  scratch_arena(memkit::memory_resource& resource, std::size_t bytes)
      : storage_(resource, shape{static_cast<std::int64_t>(bytes)}) {}
  template <class T>
  tensor_view<T> take(const shape& dims) {
    const std::size_t bytes = bytes_for<T>(dims);
    memkit::require(used_ + bytes <= storage_.bytes(), "scratch_arena: the layer asked for more scratch than it predicted");
    T* data = reinterpret_cast<T*>(storage_.data() + used_);
    used_ += bytes;
    return {data, dims, memkit::memory_kind::host};
  }

 private:
  memkit::buffer<std::byte> storage_;
  std::size_t used_ = 0;
};

}  // namespace llama
