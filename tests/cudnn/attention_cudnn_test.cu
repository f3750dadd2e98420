// memkit::attention::cudnn (MEMKIT_USE_CUDNN): cuDNN itself checks every descriptor of the forward and backward
// graphs (no device needed: tensor and operation descriptors finalize without a cuDNN handle), the entry points'
// argument checks, and (gpu suite, NOT RUN YET: written without a GPU) cuDNN's results against the host
// reference, the fallback and the exact workspace bytes.
#include <doctest/doctest.h>

#include <memkit/attention/cudnn.hpp>
#include <memkit/memory/resource.hpp>
#include <memkit/memory/tracking.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <set>
#include <vector>

#include "support/attention_device_case.hpp"
#include "support/gpu_test.hpp"
#include "support/test_values.hpp"

#if !defined(MEMKIT_USE_CUDNN)
#error "tests/cudnn is built with MEMKIT_USE_CUDNN (tests/CMakeLists.txt)"
#endif

namespace {

namespace att = memkit::attention;
namespace sdpa = memkit::attention::detail::cudnn_sdpa;

// The nodes memkit's graphs have: forward 10 (2 matmuls, scale, max, sub, exp, sum, log, add, div), backward 18
// (rowsum(dO * O) in 3, scale, sub Stats, exp, 2 transposes, 5 matmuls, dS in 3, K's reshape, dQ's copy) plus a
// reduction per gradient of grouped heads; a right bound (causal or a window) adds 2 index nodes, a compare and a
// select, plus an add for a window without causality; a left bound (a window) adds 5.
std::size_t expected_operations(const sdpa::sdpa_key& k) {
  std::size_t n = k.backward ? 18 + (k.query_heads != k.kv_heads ? 2 : 0) : 10;
  if (k.causal || k.window > 0) n += k.causal ? 4 : 5;
  if (k.window > 0) n += 5;
  return n;
}

}  // namespace

TEST_CASE("cudnn: every tensor and operation descriptor of the forward and backward graphs finalizes (no device)") {
  std::printf("memkit: cuDNN %zu (headers %d)\n", cudnnGetVersion(), CUDNN_VERSION);
  CHECK(cudnnGetVersion() >= 90000);
  int built = 0;
  // The ids attention::cudnn::forward / backward bind (the same functions they call).
  const auto ids = [](const att::cudnn::detail::bindings& b) {
    std::set<std::int64_t> s;
    for (const auto& binding : b) s.insert(binding.first);
    return s;
  };
  memkit::bf16* t = nullptr;
  float* f = nullptr;
  const std::set<std::int64_t> forward_uids = ids(att::cudnn::detail::forward_bindings(t, t, t, t, f));
  const std::set<std::int64_t> backward_uids =
      ids(att::cudnn::detail::backward_bindings(t, t, t, t, f, t, t, t, t, nullptr, nullptr));
  CHECK(forward_uids.size() == 5);
  CHECK(backward_uids.size() == 11);
  for (bool backward : {false, true})
    for (cudnnDataType_t io : {CUDNN_DATA_BFLOAT16, CUDNN_DATA_HALF})
      for (std::int64_t D : {64, 128})
        for (bool causal : {true, false})
          for (std::int64_t window : {0, 33})
            for (std::int64_t kv_heads : {8, 2, 1})  // MHA, GQA, MQA
              for (std::int64_t S : {1, 257}) {
                sdpa::sdpa_key key;
                key.backward = backward, key.io = io, key.batch = 2, key.query_heads = 8, key.kv_heads = kv_heads;
                key.sequence = S, key.head_dim = D, key.causal = causal, key.window = window;
                CAPTURE(backward);
                CAPTURE(D);
                CAPTURE(causal);
                CAPTURE(window);
                CAPTURE(kv_heads);
                CAPTURE(S);
                sdpa::graph_builder graph = sdpa::build_graph(key);
                CHECK(graph.operations().size() == expected_operations(key));
                // The tensors in memory are the ones attention::cudnn binds (execute checks it again).
                const std::set<std::int64_t> memory(graph.memory_uids().begin(), graph.memory_uids().end());
                CHECK(memory.size() == graph.memory_uids().size());
                CHECK(memory == (backward ? backward_uids : forward_uids));
                ++built;
              }
  CHECK(built == 192);
}

