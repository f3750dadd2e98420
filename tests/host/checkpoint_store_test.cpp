#include <doctest/doctest.h>
#include <memkit/core/layer.hpp>
#include <memkit/memory/tracking.hpp>

#include <cstdint>

namespace {

// The smallest layer there is: y = 2x, saving nothing but its input's shape check through the store.
struct doubling_layer {
  using value_type = float;
  memkit::shape output_shape(const memkit::shape& in) const { return in; }
  std::size_t saved_bytes(const memkit::shape& in, const memkit::forward_context&) const {
    return memkit::activation_store::bytes_required<float>(in);
  }
  void forward(const memkit::host_executor&, const memkit::forward_context&, memkit::tensor_view<const float> x,
               memkit::tensor_view<float> y, memkit::activation_store& store) {
    auto saved = store.save<float>(x.shape());
    for (std::int64_t i = 0; i < x.size(); ++i) saved[i] = x[i], y[i] = 2 * x[i];
  }
  void backward(const memkit::host_executor&, memkit::tensor_view<const float> dy, memkit::tensor_view<float> dx,
                memkit::activation_store& store) {
    auto x = store.take<float>(dx.shape(), "doubling_layer");
    for (std::int64_t i = 0; i < dx.size(); ++i) dx[i] = 2 * dy[i];
  }
};

struct not_a_layer {
  using value_type = float;
};

}  // namespace

static_assert(memkit::layer<doubling_layer, memkit::host_executor>);
static_assert(!memkit::layer<not_a_layer, memkit::host_executor>);

TEST_CASE("activation_store charges saved tensors to its resource and returns them last in, first out") {
  memkit::tracking_resource tracker(memkit::default_host_resource(), "store");
  memkit::activation_store store(tracker.category(memkit::memory_category::activations));
  auto a = store.save<float>(memkit::shape{3});
  auto b = store.save<std::int32_t>(memkit::shape{2, 2});
  a[0] = 1.5f;
  b[3] = 7;
  CHECK(store.size() == 2);
  CHECK(store.bytes() == 12 + 16);
  CHECK(tracker.stats(memkit::memory_category::activations).current_bytes == 28);
  {
    auto taken_b = store.take<std::int32_t>(memkit::shape{2, 2});
    CHECK(taken_b.view()[3] == 7);
    CHECK(store.bytes() == 12);
    CHECK(tracker.stats(memkit::memory_category::activations).current_bytes == 28);  // taken, not yet freed
  }
  CHECK(tracker.stats(memkit::memory_category::activations).current_bytes == 12);
  auto taken_a = store.take<float>(memkit::shape{3});
  CHECK(taken_a.view()[0] == 1.5f);
  CHECK(store.empty());
}

TEST_CASE("activation_store refuses a take that does not match what was saved, and keeps the tensor") {
  memkit::activation_store store(memkit::default_host_resource());
  CHECK_THROWS_WITH_AS(store.take<float>(memkit::shape{3}, "my_layer"),
                       doctest::Contains("my_layer: backward asked for a saved tensor of shape [3] but nothing is saved"),
                       memkit::error);
  store.save<float>(memkit::shape{4});
  CHECK_THROWS_WITH_AS(store.take<float>(memkit::shape{3}), doctest::Contains("has shape [4]"), memkit::error);
  CHECK_THROWS_WITH_AS(store.take<std::int32_t>(memkit::shape{4}), doctest::Contains("of another type"), memkit::error);
  CHECK(store.size() == 1);
  store.take<float>(memkit::shape{4});
  CHECK(store.empty());
}

TEST_CASE("a layer runs forward then backward through the store; a second backward is an error") {
  doubling_layer layer;
  memkit::activation_store store(memkit::default_host_resource());
  float x[4] = {1, 2, 3, 4}, y[4], dy[4] = {1, 1, 1, 1}, dx[4];
  const memkit::forward_context ctx{};
  layer.forward(memkit::host, ctx, memkit::host_view<const float>(x, {4}), memkit::host_view(y, {4}), store);
  CHECK(store.bytes() == layer.saved_bytes(memkit::shape{4}, ctx));
  layer.backward(memkit::host, memkit::host_view<const float>(dy, {4}), memkit::host_view(dx, {4}), store);
  CHECK(dx[3] == 2.0f);
  CHECK_THROWS_AS(
      layer.backward(memkit::host, memkit::host_view<const float>(dy, {4}), memkit::host_view(dx, {4}), store),
      memkit::error);
  CHECK(memkit::forward_context{7, 0, true}.for_layer(1).counter == (std::uint64_t{1} << 40));
}
