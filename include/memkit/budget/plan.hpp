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
  // PEFT's get_peft_model(autocast_adapter_dtype=True), its default: adapters of a 16-bit model are created in
  // fp32 (fp32 weights and gradients, no master copy), and each adapter casts its 16-bit input to fp32
  // (LoraLayer._cast_input_dtype) before lora_A, which keeps that fp32 copy for its weight gradient; the
  // down-projection lora_B keeps is fp32 too. PyTorch runtime only.
  bool fp32_adapters = false;
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
using ::memkit::checkpoint::checkpointing;
enum class attention_impl : std::uint8_t { eager, memory_efficient };
// The loss over the LM head (docs/memory_budget.md, "The loss"):
//   fp32     16-bit logits, their fp32 copy and fp32 log-softmax (transformers' default path)
//   half     cross-entropy of the 16-bit logits, no upcast (LitGPT, `--logits bf16`)
//   chunked  PyTorch: torchtune's CEWithChunkedOutputLoss (all 16-bit logit chunks kept, one chunk upcast
//            to fp32 at a time); memkit: loss::fused_linear_cross_entropy
//   fused    linear + cross-entropy fused, the logits never held: PyTorch: Liger's
//            LigerFusedLinearCrossEntropy (one chunk of 16-bit logits, its gradient computed in forward);
//            memkit: loss::fused_linear_cross_entropy
//   cut      Cut Cross-Entropy (Wijmans et al. 2024): no logits at all, fp32 log-sum-exp per token
enum class logits_mode : std::uint8_t { fp32, half, chunked, fused, cut };

// Which software runs the step:
//   pytorch  transformers / PEFT / bitsandbytes / torchtune conventions (16-bit gradients, PEFT's dropout
//            masks, torch AdamW's foreach temporaries, ...)
//   memkit   memkit's own components: every term from the bytes_required / workspace / saved-bytes
//            functions the components allocate by (lora_linear, quantized_tensor, adam_state,
//            attention, loss::fused_linear_cross_entropy, memkit::checkpoint::segment)
enum class runtime_kind : std::uint8_t { pytorch, memkit };

struct overhead_settings {
  std::uint64_t cuda_context_bytes = 512 * MiB;  // lazy module loading; ~1 GiB when loaded eagerly
  std::uint64_t nccl_bytes = 1 * GiB;            // charged only when training over more than one GPU
  std::uint64_t workspace_bytes = 32 * MiB;      // cuBLAS workspace
  std::uint64_t allocation_granularity = 512;    // every allocation is rounded up to this (PyTorch: 512 B)
  std::uint64_t fragmentation_percent = 0;       // reserved-but-unused share of the caching allocator
};

// No GPU-only terms: what a host run (training_plan::host_threads > 0) allocates, byte for byte.
inline constexpr overhead_settings host_overhead{.cuda_context_bytes = 0, .nccl_bytes = 0, .workspace_bytes = 0,
                                                 .allocation_granularity = 1, .fragmentation_percent = 0};

struct training_plan {
  runtime_kind runtime = runtime_kind::pytorch;
  method training = method::full;
  weight_storage weights{};
  lora_settings lora{};
  precision_mode precision = precision_mode::bf16_mixed;
  optimizer_kind optimizer = optimizer_kind::adamw;
  optimizer_placement placement = optimizer_placement::device;
  bool offload_parameters = false;  // with host placement: weights live on the host, streamed per layer
  // PyTorch's AdamW implementation: false is foreach (the default on CUDA), whose step allocates one
  // temporary the size of every trainable parameter in the state's dtype (the sqrt of v); true is
  // fused=True, which works in place and keeps its `step` counters on the device. memkit's adam_state is
  // always in place.
  bool fused_optimizer = false;
  // torchtune's optimizer_in_bwd: each parameter is stepped (and its gradient freed) as soon as its
  // gradient is accumulated, so at most one parameter's gradient is alive. Needs grad_accum 1.
  bool optimizer_in_backward = false;