namespace {

// A tensor descriptor's attributes, read back from cuDNN.
struct tensor_signature {
  cudnnDataType_t type{};
  std::vector<std::int64_t> dims, strides;
  bool is_virtual = false, by_value = false;
  bool operator==(const tensor_signature&) const = default;
};
tensor_signature signature(const sdpa::descriptor& t) {
  tensor_signature s;
  std::int64_t n = 0, dims[8] = {}, strides[8] = {};
  REQUIRE(cudnnBackendGetAttribute(t.get(), CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &n, &s.type) == 0);
  REQUIRE(cudnnBackendGetAttribute(t.get(), CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 8, &n, dims) == 0);
  s.dims.assign(dims, dims + n);
  REQUIRE(cudnnBackendGetAttribute(t.get(), CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 8, &n, strides) == 0);
  s.strides.assign(strides, strides + n);
  REQUIRE(cudnnBackendGetAttribute(t.get(), CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &n,
                                   &s.is_virtual) == 0);
  REQUIRE(cudnnBackendGetAttribute(t.get(), CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &n,
                                   &s.by_value) == 0);
  return s;
}

}  // namespace

// cudnn-frontend's composite backward lowering (the graph cuDNN's SDPA engines are exercised with) gives K's reshape
// the intermediate type (fp32) and dO * O a row stride of H * D; memkit's graph once differed in both (found by
// comparing the two graphs' tensors on the host, docs/attention.md). Every descriptor finalized either way.
TEST_CASE("cudnn: the backward graph's intermediate tensors are the ones cudnn-frontend's lowering makes") {
  sdpa::sdpa_key key;
  key.backward = true, key.io = CUDNN_DATA_BFLOAT16, key.batch = 2, key.query_heads = 8, key.kv_heads = 2;
  key.sequence = 96, key.head_dim = 64;
  const sdpa::graph_builder graph = sdpa::build_graph(key);
  std::vector<tensor_signature> all;
  for (const sdpa::descriptor& t : graph.tensors()) all.push_back(signature(t));
  const auto count = [&](const tensor_signature& wanted) { return std::count(all.begin(), all.end(), wanted); };
  const std::int64_t B = key.batch, H = key.query_heads, G = key.kv_heads, S = key.sequence, D = key.head_dim;
  // K^T reshaped to K [B, Hkv, S, D]: fp32 virtual, contiguous; never the io type.
  CHECK(count({CUDNN_DATA_FLOAT, {B, G, S, D}, {G * S * D, S * D, D, 1}, true, false}) == 1);
  CHECK(count({CUDNN_DATA_BFLOAT16, {B, G, S, D}, {G * S * D, S * D, D, 1}, true, false}) == 0);
  // dO * O [B, Hq, S, D]: fp32 virtual with the frontend's stride hint.
  CHECK(count({CUDNN_DATA_FLOAT, {B, H, S, D}, {H * S * D, S * D, H * D, 1}, true, false}) == 1);
  // The per-query-head dK and dV before the group reduction: io type, contiguous (as the frontend's).
  CHECK(count({CUDNN_DATA_BFLOAT16, {B, H, S, D}, {H * S * D, S * D, D, 1}, true, false}) == 2);
}

TEST_CASE("cudnn: a malformed node is rejected by cuDNN at finalize, with its status and message") {
  sdpa::sdpa_key key;
  key.batch = 1, key.query_heads = 2, key.kv_heads = 2, key.sequence = 64, key.head_dim = 64;
  sdpa::graph_builder g(key);
  // Q [1, 2, 64, 64] times a "K^T" of inner extent 32: the matmul's shapes do not chain.
  auto q = g.tensor(sdpa::uid_q, {1, 2, 64, 64}, {8192, 4096, 64, 1}, CUDNN_DATA_HALF);
  auto kt = g.tensor(sdpa::uid_k, {1, 2, 32, 64}, {4096, 2048, 64, 1}, CUDNN_DATA_HALF);
  auto s = g.virtual_tensor({1, 2, 64, 64});
  CHECK_THROWS_WITH_AS(g.matmul(q, kt, s), doctest::Contains("finalize matmul operation: CUDNN_STATUS_BAD_PARAM"),
                       memkit::error);
  // A ternary select without its mask.
  auto y = g.virtual_tensor({1, 2, 64, 64});
  CHECK_THROWS_WITH_AS(g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, g.scalar(1.0f), nullptr, y),
                       doctest::Contains("CUDNN_STATUS_BAD_PARAM"), memkit::error);
  // A reduction to a head count that does not divide the input's.
  CHECK_THROWS_WITH_AS(g.reduction(CUDNN_REDUCE_TENSOR_ADD, q, g.virtual_tensor({1, 3, 64, 1})),
                       doctest::Contains("CUDNN_STATUS_BAD_PARAM"), memkit::error);
}

