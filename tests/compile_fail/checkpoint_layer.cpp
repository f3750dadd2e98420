// Misuse of the layer concept must not compile, and the error must say what is missing. Built by
// tests/compile_fail/check_compile_error.cmake with one -DMEMKIT_CASE_... at a time:
//   GOOD                   compiles: a complete layer, wrapped in a memkit::checkpoint::segment
//   MISSING_BACKWARD       explain_layer names the backward a layer lacks
//   MISSING_SAVED_BYTES    explain_layer names saved_bytes
//   MIXED_VALUE_TYPES      memkit::layers refuses layers whose activations differ in type
#include <memkit/checkpoint/segment.hpp>

#include <vector>

using memkit::activation_store;
using memkit::forward_context;
using memkit::host_executor;
using memkit::shape;
using memkit::tensor_view;

struct complete {
  using value_type = float;
  shape output_shape(const shape& in) const { return in; }
  std::size_t saved_bytes(const shape&, const forward_context&) const { return 0; }
  void forward(const host_executor&, const forward_context&, tensor_view<const float>, tensor_view<float>,
               activation_store&) {}
  void backward(const host_executor&, tensor_view<const float>, tensor_view<float>, activation_store&) {}
};

struct no_backward {
  using value_type = float;
  shape output_shape(const shape& in) const { return in; }
  std::size_t saved_bytes(const shape&, const forward_context&) const { return 0; }
  void forward(const host_executor&, const forward_context&, tensor_view<const float>, tensor_view<float>,
               activation_store&) {}
};

struct no_saved_bytes {
  using value_type = float;
  shape output_shape(const shape& in) const { return in; }
  void forward(const host_executor&, const forward_context&, tensor_view<const float>, tensor_view<float>,
               activation_store&) {}
  void backward(const host_executor&, tensor_view<const float>, tensor_view<float>, activation_store&) {}
};

struct half_layer : complete {
  using value_type = short;
};

#if defined(MEMKIT_CASE_GOOD)
static_assert(memkit::explain_layer<complete, host_executor>());
int main() {
  std::vector<complete> layers(3);
  memkit::checkpoint::segment segment(layers, {.schedule = memkit::checkpoint::schedule::binomial(2)});
  static_assert(memkit::layer<decltype(segment), host_executor>);
  return 0;
}
#elif defined(MEMKIT_CASE_MISSING_BACKWARD)
static_assert(memkit::explain_layer<no_backward, host_executor>());
#elif defined(MEMKIT_CASE_MISSING_SAVED_BYTES)
static_assert(memkit::explain_layer<no_saved_bytes, host_executor>());
#elif defined(MEMKIT_CASE_MIXED_VALUE_TYPES)
void mixed() {
  complete a;
  half_layer b;
  auto sequence = memkit::checkpoint::layer_sequence(a, b);
  (void)sequence;
}
#endif
