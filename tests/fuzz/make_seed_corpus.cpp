// Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/): valid inputs that reach deep
// into each reader, made with memkit's own writers, plus a few hand-written JSON documents; and the
// regression inputs of issue #15's and #35's defects (tests/fuzz/regressions/<target>/). The committed files were
// made by this program; fuzzing adds to the corpus. Build and run from the repository root:
//   g++ -std=c++20 -O1 -Iinclude -Itests/fuzz tests/fuzz/make_seed_corpus.cpp -o /tmp/make_seed_corpus && /tmp/make_seed_corpus
// (HF config seeds are copies of tests/data/budget/*.json; see ./dev.sh fuzz.)
#include <memkit/io/safetensors.hpp>
#include <memkit/peft/peft.hpp>
#include <memkit/distributed/sharded_adam_state.hpp>
#include <memkit/distributed/sharded_parameters.hpp>
#include <memkit/optim/adam_state.hpp>
#include <memkit/optim/bnb_adam_state.hpp>
#include <memkit/quant/bnb_checkpoint.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "adam_image.hpp"
#include "sharded_image.hpp"

using namespace memkit;
using namespace memkit::optim;
namespace fs = std::filesystem;

namespace {
const fs::path root = "tests/fuzz/corpus";
const fs::path regressions = "tests/fuzz/regressions";

void write(const std::string& target, const std::string& name, const std::string& bytes, const fs::path& dir = root) {
  fs::create_directories(dir / target);
  std::ofstream(dir / target / name, std::ios::binary) << bytes;
}
void regression(const std::string& target, const std::string& name, const std::string& bytes) {
  write(target, name, bytes, regressions);
}

// A safetensors file with a hand-written header and `data_bytes` zero bytes of data.
std::string raw_safetensors(std::string header, std::size_t data_bytes) {
  while ((8 + header.size()) % 8 != 0) header += ' ';
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes += static_cast<char>(static_cast<std::uint64_t>(header.size()) >> (8 * i));
  return bytes + header + std::string(data_bytes, '\0');
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string saved(const safetensors::writer& out) {
  const std::string path = (fs::temp_directory_path() / "memkit_seed.safetensors").string();
  out.write(path);
  std::string bytes = slurp(path);
  fs::remove(path);
  return bytes;
}

std::vector<float> wave(std::size_t n, float scale) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.37f * static_cast<float>(i) + 0.1f);
  return v;
}

void json_seeds() {
  const char* documents[] = {
      "{}", "[]", "null", "true", "false", "0", "-0", "12345678901234567890", "-9223372036854775808",
      "3.14159e-10", "1E+308", "\"plain\"", "\"esc \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u0041 \\u00e9 \\ud834\\udd1e\"",
      "\"utf8 \xC3\xA9 \xE2\x82\xAC \xF0\x9D\x84\x9E\"", "[1, [2, [3, [4, [5]]]]]",
      "{\"a\": {\"b\": {\"c\": [true, false, null, 1.5, \"x\"]}}}",
      "{\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 24]}",
      "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": [8, 16], \"nested_blocksize\": 256, "
      "\"nested_dtype\": \"float32\", \"nested_offset\": 0.0123}",
      "  [ 1 , 2 ,\t3 ]\n", "{\"k\": \"\\u0000\"}", "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
      "{\"a\": 1, \"b\": 2, \"c\": 3, \"d\": [4, 5, {\"e\": 6}]}"};
  int i = 0;
  for (const char* d : documents) write("json", "seed_" + std::to_string(i++) + ".json", d);
}

void safetensors_seeds() {
  {
    safetensors::writer out;
    const std::vector<float> a = wave(6, 1.0f);
    out.add("a", host_view(a.data(), {2, 3}));
    write("safetensors", "one_f32.safetensors", saved(out));
  }
  {
    safetensors::writer out;
    const std::vector<float> a = wave(12, 2.0f);
    const std::vector<std::uint8_t> b{1, 2, 3, 4, 5};
    const std::vector<std::int64_t> c{-1, 0, 1};
    std::vector<bf16> d(4);
    for (std::size_t i = 0; i < d.size(); ++i) d[i] = bf16(static_cast<float>(i) * 0.5f);
    out.add("layer.weight", host_view(a.data(), {3, 4}));
    out.add("bytes", host_view(b));
    out.add("ints", host_view(c));
    out.add("half", host_view(d));
    out.add_metadata("format", "pt");
    out.add_metadata("note", "seed \xE2\x82\xAC");
    write("safetensors", "mixed.safetensors", saved(out));
  }
  {
    safetensors::writer out;
    const std::vector<float> none;
    out.add("empty", host_view(none.data(), {0, 7}));
    write("safetensors", "empty_tensor.safetensors", saved(out));
  }
  write("safetensors", "no_tensors.safetensors", saved(safetensors::writer{}));
}

