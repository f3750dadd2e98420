// memkit::attention under nvcc: argument checks of the CUDA entry points (run everywhere), and the CUDA kernels
// against the host path (gpu suite; Skipped visibly without a device).
#include <doctest/doctest.h>

#include <memkit/attention/flash_attention.hpp>
#include <memkit/memory/resource.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include "support/attention_device_case.hpp"
#include "support/gpu_test.hpp"
#include "support/test_values.hpp"
#include "support/torch_attention_cases.hpp"

namespace {

namespace att = memkit::attention;

template <class T>
memkit::tensor_view<T> fake_device(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
  // Never dereferenced: the checks below throw before anything reaches the device.
  return {reinterpret_cast<T*>(std::uintptr_t{4096}), memkit::shape{a, b, c, d}, memkit::memory_kind::device};
}

}  // namespace

TEST_CASE("attention cuda build: the CUDA entry points reject bad arguments before launching") {
  const memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream(0);
  memkit::host_resource workspace;
  att::attention_options o;
  const memkit::tensor_view<float> lse{reinterpret_cast<float*>(std::uintptr_t{4096}), memkit::shape{1, 2, 8},
                                       memkit::memory_kind::device};
  // A forward with query heads 2, kv heads 1, seq 8 at head_dim D, on fake device tensors (every call throws first).
  const auto forward_gqa = [&]<class T>(std::type_identity<T>, std::int64_t D) {
    att::forward<T>(exec, fake_device<T>(1, 2, 8, D), fake_device<T>(1, 1, 8, D), fake_device<T>(1, 1, 8, D),
                    fake_device<T>(1, 2, 8, D), lse, o, workspace);
  };
  constexpr std::type_identity<memkit::bf16> bf16;
  constexpr std::type_identity<memkit::fp16> fp16;
  constexpr std::type_identity<float> fp32;
  // bf16 with a head_dim that is not a multiple of 16.
  CHECK_THROWS_WITH_AS(forward_gqa(bf16, 24), doctest::Contains("multiple of 16"), memkit::error);
  // Both refusals name what CUDA runs, the mma kernels' head_dims included.
  CHECK_THROWS_WITH_AS(forward_gqa(bf16, 24),
                       doctest::Contains("attention_kernel::mma's kernels run bf16/fp16 at 64, 96, 128, 256"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(forward_gqa(fp32, 256),
                       doctest::Contains("head_dim 256 is above the WMMA kernels' 128. CUDA runs"), memkit::error);
  // head_dim 256 runs only on the mma kernels: refused under `automatic` (the WMMA kernels), in fp32 and at sizes
  // the mma kernels lack, and with a tensor cp.async cannot copy (there is no kernel to fall back to).
  CHECK_THROWS_WITH_AS(forward_gqa(bf16, 256), doctest::Contains("(above 128 only with that option)"), memkit::error);
  o.kernel = att::attention_kernel::mma;
  CHECK_THROWS_WITH_AS(forward_gqa(fp32, 256), doctest::Contains("head_dim 256 is above the WMMA kernels' 128"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(forward_gqa(fp16, 192), doctest::Contains("head_dim 192 is above the WMMA kernels' 128"),
                       memkit::error);
  const memkit::tensor_view<memkit::bf16> unaligned{reinterpret_cast<memkit::bf16*>(std::uintptr_t{4096 + 2}),
                                                    memkit::shape{1, 2, 8, 256}, memkit::memory_kind::device};
  const auto aligned = [](std::int64_t heads) { return fake_device<memkit::bf16>(1, heads, 8, 256); };
  CHECK_THROWS_WITH_AS(att::forward<memkit::bf16>(exec, aligned(2), aligned(1), aligned(1), unaligned, lse, o,
                                                  workspace),
                       doctest::Contains("attention::forward (CUDA): head_dim 256 runs only on attention_kernel::mma's "
                                         "kernels, which copy by 16-byte cp.async"),
                       memkit::error);
  // Backward refuses it before it takes its workspace (a host resource here, which would be refused after).
  CHECK_THROWS_WITH_AS(att::backward<memkit::bf16>(exec, {aligned(2), aligned(1), aligned(1), aligned(2), lse},
                                                   aligned(2), {unaligned, aligned(1), aligned(1)}, o, workspace),
                       doctest::Contains("attention::backward (CUDA): head_dim 256 runs only on"), memkit::error);
  o.kernel = att::attention_kernel::automatic;
  // Which problems the mma kernels take (the rest runs the WMMA kernels): bf16 / fp16 at 64, 96, 128, 256.
  for (std::int64_t D : {16, 32, 48, 64, 80, 96, 112, 128, 192, 256, 512}) {
    CAPTURE(D);
    const bool mine = D == 64 || D == 96 || D == 128 || D == 256;
    CHECK(att::detail::mma_forward_supports<memkit::bf16>(D) == mine);
    CHECK(att::detail::mma_forward_supports<memkit::fp16>(D) == mine);
    CHECK_FALSE(att::detail::mma_forward_supports<float>(D));
  }
  std::vector<float> host_q(1 * 2 * 8 * 16);
  CHECK_THROWS_WITH_AS(att::forward<float>(exec, memkit::host_view(host_q.data(), memkit::shape{1, 2, 8, 16}),
                                           fake_device<float>(1, 1, 8, 16), fake_device<float>(1, 1, 8, 16),
                                           fake_device<float>(1, 2, 8, 16), lse, o, workspace),
                       doctest::Contains("cannot access"), memkit::error);
  CHECK_THROWS_WITH_AS(att::forward<float>(exec, fake_device<float>(1, 3, 8, 16), fake_device<float>(1, 2, 8, 16),
                                           fake_device<float>(1, 2, 8, 16), fake_device<float>(1, 3, 8, 16), lse, o,
                                           workspace),
                       doctest::Contains("must divide"), memkit::error);
  // Packed-document offsets: the shape is checked; device-memory contents are not read on the host.
  const memkit::tensor_view<const std::int32_t> device_offsets{reinterpret_cast<const std::int32_t*>(std::uintptr_t{4096}),
                                                               memkit::shape{2, 3}, memkit::memory_kind::device};
  CHECK_THROWS_WITH_AS(att::forward<float>(exec, fake_device<float>(1, 2, 8, 16), fake_device<float>(1, 1, 8, 16),
                                           fake_device<float>(1, 1, 8, 16), device_offsets,
                                           fake_device<float>(1, 2, 8, 16), lse, o, workspace),
                       doctest::Contains("document_offsets must be int32 [batch = 1"), memkit::error);
  const std::vector<std::int32_t> pageable{0, 9};
  CHECK_THROWS_WITH_AS(att::forward<float>(exec, fake_device<float>(1, 2, 8, 16), fake_device<float>(1, 1, 8, 16),
                                           fake_device<float>(1, 1, 8, 16),
                                           memkit::host_view(pageable.data(), memkit::shape{1, 2}),
                                           fake_device<float>(1, 2, 8, 16), lse, o, workspace),
                       doctest::Contains("must end at the sequence length 8, got 9"), memkit::error);
  // The device needs no forward workspace and only delta in backward.
  const att::problem_arguments big{.batch = 2, .query_heads = 8, .kv_heads = 2, .sequence = 1000, .head_dim = 64,
                                   .on_device = true, .options = o};
  CHECK(att::workspace_bytes(att::forward_arguments{big}) == 0);
  // delta holds one float per row of all B * Hq * S rows, the count rounded up to 16.
  CHECK(att::workspace_bytes(att::backward_arguments{big}) == 2 * 8 * 1000 * sizeof(float));
  const att::problem_arguments small{.batch = 1, .query_heads = 3, .kv_heads = 1, .sequence = 7, .head_dim = 64,
                                     .on_device = true, .options = o};
  CHECK(att::workspace_bytes(att::backward_arguments{small}) == 32 * sizeof(float));
}

namespace {

// Runs forward and backward on the device against the host path, with packed-document offsets ([B, N + 1]) when
// `offsets` is not empty; returns the device's results.
template <class T>
memkit_test::attention_results<T> gpu_matches_host(std::int64_t B, std::int64_t Hq, std::int64_t Hkv, std::int64_t S,
                                                   std::int64_t D, bool causal, std::int64_t window, double tolerance,
                                                   const std::vector<std::int32_t>& offsets = {},
                                                   att::attention_kernel kernel = att::attention_kernel::automatic) {
  att::attention_options o;
  o.causal = causal;
  o.window = window;
  o.kernel = kernel;
  o.host_threads = 2;
  memkit_test::attention_device_case<T> c(B, Hq, Hkv, S, D, o, offsets);
  // A test of the mma kernels must run them, not the fallback (forward: q, k, v, out; backward: also dout and the
  // gradients).
  if (kernel == att::attention_kernel::mma)
    REQUIRE(att::detail::use_mma_kernel<T>(o, D, {c.q.data(), c.k.data(), c.v.data(), c.out.data(), c.dout.data(),
                                                  c.dq.data(), c.dk.data(), c.dv.data()},
                                                 "forward and backward (test)"));
  att::forward<T>(c.exec, c.q.view(), c.k.view(), c.v.view(), c.documents, c.out.view(), c.lse.view(), o, c.device);
  att::backward<T>(c.exec, {c.q.view(), c.k.view(), c.v.view(), c.out.view(), c.lse.view(), c.documents},
                   c.dout.view(), {c.dq.view(), c.dk.view(), c.dv.view()}, o, c.device);
  memkit_test::attention_results<T> got = c.fetch();
  CAPTURE(S);
  CAPTURE(D);
  CAPTURE(causal);
  CAPTURE(window);
  CAPTURE(offsets.size());
  CAPTURE(static_cast<int>(kernel));
  const memkit_test::attention_errors e = c.errors(got);
  std::printf("attention gpu (kernel %d) vs host (S %lld D %lld): out %.3g lse %.3g dq %.3g dk %.3g dv %.3g\n",
              static_cast<int>(kernel), static_cast<long long>(S), static_cast<long long>(D), e.out, e.lse, e.dq, e.dk,
              e.dv);
  memkit_test::check_attention_errors(e, tolerance);
  return got;
}

}  // namespace

MEMKIT_GPU_TEST_CASE("gpu: flash attention forward and backward agree with the host path") {
  for (bool causal : {true, false}) {
    gpu_matches_host<float>(2, 4, 2, 100, 40, causal, 0, 1e-4);
    gpu_matches_host<memkit::bf16>(2, 4, 2, 130, 64, causal, 0, 2e-2);
    gpu_matches_host<memkit::fp16>(1, 6, 3, 257, 128, causal, causal ? 0 : 50, 4e-3);
    gpu_matches_host<memkit::bf16>(1, 2, 1, 200, 64, causal, 33, 2e-2);
  }
}

MEMKIT_GPU_TEST_CASE("gpu: flash attention over packed documents agrees with the host path") {
  // Documents of length 1, empty ones padding a row, boundaries inside the CTA tiles (64 / 32 rows), GQA and MQA.
  const std::vector<std::int32_t> two_rows{0, 1, 2, 70, 71, 150, /**/ 0, 64, 130, 149, 150, 150};
  const std::vector<std::int32_t> one_row{0, 37, 38, 101, 257};
  for (bool causal : {true, false}) {
    gpu_matches_host<float>(2, 4, 2, 150, 40, causal, 0, 1e-4, two_rows);
    gpu_matches_host<memkit::bf16>(2, 4, 2, 150, 64, causal, 0, 2e-2, two_rows);
    gpu_matches_host<memkit::fp16>(1, 6, 3, 257, 128, causal, causal ? 0 : 50, 4e-3, one_row);
    gpu_matches_host<memkit::bf16>(1, 2, 1, 257, 64, causal, 33, 2e-2, one_row);
  }
}

MEMKIT_GPU_TEST_CASE("gpu: flash attention with one document per row is bit-identical to no offsets") {
  for (auto kernel : {att::attention_kernel::automatic, att::attention_kernel::mma})
  for (bool causal : {true, false}) {
    const auto plain = gpu_matches_host<memkit::bf16>(2, 4, 2, 130, 64, causal, 0, 2e-2, {}, kernel);
    const auto one = gpu_matches_host<memkit::bf16>(2, 4, 2, 130, 64, causal, 0, 2e-2, {0, 130, 0, 130}, kernel);
    const auto bits = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    CHECK(bits(plain.out, one.out));
    CHECK(bits(plain.lse, one.lse));
    CHECK(bits(plain.dq, one.dq));
    CHECK(bits(plain.dk, one.dk));
    CHECK(bits(plain.dv, one.dv));
  }
}

// The mma kernels (attention_options::kernel = mma: the forward and backward's dk/dv and dq passes) on every
// problem they run: bf16 and fp16, head_dim 64, 96, 128 and 256 (256: only they run it; the key pass as two
// launches), causal or not, sliding windows, GQA and MQA, packed documents (boundaries inside the 64-row tiles),
// sequences not a multiple of the 64-row / 64-key tiles. Tolerances are those of the WMMA kernels against the host
// (max |error| over max |value|; lse 1e-4): both round the weights (and dS) to the 16-bit type before their
// products, only the fp32 accumulation order differs. Then the two kernels against each other on the same inputs
// (head_dim 96 and 128; the WMMA kernels stop at 128).
MEMKIT_GPU_TEST_CASE("gpu: the mma kernels agree with the host path on every problem they run") {
  const auto mma = att::attention_kernel::mma;
  const std::vector<std::int32_t> two_rows{0, 1, 2, 70, 71, 150, /**/ 0, 64, 130, 149, 150, 150};
  const std::vector<std::int32_t> one_row{0, 37, 38, 101, 257};
  for (bool causal : {true, false}) {
    for (std::int64_t D : {64, 96, 128, 256}) {
      gpu_matches_host<memkit::bf16>(2, 4, 2, 130, D, causal, 0, 2e-2, {}, mma);
      gpu_matches_host<memkit::fp16>(2, 4, 2, 130, D, causal, 0, 4e-3, {}, mma);
      gpu_matches_host<memkit::bf16>(1, 6, 3, 257, D, causal, 33, 2e-2, {}, mma);
      gpu_matches_host<memkit::fp16>(1, 4, 1, 200, D, causal, causal ? 0 : 50, 4e-3, {}, mma);
      gpu_matches_host<memkit::bf16>(2, 4, 2, 150, D, causal, 0, 2e-2, two_rows, mma);
      gpu_matches_host<memkit::fp16>(1, 6, 3, 257, D, causal, causal ? 0 : 50, 4e-3, one_row, mma);
      gpu_matches_host<memkit::bf16>(1, 2, 1, 257, D, causal, 33, 2e-2, one_row, mma);
      gpu_matches_host<memkit::bf16>(1, 2, 2, 64, D, causal, 0, 2e-2, {}, mma);  // exactly one tile
      gpu_matches_host<memkit::fp16>(1, 2, 2, 1, D, causal, 0, 4e-3, {}, mma);   // one row
    }
  }
  for (std::int64_t D : {96, 128})
  for (bool causal : {true, false}) {
    const auto wmma = gpu_matches_host<memkit::bf16>(2, 4, 2, 300, D, causal, 0, 2e-2, {}, att::attention_kernel::wmma);
    const auto mine = gpu_matches_host<memkit::bf16>(2, 4, 2, 300, D, causal, 0, 2e-2, {}, mma);
    const auto apart = [](const auto& a, const auto& b) {  // max |a - b| over max |a|
      double worst = 0, largest = 1e-30;
      for (std::size_t i = 0; i < a.size(); ++i) {
        worst = std::max(worst, std::abs(double(memkit::to_float(a[i])) - double(memkit::to_float(b[i]))));
        largest = std::max(largest, std::abs(double(memkit::to_float(a[i]))));
      }
      return worst / largest;
    };
    const double out = apart(wmma.out, mine.out), lse = apart(wmma.lse, mine.lse), dq = apart(wmma.dq, mine.dq),
                 dk = apart(wmma.dk, mine.dk), dv = apart(wmma.dv, mine.dv);
    std::printf("attention mma vs wmma (D %lld): out %.3g lse %.3g dq %.3g dk %.3g dv %.3g (relative to the largest)\n",
                static_cast<long long>(D), out, lse, dq, dk, dv);
    CHECK(out <= 2e-2);  // a few bf16 ulps
    CHECK(lse <= 1e-4);  // fp32 sums in another order
    CHECK(dq <= 2e-2);
    CHECK(dk <= 2e-2);
    CHECK(dv <= 2e-2);
  }
}

namespace {

namespace ts = memkit_test::torch_sdpa;

// One case of tests/data/attention/torch_sdpa.safetensors on the device with `kernel`; returns the results.
template <class T>
ts::results<T> run_on_device(const ts::reference_case& c, const ts::inputs<T>& in, att::attention_kernel kernel) {
  att::attention_options o = c.options();
  o.kernel = kernel;
  const memkit::shape qs{c.B, c.Hq, c.S, c.D}, ks{c.B, c.Hkv, c.S, c.D}, ls{c.B, c.Hq, c.S};
  cudaStream_t stream{};
  MEMKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  memkit::device_async_resource device(stream);
  const memkit::cuda_executor exec{0, stream};
  memkit::buffer<T> q(device, qs), k(device, ks), v(device, ks), dout(device, qs), out(device, qs), dq(device, qs),
      dk(device, ks), dv(device, ks);
  memkit::buffer<float> lse(device, ls);
  memkit::buffer<std::int32_t> offsets;
  const auto up = [&](auto& dst, const auto& src) {
    MEMKIT_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), dst.bytes(), cudaMemcpyHostToDevice, stream));
  };
  up(q, in.q), up(k, in.k), up(v, in.v), up(dout, in.dout);
  memkit::tensor_view<const std::int32_t> docs = memkit::tensor_view<const std::int32_t>::none();
  if (!c.offsets.empty()) {
    offsets = memkit::buffer<std::int32_t>(device, ts::offsets_view(c).shape());
    up(offsets, c.offsets);
    docs = offsets.view();
  }
  if (kernel == att::attention_kernel::mma)  // a test of the mma kernels must run them, not the fallback
    REQUIRE(att::detail::use_mma_kernel<T>(o, c.D, {q.data(), k.data(), v.data(), out.data(), dout.data(), dq.data(),
                                                    dk.data(), dv.data()},
                                                   "forward and backward (test)"));
  att::forward<T>(exec, q.view(), k.view(), v.view(), docs, out.view(), lse.view(), o, device);
  att::backward<T>(exec, {q.view(), k.view(), v.view(), out.view(), lse.view(), docs}, dout.view(),
                   {dq.view(), dk.view(), dv.view()}, o, device);
  const auto down = [&](const auto& src) {
    std::vector<std::remove_cv_t<std::remove_reference_t<decltype(*src.data())>>> host(src.size());
    MEMKIT_CUDA_CHECK(cudaMemcpyAsync(host.data(), src.data(), src.bytes(), cudaMemcpyDeviceToHost, stream));
    return host;
  };
  ts::results<T> r{down(out), down(dq), down(dk), down(dv), down(lse)};
  MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  q = {}, k = {}, v = {}, dout = {}, out = {}, dq = {}, dk = {}, dv = {}, lse = {}, offsets = {};
  MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
  return r;
}

// Bounds of the device against torch (max |x - ref| / max |ref|; lse absolute). Not yet measured on a GPU: they
// are the host's measured worst against torch (fp32 7.0e-7, bf16 3.9e-3, fp16 4.6e-4, lse 1.9e-6; tests/host/
// attention_torch_test.cpp) plus the device's measured worst against the host (fp32 6.4e-7, bf16 7.3e-3 (WMMA),
// fp16 7.7e-4, lse 2.3e-7; docs/attention.md), rounded up. Against the host: the bounds of the tests above.
// torch's own CUDA flash / cuDNN backends on the same inputs: bench/peers/sdpa_device.py (`./dev.sh gpu`).
struct device_bounds {
  double torch_value, torch_lse, host_value, host_lse;
};
template <class T>
constexpr device_bounds bounds_of() {
  if constexpr (std::is_same_v<T, float>) return {1e-5, 2e-5, 1e-4, 1e-4};
  else if constexpr (std::is_same_v<T, memkit::fp16>) return {2e-3, 2e-5, 4e-3, 1e-4};
  else return {1.2e-2, 2e-5, 2e-2, 1e-4};
}

// Each kernel that runs the case (WMMA up to head_dim 128; mma for bf16 and fp16 at the head_dims it runs, 64, 96,
// 128 and 256) against torch's reference and against memkit's host path on the same inputs.
template <class T>
void device_matches_torch(const ts::reference_case& c, ts::measured& worst_torch, ts::measured& worst_host) {
  ts::inputs<T> in(c);
  REQUIRE_MESSAGE(in.match(c), "the regenerated inputs of ", c.name, " differ from torch's");
  const ts::results<T> host = ts::run_host(c, in);
  constexpr device_bounds b = bounds_of<T>();
  std::vector<att::attention_kernel> kernels;
  if (c.D <= 128) kernels.push_back(att::attention_kernel::wmma);
  if (att::detail::mma_forward_supports<T>(c.D)) kernels.push_back(att::attention_kernel::mma);
  for (const att::attention_kernel kernel : kernels) {
    CAPTURE(static_cast<int>(kernel));
    const ts::results<T> gpu = run_on_device(c, in, kernel);
    const ts::measured t = ts::compare(gpu, c), h = ts::compare(gpu, host);
    std::printf("attention gpu (kernel %d) %-32s vs torch: out %.2g dq %.2g dk %.2g dv %.2g lse %.2g | vs host: "
                "out %.2g dq %.2g dk %.2g dv %.2g lse %.2g\n",
                static_cast<int>(kernel), c.name.c_str(), t.e.out, t.e.dq, t.e.dk, t.e.dv, t.lse, h.e.out, h.e.dq,
                h.e.dk, h.e.dv, h.lse);
    CHECK(t.e.out <= b.torch_value);
    CHECK(t.e.dq <= b.torch_value);
    CHECK(t.e.dk <= b.torch_value);
    CHECK(t.e.dv <= b.torch_value);
    CHECK(t.lse <= b.torch_lse);
    CHECK(h.e.out <= b.host_value);
    CHECK(h.e.dq <= b.host_value);
    CHECK(h.e.dk <= b.host_value);
    CHECK(h.e.dv <= b.host_value);
    CHECK(h.lse <= b.host_lse);
    worst_torch.widen(t);
    worst_host.widen(h);
  }
}

}  // namespace

// PyTorch as the oracle on the device: every case of tests/data/attention/torch_sdpa.safetensors (fp32, bf16, fp16,
// causal and not, sliding windows, GQA and MQA, head_dim 16-128, lengths 1-130, packed documents;
// make_attention_data.py there), the WMMA kernels and, where they run, the mma kernels, forward and backward.
MEMKIT_GPU_TEST_CASE("gpu: flash attention forward and backward agree with PyTorch's SDPA (tests/data/attention)") {
  const std::vector<ts::reference_case> cases = ts::load_cases();
  REQUIRE(cases.size() == 16);
  ts::measured torch_fp32, torch_bf16, torch_fp16, host_fp32, host_bf16, host_fp16;
  for (const ts::reference_case& c : cases) {
    CAPTURE(c.name);
    if (c.dtype == "fp32") device_matches_torch<float>(c, torch_fp32, host_fp32);
    else if (c.dtype == "bf16") device_matches_torch<memkit::bf16>(c, torch_bf16, host_bf16);
    else if (c.dtype == "fp16") device_matches_torch<memkit::fp16>(c, torch_fp16, host_fp16);
    else FAIL("unknown dtype " << c.dtype);
  }
  std::printf("attention gpu vs torch, worst: fp32 %.3g (lse %.3g), bf16 %.3g (lse %.3g), fp16 %.3g (lse %.3g); vs "
              "host: fp32 %.3g, bf16 %.3g, fp16 %.3g\n",
              torch_fp32.e.worst(), torch_fp32.lse, torch_bf16.e.worst(), torch_bf16.lse, torch_fp16.e.worst(),
              torch_fp16.lse, host_fp32.e.worst(), host_bf16.e.worst(), host_fp16.e.worst());
}
