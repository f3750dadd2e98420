// Empty tensors on the host paths: products with an empty inner dimension write zeros, double quantization
// of zero blocks writes its offset, and the workspace functions stay exact. (tests/cuda/quant_test.cu runs
// the same cases on a device in the gpu suite.)
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "memkit/memory/tracking.hpp"
#include "memkit/quant/double_quant.hpp"
#include "memkit/quant/matmul.hpp"
#include "memkit/quant/quantized_tensor.hpp"

namespace q = memkit::quant;
using memkit::host;
using memkit::host_view;

namespace {
template <class T>
int nonzero_count(const std::vector<T>& values) {
  int count = 0;
  for (const T& v : values) {
    const float f = memkit::to_float(v);
    if (!(f == 0.0f)) ++count;  // NaN counts
  }
  return count;
}

template <q::format F, class T>
void check_empty_inner(std::int64_t M, bool double_quant) {
  CAPTURE(q::to_string(F));
  CAPTURE(sizeof(T));
  CAPTURE(M);
  CAPTURE(double_quant);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto& heap = memkit::default_host_resource();
  const std::int64_t N = 8, K = 16;
  memkit::tracking_resource workspace(heap, "empty");

  // y = x W^T with W [N, 0]: x [M, 0], y [M, N] all zeros.
  const std::vector<float> none;
  const auto w_no_k = q::quantized_tensor<F>::quantize(host, host_view(none.data(), {N, 0}), {64, double_quant}, heap);
  std::vector<T> x(0), y(static_cast<std::size_t>(M * N), memkit::from_float<T>(nan));
  q::matmul(host, host_view(std::as_const(x).data(), {M, 0}), w_no_k, host_view(y.data(), {M, N}),
            q::matmul_config{}, workspace);
  CHECK(nonzero_count(y) == 0);
  CHECK(workspace.peak_bytes() == 0);
  CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, F, 64, M, N, 0, sizeof(T), false}) == 0);
  CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::forward, F, 64, M, N, 0, sizeof(T), true}) == 0);

  // dx = dy W with W [0, K]: dy [M, 0], dx [M, K] all zeros.
  const auto w_no_n = q::quantized_tensor<F>::quantize(host, host_view(none.data(), {0, K}), {64, double_quant}, heap);
  std::vector<T> dy(0), dx(static_cast<std::size_t>(M * K), memkit::from_float<T>(nan));
  q::matmul_input_grad(host, host_view(std::as_const(dy).data(), {M, 0}), w_no_n, host_view(dx.data(), {M, K}),
                       q::matmul_config{}, workspace);
  CHECK(nonzero_count(dx) == 0);
  CHECK(workspace.peak_bytes() == 0);  // (a 16-bit dx took an fp32 accumulator the query did not count)
  CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::input_grad, F, 64, M, 0, K, sizeof(T), false}) == 0);
  CHECK(workspace_bytes(q::matmul_arguments{q::matmul_kind::input_grad, F, 64, M, 0, K, sizeof(T), true}) == 0);
}
}  // namespace

TEST_CASE("quant matmul: an empty inner dimension (K = 0 for y, N = 0 for dx) writes zeros, takes no workspace") {
  for (bool double_quant : {false, true})
    for (std::int64_t M : {1, 3, 40}) {  // the fused path (M <= 32 for 4-bit) and the tiled one
      check_empty_inner<q::NF4, float>(M, double_quant);
      check_empty_inner<q::NF4, memkit::bf16>(M, double_quant);
      check_empty_inner<q::INT8, memkit::fp16>(M, double_quant);
    }
}

TEST_CASE("double quantization of zero blocks writes a zero offset, and the tensor checks finite") {
  auto& heap = memkit::default_host_resource();
  q::quantized_tensor<q::NF4> w(heap, memkit::shape{0, 64}, {64, true});
  REQUIRE(w.offset_view().size() == 1);
  w.offset_view()[0] = std::numeric_limits<float>::quiet_NaN();  // what uninitialized memory may hold
  const std::vector<float> none;
  w.quantize_into(host, host_view(none.data(), {0, 64}), "weight", heap);
  CHECK(w.offset_view()[0] == 0.0f);
  CHECK_NOTHROW(w.require_finite_scales("empty"));

  // The free function, directly.
  float offset = std::numeric_limits<float>::quiet_NaN();
  q::quantize_scales(host, memkit::tensor_view<const float>(nullptr, memkit::shape{0}, memkit::memory_kind::host),
                     memkit::tensor_view<std::uint8_t>(nullptr, memkit::shape{0}, memkit::memory_kind::host),
                     memkit::tensor_view<float>(nullptr, memkit::shape{0}, memkit::memory_kind::host),
                     host_view(&offset, {1}));
  CHECK(offset == 0.0f);
}
