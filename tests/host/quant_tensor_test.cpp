// quantized_tensor on the host: exact memory accounting, dequantization, tiles, double quantization.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <string>
#include <vector>

#include "memkit/core/protocol.hpp"
#include "memkit/memory/tracking.hpp"
#include "memkit/quant/quantized_tensor.hpp"
#include "support/test_values.hpp"

namespace q = memkit::quant;
using memkit::host;
using memkit::host_view;

using memkit_test::standard_normal;

// bytes_required is usable at compile time, e.g. by memory_budget.
static_assert(q::quantized_tensor<q::NF4>::bytes_required(memkit::shape{4096, 4096}, {64, false}) ==
              4096u * 4096 / 2 + 4096u * 4096 / 64 * 4);
// 4.127 bits per value at block 64 with double quantization (QLoRA's figure).
static_assert(q::quantized_tensor<q::NF4>::bytes_required(memkit::shape{4096, 4096}, {64, true}) ==
              4096u * 4096 / 2 + 4096u * 4096 / 64 + 4u * (4096 * 4096 / 64 / 256 + 1));

// quantize_into follows the component protocol: its byte functions are found by argument-dependent lookup.
static_assert(memkit::operation_arguments<q::quantize_arguments>);
static_assert(workspace_bytes(q::quantize_arguments{q::NF4, memkit::shape{4096, 4096}, {64, true}}) ==
              4096u * 4096 / 64 * 4);  // the fp32 first-level scales
static_assert(bytes_required(q::quantize_arguments{q::NF4, memkit::shape{4096, 4096}, {64, false}}) == 0);
static_assert(saved_bytes(q::quantize_arguments{}) == 0);

TEST_CASE("quant tensor: quantize_into takes from its workspace what workspace_bytes says") {
  memkit::tracking_resource workspace(memkit::default_host_resource(), "quantize_into");
  for (q::quant_options options : {q::quant_options{64, false}, q::quant_options{64, true}, q::quant_options{256, true}}) {
    const memkit::shape dims{33, 77};
    CAPTURE(options.block_size);
    CAPTURE(options.double_quant);
    const std::vector<float> data = standard_normal(dims.numel(), 3);
    q::quantized_tensor<q::NF4> w(memkit::default_host_resource(), dims, options);
    workspace.reset_peak();
    w.quantize_into(host, host_view(data.data(), dims), "weight", workspace);
    const q::quantize_arguments args{q::NF4, dims, options};
    CHECK(workspace.peak_bytes() == workspace_bytes(args));
    CHECK(workspace.peak_bytes() == bytes_required(args));
    CHECK(workspace.current_bytes() == 0);
  }
}

TEST_CASE("quant tensor: bytes() and bytes_required() equal what a tracking_resource counts") {
  memkit::tracking_resource tracker(memkit::default_host_resource(), "quant");
  for (q::quant_options options : {q::quant_options{64, false}, q::quant_options{64, true}, q::quant_options{32, true},
                                   q::quant_options{4096, false}, q::quant_options{256, true}}) {
    for (memkit::shape dims : {memkit::shape{33, 77}, memkit::shape{1}, memkit::shape{128, 256}, memkit::shape{0}}) {
      CAPTURE(options.block_size);
      CAPTURE(options.double_quant);
      CAPTURE(memkit::to_string(dims));
      const std::vector<float> data = standard_normal(dims.numel(), 1);
      auto& weights = tracker.category(memkit::memory_category::weights);
      tracker.reset_peak();
      {
        auto nf4 = q::quantized_tensor<q::NF4>::quantize(host, host_view(data.data(), dims), options, weights);
        CHECK(nf4.bytes() == q::quantized_tensor<q::NF4>::bytes_required(dims, options));
        CHECK(tracker.current_bytes() == nf4.bytes());
        CHECK(tracker.peak_bytes() == nf4.bytes() + workspace_bytes(q::quantize_arguments{q::NF4, dims, options}));
        auto int8 = q::quantized_tensor<q::INT8>::quantize(host, host_view(data.data(), dims), options, weights);
        CHECK(int8.bytes() == q::quantized_tensor<q::INT8>::bytes_required(dims, options));
        CHECK(tracker.current_bytes() == nf4.bytes() + int8.bytes());
        CHECK(nf4.logical_shape() == dims);
      }
      CHECK(tracker.current_bytes() == 0);
    }
  }
}

