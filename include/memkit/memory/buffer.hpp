// memkit/memory/buffer.hpp — an owning, typed, uninitialized allocation from a memory_resource.
//
// buffer<T> is the one way memkit components own memory: it remembers its resource, releases on
// destruction, and hands out tensor_views that carry the resource's memory kind. Like cudaMalloc,
// the contents start uninitialized. bytes_required() says what a buffer of a given shape will
// take before it is made, which is how components report their allocations ahead of time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "memkit/config.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN

template <class T>
class buffer {
  static_assert(std::is_trivially_copyable_v<T>, "buffer<T> holds raw bytes: T must be trivially copyable");

 public:
  static constexpr std::size_t bytes_required(const memkit::shape& dims) noexcept {
    return static_cast<std::size_t>(dims.numel()) * sizeof(T);
  }

  buffer() = default;
  buffer(memory_resource& resource, memkit::shape dims) : resource_(&resource), shape_(dims) {
    data_ = static_cast<T*>(resource.allocate(bytes(), default_alignment));
  }
  // Stream-ordered (memory_resource::allocate_on): allocated, and released on destruction, in the order of the
  // work on `where.stream`. How CUDA operations take workspace for the kernels they enqueue on that stream.
  buffer(memory_resource& resource, memkit::shape dims, on_stream where)
      : resource_(&resource), shape_(dims), stream_(where), stream_ordered_(true) {
    data_ = static_cast<T*>(resource.allocate_on(where, bytes(), default_alignment));
  }
  buffer(buffer&& other) noexcept
      : resource_(std::exchange(other.resource_, nullptr)),
        data_(std::exchange(other.data_, nullptr)),
        shape_(std::exchange(other.shape_, memkit::shape{})),
        stream_(other.stream_),
        stream_ordered_(std::exchange(other.stream_ordered_, false)) {}
  buffer& operator=(buffer&& other) noexcept {
    if (this != &other) {
      release();
      resource_ = std::exchange(other.resource_, nullptr);
      data_ = std::exchange(other.data_, nullptr);
      shape_ = std::exchange(other.shape_, memkit::shape{});
      stream_ = other.stream_;
      stream_ordered_ = std::exchange(other.stream_ordered_, false);
    }
    return *this;
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  ~buffer() { release(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  const memkit::shape& shape() const noexcept { return shape_; }
  std::int64_t size() const noexcept { return shape_.numel(); }
  std::size_t bytes() const noexcept { return bytes_required(shape_); }
  memory_kind where() const noexcept { return resource_ ? resource_->kind() : memory_kind::host; }
  memory_resource* resource() const noexcept { return resource_; }

  tensor_view<T> view() noexcept { return {data_, shape_, where()}; }
  tensor_view<const T> view() const noexcept { return {data_, shape_, where()}; }

 private:
  void release() noexcept {
    if (resource_ != nullptr) {
      if (stream_ordered_)
        resource_->deallocate_on(stream_, data_, bytes(), default_alignment);
      else
        resource_->deallocate(data_, bytes(), default_alignment);
    }
    data_ = nullptr;
  }

  memory_resource* resource_ = nullptr;
  T* data_ = nullptr;
  memkit::shape shape_{};
  on_stream stream_{};           // the stream of a stream-ordered buffer
  bool stream_ordered_ = false;
};

MEMKIT_NAMESPACE_END
