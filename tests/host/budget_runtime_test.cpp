// memory_budget: describing the run (issue #13) — the runtime (PyTorch conventions or memkit's own
// components), torch AdamW's foreach/fused implementations, paged optimizer state, the loss kinds and the
// optimizer step fused into backward. The expected bytes are worked out by hand from what each
// implementation allocates (cited next to each figure), not taken from the calculator.
#include <doctest/doctest.h>
#include <memkit/memkit.hpp>

#include <cstdint>
#include <vector>

using namespace memkit::budget;

namespace {

// Every byte counted: no context, no cuBLAS workspace, no rounding.
constexpr overhead_settings exact{.cuda_context_bytes = 0, .nccl_bytes = 0, .workspace_bytes = 0,
                                  .allocation_granularity = 1, .fragmentation_percent = 0};

// hidden 256, 2 layers, 4 heads of 64, 2 kv heads, MLP 704, vocabulary 1000, untied, no position table.
constexpr model_config tiny = llama_style("tiny", 256, 2, 4, 2, 704, 1000, false, 0);
// Per layer: q, o 256x256; k, v 128x256; gate, up 704x256; down 256x704; two norms of 256.
constexpr std::uint64_t tiny_layer = 2 * 65536 + 2 * 32768 + 3 * 180224 + 2 * 256;  // 737,792
constexpr std::uint64_t tiny_parameters = 2 * tiny_layer + 256 + 2 * 256000;        // 1,987,840
constexpr std::uint64_t tiny_tensors = 2 * 9 + 3;  // 7 linears + 2 norms per layer; final norm, embedding, head
static_assert(parameter_count(tiny) == tiny_parameters);

const breakdown& phase(const memory_estimate& e, step_phase p) { return e.phases[static_cast<int>(p)]; }

}  // namespace

TEST_CASE("budget runtime: torch AdamW foreach allocates one parameter-sized temporary in the step, fused none") {
  // torch/optim/adamw.py (_multi_tensor_adam): exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs) is the one
  // out-of-place op, a tensor per parameter in the state's dtype; everything else is in place. fused=True
  // keeps each parameter's `step` as an fp32 device scalar (4 bytes; 512 with PyTorch's rounding).
  training_plan foreach{.optimizer = optimizer_kind::adamw, .fused_optimizer = false, .overhead = exact};
  training_plan fused = foreach;
  fused.fused_optimizer = true;
  const memory_estimate a = estimate_memory(tiny, foreach), b = estimate_memory(tiny, fused);
  REQUIRE(a.valid());
  REQUIRE(b.valid());
  // fp32 moments: 4 bytes per parameter of temporary.
  CHECK(phase(a, step_phase::optimizer_step)[category::workspace] == 4 * tiny_parameters);  // 7,951,360
  CHECK(phase(b, step_phase::optimizer_step)[category::workspace] == 0);
  CHECK(b.device[category::optimizer_state] - a.device[category::optimizer_state] == 4 * tiny_tensors);
  CHECK(phase(a, step_phase::optimizer_step).total() - phase(b, step_phase::optimizer_step).total() ==
        4 * tiny_parameters - 4 * tiny_tensors);  // 7,951,276
  // bf16 states (pure bf16 AdamW): the temporary is bf16.
  foreach.precision = precision_mode::bf16;
  foreach.optimizer = optimizer_kind::adamw_bf16;
  CHECK(phase(estimate_memory(tiny, foreach), step_phase::optimizer_step)[category::workspace] == 2 * tiny_parameters);
  // bitsandbytes' blockwise 8-bit AdamW updates in place whatever the flag says.
  foreach.optimizer = optimizer_kind::adamw_8bit;
  CHECK(phase(estimate_memory(tiny, foreach), step_phase::optimizer_step)[category::workspace] == 0);
}

