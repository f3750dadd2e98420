#include <doctest/doctest.h>
#include <memkit/core/execution.hpp>
#include <memkit/core/tensor_view.hpp>

#include <string>
#include <type_traits>
#include <vector>

using memkit::memory_kind;
using memkit::shape;
using memkit::tensor_view;

TEST_CASE("shape: extents, element count, equality and text") {
  constexpr shape matrix{4096, 11008};
  static_assert(matrix.rank == 2 && matrix.numel() == 4096ll * 11008);
  static_assert(shape{}.numel() == 1);  // a scalar
  CHECK(shape{2, 3} == shape{2, 3});
  CHECK_FALSE(shape{2, 3} == shape{3, 2});
  CHECK_FALSE(shape{6} == shape{6, 1});
  CHECK(memkit::to_string(shape{2, 3, 4}) == "[2, 3, 4]");
  CHECK_THROWS_WITH_AS(shape({2, -1}), "memkit::shape: negative extent -1", memkit::error);
  CHECK_THROWS_AS(shape({1, 2, 3, 4, 5}), memkit::error);
}

TEST_CASE("tensor_view: reshape, slices and const conversion") {
  std::vector<float> storage(12);
  for (int i = 0; i < 12; ++i) storage[i] = static_cast<float>(i);
  auto flat = memkit::host_view(storage);
  CHECK(flat.size() == 12);
  CHECK(flat.bytes() == 48);
  CHECK(flat.where() == memory_kind::host);

  auto matrix = flat.reshaped(shape{3, 4});
  CHECK(matrix.shape() == shape{3, 4});
  CHECK(matrix[5] == 5.0f);
  CHECK_THROWS_WITH_AS(flat.reshaped(shape{5, 5}),
                       "tensor_view::reshaped: cannot view [12] as [5, 5] (element counts differ)", memkit::error);

  auto middle = matrix.flat_slice(4, 4);
  CHECK(middle.shape() == shape{4});
  CHECK(middle[0] == 4.0f);
  CHECK_THROWS_WITH_AS(matrix.flat_slice(10, 4), "tensor_view::flat_slice: 4 elements from offset 10 are outside a view of 12 elements",
                       memkit::error);

  tensor_view<const float> read_only = matrix;
  CHECK(read_only.data() == storage.data());
  static_assert(std::is_convertible_v<tensor_view<float>, tensor_view<const float>>);
  static_assert(!std::is_convertible_v<tensor_view<const float>, tensor_view<float>>);
  static_assert(!std::is_convertible_v<tensor_view<int>, tensor_view<float>>);
  static_assert(std::is_trivially_copyable_v<tensor_view<float>>);
}

TEST_CASE("tensor_view: shape mismatch names the operation and both arguments") {
  std::vector<float> a(6), b(8);
  CHECK_THROWS_WITH_AS(memkit::require_same_shape(memkit::host_view(a), memkit::host_view(b), "axpy", "x", "y"),
                       "axpy: `x` has shape [6] but `y` has shape [8]", memkit::error);
  CHECK_NOTHROW(memkit::require_same_shape(memkit::host_view(a), memkit::host_view(a), "axpy", "x", "y"));
}

TEST_CASE("host executor: refuses device memory with a clear error, accepts the rest") {
  float value = 0.0f;
  const auto view_in = [&](memory_kind kind) { return tensor_view<float>(&value, shape{1}, kind); };
  CHECK_NOTHROW(memkit::require_accessible(memkit::host, view_in(memory_kind::host), "op", "x"));
  CHECK_NOTHROW(memkit::require_accessible(memkit::host, view_in(memory_kind::pinned_host), "op", "x"));
  CHECK_NOTHROW(memkit::require_accessible(memkit::host, view_in(memory_kind::managed), "op", "x"));
  CHECK_THROWS_WITH_AS(
      memkit::require_accessible(memkit::host, view_in(memory_kind::device), "dequantize", "codes"),
      "dequantize: `codes` is in device memory, which the host executor cannot access (copy it to host memory first)",
      memkit::error);
  // An empty view touches no memory, wherever it claims to live.
  CHECK_NOTHROW(memkit::require_accessible(memkit::host, tensor_view<float>(nullptr, shape{0}, memory_kind::device),
                                           "op", "x"));
  static_assert(memkit::executor<memkit::host_executor>);
}

TEST_CASE("tensor_view::none: the one absent-tensor rule; an empty tensor is not absent") {
  static_assert(tensor_view<float>::none().is_none());
  static_assert(tensor_view<const float>{}.is_none());
  float value = 0.0f;
  CHECK_FALSE(tensor_view<float>(&value, shape{}, memory_kind::host).is_none());      // a real rank-0 tensor
  CHECK_FALSE(tensor_view<float>(nullptr, shape{0}, memory_kind::host).is_none());    // empty, from an empty buffer
  CHECK_FALSE(tensor_view<float>(nullptr, shape{2, 0}, memory_kind::device).is_none());
  CHECK_FALSE(tensor_view<float>(&value, shape{1}, memory_kind::host).is_none());
  const tensor_view<const float> converted = tensor_view<float>::none();  // survives the const conversion
  CHECK(converted.is_none());
}
