// memkit::attention over packed documents (document_offsets): each document of a packed row against the same
// document run on its own through the plain attention (every dtype, causal / window / GQA, forward and backward,
// documents of length 1 and empty ones); one document per row bit-identical to no offsets; documents aligned to the
// host tiles bit-identical to the separate runs; bad offsets; the workspace a tracker sees against the prediction.
#include <doctest/doctest.h>

#include <memkit/attention/flash_attention.hpp>
#include <memkit/memory/tracking.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "support/test_values.hpp"

namespace {

namespace att = memkit::attention;
using offsets_t = std::vector<std::int32_t>;

template <class T>
memkit::tensor_view<T> view4(std::vector<T>& data, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
  return memkit::host_view(data.data(), memkit::shape{a, b, c, d});
}

// Inputs of one problem and the five results of forward + backward.
template <class T>
struct outputs {
  std::vector<T> out, dq, dk, dv;
  std::vector<float> lse;
};

template <class T>
struct problem_data {
  std::int64_t B, Hq, Hkv, S, D;
  std::vector<T> q, k, v, dout;
  problem_data(std::int64_t b, std::int64_t hq, std::int64_t hkv, std::int64_t s, std::int64_t d, unsigned seed)
      : B(b), Hq(hq), Hkv(hkv), S(s), D(d) {
    q = memkit_test::convert<T>(memkit_test::standard_normal(B * Hq * S * D, seed));
    k = memkit_test::convert<T>(memkit_test::standard_normal(B * Hkv * S * D, seed + 1));
    v = memkit_test::convert<T>(memkit_test::standard_normal(B * Hkv * S * D, seed + 2));
    dout = memkit_test::convert<T>(memkit_test::standard_normal(B * Hq * S * D, seed + 3));
  }
  problem_data(std::int64_t b, std::int64_t hq, std::int64_t hkv, std::int64_t s, std::int64_t d)
      : B(b), Hq(hq), Hkv(hkv), S(s), D(d) {}

  // Forward and backward, with the offsets (int32 [B, N + 1]) when `offsets` is not empty.
  outputs<T> run(const att::attention_options& o, const offsets_t& offsets, memkit::memory_resource& workspace) const {
    outputs<T> r;
    r.out.resize(q.size());
    r.dq.resize(q.size());
    r.dk.resize(k.size());
    r.dv.resize(v.size());
    r.lse.resize(static_cast<std::size_t>(B * Hq * S));
    auto& self = const_cast<problem_data&>(*this);
    const auto qv = view4(self.q, B, Hq, S, D), kv = view4(self.k, B, Hkv, S, D), vv = view4(self.v, B, Hkv, S, D);
    const auto ov = view4(r.out, B, Hq, S, D);
    const auto lv = memkit::host_view(r.lse.data(), memkit::shape{B, Hq, S});
    const memkit::tensor_view<const std::int32_t> docs =
        offsets.empty() ? memkit::tensor_view<const std::int32_t>::none()
                        : memkit::host_view(offsets.data(), memkit::shape{B, static_cast<std::int64_t>(offsets.size()) / B});
    att::forward<T>(memkit::host, qv, kv, vv, docs, ov, lv, o, workspace);
    att::backward<T>(memkit::host, {qv, kv, vv, ov, lv, docs}, view4(self.dout, B, Hq, S, D),
                     {view4(r.dq, B, Hq, S, D), view4(r.dk, B, Hkv, S, D), view4(r.dv, B, Hkv, S, D)}, o, workspace);
    return r;
  }

  // The positions [begin, begin + length) of batch row b as a problem of its own (batch 1).
  problem_data slice(std::int64_t b, std::int64_t begin, std::int64_t length) const {
    problem_data s(1, Hq, Hkv, length, D);
    const auto copy = [&](const std::vector<T>& from, std::int64_t heads, std::vector<T>& to) {
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t i = 0; i < length; ++i)
          for (std::int64_t d = 0; d < D; ++d)
            to.push_back(from[static_cast<std::size_t>(((b * heads + h) * S + begin + i) * D + d)]);
    };
    copy(q, Hq, s.q);
    copy(k, Hkv, s.k);
    copy(v, Hkv, s.v);
    copy(dout, Hq, s.dout);
    return s;
  }
};