template <quant::format F>
void bnb_seed(const std::string& name, bool nested, shape dims) {
  const std::vector<float> values = wave(static_cast<std::size_t>(dims.numel()), 0.2f);
  const auto weight = quant::quantized_tensor<F>::quantize(host, host_view(values.data(), dims), {64, nested},
                                                           default_host_resource());
  safetensors::writer out;
  quant::save_linear4bit(out, "w", weight);
  write("bnb_linear4bit", name, saved(out));
}

// A bitsandbytes NF4 weight "w" whose quant_state claims `shape_json` over `code_bytes` codes and `blocks` scales.
std::string bnb_claiming(const std::string& shape_json, std::int64_t code_bytes, std::int64_t blocks) {
  safetensors::writer out;
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(code_bytes), 0x77);
  std::vector<float> absmax(static_cast<std::size_t>(blocks), 1.0f);
  out.add("w", host_view(codes), {code_bytes, 1});
  out.add("w.absmax", host_view(absmax));
  out.add("w.quant_map", tensor_view<const float>(quant::nf4_codebook.data(), shape{16}, memory_kind::host));
  const std::string state = "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"bfloat16\", \"shape\": " + shape_json + "}";
  out.add_bytes("w.quant_state.bitsandbytes__nf4", "U8", {static_cast<std::int64_t>(state.size())}, state.data(), state.size());
  return saved(out);
}

void regressions_of_issue_15() {
  const char* json[] = {"\"\x80\"", "\"\xC0\xAF\"", "\"\xE0\x80\xAF\"", "\"\xED\xA0\x80\"", "\"\xF4\x90\x80\x80\"",
                        "\"\xE2\x82\"", "[1e999]", "{\"k\xFF\": 1}"};
  int i = 0;
  for (const char* d : json) regression("json", "issue15_" + std::to_string(i++) + ".json", d);
  regression("safetensors", "issue15_f64_bytes_wrap.safetensors",
             raw_safetensors(R"({"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", 0));
  regression("safetensors", "issue15_int64_wrap.safetensors",
             raw_safetensors(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0));
  regression("bnb_linear4bit", "issue15_512gib_claim.safetensors", bnb_claiming("[1048576, 1048576]", 32, 1));
  regression("bnb_linear4bit", "issue15_numel_minus_one.safetensors", bnb_claiming("[3, 6148914691236517205]", 0, 0));
  regression("bnb_linear4bit", "issue15_int64_max.safetensors", bnb_claiming("[9223372036854775807]", 0, 0));
}

template <class State>
void adam_seed(const std::string& name, const std::vector<std::int64_t>& sizes, adam_options options, int steps) {
  State state(host, default_host_resource(), sizes, options);
  std::vector<std::vector<float>> params, grads;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    params.push_back(wave(static_cast<std::size_t>(sizes[i]), 0.1f));
    grads.push_back(wave(static_cast<std::size_t>(sizes[i]), 0.01f));
  }
  std::vector<adam_param<float, float>> views;
  for (std::size_t i = 0; i < sizes.size(); ++i) views.push_back({host_view(params[i]), host_view(grads[i]), {}, 0});
  const std::vector<adam_group> groups{adam_group{}};
  for (int s = 0; s < steps; ++s) state.step(host, views, groups);
  std::stringstream image;
  state.save(host, image);
  write("adam_state", name, image.str());
  if (name != "fp32_3_steps.bin") return;
  // The forged control block of issue #15: step -5, with a valid checksum.
  std::string forged = image.str();
  const std::int64_t step = -5;
  std::memcpy(forged.data() + memkit_test::adam_image_state_offset(forged, state.bytes()), &step, sizeof step);
  memkit_test::fix_adam_image_checksum(forged, state.bytes());
  regression("adam_state", "issue15_step_minus_5.bin", forged);
  const float nan = std::nanf("");
  forged = image.str();
  std::memcpy(forged.data() + memkit_test::adam_image_state_offset(forged, state.bytes()) + offsetof(adam_control, loss_scale),
              &nan, sizeof nan);
  memkit_test::fix_adam_image_checksum(forged, state.bytes());
  regression("adam_state", "issue15_loss_scale_nan.bin", forged);
}

// ---- bitsandbytes optimizer state (load_bnb_adam_state) ----
template <class State>
State stepped_state(const std::vector<std::int64_t>& sizes, adam_options options, int steps, const std::vector<int>& group_of) {
  State state(host, default_host_resource(), sizes, options);
  std::vector<std::vector<float>> params, grads;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    params.push_back(wave(static_cast<std::size_t>(sizes[i]), 0.1f));
    grads.push_back(wave(static_cast<std::size_t>(sizes[i]), 0.01f));
  }
  std::vector<adam_param<float, float>> views;
  for (std::size_t i = 0; i < sizes.size(); ++i) views.push_back({host_view(params[i]), host_view(grads[i]), {}, group_of[i]});
  const std::vector<adam_group> groups{adam_group{.lr = 2e-3f}, adam_group{.lr = 1e-3f, .weight_decay = 0.0f}};
  for (int s = 0; s < steps; ++s) state.step(host, views, groups);
  return state;
}

