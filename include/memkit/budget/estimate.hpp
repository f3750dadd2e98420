// memkit/budget/estimate.hpp — device and host memory of one training step, by category and phase.
//
// The device peak is the largest of three moments of a step, not the sum of everything:
//   forward        persistent state + gradients kept across accumulation + saved activations,
//                  at the end with the logits and loss;
//   backward       walked layer by layer from the head: activations are released as their layer's
//                  gradients are produced (with checkpointing, one segment is recomputed at a time);
//   optimizer      persistent state + all gradients + the optimizer's temporaries.
// Persistent state is weights, master weights, optimizer state and workspace.
// Each moment has three figures (budget/allocator.hpp, docs/memory_budget.md "Which memory"):
//   allocated  the tensor categories (for PyTorch plus the tails of large blocks too small to split, which
//              it hands out whole): what torch.cuda.max_memory_allocated / a tracking_resource reports;
//   reserved   allocated plus the allocator's segment slack (PyTorch's caching allocator; for the
//              memkit runtime nothing) and overhead_settings::fragmentation_percent of allocated;
//   device     reserved plus the CUDA context, over several GPUs NCCL's buffers, with the memkit runtime
//              cuBLAS's own workspace, and a paged optimizer's managed memory: nvidia-smi.
// `overhead` is device minus the tensors, so every breakdown adds up to the device figure, and `device`
// is the breakdown at the moment with the most device memory: device.total() == peak_device_bytes.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "memkit/budget/activations.hpp"
#include "memkit/budget/allocator.hpp"
#include "memkit/budget/breakdown.hpp"
#include "memkit/budget/component_bytes.hpp"
#include "memkit/budget/memkit_step.hpp"
#include "memkit/budget/model.hpp"
#include "memkit/budget/plan.hpp"
#include "memkit/budget/presets.hpp"
#include "memkit/budget/stage3.hpp"
#include "memkit/checkpoint/cost.hpp"
#include "memkit/core/checked_math.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

enum class step_phase : std::uint8_t { forward, backward, optimizer_step };
inline constexpr int step_phase_count = 3;
constexpr std::string_view to_string(step_phase p) noexcept {
  switch (p) {
    case step_phase::forward: return "forward";
    case step_phase::backward: return "backward";
    case step_phase::optimizer_step: return "optimizer_step";
  }
  return "?";
}

struct memory_estimate {
  std::string_view problem;  // empty when the model and plan are valid; otherwise nothing else is set
  std::uint64_t parameters = 0;
  std::uint64_t trainable_parameters = 0;
  breakdown device;                      // at the peak moment: device.total() == peak_device_bytes
  breakdown host;
  breakdown phases[step_phase_count];    // device at each phase's own peak
  memory_figures figures[step_phase_count];  // allocated, reserved and device at each phase's peak
  memory_figures peak;                       // the most of each figure over the step
  step_phase peak_phase = step_phase::forward;  // the phase with the most device memory
  std::uint64_t peak_device_bytes = 0;       // == peak.device
  std::uint64_t host_bytes = 0;
  // Of the device bytes, those in CUDA managed memory (the optimizer state of a paged optimizer,
  // bitsandbytes' paged AdamW): the device holds them while they are resident, but torch's allocator
  // counters (max_memory_allocated / reserved) never see them. Already included in `device`.
  std::uint64_t managed_bytes = 0;
  // memkit runtime, Llama-style: the fused loss's tokens per chunk (training_plan::memory_cap chooses it; 0:
  // not even a one-token chunk fits under the cap).
  std::uint64_t loss_chunk_tokens = 0;
  std::uint64_t loss_held_bytes = 0;  // what the step holds when the loss starts: the cap minus this is its room
  constexpr bool valid() const noexcept { return problem.empty(); }
  constexpr std::uint64_t peak_bytes(metric m) const noexcept { return peak[m]; }
};

constexpr bool detail_is_adam(optimizer_kind o) noexcept {
  return o == optimizer_kind::adamw || o == optimizer_kind::adamw_bf16 || o == optimizer_kind::adamw_8bit ||
         o == optimizer_kind::adamw_4bit;
}

namespace detail {
// Whether every byte count of the estimate stays far inside 64 bits. Each is a sum of products of the plan's
// sizes with the model's: at most (micro-batch x sequence) tokens x the widest per-token tensor (hidden,
// MLP, vocabulary, LoRA rank, or heads x sequence for eager attention scores) x 64 bytes, per layer, plus
// the embedding and head. Bounding that product by 2^62 leaves room for the sums; a plan past it would
// otherwise wrap in unsigned arithmetic and report a small peak that "fits" (issue #15).
constexpr bool plan_sizes_bounded(const model_config& m, const training_plan& p) noexcept {
  constexpr std::uint64_t limit = std::uint64_t{1} << 62;
  const checked<std::uint64_t> tokens = try_mul(p.micro_batch, p.sequence);
  const checked<std::uint64_t> scores = try_mul(m.heads, p.sequence);
  if (!tokens || !scores || !try_mul(tokens.value, p.grad_accum)) return false;
  std::uint64_t width = scores.value;
  for (std::uint64_t w : {m.hidden, m.intermediate, m.vocab, saturating_mul(m.heads, m.head_dim),
                          saturating_mul(m.kv_heads, m.head_dim), m.expert_intermediate, p.lora.rank,
                          p.logits_chunk_tokens})
    width = w > width ? w : width;
  checked<std::uint64_t> bound = try_mul(tokens.value, width);
  if (bound) bound = try_mul(bound.value, std::uint64_t{64});
  if (bound) bound = try_mul(bound.value, saturating_add(m.layers, std::uint64_t{2}));
  // LoRA's own tensors: rank x (in + out) per target, seven targets a layer at most.
  checked<std::uint64_t> lora =
      try_mul(p.lora.rank, saturating_add(saturating_add(m.hidden, m.intermediate), m.vocab));
  if (lora) lora = try_mul(lora.value, std::uint64_t{64} * 8);
  if (lora) lora = try_mul(lora.value, saturating_add(m.layers, std::uint64_t{2}));
  return bound && bound.value <= limit && lora && lora.value <= limit;
}
}  // namespace detail

