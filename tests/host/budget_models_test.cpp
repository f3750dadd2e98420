// One config.json per supported family (tests/data/configs/, see SOURCES there) read by memkit-budget's
// reader, its parameter count checked twice: exactly against the released checkpoint's tensor total
// (tests/data/configs/count_parameters.py builds each model from its config on PyTorch's meta device and
// counts every parameter once), and against the figure its authors published, to the published precision.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include <memkit/budget/estimate.hpp>
#include <memkit/budget/model.hpp>

#include "hf_config.hpp"

using namespace memkit::budget;

namespace {

std::string config_path(const std::string& file) {
  return std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/configs/" + file;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

model_config read_config(const std::string& file, const std::string& name) {
  return memkit_tools::model_from_hf_config(memkit::json::parse(slurp(config_path(file)), file), name);
}

model_config read_text(const std::string& json, const std::string& name) {
  return memkit_tools::model_from_hf_config(memkit::json::parse(json, "config.json"), name);
}

// A published figure such as "46.7e9": the exact count must round, or truncate (Qwen's cards write
// 7,615,616,512 as 7.61B), to it at the published precision. With unit 1 the two must be equal.
bool rounds_to(std::uint64_t exact, double published, double unit) {
  const double x = static_cast<double>(exact);
  return std::abs(x - published) <= unit / 2 || (x >= published && x < published + unit);
}

struct family_case {
  const char* file;
  std::uint64_t exact;       // tensor total of the released checkpoint (tied embeddings once)
  double published;          // as the source states it
  double published_unit;     // its last digit (1 when the source is exact)
  const char* source;
};

// What counts: every parameter of the base model (for encoders the BERT/RoBERTa model with its pooler;
// the MLM decoder is tied to the word embeddings). Where a source publishes non-embedding parameters,
// `published` is that figure and the test subtracts the embedding tables.
struct non_embedding_case {
  const char* file;
  double published;
  double published_unit;
  const char* source;
};

}  // namespace

TEST_CASE("budget models: every family's parameter count, exact and as published") {
  const family_case cases[] = {
      {"llama-2-7b.json", 6'738'415'616ull, 6.74e9, 0.01e9, "Hugging Face meta-llama/Llama-2-7b-hf, safetensors 6.74B"},
      {"llama-3-8b.json", 8'030'261'248ull, 8.03e9, 0.01e9, "meta-llama/Meta-Llama-3-8B, safetensors 8.03B"},
      {"llama-3.1-8b.json", 8'030'261'248ull, 8.03e9, 0.01e9, "meta-llama/Llama-3.1-8B, safetensors 8.03B"},
      {"llama-3.2-1b.json", 1'235'814'400ull, 1.24e9, 0.01e9, "meta-llama/Llama-3.2-1B model card: 1.23B (1.24B)"},
      {"llama-3.3-70b-instruct.json", 70'553'706'496ull, 70.6e9, 0.1e9, "meta-llama/Llama-3.3-70B-Instruct, 70.6B"},
      {"mistral-7b-v0.1.json", 7'241'732'096ull, 7.24e9, 0.01e9, "mistralai/Mistral-7B-v0.1, safetensors 7.24B"},
      {"mixtral-8x7b-v0.1.json", 46'702'792'704ull, 46.7e9, 0.1e9, "Mistral AI, Mixtral of experts: 46.7B total"},
      {"qwen-7b.json", 7'721'324'544ull, 7.72e9, 0.01e9, "Qwen/Qwen-7B, safetensors 7.72B"},
      {"qwen2.5-0.5b.json", 494'032'768ull, 0.49e9, 0.01e9, "Qwen/Qwen2.5-0.5B model card: 0.49B"},
      {"qwen2.5-7b.json", 7'615'616'512ull, 7.61e9, 0.01e9, "Qwen/Qwen2.5-7B model card: 7.61B"},
      {"qwen1.5-moe-a2.7b.json", 14'315'784'192ull, 14.3e9, 0.1e9, "Qwen1.5-MoE-A2.7B blog: 14.3B total"},
      {"qwen3-0.6b.json", 596'049'920ull, 0.6e9, 0.1e9, "Qwen/Qwen3-0.6B model card: 0.6B"},
      {"qwen3-30b-a3b.json", 30'532'122'624ull, 30.5e9, 0.1e9, "Qwen/Qwen3-30B-A3B model card: 30.5B"},
      {"gemma-2b.json", 2'506'172'416ull, 2.51e9, 0.01e9, "google/gemma-2b, safetensors 2.51B"},
      {"gemma-7b.json", 8'537'680'896ull, 8.54e9, 0.01e9, "google/gemma-7b, safetensors 8.54B"},
      {"gemma-2-2b.json", 2'614'341'888ull, 2.61e9, 0.01e9, "google/gemma-2-2b, safetensors 2.61B"},
      {"gemma-3-1b-pt.json", 999'885'952ull, 1.0e9, 0.01e9, "Gemma 3 report, Table 1: 302M embedding + 698M"},
      {"gemma-3-4b-it.json", 4'300'079'472ull, 4.3e9, 0.1e9, "google/gemma-3-4b-it, safetensors 4.3B"},
      {"phi-2.json", 2'779'683'840ull, 2.78e9, 0.01e9, "microsoft/phi-2, safetensors 2.78B (card: 2.7B)"},
      {"phi-3-mini-4k-instruct.json", 3'821'079'552ull, 3.8e9, 0.1e9, "Phi-3 technical report: 3.8B"},
      {"gpt2.json", 124'439'808ull, 124e6, 1e6, "openai-community/gpt2: 124M"},
      {"pythia-160m.json", 162'322'944ull, 162'322'944, 1, "Pythia paper (Biderman et al. 2023), Table 1"},
      {"pythia-1b.json", 1'011'781'632ull, 1'011'781'632, 1, "Pythia paper (Biderman et al. 2023), Table 1"},
      {"gpt-neox-20b.json", 20'554'567'680ull, 20'554'567'680, 1, "GPT-NeoX-20B paper (Black et al. 2022)"},
      {"stablelm-2-1_6b.json", 1'644'515'328ull, 1.64e9, 0.01e9, "stabilityai/stablelm-2-1_6b, safetensors 1.64B"},
      {"stablelm-3b-4e1t.json", 2'795'443'200ull, 2'795'443'200, 1, "stabilityai/stablelm-3b-4e1t model card"},
      {"falcon-7b.json", 6'921'720'704ull, 6.92e9, 0.01e9, "Falcon series report: Falcon-7B 6.92B (tied head once)"},
      {"falcon-40b.json", 41'303'293'952ull, 41.3e9, 0.1e9, "Falcon series report: Falcon-40B 41.3B"},
      {"falcon-rw-1b.json", 1'311'625'216ull, 1.3e9, 0.1e9, "tiiuae/falcon-rw-1b model card: 1.3B"},
      {"olmo-1b-hf.json", 1'176'764'416ull, 1.18e9, 0.01e9, "allenai/OLMo-1B-hf, safetensors 1.18B"},
      {"olmo-2-1124-7b.json", 7'298'617'344ull, 7.3e9, 0.1e9, "allenai/OLMo-2-1124-7B, 7.3B"},
      {"olmoe-1b-7b-0924.json", 6'919'161'856ull, 6.9e9, 0.1e9, "OLMoE paper (Muennighoff et al. 2024): 6.9B total"},
      {"bert-base-uncased.json", 109'482'240ull, 109e6, 1e6, "google-bert/bert-base-uncased BertModel: 109M"},
      {"roberta-base.json", 124'645'632ull, 125e6, 1e6, "RoBERTa (fairseq release): roberta.base 125M"},
  };
  for (const family_case& c : cases) {
    const std::string file = c.file, source = c.source;
    CAPTURE(file);
    CAPTURE(source);
    const model_config m = read_config(c.file, c.file);
    CHECK(m.valid());
    CHECK(parameter_count(m) == c.exact);
    CHECK(rounds_to(parameter_count(m), c.published, c.published_unit));
    if (!m.moe()) CHECK(active_parameter_count(m) == parameter_count(m));
  }
}

TEST_CASE("budget models: counts equal transformers' for every config (parameter_counts.txt)") {
  // count_parameters.py's output: "file<TAB>count" per config, "-" where transformers has no such model.
  std::istringstream table(slurp(config_path("parameter_counts.txt")));
  std::string line;
  int compared = 0;
  while (std::getline(table, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::size_t tab = line.find('\t');
    REQUIRE(tab != std::string::npos);
    const std::string file = line.substr(0, tab), count = line.substr(tab + 1);
    CAPTURE(file);
    if (count == "-") continue;
    CHECK(parameter_count(read_config(file, file)) == std::stoull(count));
    ++compared;
  }
  CHECK(compared >= 33);
}

TEST_CASE("budget models: BERT's published 110M includes its pre-training heads") {
  // BERT paper (Devlin et al. 2019): BERT-base, 110M. That figure counts BertForPreTraining: the MLM
  // transform (dense h x h with bias, LayerNorm), the MLM decoder's bias (its weight is tied) and the
  // next-sentence head (h -> 2). memkit budgets the encoder, whose count is the model above.
  const model_config bert = read_config("bert-base-uncased.json", "bert");
  const std::uint64_t h = bert.hidden;
  const std::uint64_t heads = (h * h + h + 2 * h) + bert.vocab + (2 * h + 2);
  CHECK(rounds_to(parameter_count(bert) + heads, 110e6, 1e6));
}

TEST_CASE("budget models: non-embedding counts published exactly") {
  // Gemma (Gemma Team 2024, Table 2) and Gemma 2 (2024, Table 2) publish non-embedding parameters
  // exactly; the Gemma paper's embedding column counts a padded 256,128-row table, the checkpoint has
  // 256,000 rows, so only the non-embedding figure is comparable.
  const non_embedding_case cases[] = {
      {"gemma-2b.json", 1'981'884'416, 1, "Gemma paper, Table 2: 2B non-embedding"},
      {"gemma-7b.json", 7'751'248'896, 1, "Gemma paper, Table 2: 7B non-embedding"},
      {"gemma-2-2b.json", 2'024'517'888, 1, "Gemma 2 paper, Table 2: 2B non-embedding"},
      {"gemma-3-1b-pt.json", 698e6, 1e6, "Gemma 3 report, Table 1: 1B non-embedding 698M"},
      {"qwen2.5-0.5b.json", 0.36e9, 0.01e9, "Qwen2.5-0.5B model card: 0.36B non-embedding"},
      {"qwen2.5-7b.json", 6.53e9, 0.01e9, "Qwen2.5-7B model card: 6.53B non-embedding"},
      {"qwen3-0.6b.json", 0.44e9, 0.01e9, "Qwen3-0.6B model card: 0.44B non-embedding"},
      {"qwen3-30b-a3b.json", 29.9e9, 0.1e9, "Qwen3-30B-A3B model card: 29.9B non-embedding"},
  };
  for (const non_embedding_case& c : cases) {
    const std::string file = c.file, source = c.source;
    CAPTURE(file);
    CAPTURE(source);
    const model_config m = read_config(c.file, c.file);
    std::uint64_t embedding = 0;
    for_each_parameter(m, [&](const parameter_tensor& t) {
      if (t.role == tensor_role::token_embedding || t.role == tensor_role::lm_head) embedding += t.total_elements();
    });
    CHECK(rounds_to(parameter_count(m) - embedding, c.published, c.published_unit));
  }
}

TEST_CASE("budget models: Gemma 3's image encoder is counted apart from its language model") {
  // Gemma 3 report (Gemma Team 2025), Table 1, 4B: vision encoder 417M, non-embedding 3,209M.
  const model_config m = read_config("gemma-3-4b-it.json", "gemma-3-4b");
  model_config text_only = m;
  text_only.vision = {};
  const std::uint64_t projector = m.vision.hidden * m.hidden + m.vision.hidden;  // projection and its RMSNorm
  CHECK(m.vision.patches() == 64 * 64);
  CHECK(rounds_to(parameter_count(m) - parameter_count(text_only) - projector, 417e6, 1e6));
  CHECK(rounds_to(parameter_count(text_only) - m.vocab * m.hidden, 3209e6, 1e6));
  // Absent text_config fields take Gemma3TextConfig's defaults: 8 heads, 4 key/value heads, head_dim 256.
  CHECK(m.heads == 8);
  CHECK(m.kv_heads == 4);
  CHECK(m.head_dim == 256);
  CHECK(m.vocab == 262208);
}

TEST_CASE("budget models: mixture of experts holds every expert, routes top-k") {
  struct moe_case {
    const char* file;
    std::uint64_t experts, top_k;
    double active, active_unit;
    const char* source;
  };
  const moe_case cases[] = {
      {"mixtral-8x7b-v0.1.json", 8, 2, 12.9e9, 0.1e9, "Mixtral of experts: 12.9B active per token"},
      {"qwen1.5-moe-a2.7b.json", 60, 4, 2.7e9, 0.1e9, "Qwen1.5-MoE-A2.7B: 2.7B activated"},
      {"qwen3-30b-a3b.json", 128, 8, 3.3e9, 0.1e9, "Qwen3-30B-A3B model card: 3.3B activated"},
      {"olmoe-1b-7b-0924.json", 64, 8, 1.3e9, 0.1e9, "OLMoE paper: 1.3B active"},
  };
  for (const moe_case& c : cases) {
    const std::string file = c.file, source = c.source;
    CAPTURE(file);
    CAPTURE(source);
    const model_config m = read_config(c.file, c.file);
    REQUIRE(m.moe());
    CHECK(m.experts == c.experts);
    CHECK(m.experts_per_token == c.top_k);
    CHECK(rounds_to(active_parameter_count(m), c.active, c.active_unit));
    CHECK(m.mlp_activation_width() == c.top_k * m.expert_intermediate + m.shared_expert_intermediate);
  }
  // Mixtral: all eight experts' w1/w2/w3 in memory, the router h -> 8, and no dense MLP besides.
  const model_config mixtral = read_config("mixtral-8x7b-v0.1.json", "mixtral");
  const model_config mistral = read_config("mistral-7b-v0.1.json", "mistral");
  const std::uint64_t expert = 3ull * 4096 * 14336;
  CHECK(parameter_count(mixtral) - parameter_count(mistral) == 32 * (7 * expert + 4096 * 8));
  // LoRA on every expert's projections: PEFT wraps each expert's linear.
  const auto mlp = static_cast<module_set>(linear_module::gate | linear_module::up | linear_module::down);
  CHECK(lora_parameter_count(mixtral, 8, mlp) == 8 * lora_parameter_count(mistral, 8, mlp));
  // Qwen1.5-MoE: a shared expert of 5632 and its sigmoid gate beside 60 experts of 1408.
  const model_config qwen_moe = read_config("qwen1.5-moe-a2.7b.json", "qwen-moe");
  CHECK(qwen_moe.shared_expert_intermediate == 5632);
  CHECK(qwen_moe.shared_expert_gate);
  CHECK(qwen_moe.mlp_activation_width() == 4 * 1408 + 5632);
  // The budget keeps all experts' weights: a bf16 MoE needs at least two bytes per parameter.
  training_plan plan{.training = method::lora, .precision = precision_mode::bf16, .micro_batch = 1, .sequence = 512};
  const memory_estimate e = estimate_memory(mixtral, plan);
  REQUIRE(e.valid());
  CHECK(e.device[category::weights] >= 2 * parameter_count(mixtral));
}

TEST_CASE("budget models: each switch moves the count by exactly its tensors") {
  const std::string base = R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100)";
  const std::uint64_t L = 3, h = 64, kv = 32, f = 96, V = 100;
  const std::uint64_t plain = parameter_count(read_text(base + "}", "plain"));
  CHECK(plain == L * (h * h + 2 * h * kv + h * h + 3 * h * f + 2 * h) + 2 * V * h + h);
  CHECK(parameter_count(read_text(base + R"(, "tie_word_embeddings": true})", "tied")) == plain - V * h);
  CHECK(parameter_count(read_text(base + R"(, "attention_bias": true})", "bias")) == plain + L * (h + 2 * kv + h));
  CHECK(parameter_count(read_text(base + R"(, "mlp_bias": true})", "mlp bias")) == plain + L * (2 * f + h));
  const std::string qwen2 = R"({"model_type": "qwen2")" + base.substr(base.find(','));
  CHECK(parameter_count(read_text(qwen2 + "}", "qwen2")) == plain + L * (h + 2 * kv));
  const std::string qwen3 = R"({"model_type": "qwen3")" + base.substr(base.find(','));
  CHECK(parameter_count(read_text(qwen3 + "}", "qwen3")) == plain + L * 2 * (h / 4));  // q/k norm per head
  const std::string olmo = R"({"model_type": "olmo")" + base.substr(base.find(','));
  CHECK(parameter_count(read_text(olmo + "}", "olmo")) == plain - 2 * L * h - h);  // no norm weights
  const std::string olmo2 = R"({"model_type": "olmo2")" + base.substr(base.find(','));
  CHECK(parameter_count(read_text(olmo2 + "}", "olmo2")) == plain + L * (h + kv));  // q/k norms, full width
  const std::string gemma2 = R"({"model_type": "gemma2")" + base.substr(base.find(','));
  CHECK(parameter_count(read_text(gemma2 + "}", "gemma2")) == plain + 2 * L * h - V * h);  // 4 norms, tied
  const std::string stablelm = R"({"model_type": "stablelm")" + base.substr(base.find(','));
  CHECK(parameter_count(read_text(stablelm + "}", "stablelm")) == plain + 2 * L * h + h);  // LayerNorm biases
}

TEST_CASE("budget models: unknown model types and unmodeled layouts are refused by name") {
  try {
    read_text(R"({"model_type": "mamba", "hidden_size": 64})", "mamba");
    FAIL("mamba accepted");
  } catch (const memkit::error& e) {
    const std::string message = e.what();
    CHECK(message.find("unsupported model_type 'mamba'") != std::string::npos);
    for (const char* family : {"llama", "mixtral", "qwen3_moe", "gemma3_text", "phi", "gpt_neox", "falcon", "olmoe", "bert"})
      CHECK_MESSAGE(message.find(family) != std::string::npos, family);
  }
  // Expert and dense blocks mixed: refused rather than counted wrong.
  const std::string moe = R"({"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "vocab_size": 100, "num_experts": 8, "moe_intermediate_size": 32)";
  const std::string top2 = R"(, "num_experts_per_tok": 2)";
  CHECK(read_text(moe + top2 + "}", "moe").experts == 8);
  CHECK_THROWS_WITH_AS(read_text(moe + top2 + R"(, "decoder_sparse_step": 2})", "moe"),
                       doctest::Contains("decoder_sparse_step"), memkit::error);
  CHECK_THROWS_WITH_AS(read_text(moe + top2 + R"(, "mlp_only_layers": [0]})", "moe"),
                       doctest::Contains("mlp_only_layers"), memkit::error);
  CHECK_THROWS_WITH_AS(read_text(moe + R"(, "num_experts_per_tok": 9})", "moe"), doctest::Contains("experts_per_token"),
                       memkit::error);
}
