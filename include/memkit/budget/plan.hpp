// memkit/budget/plan.hpp — a constexpr description of how a model is trained.
//
// Aggregates with defaults, so a plan reads as designated initializers:
//   constexpr training_plan plan{.training = method::lora, .weights = {weight_format::nf4},
//                                .micro_batch = 4, .sequence = 2048};
#pragma once

#include <cstdint>
#include <string_view>

#include "memkit/budget/model.hpp"
#include "memkit/checkpoint/schedule.hpp"
#include "memkit/core/units.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

enum class weight_format : std::uint8_t { fp32, bf16, fp16, int8, nf4, fp4 };

// How the frozen base weights are stored (LoRA / QLoRA). Full training stores weights in the
// precision mode's dtype instead. Quantization applies to the blocks' linear weights; embeddings,
// norms and the LM head stay 16-bit, as bitsandbytes leaves them.
struct weight_storage {
  weight_format format = weight_format::bf16;
  std::uint64_t block_size = 64;  // NF4/FP4 block; int8 uses one scale per row
  bool double_quant = true;
  constexpr bool quantized() const noexcept {
    return format == weight_format::int8 || format == weight_format::nf4 || format == weight_format::fp4;
  }
};

enum class method : std::uint8_t { full, lora };

struct lora_settings {
  std::uint64_t rank = 16;
  module_set targets = all_linear_modules;
  bool dropout = false;  // lora_dropout > 0: each adapter keeps its own dropped copy of its input and a mask
};

enum class precision_mode : std::uint8_t {
  fp32,        // fp32 weights, gradients and activations
  bf16_mixed,  // bf16 weights and gradients, fp32 master weights
  bf16,        // pure bf16: no master copy (stochastic rounding)
  fp16_mixed,  // fp16 weights and gradients, fp32 master weights
};

enum class optimizer_kind : std::uint8_t { adamw, adamw_bf16, adamw_8bit, adamw_4bit, sgd_momentum, adafactor, none };

enum class optimizer_placement : std::uint8_t {
  device,  // states (and master weights) in device memory
  paged,   // managed memory: counted on the device, the driver may evict it to the host under pressure
  host,    // CPU offload: states, master weights and fp32 gradients live on the host
};

// Activation checkpointing (memkit/checkpoint/schedule.hpp): none; every layer; every k layers (one
// checkpoint per segment of k); sqrt (segments of ceil(sqrt(L)) layers); binomial (Griewank's Revolve with
// `checkpoint_slots` checkpoints, each layer taped from the nearest one and run backward alone).
using ::memkit::checkpointing;
enum class attention_impl : std::uint8_t { eager, memory_efficient };
enum class logits_mode : std::uint8_t { fp32, half, chunked };

struct overhead_settings {
  std::uint64_t cuda_context_bytes = 512 * MiB;  // lazy module loading; ~1 GiB when loaded eagerly
  std::uint64_t nccl_bytes = 1 * GiB;            // charged only when training over more than one GPU
  std::uint64_t workspace_bytes = 32 * MiB;      // cuBLAS workspace
  std::uint64_t allocation_granularity = 512;    // every allocation is rounded up to this (PyTorch: 512 B)
  std::uint64_t fragmentation_percent = 0;       // reserved-but-unused share of the caching allocator
};

struct training_plan {
  method training = method::full;
  weight_storage weights{};
  lora_settings lora{};
  precision_mode precision = precision_mode::bf16_mixed;
  optimizer_kind optimizer = optimizer_kind::adamw;
  optimizer_placement placement = optimizer_placement::device;
  bool offload_parameters = false;  // with host placement: weights live on the host, streamed per layer
  bool fused_optimizer = false;     // false: PyTorch's foreach AdamW, which allocates an fp32 temporary per parameter

  std::uint64_t micro_batch = 1;
  std::uint64_t sequence = 2048;
  std::uint64_t grad_accum = 1;
  checkpointing checkpoint = checkpointing::none;
  std::uint64_t checkpoint_every = 1;  // layers per segment for every_k_layers
  std::uint64_t checkpoint_slots = 4;  // checkpoints kept by the binomial schedule
  bool offload_checkpoints = false;    // checkpoints wait in pinned host memory, fetched back one ahead
  attention_impl attention = attention_impl::memory_efficient;
  logits_mode logits = logits_mode::fp32;
  std::uint64_t logits_chunk_tokens = 1024;
  // Hugging Face's Llama-family code computes RMSNorm and softmax in fp32 and autograd keeps the fp32
  // copies; fused kernels keep only 16-bit inputs and per-row statistics.
  bool fp32_norm_and_softmax = true;
  // PEFT's prepare_model_for_kbit_training (the usual QLoRA recipe) casts every weight that is not
  // quantized (embeddings, norms, LM head) to fp32. Norm outputs then come out in fp32,
  // bitsandbytes' 4-bit linears return their input's dtype, and the residual stream and the MLP run
  // in fp32; only the attention kernel's q, k, v are cast back to 16-bit.
  bool kbit_prepared = false;
  // bitsandbytes < 0.43.2: MatMul4Bit saved its input for backward (fixed by bitsandbytes PR #1270).
  bool quantized_matmul_keeps_input = false;

  std::uint64_t gpus = 1;
  int zero_stage = 0;
  overhead_settings overhead{};

  constexpr bool lora_training() const noexcept { return training == method::lora; }
  constexpr bool has_master_weights() const noexcept {
    return precision == precision_mode::bf16_mixed || precision == precision_mode::fp16_mixed;
  }
  // Bytes of the compute dtype, and of the activations the residual stream and MLP keep.
  constexpr std::uint64_t activation_bytes() const noexcept { return precision == precision_mode::fp32 ? 4 : 2; }
  constexpr std::uint64_t stream_bytes() const noexcept { return kbit_prepared ? 4 : activation_bytes(); }
  constexpr std::uint64_t tokens() const noexcept { return micro_batch * sequence; }
  constexpr checkpoint_schedule checkpoint_schedule_of() const noexcept {
    return {checkpoint, checkpoint_every, checkpoint_slots};
  }
};

constexpr std::string_view to_string(precision_mode p) noexcept {
  switch (p) {
    case precision_mode::fp32: return "fp32";
    case precision_mode::bf16_mixed: return "bf16-mixed";
    case precision_mode::bf16: return "bf16";
    case precision_mode::fp16_mixed: return "fp16-mixed";
  }
  return "?";
}
constexpr std::string_view to_string(optimizer_kind o) noexcept {
  switch (o) {
    case optimizer_kind::adamw: return "adamw";
    case optimizer_kind::adamw_bf16: return "adamw-bf16";
    case optimizer_kind::adamw_8bit: return "adamw8bit";
    case optimizer_kind::adamw_4bit: return "adamw4bit";
    case optimizer_kind::sgd_momentum: return "sgd";
    case optimizer_kind::adafactor: return "adafactor";
    case optimizer_kind::none: return "none";
  }
  return "?";
}
constexpr std::string_view to_string(weight_format w) noexcept {
  switch (w) {
    case weight_format::fp32: return "fp32";
    case weight_format::bf16: return "bf16";
    case weight_format::fp16: return "fp16";
    case weight_format::int8: return "int8";
    case weight_format::nf4: return "nf4";
    case weight_format::fp4: return "fp4";
  }
  return "?";
}

}  // namespace budget
MEMKIT_NAMESPACE_END
