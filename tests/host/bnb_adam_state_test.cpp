// Resuming a PEFT + bitsandbytes QLoRA run: the AdamW8bit state bitsandbytes wrote after 5 steps
// (tests/data/peft/qlora_resume, made by make_peft_data.py) is imported into adam_state<int8, 256>, stepped
// 10 more times with the same (synthetic) gradients bitsandbytes got, and compared with where
// bitsandbytes' own run ended; the state is exported again in the same layout; and every kind of bad file
// is refused with the state untouched.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include "memkit/core/random.hpp"
#include "memkit/io/safetensors.hpp"
#include "memkit/peft/peft.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/optim/bnb_adam_state.hpp"

namespace st = memkit::safetensors;
using memkit::host;
using memkit::host_view;
using memkit::shape;
using state8 = memkit::optim::adam_state<std::int8_t, 256>;

namespace {

const std::string resume_dir = std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/peft/qlora_resume";
const std::string step5_state = resume_dir + "/optimizer_step5.safetensors";

std::string error_of(auto&& action) {
  try {
    action();
  } catch (const memkit::error& e) {
    return e.what();
  }
  return "(no error)";
}

// make_peft_data.py's synthetic_gradient: the gradient of element i of tensor t at optimizer step s.
float synthetic_gradient(int tensor, int step, std::int64_t i, float scale) {
  const std::uint32_t bits = memkit::random_word(9, static_cast<std::uint64_t>(1000 * step + tensor), static_cast<std::uint64_t>(i));
  const float u = memkit::unit_float(bits);
  return ((u - 0.5f) * scale) * (1.0f + static_cast<float>((i / 256) % 4));
}

// The trainable parameters in the optimizer's order, read from a PEFT adapter by their names.
std::vector<std::vector<float>> read_params(const memkit::peft::adapter_file& adapter, const std::vector<std::string>& names) {
  std::vector<std::vector<float>> params;
  for (const std::string& name : names) params.push_back(adapter.read<float>(name));
  return params;
}

std::vector<std::int64_t> sizes_of(const st::reader& in) {
  std::vector<std::int64_t> sizes;
  for (int i = 0; in.find("state." + std::to_string(i) + ".state1"); ++i) sizes.push_back(in.info("state." + std::to_string(i) + ".state1").numel());
  return sizes;
}

std::vector<float> dequantize(const std::vector<std::uint8_t>& codes, const std::vector<float>& absmax, std::span<const float> map) {
  std::vector<float> out(codes.size());
  for (std::size_t i = 0; i < codes.size(); ++i) out[i] = map[codes[i]] * absmax[i / 256];
  return out;
}

// A copy of the step-5 file with one tensor replaced or removed, or the metadata changed.
std::string damaged_copy(const std::string& stem, const std::string& key, const std::vector<std::byte>* replacement,
                         const std::string& dtype = "", std::vector<std::int64_t> dims = {},
                         std::vector<std::pair<std::string, std::string>> metadata_changes = {}) {
  const std::string path = "/tmp/memkit_test_bnb_" + stem + "_" + std::to_string(::getpid()) + ".safetensors";
  const st::reader in(step5_state);
  st::writer out;
  for (const auto& [k, v] : in.metadata()) {
    std::string value = v;
    bool drop = false;
    for (const auto& [ck, cv] : metadata_changes)
      if (ck == k) {
        drop = cv == "<drop>";
        value = cv;
      }
    if (!drop) out.add_metadata(k, value);
  }
  for (const st::tensor_info& t : in.tensors()) {
    if (t.name == key) {
      if (replacement) out.add_bytes(t.name, dtype.empty() ? t.dtype : dtype, dims.empty() ? t.shape : dims,
                                     replacement->data(), replacement->size());
      continue;
    }
    std::vector<std::byte> bytes(t.bytes());
    in.read_bytes(t.name, bytes.data(), bytes.size());
    out.add_bytes(t.name, t.dtype, t.shape, bytes.data(), bytes.size());
  }
  out.write(path);
  return path;
}

template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& values) {
  std::vector<std::byte> out(values.size() * sizeof(T));
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

}  // namespace