// Largest |packed - separate| over the largest |separate| of one tensor's document positions (per head), and
// whether every compared element is bit-identical.
struct comparison {
  double error = 0, largest = 1e-30;
  bool identical = true;
  template <class V>
  void add(V packed, V separate) {
    const double a = memkit::to_float(packed), b = memkit::to_float(separate);
    error = std::max(error, std::abs(a - b));
    largest = std::max(largest, std::abs(b));
    identical = identical && std::memcmp(&packed, &separate, sizeof(V)) == 0;
  }
  double scaled() const { return error / largest; }
};

struct varlen_errors {
  comparison out, lse, dq, dk, dv;
  double worst() const { return std::max({out.scaled(), dq.scaled(), dk.scaled(), dv.scaled()}); }
  bool identical() const { return out.identical && lse.identical && dq.identical && dk.identical && dv.identical; }
};

// Runs the packed problem once and each of its documents alone, and compares every position.
template <class T>
varlen_errors packed_against_separate(const problem_data<T>& data, const offsets_t& offsets,
                                      const att::attention_options& o) {
  auto& ws = memkit::default_host_resource();
  const outputs<T> packed = data.run(o, offsets, ws);
  const std::int64_t count = static_cast<std::int64_t>(offsets.size()) / data.B, S = data.S, D = data.D;
  varlen_errors e;
  for (std::int64_t b = 0; b < data.B; ++b)
    for (std::int64_t doc = 0; doc + 1 < count; ++doc) {
      const std::int64_t begin = offsets[static_cast<std::size_t>(b * count + doc)];
      const std::int64_t length = offsets[static_cast<std::size_t>(b * count + doc + 1)] - begin;
      if (length == 0) continue;
      const problem_data<T> alone = data.slice(b, begin, length);
      const outputs<T> separate = alone.run(o, {}, ws);
      const auto compare = [&](const std::vector<T>& p, const std::vector<T>& s, std::int64_t heads, comparison& c) {
        for (std::int64_t h = 0; h < heads; ++h)
          for (std::int64_t i = 0; i < length; ++i)
            for (std::int64_t d = 0; d < D; ++d)
              c.add(p[static_cast<std::size_t>(((b * heads + h) * S + begin + i) * D + d)],
                    s[static_cast<std::size_t>((h * length + i) * D + d)]);
      };
      compare(packed.out, separate.out, data.Hq, e.out);
      compare(packed.dq, separate.dq, data.Hq, e.dq);
      compare(packed.dk, separate.dk, data.Hkv, e.dk);
      compare(packed.dv, separate.dv, data.Hkv, e.dv);
      for (std::int64_t h = 0; h < data.Hq; ++h)
        for (std::int64_t i = 0; i < length; ++i)
          e.lse.add(packed.lse[static_cast<std::size_t>((b * data.Hq + h) * S + begin + i)],
                    separate.lse[static_cast<std::size_t>(h * length + i)]);
    }
  return e;
}

// Tolerances of the packed result against the separate one, relative to each tensor's largest value. The two
// differ only in where the key tiles start (packed: multiples of 64 in the row, separate: in the document), so in
// the online softmax's order of rescaling: fp32 rounding, then at most one rounding step of T in the outputs
// (bf16: 2^-8 of a value, fp16: 2^-11).
template <class T>
constexpr double tolerance() {
  if constexpr (std::is_same_v<T, float>) return 2e-6;
  else if constexpr (std::is_same_v<T, memkit::fp16>) return 5e-4;
  else return 4e-3;
}

struct varlen_config {
  std::int64_t B, Hq, Hkv, S, D;
  bool causal;
  std::int64_t window;
  offsets_t offsets;  // [B, N + 1]
};

// Documents of length 1, empty documents padding a row, documents across host tiles (64), GQA and MQA.
const varlen_config varlen_configs[] = {
    {2, 4, 2, 150, 16, true, 0, {0, 1, 2, 70, 71, 150, /**/ 0, 64, 130, 149, 150, 150}},
    {1, 3, 1, 200, 8, false, 0, {0, 37, 38, 101, 200}},
    {2, 2, 2, 130, 16, true, 9, {0, 5, 66, 130, /**/ 0, 1, 129, 130}},
    {1, 4, 2, 97, 12, false, 7, {0, 40, 41, 97}},
    {1, 2, 1, 64, 16, true, 0, {0, 1, 2, 3, 4, 5, 6, 64}},
};