  std::uint64_t micro_batch = 1;
  std::uint64_t sequence = 2048;
  std::uint64_t grad_accum = 1;
  checkpointing checkpoint = checkpointing::none;
  std::uint64_t checkpoint_every = 1;  // layers per segment for every_k_layers
  std::uint64_t checkpoint_slots = 4;  // checkpoints kept by the binomial schedule
  bool offload_checkpoints = false;    // checkpoints wait in pinned host memory, fetched back one ahead
  attention_impl attention = attention_impl::memory_efficient;
  logits_mode logits = logits_mode::fp32;
  std::uint64_t logits_chunk_tokens = 1024;  // memkit's fused_linear_cross_entropy: tokens per chunk
  std::uint64_t logits_output_chunks = 8;    // torchtune's num_output_chunks (chunks along the sequence)
  // memkit runtime: the decoder block's sequence-tiled MLP (memkit/models/llama/block.hpp, decoder_block::
  // mlp_token_chunk): gate/up -> SwiGLU -> down over chunks of this many tokens, recomputed in backward. 0: untiled.
  std::uint64_t mlp_token_chunk = 0;
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
  // Lightning's BitsandbytesPrecision (LitGPT's --quantize bnb.nf4 ...; lightning/fabric/plugins/precision/
  // bitsandbytes.py): it replaces every nn.Linear, the LM head included (when not tied), and quantizes each weight
  // from fp16 (`weight.to(torch.half)` before quantize_4bit), so bitsandbytes dequantizes to an fp16 weight and
  // MatMul4Bit then casts it to the bf16 compute dtype: two whole-weight transients per 4-bit matmul, not one.
  bool lightning_bnb = false;

  // memkit runtime: where the step runs. 0: on a CUDA device (cuBLAS and the components' device kernels).
  // N > 0: on the host with N threads, as examples/train_llama.cpp runs: every workspace term is then the
  // components' host figure (linalg::gemm's per-thread packing, memkit::attention's per-thread tiles,
  // lora_linear / quant::matmul / the fused loss on the host). There is no CUDA context or cuBLAS on the
  // host: set `overhead` to zero (budget::host_overhead).
  std::uint64_t host_threads = 0;

  std::uint64_t gpus = 1;
  int zero_stage = 0;
  overhead_settings overhead{};
  // ZeRO-3: the next layer's weights are gathered while one layer runs (two layers' whole weights in
  // flight); false gathers each layer when it starts (one).
  bool gather_prefetch = true;

  constexpr bool lora_training() const noexcept { return training == method::lora; }
  constexpr bool memkit_runtime() const noexcept { return runtime == runtime_kind::memkit; }
  constexpr bool on_host() const noexcept { return memkit_runtime() && host_threads > 0; }
  constexpr bool has_master_weights() const noexcept {
    return precision == precision_mode::bf16_mixed || precision == precision_mode::fp16_mixed;
  }
  // Bytes of the compute dtype, and of the activations the residual stream and MLP keep.
  constexpr std::uint64_t activation_bytes() const noexcept { return precision == precision_mode::fp32 ? 4 : 2; }
  constexpr std::uint64_t stream_bytes() const noexcept { return kbit_prepared ? 4 : activation_bytes(); }
  // Bytes of one gradient element: memkit's parameters and lora_linear keep fp32 gradients (accumulation
  // over micro-batches loses nothing); PyTorch's have the weight's dtype.
  constexpr std::uint64_t gradient_bytes() const noexcept { return memkit_runtime() ? 4 : activation_bytes(); }
  constexpr std::uint64_t tokens() const noexcept { return micro_batch * sequence; }
  constexpr memkit::checkpoint::schedule checkpoint_schedule_of() const noexcept {
    return {checkpoint, checkpoint_every, checkpoint_slots};
  }
};

constexpr std::string_view to_string(runtime_kind r) noexcept {
  switch (r) {
    case runtime_kind::pytorch: return "pytorch";
    case runtime_kind::memkit: return "memkit";
  }
  return "?";
}
constexpr std::string_view to_string(logits_mode l) noexcept {
  switch (l) {
    case logits_mode::fp32: return "fp32";
    case logits_mode::half: return "bf16";
    case logits_mode::chunked: return "chunked";
    case logits_mode::fused: return "fused";
    case logits_mode::cut: return "cut";
  }
  return "?";
}
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
