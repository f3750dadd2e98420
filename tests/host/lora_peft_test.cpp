// lora_linear layers in PEFT's files: an adapter written by the peft package loads into lora_linear layers
// that then reproduce PEFT's forward outputs; layers saved by memkit read back bit for bit; a layer that does
// not match its module is refused before anything is written.
#include <doctest/doctest.h>

#include <memkit/peft/peft.hpp>
#include <memkit/quant/bnb_checkpoint.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include "lora_support.hpp"

namespace peft = memkit::peft;
namespace st = memkit::safetensors;
using namespace lora_test;
using memkit::activation_store;

namespace {

const std::string data_dir = std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/peft/llama_tiny";

std::string temporary_directory(const char* name) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("memkit_lora_peft_" + std::string(name) + "_" + std::to_string(::getpid())))
                              .string();
  std::filesystem::remove_all(dir);
  return dir;
}

// The frozen base of `path` from PEFT's reference file, as fp32 [out, in] (dense, or NF4 dequantized).
std::vector<float> base_of(const st::reader& reference, const std::string& path) {
  const std::string key = path + ".weight";
  if (reference.info(key).dtype == "F32") return reference.read_vector<float>(key);
  const auto weight = memkit::quant::load_linear4bit<memkit::quant::NF4>(reference, key, memkit::default_host_resource());
  std::vector<float> dense(static_cast<std::size_t>(weight.numel()));
  weight.dequantize(host, host_view(dense));
  return dense;
}

// One module rebuilt as a lora_linear<float> over its base, with the bias storage PEFT's file may fill.
struct module_layer {
  std::string path;
  std::vector<float> weight, bias;
  std::unique_ptr<lora_linear<float>> layer;
};

std::vector<module_layer> layers_for(const peft::adapter_file& file, const st::reader& reference) {
  std::vector<module_layer> out;
  for (const peft::lora_module& m : file.modules()) {
    module_layer l;
    l.path = m.path;
    l.weight = base_of(reference, m.path);
    if (m.has_bias) l.bias.assign(static_cast<std::size_t>(m.out_features), 0.0f);
    out.push_back(std::move(l));
    module_layer& back = out.back();
    back.layer = std::make_unique<lora_linear<float>>(
        host_view(back.weight.data(), {m.out_features, m.in_features}),
        back.bias.empty() ? memkit::tensor_view<float>::none() : host_view(back.bias.data(), {m.out_features}),
        peft::layer_options(file, m.path), memkit::default_host_resource(), memkit::default_host_resource(), memkit::default_host_resource());
  }
  return out;
}

std::vector<peft::layer_at<lora_linear<float>>> targets(std::vector<module_layer>& layers) {
  std::vector<peft::layer_at<lora_linear<float>>> out;
  for (module_layer& l : layers) out.push_back({l.path, l.layer.get()});
  return out;
}

}  // namespace

TEST_CASE("peft + lora_linear: an adapter written by PEFT loads into layers that reproduce PEFT's forward") {
  const peft::adapter_file file(data_dir + "/adapter_fp32");
  const st::reader reference(data_dir + "/reference.safetensors");
  std::vector<module_layer> layers = layers_for(file, reference);
  REQUIRE(layers.size() == 6);
  peft::load_layers(file, targets(layers));
  for (module_layer& l : layers) {
    CAPTURE(l.path);
    CHECK(l.layer->scale() == doctest::Approx(file.module(l.path).scale));
    const std::vector<float> x = reference.read_vector<float>(l.path + ".x");
    const std::vector<float> y_peft = reference.read_vector<float>(l.path + ".y");
    const std::int64_t tokens = static_cast<std::int64_t>(x.size()) / l.layer->in_features();
    std::vector<float> y(y_peft.size());
    activation_store store(memkit::default_host_resource());
    // PEFT's reference ran in eval mode: no dropout.
    l.layer->forward(host, {0, 0, false}, host_view(x.data(), {tokens, l.layer->in_features()}),
                     host_view(y.data(), {tokens, l.layer->out_features()}), store);
    double worst = 0.0, largest = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) {
      worst = std::max(worst, std::fabs(static_cast<double>(y[i]) - y_peft[i]));
      largest = std::max(largest, std::fabs(static_cast<double>(y_peft[i])));
    }
    CAPTURE(worst);
    CHECK(worst <= 2e-6 * (1.0 + largest));  // fp32 rounding of two different GEMMs
  }
}

