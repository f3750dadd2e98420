// The sequence-tiled MLP of memkit/models/llama/block.hpp (decoder_block::mlp_token_chunk) against the untiled
// one: the loss, every input gradient and every parameter gradient outside the MLP's projections are
// bit-identical (each row's math is unchanged); the gate/up/down weight and adapter gradients, summed chunk by
// chunk into fp32, differ only in summation order, within a stated fp32 bound. Dense (dense_linear, with MLP
// biases) and QLoRA (LoRA over NF4) models from tests/data/models, chunks of 1, 7 (odd, not dividing), all and
// more than all tokens; a block under checkpoint::segment; and the byte functions against a tracking_resource.
#include <memkit/layers/parameters.hpp>
#include <memkit/models/llama/load.hpp>

#include <memkit/checkpoint/segment.hpp>
#include <memkit/memory/tracking.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "support/tracked_memory.hpp"

namespace llama = memkit::models::llama;

namespace {

using memkit::shape;
using memkit::tensor_view;

const std::string models_dir = std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/models/";
constexpr std::int64_t batch = 2, seq = 16, tokens = batch * seq;
// The chunks: one token, an odd chunk that leaves a remainder (32 = 4 * 7 + 4), all tokens, more than all.
constexpr std::int64_t chunks[] = {1, 7, tokens, 50};
// fp32 gradients of the MLP's weights summed over 32 tokens in other groupings: a few units in the last place
// of the largest element.
constexpr double mlp_weight_grad_bound = 1e-6;

struct tracked_memory : memkit_test::tracked_memory {
  tracked_memory() : memkit_test::tracked_memory("tiled-mlp") {}
};

struct pass_result {
  float loss = 0;
  std::vector<std::string> names;
  std::vector<std::vector<float>> grads;  // registration order
};

// One forward_backward on the reference ids with next-token targets, gradients from zero.
template <class Model>
pass_result run_pass(Model& model, memkit::memory_resource& saved, std::int64_t chunk) {
  memkit::safetensors::reader r(models_dir + "qwen2_tied/reference.safetensors");
  std::vector<std::int32_t> ids = r.read_vector<std::int32_t>("ids");
  for (std::int32_t& id : ids) id %= static_cast<std::int32_t>(model.config.vocab);
  std::vector<std::int32_t> targets(ids.size(), -100);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s + 1 < seq; ++s) targets[b * seq + s] = ids[b * seq + s + 1];
  memkit::layers::parameter_registry<float> registry;
  model.register_parameters(registry);
  memkit::layers::zero_grad(memkit::host, registry);
  model.set_mlp_token_chunk(chunk);
  pass_result out;
  model.forward_backward(memkit::host, memkit::host_view(std::as_const(ids).data(), shape{batch, seq}),
                         memkit::host_view(std::as_const(targets).data(), shape{batch, seq}),
                         memkit::host_view(&out.loss, shape{1}), saved);
  for (const auto& e : registry.entries()) {
    out.names.push_back(e.name);
    out.grads.emplace_back(e.grad.data(), e.grad.data() + e.grad.size());
  }
  return out;
}

bool is_mlp_weight(const std::string& name) {
  const bool mlp = name.find(".mlp.") != std::string::npos;
  return mlp && name.find(".bias") == std::string::npos;  // biases sum their rows in order: bit-identical
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

// Tiled against untiled, for every chunk: the loss and non-MLP gradients bit for bit, the MLP's weights
// within the bound (and the chunked runs must actually differ somewhere, or the test would not see tiling).
template <class Model>
void compare_tiled(Model& model, memkit::memory_resource& saved, const char* what) {
  const pass_result plain = run_pass(model, saved, 0);
  REQUIRE(!plain.grads.empty());
  for (const std::int64_t chunk : chunks) {
    CAPTURE(chunk);
    const pass_result tiled = run_pass(model, saved, chunk);
    CHECK(tiled.loss == plain.loss);
    REQUIRE(tiled.names == plain.names);
    double worst = 0;
    int mlp_tensors = 0;
    for (std::size_t i = 0; i < plain.grads.size(); ++i) {
      CAPTURE(plain.names[i]);
      CHECK(max_abs(plain.grads[i]) > 0);  // every parameter is exercised
      if (is_mlp_weight(plain.names[i])) {
        const double e = max_diff(tiled.grads[i], plain.grads[i]) / max_abs(plain.grads[i]);
        worst = std::max(worst, e);
        CHECK(e <= mlp_weight_grad_bound);
        ++mlp_tensors;
      } else {
        CHECK(tiled.grads[i] == plain.grads[i]);
      }
    }
    CHECK(mlp_tensors > 0);
    if (chunk < tokens) CHECK(worst > 0);  // more than one chunk: the sums really were split
    MESSAGE(std::string(what) << ", chunk " << chunk << ": loss " << tiled.loss << " (untiled " << plain.loss
                 << "), worst max |tiled - untiled| / max |untiled| over the MLP's weight gradients = " << worst);
  }
  model.set_mlp_token_chunk(0);
}

}  // namespace