template <class T>
void check_varlen(const char* type_name) {
  double worst = 0;
  for (const varlen_config& c : varlen_configs) {
    att::attention_options o;
    o.causal = c.causal;
    o.window = c.window;
    o.host_threads = 2;
    CAPTURE(c.S);
    CAPTURE(c.Hq);
    CAPTURE(c.Hkv);
    CAPTURE(c.causal);
    CAPTURE(c.window);
    const problem_data<T> data(c.B, c.Hq, c.Hkv, c.S, c.D, 11);
    const varlen_errors e = packed_against_separate(data, c.offsets, o);
    CHECK(e.out.scaled() <= tolerance<T>());
    CHECK(e.lse.scaled() <= 1e-6);
    CHECK(e.dq.scaled() <= tolerance<T>());
    CHECK(e.dk.scaled() <= tolerance<T>());
    CHECK(e.dv.scaled() <= tolerance<T>());
    worst = std::max(worst, e.worst());
  }
  std::printf("attention varlen %s: packed vs per-document, worst scaled error %.3g (tolerance %.3g)\n", type_name,
              worst, tolerance<T>());
}

}  // namespace

TEST_CASE("attention varlen: each packed document equals that document run alone (fp32, bf16, fp16)") {
  check_varlen<float>("fp32");
  check_varlen<memkit::bf16>("bf16");
  check_varlen<memkit::fp16>("fp16");
}

TEST_CASE("attention varlen: a mask without the documents differs (the test can fail)") {
  // The same packed data without offsets is plain attention over the whole row: far from the separate runs.
  const problem_data<float> data(1, 2, 1, 100, 8, 5);
  att::attention_options o;
  o.host_threads = 1;
  const outputs<float> whole = data.run(o, {}, memkit::default_host_resource());
  const outputs<float> packed = data.run(o, {0, 50, 100}, memkit::default_host_resource());
  double difference = 0;
  for (std::size_t i = 0; i < whole.out.size(); ++i) difference = std::max<double>(difference, std::abs(whole.out[i] - packed.out[i]));
  CHECK(difference > 0.1);
  // The first document's rows see only the first document: identical with causal masking, which hides the rest.
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t e = 0; e < 50 * 8; ++e) CHECK(whole.out[static_cast<std::size_t>(h * 100 * 8 + e)] ==
                                                    packed.out[static_cast<std::size_t>(h * 100 * 8 + e)]);
}

TEST_CASE("attention varlen: one document per row is bit-identical to no offsets; tile-aligned documents to separate runs") {
  const auto bits = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  const auto same = [&](const auto& x, const auto& y) {
    return bits(x.out, y.out) && bits(x.lse, y.lse) && bits(x.dq, y.dq) && bits(x.dk, y.dk) && bits(x.dv, y.dv);
  };
  for (const bool causal : {true, false})
    for (const std::int64_t window : {std::int64_t{0}, std::int64_t{20}}) {
      att::attention_options o;
      o.causal = causal;
      o.window = window;
      o.host_threads = 2;
      CAPTURE(causal);
      CAPTURE(window);
      {
        const problem_data<float> data(2, 4, 2, 130, 16, 3);
        CHECK(same(data.run(o, {0, 130, 0, 130}, memkit::default_host_resource()),
                   data.run(o, {}, memkit::default_host_resource())));
      }
      {
        const problem_data<memkit::bf16> data(2, 2, 1, 70, 16, 4);
        CHECK(same(data.run(o, {0, 70, 0, 70}, memkit::default_host_resource()),
                   data.run(o, {}, memkit::default_host_resource())));
      }
      {
        const problem_data<memkit::fp16> data(1, 2, 2, 65, 16, 6);
        CHECK(same(data.run(o, {0, 65}, memkit::default_host_resource()), data.run(o, {}, memkit::default_host_resource())));
      }
      // Documents starting at multiples of the host tile (64) are tiled as they are alone: same bits.
      const problem_data<memkit::bf16> aligned(1, 4, 2, 192, 16, 8);
      const varlen_errors e = packed_against_separate(aligned, {0, 64, 192}, o);
      CHECK(e.identical());
    }
}

