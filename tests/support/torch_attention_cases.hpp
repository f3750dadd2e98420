// PyTorch's scaled-dot-product attention results (tests/data/attention/torch_sdpa.safetensors, written by
// make_attention_data.py beside it) for the host and CUDA attention tests: the cases, their inputs regenerated
// bit for bit from memkit's counter-based generator (checked against the bit sums the script recorded), memkit's
// host run of a case, and the error measures both tests report.
#pragma once

#include <memkit/attention/flash_attention.hpp>
#include <memkit/core/float16.hpp>
#include <memkit/core/random.hpp>
#include <memkit/io/json.hpp>
#include <memkit/io/safetensors.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace memkit_test::torch_sdpa {

inline std::string data_path() {
  return std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/attention/torch_sdpa.safetensors";
}

// Errors against a reference: out, dq, dk, dv relative to the reference's largest value.
struct errors {
  double out = 0, dq = 0, dk = 0, dv = 0;
  double worst() const { return std::max({out, dq, dk, dv}); }
};

// One problem and torch's float64 results for it, stored as fp32.
struct reference_case {
  std::string name, dtype;  // dtype: "fp32" or "bf16"
  std::int64_t B = 0, Hq = 0, Hkv = 0, S = 0, D = 0, window = 0;
  bool causal = false;
  double scale = 0;  // 0: 1 / sqrt(D)
  std::uint64_t seed = 0;
  std::uint64_t input_bits[4] = {};  // q, k, v, dout: the sum of the elements' bit patterns
  errors torch;            // torch's own run in the case's dtype against the float64 reference (a yardstick)
  double torch_lse = 0;    // and its flash kernel's lse, absolute
  std::vector<float> out, lse, dq, dk, dv;  // [B, Hq, S, D], [B, Hq, S], [B, Hq, S, D], [B, Hkv, S, D] x 2
  std::vector<std::int32_t> offsets;        // [B, N + 1] for packed documents, else empty

  std::int64_t q_elements() const { return B * Hq * S * D; }
  std::int64_t kv_elements() const { return B * Hkv * S * D; }
  memkit::attention::attention_options options() const {
    memkit::attention::attention_options o;
    o.causal = causal;
    o.window = window;
    o.scale = static_cast<float>(scale);
    return o;
  }
};

// Every case of the file, references loaded. The script's metadata "cases" is the list; each case's tensors are
// "<name>.out" and so on.
inline std::vector<reference_case> load_cases() {
  const memkit::safetensors::reader file(data_path());
  const std::string* text = file.find_metadata("cases");
  memkit::require(text != nullptr, data_path() + " has no \"cases\" metadata");
  const memkit::json::value list = memkit::json::parse(*text, "torch_sdpa cases");
  std::vector<reference_case> cases;
  for (const memkit::json::value& c : list.as_array()) {
    reference_case r;
    r.name = c.at("name").as_string();
    r.dtype = c.at("dtype").as_string();
    r.B = c.at("batch").as_int();
    r.Hq = c.at("query_heads").as_int();
    r.Hkv = c.at("kv_heads").as_int();
    r.S = c.at("sequence").as_int();
    r.D = c.at("head_dim").as_int();
    r.causal = c.at("causal").as_bool();
    r.window = c.at("window").as_int();
    r.scale = c.at("scale").as_double();
    r.seed = static_cast<std::uint64_t>(c.at("seed").as_int());
    const char* inputs[4] = {"q", "k", "v", "dout"};
    for (int i = 0; i < 4; ++i) r.input_bits[i] = std::stoull(c.at("input_bits").at(inputs[i]).as_string());
    const memkit::json::value& t = c.at("torch_error");
    r.torch = {t.at("out").as_double(), t.at("dq").as_double(), t.at("dk").as_double(), t.at("dv").as_double()};
    r.torch_lse = t.at("lse").as_double();
    r.out = file.read_vector<float>(r.name + ".out");
    r.lse = file.read_vector<float>(r.name + ".lse");
    r.dq = file.read_vector<float>(r.name + ".dq");
    r.dk = file.read_vector<float>(r.name + ".dk");
    r.dv = file.read_vector<float>(r.name + ".dv");
    if (c.at("document_offsets").as_bool()) r.offsets = file.read_vector<std::int32_t>(r.name + ".document_offsets");
    memkit::require(static_cast<std::int64_t>(r.out.size()) == r.q_elements() &&
                        static_cast<std::int64_t>(r.dk.size()) == r.kv_elements() &&
                        static_cast<std::int64_t>(r.lse.size()) == r.B * r.Hq * r.S,
                    "torch_sdpa case " + r.name + ": tensor sizes do not match its shape");
    cases.push_back(std::move(r));
  }
  return cases;
}

// Input `counter` (q 0, k 1, v 2, dout 3) of a case, as the script drew it: uniform with variance 1 in fp32, then
// rounded to T to nearest even.
template <class T>
std::vector<T> input(const reference_case& c, int counter) {
  const std::int64_t count = (counter == 1 || counter == 2) ? c.kv_elements() : c.q_elements();
  std::vector<T> x(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    const float u = memkit::unit_float(memkit::random_word(c.seed, static_cast<std::uint64_t>(counter),
                                                           static_cast<std::uint64_t>(i)));
    x[static_cast<std::size_t>(i)] = memkit::from_float<T>((u - 0.5f) * 3.4641016f);
  }
  return x;
}

