// Long context under a memory cap (#31), on a QLoRA Llama stack (models/llama, NF4 base, LoRA on all seven
// projections, random weights): checkpoints offloaded to host memory give the on-device checkpoints'
// gradients bit for bit; each side holds exactly what checkpoint::segment::cost predicts (device activations,
// host bytes); and under a cap the on-device step does not fit, the offloaded one trains.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <memkit/budget/estimate.hpp>
#include <memkit/memkit.hpp>
#include <memkit/memory/capped.hpp>
#include <memkit/models/llama/load.hpp>
#include <memkit/models/llama/nf4_lora.hpp>

#include "support/tracked_memory.hpp"

namespace llama = memkit::models::llama;
using memkit::shape;
using memkit::tensor_view;
using memkit::memory_category;

namespace {

using T = memkit::bf16;
constexpr std::int64_t batch = 2, seq = 48;

llama::model_config small_config() {
  return {.vocab = 512, .hidden = 96, .layers = 3, .heads = 3, .kv_heads = 1, .head_dim = 32, .intermediate = 256,
          .max_positions = seq, .tie_embeddings = true};
}

struct step_result {
  bool trained = false;
  float loss = 0;
  std::vector<float> gradients;  // every adapter's, in registry order
  std::uint64_t activation_peak = 0, predicted_activation_peak = 0;
  std::uint64_t host_peak = 0, predicted_host_bytes = 0;
  std::uint64_t total_peak = 0;
  std::uint64_t weights_after_resize = 0;  // tracked bytes right after set_max_positions
  std::uint64_t weights_as_built = 0;      // tracked bytes right after the build
  std::uint64_t resize_peak = 0;           // the tracked peak during set_max_positions
};

// One forward + loss + backward through memkit::checkpoint::segment (a checkpoint per layer), every
// allocation through a tracker over a cap (`cap` 0: none); offloaded checkpoints in host memory of their own.
// With `built_positions` other than seq the model is built with a rotary table of that many rows and re-sized
// to seq before the step (causal_lm::set_max_positions, as train_llama's search does between trials).
step_result train_step(bool offload, std::size_t cap, std::int64_t built_positions = seq) {
  llama::model_config c = small_config();
  c.max_positions = built_positions;
  memkit::capped_resource capped(memkit::default_host_resource(), cap != 0 ? cap : std::numeric_limits<std::size_t>::max());
  memkit::tracking_resource tracker(capped, "device");
  const memkit::layers::memory_resources memory = memkit_test::tracked_resources(tracker, 2);
  memkit::memory_resource& activations = tracker.category(memory_category::activations);
  memkit::tracking_resource host_memory(memkit::default_host_resource(), "offloaded");
  memkit::checkpoint::offload offloaded(host_memory);
  step_result r;
  try {
    llama::lora_load_options load;
    load.lora.rank = 4;
    load.lora.alpha = 8;
    load.lora.init_seed = 5;
    const llama::random_weights fill{7, 0.05f};
    auto model = llama::build_lora_causal_lm<T, memkit::quant::quantized_tensor<memkit::quant::NF4>>(memkit::host, c, memory,
                                                                                                      load, fill);
    r.weights_as_built = tracker.current_bytes();
    if (built_positions != seq) {
      tracker.reset_peak();
      model->set_max_positions(seq);
      r.weights_after_resize = tracker.current_bytes();
      r.resize_peak = tracker.peak_bytes();
    }
    memkit::layers::parameter_registry<T> params;
    model->register_parameters(params);
    // B starts at zero, which would leave every A's gradient zero: random factors make every gradient count.
    for (const auto& e : params.entries()) fill(e.name, e.value);
    auto stack = memkit::checkpoint::segment(memkit::checkpoint::layer_sequence(model->blocks, model->final_norm),
                                             {.schedule = memkit::checkpoint::schedule::every_layer(),
                                              .offload = offload ? &offloaded : nullptr});
    const shape hs{batch, seq, c.hidden};
    std::vector<std::int32_t> ids(batch * seq), targets(batch * seq);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      ids[i] = static_cast<std::int32_t>(memkit::random_word(11, 1, i) % static_cast<std::uint64_t>(c.vocab));
      targets[i] = static_cast<std::int32_t>(memkit::random_word(11, 2, i) % static_cast<std::uint64_t>(c.vocab));
    }
    memkit::buffer<T> h0(activations, hs), hn(activations, hs), dhn(activations, hs);
    r.predicted_activation_peak = 3 * memkit::buffer<T>::bytes_required(hs) + stack.cost(hs, {}).peak_bytes;
    r.predicted_host_bytes = stack.cost(hs, {}).host_bytes;
    memkit::activation_store store(activations);
    const memkit::forward_context ctx{3, 0, true};
    const std::int64_t N = batch * seq;
    model->embed.forward(memkit::host, memkit::host_view(std::as_const(ids).data(), shape{batch, seq}), h0.view());
    stack.forward(memkit::host, ctx, std::as_const(h0).view(), hn.view(), store);
    memkit::loss::fused_linear_cross_entropy(
        memkit::host, std::as_const(hn).view().reshaped(shape{N, c.hidden}), std::as_const(model->head_weight().value).view(),
        memkit::host_view(std::as_const(targets).data(), shape{N}), memkit::host_view(&r.loss, shape{1}),
        dhn.view().reshaped(shape{N, c.hidden}), tensor_view<float>::none(),
        memkit::loss::cross_entropy_options{.chunk_bytes = memkit::loss::chunk_bytes_for(32, c.vocab, sizeof(T)), .host_threads = 2},
        *memory.workspace);
    stack.backward(memkit::host, std::as_const(dhn).view(), tensor_view<T>::none(), store);
    for (const auto& e : params.entries()) {
      const std::vector<float> g = memkit::layers::copy_out(tensor_view<const float>(e.grad));
      r.gradients.insert(r.gradients.end(), g.begin(), g.end());
    }
    r.trained = true;
  } catch (const memkit::out_of_memory&) {
    r.trained = false;
  }
  r.activation_peak = tracker.stats(memory_category::activations).peak_bytes;
  r.total_peak = tracker.peak_bytes();
  r.host_peak = host_memory.peak_bytes();
  return r;
}

}  // namespace

