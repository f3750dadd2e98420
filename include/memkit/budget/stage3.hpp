// memkit/budget/stage3.hpp — memory_budget's ZeRO-3 terms for the memkit runtime: what the stage-3 runtime
// (distributed/stage3.hpp, stage3_parameters, over models::llama::stage3_units) allocates per rank, from its own
// byte functions (distributed/stage3_bytes.hpp) applied to the model's shape; no runtime code.
//
//   stage3_problem(m, p)                  what the memkit runtime's stage 3 cannot run, or empty
//   stage3_unit_shapes(m, p)              the runtime's units for this model and plan
//   stage3_runtime_bytes(m, p, rank)      rank's bytes per category (rank < 0: per category, the worst rank)
//   stage3_transient_workspace_bytes      the most the runtime (an NF4 gather's staging) or the adapters'
//                                         ordered all-reduce take from the workspace at once
//
// What the runtime does not hold (budget/estimate.hpp adds it): the frozen dense tensors of a QLoRA model
// (embedding, norms, head: whole on every rank) and the LoRA adapters with their gradients and adam_state
// (replicated, their gradients summed in rank order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "memkit/budget/model.hpp"
#include "memkit/budget/plan.hpp"
#include "memkit/config.hpp"
#include "memkit/distributed/stage3_bytes.hpp"
#include "memkit/optim/adam_bytes.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

// What the memkit runtime's stage 3 runs: a Llama-style decoder (models/llama), full training (every tensor a
// unit's) or QLoRA over NF4 bases (the bases units', the rest whole), an adam_state flavour, one backward per
// step, prefetch (two gather buffers in slot 0) or not.
constexpr std::string_view stage3_problem(const model_config& m, const training_plan& p) noexcept {
  if (!(m.family == architecture::llama && m.gated_mlp() && !m.moe() && !m.fused_qkv && !m.fused_gate_up &&
        m.norm == norm_kind::rms && m.norms_per_block == 2 && m.final_norm && !m.parallel_attention &&
        !m.learned_positions && m.token_types == 0 && !m.embedding_norm && !m.pooler && !m.lm_head_bias &&
        m.vision.hidden == 0 && m.qk_norm != qk_norm_kind::full_width))
    return "memkit's stage 3 runs the Llama-family decoder (models/llama): not this architecture";
  if (p.lora_training() && p.weights.format != weight_format::nf4)
    return "memkit's stage 3 shards trainable dense tensors (full training) or NF4 bases (QLoRA); a frozen 16-bit or "
           "int8/fp4 base would stay whole on every rank: use --zero 2, or --weights nf4";
  if (!(p.optimizer == optimizer_kind::adamw || p.optimizer == optimizer_kind::adamw_bf16 ||
        p.optimizer == optimizer_kind::adamw_8bit || p.optimizer == optimizer_kind::adamw_4bit))
    return "memkit's stage 3 steps each unit with sharded_adam_state: an adamw flavour";
  if (p.grad_accum > 1)
    return "memkit's stage 3 reduces each unit's gradients once per step (one backward per unit): grad_accum 1";
  if (p.placement != optimizer_placement::device || p.offload_parameters)
    return "memkit's stage 3 keeps its shards on the device: no offload";
  return {};
}

constexpr distributed::decoder_stage3_dims stage3_dims(const model_config& m) noexcept {
  distributed::decoder_stage3_dims d;
  d.vocab = static_cast<std::int64_t>(m.vocab), d.hidden = static_cast<std::int64_t>(m.hidden);
  d.layers = static_cast<std::int64_t>(m.layers), d.intermediate = static_cast<std::int64_t>(m.intermediate);
  d.q_width = static_cast<std::int64_t>(m.q_width()), d.kv_width = static_cast<std::int64_t>(m.kv_width());
  d.qk_norm = m.qk_norm == qk_norm_kind::per_head ? static_cast<std::int64_t>(m.head_dim) : 0;
  d.qkv_bias = m.qkv_bias, d.o_bias = m.o_bias, d.mlp_bias = m.mlp_bias, d.tied_embeddings = m.tied_embeddings;
  return d;
}