TEST_CASE("budget runtime: memkit's parameters keep fp32 gradients and adam_state's exact bytes") {
  const training_plan torch_plan{.optimizer = optimizer_kind::adamw_8bit, .overhead = exact};
  training_plan memkit_plan = torch_plan;
  memkit_plan.runtime = runtime_kind::memkit;
  memkit_plan.logits = logits_mode::chunked;
  const memory_estimate t = estimate_memory(tiny, torch_plan), k = estimate_memory(tiny, memkit_plan);
  REQUIRE(t.valid());
  REQUIRE(k.valid());
  const breakdown& ts = phase(t, step_phase::optimizer_step);
  const breakdown& ks = phase(k, step_phase::optimizer_step);
  CHECK(ts[category::gradients] == 2 * tiny_parameters);  // PyTorch: gradients in the weights' bf16
  CHECK(ks[category::gradients] == 4 * tiny_parameters);  // memkit: fp32 (memkit/models/llama parameter, lora_linear)
  CHECK(ks[category::weights] == 2 * tiny_parameters);
  CHECK(ks[category::master_weights] == 4 * tiny_parameters);
  // memkit: adam_state<int8, 256>::bytes_required over the trainable tensors, control block and norm scratch
  // included — what the example allocates. PyTorch (bitsandbytes): the moments and absmax only.
  std::vector<std::int64_t> sizes;
  for_each_parameter(tiny, [&](const parameter_tensor& p) {
    for (std::uint64_t c = 0; c < p.count; ++c) sizes.push_back(static_cast<std::int64_t>(p.elements()));
  });
  REQUIRE(sizes.size() == tiny_tensors);
  const std::uint64_t adam = memkit::optim::adam_state<std::int8_t, 256>::bytes_required(sizes);
  CHECK(ks[category::optimizer_state] == adam);
  std::uint64_t moments = 0;
  for (std::int64_t n : sizes) moments += memkit::optim::adam_state<std::int8_t, 256>::tensor_bytes(n);
  CHECK(ts[category::optimizer_state] == moments);
  CHECK(adam > moments);
}

TEST_CASE("budget runtime: memkit's lora_linear saves its own input copy and no mask; the base keeps nothing") {
  // 2 x 64 tokens, LoRA r=8 on all seven linears, bf16, fused norms in both (memkit has no fp32 norm copies).
  const std::uint64_t T = 128, h = 256, f = 704;
  training_plan torch_plan{.training = method::lora, .lora = {8, all_linear_modules, false}, .micro_batch = 2,
                           .sequence = 64, .logits = logits_mode::chunked, .fp32_norm_and_softmax = false,
                           .overhead = exact};
  training_plan memkit_plan = torch_plan;
  memkit_plan.runtime = runtime_kind::memkit;
  const block_activations pt = block_activation_bytes(tiny, torch_plan);
  const block_activations mk = block_activation_bytes(tiny, memkit_plan);
  // PyTorch without dropout: each adapter reads x, which the block keeps once per input (qkv, gate/up: T x h;
  // down: T x f; o's input is the attention output, saved anyway). memkit: every lora_linear keeps its own
  // dropout(x) — q, k, v, o, gate, up read T x h, down T x f — plus a 32-byte record of the dropout stream
  // (lora/bytes.hpp). Both keep the [T, r] down-projections.
  // memkit's SwiGLU keeps only its [T, 2f] input (the gate and up outputs: memkit/models/llama/layers.hpp's swiglu);
  // PyTorch's autograd also keeps silu(gate) [T, f] for the product's backward.
  const std::uint64_t torch_inputs = 2 * (T * h + T * h + T * f);
  const std::uint64_t memkit_inputs = 2 * (6 * T * h + T * f) + 7 * 32;
  const std::uint64_t torch_silu = 2 * T * f;
  CHECK(mk.saved_bytes - pt.saved_bytes == memkit_inputs - torch_inputs - torch_silu);  // 82,144
  CHECK(mk.saved_bytes - pt.saved_bytes == 82144);
  // With dropout PyTorch (PEFT) keeps a dropped copy and a 1-byte mask per adapter; memkit the same copy, no mask.
  torch_plan.lora.dropout = memkit_plan.lora.dropout = true;
  const std::uint64_t pt_dropout = block_activation_bytes(tiny, torch_plan).saved_bytes;
  const std::uint64_t mk_dropout = block_activation_bytes(tiny, memkit_plan).saved_bytes;
  CHECK(mk_dropout == mk.saved_bytes);  // lora_linear saves the same with or without dropout
  CHECK(pt_dropout - mk_dropout == (6 * T * h + T * f) - 7 * 32 + torch_silu);  // the masks, less the records
}

