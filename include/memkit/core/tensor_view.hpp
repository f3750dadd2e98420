// memkit/core/tensor_view.hpp — where memory lives, tensor shapes, and non-owning typed views.
//
// A tensor_view is a pointer, a row-major shape and the kind of memory the pointer points into.
// Carrying the memory kind is what lets an operation reject, with a readable error, a device
// pointer handed to the host path (or pageable host memory handed to a kernel) instead of crashing.
// Views are trivially copyable and usable inside kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/checked_math.hpp"

MEMKIT_NAMESPACE_BEGIN

enum class memory_kind : std::uint8_t {
  host,         // pageable host memory (malloc, new, std::vector)
  pinned_host,  // page-locked host memory; also addressable by CUDA devices
  device,       // CUDA device memory
  managed,      // CUDA managed (unified) memory, paged between host and device on demand
};

constexpr const char* to_string(memory_kind kind) noexcept {
  switch (kind) {
    case memory_kind::host: return "host";
    case memory_kind::pinned_host: return "pinned_host";
    case memory_kind::device: return "device";
    case memory_kind::managed: return "managed";
  }
  return "unknown";
}

// Row-major extents of rank 0..4. Rank 0 is a scalar (one element). The constructor refuses extents whose
// element count does not fit int64, so numel() of a constructed shape never overflows.
struct shape {
  static constexpr int max_rank = 4;
  int rank = 0;
  std::int64_t extents[max_rank] = {};

  constexpr shape() = default;
  constexpr shape(std::initializer_list<std::int64_t> dims) {
    if (dims.size() > static_cast<std::size_t>(max_rank)) throw error("memkit::shape: rank above 4 is not supported");
    std::int64_t count = 1;
    for (std::int64_t d : dims) {
      if (d < 0) throw error("memkit::shape: negative extent " + std::to_string(d));
      count = checked_mul(count, d, "memkit::shape: element count");
      extents[rank++] = d;
    }
  }

  MEMKIT_HOST_DEVICE constexpr std::int64_t operator[](int axis) const noexcept { return extents[axis]; }
  MEMKIT_HOST_DEVICE constexpr std::int64_t numel() const noexcept {
    std::int64_t count = 1;
    // The bound on max_rank costs nothing and stops GCC 12 from warning (maybe-uninitialized) at -O3.
    for (int i = 0; i < rank && i < max_rank; ++i) count *= extents[i];
    return count;
  }
  MEMKIT_HOST_DEVICE constexpr bool operator==(const shape& other) const noexcept {
    if (rank != other.rank) return false;
    for (int i = 0; i < rank; ++i)
      if (extents[i] != other.extents[i]) return false;
    return true;
  }
};

inline std::string to_string(const shape& s) {
  std::string text = "[";
  for (int i = 0; i < s.rank; ++i) {
    text += i ? ", " : "";  // two appends, not "," + to_string(...): GCC 12 at -O3 warns (-Wrestrict) on that
    text += std::to_string(s.extents[i]);
  }
  return text + "]";
}

template <class T>
class tensor_view {
 public:
  using element_type = T;

  // A default view is none(): "no tensor here" (no gradient wanted, no bias). It is rank 0 with a null pointer,
  // which no real tensor is (a rank-0 tensor holds one element), so an empty tensor (shape{0}) is never absent.
  constexpr tensor_view() = default;
  MEMKIT_HOST_DEVICE static constexpr tensor_view none() noexcept { return {}; }
  MEMKIT_HOST_DEVICE constexpr bool is_none() const noexcept { return data_ == nullptr && shape_.rank == 0; }
  MEMKIT_HOST_DEVICE constexpr tensor_view(T* data, memkit::shape dims, memory_kind where) noexcept
      : data_(data), shape_(dims), where_(where) {}

  // A view of T converts to a view of const T, never the other way.
  template <class U>
    requires(!std::is_same_v<U, T> && std::is_convertible_v<U (*)[], T (*)[]>)
  MEMKIT_HOST_DEVICE constexpr tensor_view(const tensor_view<U>& other) noexcept
      : data_(other.data()), shape_(other.shape()), where_(other.where()) {}

  MEMKIT_HOST_DEVICE constexpr T* data() const noexcept { return data_; }
  MEMKIT_HOST_DEVICE constexpr const memkit::shape& shape() const noexcept { return shape_; }
  MEMKIT_HOST_DEVICE constexpr memory_kind where() const noexcept { return where_; }
  MEMKIT_HOST_DEVICE constexpr std::int64_t size() const noexcept { return shape_.numel(); }
  MEMKIT_HOST_DEVICE constexpr std::size_t bytes() const noexcept {
    return static_cast<std::size_t>(size()) * sizeof(T);
  }
  MEMKIT_HOST_DEVICE constexpr bool empty() const noexcept { return size() == 0; }
  MEMKIT_HOST_DEVICE constexpr T& operator[](std::int64_t flat_index) const noexcept { return data_[flat_index]; }
  MEMKIT_HOST_DEVICE constexpr T* begin() const noexcept { return data_; }
  MEMKIT_HOST_DEVICE constexpr T* end() const noexcept { return data_ + size(); }

  // The same memory seen with another shape of the same element count.
  tensor_view reshaped(memkit::shape dims) const {
    require(dims.numel() == size(), "tensor_view::reshaped: cannot view " + to_string(shape_) + " as " +
                                        to_string(dims) + " (element counts differ)");
    return {data_, dims, where_};
  }
  // Elements [offset, offset + count) of the flattened view, as a rank-1 view.
  tensor_view flat_slice(std::int64_t offset, std::int64_t count) const {
    require(within_range(offset, count, size()),
            "tensor_view::flat_slice: " + std::to_string(count) + " elements from offset " + std::to_string(offset) +
                " are outside a view of " + std::to_string(size()) + " elements");
    return {data_ + offset, memkit::shape{count}, where_};
  }

 private:
  T* data_ = nullptr;
  memkit::shape shape_{};
  memory_kind where_ = memory_kind::host;
};

// A view of ordinary host memory, e.g. a std::vector's data().
template <class T>
constexpr tensor_view<T> host_view(T* data, shape dims) noexcept {
  return {data, dims, memory_kind::host};
}
template <class Container>
constexpr auto host_view(Container& container) noexcept {
  using element = std::remove_reference_t<decltype(*container.data())>;
  return tensor_view<element>{container.data(), shape{static_cast<std::int64_t>(container.size())},
                              memory_kind::host};
}

// Throws unless two views have the same shape; names the operation and both arguments.
template <class A, class B>
void require_same_shape(const tensor_view<A>& a, const tensor_view<B>& b, const char* operation, const char* a_name,
                        const char* b_name) {
  require(a.shape() == b.shape(), std::string(operation) + ": `" + a_name + "` has shape " + to_string(a.shape()) +
                                      " but `" + b_name + "` has shape " + to_string(b.shape()));
}

MEMKIT_NAMESPACE_END