template <class State>
std::string bnb_state_file(const State& state, const std::vector<int>& group_of, bool names) {
  bnb_adam_state_info info;
  info.groups = {adam_group{.lr = 2e-3f}, adam_group{.lr = 1e-3f, .weight_decay = 0.0f}};
  info.group_of_tensor = group_of;
  if (group_of == std::vector<int>(group_of.size(), 0)) info.groups.resize(1);
  if (names)
    for (std::size_t i = 0; i < state.tensor_count(); ++i) info.names.push_back("model.layer" + std::to_string(i) + ".weight");
  const std::string path = (fs::temp_directory_path() / "memkit_seed_bnb.safetensors").string();
  save_bnb_adam_state(host, state, path, info);
  std::string bytes = slurp(path);
  fs::remove(path);
  return bytes;
}

// A copy of the safetensors file `bytes` with tensors replaced (key -> I64 scalar), keys added and metadata changed.
std::string bnb_edited(const std::string& bytes, const std::vector<std::pair<std::string, std::int64_t>>& steps,
                       const std::vector<std::pair<std::string, std::string>>& metadata = {}) {
  const std::string in_path = (fs::temp_directory_path() / "memkit_seed_bnb_in.safetensors").string();
  std::ofstream(in_path, std::ios::binary) << bytes;
  safetensors::writer out;
  {
    const safetensors::reader in(in_path);
    for (const auto& [k, v] : in.metadata()) {
      std::string value = v;
      for (const auto& [ck, cv] : metadata)
        if (ck == k) value = cv;
      out.add_metadata(k, value);
    }
    for (const safetensors::tensor_info& t : in.tensors()) {
      bool replaced = false;
      for (const auto& [key, step] : steps) replaced = replaced || key == t.name;
      if (replaced) continue;
      std::vector<std::byte> data(t.bytes());
      in.read_bytes(t.name, data.data(), data.size());
      out.add_bytes(t.name, t.dtype, t.shape, data.data(), data.size());
    }
  }
  for (const auto& [key, step] : steps) out.add_bytes(key, "I64", {}, &step, sizeof step);
  fs::remove(in_path);
  return saved(out);
}

void bnb_adam_seeds() {
  const std::vector<int> two_groups{0, 1}, one_group{0, 0};
  using state8 = adam_state<std::int8_t, 256>;
  const adam_options eight_bit{.min_quantized_size = 256};
  write("bnb_adam_state", "int8_fresh.safetensors", bnb_state_file(stepped_state<state8>({300, 5}, eight_bit, 0, one_group), one_group, false));
  const std::string int8_stepped = bnb_state_file(stepped_state<state8>({300, 5}, eight_bit, 2, two_groups), two_groups, true);
  write("bnb_adam_state", "int8_2_steps_named.safetensors", int8_stepped);
  write("bnb_adam_state", "fp32_3_steps.safetensors", bnb_state_file(stepped_state<adam_state<float>>({7, 3}, {}, 3, one_group), one_group, false));
  write("bnb_adam_state", "fp32_2_groups_named.safetensors",
        bnb_state_file(stepped_state<adam_state<float>>({7, 3}, {}, 1, two_groups), two_groups, true));
  // #35: a step of INT64_MAX (the next step overflowed), a 23-digit parameter index (std::out_of_range), a
  // leading-zero index, a learning rate past a double (the field unnamed).
  const std::int64_t big = 9223372036854775807;
  regression("bnb_adam_state", "issue35_step_int64_max.safetensors",
             bnb_edited(int8_stepped, {{"state.0.step", big}, {"state.1.step", big}}));
  regression("bnb_adam_state", "issue35_huge_index.safetensors",
             bnb_edited(int8_stepped, {{"state.99999999999999999999999.step", 2}}));
  regression("bnb_adam_state", "issue35_leading_zero_index.safetensors", bnb_edited(int8_stepped, {{"state.01.step", 2}}));
  regression("bnb_adam_state", "issue35_lr_past_double.safetensors",
             bnb_edited(int8_stepped, {}, {{"param_groups", R"([{"lr": 1e999, "betas": [0.9, 0.999], "eps": 1e-08, )"
                                                            R"("weight_decay": 0.01, "params": [0, 1]}])"}}));
}