// The runtime's units: full training, every tensor trainable in its block's unit or the outer one (fp32 master
// slices with bf16-mixed); QLoRA, each block's seven NF4 bases (the plan's block size and double quantization).
constexpr std::vector<distributed::stage3_unit_shape> stage3_unit_shapes(const model_config& m, const training_plan& p) {
  const bool full = !p.lora_training();
  const quant::quant_options nf4{static_cast<std::int64_t>(p.weights.block_size), p.weights.double_quant};
  return distributed::decoder_stage3_unit_shapes(stage3_dims(m), full, full && p.has_master_weights(), full ? nullptr : &nf4);
}

namespace detail {
template <class State, int Block>
constexpr distributed::stage3_bytes stage3_runtime_bytes_of(std::span<const distributed::stage3_unit_shape> units,
                                                            std::size_t value_bytes, int rank, int ranks, bool prefetch) {
  using layout = distributed::stage3_layout<State, Block>;
  const int two_in_slot_0[] = {2};
  const std::span<const int> buffers = prefetch ? std::span<const int>(two_in_slot_0) : std::span<const int>();
  return rank < 0 ? layout::max_bytes_per_rank(units, value_bytes, ranks, optim::default_min_quantized_size, buffers)
                  : layout::bytes_required(units, value_bytes, rank, ranks, optim::default_min_quantized_size, buffers);
}
}  // namespace detail

// What rank `rank` of p.gpus allocates in stage3_parameters for this model (rank < 0: each category's most over
// the ranks), with p.gather_prefetch's buffers (two in slot 0: the block running and the next one).
constexpr distributed::stage3_bytes stage3_runtime_bytes(const model_config& m, const training_plan& p, int rank = -1) {
  const std::vector<distributed::stage3_unit_shape> units = stage3_unit_shapes(m, p);
  const std::size_t value_bytes = p.precision == precision_mode::fp32 ? 4 : 2;
  const int ranks = static_cast<int>(p.gpus);
  switch (p.optimizer) {
    case optimizer_kind::adamw_bf16:
      return detail::stage3_runtime_bytes_of<bf16, 0>(units, value_bytes, rank, ranks, p.gather_prefetch);
    case optimizer_kind::adamw_8bit:
      return detail::stage3_runtime_bytes_of<std::int8_t, 256>(units, value_bytes, rank, ranks, p.gather_prefetch);
    case optimizer_kind::adamw_4bit:
      return detail::stage3_runtime_bytes_of<optim::four_bit, 128>(units, value_bytes, rank, ranks, p.gather_prefetch);
    default: return detail::stage3_runtime_bytes_of<float, 0>(units, value_bytes, rank, ranks, p.gather_prefetch);
  }
}

// The most taken from the workspace at once besides the step's own: an NF4 gather's staging (released before
// the gather returns) or, with LoRA, the ordered all-reduce of the largest adapter's gradients after backward;
// the two never overlap.
constexpr std::size_t stage3_transient_workspace_bytes(const model_config& m, const training_plan& p) {
  const std::vector<distributed::stage3_unit_shape> units = stage3_unit_shapes(m, p);
  const int ranks = static_cast<int>(p.gpus);
  std::size_t most = distributed::stage3_layout<float>::gather_workspace_bytes(units, ranks);
  if (p.lora_training())
    for_each_lora_parameter(m, p.lora.rank, p.lora.targets, [&](const parameter_tensor& t) {
      const std::size_t b = distributed::ordered_all_reduce_workspace_bytes(static_cast<std::int64_t>(t.elements()), ranks);
      most = b > most ? b : most;
    });
  return most;
}

}  // namespace budget
MEMKIT_NAMESPACE_END