TEST_CASE("tiled MLP: a dense model's loss and gradients equal the untiled ones (MLP weights to summation order)") {
  tracked_memory m;
  llama::hf_checkpoint ckpt(models_dir + "llama_llama3_bias", seq);  // MLP biases: their gradients too
  auto model = llama::load_causal_lm<float>(ckpt, m.memory, memkit::layers::trainability::bf16_master);
  REQUIRE(model->config.mlp_bias);
  compare_tiled(*model, m.activations(), "dense llama_llama3_bias");
  // The embedding's gradient is the sum of the input gradients of block 0: bit-identical means they are.
}

TEST_CASE("tiled MLP: a QLoRA model's loss and adapter gradients equal the untiled ones (MLP adapters to summation order)") {
  using nf4 = memkit::quant::quantized_tensor<memkit::quant::NF4>;
  tracked_memory m;
  llama::hf_checkpoint ckpt(models_dir + "qwen2_tied", seq);
  llama::lora_load_options options;
  options.lora.rank = 4;
  options.lora.alpha = 8;
  auto model = llama::load_lora_causal_lm<float, nf4>(memkit::host, ckpt, m.memory, options);
  llama::load_peft_adapter(*model, models_dir + "qwen2_tied/adapter");  // B != 0: A's gradients are not zero
  compare_tiled(*model, m.activations(), "QLoRA qwen2_tied");
}

TEST_CASE("tiled MLP: a negative chunk is refused") {
  tracked_memory m;
  llama::hf_checkpoint ckpt(models_dir + "qwen2_tied", seq);
  auto model = llama::load_causal_lm<float>(ckpt, m.memory);
  CHECK_THROWS_WITH_AS(model->set_mlp_token_chunk(-3), doctest::Contains("must be 0 (untiled) or positive, got -3"),
                       memkit::error);
  model->blocks[0].mlp_token_chunk = -1;
  std::vector<float> x(static_cast<std::size_t>(tokens * model->config.hidden)), y(x.size());
  memkit::activation_store store(m.activations());
  const shape in{batch, seq, model->config.hidden};
  CHECK_THROWS_WITH_AS(model->blocks[0].forward(memkit::host, {}, memkit::host_view(std::as_const(x).data(), in),
                                                memkit::host_view(y.data(), in), store),
                       doctest::Contains("mlp_token_chunk must be 0 (untiled) or a positive number of tokens, got -1"),
                       memkit::error);
}