// ---- sharded_adam_state rank images ----
template <class S>
std::string sharded_image(const std::vector<std::int64_t>& sizes, adam_options options, int steps, std::uint64_t run) {
  S state(host, distributed::single_communicator{}, default_host_resource(), sizes, options, run);
  std::vector<float> params(static_cast<std::size_t>(state.flat_size())), grads(params.size());
  params = wave(params.size(), 0.1f);
  for (int s = 0; s < steps; ++s) {
    grads = wave(params.size(), 0.01f * static_cast<float>(s + 1));
    state.step_full_gradients(host, distributed::single_communicator{}, host_view(params), host_view(grads),
                              std::vector<adam_group>{adam_group{}});
  }
  std::stringstream out;
  state.save(host, out);
  return out.str();
}

// The same save re-sharded onto `ranks` ranks: their images back to back.
template <class S>
std::string resharded(const std::string& image, const std::vector<std::int64_t>& sizes, adam_options options, int ranks,
                      std::uint64_t run) {
  std::string all;
  for (int r = 0; r < ranks; ++r) {
    S state(host, memkit_test::rank_of_communicator{r, ranks}, default_host_resource(), sizes, options, run);
    std::stringstream in(image), out;
    state.load(host, in);
    state.save(host, out);
    all += out.str();
  }
  return all;
}

// A one-rank fp32 image of `sizes` with its control block changed (and the checksum made to match).
template <class S, class Change>
std::string forged_control(std::string image, std::size_t tensors, Change change) {
  std::uint32_t magic_length = 0;
  std::memcpy(&magic_length, image.data(), 4);
  const std::size_t body = 4 + magic_length + 4 + 8;
  // name, bits, block, map fingerprint, min_quantized_size, ranks, rank, run id, tensor count, sizes
  const std::size_t at = body + 4 + S::format_name().size() + 4 + 4 + 8 + 8 + 4 + 4 + 8 + 8 + 8 * tensors;
  adam_control c{};
  std::memcpy(&c, image.data() + at, sizeof c);
  change(c);
  std::memcpy(image.data() + at, &c, sizeof c);
  memkit_test::sharded_image_end<S>(image, 0, true);
  return image;
}

