// One attention problem for the GPU suites that hold a device path to memkit's host path (tests/cuda/attention_test.cu,
// tests/cudnn/attention_cudnn_test.cu): inputs drawn once, the host forward and backward on them as the reference,
// the same inputs uploaded on a stream of its own, the device results fetched, and their errors against the host's.
// Needs nvcc and a device; the caller runs whichever device path it tests on `exec` with the buffers here.
#pragma once

#include <doctest/doctest.h>

#include <memkit/attention/flash_attention.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "support/test_values.hpp"
#include "support/torch_attention_cases.hpp"  // scaled_error: max |x - ref| / max |ref|

namespace memkit_test {

// Forward + backward's five results on the host (the device's after fetch()).
template <class T>
struct attention_results {
  std::vector<T> out, dq, dk, dv;
  std::vector<float> lse;
};

struct attention_errors {
  double out, lse, dq, dk, dv;
};

template <class T>
class attention_device_case {
 public:
  // q, k, v, dout standard normal (seeds 1-4), rounded to T; `offsets` ([B, N + 1] packed documents) when not empty.
  attention_device_case(std::int64_t B, std::int64_t Hq, std::int64_t Hkv, std::int64_t S, std::int64_t D,
                        const memkit::attention::attention_options& options, std::vector<std::int32_t> offsets = {})
      : qs{B, Hq, S, D}, ks{B, Hkv, S, D}, ls{B, Hq, S}, offsets_(std::move(offsets)) {
    namespace att = memkit::attention;
    const std::int64_t nq = B * Hq * S * D, nkv = B * Hkv * S * D;
    q_ = convert<T>(standard_normal(nq, 1));
    k_ = convert<T>(standard_normal(nkv, 2));
    v_ = convert<T>(standard_normal(nkv, 3));
    dout_ = convert<T>(standard_normal(nq, 4));
    host.out.resize(nq), host.dq.resize(nq), host.dk.resize(nkv), host.dv.resize(nkv), host.lse.resize(B * Hq * S);
    const memkit::shape os{B, offsets_.empty() ? 0 : static_cast<std::int64_t>(offsets_.size()) / B};
    auto hv = [](auto& x, memkit::shape s) { return memkit::host_view(x.data(), s); };
    const memkit::tensor_view<const std::int32_t> host_docs =
        offsets_.empty() ? memkit::tensor_view<const std::int32_t>::none() : memkit::host_view(offsets_.data(), os);
    att::forward<T>(memkit::host, hv(q_, qs), hv(k_, ks), hv(v_, ks), host_docs, hv(host.out, qs), hv(host.lse, ls),
                    options, memkit::default_host_resource());
    att::backward<T>(memkit::host, {hv(q_, qs), hv(k_, ks), hv(v_, ks), hv(host.out, qs), hv(host.lse, ls), host_docs},
                     hv(dout_, qs), {hv(host.dq, qs), hv(host.dk, ks), hv(host.dv, ks)}, options,
                     memkit::default_host_resource());

    q = memkit::buffer<T>(device, qs), k = memkit::buffer<T>(device, ks), v = memkit::buffer<T>(device, ks);
    dout = memkit::buffer<T>(device, qs), out = memkit::buffer<T>(device, qs);
    dq = memkit::buffer<T>(device, qs), dk = memkit::buffer<T>(device, ks), dv = memkit::buffer<T>(device, ks);
    lse = memkit::buffer<float>(device, ls);
    upload(q, q_), upload(k, k_), upload(v, v_), upload(dout, dout_);
    if (!offsets_.empty()) {
      device_offsets = memkit::buffer<std::int32_t>(device, os);
      upload(device_offsets, offsets_);
      documents = device_offsets.view();
    }
  }
  attention_device_case(const attention_device_case&) = delete;
  attention_device_case& operator=(const attention_device_case&) = delete;
  ~attention_device_case() {
    // The buffers go back stream-ordered on `stream`, which must outlive them.
    q = {}, k = {}, v = {}, dout = {}, out = {}, dq = {}, dk = {}, dv = {}, lse = {}, device_offsets = {};
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  }

  bool packed() const noexcept { return !offsets_.empty(); }

  // The device's out, lse, dq, dk, dv (waits for the stream).
  attention_results<T> fetch() const {
    attention_results<T> r{download(out), download(dq), download(dk), download(dv), download(lse)};
    MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return r;
  }
  attention_errors errors(const attention_results<T>& device_results) const {
    using torch_sdpa::scaled_error;
    return {scaled_error(device_results.out, host.out), scaled_error(device_results.lse, host.lse),
            scaled_error(device_results.dq, host.dq), scaled_error(device_results.dk, host.dk),
            scaled_error(device_results.dv, host.dv)};
  }

  const memkit::shape qs, ks, ls;
  attention_results<T> host;  // the host path's results: the reference

 private:
  std::vector<T> q_, k_, v_, dout_;
  std::vector<std::int32_t> offsets_;

 public:
  cudaStream_t stream = new_stream();
  memkit::device_async_resource device{stream};
  memkit::cuda_executor exec{0, stream};
  memkit::buffer<T> q, k, v, dout, out, dq, dk, dv;
  memkit::buffer<float> lse;
  memkit::buffer<std::int32_t> device_offsets;
  memkit::tensor_view<const std::int32_t> documents = memkit::tensor_view<const std::int32_t>::none();

 private:
  static cudaStream_t new_stream() {
    cudaStream_t s{};
    MEMKIT_CUDA_CHECK(cudaStreamCreate(&s));
    return s;
  }
  template <class U>
  void upload(memkit::buffer<U>& dst, const std::vector<U>& src) {
    MEMKIT_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), dst.bytes(), cudaMemcpyHostToDevice, stream));
  }
  template <class U>
  std::vector<U> download(const memkit::buffer<U>& src) const {
    std::vector<U> h(static_cast<std::size_t>(src.size()));
    MEMKIT_CUDA_CHECK(cudaMemcpyAsync(h.data(), src.data(), src.bytes(), cudaMemcpyDeviceToHost, stream));
    return h;
  }
};

// The GPU suites' bounds: out and the gradients within `tolerance` of the host's scale, lse within 1e-4.
inline void check_attention_errors(const attention_errors& e, double tolerance) {
  CHECK(e.out <= tolerance);
  CHECK(e.lse <= 1e-4);
  CHECK(e.dq <= tolerance);
  CHECK(e.dk <= tolerance);
  CHECK(e.dv <= tolerance);
}

}  // namespace memkit_test