// One block's forward and backward, tiled or not: what it saves and the workspace it holds, measured by the
// tracking_resource, against saved_bytes() and workspace_bytes().
template <class Block>
void block_bytes(Block& block, memkit::tracking_resource& tracker, const char* what) {
  const shape in{batch, seq, block.config.hidden};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(in.numel())), y(x.size()), dx(x.size());
  for (float& v : x) v = normal(rng);
  std::vector<float> y_untiled, dx_untiled;
  for (const std::int64_t chunk : {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, tokens, std::int64_t{50}}) {
    CAPTURE(chunk);
    block.mlp_token_chunk = chunk;
    memkit::activation_store store(tracker.category(memkit::memory_category::activations));
    tracker.reset_peak();
    block.forward(memkit::host, {}, memkit::host_view(std::as_const(x).data(), in), memkit::host_view(y.data(), in), store);
    CHECK(store.bytes() == block.saved_bytes(in, {}));
    const std::size_t forward_workspace = tracker.stats(memkit::memory_category::workspace).peak_bytes;
    tracker.reset_peak();
    block.backward(memkit::host, memkit::host_view(std::as_const(y).data(), in), memkit::host_view(dx.data(), in), store);
    CHECK(store.empty());
    const std::size_t backward_workspace = tracker.stats(memkit::memory_category::workspace).peak_bytes;
    // The block's output and input gradient (dy = y here) row by row as untiled: bit for bit.
    if (chunk == 0) {
      y_untiled = y;
      dx_untiled = dx;
    } else {
      CHECK(y == y_untiled);
      CHECK(dx == dx_untiled);
    }
    CHECK(tracker.stats(memkit::memory_category::activations).peak_bytes == block.saved_bytes(in, {}));
    MESSAGE(std::string(what) << " chunk " << chunk << ": saved " << block.saved_bytes(in, {}) << ", workspace measured forward "
                 << forward_workspace << " backward " << backward_workspace << ", stated " << block.workspace_bytes(in)
                 << " (scratch " << block.forward_scratch_bytes(in) << " / " << block.backward_scratch_bytes(in) << ")");
    CHECK(std::max(forward_workspace, backward_workspace) == block.workspace_bytes(in));
    if (chunk == 0) continue;
    // The MLP phase alone (one chunk's recompute and backward, as the tiled backward runs it), whose peak here
    // sits below the attention's: the sub-layers' saved tensors plus one projection's workspace, exactly.
    const std::int64_t rows = block.mlp_rows(in), h = block.config.hidden, f = block.config.intermediate;
    std::vector<float> xc(static_cast<std::size_t>(rows * h)), gu(static_cast<std::size_t>(rows * 2 * f)),
        a(static_cast<std::size_t>(rows * f)), yc(xc.size()), dxc(xc.size()), partial(xc.size());
    std::copy_n(x.begin(), xc.size(), xc.begin());
    memkit::activation_store chunk_store(tracker.category(memkit::memory_category::workspace));
    tracker.reset_peak();
    block.mlp_forward(memkit::host, {}, memkit::host_view(std::as_const(xc).data(), shape{rows, h}),
                      memkit::host_view(gu.data(), shape{rows * 2 * f}), memkit::host_view(a.data(), shape{rows * f}),
                      memkit::host_view(yc.data(), shape{rows, h}), chunk_store);
    block.mlp_backward(memkit::host, memkit::host_view(std::as_const(yc).data(), shape{rows, h}),
                       memkit::host_view(a.data(), shape{rows * f}), memkit::host_view(gu.data(), shape{rows * 2 * f}),
                       memkit::host_view(dxc.data(), shape{rows, h}), memkit::host_view(partial.data(), shape{rows, h}),
                       chunk_store);
    CHECK(chunk_store.empty());
    CHECK(tracker.stats(memkit::memory_category::workspace).peak_bytes == block.mlp_workspace_bytes(in));
  }
  block.mlp_token_chunk = 0;
}

TEST_CASE("tiled MLP: a block saves what saved_bytes states and holds the workspace_bytes it states") {
  tracked_memory m;
  llama::hf_checkpoint ckpt(models_dir + "llama_llama3_bias", seq);
  auto dense = llama::load_causal_lm<float>(ckpt, m.memory, memkit::layers::trainability::bf16_master);
  block_bytes(dense->blocks[0], m.tracker, "dense");
  using nf4 = memkit::quant::quantized_tensor<memkit::quant::NF4>;
  llama::lora_load_options options;
  options.lora.rank = 4;
  auto qlora = llama::load_lora_causal_lm<float, nf4>(memkit::host, ckpt, m.memory, options);
  block_bytes(qlora->blocks[0], m.tracker, "QLoRA");
}

namespace {
// Every gradient of a dense block (llama_llama3_bias: every projection has a bias), named.
template <class Block>
std::vector<std::pair<std::string, std::vector<float>>> block_grads(Block& b) {
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (memkit::layers::basic_parameter<float>* p :
       {&b.attn_norm.weight, &b.mlp_norm.weight, &b.q.weight, &b.q.bias, &b.k.weight, &b.k.bias, &b.v.weight, &b.v.bias,
        &b.o.weight, &b.o.bias, &b.gate.weight, &b.gate.bias, &b.up.weight, &b.up.bias, &b.down.weight, &b.down.bias})
    out.emplace_back(p->name, std::vector<float>(p->grad.data(), p->grad.data() + p->grad.size()));
  return out;
}
}  // namespace