TEST_CASE("peft + lora_linear: layers saved by memkit load back bit for bit, bias and config included") {
  const std::int64_t in = 40, out = 24;
  std::vector<float> w = memkit_test::uniform_values(in * out, 1), bias_q(out, 0.25f), bias_v(out, -0.5f);
  auto& heap = memkit::default_host_resource();
  const lora_options options{.rank = 4, .alpha = 8.0, .use_rslora = true, .dropout = 0.1f, .train_bias = true, .init_seed = 5};
  lora_linear<float> q_proj(host_view(w.data(), {out, in}), host_view(bias_q.data(), {out}), options, heap, heap, heap);
  lora_linear<float> v_proj(host_view(w.data(), {out, in}), host_view(bias_v.data(), {out}),
                            lora_options{options.rank, options.alpha, true, 0.1f, true, {}, 6}, heap, heap, heap);
  randomize_b(q_proj, 7);
  randomize_b(v_proj, 8);
  const std::string dir = temporary_directory("round_trip");
  peft::lora_config config = peft::config_for(q_proj, peft::module_selector::of({"q_proj", "v_proj"}));
  config.task_type = "CAUSAL_LM";
  peft::save_layers<float, float>(dir, config,
                                  {{"model.layers.0.self_attn.q_proj", &q_proj}, {"model.layers.0.self_attn.v_proj", &v_proj}});

  const peft::adapter_file file(dir);
  CHECK(file.config().r == 4);
  CHECK(file.config().lora_alpha == 8.0);
  CHECK(file.config().use_rslora);
  CHECK(file.config().bias == "lora_only");
  CHECK(file.config().lora_dropout == doctest::Approx(0.1));
  std::vector<float> w2 = w, bias2(out, 0.0f);
  lora_linear<float> loaded(host_view(w2.data(), {out, in}), host_view(bias2.data(), {out}),
                            peft::layer_options(file, "model.layers.0.self_attn.v_proj"), heap, heap, heap);
  peft::load_layers<float, float>(file, {{"model.layers.0.self_attn.v_proj", &loaded}});
  CHECK(std::equal(loaded.lora_A().begin(), loaded.lora_A().end(), v_proj.lora_A().begin()));
  CHECK(std::equal(loaded.lora_B().begin(), loaded.lora_B().end(), v_proj.lora_B().begin()));
  CHECK(bias2 == bias_v);
  CHECK(loaded.options().train_bias);
  std::filesystem::remove_all(dir);
}

TEST_CASE("peft + lora_linear: a layer that does not match its module is refused, and nothing is loaded") {
  const peft::adapter_file file(data_dir + "/adapter_fp32");
  const st::reader reference(data_dir + "/reference.safetensors");
  std::vector<module_layer> layers = layers_for(file, reference);
  const std::vector<float> a_before(layers[0].layer->lora_A().begin(), layers[0].layer->lora_A().end());
  auto& heap = memkit::default_host_resource();
  auto check_refused = [&](lora_linear<float>& wrong, const std::string& path, const char* message) {
    std::vector<peft::layer_at<lora_linear<float>>> list = targets(layers);
    for (auto& t : list)
      if (t.path == path) t.layer = &wrong;
    CHECK_THROWS_WITH_AS(peft::load_layers(file, list), doctest::Contains(message), memkit::error);
    // The first module was listed before the bad one: still as it was.
    CHECK(std::equal(a_before.begin(), a_before.end(), layers[0].layer->lora_A().begin()));
  };
  const std::string q1 = "model.layers.1.self_attn.q_proj";
  module_layer& target = layers[4];
  REQUIRE(target.path == q1);
  const std::int64_t in = target.layer->in_features(), out = target.layer->out_features();
  lora_options scale_off = peft::layer_options(file, q1);
  scale_off.alpha = 16.0;  // the file's alpha_pattern gives this module 4
  lora_linear<float> wrong_scale(host_view(target.weight.data(), {out, in}), host_view(target.bias.data(), {out}),
                                 scale_off, heap, heap, heap);
  check_refused(wrong_scale, q1, "the file's scale is 0.5 (lora_alpha 4) but the layer's is 2");
  lora_options rank_off = peft::layer_options(file, q1);
  rank_off.rank = 4;
  rank_off.alpha = 2.0;
  lora_linear<float> wrong_rank(host_view(target.weight.data(), {out, in}), host_view(target.bias.data(), {out}),
                                rank_off, heap, heap, heap);
  check_refused(wrong_rank, q1, "has rank 8 but the layer has rank 4");
  lora_options no_bias = peft::layer_options(file, q1);
  no_bias.train_bias = false;
  lora_linear<float> without_bias(host_view(target.weight.data(), {out, in}), no_bias, heap, heap, heap);
  check_refused(without_bias, q1, "trains this module's bias");

  // Saving: a layer whose scale the config does not give is refused by the writer.
  peft::adapter_writer writer(file.config());
  CHECK_THROWS_WITH_AS(writer.add(q1, wrong_scale), doctest::Contains("the config gives this module 0.5"), memkit::error);
}