void sharded_adam_seeds() {
  using S = distributed::sharded_adam_state<float>;
  using S8 = distributed::sharded_adam_state<std::int8_t, 256>;
  const adam_options scaled{.loss_scaling = {.enabled = true, .initial_scale = 256.0f}};
  const adam_options eight_bit{.min_quantized_size = 256};
  write("sharded_adam_state", "fp32_fresh.bin", sharded_image<S>({7, 3}, {}, 0, 0x5eed));
  const std::string fp32 = sharded_image<S>({7, 3}, {}, 3, 0x5eed);
  write("sharded_adam_state", "fp32_3_steps.bin", fp32);
  write("sharded_adam_state", "fp32_scaled.bin", sharded_image<S>({7, 3}, scaled, 2, 0x5eed));
  write("sharded_adam_state", "fp32_2_ranks.bin", resharded<S>(fp32, {7, 3}, {}, 2, 0x5eed));
  const std::string int8 = sharded_image<S8>({300, 5}, eight_bit, 2, 0x5eed);
  write("sharded_adam_state", "int8_2_steps.bin", int8);
  write("sharded_adam_state", "int8_3_ranks.bin", resharded<S8>(int8, {300, 5}, eight_bit, 3, 0x5eed));
  // #35: forged control blocks with valid checksums; a short image claiming a huge body; two ranks of
  // different runs at the same step.
  regression("sharded_adam_state", "issue35_step_int64_max.bin",
             forged_control<S>(fp32, 2, [](adam_control& c) { c.step = 9223372036854775807; }));
  regression("sharded_adam_state", "issue35_step_minus_5.bin", forged_control<S>(fp32, 2, [](adam_control& c) { c.step = -5; }));
  regression("sharded_adam_state", "issue35_loss_scale_nan_norm_minus_1.bin", forged_control<S>(fp32, 2, [](adam_control& c) {
               c.loss_scale = std::nanf("");
               c.grad_norm = -1.0;
             }));
  std::string huge = fp32.substr(0, 4 + 25 + 4 + 8);
  const std::uint64_t claimed = std::uint64_t{1} << 31;
  std::memcpy(huge.data() + 4 + 25 + 4, &claimed, 8);
  regression("sharded_adam_state", "issue35_41_bytes_claiming_2gib.bin", huge);  // past the bound: refused unread
  const std::uint64_t within = std::uint64_t{1} << 20;                          // within it: read in pieces, truncated
  std::memcpy(huge.data() + 4 + 25 + 4, &within, 8);
  regression("sharded_adam_state", "issue35_41_bytes_claiming_1mib.bin", huge);
  std::string other_run = resharded<S>(sharded_image<S>({7, 3}, {}, 3, 0xbad), {7, 3}, {}, 2, 0xbad);
  std::string mine = resharded<S>(fp32, {7, 3}, {}, 2, 0x5eed);
  const std::size_t half = memkit_test::sharded_image_end<S>(mine, 0, false);
  const std::size_t half_other = memkit_test::sharded_image_end<S>(other_run, 0, false);
  regression("sharded_adam_state", "issue35_ranks_of_two_runs.bin", mine.substr(0, half) + other_run.substr(half_other));
}
}  // namespace