TEST_CASE("budget runtime: a memkit NF4 base takes lora_linear's workspace, PyTorch a whole dequantized weight") {
  const training_plan torch_plan{.training = method::lora, .weights = {weight_format::nf4, 64, true},
                                 .lora = {8, all_linear_modules, false}, .micro_batch = 2, .sequence = 64,
                                 .logits = logits_mode::chunked, .fp32_norm_and_softmax = false, .overhead = exact};
  training_plan memkit_plan = torch_plan;
  memkit_plan.runtime = runtime_kind::memkit;
  // bitsandbytes: dequantize_4bit of the largest linear (gate/up/down: 704 x 256) into bf16.
  CHECK(estimate_memory(tiny, torch_plan).device[category::workspace] == 2 * 704 * 256);  // 360,448
  // memkit on a device (quant/matmul.hpp, lora/lora_linear.hpp): a tile of min(2^26 / in, out) rows of the
  // weight in bf16 — the whole weight here, so cuBLAS writes the 16-bit input gradient itself (an fp32
  // accumulator [tokens, in] only when W takes several tiles); the adapter's backward also holds its [tokens, r]
  // down-projection gradient (bf16 on CUDA). down (in 704): 256*704*2 + 128*8*2 = 360,448 + 2,048.
  const std::uint64_t down = 256 * 704 * 2 + 128 * 8 * 2;
  CHECK(down == 362496);
  // memkit charges it inside the block's backward, on top of the block's bf16 gradient scratch
  // (budget/activations.hpp's memkit_block_activation_bytes, as memkit/models/llama/block.hpp takes it): the SwiGLU
  // and gate|up gradients, four hidden-width, four q-width and four kv-width ones, T = 128.
  const std::uint64_t backward_scratch = 2 * 128 * (704 + 2 * 704 + 4 * 256 + 4 * 256 + 4 * 128);
  CHECK(backward_scratch == 1196032);
  CHECK(estimate_memory(tiny, memkit_plan).device[category::workspace] == backward_scratch + down);
}

TEST_CASE("budget runtime: the memkit runtime refuses what memkit does not have") {
  training_plan p{.runtime = runtime_kind::memkit, .logits = logits_mode::fp32};
  CHECK_FALSE(estimate_memory(tiny, p).valid());
  p.logits = logits_mode::fused;
  CHECK(estimate_memory(tiny, p).valid());
  p.optimizer = optimizer_kind::adafactor;
  CHECK(std::string(estimate_memory(tiny, p).problem).find("adam_state") != std::string::npos);
  p.optimizer = optimizer_kind::adamw;
  p.kbit_prepared = true;
  CHECK_FALSE(estimate_memory(tiny, p).valid());
  p.kbit_prepared = false;
  p.optimizer_in_backward = true;
  CHECK(std::string(estimate_memory(tiny, p).problem).find("after backward") != std::string::npos);
}

TEST_CASE("budget runtime: paged optimizer state is on the device but outside torch's counters") {
  training_plan device{.optimizer = optimizer_kind::adamw_8bit, .overhead = exact};
  training_plan paged = device;
  paged.placement = optimizer_placement::paged;
  const memory_estimate d = estimate_memory(tiny, device), p = estimate_memory(tiny, paged);
  REQUIRE(p.valid());
  CHECK(d.managed_bytes == 0);
  CHECK(p.peak_device_bytes == d.peak_device_bytes);
  CHECK(p.managed_bytes == p.device[category::optimizer_state]);
  CHECK(p.managed_bytes > 0);
  CHECK(p.host_bytes == 0);
  // torch's counters (the allocated and reserved figures) do not see it; the device figure does.
  CHECK(p.peak_bytes(metric::allocated) + p.managed_bytes == d.peak_bytes(metric::allocated));
  CHECK(p.peak_bytes(metric::device) == d.peak_bytes(metric::device));
}