TEST_CASE("long context: offloaded checkpoints give the on-device gradients bit for bit, each side as predicted, and "
          "train under a cap the on-device ones do not fit") {
  const step_result on_device = train_step(false, 0);
  const step_result offloaded = train_step(true, 0);
  REQUIRE(on_device.trained);
  REQUIRE(offloaded.trained);
  CHECK(std::memcmp(&on_device.loss, &offloaded.loss, sizeof(float)) == 0);
  REQUIRE(on_device.gradients.size() == offloaded.gradients.size());
  CHECK(std::memcmp(on_device.gradients.data(), offloaded.gradients.data(), on_device.gradients.size() * sizeof(float)) == 0);
  std::size_t nonzero = 0;
  for (float g : on_device.gradients) nonzero += g != 0.0f;
  CHECK(nonzero > on_device.gradients.size() / 2);  // the comparison is of real gradients
  // Device activations and host bytes exactly as checkpoint::segment::cost says, on each side.
  CHECK(on_device.activation_peak == on_device.predicted_activation_peak);
  CHECK(offloaded.activation_peak == offloaded.predicted_activation_peak);
  CHECK(on_device.host_peak == 0);
  CHECK(on_device.predicted_host_bytes == 0);
  CHECK(offloaded.host_peak == offloaded.predicted_host_bytes);
  CHECK(offloaded.host_peak >= 4 * memkit::buffer<T>::bytes_required(shape{batch, seq, small_config().hidden}));  // 3 blocks + norm
  // A cap one byte under the on-device step's peak: it stops with out_of_memory; the offloaded one, whose
  // checkpoints wait outside the cap, trains to the same gradients.
  REQUIRE(offloaded.total_peak < on_device.total_peak);
  const std::size_t cap = on_device.total_peak - 1;
  CHECK_FALSE(train_step(false, cap).trained);
  const step_result capped = train_step(true, cap);
  REQUIRE(capped.trained);
  CHECK(capped.total_peak <= cap);
  CHECK(std::memcmp(capped.gradients.data(), on_device.gradients.data(), on_device.gradients.size() * sizeof(float)) == 0);
}

TEST_CASE("long context: one model re-sized to another length (set_max_positions) trains as one built for it") {
  const step_result built = train_step(false, 0);
  for (const std::int64_t positions : {std::int64_t{8}, std::int64_t{200}}) {  // shorter and longer than the step's
    CAPTURE(positions);
    const step_result resized = train_step(false, 0, positions);
    REQUIRE(resized.trained);
    // Exactly the bytes of a model built for seq: the old table is gone, the new one has seq rows.
    CHECK(resized.weights_after_resize == built.weights_as_built);
    CHECK(resized.weights_as_built ==
          built.weights_as_built - llama::rotary<T>::table_bytes(32, seq) + llama::rotary<T>::table_bytes(32, positions));
    CHECK(std::memcmp(&resized.loss, &built.loss, sizeof(float)) == 0);
    REQUIRE(resized.gradients.size() == built.gradients.size());
    CHECK(std::memcmp(resized.gradients.data(), built.gradients.data(), built.gradients.size() * sizeof(float)) == 0);
    // The two tables are never held together: the resize's peak is the larger of before and after.
    CHECK(resized.resize_peak == std::max(resized.weights_as_built, resized.weights_after_resize));
    if (positions < seq) CHECK(resized.total_peak == built.total_peak);
  }
  // A table too short for the sequence, and a bad length, are refused clearly.
  llama::model_config c = small_config();
  memkit::layers::memory_resources memory;
  memory.host_threads = 1;
  llama::lora_load_options load;
  load.lora.rank = 2;
  auto model = llama::build_lora_causal_lm<T, memkit::quant::quantized_tensor<memkit::quant::NF4>>(
      memkit::host, c, memory, load, llama::random_weights{7, 0.05f});
  CHECK_THROWS_WITH_AS(model->set_max_positions(0), doctest::Contains("positions must be at least 1, got 0"), memkit::error);
  model->set_max_positions(seq - 1);
  CHECK(model->config.max_positions == seq - 1);
  CHECK(model->rope->max_positions == seq - 1);
  std::vector<std::int32_t> ids(seq, 1);
  memkit::buffer<T> h(*memory.workspace, shape{1, seq, c.hidden});
  model->embed.forward(memkit::host, memkit::host_view(std::as_const(ids).data(), shape{1, seq}), h.view());
  CHECK_THROWS_WITH_AS(model->rope->rotate(memkit::host, std::as_const(h).view(), h.view(), 1.0f),
                       doctest::Contains("longer than the table"), memkit::error);
}