TEST_CASE("attention varlen: bad offsets are a clear memkit::error and write nothing") {
  std::vector<float> q(2 * 2 * 8 * 4, 0.5f), k(2 * 1 * 8 * 4, 0.5f), v = k, out(q.size(), 7.0f), lse(2 * 2 * 8, 7.0f);
  const att::attention_options o;
  auto& ws = memkit::default_host_resource();
  const auto lv = memkit::host_view(lse.data(), memkit::shape{2, 2, 8});
  const auto call = [&](const offsets_t& offsets, memkit::shape dims,
                        memkit::memory_kind where = memkit::memory_kind::host) {
    att::forward<float>(memkit::host, view4(q, 2, 2, 8, 4), view4(k, 2, 1, 8, 4), view4(v, 2, 1, 8, 4),
                        memkit::tensor_view<const std::int32_t>(offsets.data(), dims, where), view4(out, 2, 2, 8, 4), lv,
                        o, ws);
  };
  CHECK_THROWS_WITH_AS(call({0, 3, 8, 1, 3, 8}, {2, 3}),
                       doctest::Contains("attention::forward: document_offsets of batch row 1 must start at 0, got 1"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(call({0, 3, 8, 0, 5, 4, 8}, {2, 3}),  // row 1: 0, 5, 4
                       doctest::Contains("batch row 1 must not decrease: offset 2 is 4 after 5"), memkit::error);
  CHECK_THROWS_WITH_AS(call({0, 3, 8, 0, 3, 9}, {2, 3}),
                       doctest::Contains("batch row 1 must end at the sequence length 8, got 9"), memkit::error);
  CHECK_THROWS_WITH_AS(call({0, 3, 7, 0, 3, 8}, {2, 3}),
                       doctest::Contains("batch row 0 must end at the sequence length 8, got 7"), memkit::error);
  CHECK_THROWS_WITH_AS(call({0, 8}, {1, 2}),
                       doctest::Contains("document_offsets must be int32 [batch = 2, documents + 1 >= 2], got [1, 2]"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(call({0, 0}, {2, 1}), doctest::Contains("documents + 1 >= 2"), memkit::error);
  CHECK_THROWS_WITH_AS(call({0, 8, 0, 8}, {2, 2}, memkit::memory_kind::device),
                       doctest::Contains("attention::forward: `document_offsets`"), memkit::error);
  // Backward checks the offsets it is given the same way.
  std::vector<float> dq(q.size()), dk(k.size()), dv(v.size());
  const offsets_t negative{0, -1, 8, 0, 4, 8};
  CHECK_THROWS_WITH_AS(
      att::backward<float>(memkit::host,
                           {view4(q, 2, 2, 8, 4), view4(k, 2, 1, 8, 4), view4(v, 2, 1, 8, 4), view4(out, 2, 2, 8, 4), lv,
                            memkit::host_view(negative.data(), memkit::shape{2, 3})},
                           view4(q, 2, 2, 8, 4), {view4(dq, 2, 2, 8, 4), view4(dk, 2, 1, 8, 4), view4(dv, 2, 1, 8, 4)},
                           o, ws),
      doctest::Contains("attention::backward: document_offsets of batch row 0 must not decrease"), memkit::error);
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; }));
  CHECK(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 7.0f; }));
  // The public check of a loader's host copy.
  const offsets_t good{0, 2, 2, 8};
  att::check_document_offsets(memkit::host_view(good.data(), memkit::shape{1, 4}), 1, 8);
  CHECK_THROWS_WITH_AS(att::check_document_offsets(memkit::host_view(good.data(), memkit::shape{1, 4}), 1, 9),
                       doctest::Contains("attention::check_document_offsets: document_offsets of batch row 0 must end"),
                       memkit::error);
}

TEST_CASE("attention varlen: the workspace taken equals the prediction, offsets or not") {
  const problem_data<memkit::bf16> data(2, 4, 2, 150, 16, 9);
  const offsets_t offsets{0, 1, 2, 70, 71, 150, /**/ 0, 64, 130, 149, 150, 150};
  for (const int threads : {1, 3}) {
    att::attention_options o;
    o.host_threads = threads;
    memkit::tracking_resource tracker(memkit::default_host_resource());
    const outputs<memkit::bf16> r = data.run(o, offsets, tracker.category(memkit::memory_category::workspace));
    CHECK(r.lse.size() == 2u * 4u * 150u);
    const att::problem_arguments a{.batch = 2, .query_heads = 4, .kv_heads = 2, .sequence = 150, .head_dim = 16,
                                   .element_bytes = 2, .options = o};
    const std::size_t predicted =
        std::max(att::workspace_bytes(att::forward_arguments{a}), att::workspace_bytes(att::backward_arguments{a}));
    CHECK(tracker.peak_bytes() == predicted);
    CHECK(tracker.current_bytes() == 0);
  }
}