TEST_CASE("budget runtime: loss kinds hold what their implementations hold") {
  // Llama 3.1 8B (V = 128,256, H = 4,096), LoRA, 2 x 1024 tokens, bf16.
  const model_config& m = presets::llama_3_1_8b;
  training_plan plan{.training = method::lora, .micro_batch = 2, .sequence = 1024, .overhead = exact};
  const std::uint64_t T = 2048, V = 128256, H = 4096, TV = T * V;
  // torchtune CEWithChunkedOutputLoss, 8 chunks along the sequence: chunks of 2 x 128 = 256 tokens; all bf16
  // chunks kept, the compiled per-chunk loss keeps an fp32 log-sum-exp per token, and in backward writes
  // one chunk's bf16 gradient at a time.
  plan.logits = logits_mode::chunked;
  const std::uint64_t chunk = 256 * V;
  CHECK(logits_activation_bytes(m, plan).forward_peak == 2 * TV + 4 * T);  // 525,344,768
  CHECK(logits_activation_bytes(m, plan).forward_peak == 525344768);
  CHECK(logits_activation_bytes(m, plan).backward_peak == 2 * TV + 4 * T + 2 * chunk);
  // Liger: inc_factor = ceil(V / H) = 32, chunk = next_power_of_2(ceil(2048 / 32)) = 64 tokens of bf16
  // logits, grad_input [T, H] bf16 and fp32 losses [T] in forward; backward scales grad_input.
  plan.logits = logits_mode::fused;
  CHECK(logits_activation_bytes(m, plan).forward_peak == 2 * 64 * V + 2 * T * H + 4 * T);  // 33,202,176
  CHECK(logits_activation_bytes(m, plan).forward_peak == 33202176);
  CHECK(logits_activation_bytes(m, plan).backward_peak == 2 * T * H);
  // Full training: Liger allocates the head's gradient [V, H] in forward too.
  training_plan full = plan;
  full.training = method::full;
  CHECK(logits_activation_bytes(m, full).forward_peak == 2 * 64 * V + 2 * T * H + 4 * T + 2 * V * H);
  // ...and no lm_head input is kept for backward (the gradient was taken in forward).
  training_plan full_fp32 = full;
  full_fp32.logits = logits_mode::fp32;
  CHECK(model_level_activation_bytes(m, full_fp32) - model_level_activation_bytes(m, full) == 2 * T * H);
  // Cut Cross-Entropy: no logits; lse and target logits fp32 [T], fp32 logit averages [V], and (LoRA: nothing
  // else keeps it) its bf16 input [T, H]; backward adds an int32 ordering [V] and de [T, H].
  plan.logits = logits_mode::cut;
  CHECK(logits_activation_bytes(m, plan).forward_peak == 2 * T * H + 8 * T + 4 * V);  // 17,306,624
  CHECK(logits_activation_bytes(m, plan).backward_peak == 2 * T * H + 4 * T + 8 * V + 2 * T * H);
  // memkit runtime: chunked and fused are both loss::fused_linear_cross_entropy (1024-token chunks of fp32
  // logits and their bf16 copy, fp32 per-token losses, two counters) plus the bf16 d_hidden.
  plan.runtime = runtime_kind::memkit;
  plan.logits = logits_mode::fused;
  const std::uint64_t memkit_loss = 1024 * V * (4 + 2) + T * 4 + 8 + 2 * T * H;
  CHECK(logits_activation_bytes(m, plan).forward_peak == memkit_loss);
  plan.logits = logits_mode::chunked;
  CHECK(logits_activation_bytes(m, plan).forward_peak == memkit_loss);
  // Fused and cut never hold T x V; the peak drops accordingly.
  training_plan fp32_plan{.training = method::lora, .micro_batch = 2, .sequence = 1024, .overhead = exact};
  training_plan cut_plan = fp32_plan;
  cut_plan.logits = logits_mode::cut;
  CHECK(estimate_memory(m, cut_plan).peak_device_bytes + TV * 8 < estimate_memory(m, fp32_plan).peak_device_bytes);
}