// More GPUs than any real run: products of per-GPU shares with this count stay far from 2^62.
inline constexpr std::uint64_t max_gpus = std::uint64_t{1} << 16;

// What is wrong with `plan` for `model`, or empty.
constexpr std::string_view plan_problem(const model_config& m, const training_plan& p) noexcept {
  if (!m.valid()) return m.problem();
  if (p.micro_batch == 0) return "micro-batch must be positive";
  if (p.sequence == 0) return "sequence length must be positive";
  if (p.grad_accum == 0) return "gradient accumulation must be positive";
  if (p.gpus == 0) return "number of GPUs must be positive";
  if (p.gpus > max_gpus) return "number of GPUs is past any real run (at most 65536)";
  if (p.zero_stage < 0 || p.zero_stage > 3) return "ZeRO stage must be 0, 1, 2 or 3";
  if (!detail::plan_sizes_bounded(m, p))
    return "micro-batch x sequence (x gradient accumulation, or the LoRA rank) is past any real run: the byte "
           "counts would exceed 2^62";
  if (p.checkpoint == checkpointing::every_k_layers && p.checkpoint_every == 0)
    return "checkpoint_every must be positive";
  if (p.checkpoint == checkpointing::binomial && p.checkpoint_slots == 0) return "checkpoint_slots must be positive";
  if (p.logits == logits_mode::chunked && p.logits_output_chunks == 0) return "logits_output_chunks must be positive";
  if ((p.logits == logits_mode::chunked || p.logits == logits_mode::fused) && p.logits_chunk_tokens == 0)
    return "logits_chunk_tokens must be positive";
  if (p.mlp_token_chunk > 0 && !memkit_block_modelled(m, p))
    return "mlp_token_chunk (the sequence-tiled MLP) is modelled for memkit's Llama-style block only (runtime memkit)";
  if (m.is_gpt2() && p.sequence > m.max_positions)
    return "sequence is longer than the model's learned position table";
  if (p.training == method::full && p.weights.quantized())
    return "full training needs fp32/bf16/fp16 weights; quantized weights train with LoRA";
  if (p.lora_training() && (p.lora.rank == 0 || p.lora.targets == 0))
    return "LoRA needs a positive rank and at least one target module";
  if (p.lora.fp32_adapters && !p.lora_training()) return "fp32 adapters are PEFT's LoRA adapters: they need method lora";
  if (p.lightning_bnb && !p.weights.quantized()) return "lightning-bnb describes quantized (bitsandbytes) weights: use qlora";
  // The rule quantized_tensor enforces (a block size past int64 converts negative and is refused too).
  if ((p.weights.format == weight_format::nf4 || p.weights.format == weight_format::fp4) &&
      !quant::is_valid_block_size(static_cast<std::int64_t>(p.weights.block_size)))
    return "4-bit block size must be a power of two in 32..4096";
  if (p.offload_parameters && p.placement != optimizer_placement::host)
    return "offloading parameters needs the optimizer offloaded to the host too";
  if (p.optimizer_in_backward) {
    if (p.grad_accum > 1) return "the optimizer step in backward frees each gradient at once: it needs grad_accum 1";
    if (p.placement == optimizer_placement::host) return "the optimizer step in backward runs on the device: not with CPU offload";
    if (p.gpus > 1 && p.zero_stage > 0) return "the optimizer step in backward is modelled for one GPU (no ZeRO)";
  }
  if (p.memkit_runtime()) {
    // What memkit has: its losses, optimizers and kernels; PyTorch-only conventions do not apply.
    if (p.logits == logits_mode::fp32 || p.logits == logits_mode::half || p.logits == logits_mode::cut)
      return "memkit's loss is loss::fused_linear_cross_entropy: use logits chunked or fused with the memkit runtime";
    if (!(detail_is_adam(p.optimizer) || p.optimizer == optimizer_kind::none))
      return "memkit's optimizers are adam_state flavours (adamw, adamw-bf16, adamw8bit, adamw4bit) or none";
    if (p.kbit_prepared || p.quantized_matmul_keeps_input || p.lora.fp32_adapters || p.lightning_bnb)
      return "kbit-prepared, bnb-keeps-input, fp32-adapters and lightning-bnb describe PEFT / bitsandbytes / Lightning, "
             "not the memkit runtime";
    if (p.placement == optimizer_placement::paged) return "paged optimizer state is bitsandbytes': not with the memkit runtime";
    if (p.optimizer_in_backward)
      return "memkit's adam_state steps every tensor once after backward (one step counter, global-norm clipping)";
    if (p.gpus > 1 && p.zero_stage == 3) {
      const std::string_view stage3 = stage3_problem(m, p);
      if (!stage3.empty()) return stage3;
    }
  }
  if (p.host_threads > 0 && !p.memkit_runtime()) return "host execution (host_threads) is modelled for the memkit runtime only";
  if (p.memory_cap != 0 && !p.memkit_runtime()) return "memory_cap (the loss's chunk from the memory left) is modelled for the memkit runtime only";
  return {};
}

