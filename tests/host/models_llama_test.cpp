// memkit/models/llama against transformers: Hugging Face checkpoints of every supported family load and give
// transformers' logits and loss (tests/data/models/, written by make_model_data.py beside them), and every
// malformed config or checkpoint is refused with a message naming the key, before anything is allocated.
#include <memkit/layers/parameters.hpp>
#include <memkit/models/llama/load.hpp>

#include <memkit/linalg/gemm.hpp>
#include <memkit/loss/fused_linear_cross_entropy.hpp>
#include <memkit/memory/tracking.hpp>
#include <memkit/optim/adam_state.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/tracked_memory.hpp"

namespace llama = memkit::models::llama;
namespace fs = std::filesystem;

namespace {

using memkit::shape;
using memkit::tensor_view;

const std::string models_dir = std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/models/";
const char* const all_models[] = {"llama_llama3_bias", "llama_tied_bf16", "mistral_window", "qwen2_tied", "qwen3_qknorm"};
constexpr std::int64_t batch = 2, seq = 16;

struct reference {
  std::vector<std::int32_t> ids;
  std::vector<float> logits_fp32, logits_bf16;
  float loss = 0;
  explicit reference(const std::string& model) {
    memkit::safetensors::reader r(models_dir + model + "/reference.safetensors");
    ids = r.read_vector<std::int32_t>("ids");
    logits_fp32 = r.read_vector<float>("logits_fp32");
    logits_bf16 = r.read_vector<float>("logits_bf16");
    loss = r.read_vector<float>("loss_fp32")[0];
  }
};

struct tracked_memory : memkit_test::tracked_memory {
  tracked_memory() : memkit_test::tracked_memory("models") {}
};

// The model's final hidden states [B*S, H] for the reference ids.
template <class T, class Model>
std::vector<T> final_hidden(Model& model, const std::vector<std::int32_t>& ids, memkit::memory_resource& saved) {
  std::vector<T> hidden(static_cast<std::size_t>(batch * seq * model.config.hidden));
  model.forward_hidden(memkit::host, memkit::host_view(ids.data(), shape{batch, seq}),
                       memkit::host_view(hidden.data(), shape{batch, seq, model.config.hidden}), saved);
  return hidden;
}

// logits [B*S, V] = hidden [B*S, H] head^T, fp32 accumulation.
template <class T, class Model>
std::vector<float> logits_of(Model& model, const std::vector<T>& hidden) {
  const std::int64_t N = batch * seq, H = model.config.hidden, V = model.config.vocab;
  std::vector<float> logits(static_cast<std::size_t>(N * V));
  namespace la = memkit::linalg;
  la::gemm(memkit::host, la::transpose::no, la::transpose::yes, 1.0f,
           la::matrix_ref<const T>{hidden.data(), N, H, H, memkit::memory_kind::host},
           la::matrix_ref<const T>{model.head_weight().value.data(), V, H, H, memkit::memory_kind::host}, 0.0f,
           la::matrix_ref<float>{logits.data(), N, V, V, memkit::memory_kind::host}, memkit::default_host_resource(),
           la::gemm_options{2});
  return logits;
}

// Next-token targets of ids [batch, seq]: the following id, -100 (ignored) at each sequence's last position.
std::vector<std::int32_t> next_token_targets(const std::vector<std::int32_t>& ids) {
  std::vector<std::int32_t> targets(ids.size(), -100);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s + 1 < seq; ++s) targets[b * seq + s] = ids[b * seq + s + 1];
  return targets;
}

// One training pass of `model` on the reference ids with next-token targets: returns the mean loss, the
// gradients accumulated into the adapters (or trainable parameters).
template <class Model>
float next_token_pass(Model& model, const std::vector<std::int32_t>& ids, memkit::memory_resource& saved) {
  const std::vector<std::int32_t> targets = next_token_targets(ids);
  float loss = 0;
  model.forward_backward(memkit::host, memkit::host_view(ids.data(), shape{batch, seq}),
                         memkit::host_view(targets.data(), shape{batch, seq}), memkit::host_view(&loss, shape{1}), saved);
  return loss;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::abs(double(x)));
  return m;
}
double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}