TEST_CASE("budget runtime: the optimizer step in backward keeps one gradient, not all") {
  // A short sequence, so that the model states, not the activations, set the peak.
  const training_plan plain{.optimizer = optimizer_kind::adamw, .sequence = 64, .overhead = exact};
  training_plan in_backward = plain;
  in_backward.optimizer_in_backward = true;
  const memory_estimate a = estimate_memory(tiny, plain), b = estimate_memory(tiny, in_backward);
  REQUIRE(b.valid());
  // The largest trainable tensor is the embedding (or head): 1000 x 256 bf16 = 512,000 bytes, and foreach's
  // temporary for that tensor alone, fp32: 1,024,000 bytes, during backward.
  CHECK(phase(b, step_phase::backward)[category::gradients] == 512000);
  CHECK(phase(b, step_phase::backward)[category::workspace] == 1024000);
  CHECK(phase(a, step_phase::optimizer_step)[category::gradients] == 2 * tiny_parameters);
  // No optimizer phase of its own: only the persistent state.
  CHECK(phase(b, step_phase::optimizer_step)[category::gradients] == 0);
  CHECK(phase(b, step_phase::optimizer_step)[category::workspace] == 0);
  CHECK(a.peak_phase == step_phase::optimizer_step);
  CHECK(b.peak_device_bytes < a.peak_device_bytes);
  // Where the activations set the peak (2048 tokens), the step in backward adds its one gradient and
  // temporary to the backward peak instead: no saving there.
  training_plan long_plain = plain, long_in_backward = in_backward;
  long_plain.sequence = long_in_backward.sequence = 2048;
  CHECK(estimate_memory(tiny, long_in_backward).peak_device_bytes > estimate_memory(tiny, long_plain).peak_device_bytes);
  // torchtune refuses it with gradient accumulation; so does the calculator.
  in_backward.grad_accum = 2;
  CHECK_FALSE(estimate_memory(tiny, in_backward).valid());
}

TEST_CASE("budget planner: a rung that does not lower the peak is not applied, and says why") {
  // Llama 3.1 8B, 4 micro-batches of 1 x 128: the model states set the peak (16 bytes per parameter and
  // foreach's 4-byte temporary); the logits (128 x 128,256) are small and gone by the step.
  const training_plan workload{.micro_batch = 1, .sequence = 128, .grad_accum = 4};
  const ladder l = plan_ladder(presets::llama_3_1_8b, presets::h100_80gb, workload);
  const ladder_rung& base = l.rungs[static_cast<int>(rung_kind::bf16)];
  REQUIRE(base.estimate.peak_phase == step_phase::optimizer_step);
  const ladder_rung& adam8 = l.rungs[static_cast<int>(rung_kind::optimizer_8bit)];
  CHECK(adam8.effective);
  CHECK(adam8.estimate.peak_device_bytes < base.estimate.peak_device_bytes);
  // torchtune refuses the step in backward with accumulation; so does the planner, and says so.
  const ladder_rung& in_backward = l.rungs[static_cast<int>(rung_kind::optimizer_in_backward)];
  CHECK_FALSE(in_backward.effective);
  CHECK(std::string(in_backward.reason).find("accumulation") != std::string::npos);
  CHECK_FALSE(in_backward.plan.optimizer_in_backward);
  const ladder_rung& loss = l.rungs[static_cast<int>(rung_kind::fused_loss)];
  CHECK_FALSE(loss.effective);
  CHECK(loss.plan.logits == logits_mode::fp32);  // not applied
  CHECK(loss.speed_factor == 1.0);
  const ladder_rung& batch = l.rungs[static_cast<int>(rung_kind::smaller_micro_batch)];
  CHECK_FALSE(batch.effective);
  CHECK(std::string(batch.reason) == "the micro-batch is already 1");
  // The ladder only ever moves toward fitting.
  for (int i = 1; i < rung_count; ++i)
    if (l.rungs[i].effective) CHECK(l.rungs[i].estimate.peak_device_bytes < l.rungs[i - 1].estimate.peak_device_bytes);
    else CHECK(l.rungs[i].estimate.peak_device_bytes == l.rungs[i - 1].estimate.peak_device_bytes);
  // Without accumulation the step in backward frees the 16 GB of bf16 gradients: applied.
  const ladder single = plan_ladder(presets::llama_3_1_8b, presets::h100_80gb, training_plan{.micro_batch = 1, .sequence = 128});
  const ladder_rung& applied = single.rungs[static_cast<int>(rung_kind::optimizer_in_backward)];
  CHECK(applied.effective);
  CHECK(applied.plan.optimizer_in_backward);
  CHECK(applied.estimate.peak_device_bytes + 12 * memkit::GiB <
        single.rungs[static_cast<int>(rung_kind::optimizer_8bit)].estimate.peak_device_bytes);
}