namespace detail {

// How a frozen tensor is stored: a quantized_tensor of `format` in blocks of `block` (int8: one scale per
// row), or dense with `element_bytes` per element.
struct frozen_storage {
  bool quantized = false;
  quant::format format = quant::format::nf4;
  quant::quant_options options{};
  std::uint64_t element_bytes = 2;
};
constexpr frozen_storage frozen_storage_of(const parameter_tensor& t, const weight_storage& w, bool kbit_prepared) noexcept {
  frozen_storage s;
  if (t.role == tensor_role::linear_weight) {
    switch (w.format) {
      case weight_format::nf4:
      case weight_format::fp4:
        s.quantized = true;
        s.format = w.format == weight_format::nf4 ? quant::format::nf4 : quant::format::fp4;
        s.options = {static_cast<std::int64_t>(w.block_size), w.double_quant};
        return s;
      case weight_format::int8:
        s.quantized = true;
        s.format = quant::format::int8;
        s.options = {static_cast<std::int64_t>(t.cols), false};
        return s;
      case weight_format::fp32: s.element_bytes = 4; return s;
      default: s.element_bytes = 2; return s;
    }
  }
  s.element_bytes = w.format == weight_format::fp32 || kbit_prepared ? 4 : 2;  // quantized models keep the rest in 16-bit
  return s;
}

constexpr std::uint64_t frozen_weight_bytes(const parameter_tensor& t, const weight_storage& w, bool kbit_prepared) noexcept {
  const frozen_storage s = frozen_storage_of(t, w, kbit_prepared);
  if (!s.quantized) return s.element_bytes * t.elements();
  return quant::quantized_tensor_bytes(s.format, shape{static_cast<std::int64_t>(t.elements())}, s.options);
}

constexpr std::uint64_t optimizer_state_bytes(const parameter_tensor& t, optimizer_kind o, bool pure_16bit) noexcept {
  const std::uint64_t n = t.elements();
  switch (o) {
    case optimizer_kind::adamw: return adam_fp32_state_bytes(n);
    case optimizer_kind::adamw_bf16: return adam_bf16_state_bytes(n);
    case optimizer_kind::adamw_8bit: return adam_8bit_state_bytes(n);
    case optimizer_kind::adamw_4bit: return adam_4bit_state_bytes(n);
    case optimizer_kind::sgd_momentum: return (pure_16bit ? 2 : 4) * n;
    case optimizer_kind::adafactor: return 4 * (t.cols > 1 ? t.rows + t.cols : n);  // factored second moment
    case optimizer_kind::none: return 0;
  }
  return 0;
}

// Per-parameter-tensor totals of the trainable and frozen state.
constexpr bool is_adam(optimizer_kind o) noexcept {
  return o == optimizer_kind::adamw || o == optimizer_kind::adamw_bf16 || o == optimizer_kind::adamw_8bit ||
         o == optimizer_kind::adamw_4bit;
}

// The trainable tensors' element counts, in the order parameter_bytes visits them (every copy of a
// tensor type): what a distributed::sharded_adam_state would be made for.
constexpr std::vector<std::int64_t> trainable_tensor_sizes(const model_config& m, const training_plan& p) {
  std::vector<std::int64_t> sizes;
  auto add = [&](const parameter_tensor& t) {
    for (std::uint64_t c = 0; c < t.count; ++c) sizes.push_back(static_cast<std::int64_t>(t.elements()));
  };
  if (!p.lora_training()) for_each_parameter(m, add);
  else for_each_lora_parameter(m, p.lora.rank, p.lora.targets, add);
  return sizes;
}

// ZeRO 1/2 with an Adam flavour: the optimizer state and fp32 master shard of the most loaded rank, from
// distributed::sharded_adam_state's own layout (docs/sharding.md).
struct sharded_totals {
  std::uint64_t optimizer = 0, master = 0;
};
constexpr sharded_totals sharded_adam_bytes(const model_config& m, const training_plan& p) {
  const std::vector<std::int64_t> sizes = trainable_tensor_sizes(m, p);
  sharded_totals r;
  switch (p.optimizer) {
    case optimizer_kind::adamw: r.optimizer = sharded_adam_state_bytes<float, 0>(sizes, p.gpus); break;
    case optimizer_kind::adamw_bf16: r.optimizer = sharded_adam_state_bytes<bf16, 0>(sizes, p.gpus); break;
    case optimizer_kind::adamw_8bit: r.optimizer = sharded_adam_state_bytes<std::int8_t, 256>(sizes, p.gpus); break;
    case optimizer_kind::adamw_4bit: r.optimizer = sharded_adam_state_bytes<optim::four_bit, 128>(sizes, p.gpus); break;
    default: break;
  }
  if (p.has_master_weights()) r.master = sharded_master_bytes(sizes, p.gpus);
  return r;
}

// ZeRO-3: what a rank keeps and stages for the weights, from distributed/sharded_parameters_bytes.hpp (the
// byte functions of sharded_dense / sharded_quantized), tensor by tensor, each piece one allocation:
//   shards     every tensor's shard: whole elements of a dense tensor, whole quantization blocks (with double
//              quantization whole nested groups of 256 blocks) of a quantized one, padded to the same count
//              on every rank;
//   gathered   the whole weights gathered for the units in flight. Units run in order: the embeddings, each
//              block, then the final norm and the head (the tied embedding gathered again); with prefetch
//              the next unit is gathered while one runs, so the largest two neighbours, else the largest one;
//   staging    the all_gather receive buffer of one tensor's gather (every rank's shard), the largest over
//              the model: gathers run one at a time and release it before returning.
// Frozen tensors keep their storage (NF4 / FP4 / int8 or 16-bit); trainable ones (all, or the LoRA adapters)
// are dense in the weights' dtype.
struct stage3_totals {
  std::uint64_t shards = 0, gathered = 0, staging = 0;
};
constexpr stage3_totals stage3_weight_bytes(const model_config& m, const training_plan& p) noexcept {
  const std::uint64_t g = p.overhead.allocation_granularity;
  const int ranks = static_cast<int>(p.gpus);
  stage3_totals r;
  // Whole bytes per unit: before the first block tensor, one block, after the blocks.
  std::uint64_t first = 0, block = 0, last = 0, tied_embedding = 0;
  bool seen_block = false;
  auto add = [&](const parameter_tensor& t, const frozen_storage& s) {
    const shape dims{static_cast<std::int64_t>(t.elements())};
    std::uint64_t shard = 0, whole = 0, staging = 0;
    if (s.quantized) {
      const distributed::quantized_shard_pieces pieces = distributed::quantized_shard_pieces_of(s.format, dims, s.options, ranks);
      shard = round_up(pieces.codes, g) + round_up(pieces.scales, g) + round_up(pieces.groups, g);
      whole = round_up(quant::quantized_tensor_bytes(s.format, dims, s.options), g);
      staging = distributed::quantized_gather_workspace_bytes(s.format, dims, s.options, ranks);
    } else {
      shard = round_up(distributed::dense_shard_bytes(dims, s.element_bytes, ranks), g);
      whole = round_up(s.element_bytes * t.elements(), g);
      staging = distributed::dense_gather_workspace_bytes(dims, s.element_bytes, ranks);
    }
    r.shards += shard * t.count;
    r.staging = max_of(r.staging, round_up(staging, g));
    if (t.per_block) {
      seen_block = true;
      block += whole * (t.count / m.layers);
    } else {
      (seen_block ? last : first) += whole * t.count;
      if (t.role == tensor_role::token_embedding && m.tied_embeddings) tied_embedding = whole;
    }
  };
  frozen_storage dense;
  dense.element_bytes = p.precision == precision_mode::fp32 ? 4 : 2;
  if (!p.lora_training()) {
    for_each_parameter(m, [&](const parameter_tensor& t) { add(t, dense); });
  } else {
    for_each_parameter(m, [&](const parameter_tensor& t) { add(t, frozen_storage_of(t, p.weights, p.kbit_prepared)); });
    for_each_lora_parameter(m, p.lora.rank, p.lora.targets, [&](const parameter_tensor& t) { add(t, dense); });
  }
  last += tied_embedding;
  if (!p.gather_prefetch) r.gathered = max_of(first, max_of(block, last));
  else if (m.layers == 0) r.gathered = first + last;
  else r.gathered = max_of(first + block, max_of(m.layers > 1 ? 2 * block : 0, block + last));
  return r;
}

struct parameter_totals {
  std::uint64_t weights = 0;          // everything the model holds, trainable and frozen
  std::uint64_t gradients = 0;
  std::uint64_t master = 0;
  std::uint64_t optimizer = 0;
  std::uint64_t step_temporary = 0;   // optimizer temporaries during the step
  std::uint64_t largest_gradient = 0;  // the largest trainable tensor's gradient (optimizer in backward)
  std::uint64_t largest_step_temporary = 0;  // the step's temporaries for that tensor alone
  std::uint64_t largest_frozen_linear = 0;  // elements of the largest quantized linear (dequantized tile)
  std::uint64_t layer_weights = 0;    // one block's weights (ZeRO-3 gather, parameter streaming)
  std::uint64_t layer_gradients = 0;  // one block's gradients
  std::uint64_t head_gradients = 0;   // gradient of the LM head (or tied embedding), produced first
  std::uint64_t embedding_gradients = 0;  // produced last (untied / position embeddings)
  std::uint64_t stage3_sharded_whole = 0;  // of `weights`, what memkit's stage 3 shards: the NF4 bases (QLoRA) or all
  // Tensor-size profiles of the categories, for the allocator model (budget/allocator.hpp).
  pool_usage weights_pool, gradients_pool, master_pool, optimizer_pool, temporary_pool;
};

constexpr parameter_totals parameter_bytes(const model_config& m, const training_plan& p) noexcept {
  parameter_totals r;
  const std::uint64_t g = p.overhead.allocation_granularity;
  const std::uint64_t weight_bytes = p.precision == precision_mode::fp32 ? 4 : 2;
  const std::uint64_t gradient_bytes = p.gradient_bytes();
  const bool pure_16bit = p.precision == precision_mode::bf16;
  // torch.optim.AdamW(fused=True) keeps each parameter's `step` counter as an fp32 scalar on the device;
  // foreach keeps it on the host (capturable=False), bitsandbytes as a Python int.
  const bool torch_adam = !p.memkit_runtime() &&
                          (p.optimizer == optimizer_kind::adamw || p.optimizer == optimizer_kind::adamw_bf16);
  const std::uint64_t step_counter = torch_adam && p.fused_optimizer ? round_up(4, g) : 0;
  std::uint64_t largest_trainable = 0;
  std::uint64_t trainable_tensors = 0;
  std::uint64_t trainable_elements = 0;
  std::uint64_t adam_chunks = 0;
  // PEFT's fp32 adapters: fp32 weights and gradients, stepped directly (no master copy).
  const bool fp32_adapters = p.lora_training() && p.lora.fp32_adapters;
  auto trainable = [&](const parameter_tensor& t) {
    const std::uint64_t n = t.elements();
    adam_chunks += adam_reduction_chunks(n) * t.count;
    trainable_tensors += t.count;
    trainable_elements += n * t.count;
    const std::uint64_t w = round_up((fp32_adapters ? 4 : weight_bytes) * n, g);
    const std::uint64_t grad = round_up((fp32_adapters ? 4 : gradient_bytes) * n, g);
    r.weights += w * t.count;
    r.gradients += grad * t.count;
    r.largest_gradient = max_of(r.largest_gradient, grad);
    if (p.has_master_weights() && !fp32_adapters) r.master += round_up(4 * n, g) * t.count;
    const std::uint64_t state = optimizer_state_bytes(t, p.optimizer, pure_16bit);
    r.optimizer += round_up(state, g) * t.count;
    r.weights_pool.add(w, t.count);
    r.gradients_pool.add(grad, t.count);
    r.master_pool.add(4 * n, t.count);
    // Adam flavours keep exp_avg and exp_avg_sq as two tensors per parameter (fp32, bf16, 8-bit codes,
    // packed 4-bit codes), and the blockwise ones their scales as two more.
    const std::uint64_t moment = p.optimizer == optimizer_kind::adamw        ? 4 * n
                                 : p.optimizer == optimizer_kind::adamw_bf16 ? 2 * n
                                 : p.optimizer == optimizer_kind::adamw_8bit ? n
                                 : p.optimizer == optimizer_kind::adamw_4bit ? ceil_div(n, 2)
                                                                             : 0;
    if (moment != 0 && 2 * moment <= state) {
      r.optimizer_pool.add(moment, 2 * t.count);
      r.optimizer_pool.add(ceil_div(state - 2 * moment, 2), 2 * t.count);
    } else {
      r.optimizer_pool.add(state, t.count);
    }
    // foreach AdamW: one temporary per parameter in the state's dtype.
    r.temporary_pool.add((p.optimizer == optimizer_kind::adamw_bf16 ? 2 : 4) * n, t.count);
    largest_trainable = max_of(largest_trainable, n);
    if (t.per_block) {
      const std::uint64_t per_block = t.count / m.layers;
      r.layer_gradients += grad * per_block;
      r.layer_weights += w * per_block;
    }
    if (t.role == tensor_role::lm_head || (t.role == tensor_role::token_embedding && m.tied_embeddings))
      r.head_gradients += grad;
    else if (t.role == tensor_role::token_embedding || t.role == tensor_role::position_embedding)
      r.embedding_gradients += grad;
  };
  if (!p.lora_training()) {
    for_each_parameter(m, trainable);
    r.stage3_sharded_whole = r.weights;
  } else {
    for_each_parameter(m, [&](const parameter_tensor& in) {
      // Lightning's bitsandbytes plugin quantizes the (untied) LM head like any other linear.
      parameter_tensor t = in;
      if (p.lightning_bnb && t.role == tensor_role::lm_head && t.cols != 1) t.role = tensor_role::linear_weight;
      const std::uint64_t w = round_up(frozen_weight_bytes(t, p.weights, p.kbit_prepared), g);
      r.weights += w * t.count;
      // bitsandbytes keeps a quantized weight's packed data and its scales as separate tensors.
      const std::uint64_t packed = t.role != tensor_role::linear_weight ? 0
                                   : p.weights.format == weight_format::int8 ? t.elements()
                                   : p.weights.quantized()                   ? ceil_div(t.elements(), 2)
                                                                             : 0;
      r.weights_pool.add(packed, t.count);
      r.weights_pool.add(w - packed, t.count);
      if (t.per_block) r.layer_weights += w * (t.count / m.layers);
      if (t.role == tensor_role::linear_weight && p.weights.format == weight_format::nf4) r.stage3_sharded_whole += w * t.count;
      if (t.role == tensor_role::linear_weight && p.weights.quantized())
        r.largest_frozen_linear = max_of(r.largest_frozen_linear, t.elements());
    });
    for_each_lora_parameter(m, p.lora.rank, p.lora.targets, trainable);
  }
  // memkit's adam_state adds one control block and its gradient-norm scratch per state (memkit runtime);
  // torch's fused AdamW one device `step` counter per parameter tensor (PyTorch runtime).
  if (p.memkit_runtime() && is_adam(p.optimizer)) r.optimizer += round_up(adam_overhead_bytes(adam_chunks), g);
  r.optimizer += step_counter * trainable_tensors;
  // torch's foreach AdamW (torch/optim/adamw.py, _multi_tensor_adam; grouped per device and dtype):
  // everything it does to the moments and parameters is in place (_foreach_lerp_, _foreach_mul_,
  // _foreach_addcmul_, _foreach_addcdiv_) except `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`,
  // one new tensor per parameter in the state's dtype, alive until the group's update is done: one
  // temporary the size of all trainable parameters (fp32 states: 4 bytes each; bf16 states: 2).
  // fused=True, bitsandbytes' blockwise optimizers and memkit's adam_state work in place.
  // Adafactor builds fp32 temporaries per tensor.
  if (torch_adam && !p.fused_optimizer) {
    const std::uint64_t state_bytes = p.optimizer == optimizer_kind::adamw ? 4 : 2;
    r.step_temporary = state_bytes * trainable_elements;
    r.largest_step_temporary = round_up(state_bytes * largest_trainable, g);
  }
  if (p.optimizer == optimizer_kind::adafactor) r.largest_step_temporary = r.step_temporary = 3 * 4 * largest_trainable;
  return r;
}

}  // namespace detail