TEST_CASE("cudnn: the entry points check their arguments before touching the device") {
  const memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream(0);
  memkit::host_resource workspace;
  att::attention_options o;
  auto fake = [](std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
    return memkit::tensor_view<memkit::bf16>{reinterpret_cast<memkit::bf16*>(std::uintptr_t{4096}),
                                             memkit::shape{a, b, c, d}, memkit::memory_kind::device};
  };
  const memkit::tensor_view<float> lse{reinterpret_cast<float*>(std::uintptr_t{4096}), memkit::shape{1, 3, 8},
                                       memkit::memory_kind::device};
  CHECK_THROWS_WITH_AS(att::cudnn::forward<memkit::bf16>(exec, fake(1, 3, 8, 64), fake(1, 2, 8, 64), fake(1, 2, 8, 64),
                                                         fake(1, 3, 8, 64), lse, o, workspace),
                       doctest::Contains("must divide"), memkit::error);
  att::problem_arguments a{.batch = 1, .query_heads = 2, .kv_heads = 2, .sequence = 8, .head_dim = 64,
                           .element_bytes = 4, .on_device = true, .options = o};
  CHECK_THROWS_WITH_AS(att::cudnn::workspace_bytes<memkit::bf16>(exec, att::forward_arguments{a}),
                       doctest::Contains("is not sizeof(T)"), memkit::error);
  a.element_bytes = 2, a.on_device = false;
  CHECK_THROWS_WITH_AS(att::cudnn::workspace_bytes<memkit::bf16>(exec, att::backward_arguments{a}),
                       doctest::Contains("for device problems"), memkit::error);
  // fp32 and packed documents never ask cuDNN (no device needed to know): the built-in kernel runs, with its bytes.
  a.element_bytes = 2, a.on_device = true;
  const att::cudnn::path_choice packed = att::cudnn::path_for<memkit::bf16>(exec, a, true, true);
  CHECK_FALSE(packed.uses_cudnn);
  CHECK(packed.reason.find("packed documents") != std::string::npos);
  CHECK(att::cudnn::workspace_bytes<memkit::bf16>(exec, att::backward_arguments{a}, true) ==
        att::workspace_bytes(att::backward_arguments{a}));
  a.element_bytes = 4, a.on_device = true;
  CHECK(att::cudnn::workspace_bytes<float>(exec, att::backward_arguments{a}) ==
        att::workspace_bytes(att::backward_arguments{a}));
  CHECK_FALSE(att::cudnn::path_for<float>(exec, a, false).uses_cudnn);
}