TEST_CASE("budget planner: each rung says its speed cost") {
  // Llama 3.2 1B at 4 x 4096 tokens: activations dominate, checkpointing helps and costs one more forward.
  const ladder l = plan_ladder(presets::llama_3_2_1b, presets::rtx_4090, training_plan{.micro_batch = 4, .sequence = 4096});
  const ladder_rung& ckpt = l.rungs[static_cast<int>(rung_kind::checkpointing)];
  REQUIRE(ckpt.effective);
  CHECK(ckpt.speed_factor == doctest::Approx(4.0 / 3.0));
  double total = 1.0;
  for (int i = 0; i <= static_cast<int>(rung_kind::checkpointing); ++i) total *= l.rungs[i].effective ? l.rungs[i].speed_factor : 1.0;
  CHECK(ckpt.total_speed_factor == doctest::Approx(total));
  // The 8-bit optimizer and the fused loss cost nothing in speed; both lower the peak here.
  CHECK(l.rungs[static_cast<int>(rung_kind::optimizer_8bit)].speed_factor == 1.0);
  CHECK(l.rungs[static_cast<int>(rung_kind::fused_loss)].effective);
  CHECK(l.rungs[static_cast<int>(rung_kind::fused_loss)].plan.logits == logits_mode::fused);
}

TEST_CASE("budget planner: CPU offload's cost is its PCIe traffic against the step's compute") {
  // Llama 2 70B, QLoRA, 1 x 2048 on an 80 GB A100: offloading the NF4 base moves it up three times per step
  // (forward, recomputation, backward), plus the adapters' bf16 gradients down and weights up.
  const ladder l = plan_ladder(presets::llama_2_70b, presets::a100_80gb, training_plan{.micro_batch = 1, .sequence = 2048});
  const ladder_rung& offload = l.rungs[static_cast<int>(rung_kind::cpu_offload)];
  REQUIRE(offload.effective);
  const memory_estimate& e = offload.estimate;
  const std::uint64_t traffic = e.trainable_parameters * (2 + 2) + 3 * e.host[category::weights];
  CHECK(offload.host_traffic_bytes == traffic);
  // Compute: (4 x parameters) FLOPs per token, + 2 x parameters for the recomputation, at 40% of 312 TFLOP/s.
  const double flops = 6.0 * static_cast<double>(e.parameters) * 2048.0;
  const double seconds = flops / (312e12 * 0.4);
  CHECK(offload.speed_factor == doctest::Approx(1.0 + static_cast<double>(traffic) / 25e9 / seconds));
  CHECK(offload.speed_factor > 1.0);
}