// Whose allocator serves the step's tensors: PyTorch's caching allocator, or an exact one (every tensor its
// bytes, nothing cached) for the memkit runtime, whose resources are exact, and for an allocation
// granularity of 1 byte, which no caching allocator has (PyTorch rounds every block to 512).
constexpr allocator_kind allocator_of(const training_plan& p) noexcept {
  return p.memkit_runtime() || p.overhead.allocation_granularity <= 1 ? allocator_kind::memkit_exact
                                                                       : allocator_kind::pytorch_caching;
}

constexpr memory_estimate estimate_memory(const model_config& m, const training_plan& p) noexcept {
  memory_estimate out;
  out.problem = plan_problem(m, p);
  if (!out.valid()) return out;
  out.parameters = parameter_count(m);
  out.trainable_parameters = p.lora_training() ? lora_parameter_count(m, p.lora.rank, p.lora.targets) : out.parameters;

  const detail::parameter_totals params = detail::parameter_bytes(m, p);
  const std::uint64_t N = p.gpus;
  const int zero = N > 1 ? p.zero_stage : 0;
  // ZeRO-3: the PyTorch runtime's (FSDP's) terms from the shard classes' byte functions; the memkit runtime's
  // are what stage3_parameters allocates (budget/stage3.hpp), the worst rank per category.
  const bool memkit_stage3 = zero == 3 && p.memkit_runtime();
  const detail::stage3_totals stage3 =
      zero == 3 && !memkit_stage3 ? detail::stage3_weight_bytes(m, p) : detail::stage3_totals{};
  const distributed::stage3_bytes runtime3 = memkit_stage3 ? stage3_runtime_bytes(m, p) : distributed::stage3_bytes{};
  const bool host_optimizer = p.placement == optimizer_placement::host;

  // --- persistent device and host state ---
  breakdown persistent;
  breakdown& host = out.host;
  if (p.offload_parameters) {
    host[category::weights] = params.weights;
    persistent[category::weights] = 2 * params.layer_weights;  // the layer in use and the one prefetched
  } else if (memkit_stage3) {
    // The runtime's slices and gather buffers, plus what stays whole on every rank: a QLoRA model's frozen
    // dense tensors and its adapters (full training: nothing, every tensor is a unit's).
    persistent[category::weights] =
        round_up(runtime3.weights, p.overhead.allocation_granularity) + params.weights - params.stage3_sharded_whole;
    persistent[category::workspace] = round_up(stage3_transient_workspace_bytes(m, p), p.overhead.allocation_granularity);
  } else if (zero == 3) {
    persistent[category::weights] = stage3.shards + stage3.gathered;
    persistent[category::workspace] = stage3.staging;  // the all_gather's receive buffer
  } else {
    persistent[category::weights] = params.weights;
  }
  // ZeRO 1/2/3 with Adam: sharded_adam_state's per-rank bytes (other optimizers: an even split).
  const bool sharded_adam = zero >= 1 && detail::is_adam(p.optimizer);
  const detail::sharded_totals sharded = sharded_adam ? detail::sharded_adam_bytes(m, p) : detail::sharded_totals{};
  const std::uint64_t granularity = p.overhead.allocation_granularity;
  std::uint64_t master = !(zero >= 1)   ? params.master
                         : sharded_adam ? round_up(sharded.master, granularity)
                                        : ceil_div(params.master, N);
  std::uint64_t optimizer = !(zero >= 1)   ? params.optimizer
                            : sharded_adam ? round_up(sharded.optimizer, granularity)
                                           : ceil_div(params.optimizer, N);
  std::uint64_t gradients = zero >= 2 ? ceil_div(params.gradients, N) + params.layer_gradients : params.gradients;
  if (memkit_stage3) {
    // Full training: the runtime's gradient slices, its slots' gradient buffers and the reduction's staging;
    // QLoRA: the replicated adapters' whole gradients and Adam states (params' LoRA terms) besides.
    const std::uint64_t lora = p.lora_training() ? 1 : 0;
    const std::uint64_t g3 = p.overhead.allocation_granularity;
    gradients = round_up(runtime3.gradients, g3) + lora * params.gradients;
    master = round_up(runtime3.master, g3) + lora * params.master;
    optimizer = round_up(runtime3.optimizer_state - runtime3.master, g3) + lora * params.optimizer;
  }
  std::uint64_t step_temporary = zero >= 1 ? ceil_div(params.step_temporary, N) : params.step_temporary;
  // torchtune's optimizer_in_bwd: a parameter's step runs (and its gradient is freed) as soon as its
  // gradient is accumulated, so at most the largest one is alive, with that one tensor's step temporaries,
  // during backward; there is no separate optimizer phase.
  const bool step_in_backward = p.optimizer_in_backward;
  if (step_in_backward) gradients = params.largest_gradient;
  if (host_optimizer) {
    host[category::master_weights] = master;
    host[category::optimizer_state] = optimizer;
    // The host keeps fp32 gradients; the device only a double-buffered bucket of one layer's.
    const std::uint64_t grad_bytes = p.precision == precision_mode::fp32 ? 4 : 2;
    host[category::gradients] = zero >= 2 ? ceil_div(params.gradients, N) * 4 / grad_bytes
                                          : params.gradients * 4 / grad_bytes;
    gradients = 2 * params.layer_gradients + params.head_gradients;
    step_temporary = 0;  // the CPU optimizer steps on the host
  } else {
    persistent[category::master_weights] = master;
    persistent[category::optimizer_state] = optimizer;
    if (p.placement == optimizer_placement::paged) out.managed_bytes = optimizer;
  }
  const std::uint64_t g = p.overhead.allocation_granularity;
  // PyTorch: bitsandbytes dequantizes a quantized base one linear at a time into a 16-bit copy of the
  // whole weight. memkit: the largest workspace one of its linears takes (lora_linear / quant::matmul).
  // Lightning's plugin quantized from fp16: an fp16 dequantized weight, then its bf16 copy (plan.lightning_bnb).
  const std::uint64_t dequantized_copies = p.lightning_bnb ? 2 : 1;
  persistent[category::workspace] +=
      p.overhead.workspace_bytes +
      (p.memkit_runtime() ? round_up(memkit_linear_workspace_bytes(m, p), g)
                          : dequantized_copies * round_up(2 * params.largest_frozen_linear, g));
  // Outside any allocator: the CUDA context, NCCL's buffers when there is more than one GPU, and with the
  // memkit runtime the cuBLAS workspace (memkit never calls cublasSetWorkspace: cuBLAS allocates its own;
  // PyTorch hands cuBLAS one from its caching allocator, so there it is a tensor of `workspace`).
  const bool cublas_outside = p.memkit_runtime();
  if (cublas_outside) persistent[category::workspace] -= p.overhead.workspace_bytes;
  const std::uint64_t outside_allocator = p.overhead.cuda_context_bytes + (N > 1 ? p.overhead.nccl_bytes : 0) +
                                          (cublas_outside ? p.overhead.workspace_bytes : 0);

  // --- activations ---
  const block_activations block = block_activation_bytes(m, p);
  const std::uint64_t extras = model_level_activation_bytes(m, p);
  const logits_bytes logits = logits_activation_bytes(m, p);
  const std::uint64_t L = m.layers;
  const std::uint64_t layer_input = round_up(p.stream_bytes() * p.tokens() * m.hidden, g);
  // The blocks' saved tensors and checkpoints at every moment of the schedule (checkpoint/schedule.hpp).
  const ::memkit::checkpoint::checkpoint_trace blocks =
      ::memkit::checkpoint::trace_checkpointing(p.checkpoint_schedule_of(), L, layer_input, block.saved_bytes, p.offload_checkpoints);
  host[category::activations] = blocks.host_bytes;  // offloaded checkpoints
  out.host_bytes = host.total();
  const std::uint64_t saved_blocks = blocks.after_forward;
  const std::uint64_t grads_kept_in_forward = p.grad_accum > 1 ? gradients : 0;

  auto with = [&](breakdown b, std::uint64_t grads, std::uint64_t activations, std::uint64_t logit_bytes,
                  std::uint64_t extra_workspace) {
    b[category::gradients] = grads;
    b[category::activations] = activations;
    b[category::logits] = logit_bytes;
    b[category::workspace] += extra_workspace;
    return b;
  };
  auto larger = [](const breakdown& a, const breakdown& b) { return b.total() > a.total() ? b : a; };

  // Forward: the last block's temporaries, then the logits and loss on top of everything saved.
  breakdown forward = with(persistent, grads_kept_in_forward, saved_blocks + extras + block.forward_transient, 0, 0);
  forward = larger(forward, with(persistent, grads_kept_in_forward, saved_blocks + extras, logits.forward_peak, 0));
  out.phases[0] = forward;

  // Backward, from the loss: the head's gradient first, then block by block.
  auto grads_so_far = [&](std::uint64_t produced) {
    if (p.grad_accum > 1 || host_optimizer || step_in_backward) return gradients;  // allocated, a bucket, or one
    return produced < gradients ? produced : gradients;
  };
  const std::uint64_t backward_workspace = step_in_backward ? params.largest_step_temporary : 0;
  const breakdown at_loss = with(persistent, grads_so_far(params.head_gradients), saved_blocks + extras,
                                 logits.backward_peak, backward_workspace);
  breakdown backward = at_loss;
  for (std::uint64_t i = L; i-- > 0;) {
    // Layer i runs backward: what blocks 0..i (or their checkpoints) still keep, plus its temporaries.
    const std::uint64_t activations = extras + block.backward_transient + blocks.at_backward(i);
    const std::uint64_t produced = params.head_gradients + (L - i) * params.layer_gradients;
    backward = larger(backward, with(persistent, grads_so_far(produced), activations, 0, backward_workspace));
  }
  // A tied embedding's gradient arrives twice: the LM head's first, then embedding_dense_backward's, a new
  // [vocab, hidden] tensor (at::zeros in aten/src/ATen/native/cuda/Embedding.cu), and autograd sums the two out of
  // place (an aten::add of two [vocab, hidden] tensors in torch's profiler, torch 2.15 on the CPU): the
  // embedding's gradient and the sum are alive next to the head's. Untied, the embedding's gradient is its own
  // (counted above).
  const std::uint64_t tied_embedding_grad =
      m.tied_embeddings && !p.lora_training() && !p.memkit_runtime() && !step_in_backward && !host_optimizer
          ? 2 * params.head_gradients
          : 0;
  backward = larger(backward, with(persistent, grads_so_far(gradients) + tied_embedding_grad, extras, 0,
                                   backward_workspace));
  out.phases[1] = backward;

  breakdown step = step_in_backward ? with(persistent, 0, 0, 0, 0) : with(persistent, gradients, 0, 0, step_temporary);
  out.phases[2] = step;

  // memkit runtime, Llama-style blocks: the step as a memkit training loop runs it (budget/memkit_step.hpp).
  // Gradients are allocated up front; the linears' workspace is part of each block's temporaries; the rotary
  // table (fp32 cos and sin, [max_positions, head_dim / 2] each) lives with the weights; no logits exist.
  if (memkit_block_modelled(m, p)) {
    breakdown base = persistent;
    base[category::weights] += round_up(4 * 2 * m.max_positions * (m.head_dim / 2), g);
    base[category::workspace] -= round_up(memkit_linear_workspace_bytes(m, p), g);
    const memkit_step_moments moments = memkit_step_activations(m, p, base.total() + gradients);
    out.loss_chunk_tokens = moments.loss_chunk_tokens;
    out.loss_held_bytes = moments.loss_held_bytes;
    // The stack checkpoints the final norm's input too (memkit::checkpoint::segment over blocks + norm).
    host[category::activations] = moments.host_bytes;
    out.host_bytes = host.total();
    for (int i = 0; i < step_phase_count; ++i)
      out.phases[i] = with(base, gradients, moments.activations[i], 0, moments.workspace[i]);
  }

  // --- allocated, reserved, device ---
  // The activations' tensor sizes are one block's saved tensors; the logits a tensor of their own; the
  // workspace the cuBLAS workspace, the dequantized tile and (in the step) the optimizer's temporaries.
  pool_usage activation_pool;
  for (int i = 0; i < block.count; ++i) activation_pool.add(block.items[i].bytes);
  const allocator_kind allocator = allocator_of(p);
  // The caching allocator's segments for a moment's live tensors: its allocated figure (unsplit blocks count
  // whole) and its reserved figure, before the cache's memory of earlier phases.
  // `tied_pair`: bytes of b's gradients that are two tensors of their own (a tied embedding's second gradient
  // and the sum).
  auto caching_figures = [&](const breakdown& b, std::uint64_t tied_pair = 0) {
    memory_figures f;
    const std::uint64_t counted = b.total() - out.managed_bytes;
    f.allocated = counted;
    f.reserved = counted + counted * p.overhead.fragmentation_percent / 100;
    pool_usage live;
    live.add_as(params.weights_pool, b[category::weights]);
    live.add_as(params.gradients_pool, b[category::gradients] - tied_pair);
    if (tied_pair != 0) live.add(tied_pair / 2, 2);
    live.add_as(params.master_pool, b[category::master_weights]);
    live.add_as(params.optimizer_pool, b[category::optimizer_state] - out.managed_bytes);
    live.add_as(activation_pool, b[category::activations]);
    live.add(b[category::logits]);
    live.add(p.overhead.workspace_bytes);
    for (std::uint64_t i = 0; i < dequantized_copies; ++i) live.add(2 * params.largest_frozen_linear);
    live.add_as(params.temporary_pool, b[category::workspace] - persistent[category::workspace]);
    // An unsplit block is handed out whole and counted as allocated (allocated_bytes adds its size).
    f.allocated += live.unsplit_tails();
    f.reserved += live.slack();
    return f;
  };
  std::uint64_t reserved_so_far = 0;
  for (int i = 0; i < step_phase_count; ++i) {
    breakdown& b = out.phases[i];
    memory_figures& f = out.figures[i];
    const std::uint64_t tensors = b.total();
    // A paged optimizer's state is in managed memory: on the device, unseen by the allocator's counters.
    const std::uint64_t counted = tensors - out.managed_bytes;
    f.allocated = counted;
    f.reserved = counted + counted * p.overhead.fragmentation_percent / 100;
    if (allocator == allocator_kind::pytorch_caching) {
      const bool tied_moment = i == static_cast<int>(step_phase::backward) && tied_embedding_grad != 0 &&
                               b[category::gradients] == gradients + tied_embedding_grad;
      f = caching_figures(b, tied_moment ? tied_embedding_grad : 0);
      // Backward starts at the loss, whose freed forward segments the cache keeps (logits_bytes): whatever
      // moment sets the phase's tensors, the phase holds at least the segments of that one.
      if (i == static_cast<int>(step_phase::backward) && !memkit_block_modelled(m, p))
        f.reserved = max_of(f.reserved, caching_figures(at_loss).reserved + logits.reserved_at_backward_peak -
                                            logits.backward_peak);
      // The cache keeps what it reserved: a later phase holds at least an earlier one's segments.
      f.reserved = max_of(f.reserved, reserved_so_far);
      reserved_so_far = f.reserved;
    }
    f.device = f.reserved + out.managed_bytes + outside_allocator;
    b[category::overhead] = f.device - tensors;
    out.peak.allocated = max_of(out.peak.allocated, f.allocated);
    out.peak.reserved = max_of(out.peak.reserved, f.reserved);
    out.peak.device = max_of(out.peak.device, f.device);
  }
  int peak = 0;
  for (int i = 1; i < step_phase_count; ++i)
    if (out.figures[i].device > out.figures[peak].device) peak = i;
  out.peak_phase = static_cast<step_phase>(peak);
  out.device = out.phases[peak];
  out.peak_device_bytes = out.peak.device;
  return out;
}