// The entry points take any executor (as attention::forward / backward do): a host one runs the host path, bit for
// bit, with no cuDNN, no device and no message.
TEST_CASE("cudnn: a host executor runs memkit's host path (the same bits)") {
  using T = memkit::bf16;
  const std::int64_t B = 1, Hq = 4, Hkv = 2, S = 70, D = 64;
  const memkit::shape qs{B, Hq, S, D}, ks{B, Hkv, S, D}, ls{B, Hq, S};
  const auto q = memkit_test::convert<T>(memkit_test::standard_normal(B * Hq * S * D, 1));
  const auto k = memkit_test::convert<T>(memkit_test::standard_normal(B * Hkv * S * D, 2));
  const auto v = memkit_test::convert<T>(memkit_test::standard_normal(B * Hkv * S * D, 3));
  const auto dout = memkit_test::convert<T>(memkit_test::standard_normal(B * Hq * S * D, 4));
  att::attention_options o;
  o.window = 33;
  o.host_threads = 1;
  auto hv = [](auto& x, memkit::shape s) { return memkit::host_view(x.data(), s); };
  const auto run = [&](bool through_cudnn) {
    memkit_test::attention_results<T> r{std::vector<T>(q.size()), std::vector<T>(q.size()), std::vector<T>(k.size()),
                                        std::vector<T>(v.size()), std::vector<float>(B * Hq * S)};
    const att::forward_tensors<T> saved{hv(q, qs), hv(k, ks), hv(v, ks), hv(r.out, qs), hv(r.lse, ls)};
    const att::gradients<T> grads{hv(r.dq, qs), hv(r.dk, ks), hv(r.dv, ks)};
    if (through_cudnn) {
      att::cudnn::forward<T>(memkit::host, hv(q, qs), hv(k, ks), hv(v, ks), hv(r.out, qs), hv(r.lse, ls), o,
                             memkit::default_host_resource());
      att::cudnn::backward<T>(memkit::host, saved, hv(dout, qs), grads, o, memkit::default_host_resource());
    } else {
      att::forward<T>(memkit::host, hv(q, qs), hv(k, ks), hv(v, ks), hv(r.out, qs), hv(r.lse, ls), o,
                      memkit::default_host_resource());
      att::backward<T>(memkit::host, saved, hv(dout, qs), grads, o, memkit::default_host_resource());
    }
    return r;
  };
  const memkit_test::attention_results<T> plain = run(false), cudnn = run(true);
  const auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  CHECK(same(cudnn.out, plain.out));
  CHECK(same(cudnn.lse, plain.lse));
  CHECK(same(cudnn.dq, plain.dq));
  CHECK(same(cudnn.dk, plain.dk));
  CHECK(same(cudnn.dv, plain.dv));
}

TEST_CASE("cudnn: a fallback is said once per configuration kind, not per call") {
  att::problem_arguments a{.batch = 1, .query_heads = 4, .kv_heads = 2, .sequence = 8, .head_dim = 64,
                           .element_bytes = 2, .on_device = true, .options = {}};
  a.options.window = 16;
  const std::string kind = att::cudnn::detail::kind_of<memkit::fp16>(true, a);
  CHECK(kind == "backward fp16 head_dim 64, causal, sliding window, grouped-query heads");
  CHECK(sdpa::report_fallback_once(kind, "a reason (test)"));
  CHECK_FALSE(sdpa::report_fallback_once(kind, "a reason (test)"));
  CHECK_FALSE(sdpa::report_fallback_once(kind, "another reason"));
  CHECK(sdpa::report_fallback_once(att::cudnn::detail::kind_of<memkit::fp16>(false, a), "a reason (test)"));
}

// --- On a GPU (NOT RUN YET: this file was written without a device). ---
namespace {

// Forward and backward through the cuDNN path on the device against memkit's host path on the same inputs; the
// workspace each takes, measured by a tracking_resource, against workspace_bytes. Returns whether cuDNN ran.
template <class T>
bool cudnn_matches_host(std::int64_t B, std::int64_t Hq, std::int64_t Hkv, std::int64_t S, std::int64_t D, bool causal,
                        std::int64_t window, double tolerance, const std::vector<std::int32_t>& offsets = {}) {
  att::attention_options o;
  o.causal = causal;
  o.window = window;
  o.host_threads = 2;
  memkit_test::attention_device_case<T> c(B, Hq, Hkv, S, D, o, offsets);
  const att::problem_arguments a{.batch = B, .query_heads = Hq, .kv_heads = Hkv, .sequence = S, .head_dim = D,
                                 .element_bytes = sizeof(T), .on_device = true, .options = o};
  const bool packed = c.packed();
  const bool forward_cudnn = att::cudnn::path_for<T>(c.exec, a, false, packed).uses_cudnn;
  const bool backward_cudnn = att::cudnn::path_for<T>(c.exec, a, true, packed).uses_cudnn;
  memkit::tracking_resource forward_workspace(c.device, "cudnn forward");
  att::cudnn::forward<T>(c.exec, c.q.view(), c.k.view(), c.v.view(), c.documents, c.out.view(), c.lse.view(), o,
                         forward_workspace);
  memkit::tracking_resource backward_workspace(c.device, "cudnn backward");
  att::cudnn::backward<T>(c.exec, {c.q.view(), c.k.view(), c.v.view(), c.out.view(), c.lse.view(), c.documents},
                          c.dout.view(), {c.dq.view(), c.dk.view(), c.dv.view()}, o, backward_workspace);
  CAPTURE(S);
  CAPTURE(D);
  CAPTURE(Hkv);
  CAPTURE(causal);
  CAPTURE(window);
  CAPTURE(packed);
  const memkit_test::attention_errors e = c.errors(c.fetch());
  std::printf("attention cuDNN path (forward %s, backward %s) vs host (S %lld D %lld Hkv %lld): out %.3g lse %.3g "
              "dq %.3g dk %.3g dv %.3g\n",
              forward_cudnn ? "cuDNN" : "fallback", backward_cudnn ? "cuDNN" : "fallback", static_cast<long long>(S),
              static_cast<long long>(D), static_cast<long long>(Hkv), e.out, e.lse, e.dq, e.dk, e.dv);
  memkit_test::check_attention_errors(e, tolerance);
  // The byte functions are exact: what each call took at its peak.
  CHECK(forward_workspace.peak_bytes() == att::cudnn::workspace_bytes<T>(c.exec, att::forward_arguments{a}, packed));
  CHECK(backward_workspace.peak_bytes() ==
        att::cudnn::workspace_bytes<T>(c.exec, att::backward_arguments{a}, packed));
  return forward_cudnn && backward_cudnn;
}

}  // namespace