// ---- PEFT adapters: u32 config length, adapter_config.json, adapter_model.safetensors ----
std::string peft_input(const std::string& config, const std::string& weights) {
  std::string bytes;
  for (int i = 0; i < 4; ++i) bytes += static_cast<char>(static_cast<std::uint32_t>(config.size()) >> (8 * i));
  return bytes + config + weights;
}
std::string peft_written(const peft::adapter_writer& writer) {
  const fs::path dir = fs::temp_directory_path() / "memkit_seed_peft";
  fs::remove_all(dir);
  writer.write(dir.string());
  std::string bytes = peft_input(slurp((dir / peft::config_file_name).string()), slurp((dir / peft::weights_file_name).string()));
  fs::remove_all(dir);
  return bytes;
}
void peft_adapter_seeds() {
  const std::vector<float> A(2 * 4, 0.5f), B(3 * 2, 0.25f), bias(3, 1.0f);
  auto a = host_view(A.data(), shape{2, 4});
  auto b = host_view(B.data(), shape{3, 2});
  {  // a list of targets, a trained bias, two layers
    peft::lora_config c;
    c.r = 2;
    c.bias = "lora_only";
    c.target_modules = peft::module_selector::of({"q_proj", "v_proj"});
    peft::adapter_writer w(c);
    for (const char* path : {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"})
      w.add<float>(path, a, b, host_view(bias.data(), shape{3}));
    write("peft_adapter", "list_bias.bin", peft_written(w));
  }
  {  // a regex, rank_pattern, alpha_pattern, layers_to_transform with a layers_pattern list
    peft::lora_config c;
    c.r = 4;
    c.target_modules = peft::module_selector::matching(".*\\.(q|k)_proj");
    c.rank_pattern = {{"q_proj", 2}};
    c.alpha_pattern = {{"k_pro.", 3.0}};
    c.layers_to_transform = {1};
    c.layers_pattern = {"layers", "h"};
    peft::adapter_writer w(c);
    w.add<float>("model.layers.1.attn.q_proj", a, b);
    write("peft_adapter", "regex_patterns.bin", peft_written(w));
  }
  // #35 regressions: catastrophic backtracking for std::regex, a 200 KB module path, a layer index past int64.
  const std::string base = R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4, )";
  auto one_module = [&](const std::string& path) {
    safetensors::writer out;
    out.add_bytes("base_model.model." + path + ".lora_A.weight", "F32", {2, 4}, A.data(), A.size() * 4);
    out.add_bytes("base_model.model." + path + ".lora_B.weight", "F32", {3, 2}, B.data(), B.size() * 4);
    return saved(out);
  };
  regression("peft_adapter", "issue35_backtracking.bin",
             peft_input(base + R"("target_modules": "(a+)+b", "rank_pattern": {"(a|aa)+c": 2}})", one_module(std::string(64, 'a') + "c")));
  regression("peft_adapter", "issue35_200kb_path.bin",
             peft_input(base + R"("target_modules": ".*x"})", one_module(std::string(200000, 'a') + "x")));
  regression("peft_adapter", "issue35_layer_index_past_int64.bin",
             peft_input(base + R"("target_modules": ["q_proj"], "layers_to_transform": [1]})",
                        one_module("model.layers.99999999999999999999999.q_proj")));
  regression("peft_adapter", "issue35_bad_layers_pattern_item.bin",
             peft_input(base + R"("target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": ["layers", "h["]})",
                        one_module("model.layers.1.q_proj")));
}

// ---- export_consolidated: rank files of sharded parameters ----

void consolidate_seeds() {
  namespace dist = memkit::distributed;
  memory_resource& r = default_host_resource();
  std::vector<float> v(40 * 300);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.37f * static_cast<float>(i)) * (1.0f + static_cast<float>(i % 7));
  const auto nf4 = quant::quantized_tensor<quant::NF4>::quantize(host, host_view(v.data(), shape{40, 300}), {64, true}, r);
  const auto fp4 = quant::quantized_tensor<quant::FP4>::quantize(host, host_view(v.data(), shape{3, 99}), {32, false}, r);
  std::vector<bf16> embedding;
  for (int i = 0; i < 6 * 5; ++i) embedding.emplace_back(v[static_cast<std::size_t>(i)]);
  const tensor_view<const bf16> embedding_view(embedding.data(), shape{6, 5}, memory_kind::host);
  const auto rank_file = [&](int rank, int ranks, bool dense, bool quantized) {
    safetensors::writer out;
    if (dense) dist::sharded_dense<bf16>(embedding_view, rank, ranks, r).save(out, "model.embed_tokens.weight");
    if (quantized) {
      dist::sharded_quantized<quant::NF4>(nf4, rank, ranks, r).save(out, "model.layers.0.mlp.up_proj.weight");
      dist::sharded_quantized<quant::FP4>(fp4, rank, ranks, r).save(out, "model.layers.0.mlp.down_proj.weight");
    }
    if (dense) dist::sharded_dense<float>(host_view(v.data(), shape{7}), rank, ranks, r).save(out, "model.norm.weight");
    return saved(out);
  };
  write("consolidate", "dense.safetensors", rank_file(0, 1, true, false));
  write("consolidate", "quantized.safetensors", rank_file(0, 1, false, true));
  write("consolidate", "model.safetensors", rank_file(0, 1, true, true));
  write("consolidate", "rank_1_of_2.safetensors", rank_file(1, 2, true, true));  // refused alone: a rank is missing
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "peft_adapter") {  // only the PEFT seeds
    peft_adapter_seeds();
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "consolidate") {  // only the export's seeds
    consolidate_seeds();
    return 0;
  }
  consolidate_seeds();
  peft_adapter_seeds();
  regressions_of_issue_15();
  json_seeds();
  safetensors_seeds();
  bnb_seed<quant::format::nf4>("nf4.safetensors", false, {4, 32});
  bnb_seed<quant::format::nf4>("nf4_nested.safetensors", true, {3, 40});
  bnb_seed<quant::format::fp4>("fp4.safetensors", false, {129});
  bnb_seed<quant::format::fp4>("fp4_nested.safetensors", true, {2, 2, 33});
  adam_seed<adam_state<float>>("fp32_fresh.bin", {7, 3}, {}, 0);
  adam_seed<adam_state<float>>("fp32_3_steps.bin", {7, 3}, {}, 3);
  adam_seed<adam_state<float>>("fp32_scaled.bin", {7, 3}, {.loss_scaling = {.enabled = true, .initial_scale = 256.0f}}, 2);
  adam_seed<adam_state<std::int8_t, 256>>("int8_2_steps.bin", {300, 5}, {.min_quantized_size = 256}, 2);
  bnb_adam_seeds();
  sharded_adam_seeds();
  for (const auto& entry : fs::directory_iterator("tests/data/budget"))
    if (entry.path().filename().string().rfind("bad_", 0) != 0)
      write("hf_config", entry.path().filename().string(), slurp(entry.path().string()));
  // One real config per supported model family (tests/data/configs/SOURCES).
  for (const auto& entry : fs::directory_iterator("tests/data/configs"))
    if (entry.path().extension() == ".json")
      write("hf_config", "family_" + entry.path().filename().string(), slurp(entry.path().string()));
  return 0;
}