struct fit_report {
  memory_estimate estimate;
  std::uint64_t available_bytes = 0;
  metric compared = metric::device;  // which figure was held against the GPU's memory
  bool fits = false;
  constexpr std::uint64_t needed_bytes() const noexcept { return estimate.peak_bytes(compared); }
  constexpr std::uint64_t shortfall_bytes() const noexcept {
    return needed_bytes() > available_bytes ? needed_bytes() - available_bytes : 0;
  }
};

// Does the step fit the GPU's memory? By default the device figure (what nvidia-smi shows) is compared;
// `which` compares the allocated or reserved figure instead.
constexpr fit_report check_fit(const model_config& m, const training_plan& p, const gpu_spec& gpu,
                               metric which = metric::device) noexcept {
  fit_report r;
  r.estimate = estimate_memory(m, p);
  r.available_bytes = gpu.memory_bytes;
  r.compared = which;
  r.fits = r.estimate.valid() && r.estimate.peak_bytes(which) <= gpu.memory_bytes;
  return r;
}

// The long-context default (#31), memkit runtime under a memory cap: the checkpoints stay on the device when
// the step fits the cap with them there, and wait in host memory (pinned on a device; outside the cap)
// otherwise. Returns the plan with offload_checkpoints so chosen; without a cap or checkpointing, unchanged.
// examples/train_llama.cpp decides with this function (--offload-checkpoints auto), so the driver and the
// budget cannot disagree on where the checkpoints are.
constexpr training_plan with_checkpoints_placed_for_cap(const model_config& m, training_plan p) noexcept {
  if (p.memory_cap == 0 || p.checkpoint == checkpointing::none) return p;
  p.offload_checkpoints = false;
  const memory_estimate on_device = estimate_memory(m, p);
  p.offload_checkpoints = on_device.valid() && on_device.peak_bytes(metric::allocated) > p.memory_cap;
  return p;
}

}  // namespace budget
MEMKIT_NAMESPACE_END
