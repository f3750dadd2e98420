// memory_budget's ZeRO-3 terms against distributed::sharded_dense / sharded_quantized: the per-rank weight
// bytes are the sum of the shards' shard_bytes over a model's real tensors (listed here by name and shape from
// its config.json, not from the budget's own tensor walk), and a tracking_resource holding real shards of a
// small model counts exactly that.
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <memkit/budget/estimate.hpp>
#include <memkit/distributed/sharded_parameters.hpp>
#include <memkit/memory/tracking.hpp>

#include "hf_config.hpp"

using namespace memkit::budget;
using memkit::shape;
namespace dist = memkit::distributed;
namespace q = memkit::quant;

namespace {

// One tensor of a Llama checkpoint: its shape, whether it is a block's projection (quantized under QLoRA,
// gets LoRA adapters), and whether it belongs to a block.
struct llama_tensor {
  std::string name;
  shape dims;
  bool projection = false;
  bool in_block = false;
};

// The tensors of a Hugging Face LlamaForCausalLM, from its config.json fields.
std::vector<llama_tensor> llama_tensors(const memkit::json::value& c) {
  const std::int64_t h = c.at("hidden_size").as_int(), L = c.at("num_hidden_layers").as_int();
  const std::int64_t H = c.at("num_attention_heads").as_int(), kv = c.at("num_key_value_heads").as_int();
  const std::int64_t d = c.find("head_dim") ? c.at("head_dim").as_int() : h / H;
  const std::int64_t ffn = c.at("intermediate_size").as_int(), V = c.at("vocab_size").as_int();
  std::vector<llama_tensor> out{{"model.embed_tokens.weight", shape{V, h}}};
  for (std::int64_t i = 0; i < L; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    out.push_back({p + "input_layernorm.weight", shape{h}, false, true});
    out.push_back({p + "self_attn.q_proj.weight", shape{H * d, h}, true, true});
    out.push_back({p + "self_attn.k_proj.weight", shape{kv * d, h}, true, true});
    out.push_back({p + "self_attn.v_proj.weight", shape{kv * d, h}, true, true});
    out.push_back({p + "self_attn.o_proj.weight", shape{h, H * d}, true, true});
    out.push_back({p + "post_attention_layernorm.weight", shape{h}, false, true});
    out.push_back({p + "mlp.gate_proj.weight", shape{ffn, h}, true, true});
    out.push_back({p + "mlp.up_proj.weight", shape{ffn, h}, true, true});
    out.push_back({p + "mlp.down_proj.weight", shape{h, ffn}, true, true});
  }
  out.push_back({"model.norm.weight", shape{h}});
  if (!c.at("tie_word_embeddings").as_bool()) out.push_back({"lm_head.weight", shape{V, h}});
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

constexpr std::int64_t lora_rank = 16;

training_plan qlora_zero3(std::uint64_t gpus, bool double_quant) {
  training_plan p{.training = method::lora, .weights = {weight_format::nf4, 64, double_quant}, .lora = {lora_rank},
                  .gpus = gpus, .zero_stage = 3, .overhead = host_overhead};  // 1-byte granularity: exact bytes
  return p;
}

// Per rank: the NF4 shard of every projection, the bf16 shard of everything else, and of each LoRA A / B.
std::uint64_t sum_of_shard_bytes(const std::vector<llama_tensor>& tensors, int ranks, const q::quant_options& o) {
  std::uint64_t sum = 0;
  for (const llama_tensor& t : tensors) {
    if (!t.projection) {
      sum += dist::sharded_dense<memkit::bf16>::shard_bytes(t.dims, ranks);
      continue;
    }
    sum += dist::sharded_quantized<q::NF4>::shard_bytes(t.dims, o, ranks);
    sum += dist::sharded_dense<memkit::bf16>::shard_bytes(shape{lora_rank, t.dims[1]}, ranks);  // A
    sum += dist::sharded_dense<memkit::bf16>::shard_bytes(shape{t.dims[0], lora_rank}, ranks);  // B
  }
  return sum;
}

}  // namespace

TEST_CASE("budget ZeRO-3: per-rank weight shards are sharded_parameters' shard_bytes over Llama-3.2-1B's tensors") {
  const std::string file = std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/configs/llama-3.2-1b.json";
  const memkit::json::value config = memkit::json::parse(slurp(file), file);
  const model_config m = memkit_tools::model_from_hf_config(config, "llama-3.2-1b");
  const std::vector<llama_tensor> tensors = llama_tensors(config);
  REQUIRE(tensors.size() == 2 + 16 * 9);  // tied: no lm_head
  for (const bool nested : {true, false})
    for (const int ranks : {2, 3, 4, 7}) {
      CAPTURE(nested);
      CAPTURE(ranks);
      const training_plan p = qlora_zero3(static_cast<std::uint64_t>(ranks), nested);
      const detail::stage3_totals stage3 = detail::stage3_weight_bytes(m, p);
      const q::quant_options o{64, nested};
      CHECK(stage3.shards == sum_of_shard_bytes(tensors, ranks, o));
      // Gathered: whole tensors of the units in flight. The tied embedding (bf16, 128256 x 2048) dwarfs a
      // block, so with prefetch the peak pair is the embedding and block 0 (or the last block and the head).
      std::uint64_t block = 0;
      for (const llama_tensor& t : tensors) {
        if (t.name.rfind("model.layers.0.", 0) != 0) continue;
        if (!t.projection) {
          block += 2 * static_cast<std::uint64_t>(t.dims.numel());
          continue;
        }
        block += q::quantized_tensor<q::NF4>::bytes_required(t.dims, o);
        block += 2 * static_cast<std::uint64_t>(lora_rank * (t.dims[0] + t.dims[1]));
      }
      const std::uint64_t embedding = 2ull * 128256 * 2048, norm = 2 * 2048;
      CHECK(stage3.gathered == block + embedding + norm);  // the last block + final norm + the tied head
      training_plan one_at_a_time = p;
      one_at_a_time.gather_prefetch = false;
      CHECK(detail::stage3_weight_bytes(m, one_at_a_time).gathered == embedding + norm);
      // Staging: one gather's receive buffer, the largest tensor's (the embedding's shards of every rank).
      CHECK(stage3.staging == dist::sharded_dense<memkit::bf16>::gather_workspace_bytes(shape{128256, 2048}, ranks));
      // The estimate charges exactly these: weights = shards + gathered in every phase.
      const memory_estimate e = estimate_memory(m, p);
      REQUIRE(e.valid());
      for (const breakdown& phase : e.phases) CHECK(phase[category::weights] == stage3.shards + stage3.gathered);
      // About 1/ranks of the unsharded weights: a little less (each tensor's double-quantization offset is a
      // member of the shard, not an allocation), or a little more (the last ranks' padding, up to one unit per
      // tensor: with double quantization a nested group of 16384 elements; measured +0.33% on 7 ranks).
      const memory_estimate single = estimate_memory(m, qlora_zero3(1, nested));
      const double share = double(stage3.shards) * ranks / double(single.phases[0][category::weights]);
      CHECK(share > 0.999);
      CHECK(share < 1.005);
    }
}

// The stage-3 terms are constexpr like the rest of the estimate (static_assert(memkit::fits(...)) works with them).
static_assert(estimate_memory(presets::llama_3_1_70b, {.training = method::lora, .weights = {weight_format::nf4, 64, true},
                                                       .gpus = 4, .zero_stage = 3})
                  .valid());
static_assert(detail::stage3_weight_bytes(presets::llama_3_1_70b, {.training = method::lora, .weights = {weight_format::nf4, 64, true},
                                                                   .gpus = 4, .zero_stage = 3})
                  .shards > 0);

TEST_CASE("budget ZeRO-3: a tracker holding every real shard of a small Llama counts the budget's shard bytes") {
  // Small enough to quantize and shard in milliseconds; untied, so the head is its own tensor.
  const std::string json = R"({"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 320, "vocab_size": 1000,
    "max_position_embeddings": 256, "tie_word_embeddings": false})";
  const memkit::json::value config = memkit::json::parse(json, "config.json");
  const model_config m = memkit_tools::model_from_hf_config(config, "tiny-llama");
  const std::vector<llama_tensor> tensors = llama_tensors(config);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const bool nested : {true, false})
    for (const int ranks : {2, 3}) {
      CAPTURE(nested);
      CAPTURE(ranks);
      const q::quant_options o{64, nested};
      for (int rank = 0; rank < ranks; ++rank) {
        memkit::tracking_resource tracker(memkit::default_host_resource(), "zero3");
        memkit::memory_resource& weights = tracker.category(memkit::memory_category::weights);
        std::vector<dist::sharded_dense<memkit::bf16>> dense;
        std::vector<dist::sharded_quantized<q::NF4>> quantized;
        auto add_dense = [&](const shape& dims) {
          std::vector<memkit::bf16> v;
          for (std::int64_t i = 0; i < dims.numel(); ++i) v.emplace_back(normal(rng));
          dense.emplace_back(memkit::tensor_view<const memkit::bf16>(v.data(), dims, memkit::memory_kind::host), rank, ranks, weights);
        };
        for (const llama_tensor& t : tensors) {
          if (!t.projection) {
            add_dense(t.dims);
            continue;
          }
          std::vector<float> v(static_cast<std::size_t>(t.dims.numel()));
          for (float& x : v) x = normal(rng);
          const auto whole = q::quantized_tensor<q::NF4>::quantize(memkit::host, memkit::host_view(v.data(), t.dims), o,
                                                                   memkit::default_host_resource());
          quantized.emplace_back(whole, rank, ranks, weights);
          add_dense(shape{lora_rank, t.dims[1]});
          add_dense(shape{t.dims[0], lora_rank});
        }
        CHECK(tracker.current_bytes() == detail::stage3_weight_bytes(m, qlora_zero3(static_cast<std::uint64_t>(ranks), nested)).shards);
      }
    }
}