// A copy of one reference model in a fresh temporary directory, to break.
struct model_copy {
  fs::path dir;
  explicit model_copy(const std::string& model, const std::string& tag) {
    dir = fs::temp_directory_path() / ("memkit_models_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    for (const fs::directory_entry& e : fs::directory_iterator(models_dir + model))
      if (e.is_regular_file() && e.path().filename() != "reference.safetensors") fs::copy_file(e.path(), dir / e.path().filename());
  }
  ~model_copy() { fs::remove_all(dir); }
  std::string text(const std::string& file) const {
    std::ifstream in(dir / file);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  void write(const std::string& file, const std::string& contents) const { std::ofstream(dir / file) << contents; }
  // Replaces the first `from` in config.json (which must be there) by `to`.
  void edit_config(const std::string& from, const std::string& to) const {
    std::string s = text("config.json");
    const std::size_t at = s.find(from);
    REQUIRE(at != std::string::npos);
    s.replace(at, from.size(), to);
    write("config.json", s);
  }
  // Rewrites model.safetensors with `change` applied to its (name, dtype, dims, bytes) entries.
  template <class Change>
  void rewrite_weights(Change change) const {
    memkit::safetensors::writer out;
    {
      memkit::safetensors::reader in((dir / "model.safetensors").string());
      for (const memkit::safetensors::tensor_info& t : in.tensors()) {
        std::vector<std::byte> bytes(t.bytes());
        in.read_bytes(t.name, bytes.data(), bytes.size());
        std::string name = t.name, dtype = t.dtype;
        std::vector<std::int64_t> dims = t.shape;
        if (change(name, dtype, dims, bytes)) out.add_bytes(name, dtype, dims, bytes.data(), bytes.size());
      }
    }
    out.write((dir / "model.safetensors").string());
  }
};

std::string load_error(const std::string& dir, std::int64_t max_sequence = seq) {
  tracked_memory m;
  try {
    llama::hf_checkpoint ckpt(dir, max_sequence);
    auto model = llama::load_causal_lm<float>(ckpt, m.memory);
  } catch (const memkit::error& e) {
    CHECK(m.tracker.current_bytes() == 0);  // nothing is left allocated
    return e.what();
  }
  return "(no error)";
}

// LoRA options of the reference adapters tests/data/models/make_model_data.py wrote (r = 4, lora_alpha = 8).
llama::lora_load_options reference_lora_options() {
  llama::lora_load_options options;
  options.lora.rank = 4;
  options.lora.alpha = 8;
  return options;
}

// The fp32 LoRA model of `name` with its reference PEFT adapter loaded, allocated from `memory`.
auto load_reference_adapter(const std::string& name, const memkit::layers::memory_resources& memory) {
  llama::hf_checkpoint ckpt(models_dir + name, seq);
  auto model = llama::load_lora_causal_lm<float, float>(memkit::host, ckpt, memory, reference_lora_options());
  llama::load_peft_adapter(*model, models_dir + name + "/adapter");
  return model;
}

}  // namespace

TEST_CASE("models: each family's config.json is read with the options its math needs") {
  const auto config = [](const char* model) { return llama::read_hf_config(models_dir + model + "/config.json", seq); };
  const llama::model_config l = config("llama_llama3_bias");
  CHECK(l.head_dim == 32);  // given, not hidden / heads = 16
  CHECK((l.qkv_bias && l.o_bias && l.mlp_bias && !l.tie_embeddings && !l.qk_norm));
  CHECK(l.rope_theta == 500000.0f);
  CHECK(l.rope_llama3_factor == 8.0f);
  CHECK(l.rope_original_max_positions == 16);
  CHECK(l.max_positions == seq);
  CHECK(config("llama_tied_bf16").tie_embeddings);
  const llama::model_config m = config("mistral_window");
  CHECK((m.sliding_window == 5 && m.first_sliding_layer == 0 && m.window_of(0) == 5));
  const llama::model_config q2 = config("qwen2_tied");
  CHECK((q2.qkv_bias && !q2.o_bias && q2.tie_embeddings && q2.sliding_window == 0));
  const llama::model_config q3 = config("qwen3_qknorm");
  CHECK((q3.qk_norm && q3.head_dim == 32 && q3.window_of(0) == 0 && q3.window_of(1) == 6));
  CHECK(q3.norm_eps == 1e-5f);
}

TEST_CASE("models: fp32 logits and loss equal transformers' for every family") {
  for (const char* name : all_models) {
    CAPTURE(name);
    const reference ref(name);
    tracked_memory m;
    llama::hf_checkpoint ckpt(models_dir + name, seq);
    auto model = llama::load_causal_lm<float>(ckpt, m.memory);
    const std::vector<float> hidden = final_hidden<float>(*model, ref.ids, m.activations());
    const std::vector<float> logits = logits_of(*model, hidden);
    const double scale = max_abs(ref.logits_fp32), err = max_diff(logits, ref.logits_fp32);
    MESSAGE(std::string(name) << ": fp32 max |logit - transformers| = " << err << " (max |logit| " << scale << ")");
    CHECK(err <= 1e-4 * scale);

    // The loss through memkit's fused linear cross-entropy: next-token targets, the last position ignored.
    const std::vector<std::int32_t> targets = next_token_targets(ref.ids);
    float loss = 0;
    const std::int64_t N = batch * seq, H = model->config.hidden;
    memkit::loss::fused_linear_cross_entropy(
        memkit::host, memkit::host_view(hidden.data(), shape{N, H}), std::as_const(model->head_weight().value).view(),
        memkit::host_view(targets.data(), shape{N}), memkit::host_view(&loss, shape{1}), tensor_view<float>{},
        tensor_view<float>{}, {}, memkit::default_host_resource());
    CHECK(std::abs(loss - ref.loss) <= 1e-5 * std::abs(ref.loss));
  }
}

// bf16 rounds activations at different points than torch does (memkit: once per layer output, fp32 inside
// RMSNorm, rotary and SwiGLU; torch: after most elementwise ops), so the two bf16 results differ by about
// their distance from the fp32 result. The bound: memkit's bf16 logits are no further from transformers'
// fp32 logits than twice transformers' own bf16 logits are.
TEST_CASE("models: bf16 logits are within bf16 rounding of transformers'") {
  for (const char* name : all_models) {
    CAPTURE(name);
    const reference ref(name);
    tracked_memory m;
    llama::hf_checkpoint ckpt(models_dir + name, seq);
    auto model = llama::load_causal_lm<memkit::bf16>(ckpt, m.memory);
    const std::vector<float> logits = logits_of(*model, final_hidden<memkit::bf16>(*model, ref.ids, m.activations()));
    const double memkit_err = max_diff(logits, ref.logits_fp32), torch_err = max_diff(ref.logits_bf16, ref.logits_fp32);
    MESSAGE(std::string(name) << ": bf16 max |logit - fp32 reference|: memkit " << memkit_err << ", transformers " << torch_err);
    CHECK(memkit_err <= 2 * torch_err);
  }
}

TEST_CASE("models: a PEFT adapter loads onto the checkpoint and gives PEFT's logits, loss and LoRA gradients") {
  for (const char* name : all_models) {
    CAPTURE(name);
    const reference ref(name);
    memkit::safetensors::reader r(models_dir + name + "/reference.safetensors");
    const std::vector<float> logits_ref = r.read_vector<float>("logits_lora_fp32");
    const float loss_ref = r.read_vector<float>("loss_lora_fp32")[0];
    tracked_memory m;
    auto model = load_reference_adapter(name, m.memory);

    const std::vector<float> logits = logits_of(*model, final_hidden<float>(*model, ref.ids, m.activations()));
    const double err = max_diff(logits, logits_ref);
    MESSAGE(std::string(name) << ": LoRA fp32 max |logit - PEFT| = " << err << " (max |logit| " << max_abs(logits_ref) << ")");
    CHECK(err <= 1e-4 * max_abs(logits_ref));
    CHECK(max_diff(logits_ref, ref.logits_fp32) > 0.1);  // the adapter changes the output

    const float loss = next_token_pass(*model, ref.ids, m.activations());
    CHECK(std::abs(loss - loss_ref) <= 1e-5 * std::abs(loss_ref));
    double worst = 0;
    for (llama::lora_projection<float, float>* l : model->linears())
      for (const auto& [suffix, grad] : {std::pair{".lora_A", l->grad_A()}, std::pair{".lora_B", l->grad_B()}}) {
        const std::vector<float> want = r.read_vector<float>("grad." + l->path + suffix);
        const std::vector<float> got(grad.data(), grad.data() + grad.size());
        CAPTURE(l->path);
        const double e = max_diff(got, want) / std::max(max_abs(want), 1e-30);
        worst = std::max(worst, e);
        CHECK(e <= 1e-4);
      }
    MESSAGE(std::string(name) << ": LoRA gradients, worst max |memkit - PEFT| / max |PEFT| over the 28 tensors = " << worst);
  }
}

// The other direction: memkit trains an adapter (fp32 LoRA on qwen3_qknorm, 3 AdamW steps on the reference
// ids), writes it with peft::adapter_writer, and PEFT, loading it onto the transformers model, computes
// memkit's logits. The trained adapter and PEFT's logits for it are committed
// (tests/data/models/qwen3_qknorm/memkit_trained/, check_memkit_adapter.py): this test retrains and checks the
// adapter is the committed one, and that memkit's logits with it are PEFT's. MEMKIT_MODELS_EXPORT_DIR=DIR
// writes the adapter and memkit's logits there instead, for the script.
TEST_CASE("models: an adapter memkit trains, loaded by PEFT, gives memkit's logits") {
  const std::string name = "qwen3_qknorm", trained = models_dir + name + "/memkit_trained";
  const reference ref(name);
  tracked_memory m;
  llama::hf_checkpoint ckpt(models_dir + name, seq);
  llama::lora_load_options options = reference_lora_options();
  options.lora.init_seed = 2026;
  auto model = llama::load_lora_causal_lm<float, float>(memkit::host, ckpt, m.memory, options);
  // The adapters' A and B, registered by the model (its frozen base registers nothing).
  memkit::layers::parameter_registry<float> registry;
  model->register_parameters(registry);
  REQUIRE(registry.size() == 2 * model->linears().size());
  CHECK(registry.entries()[0].name == "model.layers.0.self_attn.q_proj.lora_A.weight");
  memkit::optim::adam_state<float> adam(memkit::host, m.tracker.category(memkit::memory_category::optimizer_state), registry.sizes());
  const std::vector<memkit::optim::adam_param<float, float>> params = registry.adam_params();
  const std::vector<memkit::optim::adam_group> groups = registry.adam_groups({.weight_decay = 0.0f}, 1e-2f);
  std::vector<float> losses;
  for (int step = 0; step < 3; ++step) {
    memkit::layers::zero_grad(memkit::host, registry);
    const float loss = next_token_pass(*model, ref.ids, m.activations());
    losses.push_back(loss);
    adam.step(memkit::host, params, groups);
  }
  CHECK(losses.back() < losses.front());
  const std::vector<float> logits = logits_of(*model, final_hidden<float>(*model, ref.ids, m.activations()));

  memkit::peft::lora_config config;
  config.r = 4;
  config.lora_alpha = 8;
  config.target_modules = memkit::peft::module_selector::of({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"});
  config.task_type = "CAUSAL_LM";
  if (const char* dir = std::getenv("MEMKIT_MODELS_EXPORT_DIR")) {
    memkit::peft::adapter_writer writer(config);
    for (llama::lora_projection<float, float>* l : model->linears())
      writer.add<float>(l->path, tensor_view<const float>(l->lora_A()), tensor_view<const float>(l->lora_B()));
    writer.write(dir);
    memkit::safetensors::writer out;
    out.add("logits", memkit::host_view(std::as_const(logits).data(), shape{batch, seq, model->config.vocab}));
    out.write(std::string(dir) + "/memkit_logits.safetensors");
    MESSAGE("wrote the adapter and memkit's logits to " << dir);
    return;
  }
  // Retraining gives the committed adapter (to fp32 rounding of a different host SIMD path).
  const memkit::peft::adapter_file committed(trained);
  double worst = 0;
  for (llama::lora_projection<float, float>* l : model->linears()) {
    const std::vector<float> a = committed.read<float>(std::string(memkit::peft::key_prefix) + l->path + ".lora_A.weight");
    const std::vector<float> b = committed.read<float>(std::string(memkit::peft::key_prefix) + l->path + ".lora_B.weight");
    const tensor_view<float> A = l->lora_A(), B = l->lora_B();
    worst = std::max({worst, max_diff(a, std::vector<float>(A.data(), A.data() + A.size())) / max_abs(a),
                      max_diff(b, std::vector<float>(B.data(), B.data() + B.size())) / max_abs(b)});
  }
  CHECK(worst <= 1e-4);
  // PEFT's logits with the committed adapter, and memkit's with the same adapter loaded from the file.
  auto fresh = llama::load_lora_causal_lm<float, float>(memkit::host, ckpt, m.memory, options);
  llama::load_peft_adapter(*fresh, trained);
  const std::vector<float> mine = logits_of(*fresh, final_hidden<float>(*fresh, ref.ids, m.activations()));
  const std::vector<float> peft = memkit::safetensors::reader(trained + "/peft_logits.safetensors").read_vector<float>("logits");
  const double err = max_diff(mine, peft);
  MESSAGE("memkit-trained adapter: max |memkit logit - PEFT logit| = " << err << " (max |logit| " << max_abs(peft)
          << "), retrained adapter vs committed: " << worst);
  CHECK(err <= 1e-4 * max_abs(peft));
  CHECK(max_diff(peft, ref.logits_fp32) > 0.01);  // the training moved the output
}

// QLoRA: the 16-bit checkpoint quantized to NF4 as it loads, and bitsandbytes' own 4-bit serialization of it
// (transformers + BitsAndBytesConfig, bnb4/), each with the PEFT adapter, against PEFT + bitsandbytes.
TEST_CASE("models: QLoRA from a 16-bit checkpoint and from bitsandbytes' 4-bit one gives PEFT + bitsandbytes' logits") {
  using nf4 = memkit::quant::quantized_tensor<memkit::quant::NF4>;
  for (const char* name : {"llama_tied_bf16", "qwen2_tied"}) {
    CAPTURE(name);
    const reference ref(name);
    memkit::safetensors::reader r(models_dir + name + "/reference.safetensors");
    const std::vector<float> bnb_base = r.read_vector<float>("logits_bnb4_fp32");
    const std::vector<float> bnb_qlora = r.read_vector<float>("logits_qlora_fp32");
    const llama::lora_load_options options = reference_lora_options();
    for (const std::string& dir : {models_dir + name, models_dir + name + "/bnb4"}) {
      CAPTURE(dir);
      tracked_memory m;
      llama::hf_checkpoint ckpt(dir, seq);
      CHECK(ckpt.prequantized() == (dir.find("bnb4") != std::string::npos));
      auto model = llama::load_lora_causal_lm<float, nf4>(memkit::host, ckpt, m.memory, options);
      // B is zero until the adapter loads: the base alone.
      const std::vector<float> base = logits_of(*model, final_hidden<float>(*model, ref.ids, m.activations()));
      llama::load_peft_adapter(*model, models_dir + name + "/adapter");
      const std::vector<float> adapted = logits_of(*model, final_hidden<float>(*model, ref.ids, m.activations()));
      const double base_err = max_diff(base, bnb_base), err = max_diff(adapted, bnb_qlora);
      MESSAGE(dir << ": NF4 base max |logit - bitsandbytes| = " << base_err << ", with the adapter vs PEFT + bitsandbytes "
                  << err << " (max |logit| " << max_abs(bnb_qlora) << ")");
      CHECK(base_err <= 1e-4 * max_abs(bnb_base));
      CHECK(err <= 1e-4 * max_abs(bnb_qlora));
      CHECK(max_diff(bnb_base, ref.logits_fp32) > 1e-3);  // NF4 is not the 16-bit model
      // No adapter anywhere: every projection is the frozen NF4 base alone (quant::matmul), the same logits.
      llama::lora_load_options none = options;
      none.targets = {};
      auto bare = llama::load_lora_causal_lm<float, nf4>(memkit::host, ckpt, m.memory, none);
      CHECK(max_diff(logits_of(*bare, final_hidden<float>(*bare, ref.ids, m.activations())), bnb_base) <= 1e-4 * max_abs(bnb_base));
      // The input gradient flows through frozen NF4 projections (quant::matmul_input_grad) to an adapter below them.
      none.targets = {"q_proj"};
      auto q_only = llama::load_lora_causal_lm<float, nf4>(memkit::host, ckpt, m.memory, none);
      const float loss = next_token_pass(*q_only, ref.ids, m.activations());
      CHECK(std::isfinite(loss));
      const tensor_view<float> g = q_only->linears()[0]->grad_B();
      CHECK(max_abs(std::vector<float>(g.data(), g.data() + g.size())) > 0);
    }
  }
  // An FP4 base (here without double quantization) quantizes from the 16-bit checkpoint too: further from the
  // fp32 logits than NF4's, and a bitsandbytes NF4 file does not load into them.
  {
    const reference ref("qwen2_tied");
    const std::vector<float> bnb_base =
        memkit::safetensors::reader(models_dir + "qwen2_tied/reference.safetensors").read_vector<float>("logits_bnb4_fp32");
    tracked_memory m;
    llama::lora_load_options options;
    options.targets = {};
    options.quant = {64, false};
    llama::hf_checkpoint ckpt(models_dir + "qwen2_tied", seq);
    using fp4 = memkit::quant::quantized_tensor<memkit::quant::FP4>;
    auto model = llama::load_lora_causal_lm<float, fp4>(memkit::host, ckpt, m.memory, options);
    const std::vector<float> logits = logits_of(*model, final_hidden<float>(*model, ref.ids, m.activations()));
    const double fp4_err = max_diff(logits, ref.logits_fp32), nf4_err = max_diff(bnb_base, ref.logits_fp32);
    MESSAGE("qwen2_tied, max |logit - fp32|: FP4 base " << fp4_err << ", NF4 base " << nf4_err);
    CHECK(fp4_err > 0);
    CHECK(fp4_err < 4 * nf4_err);
    const auto load_bnb_into_fp4 = [&] {
      return llama::load_lora_causal_lm<float, fp4>(memkit::host, llama::hf_checkpoint(models_dir + "qwen2_tied/bnb4", seq),
                                                    m.memory, options);
    };
    CHECK_THROWS_WITH_AS(load_bnb_into_fp4(),
                         doctest::Contains("a bitsandbytes NF4 checkpoint loads into a QLoRA model with an NF4 base"), memkit::error);
  }
  // A 4-bit checkpoint only loads as QLoRA; other quantizations are refused, naming the field.
  model_copy copy("qwen2_tied/bnb4", "bnb4");
  CHECK(load_error(copy.dir.string()).find("a bitsandbytes 4-bit checkpoint loads into a QLoRA model") != std::string::npos);
  copy.edit_config("\"bnb_4bit_quant_type\": \"nf4\"", "\"bnb_4bit_quant_type\": \"fp4\"");
  CHECK(load_error(copy.dir.string()).find("bnb_4bit_quant_type 'fp4' is not supported (supported: nf4)") != std::string::npos);
  copy.edit_config("\"load_in_8bit\": false", "\"load_in_8bit\": true");
  CHECK(load_error(copy.dir.string()).find("load_in_8bit: 8-bit bitsandbytes checkpoints are not supported") != std::string::npos);
}

TEST_CASE("models: a PEFT adapter on some projections (q_proj, v_proj; rank_pattern) loads; the rest stay the base alone") {
  for (const char* name : {"llama_llama3_bias", "qwen2_tied"}) {
    CAPTURE(name);
    const reference ref(name);
    const std::vector<float> want =
        memkit::safetensors::reader(models_dir + name + "/reference.safetensors").read_vector<float>("logits_lora_qv_fp32");
    tracked_memory m;
    llama::hf_checkpoint ckpt(models_dir + name, seq);
    const memkit::peft::adapter_file file(models_dir + name + "/adapter_qv");
    llama::lora_load_options options;
    options.adapter = &file;
    auto model = llama::load_lora_causal_lm<float, float>(memkit::host, ckpt, m.memory, options);
    int adapted = 0;
    for (llama::lora_projection<float, float>* l : model->linears()) {
      const bool v = l->path.find("v_proj") != std::string::npos, q = l->path.find("q_proj") != std::string::npos;
      CHECK(l->adapted() == (q || v));
      if (l->adapted()) CHECK(l->layer->rank() == (v ? 4 : 8));
      adapted += l->adapted();
    }
    CHECK(adapted == 2 * model->config.layers);
    llama::load_peft_adapter(*model, file);
    const std::vector<float> logits = logits_of(*model, final_hidden<float>(*model, ref.ids, m.activations()));
    const double err = max_diff(logits, want);
    MESSAGE(std::string(name) << ": q/v-only PEFT adapter, max |logit - PEFT| = " << err);
    CHECK(err <= 1e-4 * max_abs(want));
    // Training through the frozen projections: the adapted ones get gradients, the loss is the logits' loss.
    const float loss = next_token_pass(*model, ref.ids, m.activations());
    CHECK(std::isfinite(loss));
    for (llama::lora_projection<float, float>* l : model->linears())
      if (l->adapted()) CHECK(max_abs(std::vector<float>(l->grad_A().data(), l->grad_A().data() + l->grad_A().size())) > 0);
  }
  // A model adapted elsewhere does not take the file, either way round.
  tracked_memory m;
  llama::hf_checkpoint ckpt(models_dir + std::string("qwen2_tied"), seq);
  llama::lora_load_options all;
  all.lora.rank = 8;
  all.lora.alpha = 16;
  auto every = llama::load_lora_causal_lm<float, float>(memkit::host, ckpt, m.memory, all);
  CHECK_THROWS_WITH_AS(llama::load_peft_adapter(*every, models_dir + "qwen2_tied/adapter_qv"),
                       doctest::Contains("no adapter for module 'model.layers.0.self_attn.k_proj'"), memkit::error);
  llama::lora_load_options q_only = all;
  q_only.targets = {"q_proj"};
  auto fewer = llama::load_lora_causal_lm<float, float>(memkit::host, ckpt, m.memory, q_only);
  CHECK_THROWS_WITH_AS(llama::load_peft_adapter(*fewer, models_dir + "qwen2_tied/adapter_qv"),
                       doctest::Contains("adapts 'model.layers.0.self_attn.v_proj', which this model built without an adapter"),
                       memkit::error);
}

TEST_CASE("models: an adapter merged into the checkpoint (save_merged) loads as a dense model with PEFT's logits") {
  for (const char* name : {"qwen2_tied", "llama_llama3_bias"}) {
    CAPTURE(name);
    const reference ref(name);
    const std::vector<float> want =
        memkit::safetensors::reader(models_dir + name + "/reference.safetensors").read_vector<float>("logits_lora_fp32");
    const fs::path dir = fs::temp_directory_path() / ("memkit_merged_" + std::string(name) + "_" + std::to_string(::getpid()));
    tracked_memory m;
    {
      auto model = load_reference_adapter(name, m.memory);
      llama::save_merged(memkit::host, *model, models_dir + name + "/config.json", dir.string());
    }
    llama::hf_checkpoint merged(dir.string(), seq);
    auto dense = llama::load_causal_lm<float>(merged, m.memory);
    const double err = max_diff(logits_of(*dense, final_hidden<float>(*dense, ref.ids, m.activations())), want);
    MESSAGE(std::string(name) << ": merged checkpoint, max |logit - PEFT with the adapter| = " << err);
    CHECK(err <= 1e-4 * max_abs(want));
    fs::remove_all(dir);
  }
}

TEST_CASE("models: loading streams the checkpoint: the peak is the model plus one staging piece, said in advance") {
  for (const char* name : {"llama_llama3_bias", "llama_tied_bf16"})
    for (const auto mode : {memkit::layers::trainability::frozen, memkit::layers::trainability::bf16_master}) {
      CAPTURE(name);
      tracked_memory m;
      llama::hf_checkpoint ckpt(models_dir + name, seq);
      const std::size_t predicted = llama::loading_peak_bytes<memkit::bf16>(ckpt.config(), mode);
      auto model = llama::load_causal_lm<memkit::bf16>(ckpt, m.memory, mode);
      CHECK(m.tracker.peak_bytes() == predicted);
      CHECK(m.tracker.current_bytes() == llama::dense_model_bytes<memkit::bf16>(ckpt.config(), mode));
    }
}

TEST_CASE("models: a QLoRA load holds the quantized model plus one projection in T, said in advance") {
  using nf4 = memkit::quant::quantized_tensor<memkit::quant::NF4>;
  for (const char* name : {"llama_llama3_bias", "qwen2_tied", "qwen3_qknorm"}) {
    CAPTURE(name);
    tracked_memory m;
    llama::hf_checkpoint ckpt(models_dir + name, seq);
    llama::lora_load_options options;
    options.lora.rank = 4;
    const std::size_t predicted = llama::lora_loading_peak_bytes<memkit::bf16, nf4>(ckpt.config(), options);
    auto model = llama::load_lora_causal_lm<memkit::bf16, nf4>(memkit::host, ckpt, m.memory, options);
    CHECK(m.tracker.peak_bytes() == predicted);
    // Beyond what stays allocated: at most the largest projection in bf16 with its reader pieces and the
    // quantizer's workspace (never the 16-bit model).
    std::size_t beyond = 0;
    for (std::int64_t i = 0; i < ckpt.config().layers; ++i)
      for (const llama::projection& p : llama::projections_of(ckpt.config(), i)) {
        const shape w{p.out, p.in};
        beyond = std::max(beyond, memkit::buffer<memkit::bf16>::bytes_required(w) +
                                      std::max(llama::reading_staging_bytes<memkit::bf16>(w.numel()),
                                               nf4::bytes_required(w, options.quant) +
                                                   memkit::quant::workspace_bytes(memkit::quant::quantize_arguments{
                                                       nf4::quant_format, w, options.quant})));
      }
    CHECK(predicted - m.tracker.current_bytes() <= beyond);
  }
}

TEST_CASE("models: an unsupported or contradictory config.json is refused, naming the field") {
  const auto refused = [](const std::string& from, const std::string& to, const std::string& message,
                          const char* model = "qwen2_tied") {
    model_copy copy(model, "config");
    copy.edit_config(from, to);
    const std::string error = load_error(copy.dir.string());
    CAPTURE(error);
    CHECK(error.find(message) != std::string::npos);
  };
  refused("\"model_type\": \"qwen2\"", "\"model_type\": \"gpt2\"",
          "model_type 'gpt2' is not supported (supported: llama, mistral, qwen2, qwen3)");
  refused("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act 'gelu' is not supported (supported: silu)");
  refused("\"rope_type\": \"default\"", "\"rope_type\": \"yarn\"", "rope type 'yarn' is not supported (supported: default, llama3)");
  refused("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3", "num_attention_heads 4 is not a multiple of num_key_value_heads 3");
  refused("\"hidden_size\": 64", "\"hidden_size\": 1e12", "field 'hidden_size' is 1e12, outside 1..1048576");
  refused("\"vocab_size\": 128", "\"vocab_size\": -5", "field 'vocab_size' is -5, outside");
  refused("\"hidden_size\": 64", "\"hidden_size\": 64.5", "field 'hidden_size' must be an integer");
  refused("\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": \"small\"", "field 'rms_norm_eps' must be a positive finite number");
  refused("\"model_type\": \"qwen2\"", "\"quantization_config\": {}, \"model_type\": \"qwen2\"",
          "quant_method '' is not supported (supported: bitsandbytes with load_in_4bit and nf4)");
  // The config contradicts the tensors: each is named with both values.
  refused("\"intermediate_size\": 128", "\"intermediate_size\": 80",
          "tensor 'model.layers.0.mlp.gate_proj.weight' is [128, 64] in");
  refused("\"tie_word_embeddings\": true", "\"tie_word_embeddings\": false",
          "tensor 'lm_head.weight' [128, 64] is missing (config.json implies it: tie_word_embeddings is false)");
  refused("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1",
          "tensor 'model.layers.1.input_layernorm.weight' is not part of a 1-layer model of this config", "mistral_window");
  refused("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3", "tensor 'model.layers.2.input_layernorm.weight' [64] is missing",
          "mistral_window");
  refused("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3", "layer_types must list num_hidden_layers entries");
  refused("\"full_attention\"", "\"local_attention\"",
          "layer_types[0] is 'local_attention' (supported: full_attention, sliding_attention)", "qwen3_qknorm");
}

TEST_CASE("models: a missing, extra, misshapen, mistyped or non-finite tensor is refused, naming the key") {
  const auto refused = [](auto change, const std::string& message) {
    model_copy copy("qwen2_tied", "tensors");
    copy.rewrite_weights(change);
    const std::string error = load_error(copy.dir.string());
    CAPTURE(error);
    CHECK(error.find(message) != std::string::npos);
  };
  using bytes_t = std::vector<std::byte>;
  using dims_t = std::vector<std::int64_t>;
  refused([](std::string& n, std::string&, dims_t&, bytes_t&) { return n != "model.layers.1.self_attn.k_proj.bias"; },
          "tensor 'model.layers.1.self_attn.k_proj.bias' [32] is missing");
  refused([](std::string& n, std::string&, dims_t&, bytes_t&) {
            if (n == "model.norm.weight") n = "model.final_norm.weight";
            return true;
          },
          "tensor 'model.norm.weight' [64] is missing");
  refused([](std::string& n, std::string&, dims_t& d, bytes_t&) {
            if (n == "model.layers.0.self_attn.q_proj.weight") d = {32, 128};
            return true;
          },
          "tensor 'model.layers.0.self_attn.q_proj.weight' is [32, 128] in");
  refused([](std::string& n, std::string& t, dims_t&, bytes_t& b) {
            if (n == "model.layers.0.mlp.up_proj.weight") {
              t = "I32";
              b.resize(b.size());
            }
            return true;
          },
          "tensor 'model.layers.0.mlp.up_proj.weight' is I32 (supported: F32, BF16, F16)");
  refused([](std::string& n, std::string&, dims_t&, bytes_t& b) {
            if (n == "model.layers.1.mlp.down_proj.weight") {
              const float nan = std::nanf("");
              std::memcpy(b.data() + 4 * 77, &nan, 4);
            }
            return true;
          },
          "tensor 'model.layers.1.mlp.down_proj.weight' element 77 is NaN");
  {  // An extra tensor (tied embeddings with an lm_head.weight too).
    model_copy copy("qwen2_tied", "extra");
    memkit::safetensors::writer out;
    {
      memkit::safetensors::reader in((copy.dir / "model.safetensors").string());
      for (const memkit::safetensors::tensor_info& t : in.tensors()) {
        std::vector<std::byte> bytes(t.bytes());
        in.read_bytes(t.name, bytes.data(), bytes.size());
        out.add_bytes(t.name, t.dtype, t.shape, bytes.data(), bytes.size());
        if (t.name == "model.embed_tokens.weight") out.add_bytes("lm_head.weight", t.dtype, t.shape, bytes.data(), bytes.size());
      }
    }
    out.write((copy.dir / "model.safetensors").string());
    CHECK(load_error(copy.dir.string()).find("tensor 'lm_head.weight' is not part of a 2-layer model of this config "
                                             "(tie_word_embeddings is true)") != std::string::npos);
  }
}

TEST_CASE("models: a sharded checkpoint's index is checked: file names stay in the directory, every tensor is mapped once") {
  const auto refused = [](const std::string& from, const std::string& to, const std::string& message) {
    model_copy copy("llama_llama3_bias", "index");
    std::string index = copy.text("model.safetensors.index.json");
    const std::size_t at = index.find(from);
    REQUIRE(at != std::string::npos);
    index.replace(at, from.size(), to);
    copy.write("model.safetensors.index.json", index);
    const std::string error = load_error(copy.dir.string());
    CAPTURE(error);
    CHECK(error.find(message) != std::string::npos);
  };
  refused("\"model.norm.weight\": \"model-00005-of-00005.safetensors\"", "\"model.norm.weight\": \"../../etc/passwd\"",
          "weight_map['model.norm.weight'] = '../../etc/passwd' is not a file name in the checkpoint's directory");
  refused("\"lm_head.weight\": \"model-00005-of-00005.safetensors\"",
          "\"lm_head.weight\": \"model-00001-of-00005.safetensors\"", "maps 'lm_head.weight' to");
  refused("\"lm_head.weight\": \"model-00005-of-00005.safetensors\",", "",
          "holds 'lm_head.weight', which the index does not map to it");
  refused("\"weight_map\"", "\"weights\"", "no weight_map object");
}