TEST_CASE("bnb: an AdamW8bit state imported from bitsandbytes continues its trajectory") {
  const st::reader file(step5_state);
  const std::vector<std::int64_t> sizes = sizes_of(file);
  REQUIRE(sizes.size() == 8);
  state8 state(host, memkit::default_host_resource(), sizes);
  const memkit::optim::bnb_adam_state_info info = memkit::optim::load_bnb_adam_state(host, state, step5_state);
  CHECK(info.step == 5);
  CHECK(state.control(host).step == 5);
  REQUIRE(info.groups.size() == 1);
  CHECK(info.groups[0].lr == 2e-3f);
  CHECK(info.groups[0].beta2 == 0.995f);
  CHECK(info.groups[0].weight_decay == 0.01f);
  REQUIRE(info.names.size() == 8);
  CHECK(info.names[1] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  CHECK(info.shapes[6] == std::vector<std::int64_t>{16, 520});
  // Below 4096 elements bitsandbytes keeps 32-bit state; so does adam_state, with the same threshold.
  const std::vector<bool> eight_bit = {false, true, true, false, false, false, true, true};
  for (std::size_t i = 0; i < 8; ++i) CHECK(state.is_quantized(i) == eight_bit[i]);
  // bitsandbytes' maps are memkit's, up to torch.linspace's rounding of a few entries on this kind of CPU.
  int differing = 0;
  for (const char* field : {"qmap1", "qmap2"}) {
    const std::vector<float> map = file.read_vector<float>(std::string("state.1.") + field);
    const std::span<const float> mine = field[4] == '1' ? state8::m_map() : state8::v_map();
    for (std::size_t c = 0; c < 256; ++c) {
      std::int32_t a, b;
      std::memcpy(&a, &map[c], 4);
      std::memcpy(&b, &mine[c], 4);
      CHECK(std::abs(a - b) <= 2);
      differing += a != b;
    }
  }
  const bool verbose = std::getenv("MEMKIT_PRINT_TRAJECTORY") != nullptr;
  if (verbose) std::printf("qmap entries differing from memkit's maps (by at most 2 ulps): %d of 512\n", differing);
  // Codes and scales arrive as bitsandbytes stored them: no requantization.
  for (std::size_t i = 0; i < 8; ++i) {
    CAPTURE(i);
    const std::string prefix = "state." + std::to_string(i) + ".";
    const auto s = state.tensor_state(i);
    if (eight_bit[i]) {
      CHECK(std::equal(s.m_codes.begin(), s.m_codes.end(), file.read_vector<std::uint8_t>(prefix + "state1").begin()));
      CHECK(std::equal(s.v_absmax.begin(), s.v_absmax.end(), file.read_vector<float>(prefix + "absmax2").begin()));
    } else {
      CHECK(std::equal(s.v.begin(), s.v.end(), file.read_vector<float>(prefix + "state2").begin()));
    }
  }

  // Replay steps 6..15 with bitsandbytes' gradients and hyperparameters.
  const memkit::peft::adapter_file adapter(resume_dir + "/adapter_step5");
  std::vector<std::vector<float>> params = read_params(adapter, info.names);
  std::vector<std::vector<float>> grads(params.size());
  for (int step = 6; step <= 15; ++step) {
    std::vector<memkit::optim::adam_param<float, float>> views;
    for (std::size_t t = 0; t < params.size(); ++t) {
      const float scale = info.names[t].find("lora_A") != std::string::npos ? 1e-2f : 3e-3f;
      grads[t].resize(params[t].size());
      for (std::size_t i = 0; i < grads[t].size(); ++i)
        grads[t][i] = synthetic_gradient(static_cast<int>(t), step, static_cast<std::int64_t>(i), scale);
      views.push_back({host_view(params[t]), host_view(static_cast<const std::vector<float>&>(grads[t])), {}, info.group_of_tensor[t]});
    }
    state.step(host, views, info.groups);
    REQUIRE(state.report(host).applied);
  }
  CHECK(state.control(host).step == 15);

  // bitsandbytes' own run after step 15, and the yardsticks: memkit must follow bitsandbytes' 8-bit run
  // within bitsandbytes' 8-bit-vs-32-bit tolerance (shared/REFERENCE.md: mean parameter error < 6e-5
  // absolute, < 6e-4 relative; states within atol 3e-3 / rtol 1e-3 but for < 20 elements).
  const st::reader final_file(resume_dir + "/final_step15.safetensors");
  double total_abs = 0.0, total_rel = 0.0;
  std::int64_t total = 0;
  for (std::size_t t = 0; t < params.size(); ++t) {
    CAPTURE(info.names[t]);
    const std::vector<float> expected = final_file.read_vector<float>(info.names[t]);
    REQUIRE(expected.size() == params[t].size());
    double worst = 0.0, sum_abs = 0.0, sum_rel = 0.0;
    for (std::size_t i = 0; i < expected.size(); ++i) {
      const double diff = std::fabs(double(params[t][i]) - expected[i]);
      worst = std::max(worst, diff);
      sum_abs += diff;
      sum_rel += diff / std::max(std::fabs(double(expected[i])), 1e-12);
    }
    const double n = static_cast<double>(expected.size());
    total_abs += sum_abs;
    total_rel += sum_rel;
    total += static_cast<std::int64_t>(expected.size());
    CHECK(sum_abs / n < 6e-5);
    CHECK(sum_rel / n < 6e-4);

    const std::string prefix = "optimizer.state." + std::to_string(t) + ".";
    const auto s = state.tensor_state(t);
    std::vector<float> m, v, m_ref, v_ref;
    std::int64_t same_codes = 0;
    if (eight_bit[t]) {
      const auto m_codes = std::vector<std::uint8_t>(s.m_codes.begin(), s.m_codes.end());
      const auto v_codes = std::vector<std::uint8_t>(s.v_codes.begin(), s.v_codes.end());
      m = dequantize(m_codes, std::vector<float>(s.m_absmax.begin(), s.m_absmax.end()), state8::m_map());
      v = dequantize(v_codes, std::vector<float>(s.v_absmax.begin(), s.v_absmax.end()), state8::v_map());
      const auto m_codes_ref = final_file.read_vector<std::uint8_t>(prefix + "state1");
      const auto v_codes_ref = final_file.read_vector<std::uint8_t>(prefix + "state2");
      m_ref = dequantize(m_codes_ref, final_file.read_vector<float>(prefix + "absmax1"), state8::m_map());
      v_ref = dequantize(v_codes_ref, final_file.read_vector<float>(prefix + "absmax2"), state8::v_map());
      for (std::size_t i = 0; i < m_codes.size(); ++i) same_codes += (m_codes[i] == m_codes_ref[i]) + (v_codes[i] == v_codes_ref[i]);
    } else {
      m.assign(s.m.begin(), s.m.end());
      v.assign(s.v.begin(), s.v.end());
      m_ref = final_file.read_vector<float>(prefix + "state1");
      v_ref = final_file.read_vector<float>(prefix + "state2");
    }
    int mismatches = 0;
    double worst_m = 0.0, worst_v = 0.0;
    for (std::size_t i = 0; i < m.size(); ++i) {
      mismatches += std::fabs(m[i] - m_ref[i]) > 3e-3 + 1e-3 * std::fabs(m_ref[i]);
      mismatches += std::fabs(v[i] - v_ref[i]) > 3e-3 + 1e-3 * std::fabs(v_ref[i]);
      worst_m = std::max(worst_m, double(std::fabs(m[i] - m_ref[i])));
      worst_v = std::max(worst_v, double(std::fabs(v[i] - v_ref[i])));
    }
    CHECK(mismatches < 20);
    if (verbose)
      std::printf("%-66s %5zu el %2d-bit  param |diff| max %.3g mean %.3g rel %.3g  m max %.3g v max %.3g  codes equal %.4f\n",
                  info.names[t].c_str(), m.size(), eight_bit[t] ? 8 : 32, worst, sum_abs / n, sum_rel / n, worst_m, worst_v,
                  eight_bit[t] ? double(same_codes) / (2.0 * n) : 1.0);
  }
  if (verbose) std::printf("all: mean |diff| %.3g, mean rel %.3g over %lld parameters\n", total_abs / double(total),
                           total_rel / double(total), static_cast<long long>(total));
  CHECK(total_abs / double(total) < 6e-5);
  CHECK(total_rel / double(total) < 6e-4);

  // Hand it back: export, and the export imports to the same state.
  const std::string exported = "/tmp/memkit_test_bnb_export_" + std::to_string(::getpid()) + ".safetensors";
  memkit::optim::save_bnb_adam_state(host, state, exported, info);
  state8 again(host, memkit::default_host_resource(), sizes);
  const memkit::optim::bnb_adam_state_info info2 = memkit::optim::load_bnb_adam_state(host, again, exported);
  CHECK(info2.step == 15);
  CHECK(info2.names == info.names);
  CHECK(info2.shapes == info.shapes);
  CHECK(info2.param_groups_json == info.param_groups_json);  // every field kept, lr still spelled 0.002
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const auto a = state.tensor_state(t), b = again.tensor_state(t);
    if (a.quantized) {
      CHECK(std::equal(a.m_codes.begin(), a.m_codes.end(), b.m_codes.begin()));
      CHECK(std::equal(a.v_codes.begin(), a.v_codes.end(), b.v_codes.begin()));
      CHECK(std::equal(a.m_absmax.begin(), a.m_absmax.end(), b.m_absmax.begin()));
      CHECK(std::equal(a.v_absmax.begin(), a.v_absmax.end(), b.v_absmax.begin()));
    } else {
      CHECK(std::equal(a.m.begin(), a.m.end(), b.m.begin()));
      CHECK(std::equal(a.v.begin(), a.v.end(), b.v.begin()));
    }
  }
  // Where the tests are asked to, the exported state and parameters stay for
  // tests/data/peft/check_memkit_resume.py (bitsandbytes continues from memkit's step 15).
  if (const char* out = std::getenv("MEMKIT_PEFT_EXPORT_DIR")) {
    std::filesystem::create_directories(out);
    std::filesystem::copy_file(exported, std::string(out) + "/optimizer_step15.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    memkit::peft::adapter_writer writer(adapter.config());
    for (const memkit::peft::lora_module& m : adapter.modules()) {
      auto find = [&](const std::string& key) -> const std::vector<float>* {
        for (std::size_t t = 0; t < info.names.size(); ++t)
          if (info.names[t] == key) return &params[t];
        return nullptr;
      };
      const std::vector<float>* bias = m.has_bias ? find(m.bias_key()) : nullptr;
      writer.add<float>(m.path, host_view(find(m.a_key())->data(), shape{m.rank, m.in_features}),
                        host_view(find(m.b_key())->data(), shape{m.out_features, m.rank}),
                        bias ? host_view(bias->data(), shape{m.out_features}) : memkit::tensor_view<const float>{});
    }
    writer.write(std::string(out) + "/adapter_step15");
  }
  std::remove(exported.c_str());
}

TEST_CASE("bnb: a file that does not match the state is refused, naming the key, and the state stays as it was") {
  const std::vector<std::int64_t> sizes = sizes_of(st::reader(step5_state));
  state8 state(host, memkit::default_host_resource(), sizes);
  // A recognisable state to compare against after each refusal.
  (void)memkit::optim::load_bnb_adam_state(host, state, step5_state);
  const std::vector<std::byte> before(state.arena_view().begin(), state.arena_view().end());
  auto refused = [&](const std::string& path) {
    const std::string message = error_of([&] { (void)memkit::optim::load_bnb_adam_state(host, state, path); });
    CHECK(std::equal(before.begin(), before.end(), state.arena_view().begin()));
    if (path != step5_state) std::remove(path.c_str());
    return message;
  };

  std::vector<float> map(state8::m_map().begin(), state8::m_map().end());
  map[17] *= 1.00001f;  // ten times map_tolerance
  const auto map_bytes = bytes_of(map);
  CHECK(refused(damaged_copy("qmap", "state.1.qmap1", &map_bytes)).find(
            "'state.1.qmap1' entry 17 is -0.753913") != std::string::npos);
  std::vector<float> absmax = st::reader(step5_state).read_vector<float>("state.2.absmax2");
  absmax[3] = NAN;
  const auto absmax_bytes = bytes_of(absmax);
  CHECK(refused(damaged_copy("absmax", "state.2.absmax2", &absmax_bytes)).find("'state.2.absmax2' block 3 is nan; block scales must be finite and >= 0") !=
        std::string::npos);
  std::vector<float> v = st::reader(step5_state).read_vector<float>("state.4.state2");
  v[9] = -1.0f;
  const auto v_bytes = bytes_of(v);
  CHECK(refused(damaged_copy("negative_v", "state.4.state2", &v_bytes)).find("'state.4.state2' element 9 is -1; second moments must be finite and >= 0") !=
        std::string::npos);
  CHECK(refused(damaged_copy("missing", "state.3.state1", nullptr)).find("missing key 'state.3.state1'") != std::string::npos);
  CHECK(refused(damaged_copy("missing_absmax", "state.6.absmax1", nullptr)).find("missing key 'state.6.absmax1'") !=
        std::string::npos);
  const std::vector<std::int64_t> step3 = {3};
  const auto step_bytes = bytes_of(step3);
  CHECK(refused(damaged_copy("step", "state.4.step", &step_bytes)).find(
            "'state.4.step' is 3 but 'state.0.step' is 5; memkit keeps one step count") != std::string::npos);
  // #35: a step past 2^62 (INT64_MAX overflowed the next step's counter) is refused with the key named, by the
  // same check adam_state::load applies; so is a key whose parameter index does not fit 64 bits (escaped as
  // std::out_of_range "stoull") and a non-number where param_groups wants one (the field named).
  const std::vector<std::int64_t> step_max = {std::numeric_limits<std::int64_t>::max()};
  const auto step_max_bytes = bytes_of(step_max);
  CHECK(refused(damaged_copy("step_max", "state.0.step", &step_max_bytes)).find(
            "'state.0.step': step 9223372036854775807 (must be 0 .. 2^62)") != std::string::npos);
  const auto with_extra_key = [&](const std::string& key) {
    const std::string path = "/tmp/memkit_test_bnb_extra_key_" + std::to_string(::getpid()) + ".safetensors";
    const st::reader in(step5_state);
    st::writer out;
    for (const auto& [k, v] : in.metadata()) out.add_metadata(k, v);
    for (const st::tensor_info& t : in.tensors()) {
      std::vector<std::byte> bytes(t.bytes());
      in.read_bytes(t.name, bytes.data(), bytes.size());
      out.add_bytes(t.name, t.dtype, t.shape, bytes.data(), bytes.size());
    }
    out.add_bytes(key, "I64", {1}, step_max_bytes.data(), step_max_bytes.size());
    out.write(path);
    return path;
  };
  CHECK(refused(with_extra_key("state.99999999999999999999999.step"))
            .find("key 'state.99999999999999999999999.step' names parameter 99999999999999999999999, but the "
                  "adam_state has 8 tensors") != std::string::npos);
  // An index spelled with a leading zero is not the parameter's key (it was read as parameter 1 and then ignored).
  CHECK(refused(with_extra_key("state.01.step")).find("unexpected key 'state.01.step'") != std::string::npos);
  CHECK(refused(damaged_copy("beta_text", "", nullptr, "", {},
                             {{"param_groups", R"([{"lr": 0.002, "betas": [0.9, "0.995"], "eps": 1e-08, "weight_decay": 0.01, "params": [0, 1, 2, 3, 4, 5, 6, 7]}])"}}))
            .find("param_groups[0].betas[1] is a string, not a number") != std::string::npos);
  CHECK(refused(damaged_copy("param_text", "", nullptr, "", {},
                             {{"param_groups", R"([{"lr": 0.002, "betas": [0.9, 0.995], "eps": 1e-08, "weight_decay": 0.01, "params": [0, 1, "2", 3, 4, 5, 6, 7]}])"}}))
            .find("param_groups[0].params[2] is a string; params lists parameter indices") != std::string::npos);
  // A number JSON cannot hand over (past a double, a fraction or past int64 where an index is wanted) names its
  // field too (they escaped as "json: number 1e999 is outside the range of a double", field unnamed).
  const auto groups_with = [](const std::string& lr, const std::string& params) {
    return std::vector<std::pair<std::string, std::string>>{
        {"param_groups", R"([{"lr": )" + lr + R"(, "betas": [0.9, 0.995], "eps": 1e-08, "weight_decay": 0.01, "params": [)" +
                             params + "]}]"}};
  };
  CHECK(refused(damaged_copy("lr_huge", "", nullptr, "", {}, groups_with("1e999", "0, 1, 2, 3, 4, 5, 6, 7")))
            .find("param_groups[0].lr: json: number 1e999 is outside the range of a double") != std::string::npos);
  CHECK(refused(damaged_copy("param_fraction", "", nullptr, "", {}, groups_with("0.002", "0, 1.5, 2, 3, 4, 5, 6, 7")))
            .find("param_groups[0].params[1]: json: 1.5 is not an integer") != std::string::npos);
  CHECK(refused(damaged_copy("param_huge", "", nullptr, "", {}, groups_with("0.002", "0, 1, 2, 3, 4, 5, 6, 99999999999999999999")))
            .find("param_groups[0].params[7]: json: integer 99999999999999999999 is out of range") != std::string::npos);
  std::vector<float> short_absmax(15, 1.0f);
  const auto short_bytes = bytes_of(short_absmax);
  CHECK(refused(damaged_copy("short", "state.1.absmax1", &short_bytes, "F32", {15})).find(
            "'state.1.absmax1' has 15 elements, expected 16 (one per block of 256 of 4096 elements)") != std::string::npos);
  CHECK(refused(damaged_copy("format", "", nullptr, "", {}, {{"format", "pt"}})).find(
            "metadata format is \"pt\", expected \"memkit.bnb_optimizer_state\"") != std::string::npos);
  CHECK(refused(damaged_copy("block", "", nullptr, "", {}, {{"block_size", "2048"}})).find("metadata block_size is \"2048\"") !=
        std::string::npos);
  CHECK(refused(damaged_copy("ademamix", "", nullptr, "", {},
                             {{"param_groups", R"([{"lr": 0.002, "betas": [0.9, 0.995, 0.9999], "eps": 1e-08, "weight_decay": 0.01, "params": [0, 1, 2, 3, 4, 5, 6, 7]}])"}}))
            .find("betas must be a list of two numbers (three betas: AdEMAMix, not AdamW)") != std::string::npos);
  CHECK(refused(damaged_copy("groups", "", nullptr, "", {},
                             {{"param_groups", R"([{"lr": 0.002, "betas": [0.9, 0.995], "eps": 1e-08, "weight_decay": 0.01, "params": [0, 1, 2, 3, 4, 5, 6]}])"}}))
            .find("param_groups list 7 parameters, the adam_state has 8 tensors") != std::string::npos);
  {
    std::vector<float> extra(4, 0.0f);
    const auto extra_bytes = bytes_of(extra);
    const std::string path = damaged_copy("unorm", "", nullptr);
    st::reader in(path);
    st::writer out;
    for (const auto& [k, val] : in.metadata()) out.add_metadata(k, val);
    for (const st::tensor_info& t : in.tensors()) {
      std::vector<std::byte> bytes(t.bytes());
      in.read_bytes(t.name, bytes.data(), bytes.size());
      out.add_bytes(t.name, t.dtype, t.shape, bytes.data(), bytes.size());
    }
    out.add_bytes("state.1.unorm_vec", "F32", {4}, extra_bytes.data(), extra_bytes.size());
    out.write(path);
    CHECK(refused(path).find("unexpected key 'state.1.unorm_vec'") != std::string::npos);
  }

  // A state whose threshold differs from bitsandbytes' min_8bit_size: tensor 1 (4096 elements) is 8-bit
  // in the file, fp32 here.
  memkit::optim::adam_options options;
  options.min_quantized_size = 8192;
  state8 other(host, memkit::default_host_resource(), sizes, options);
  CHECK(error_of([&] { (void)memkit::optim::load_bnb_adam_state(host, other, step5_state); })
            .find("'state.1.state1' is U8 (8-bit state), but this adam_state keeps fp32 moments for tensor 1 (4096 elements, "
                  "min_quantized_size 8192; bitsandbytes' min_8bit_size must equal it)") != std::string::npos);
  std::vector<std::int64_t> wrong_sizes = sizes;
  wrong_sizes[6] = 8192;
  state8 wrong(host, memkit::default_host_resource(), wrong_sizes);
  CHECK(error_of([&] { (void)memkit::optim::load_bnb_adam_state(host, wrong, step5_state); })
            .find("'state.6.state1' has 8320 elements (shape [16, 520]), tensor 6 of the adam_state has 8192") != std::string::npos);
  wrong_sizes.pop_back();
  state8 fewer(host, memkit::default_host_resource(), wrong_sizes);
  CHECK(error_of([&] { (void)memkit::optim::load_bnb_adam_state(host, fewer, step5_state); }).find("lists parameter 7, but the adam_state has 7 tensors") !=
        std::string::npos);
  memkit::optim::adam_state<float> plain(host, memkit::default_host_resource(), sizes);
  CHECK(error_of([&] { (void)memkit::optim::load_bnb_adam_state(host, plain, step5_state); })
            .find("'state.1.state1' is U8 (8-bit state), but this adam_state keeps fp32 moments") != std::string::npos);
}

TEST_CASE("bnb: read-only views and assign() round-trip any state; fp32 states use the 32-bit layout") {
  const std::vector<std::int64_t> sizes = {300, 5000};
  std::vector<float> p0(300), p1(5000), g0(300), g1(5000);
  for (std::size_t i = 0; i < p1.size(); ++i) {
    if (i < p0.size()) {
      p0[i] = 0.01f * float(i % 7);
      g0[i] = synthetic_gradient(0, 1, std::int64_t(i), 1e-2f);
    }
    p1[i] = -0.02f * float(i % 5);
    g1[i] = synthetic_gradient(1, 1, std::int64_t(i), 1e-2f);
  }
  const std::vector<memkit::optim::adam_group> groups(1);
  auto step_once = [&](auto& state) {
    std::vector<memkit::optim::adam_param<float, float>> views = {{host_view(p0), host_view(static_cast<const std::vector<float>&>(g0))},
                                                          {host_view(p1), host_view(static_cast<const std::vector<float>&>(g1))}};
    state.step(host, views, groups);
  };
  memkit::optim::adam_state<float> plain(host, memkit::default_host_resource(), sizes);
  step_once(plain);
  step_once(plain);
  CHECK(plain.step_view()[0] == 2);
  const std::string path = "/tmp/memkit_test_bnb_fp32_" + std::to_string(::getpid()) + ".safetensors";
  memkit::optim::bnb_adam_state_info info;
  info.groups = groups;
  info.group_of_tensor = {0, 0};
  info.shapes = {{300}, {50, 100}};
  memkit::optim::save_bnb_adam_state(host, plain, path, info);
  {
    const st::reader in(path);
    CHECK(in.info("state.1.state1").dtype == "F32");
    CHECK(in.info("state.1.state1").shape == std::vector<std::int64_t>{50, 100});
    CHECK(in.find("state.1.absmax1") == nullptr);
    std::string groups_text;
    for (const auto& [k, v] : in.metadata())
      if (k == "param_groups") groups_text = v;
    CHECK(groups_text == R"([{"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.01, "params": [0, 1]}])");
  }
  memkit::optim::adam_state<float> back(host, memkit::default_host_resource(), sizes);
  const auto back_info = memkit::optim::load_bnb_adam_state(host, back, path);
  CHECK(back_info.step == 2);
  CHECK(std::equal(plain.arena_view().begin(), plain.arena_view().begin() + 8, back.arena_view().begin()));
  for (std::size_t t = 0; t < 2; ++t) {
    const auto a = plain.tensor_state(t), b = back.tensor_state(t);
    CHECK(std::equal(a.m.begin(), a.m.end(), b.m.begin()));
    CHECK(std::equal(a.v.begin(), a.v.end(), b.v.begin()));
  }
  std::remove(path.c_str());

  // assign() takes exactly what tensor_state() shows, and checks it.
  state8 q(host, memkit::default_host_resource(), sizes);
  step_once(q);
  const auto t1 = q.tensor_state(1);
  CHECK(t1.quantized);
  CHECK(t1.m_codes.size() == 5000);
  CHECK(t1.m_absmax.size() == 20);
  CHECK(state8::m_map().size() == 256);
  CHECK(state8::m_map()[127] == 0.0f);
  std::vector<memkit::optim::adam_tensor_state<float>> copy = {q.tensor_state(0), q.tensor_state(1)};
  state8 q2(host, memkit::default_host_resource(), sizes);
  q2.assign(host, copy, q.control(host).step);
  // A step past 2^62 is refused by assign() as by load() (#35: INT64_MAX overflowed the next step).
  CHECK_THROWS_WITH_AS(q2.assign(host, copy, std::numeric_limits<std::int64_t>::max()),
                       doctest::Contains("adam_state::assign: step 9223372036854775807 (must be 0 .. 2^62)"), memkit::error);
  CHECK(q2.control(host).step == q.control(host).step);
  std::vector<float> m_a, v_a, m_b, v_b;
  q.read_moments(host, 1, m_a, v_a);
  q2.read_moments(host, 1, m_b, v_b);
  CHECK(m_a == m_b);
  CHECK(v_a == v_b);
  std::vector<float> bad_absmax(t1.m_absmax.begin(), t1.m_absmax.end());
  bad_absmax[2] = -1.0f;
  copy[1].m_absmax = host_view(static_cast<const float*>(bad_absmax.data()), shape{20});
  const std::vector<std::byte> before(q2.arena_view().begin(), q2.arena_view().end());
  CHECK(error_of([&] { q2.assign(host, copy, 1); }).find("tensor 1: m_absmax[2] is -1; block scales must be finite and >= 0") !=
        std::string::npos);
  copy[1] = q.tensor_state(0);
  CHECK(error_of([&] { q2.assign(host, copy, 1); }).find("tensor 1: the source has plain moments, but this state quantizes") !=
        std::string::npos);
  CHECK(std::equal(before.begin(), before.end(), q2.arena_view().begin()));
}