TEST_CASE("quant tensor: dequantize whole, by rows and by range, to fp32, bf16 and fp16") {
  const memkit::shape dims{48, 100};
  const std::vector<float> data = standard_normal(dims.numel(), 2);
  for (bool nested : {false, true}) {
    CAPTURE(nested);
    const auto t = q::quantized_tensor<q::FP4>::quantize(host, host_view(data.data(), dims), {32, nested},
                                                         memkit::default_host_resource());
    std::vector<float> whole(static_cast<std::size_t>(dims.numel()));
    t.dequantize(host, host_view(whole.data(), dims));
    double error = 0;
    for (std::size_t i = 0; i < whole.size(); ++i) error += std::fabs(whole[i] - data[i]);
    CHECK(error / static_cast<double>(whole.size()) < 0.12);
    std::vector<memkit::bf16> rows(300);  // rows 5..7
    t.dequantize_rows(host, 5, host_view(rows));
    for (std::size_t i = 0; i < rows.size(); ++i) CHECK(rows[i].bits == memkit::bf16(whole[500 + i]).bits);
    std::vector<memkit::fp16> range(61);
    t.dequantize_range(host, 1333, host_view(range));
    for (std::size_t i = 0; i < range.size(); ++i) CHECK(range[i].bits == memkit::fp16(whole[1333 + i]).bits);
  }
}

TEST_CASE("quant tensor: double-quantized scales decode as offset + map * group absmax") {
  const memkit::shape dims{64, 1024};
  const std::vector<float> data = standard_normal(dims.numel(), 3);
  const auto plain = q::quantized_tensor<q::NF4>::quantize(host, host_view(data.data(), dims), {64, false},
                                                           memkit::default_host_resource());
  const auto nested = q::quantized_tensor<q::NF4>::quantize(host, host_view(data.data(), dims), {64, true},
                                                            memkit::default_host_resource());
  CHECK(plain.absmax().size() == 1024);
  CHECK(nested.absmax().size() == 0);
  CHECK(nested.nested_codes().size() == 1024);
  CHECK(nested.nested_group_absmax().size() == 4);
  CHECK(nested.offset_view().size() == 1);
  // The element codes are computed with the exact scales, so both tensors share them.
  CHECK(std::vector<std::uint8_t>(plain.codes().begin(), plain.codes().end()) ==
        std::vector<std::uint8_t>(nested.codes().begin(), nested.codes().end()));
  double mean = 0;
  for (float a : plain.absmax()) mean += a;
  CHECK(nested.offset_view()[0] == doctest::Approx(mean / 1024).epsilon(1e-7));
  const q::block_scales scales = nested.scales();
  memkit::quant::block_scales with_map = scales;
  with_map.nested_map = q::dynamic_map_signed.data();
  for (std::int64_t b = 0; b < 1024; ++b) {
    const float expected = q::dynamic_map_signed[nested.nested_codes()[b]] * nested.nested_group_absmax()[b / 256] +
                           nested.offset_view()[0];
    CHECK(with_map(b) == expected);
    CHECK(with_map(b) == doctest::Approx(plain.absmax()[b]).epsilon(0.01));
  }
}

TEST_CASE("quant tensor: errors name the tensor and block, the shape, and bad options") {
  std::vector<float> data = standard_normal(1000, 4);
  data[640] = std::numeric_limits<float>::quiet_NaN();
  memkit::tracking_resource tracker(memkit::default_host_resource(), "t");
  CHECK_THROWS_WITH_AS(q::quantized_tensor<q::NF4>::quantize(host, host_view(std::as_const(data).data(), {10, 100}),
                                                             {64, true}, tracker, "lm_head.weight"),
                       doctest::Contains("tensor 'lm_head.weight' has a non-finite value (nan) at flat element 640, in block 10"),
                       memkit::error);
  CHECK(tracker.total().total_allocations == 0);  // nothing was allocated for the rejected input
  CHECK_THROWS_WITH_AS(q::quantized_tensor<q::NF4>(tracker, {10, 100}, {96, false}),
                       doctest::Contains("block size 96 is not supported"), memkit::error);
  data[640] = 0.0f;
  const auto t = q::quantized_tensor<q::NF4>::quantize(host, host_view(std::as_const(data).data(), {10, 100}),
                                                       {64, false}, tracker);
  std::vector<float> wrong(999);
  CHECK_THROWS_WITH_AS(t.dequantize(host, host_view(wrong)), doctest::Contains("`out` has 999 elements"), memkit::error);
  std::vector<float> tile(150);
  CHECK_THROWS_WITH_AS(t.dequantize_rows(host, 1, host_view(tile)), doctest::Contains("not a whole number of rows"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(t.dequantize_range(host, 900, host_view(tile)), doctest::Contains("outside the tensor"),
                       memkit::error);
  t.require_finite_scales("w");
  // Double-quantized scales: a bad group absmax names its group's first block, a bad offset block 0.
  const std::vector<float> wide = standard_normal(64 * 300, 5);
  auto dq = q::quantized_tensor<q::NF4>::quantize(host, host_view(wide.data(), {300, 64}), {64, true}, tracker);
  dq.require_finite_scales("dq");
  dq.nested_group_absmax()[1] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH_AS(dq.require_finite_scales("dq"), doctest::Contains("non-finite value in block 256 of 300"),
                       memkit::error);
  dq.nested_group_absmax()[1] = 1.0f;
  dq.offset_view()[0] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(dq.require_finite_scales("dq"), doctest::Contains("non-finite value in block 0 of 300"),
                       memkit::error);
}