// The sum of the elements' bit patterns (what the script recorded per input).
template <class T>
std::uint64_t bit_sum(const std::vector<T>& x) {
  using bits_t = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>;
  static_assert(sizeof(T) == sizeof(bits_t));
  std::uint64_t sum = 0;
  for (const T& v : x) {
    bits_t b;
    std::memcpy(&b, &v, sizeof b);
    sum += b;
  }
  return sum;
}

// The four inputs of a case in type T.
template <class T>
struct inputs {
  std::vector<T> q, k, v, dout;
  explicit inputs(const reference_case& c)
      : q(input<T>(c, 0)), k(input<T>(c, 1)), v(input<T>(c, 2)), dout(input<T>(c, 3)) {}
  // Whether these are the inputs torch saw (same generator, same rounding).
  bool match(const reference_case& c) const {
    return bit_sum(q) == c.input_bits[0] && bit_sum(k) == c.input_bits[1] && bit_sum(v) == c.input_bits[2] &&
           bit_sum(dout) == c.input_bits[3];
  }
};

// The five results of forward + backward.
template <class T>
struct results {
  std::vector<T> out, dq, dk, dv;
  std::vector<float> lse;
};

// The case's document offsets as a view (none when it has none).
inline memkit::tensor_view<const std::int32_t> offsets_view(const reference_case& c) {
  if (c.offsets.empty()) return memkit::tensor_view<const std::int32_t>::none();
  return memkit::host_view(c.offsets.data(), memkit::shape{c.B, static_cast<std::int64_t>(c.offsets.size()) / c.B});
}

// memkit's host forward + backward on a case's inputs.
template <class T>
results<T> run_host(const reference_case& c, inputs<T>& in) {
  namespace att = memkit::attention;
  const memkit::shape qs{c.B, c.Hq, c.S, c.D}, ks{c.B, c.Hkv, c.S, c.D}, ls{c.B, c.Hq, c.S};
  results<T> r{std::vector<T>(in.q.size()), std::vector<T>(in.q.size()), std::vector<T>(in.k.size()),
               std::vector<T>(in.v.size()), std::vector<float>(static_cast<std::size_t>(c.B * c.Hq * c.S))};
  const auto hv = [](auto& x, const memkit::shape& s) { return memkit::host_view(x.data(), s); };
  att::attention_options o = c.options();
  o.host_threads = 2;
  auto& ws = memkit::default_host_resource();
  const auto docs = offsets_view(c);
  att::forward<T>(memkit::host, hv(in.q, qs), hv(in.k, ks), hv(in.v, ks), docs, hv(r.out, qs), hv(r.lse, ls), o, ws);
  att::backward<T>(memkit::host, {hv(in.q, qs), hv(in.k, ks), hv(in.v, ks), hv(r.out, qs), hv(r.lse, ls), docs},
                   hv(in.dout, qs), {hv(r.dq, qs), hv(r.dk, ks), hv(r.dv, ks)}, o, ws);
  return r;
}

// max |x - ref| / max |ref|; max |x - ref| where the reference is zero but for float64 rounding (below 1e-12): dq
// and dk of a length-1 sequence, whose one weight is 1, so dS = P (dP - delta) = 0.
template <class V, class R>
double scaled_error(const std::vector<V>& x, const std::vector<R>& ref) {
  memkit::require(x.size() == ref.size(),
                  "scaled_error: " + std::to_string(x.size()) + " values against " + std::to_string(ref.size()));
  double worst = 0, largest = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double r = memkit::to_float(ref[i]);
    worst = std::max(worst, std::abs(static_cast<double>(memkit::to_float(x[i])) - r));
    largest = std::max(largest, std::abs(r));
  }
  return worst / (largest >= 1e-12 ? largest : 1.0);
}

// max |x - ref| (lse is compared absolutely: its scale is log S, not the values').
inline double absolute_error(const std::vector<float>& x, const std::vector<float>& ref) {
  memkit::require(x.size() == ref.size(), "absolute_error: sizes differ");
  double worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(x[i]) - static_cast<double>(ref[i])));
  return worst;
}

// The errors of one run against torch's reference or against another run.
struct measured {
  errors e;
  double lse = 0;
  void widen(const measured& m) {  // the worst of both
    e = {std::max(e.out, m.e.out), std::max(e.dq, m.e.dq), std::max(e.dk, m.e.dk), std::max(e.dv, m.e.dv)};
    lse = std::max(lse, m.lse);
  }
};

template <class T>
measured compare(const results<T>& r, const reference_case& c) {
  return {{scaled_error(r.out, c.out), scaled_error(r.dq, c.dq), scaled_error(r.dk, c.dk), scaled_error(r.dv, c.dv)},
          absolute_error(r.lse, c.lse)};
}

template <class T>
measured compare(const results<T>& r, const results<T>& ref) {
  return {{scaled_error(r.out, ref.out), scaled_error(r.dq, ref.dq), scaled_error(r.dk, ref.dk),
           scaled_error(r.dv, ref.dv)},
          absolute_error(r.lse, ref.lse)};
}

}  // namespace memkit_test::torch_sdpa