TEST_CASE("long context: memory_budget's loss chunk keeps the loss's 2^31-element limit (Llama-3.1-8B, 96K tokens)") {
  namespace budget = memkit::budget;
  constexpr std::uint64_t seq = 96 * 1024;
  const budget::model_config m = budget::llama_style("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, false, seq, 128);
  budget::training_plan p{.runtime = budget::runtime_kind::memkit, .training = budget::method::lora,
                          .weights = {budget::weight_format::nf4, 64, true}, .lora = {.rank = 32},
                          .precision = budget::precision_mode::bf16, .optimizer = budget::optimizer_kind::adamw_8bit,
                          .micro_batch = 1, .sequence = seq, .checkpoint = budget::checkpointing::every_layer,
                          .logits = budget::logits_mode::chunked, .logits_chunk_tokens = seq,
                          .fp32_norm_and_softmax = false};
  p.mlp_token_chunk = 1024;
  // No cap: the plan's chunk (the whole sequence) stops at the limit, and the bytes are that chunk's.
  const budget::memory_estimate free = budget::estimate_memory(m, p);
  REQUIRE(free.valid());
  CHECK(free.loss_chunk_tokens == static_cast<std::uint64_t>(memkit::loss::max_chunk_tokens(128256)));
  CHECK(free.loss_chunk_tokens == 16743);
  // Under a cap with room for far more (a 1 TiB "device"): the chunk from the memory left stops there too.
  p.memory_cap = std::uint64_t{1} << 40;
  const budget::memory_estimate capped = budget::estimate_memory(m, p);
  REQUIRE(capped.valid());
  CHECK(capped.loss_chunk_tokens == 16743);
  CHECK(capped.peak_bytes(budget::metric::allocated) == free.peak_bytes(budget::metric::allocated));
}

TEST_CASE("long context: one cuBLAS operand spans at most 2^31 - 1 elements; past it the device paths refuse clearly") {
  using memkit::detail::require_cublas_span;
  // Llama-3.1-8B's untiled MLP at [tokens, 14336]: fine up to 149,796 tokens, refused from 149,797.
  CHECK_NOTHROW(require_cublas_span(149796, 14336, "quant::matmul", "y"));
  CHECK_THROWS_WITH_AS(require_cublas_span(149797, 14336, "quant::matmul", "y"),
                       doctest::Contains("quant::matmul (CUDA): y spans 149797 x 14336 elements"), memkit::error);
  CHECK_THROWS_WITH_AS(require_cublas_span(400000, 14336, "quant::matmul", "y"), doctest::Contains("tile the MLP"),
                       memkit::error);
  // Tiled at 1,024 tokens the MLP's operands are small; q / o at 400K tokens x 4096 fit, at 2^19 tokens not.
  CHECK_NOTHROW(require_cublas_span(1024, 14336, "quant::matmul", "y"));
  CHECK_NOTHROW(require_cublas_span(400000, 4096, "linalg::gemm", "C"));
  CHECK_THROWS_AS(require_cublas_span(std::int64_t{1} << 19, 4096, "linalg::gemm", "C"), memkit::error);
  // The loss's chunk rule stays inside the same limit.
  CHECK_NOTHROW(require_cublas_span(memkit::loss::max_chunk_tokens(128256), 128256, "loss", "logits"));
  CHECK_THROWS_AS(require_cublas_span(memkit::loss::max_chunk_tokens(128256) + 1, 128256, "loss", "logits"), memkit::error);
  CHECK_NOTHROW(require_cublas_span(0, std::int64_t{1} << 40, "x", "empty"));
}