// checkpoint::segment drops the tiled block's saved tensors (n2 among them) and recomputes its forward before
// the backward, which recomputes each MLP chunk again: the same gradients as the taped untiled stack.
TEST_CASE("tiled MLP: checkpointed tiled blocks give the plain stack's gradients") {
  tracked_memory m;
  llama::hf_checkpoint ckpt(models_dir + "llama_llama3_bias", seq);
  auto plain = llama::load_causal_lm<float>(ckpt, m.memory, memkit::layers::trainability::bf16_master);
  auto taped_tiled = llama::load_causal_lm<float>(ckpt, m.memory, memkit::layers::trainability::bf16_master);
  auto checkpointed = llama::load_causal_lm<float>(ckpt, m.memory, memkit::layers::trainability::bf16_master);
  taped_tiled->set_mlp_token_chunk(7);
  checkpointed->set_mlp_token_chunk(7);
  const shape in{batch, seq, plain->config.hidden};
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(in.numel())), r(x.size());
  for (float& v : x) v = normal(rng);
  for (float& v : r) v = normal(rng);
  // Taped: blocks 0 and 1 forward, then backward.
  const auto taped = [&](auto& model, std::vector<float>& y, std::vector<float>& dx) {
    std::vector<float> h(x.size()), dh(x.size());
    memkit::activation_store store(m.activations());
    auto& b0 = model.blocks[0];
    auto& b1 = model.blocks[1];
    b0.forward(memkit::host, {}, memkit::host_view(std::as_const(x).data(), in), memkit::host_view(h.data(), in), store);
    b1.forward(memkit::host, {}, memkit::host_view(std::as_const(h).data(), in), memkit::host_view(y.data(), in), store);
    b1.backward(memkit::host, memkit::host_view(std::as_const(r).data(), in), memkit::host_view(dh.data(), in), store);
    b0.backward(memkit::host, memkit::host_view(std::as_const(dh).data(), in), memkit::host_view(dx.data(), in), store);
  };
  std::vector<float> y_plain(x.size()), dx_plain(x.size()), y_tiled(x.size()), dx_tiled(x.size()), y_ckpt(x.size()),
      dx_ckpt(x.size());
  taped(*plain, y_plain, dx_plain);
  taped(*taped_tiled, y_tiled, dx_tiled);
  {
    memkit::activation_store store(m.activations());
    auto stack = memkit::checkpoint::segment(memkit::checkpoint::layer_sequence(checkpointed->blocks[0], checkpointed->blocks[1]),
                                            {.schedule = memkit::checkpoint::schedule::every_layer()});
    stack.forward(memkit::host, {}, memkit::host_view(std::as_const(x).data(), in), memkit::host_view(y_ckpt.data(), in), store);
    stack.backward(memkit::host, memkit::host_view(std::as_const(r).data(), in), memkit::host_view(dx_ckpt.data(), in), store);
    CHECK(store.empty());
  }
  CHECK(y_ckpt == y_plain);
  CHECK(dx_ckpt == dx_plain);
  CHECK(dx_tiled == dx_plain);
  double worst = 0;
  for (std::size_t i = 0; i < 2; ++i) {
    const auto want = block_grads(plain->blocks[i]), tiled = block_grads(taped_tiled->blocks[i]),
               got = block_grads(checkpointed->blocks[i]);
    for (std::size_t j = 0; j < want.size(); ++j) {
      CAPTURE(want[j].first);
      CHECK(max_abs(want[j].second) > 0);
      CHECK(got[j].second == tiled[j].second);  // the same chunks: bit for bit
      if (is_mlp_weight(want[j].first)) {
        const double e = max_diff(got[j].second, want[j].second) / max_abs(want[j].second);
        worst = std::max(worst, e);
        CHECK(e <= mlp_weight_grad_bound);
      } else {
        CHECK(got[j].second == want[j].second);
      }
    }
  }
  CHECK(worst > 0);
  MESSAGE("checkpointed, chunk 7: worst MLP weight-gradient difference to the plain untiled stack " << worst);
}