TEST_CASE("budget runtime: with checkpointing, backward holds every checkpoint, one recomputed layer and its temporaries") {
  // QLoRA (NF4) on the tiny model, r=8 on all seven linears with dropout, 2 x 64 tokens, every layer
  // checkpointed, fused norms, flash attention, the fused loss; PyTorch conventions. Two micro-batches, so
  // that all gradients are allocated throughout backward and the activations alone decide its peak.
  training_plan plan{.training = method::lora, .weights = {weight_format::nf4, 64, true},
                     .lora = {8, all_linear_modules, true}, .micro_batch = 2, .sequence = 64, .grad_accum = 2,
                     .checkpoint = checkpointing::every_layer, .logits = logits_mode::fused,
                     .fp32_norm_and_softmax = false, .overhead = exact};
  const std::uint64_t T = 128, h = 256, f = 704, r = 8;
  const block_activations block = block_activation_bytes(tiny, plan);
  // One recomputed layer's saved tensors. PEFT with dropout: per adapter the dropped input (bf16), its 1-byte
  // mask and the [T, r] A output; the frozen NF4 linears keep no input.
  const std::uint64_t adapters = 2 * T * (6 * h + f) + T * (6 * h + f) + 7 * 2 * T * r;  // 874,496
  // The block's own: attn_norm input and rstd, q, k, v (flash: 16-bit, grouped k/v), the attention output and
  // its fp32 log-sum-exp per head and row, mlp_norm input and rstd, gate output, SiLU output, up output.
  const std::uint64_t own = 2 * T * h + 4 * T + 2 * T * h + 2 * 2 * T * 128 + 2 * T * h + 4 * 2 * 4 * 64 + 2 * T * h +
                            4 * T + 3 * 2 * T * f;  // 871,424
  CHECK(adapters == 874496);
  CHECK(own == 871424);
  CHECK(block.saved_bytes == adapters + own);
  std::uint64_t dropout_copies = 0;
  for (int i = 0; i < block.count; ++i)
    if (block.items[i].name == "lora.dropout_output") dropout_copies += block.items[i].bytes;
  CHECK(dropout_copies == 2 * T * (6 * h + f));
  // Backward of the last layer: the other layer's checkpoint (its bf16 input, 2*T*h) and the recomputed layer
  // (whose first saved tensor is its own input: its checkpoint, counted once), the layer's gradient
  // temporaries, and outside the blocks the rotary tables (cos, sin: 2 x 2*T*64) and the final norm's input
  // and rstd.
  const std::uint64_t extras = 2 * 2 * T * 64 + 2 * T * h + 4 * T;  // 98,816
  CHECK(model_level_activation_bytes(tiny, plan) == extras);
  const memory_estimate e = estimate_memory(tiny, plan);
  REQUIRE(e.valid());
  const breakdown& backward = phase(e, step_phase::backward);
  CHECK(backward[category::activations] == extras + block.backward_transient + 2 * T * h + block.saved_bytes);
  // ...next to bitsandbytes' dequantized weight (the largest, 704 x 256 in bf16) in the workspace.
  CHECK(backward[category::workspace] == 2 * 704 * 256);
  // The memkit runtime models this block as memkit's layers build it (budget/memkit_step.hpp: each layer's own
  // copies, lora_linear without masks, scratch and operation workspaces as workspace);
  // tests/host/budget_memkit_example_test.cpp pins its checkpointed backward against hand-computed bytes of the
  // main example's QLoRA configuration, which the example's tracker matches within 0.1%.
  plan.runtime = runtime_kind::memkit;
  const block_activations memkit_block = block_activation_bytes(tiny, plan);
  CHECK(memkit_block.saved_bytes < block.saved_bytes);  // no dropout masks, no SiLU output copy
  const memory_estimate m = estimate_memory(tiny, plan);
  REQUIRE(m.valid());
  // One recomputed layer next to the other layer's checkpoint (+ the loop's hidden buffers): not both layers.
  CHECK(phase(m, step_phase::backward)[category::activations] >= 2 * T * h + memkit_block.saved_bytes);
  CHECK(phase(m, step_phase::backward)[category::activations] < 2 * memkit_block.saved_bytes + 4 * 2 * T * h);
}

TEST_CASE("budget planner: with the memkit runtime the rungs memkit cannot take say why") {
  const training_plan workload{.runtime = runtime_kind::memkit, .micro_batch = 4, .sequence = 4096,
                               .logits = logits_mode::fused};
  const ladder l = plan_ladder(presets::llama_3_2_1b, presets::rtx_4090, workload);
  for (const ladder_rung& r : l.rungs) CHECK(r.plan.memkit_runtime());
  const ladder_rung& in_backward = l.rungs[static_cast<int>(rung_kind::optimizer_in_backward)];
  CHECK_FALSE(in_backward.effective);
  CHECK(std::string(in_backward.reason) == "memkit's adam_state steps once after backward");
  const ladder_rung& loss = l.rungs[static_cast<int>(rung_kind::fused_loss)];
  CHECK_FALSE(loss.effective);
  CHECK(std::string(loss.reason) == "the loss is fused already");
  CHECK(l.rungs[static_cast<int>(rung_kind::checkpointing)].effective);
}

