// The host step's block kernels (vector paths where the compiler targets SSE2, AVX or AVX-512, scalar
// otherwise) give exactly the bits of the per-element functions they replace, and a whole host step
// equals a plain per-element step written with the shared functions, for every state flavour.
#include <doctest/doctest.h>
#include <memkit/optim/adam_state.hpp>
#include <memkit/quant/codebooks.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "host/adam_support.hpp"
#include "support/host_isa_scope.hpp"

using memkit::optim::adam_group;
using memkit::optim::adam_options;
using memkit::optim::adam_param;
using memkit::optim::adam_state;
using memkit::bf16;
using memkit::optim::four_bit;
using memkit::host;
using memkit::host_view;

namespace {

std::uint32_t bits(float x) { return memkit::detail::bit_cast<std::uint32_t>(x); }

// Equal bits, or both NaN: which NaN payload an operation returns depends on the operand order the
// compiler picks for commutative operations, which C++ leaves open (and CUDA returns one canonical NaN).
bool same(float a, float b) { return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b)); }

// Ordinary values of several magnitudes, with zeros, denormals, huge values, Inf and NaN mixed in.
std::vector<float> mixed_values(std::size_t count, float scale, std::uint32_t seed, bool non_negative) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 2), special(0, 63);
  const float specials[] = {0.0f, -0.0f, std::numeric_limits<float>::denorm_min(), 1e-38f, 3e38f,
                            std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> values(count);
  for (float& x : values) {
    const int pick = special(rng);
    x = pick < 7 ? specials[pick] : normal(rng) * scale * std::ldexp(1.0f, exponent(rng) / 4);
    if (non_negative) x = std::fabs(x);
  }
  return values;
}

}  // namespace