// Tolerances are the mma / WMMA kernels' against the host (max |error| over max |value|; lse 1e-4): cuDNN also
// rounds P and dS to the 16-bit type before their products and accumulates in fp32.
MEMKIT_GPU_TEST_CASE("gpu: the cuDNN path agrees with the host path (bf16 / fp16, causal or not, window, GQA)") {
  int core = 0, other = 0;
  for (bool causal : {true, false}) {
    for (std::int64_t D : {64, 128}) {
      core += cudnn_matches_host<memkit::bf16>(2, 4, 4, 130, D, causal, 0, 2e-2);
      core += cudnn_matches_host<memkit::fp16>(2, 4, 2, 130, D, causal, 0, 4e-3);  // GQA
      core += cudnn_matches_host<memkit::bf16>(1, 4, 1, 257, D, causal, 0, 2e-2);  // MQA
      other += cudnn_matches_host<memkit::bf16>(1, 6, 3, 257, D, causal, 33, 2e-2);  // sliding window (or fallback)
      other += cudnn_matches_host<memkit::fp16>(1, 2, 2, 1, D, causal, 0, 4e-3);    // one row (or fallback)
    }
  }
  std::printf("attention cuDNN path: cuDNN ran both directions of %d of 12 plain problems and %d of 8 with a window "
              "or one row\n", core, other);
  // cuDNN's SDPA engines take plain bf16 / fp16 attention at head_dim 64 / 128 on Ampere and Hopper, MHA, GQA and
  // MQA: those must not quietly be the fallback.
  CHECK(core == 12);
}

MEMKIT_GPU_TEST_CASE("gpu: the cuDNN path falls back, and says why, for problems it does not take") {
  const memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream(0);
  const att::problem_arguments a{.batch = 1, .query_heads = 2, .kv_heads = 2, .sequence = 150, .head_dim = 64,
                                 .element_bytes = 2, .on_device = true, .options = {}};
  const att::cudnn::path_choice packed = att::cudnn::path_for<memkit::bf16>(exec, a, false, true);
  CHECK_FALSE(packed.uses_cudnn);
  CHECK(packed.reason.find("packed documents") != std::string::npos);
  att::problem_arguments f = a;
  f.element_bytes = 4;
  CHECK(att::cudnn::path_for<float>(exec, f, true).reason.find("fp32") != std::string::npos);
  // head_dim 36: rows of 72 bytes, not the 16-byte multiple cuDNN's engines read (only the path is asked here).
  att::problem_arguments odd = a;
  odd.head_dim = 36;
  const att::cudnn::path_choice rejected = att::cudnn::path_for<memkit::fp16>(exec, odd, false);
  CHECK_FALSE(rejected.uses_cudnn);
  std::printf("attention cuDNN path, head_dim 36: %s\n", rejected.reason.c_str());
  // The fallbacks still give the host path's results (and the built-in kernel's bytes).
  const std::vector<std::int32_t> two_rows{0, 1, 2, 70, 71, 150, /**/ 0, 64, 130, 149, 150, 150};
  CHECK_FALSE(cudnn_matches_host<memkit::bf16>(2, 4, 2, 150, 64, true, 0, 2e-2, two_rows));
  CHECK_FALSE(cudnn_matches_host<float>(2, 4, 2, 100, 40, false, 0, 1e-4));
}