TEST_CASE("budget runtime: under a memory cap the loss's chunk is the largest the memory left holds, and checkpoints "
          "leave the device only when they must") {
  // SmolLM2-135M, QLoRA on all seven projections, 1 x 4096 tokens on the host, a checkpoint per block.
  training_plan plan{.runtime = runtime_kind::memkit, .training = method::lora, .weights = {weight_format::nf4},
                     .lora = {.rank = 8}, .optimizer = optimizer_kind::adamw_8bit, .micro_batch = 1, .sequence = 4096,
                     .checkpoint = checkpointing::every_layer, .logits = logits_mode::chunked,
                     .logits_chunk_tokens = 4096, .host_threads = 2, .overhead = host_overhead};
  const model_config& m = presets::smollm2_135m;
  const memory_estimate free_run = estimate_memory(m, plan);
  REQUIRE(free_run.valid());
  CHECK(free_run.loss_chunk_tokens == 4096);  // no cap: logits_chunk_tokens, at most the micro-batch
  CHECK(free_run.peak_phase == step_phase::forward);  // 4096 tokens' fp32 logits of a 49152 vocabulary: the loss
  // A cap 64 MiB under that peak: the loss takes a smaller chunk, and the step then fits the cap.
  plan.memory_cap = free_run.peak_bytes(metric::allocated) - 64 * memkit::MiB;
  const memory_estimate capped = estimate_memory(m, plan);
  CHECK(capped.loss_chunk_tokens > 0);
  CHECK(capped.loss_chunk_tokens < 4096);
  CHECK(capped.peak_bytes(metric::allocated) <= plan.memory_cap);
  // One token more would not have fitted: the loss's moment is then above the cap.
  training_plan one_more = plan;
  one_more.memory_cap = 0;
  one_more.logits_chunk_tokens = capped.loss_chunk_tokens + 1;
  CHECK(estimate_memory(m, one_more).phases[0].total() > plan.memory_cap);
  // The same cap with the checkpoints offloaded leaves the loss more room.
  training_plan offloaded = plan;
  offloaded.offload_checkpoints = true;
  CHECK(estimate_memory(m, offloaded).loss_chunk_tokens > capped.loss_chunk_tokens);
  // Placement: the step fits with on-device checkpoints, so they stay; under a cap just below the loss's
  // moment with a one-token chunk and on-device checkpoints, they move to the host (and the step needs less).
  CHECK_FALSE(with_checkpoints_placed_for_cap(m, plan).offload_checkpoints);
  const memkit::loss::fused_linear_cross_entropy_arguments one_token{
      .tokens = 4096, .hidden = 576, .vocab = 49152, .hidden_element_bytes = 2, .head_grad = false,
      .options = {.chunk_bytes = memkit::loss::chunk_bytes_for(1, 49152, 2), .host_threads = 2}};
  training_plan tight = plan;
  tight.memory_cap = free_run.loss_held_bytes + memkit::loss::bytes_required(one_token) - 1;
  CHECK(estimate_memory(m, tight).loss_chunk_tokens == 0);  // on-device checkpoints: not even one token
  const training_plan placed = with_checkpoints_placed_for_cap(m, tight);
  CHECK(placed.offload_checkpoints);
  const memory_estimate moved = estimate_memory(m, placed);
  CHECK(moved.loss_chunk_tokens > 0);
  CHECK(moved.peak_bytes(metric::allocated) < estimate_memory(m, tight).peak_bytes(metric::allocated));
  CHECK(moved.host_bytes > 0);  // the checkpoints, outside the cap
  // Without a cap, or without checkpointing, nothing is decided.
  training_plan no_cap = tight;
  no_cap.memory_cap = 0;
  CHECK_FALSE(with_checkpoints_placed_for_cap(m, no_cap).offload_checkpoints);
  // The PyTorch runtime has no such loss.
  training_plan torch_plan = plan;
  torch_plan.runtime = runtime_kind::pytorch;
  torch_plan.host_threads = 0;
  CHECK_FALSE(estimate_memory(m, torch_plan).valid());
}