namespace {

// Runs `check` once per instruction set this CPU has (core/host_simd.hpp: the dispatched kernels take
// each path in turn).
template <class Check>
void on_every_isa(Check&& check) {
  memkit_test::on_each_host_isa([&](memkit::host_isa) { check(); });
}

void check_update_array() {
  const std::size_t n = 4099;  // not a multiple of any vector width: the tail runs the scalar function
  adam_group groups[3] = {{}, {.lr = 3e-2f, .beta1 = 0.5f, .beta2 = 0.9f, .eps = 0.0f, .weight_decay = 0.0f},
                          {.lr = 1e-4f, .beta1 = 0.0f, .beta2 = 0.99f, .eps = 1e-6f, .weight_decay = 0.3f}};
  int mismatches = 0, compared = 0;
  for (int g = 0; g < 3; ++g)
    for (std::int64_t step : {1, 7, 5000}) {
      memkit::optim::adam_control control;
      control.step = step;
      control.grad_multiplier = g == 1 ? 0.37f : 1.0f;
      const memkit::optim::adam_coefficients c = memkit::optim::make_coefficients(groups[g], control);
      const auto seed = static_cast<std::uint32_t>(g * 100 + step);
      auto p = mixed_values(n, 0.1f, seed, false), m = mixed_values(n, 1e-3f, seed + 1, false);
      auto v = mixed_values(n, 1e-6f, seed + 2, true);
      const auto grad = mixed_values(n, 1e-2f, seed + 3, false);
      auto p_ref = p, m_ref = m, v_ref = v;
      memkit::optim::detail::adamw_update_array(p.data(), m.data(), v.data(), grad.data(), static_cast<std::int64_t>(n), c);
      for (std::size_t i = 0; i < n; ++i) {
        memkit::optim::adamw_update(p_ref[i], m_ref[i], v_ref[i], grad[i], c);
        mismatches += !same(p[i], p_ref[i]) || !same(m[i], m_ref[i]) || !same(v[i], v_ref[i]);
        ++compared;
      }
    }
  CHECK(compared == 9 * 4099);
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("adam fast path: adamw_update_array equals adamw_update element by element, on every instruction set") {
  on_every_isa(check_update_array);
}

namespace {

// The quantized step's fused block update: table entries in (lookup_codes), scaled by the block's absmax,
// updated, maxima out; against dequantize_codes, adamw_update per element and max_magnitude_bits.
void check_update_block() {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<std::uint8_t> m_codes(2100), v_codes(2100);
  for (auto& c : m_codes) c = static_cast<std::uint8_t>(byte(rng));
  for (auto& c : v_codes) c = static_cast<std::uint8_t>(byte(rng));
  const auto& maps8 = memkit::optim::detail::int8_maps;
  const auto& maps4 = memkit::optim::detail::int4_maps;
  memkit::optim::adam_control control;
  control.step = 7;
  control.grad_multiplier = 0.37f;
  const memkit::optim::adam_coefficients c = memkit::optim::make_coefficients(adam_group{}, control);
  int mismatches = 0, compared = 0;
  for (int bits8 = 0; bits8 < 2; ++bits8)
    for (std::int64_t first : {0, 256, 1024})
      for (std::int64_t count : {1, 15, 16, 17, 255, 256, 1000}) {
        const auto seed = static_cast<std::uint32_t>(first + count + 10000 * bits8);
        const auto n = static_cast<std::size_t>(count);
        auto p = mixed_values(n, 0.1f, seed, false);
        const auto grad = mixed_values(n, 1e-2f, seed + 1, false);
        const float m_absmax = 3e-3f, v_absmax = bits8 ? 1.5e-5f : std::numeric_limits<float>::infinity();
        std::vector<float> m(n), v(n), m_ref(n), v_ref(n);
        auto p_ref = p;
        if (bits8) {
          memkit::optim::detail::lookup_codes<8>(maps8.m.data(), m_codes.data(), first, count, m.data());
          memkit::optim::detail::lookup_codes<8>(maps8.v.data(), v_codes.data(), first, count, v.data());
          memkit::optim::detail::dequantize_codes<8>(maps8.m.data(), m_codes.data(), first, count, m_absmax, m_ref.data());
          memkit::optim::detail::dequantize_codes<8>(maps8.v.data(), v_codes.data(), first, count, v_absmax, v_ref.data());
        } else {
          memkit::optim::detail::lookup_codes<4>(maps4.m.data(), m_codes.data(), first, count, m.data());
          memkit::optim::detail::lookup_codes<4>(maps4.v.data(), v_codes.data(), first, count, v.data());
          memkit::optim::detail::dequantize_codes<4>(maps4.m.data(), m_codes.data(), first, count, m_absmax, m_ref.data());
          memkit::optim::detail::dequantize_codes<4>(maps4.v.data(), v_codes.data(), first, count, v_absmax, v_ref.data());
        }
        const memkit::optim::detail::moment_maxima maxima =
            memkit::optim::detail::adamw_update_block(p.data(), m.data(), v.data(), grad.data(), count, c, m_absmax, v_absmax);
        for (std::size_t i = 0; i < n; ++i) {
          memkit::optim::adamw_update(p_ref[i], m_ref[i], v_ref[i], grad[i], c);
          mismatches += !same(p[i], p_ref[i]) || !same(m[i], m_ref[i]) || !same(v[i], v_ref[i]);
          ++compared;
        }
        mismatches += maxima.m != memkit::detail::max_magnitude_bits(m_ref.data(), count);
        mismatches += maxima.v != memkit::detail::max_magnitude_bits(v_ref.data(), count);
      }
  CHECK(compared == 2 * 3 * (1 + 15 + 16 + 17 + 255 + 256 + 1000));
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("adam fast path: the fused quantized-block update equals decode, adamw_update and the block maxima, on every instruction set") {
  on_every_isa(check_update_block);
}

namespace {

void check_block_codes() {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<std::uint8_t> codes(4096);
  for (auto& c : codes) c = static_cast<std::uint8_t>(byte(rng));
  const auto& maps8 = memkit::optim::detail::int8_maps;
  const auto& maps4 = memkit::optim::detail::int4_maps;
  int mismatches = 0;
  for (std::int64_t first : {0, 2, 64, 1000}) {
    for (std::int64_t count : {1, 15, 16, 17, 256, 2047}) {
      std::vector<float> out8(static_cast<std::size_t>(count)), out4(static_cast<std::size_t>(count));
      memkit::optim::detail::dequantize_codes<8>(maps8.v.data(), codes.data(), first, count, 0.0371f, out8.data());
      memkit::optim::detail::dequantize_codes<4>(maps4.m.data(), codes.data(), first, count, 2.5e-3f, out4.data());
      for (std::int64_t e = 0; e < count; ++e) {
        const float expected8 = maps8.v[codes[static_cast<std::size_t>(first + e)]] * 0.0371f;
        const unsigned packed = codes[static_cast<std::size_t>((first + e) / 2)];
        const unsigned code4 = (first + e) % 2 ? packed & 0x0fu : packed >> 4;
        mismatches += bits(out8[static_cast<std::size_t>(e)]) != bits(expected8);
        mismatches += bits(out4[static_cast<std::size_t>(e)]) != bits(maps4.m[code4] * 2.5e-3f);
      }
    }
  }
  CHECK(mismatches == 0);

  // Requantize: every map entry and midpoint and their neighbouring floats, then random values, scaled
  // by a few inverse absmaxes (Inf included, as 1/absmax of a denormal absmax can be).
  std::vector<float> values;
  for (const auto* map : {&memkit::quant::dynamic_map_signed, &memkit::quant::dynamic_map_unsigned})
    for (std::size_t i = 0; i < 256; ++i) {
      const float centres[2] = {(*map)[i], i + 1 < 256 ? ((*map)[i + 1] + (*map)[i]) * 0.5f : (*map)[i]};
      for (float centre : centres) {
        float up = centre, down = centre;
        values.push_back(centre);
        for (int k = 0; k < 3; ++k) values.push_back(up = std::nextafter(up, 2.0f));
        for (int k = 0; k < 3; ++k) values.push_back(down = std::nextafter(down, -2.0f));
      }
    }
  for (int i = 0; i < 16; ++i) {
    const float middle = (maps4.m[static_cast<std::size_t>(i)] + maps4.m[static_cast<std::size_t>(std::min(i + 1, 15))]) * 0.5f;
    const float level = (maps4.v[static_cast<std::size_t>(i)] + maps4.v[static_cast<std::size_t>(std::min(i + 1, 15))]) * 0.5f;
    for (float centre : {middle, level, maps4.m[static_cast<std::size_t>(i)], maps4.v[static_cast<std::size_t>(i)]}) {
      values.push_back(centre);
      values.push_back(std::nextafter(centre, 2.0f));
      values.push_back(std::nextafter(centre, -2.0f));
    }
  }
  const auto random = mixed_values(60000, 0.5f, 12, false);
  values.insert(values.end(), random.begin(), random.end());
  if (values.size() % 2) values.push_back(0.25f);
  const auto n = static_cast<std::int64_t>(values.size());
  const auto& signed_index = memkit::detail::dynamic_code_index_for<true>();
  const auto& unsigned_index = memkit::detail::dynamic_code_index_for<false>();
  int wrong8 = 0, wrong4 = 0;
  for (float inverse : {1.0f, 0.75f, 3.0f, std::numeric_limits<float>::infinity()}) {
    std::vector<std::uint8_t> signed_codes(static_cast<std::size_t>(n)), unsigned_codes(static_cast<std::size_t>(n));
    std::vector<std::uint8_t> m4(static_cast<std::size_t>(n / 2)), v4(static_cast<std::size_t>(n / 2));
    memkit::detail::dynamic_codes_indexed(signed_index, values.data(), inverse, n, signed_codes.data());
    memkit::detail::dynamic_codes_indexed(unsigned_index, values.data(), inverse, n, unsigned_codes.data());
    memkit::optim::detail::table16_codes(maps4.m.data(), values.data(), inverse, n, m4.data());
    memkit::optim::detail::table16_codes(maps4.v.data(), values.data(), inverse, n - 1, v4.data());  // odd count: a last half byte
    for (std::int64_t e = 0; e < n; ++e) {
      const float x = values[static_cast<std::size_t>(e)] * inverse;
      const auto i = static_cast<std::size_t>(e);
      wrong8 += signed_codes[i] != memkit::quant::nearest_dynamic(memkit::quant::dynamic_map_signed.data(), x);
      wrong8 += unsigned_codes[i] != memkit::quant::nearest_dynamic(memkit::quant::dynamic_map_unsigned.data(), x);
      const unsigned m_code = e % 2 ? m4[i / 2] & 0x0fu : m4[i / 2] >> 4;
      wrong4 += m_code != memkit::optim::detail::nearest_in_table<16>(maps4.m.data(), x);
      if (e < n - 1) {
        const unsigned v_code = e % 2 ? v4[i / 2] & 0x0fu : v4[i / 2] >> 4;
        wrong4 += v_code != memkit::optim::detail::nearest_in_table<16>(maps4.v.data(), x);
      }
    }
    wrong4 += (v4.back() & 0x0fu) != 0u;  // the missing last element packs as 0
  }
  CHECK(n > 60000);
  CHECK(wrong8 == 0);
  CHECK(wrong4 == 0);
}

}  // namespace

TEST_CASE("adam fast path: block dequantize and requantize equal the per-element codes, on every instruction set") {
  on_every_isa(check_block_codes);
}

namespace {

// The step's decision as the shared functions define it: canonical chunk sums over all tensors, then finalize_step.
template <class G>
memkit::optim::adam_control reference_decision(memkit::optim::adam_control control, const std::vector<std::vector<G>>& grads,
                                        const adam_options& options) {
  std::vector<double> sums;
  double lanes[memkit::optim::detail::reduction_lanes];
  for (const auto& grad : grads) {
    const auto n = static_cast<std::int64_t>(grad.size());
    for (std::int64_t c = 0; c < memkit::optim::detail::reduction_chunks(n); ++c) {
      const std::int64_t begin = c * memkit::optim::detail::reduction_chunk;
      const std::int64_t count = std::min(memkit::optim::detail::reduction_chunk, n - begin);
      for (int lane = 0; lane < memkit::optim::detail::reduction_lanes; ++lane)
        lanes[lane] = memkit::optim::detail::lane_sum_of_squares(grad.data() + begin, count, lane);
      sums.push_back(memkit::optim::detail::tree_sum(lanes));
    }
  }
  memkit::optim::detail::finalize_step(control, sums.data(), static_cast<std::int64_t>(sums.size()), options.max_grad_norm,
                                options.loss_scaling, 1.0f);
  return control;
}

// One tensor's update as the per-element functions define it, element by element: dequantized moments,
// update_element (adamw_update and the parameter's store), then the block's absmax and nearest codes
// (the device's lookups). Returns the moments as read_moments will show them.
template <class S, class P, class G>
void reference_update(const S& state, std::vector<P>& param, std::vector<float>* master, const std::vector<G>& grad,
                      std::size_t tensor, const adam_group& group, const adam_options& options,
                      const memkit::optim::adam_control& decided, std::vector<float>& m, std::vector<float>& v) {
  using traits = memkit::optim::adam_state_traits<typename S::state_type>;
  const auto n = static_cast<std::int64_t>(param.size());
  state.read_moments(host, tensor, m, v);
  const memkit::optim::adam_coefficients c = memkit::optim::make_coefficients(group, decided);
  const memkit::optim::detail::param_access<P, G> access{param.data(), grad.data(), master ? master->data() : nullptr,
                                                  options.stochastic_rounding, options.seed, decided.step,
                                                  static_cast<std::int64_t>(tensor)};
  for (std::int64_t i = 0; i < n; ++i)
    memkit::optim::detail::update_element(access, m[static_cast<std::size_t>(i)], v[static_cast<std::size_t>(i)], i, c);
  if (!state.is_quantized(tensor)) {
    if constexpr (!traits::quantized) {  // bf16 moments are stored rounded
      for (float& x : m) x = memkit::to_float(memkit::from_float<typename traits::moment_type>(x));
      for (float& x : v) x = memkit::to_float(memkit::from_float<typename traits::moment_type>(x));
    }
    return;
  }
  if constexpr (traits::quantized) {
    const auto& tables = traits::tables();
    for (std::int64_t begin = 0; begin < n; begin += S::block_size) {
      const std::int64_t end = std::min<std::int64_t>(begin + S::block_size, n);
      float m_max = 0.0f, v_max = 0.0f;
      for (std::int64_t i = begin; i < end; ++i) {
        m_max = memkit::optim::detail::max_abs(m_max, m[static_cast<std::size_t>(i)]);
        v_max = memkit::optim::detail::max_abs(v_max, v[static_cast<std::size_t>(i)]);
      }
      const float m_inverse = memkit::optim::detail::inverse_scale(m_max), v_inverse = memkit::optim::detail::inverse_scale(v_max);
      for (std::int64_t i = begin; i < end; ++i) {
        float& mi = m[static_cast<std::size_t>(i)];
        float& vi = v[static_cast<std::size_t>(i)];
        mi = tables.m[traits::code(tables.m.data(), mi * m_inverse)] * m_max;
        vi = tables.v[traits::code(tables.v.data(), vi * v_inverse)] * v_max;
      }
    }
  }
}

template <class P>
std::uint32_t param_bits(P x) {
  if constexpr (std::is_same_v<P, float>) return bits(x);
  else return x.bits;
}

template <class S, class P, class G>
void check_steps_match_reference(bool with_master) {
  const std::vector<std::int64_t> sizes{1000, 6001, 20000};  // below the quantization threshold, odd, several chunks
  adam_options options;
  options.max_grad_norm = 2.0f;  // active from the second step: the gradient multiplier is not 1
  options.seed = 42;
  S state(host, memkit::default_host_resource(), sizes, options);
  const adam_group group{.lr = 1e-2f, .weight_decay = 0.05f};
  std::vector<std::vector<P>> params;
  std::vector<std::vector<float>> masters;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const auto start = adam_test::normal(static_cast<std::size_t>(sizes[t]), 0.1f, static_cast<std::uint32_t>(t + 1));
    params.push_back(adam_test::convert<P>(start));
    masters.push_back(start);
  }
  auto params_ref = params;
  auto masters_ref = masters;
  int mismatches = 0;
  for (int step = 0; step < 3; ++step) {
    std::vector<std::vector<G>> grads;
    for (std::size_t t = 0; t < sizes.size(); ++t)
      grads.push_back(adam_test::convert<G>(adam_test::normal(static_cast<std::size_t>(sizes[t]), step == 0 ? 1e-3f : 0.05f,
                                                              static_cast<std::uint32_t>(100 * step + t))));
    const memkit::optim::adam_control decided = reference_decision(state.control(host), grads, options);
    std::vector<std::vector<float>> m_expected(sizes.size()), v_expected(sizes.size());
    for (std::size_t t = 0; t < sizes.size(); ++t)
      reference_update(state, params_ref[t], with_master ? &masters_ref[t] : nullptr, grads[t], t, group, options, decided,
                       m_expected[t], v_expected[t]);
    std::vector<adam_param<P, G>> views;
    for (std::size_t t = 0; t < sizes.size(); ++t)
      views.push_back({host_view(params[t]), host_view(grads[t]),
                       with_master ? host_view(masters[t]) : memkit::tensor_view<float>{}, 0});
    state.step(host, views, std::vector<adam_group>{group});
    const memkit::optim::adam_control after = state.control(host);
    CHECK(after.applied == 1);
    CHECK(after.step == decided.step);
    CHECK(bits(after.grad_multiplier) == bits(decided.grad_multiplier));
    CHECK(after.grad_norm == decided.grad_norm);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::vector<float> m, v;
      state.read_moments(host, t, m, v);
      for (std::size_t i = 0; i < m.size(); ++i) {
        mismatches += bits(m[i]) != bits(m_expected[t][i]) || bits(v[i]) != bits(v_expected[t][i]);
        mismatches += param_bits(params[t][i]) != param_bits(params_ref[t][i]);
        if (with_master) mismatches += bits(masters[t][i]) != bits(masters_ref[t][i]);
      }
    }
  }
  if (options.max_grad_norm > 0.0f) CHECK(state.control(host).grad_multiplier < 1.0f);  // clipping was exercised
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE_TEMPLATE("adam fast path: host steps on every instruction set equal per-element steps", S, adam_state<float>,
                   adam_state<std::int8_t, 256>, adam_state<four_bit, 128>) {
  on_every_isa([] { check_steps_match_reference<S, float, float>(false); });
  on_every_isa([] { check_steps_match_reference<S, bf16, bf16>(true); });
}

TEST_CASE_TEMPLATE("adam fast path: host steps equal per-element steps bit for bit", S, adam_state<float>,
                   adam_state<bf16>, adam_state<std::int8_t, 256>, adam_state<std::int8_t, 2048>,
                   adam_state<four_bit, 128>) {
  SUBCASE("fp32 parameters and gradients") { check_steps_match_reference<S, float, float>(false); }
  SUBCASE("bf16 parameters with an fp32 master, bf16 gradients") { check_steps_match_reference<S, bf16, bf16>(true); }
  SUBCASE("bf16 parameters rounded stochastically, fp32 gradients") { check_steps_match_reference<S, bf16, float>(false); }
}

namespace {

// The same steps with `threads` host threads: the state bytes and the parameters after them.
template <class S, class P>
std::pair<std::vector<std::byte>, std::vector<std::vector<P>>> run_threaded_steps(int threads) {
  // Tensors that split across threads (> 2^17 elements each part), with odd tails, and a small one that does not.
  const std::vector<std::int64_t> sizes{300001, 1000, 4096 * 70 + 3};
  adam_options options;
  options.max_grad_norm = 5.0f;
  options.seed = 7;
  options.host_threads = threads;
  S state(host, memkit::default_host_resource(), sizes, options);
  std::vector<std::vector<P>> params;
  for (std::size_t t = 0; t < sizes.size(); ++t)
    params.push_back(adam_test::convert<P>(adam_test::normal(static_cast<std::size_t>(sizes[t]), 0.1f, static_cast<std::uint32_t>(t + 3))));
  for (int step = 0; step < 2; ++step) {
    std::vector<std::vector<float>> grads;
    std::vector<adam_param<P, float>> views;
    for (std::size_t t = 0; t < sizes.size(); ++t)
      grads.push_back(adam_test::normal(static_cast<std::size_t>(sizes[t]), 0.05f, static_cast<std::uint32_t>(50 * step + t)));
    for (std::size_t t = 0; t < sizes.size(); ++t) views.push_back({host_view(params[t]), host_view(grads[t]), {}, 0});
    state.step(host, views, std::vector<adam_group>{{.lr = 1e-2f, .weight_decay = 0.05f}});
    CHECK(state.control(host).applied == 1);
  }
  return {adam_test::snapshot(state), params};
}

}  // namespace

TEST_CASE_TEMPLATE("adam fast path: the host step gives the same bits on any number of threads", S, adam_state<float>,
                   adam_state<bf16>, adam_state<std::int8_t, 256>, adam_state<std::int8_t, 2048>,
                   adam_state<four_bit, 128>) {
  // fp32 parameters, and bf16 parameters rounded stochastically (the random bits are per element).
  const auto fp32_one = run_threaded_steps<S, float>(1);
  const auto bf16_one = run_threaded_steps<S, bf16>(1);
  for (int threads : {2, 3, 0}) {
    CAPTURE(threads);
    const auto fp32_many = run_threaded_steps<S, float>(threads);
    CHECK(fp32_many.first == fp32_one.first);
    for (std::size_t t = 0; t < fp32_one.second.size(); ++t) CHECK(adam_test::same_bits(fp32_many.second[t], fp32_one.second[t]));
    const auto bf16_many = run_threaded_steps<S, bf16>(threads);
    CHECK(bf16_many.first == bf16_one.first);
    for (std::size_t t = 0; t < bf16_one.second.size(); ++t) CHECK(adam_test::same_bits(bf16_many.second[t], bf16_one.second[t]));
  }
}

TEST_CASE("adam fast path: host_threads below 0 is an error") {
  adam_options options;
  options.host_threads = -1;
  const std::vector<std::int64_t> sizes{10};
  CHECK_THROWS_WITH_AS(adam_state<float>(host, memkit::default_host_resource(), sizes, options),
                       doctest::Contains("host_threads must be >= 0"), memkit::error);
}
