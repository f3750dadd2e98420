// train_llama: pretrain, then QLoRA-fine-tune, a small Llama-style model in C++ with memkit alone.
//
//   stage 1  pretraining from scratch on Shakespeare (examples/data/shakespeare.txt): bf16 weights with
//            fp32 master weights (or bf16 with stochastic rounding, --rounding), blockwise 8-bit AdamW,
//            activation checkpointing (memkit::checkpoint::segment, one checkpoint per block), gradient
//            accumulation, global gradient-norm clipping. The pretrained model is saved as safetensors.
//   stage 2  QLoRA on Jane Austen (examples/data/austen.txt): the projections are loaded into NF4 with
//            double quantization, LoRA adapters train on all seven projections with 8-bit AdamW; the
//            adapter is saved in PEFT's format and the base in bitsandbytes' 4-bit format, both reloaded
//            and checked to give the same loss; then the model writes some text.
//
// Every byte goes through one tracking_resource. Before a stage allocates, the example predicts what each
// memory category will hold at its peak from the components' own size functions (bytes_required, saved
// and workspace bytes, memkit::checkpoint::segment::cost) and prints that next to what the tracker measured.
// At compile time, memory_budget checks the configuration against a GPU (static_assert(memkit::fits(...))).
//
// Where it runs (--device): on the host (the default), or on a CUDA device: the same model, optimizer state,
// checkpointing and loss, every buffer in device memory through the same tracker (over a stream-ordered
// device_async_resource), every operation on one cuda_executor (the legacy default stream). The CUDA path
// exists in the nvcc build of this file (memkit_example_train_llama_cuda, built when CMake finds nvcc);
// the g++ build (memkit_example_train_llama) is host-only and answers --device cuda with exit code 2 and
// the reason, as the nvcc build does when no device is usable. --device auto takes a device when one is usable.
//
//   ./train_llama [--short] [--check] [--device host|cuda|auto] [--steps N] [--finetune-steps N] [--batch B]
//                 [--seq S] [--accum A] [--hidden H] [--layers L] [--threads T] [--rounding]
//                 [--no-checkpointing] [--mlp-chunk TOKENS] [--pack] [--out DIR]
//
// --mlp-chunk TOKENS runs every block's MLP sequence-tiled (decoder_block::mlp_token_chunk): gate/up -> SwiGLU
// -> down over chunks of TOKENS tokens, recomputed in the backward, so the [tokens, intermediate] tensors are
// never held whole; memory_budget models it (training_plan::mlp_token_chunk) and --check holds it to the peak.
//
// --pack trains both stages on packed documents instead of random windows: the texts' paragraphs, packed whole
// into rows with their offsets (examples/llama/text.hpp), so attention and rotary positions stay inside each
// paragraph (forward_context::document_offsets) and the loss ignores the targets that would cross one.
//
// With a Hugging Face checkpoint instead (docs/models.md): --model DIR (config.json + safetensors, 16-bit or
// bitsandbytes 4-bit) or --init random --config FILE (any supported config at its real shapes), trained on
// --data FILE (token ids from tools/tokenize.py; random ids without it), skipping both stages:
//   --finetune qlora   NF4 base, LoRA on the seven projections, 8-bit AdamW (the default); --merge also
//                      writes the adapter merged into a bf16 checkpoint
//   --finetune lora    the same over the bf16 base
//   --finetune full    every parameter, bf16 with fp32 master weights (or --rounding), 8-bit AdamW
// The adapter is saved in PEFT's format (full: the whole checkpoint) and reloaded to check it.
// --zero 3 (the MPI build, memkit_example_train_llama_mpi, under mpirun; #32): --init random --config FILE
// --finetune full with every tensor sharded over the ranks (distributed/stage3.hpp), each layer gathered around
// its forward and its backward; every rank trains on the same batches, checks its own tracked peak and prints
// a checksum of the trained parameters (rank 0 prints the rest).
#include <memkit/memkit.hpp>

#include <memkit/models/llama/model.hpp>
#include <memkit/models/llama/load.hpp>
#include <memkit/models/llama/nf4_lora.hpp>
#include <memkit/models/llama/stage3.hpp>
#include <memkit/models/tokens.hpp>
#if defined(MEMKIT_EXAMPLE_MPI)
#include <memkit/distributed/mpi_communicator.hpp>
#include <mpi.h>
#endif
#include "llama/report.hpp"
#include "llama/text.hpp"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace llama = memkit::models::llama;
namespace budget = memkit::budget;
using memkit::shape;
using memkit::tensor_view;
using memkit::memory_category;
using act_t = memkit::bf16;

// The LoRA layer over an NF4 base (printed at start).
using lora_linear_impl = llama::nf4_lora_linear<act_t>;
using adapter_t = lora_linear_impl::adapter_type;  // the element type of the LoRA factors

using pretrain_model = llama::causal_lm<act_t, memkit::layers::dense_linear<act_t>>;
using finetune_model = llama::causal_lm<act_t, lora_linear_impl>;

// ---- the configuration, checked at compile time ----------------------------------------------------------
constexpr std::int64_t default_hidden = 128, default_layers = 4, default_heads = 4, default_kv_heads = 2,
                       default_intermediate = 352, default_batch = 8, default_seq = 128, default_accum = 2;
constexpr budget::model_config example_model =
    budget::llama_style("memkit-example", default_hidden, default_layers, default_heads, default_kv_heads,
                        default_intermediate, 256, false, 256);
// Both stages run on memkit's own components: memory_budget's memkit runtime (every term from their byte
// functions). Stage 2's adapters are bf16 updated with stochastic rounding (no fp32 master copy).
constexpr budget::training_plan pretrain_plan{.runtime = budget::runtime_kind::memkit,
                                              .precision = budget::precision_mode::bf16_mixed,
                                              .optimizer = budget::optimizer_kind::adamw_8bit,
                                              .fused_optimizer = true,
                                              .micro_batch = default_batch,
                                              .sequence = default_seq,
                                              .grad_accum = default_accum,
                                              .checkpoint = budget::checkpointing::every_layer,
                                              .logits = budget::logits_mode::chunked,
                                              .fp32_norm_and_softmax = false};
constexpr budget::training_plan qlora_plan{.runtime = budget::runtime_kind::memkit,
                                           .training = budget::method::lora,
                                           .weights = {budget::weight_format::nf4, 64, true},
                                           .lora = {.rank = 8},
                                           .precision = budget::precision_mode::bf16,
                                           .optimizer = budget::optimizer_kind::adamw_8bit,
                                           .fused_optimizer = true,
                                           .micro_batch = default_batch,
                                           .sequence = default_seq,
                                           .grad_accum = default_accum,
                                           .checkpoint = budget::checkpointing::every_layer,
                                           .logits = budget::logits_mode::chunked,
                                           .fp32_norm_and_softmax = false};
// The defaults fit the smallest GPU in the presets; so does the same recipe scaled to a SmolLM2-360M-sized
// model at 2 x 2048 tokens, what one would run with the flags on a GPU (a larger plan fails to compile,
// with the numbers in the error).
static_assert(memkit::fits(example_model, pretrain_plan, budget::presets::t4));
static_assert(memkit::fits(example_model, qlora_plan, budget::presets::t4));
constexpr budget::training_plan gpu_scale_plan = [] {
  budget::training_plan p = pretrain_plan;
  p.micro_batch = 2;
  p.sequence = 2048;
  return p;
}();
static_assert(memkit::fits(budget::presets::smollm2_360m, gpu_scale_plan, budget::presets::t4));

// ---- options ---------------------------------------------------------------------------------------------
enum class device_choice { host, cuda, automatic };
// Where the checkpointed blocks' inputs wait between forward and backward (#31): on the device, or in host
// memory outside --memory-cap (pinned on CUDA); auto: on the host when memory_budget says the on-device
// ones would not fit the cap (budget::with_checkpoints_placed_for_cap), else on the device.
enum class offload_choice { off, on, automatic };

// --pack: each training row holds at most this many documents, the padding of its tail included (a fixed
// [batch, documents + 1] offsets buffer, allocated once per stage like the ids).
constexpr std::int64_t pack_documents_per_row = 8;

struct options {
  device_choice device = device_choice::host;
  llama::model_config model;
  std::int64_t batch = default_batch, seq = default_seq, accum = default_accum;
  std::int64_t pretrain_steps = 300, finetune_steps = 160;
  std::int64_t lora_rank = 8;
  float lora_alpha = 16.0f;
  float pretrain_lr = 3e-3f, finetune_lr = 2e-3f, max_grad_norm = 1.0f;
  int threads = 0;
  bool rounding = false;       // bf16 weights with stochastic rounding instead of fp32 master weights
  std::int64_t loss_chunk_tokens = 256;  // tokens whose fp32 logits exist at once (0: all of a micro-batch)
  std::int64_t mlp_chunk_tokens = 0;     // --mlp-chunk: tokens per chunk of the blocks' tiled MLP (0: untiled)
  bool adam32 = false;         // stage 1 with fp32 AdamW moments instead of 8-bit (to measure what 8-bit saves)
  bool checkpointing = true;   // one checkpoint per block (memkit::checkpoint::schedule::every_layer)
  bool pack = false;           // --pack: training rows of whole paragraphs with document offsets
  bool check = false;          // exit non-zero unless loss falls, memory agrees within 2%, reloads agree
  std::int64_t sample_bytes = 300;
  std::int64_t log_every = 10;
  std::int64_t validation_batches = 4;
  std::uint64_t seed = 1234;
  std::string data_dir = MEMKIT_EXAMPLE_DATA_DIR;
  std::string out_dir = "train_llama_out";
  // Fine-tuning a Hugging Face checkpoint (--model DIR) or a model of a config.json with random weights
  // (--init random --config FILE) on a token file (--data FILE, tools/tokenize.py) instead of both stages.
  std::string model_dir, config_file, token_file;
  bool qlora = true;   // --finetune qlora (NF4 base) | lora (bf16 base) | full
  bool full = false;
  bool merge = false;  // --merge: also write the merged dense checkpoint
  std::int64_t memory_cap_mib = 0;  // --memory-cap MIB: every allocation through a capped_resource (0: none)
  bool max_seq_search = false;      // --max-seq-search: the longest sequence whose step fits the cap (#31)
  offload_choice offload = offload_choice::automatic;  // --offload-checkpoints on|off|auto (auto acts under a cap)
  bool loss_chunk_given = false;    // --loss-chunk on the command line (else, under a cap, the whole micro-batch)
  bool trial = false;               // one step of a search: no validation, nothing saved
  int zero = 0;                     // --zero 3: ZeRO stage 3 over the MPI ranks (the MPI build only)
  int ranks = 1;                    // the MPI ranks (the MPI build); 1 otherwise
  std::vector<std::string> targets{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  bool from_checkpoint() const { return !model_dir.empty() || !config_file.empty(); }
  // How trained weights are kept: bf16 with stochastic rounding (--rounding) or with fp32 master copies.
  memkit::layers::trainability trained_weights() const {
    return rounding ? memkit::layers::trainability::bf16_rounding : memkit::layers::trainability::bf16_master;
  }
};

constexpr const char* flag_list =
    "--short --check --device host|cuda|auto --steps N --finetune-steps N --batch B --seq S --accum A --hidden H "
    "--layers L --heads H --kv-heads K --intermediate F --rank R --threads T --rounding --adam32 --loss-chunk TOKENS "
    "--mlp-chunk TOKENS --no-checkpointing --pack --sample N --data DIR --out DIR | --model DIR | --init random --config FILE, "
    "with --data FILE (tokens) --finetune qlora|lora|full --targets q_proj,v_proj,... --merge; --memory-cap MIB "
    "--max-seq-search --offload-checkpoints on|off|auto; --zero 3 (MPI build, under mpirun)";

// A bad command line: one line naming the flag, exit 2, before anything is allocated or trained.
[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr, "train_llama: %s (train_llama --help lists the flags)\n", problem.c_str());
  std::exit(2);
}

// The whole text as an integer in [low, high] (no sign games, no trailing characters, no silent wrap).
std::int64_t parse_integer(const std::string& flag, const std::string& text, std::int64_t low, std::int64_t high) {
  std::int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [at, problem] = std::from_chars(text.data(), end, value);
  if (text.empty() || problem != std::errc() || at != end || value < low || value > high)
    usage(flag + " takes an integer in " + std::to_string(low) + ".." + std::to_string(high) + ", got '" + text + "'");
  return value;
}

// --short sets shortened defaults (a few steps of each stage, a 2-layer model); every other flag overrides
// them whatever the order. Each number has a range a run on this example can use; the whole configuration is
// checked here, before anything is allocated or trained.
options parse(int argc, char** argv) {
  options o;
  o.model.hidden = default_hidden;
  o.model.layers = default_layers;
  o.model.heads = default_heads;
  o.model.kv_heads = default_kv_heads;
  o.model.intermediate = default_intermediate;
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--short") {
      o.pretrain_steps = 20;
      o.finetune_steps = 16;
      o.batch = 4;
      o.seq = 64;
      o.model.layers = 2;
      o.log_every = 4;
      o.sample_bytes = 60;
      o.validation_batches = 2;
    }
  bool init_random = false, data_given = false, targets_given = false, layers_given = false;
  for (int i = 1; i < argc; ++i) data_given = data_given || std::string(argv[i]) == "--data";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value after " + a);
      return argv[++i];
    };
    auto number = [&](std::int64_t low, std::int64_t high) { return parse_integer(a, value(), low, high); };
    if (a == "--help") {
      std::printf("train_llama flags: %s\n", flag_list);
      std::exit(0);
    } else if (a == "--short") {
    } else if (a == "--check") o.check = true;
    else if (a == "--device") {
      const std::string d = value();
      if (d == "host") o.device = device_choice::host;
      else if (d == "cuda") o.device = device_choice::cuda;
      else if (d == "auto") o.device = device_choice::automatic;
      else usage("--device takes host, cuda or auto, not '" + d + "'");
    }
    else if (a == "--steps") o.pretrain_steps = number(1, 1000000);
    else if (a == "--finetune-steps") o.finetune_steps = number(1, 1000000);
    else if (a == "--batch") o.batch = number(1, 4096);
    else if (a == "--seq") o.seq = number(2, 65536);
    else if (a == "--accum") o.accum = number(1, 4096);
    else if (a == "--zero") o.zero = static_cast<int>(number(0, 3));
    else if (a == "--hidden") o.model.hidden = number(1, 65536);
    else if (a == "--layers") {
      o.model.layers = number(1, 1024);
      layers_given = true;
    }
    else if (a == "--heads") o.model.heads = number(1, 1024);
    else if (a == "--kv-heads") o.model.kv_heads = number(1, 1024);
    else if (a == "--intermediate") o.model.intermediate = number(1, 262144);
    else if (a == "--rank") o.lora_rank = number(1, 4096);
    else if (a == "--threads") o.threads = static_cast<int>(number(0, 4096));
    else if (a == "--rounding") o.rounding = true;
    else if (a == "--adam32") o.adam32 = true;
    else if (a == "--loss-chunk") {
      o.loss_chunk_tokens = number(0, std::int64_t{1} << 30);
      o.loss_chunk_given = true;
    }
    else if (a == "--mlp-chunk") o.mlp_chunk_tokens = number(1, std::int64_t{1} << 30);
    else if (a == "--no-checkpointing") o.checkpointing = false;
    else if (a == "--pack") o.pack = true;
    else if (a == "--sample") o.sample_bytes = number(0, 1000000);
    else if (a == "--data") o.data_dir = value();
    else if (a == "--out") o.out_dir = value();
    else if (a == "--model") o.model_dir = value();
    else if (a == "--config") o.config_file = value();
    else if (a == "--init") {
      const std::string init = value();
      if (init != "random") usage("--init takes 'random' (a checkpoint's weights come with --model DIR), not '" + init + "'");
      init_random = true;
    } else if (a == "--finetune") {
      const std::string mode = value();
      o.qlora = mode == "qlora";
      o.full = mode == "full";
      if (mode != "qlora" && mode != "lora" && mode != "full")
        usage("--finetune takes qlora, lora or full, not '" + mode + "'");
    } else if (a == "--merge") o.merge = true;
    else if (a == "--memory-cap") o.memory_cap_mib = number(1, std::int64_t{1} << 24);
    else if (a == "--max-seq-search") o.max_seq_search = true;
    else if (a == "--offload-checkpoints") {
      const std::string d = value();
      if (d == "on") o.offload = offload_choice::on;
      else if (d == "off") o.offload = offload_choice::off;
      else if (d == "auto") o.offload = offload_choice::automatic;
      else usage("--offload-checkpoints takes on, off or auto, not '" + d + "'");
    }
    else if (a == "--targets") {
      const std::string list = value();
      const std::vector<std::string> all = o.targets;
      o.targets.clear();
      for (std::size_t at = 0; at <= list.size();) {
        const std::size_t comma = std::min(list.find(',', at), list.size());
        const std::string name = list.substr(at, comma - at);
        if (std::find(all.begin(), all.end(), name) == all.end())
          usage("--targets takes projections among q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj, not '" + name + "'");
        if (std::find(o.targets.begin(), o.targets.end(), name) == o.targets.end()) o.targets.push_back(name);
        at = comma + 1;
      }
      targets_given = true;
    }
    else usage("unknown flag '" + a + "'");
  }
  if (o.zero == 1 || o.zero == 2)
    usage("--zero takes 0 or 3 (stage 3: every tensor sharded over the MPI ranks), not " + std::to_string(o.zero));
#if !defined(MEMKIT_EXAMPLE_MPI)
  if (o.zero == 3)
    usage("--zero 3: this build has no MPI; run memkit_example_train_llama_mpi under mpirun (built when CMake finds MPI)");
#else
  if (o.zero == 3) {  // the one stage-3 run this example has: dense full fine-tuning, on the host
    if (!(init_random && !o.config_file.empty() && o.full))
      usage("--zero 3 runs --init random --config FILE --finetune full (every tensor sharded over the ranks)");
    if (o.accum != 1) usage("--zero 3 reduces each layer's gradients once per step: --accum 1");
    if (o.device != device_choice::host) usage("--zero 3 runs on the host (the ranks are MPI processes)");
    if (o.memory_cap_mib > 0 || o.offload == offload_choice::on || o.mlp_chunk_tokens > 0)
      usage("--zero 3 runs without --memory-cap, --offload-checkpoints on or --mlp-chunk");
  }
#endif
  if (o.offload == offload_choice::on && !o.checkpointing)
    usage("--offload-checkpoints on keeps checkpoints in host memory: not with --no-checkpointing");
  if (o.offload == offload_choice::on && o.model_dir.empty() && o.config_file.empty() && !init_random)
    usage("--offload-checkpoints applies with --model DIR or --init random --config FILE");
  if (targets_given && o.model_dir.empty() && o.config_file.empty() && !init_random)
    usage("--targets applies with --model DIR or --init random --config FILE (the example's own stage 2 adapts all seven)");
  if (!o.model_dir.empty() || !o.config_file.empty() || init_random) {
    if (!o.model_dir.empty() && (init_random || !o.config_file.empty()))
      usage("--model DIR loads a checkpoint and --init random --config FILE builds one without: give one");
    if (o.model_dir.empty() && !(init_random && !o.config_file.empty()))
      usage("--init random needs --config FILE (a config.json), and --config needs --init random");
    if (o.model_dir.empty() && o.merge) usage("--merge needs --model DIR (random weights are not worth exporting)");
    if (o.full && targets_given) usage("--targets applies to --finetune qlora or lora (full fine-tuning trains every parameter)");
    if (o.max_seq_search && o.memory_cap_mib == 0) usage("--max-seq-search needs --memory-cap MIB (the cap the step must fit)");
    if (o.max_seq_search && !o.token_file.empty()) usage("--max-seq-search runs on random token ids: leave out --data");
    if (o.max_seq_search && o.full) usage("--max-seq-search searches --finetune qlora or lora");
    if (o.full && o.merge) usage("--merge applies to --finetune qlora or lora (full fine-tuning saves the whole model)");
    if (o.pack) usage("--pack packs the example's own texts by paragraph (stages 1 and 2), not a token file");
    // Under a cap the loss's chunk is the largest the memory left at the loss point holds: at most --loss-chunk
    // when given, else at most the micro-batch.
    if (o.memory_cap_mib > 0 && !o.loss_chunk_given) o.loss_chunk_tokens = 0;
    o.token_file = data_given ? o.data_dir : std::string();
    if (!o.model_dir.empty() && o.token_file.empty() && !o.max_seq_search)
      usage("--model DIR needs --data FILE: a token file written by tools/tokenize.py with the model's tokenizer");
    std::error_code ec;
    if (!o.token_file.empty() && !std::filesystem::is_regular_file(o.token_file, ec))
      usage("--data " + o.token_file + ": not a readable token file");
    const std::int64_t layers = o.model.layers;
    try {  // the model's shape: checked here, before anything is allocated
      const std::string config = o.model_dir.empty() ? o.config_file : o.model_dir + "/config.json";
      o.model = llama::read_hf_config(config, o.seq);
    } catch (const memkit::error& e) {
      usage(e.what());
    }
    // --layers L with --init random: the config's first L blocks at its real widths and vocabulary (a
    // long-context search on a model's shapes in CI time, #31).
    if (layers_given) {
      if (o.model_dir.empty() && layers <= o.model.layers) o.model.layers = layers;
      else usage("--layers with a config.json applies to --init random, at most the config's " +
                 std::to_string(o.model.layers) + " layers");
    }
    if (o.lora_rank > std::min(o.model.hidden, o.model.intermediate))
      usage("--rank " + std::to_string(o.lora_rank) + " is above the smallest adapted width (" +
            std::to_string(std::min(o.model.hidden, o.model.intermediate)) + ")");
    if (o.token_file.empty()) o.validation_batches = 1;  // random ids: the validation loss only shows it runs
    o.threads = memkit::resolve_host_threads(o.threads);
    return o;
  }
  if (o.model.hidden % o.model.heads != 0)
    usage("--hidden " + std::to_string(o.model.hidden) + " must be a multiple of --heads " + std::to_string(o.model.heads));
  o.model.head_dim = o.model.hidden / o.model.heads;
  if (o.model.head_dim % 2 != 0)
    usage("--hidden / --heads must be even (rotary positions rotate pairs), got head_dim " + std::to_string(o.model.head_dim));
  o.model.max_positions = std::max<std::int64_t>(256, o.seq);
  if (o.model.heads % o.model.kv_heads != 0)
    usage("--kv-heads " + std::to_string(o.model.kv_heads) + " must divide --heads " + std::to_string(o.model.heads));
  if (o.lora_rank > std::min(o.model.hidden, o.model.intermediate))
    usage("--rank " + std::to_string(o.lora_rank) + " is above the smallest adapted width (" +
          std::to_string(std::min(o.model.hidden, o.model.intermediate)) + ")");
  for (const char* file : {"shakespeare.txt", "austen.txt"}) {
    const std::filesystem::path path = std::filesystem::path(o.data_dir) / file;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) usage("--data " + o.data_dir + ": no readable " + file + " there");
  }
  o.threads = memkit::resolve_host_threads(o.threads);
  return o;
}

// ---- memory: predicted before allocating, measured by the tracker --------------------------------------
struct categories {
  std::uint64_t bytes[memkit::memory_category_count]{};
  std::uint64_t& operator[](memory_category c) { return bytes[static_cast<int>(c)]; }
  std::uint64_t operator[](memory_category c) const { return bytes[static_cast<int>(c)]; }
  std::uint64_t total() const {
    std::uint64_t t = 0;
    for (std::uint64_t b : bytes) t += b;
    return t;
  }
};

struct memory_prediction {
  categories peak;          // each category's own peak
  std::uint64_t total = 0;  // the peak of the sum
};

// Every allocation of the run goes through one tracking_resource, a resource per category. The meter puts
// a probe in front of each category's resource that copies every category's current bytes whenever the
// total reaches its peak, so the report can also say what each category held at that moment: the category
// peaks need not coincide, and memory_budget predicts the breakdown at the peak moment.
class memory_meter {
 public:
  memkit::tracking_resource tracker;

  // `upstream`: host memory, or (CUDA) a device_async_resource: then every category is stream-ordered.
  explicit memory_meter(memkit::memory_resource& upstream) : tracker(upstream, "train_llama") {
    for (int i = 0; i < memkit::memory_category_count; ++i) probes_[i].init(*this, static_cast<memory_category>(i));
  }
  memory_meter(const memory_meter&) = delete;
  memory_meter& operator=(const memory_meter&) = delete;

  memkit::memory_resource& category(memory_category c) { return probes_[static_cast<int>(c)]; }
  void reset_peak() {
    tracker.reset_peak();
    phase_ = "setup";
    snapshot();
  }
  categories peaks() const {
    categories c;
    for (int i = 0; i < memkit::memory_category_count; ++i)
      c.bytes[i] = tracker.stats(static_cast<memory_category>(i)).peak_bytes;
    return c;
  }
  const categories& at_peak() const { return at_peak_; }
  // What the run is doing (set by the training loop), recorded with the snapshot at the peak.
  void set_phase(const char* phase) { phase_ = phase; }
  const char* phase_at_peak() const { return phase_at_peak_; }

 private:
  class probe final : public memkit::memory_resource {
   public:
    void init(memory_meter& meter, memory_category c) {
      meter_ = &meter;
      category_ = c;
    }
    memkit::memory_kind kind() const noexcept override { return meter_->tracker.kind(); }
    const char* name() const noexcept override { return memkit::to_string(category_); }

   protected:
    void* do_allocate(std::size_t bytes, std::size_t alignment) override {
      void* p = meter_->tracker.category(category_).allocate(bytes, alignment);
      if (meter_->tracker.current_bytes() == meter_->tracker.peak_bytes()) meter_->snapshot();
      return p;
    }
    void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
      meter_->tracker.category(category_).deallocate(p, bytes, alignment);
    }
    // Stream-ordered allocations (device workspace) pass through in order, counted the same way.
    bool is_stream_ordered() const noexcept override { return meter_->tracker.category(category_).stream_ordered(); }
    void* do_allocate_on(memkit::on_stream where, std::size_t bytes, std::size_t alignment) override {
      void* p = meter_->tracker.category(category_).allocate_on(where, bytes, alignment);
      if (meter_->tracker.current_bytes() == meter_->tracker.peak_bytes()) meter_->snapshot();
      return p;
    }
    void do_deallocate_on(memkit::on_stream where, void* p, std::size_t bytes, std::size_t alignment) noexcept override {
      meter_->tracker.category(category_).deallocate_on(where, p, bytes, alignment);
    }

   private:
    memory_meter* meter_ = nullptr;
    memory_category category_ = memory_category::other;
  };

  void snapshot() {
    for (int i = 0; i < memkit::memory_category_count; ++i)
      at_peak_.bytes[i] = tracker.stats(static_cast<memory_category>(i)).current_bytes;
    phase_at_peak_ = phase_;
  }

  probe probes_[memkit::memory_category_count];
  categories at_peak_;
  const char* phase_ = "setup";
  const char* phase_at_peak_ = "setup";
};

// memory_budget's prediction of the same model and plan: the breakdown at its peak moment, mapped onto the
// tracker's categories, and the peak.
struct budget_prediction {
  categories at_peak;
  std::uint64_t peak = 0;
  const char* column = "";       // the table's column header
  const char* description = "";  // what the column is
  std::uint64_t loss_chunk = 0;  // the loss's tokens per chunk it costed
  std::uint64_t host_bytes = 0;  // offloaded checkpoints
};

// memory_budget's memkit runtime for this exact model and plan, run on the host with the example's threads
// (training_plan::host_threads: the components' host workspaces, no CUDA context or cuBLAS) or on a CUDA
// device (host_threads 0: the components' device workspaces), its breakdown at its peak moment mapped onto
// the tracker's categories. `--check` holds its peak to the measured one (2%).
budget::training_plan budget_plan(const options& o, bool qlora, bool on_device) {
  budget::training_plan p = qlora ? qlora_plan : pretrain_plan;
  p.micro_batch = static_cast<std::uint64_t>(o.batch);
  p.sequence = static_cast<std::uint64_t>(o.seq);
  p.grad_accum = static_cast<std::uint64_t>(o.accum);
  p.lora.rank = static_cast<std::uint64_t>(o.lora_rank);
  p.checkpoint = o.checkpointing ? budget::checkpointing::every_layer : budget::checkpointing::none;
  if (!qlora && o.rounding) p.precision = budget::precision_mode::bf16;
  if (!qlora && o.adam32) p.optimizer = budget::optimizer_kind::adamw;
  p.logits_chunk_tokens = static_cast<std::uint64_t>(o.loss_chunk_tokens > 0 ? o.loss_chunk_tokens : o.batch * o.seq);
  p.mlp_token_chunk = static_cast<std::uint64_t>(o.mlp_chunk_tokens);
  if (o.zero == 3) {  // memory_budget's --runtime memkit --zero 3: stage3_parameters' terms, the worst rank
    p.gpus = static_cast<std::uint64_t>(o.ranks);
    p.zero_stage = 3;
    p.gather_prefetch = false;  // distributed::stage3_layer gathers each block when it runs: one buffer
  }
  if (!on_device) {
    p.host_threads = static_cast<std::uint64_t>(o.threads);
    p.overhead = budget::host_overhead;
  }
  return p;
}

budget::model_config budget_model(const options& o) {
  return budget::llama_style("memkit-example", static_cast<std::uint64_t>(o.model.hidden),
                                                     static_cast<std::uint64_t>(o.model.layers),
                                                     static_cast<std::uint64_t>(o.model.heads),
                                                     static_cast<std::uint64_t>(o.model.kv_heads),
                                                     static_cast<std::uint64_t>(o.model.intermediate),
                                                     static_cast<std::uint64_t>(o.model.vocab), o.model.tie_embeddings,
                                                     static_cast<std::uint64_t>(o.model.max_positions),
                                                     static_cast<std::uint64_t>(o.model.head_dim));
}

budget::training_plan checkpoint_budget_plan(const options& o, bool qlora, bool on_device) {
  budget::training_plan plan = budget_plan(o, qlora, on_device);
  if (o.from_checkpoint()) {  // --memory-cap and --offload-checkpoints act on the checkpoint fine-tunings
    plan.memory_cap = static_cast<std::uint64_t>(o.memory_cap_mib) << 20;
    plan.offload_checkpoints = o.checkpointing && o.offload == offload_choice::on;
  }
  if (qlora && !o.qlora) plan.weights.format = budget::weight_format::bf16;  // --finetune lora: a bf16 base
  if (qlora) {  // --targets: the adapted projections
    const char* names[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
    plan.lora.targets = 0;
    for (int i = 0; i < 7; ++i)
      if (std::find(o.targets.begin(), o.targets.end(), names[i]) != o.targets.end())
        plan.lora.targets = static_cast<budget::module_set>(plan.lora.targets | (1u << i));
  }
  // auto: the budget decides where the checkpoints wait, and the run does as it says.
  if (o.from_checkpoint() && o.offload == offload_choice::automatic)
    plan = budget::with_checkpoints_placed_for_cap(budget_model(o), plan);
  return plan;
}

budget_prediction budget_estimate(const options& o, bool qlora, bool on_device) {
  const budget::model_config m = budget_model(o);
  const budget::training_plan plan = checkpoint_budget_plan(o, qlora, on_device);
  const budget::memory_estimate e = budget::estimate_memory(m, plan);
  if (!e.valid()) {
    std::fprintf(stderr, "train_llama: memory_budget refuses the plan: %s\n", std::string(e.problem).c_str());
    std::exit(1);
  }
  budget_prediction b;
  b.column = "budget";
  b.description = on_device ? "budget: memory_budget's memkit runtime on a CUDA device (estimate_memory with runtime memkit,\n"
                              "   host_threads 0): its breakdown at its own peak moment, by category"
                            : "budget: memory_budget's memkit runtime on the host (estimate_memory with runtime memkit,\n"
                              "   host_threads): its breakdown at its own peak moment, by category";
  categories& c = b.at_peak;
  c[memory_category::weights] = e.device[budget::category::weights];
  c[memory_category::gradients] = e.device[budget::category::gradients];
  c[memory_category::optimizer_state] = e.device[budget::category::optimizer_state] + e.device[budget::category::master_weights];
  c[memory_category::activations] = e.device[budget::category::activations] + e.device[budget::category::logits];
  c[memory_category::workspace] = e.device[budget::category::workspace];
  b.peak = e.peak_bytes(budget::metric::allocated);  // the live tensors: what a tracking_resource reports
  b.loss_chunk = e.loss_chunk_tokens;
  b.host_bytes = e.host_bytes;
  return b;
}

double percent_error(std::uint64_t predicted, std::uint64_t measured) {
  return measured ? (double(predicted) - double(measured)) / double(measured) * 100.0 : 0.0;
}

// Two comparisons per category: each category's own peak, predicted from the components' size functions
// before allocating vs measured; and the breakdown at the moment of the total peak, measured vs memory_budget.
void print_memory_table(const char* title, const memory_prediction& predicted, const memory_meter& meter,
                        const budget_prediction& budget_view) {
  const categories peaks = meter.peaks(), at_peak = meter.at_peak();
  const std::uint64_t peak = meter.tracker.peak_bytes();
  std::printf("\n%s: memory, bytes tracked by the tracking_resource\n", title);
  std::printf("  %-16s %-32s | %s\n", "", "each category's own peak", "at the moment of the total peak");
  std::printf("  %-16s %11s %11s %8s | %11s %11s %8s\n", "category", "predicted", "measured", "error", "measured",
              budget_view.column, "error");
  for (int i = 0; i < memkit::memory_category_count; ++i) {
    const auto c = static_cast<memory_category>(i);
    if (predicted.peak[c] == 0 && peaks[c] == 0) continue;
    std::printf("  %-16s %11s %11s %7.2f%% | %11s %11s %7.2f%%\n", memkit::to_string(c),
                memkit::format_bytes(predicted.peak[c]).c_str(), memkit::format_bytes(peaks[c]).c_str(),
                percent_error(predicted.peak[c], peaks[c]), memkit::format_bytes(at_peak[c]).c_str(),
                memkit::format_bytes(budget_view.at_peak[c]).c_str(), percent_error(budget_view.at_peak[c], at_peak[c]));
  }
  std::printf("  %-16s %11s %11s %7.2f%% | %11s %11s %7.2f%%\n", "total at peak", memkit::format_bytes(predicted.total).c_str(),
              memkit::format_bytes(peak).c_str(), percent_error(predicted.total, peak), memkit::format_bytes(peak).c_str(),
              memkit::format_bytes(budget_view.peak).c_str(), percent_error(budget_view.peak, peak));
  std::printf("  (the total peak was reached in: %s)\n", meter.phase_at_peak());
  std::printf("  (predicted: from the components' own size functions, the total as the sum of the category peaks;\n"
              "   %s)\n", budget_view.description);
}

// ---- one stage's training loop -------------------------------------------------------------------------
struct resources {
  memory_meter& meter;
  memkit::tracking_resource& tracker;  // read only: every allocation goes through the meter's probes
  memkit::layers::memory_resources model;
  memkit::memory_resource& activations;
  memkit::memory_resource& other;
};

resources make_resources(memory_meter& meter, int threads) {
  memkit::layers::memory_resources m;
  m.weights = &meter.category(memory_category::weights);
  m.gradients = &meter.category(memory_category::gradients);
  m.optimizer = &meter.category(memory_category::optimizer_state);
  m.workspace = &meter.category(memory_category::workspace);
  m.host_threads = threads;
  return {meter, meter.tracker, m, meter.category(memory_category::activations), meter.category(memory_category::other)};
}

// The offsets per row of a packed micro-batch (0: not packing).
std::int64_t offsets_per_row(const options& o) { return o.pack ? pack_documents_per_row + 1 : 0; }

// The forward_context the memory prediction sizes the layers with: a packed micro-batch's offsets shape (each
// block keeps a copy of them for its backward), no data.
memkit::forward_context prediction_context(const options& o) {
  memkit::forward_context ctx{};
  if (o.pack)
    ctx.document_offsets = tensor_view<const std::int32_t>(nullptr, shape{o.batch, offsets_per_row(o)}, memkit::memory_kind::host);
  return ctx;
}

// Chunks of --loss-chunk tokens (0: the whole micro-batch), by the loss's own rule (loss::chunk_bytes_for).
memkit::loss::cross_entropy_options loss_options(const options& opt, bool on_device) {
  memkit::loss::cross_entropy_options o;
  o.host_threads = opt.threads;
  const std::int64_t tokens = opt.loss_chunk_tokens > 0 ? opt.loss_chunk_tokens : opt.batch * opt.seq;
  o.chunk_bytes = memkit::loss::chunk_bytes_for(tokens, opt.model.vocab, sizeof(act_t), on_device);
  return o;
}

// Buffers of one micro-batch: token ids and targets (and with --pack the document offsets), the hidden states in
// and out of the layer stack and their gradients. Allocated once per stage (where the model runs); the ids are
// made on the host (staging, not counted: host memory of the data loader) and copied in.
struct step_buffers {
  memkit::buffer<std::int32_t> ids, targets, offsets;
  memkit::buffer<float> loss;
  memkit::buffer<act_t> h0, hn, dhn, dh0;
  std::vector<std::int32_t> ids_staging, targets_staging, offsets_staging;
  step_buffers(const resources& r, std::int64_t batch, std::int64_t seq, std::int64_t hidden, bool embedding_trains,
               std::int64_t offsets_per_row)
      : ids(r.other, shape{batch * seq}), targets(r.other, shape{batch * seq}), loss(r.other, shape{1}),
        h0(r.activations, shape{batch, seq, hidden}), hn(r.activations, shape{batch, seq, hidden}),
        dhn(r.activations, shape{batch, seq, hidden}),
        dh0(r.activations, embedding_trains ? shape{batch, seq, hidden} : shape{0}),
        ids_staging(static_cast<std::size_t>(batch * seq)), targets_staging(static_cast<std::size_t>(batch * seq)),
        offsets_staging(static_cast<std::size_t>(batch * offsets_per_row)) {
    if (offsets_per_row > 0) offsets = memkit::buffer<std::int32_t>(r.other, shape{batch, offsets_per_row});
  }
  // fill(ids, targets) writes one micro-batch into host memory; it is checked and copied where the model runs.
  template <class Fill>
  void set_batch(Fill&& fill, std::int64_t vocab) {
    fill(ids_staging.data(), targets_staging.data());
    copy_batch(vocab);
  }
  // fill(ids, targets, offsets) writes one packed micro-batch (targets -100 where ignored).
  template <class Fill>
  void set_packed_batch(Fill&& fill, std::int64_t vocab) {
    fill(ids_staging.data(), targets_staging.data(), offsets_staging.data());
    memkit::attention::check_document_offsets(memkit::host_view(std::as_const(offsets_staging).data(), offsets.shape()),
                                              offsets.shape()[0], static_cast<std::int64_t>(ids_staging.size()) / offsets.shape()[0]);
    memkit::layers::copy_in(offsets_staging.data(), offsets.view());
    copy_batch(vocab);
  }
  // The packed micro-batch's offsets where the model runs, or none().
  tensor_view<const std::int32_t> document_offsets() const {
    return offsets.size() > 0 ? std::as_const(offsets).view() : tensor_view<const std::int32_t>::none();
  }
  float loss_value() const { return memkit::layers::copy_out(loss.view())[0]; }
  static std::uint64_t activation_bytes(std::int64_t batch, std::int64_t seq, std::int64_t hidden, bool embedding_trains) {
    return memkit::buffer<act_t>::bytes_required(shape{batch, seq, hidden}) * (embedding_trains ? 4 : 3);
  }
  static std::uint64_t other_bytes(std::int64_t batch, std::int64_t seq, std::int64_t offsets_per_row) {
    return 2 * memkit::buffer<std::int32_t>::bytes_required(shape{batch * seq}) + memkit::buffer<float>::bytes_required(shape{1}) +
           (offsets_per_row > 0 ? memkit::buffer<std::int32_t>::bytes_required(shape{batch, offsets_per_row}) : 0);
  }

 private:
  void copy_batch(std::int64_t vocab) {
    for (std::size_t i = 0; i < ids_staging.size(); ++i)
      memkit::require(ids_staging[i] >= 0 && ids_staging[i] < vocab &&
                          (targets_staging[i] == -100 || (targets_staging[i] >= 0 && targets_staging[i] < vocab)),
                      "train_llama: a token id outside the vocabulary");
    memkit::layers::copy_in(ids_staging.data(), ids.view());
    memkit::layers::copy_in(targets_staging.data(), targets.view());
  }
};

// A stage's layer stack: the blocks, their MLP tiled by --mlp-chunk (set here, before anything predicts the
// blocks' bytes), and the final norm, a checkpoint per block unless --no-checkpointing. `offload`: where the
// blocks' inputs wait between forward and backward (null: in the store, on the device).
template <class Model>
auto make_stack(Model& model, const options& o, memkit::checkpoint::offload* offload = nullptr) {
  model.set_mlp_token_chunk(o.mlp_chunk_tokens);
  return memkit::checkpoint::segment(
      memkit::checkpoint::layer_sequence(model.blocks, model.final_norm),
      {.schedule = o.checkpointing ? memkit::checkpoint::schedule::every_layer() : memkit::checkpoint::schedule::none(),
       .offload = offload});
}

// Forward, loss, backward of one micro-batch through the checkpointed stack; returns the loss.
template <memkit::executor E, class Model, class Stack>
float train_micro_batch(const E& exec, Model& model, Stack& stack, step_buffers& b, memkit::activation_store& store,
                        const memkit::forward_context& ctx, const options& o, memory_meter& meter) {
  const std::int64_t tokens = o.batch * o.seq, h = model.config.hidden;
  meter.set_phase("forward");
  model.embed.forward(exec, std::as_const(b.ids).view(), b.h0.view());
  stack.forward(exec, ctx, std::as_const(b.h0).view(), b.hn.view(), store);
  const tensor_view<float> d_head = model.head_weight().trains() ? model.head_weight().grad.view() : tensor_view<float>::none();
  meter.set_phase("loss");
  memkit::loss::fused_linear_cross_entropy(
      exec, std::as_const(b.hn).view().reshaped(shape{tokens, h}), std::as_const(model.head_weight().value).view(),
      std::as_const(b.targets).view(), b.loss.view(), b.dhn.view().reshaped(shape{tokens, h}), d_head,
      loss_options(o, model.memory.on_device()), *model.memory.workspace);
  meter.set_phase("backward");
  // No input gradient when the embedding is frozen: dh0 is then never allocated (tensor_view::none()).
  stack.backward(exec, std::as_const(b.dhn).view(),
                 model.embed.weight.trains() ? b.dh0.view() : tensor_view<act_t>::none(), store);
  if (model.embed.weight.trains()) model.embed.backward(exec, std::as_const(b.ids).view(), std::as_const(b.dh0).view());
  return b.loss_value();  // (on a device: waits for the micro-batch)
}

// Mean loss over held-out windows, without checkpointing or gradients (each layer's saved tensors are
// dropped as soon as it has run). `around(i, before)`: called before and after block i runs (--zero 3 gathers
// and releases the block there).
struct no_block_hook {
  void operator()(std::int64_t, bool) const {}
};
template <memkit::executor E, class Model, class BlockHook = no_block_hook>
double validation_loss(const E& exec, Model& model, const example::text_dataset& data, step_buffers& b, const resources& r,
                       const options& o, BlockHook around = {}) {
  const std::int64_t tokens = o.batch * o.seq, h = model.config.hidden;
  r.meter.set_phase("validation");
  memkit::activation_store store(r.activations);
  const memkit::forward_context ctx{o.seed, 0, false};
  double total = 0.0;
  for (std::int64_t v = 0; v < o.validation_batches; ++v) {
    b.set_batch([&](std::int32_t* ids, std::int32_t* targets) {
      data.validation_batch(o.batch, v * o.batch, o.validation_batches * o.batch, ids, targets);
    }, model.config.vocab);
    model.embed.forward(exec, std::as_const(b.ids).view(), b.h0.view());
    act_t* x = b.h0.data();
    act_t* y = b.hn.data();
    const shape in{o.batch, o.seq, h};
    const memkit::memory_kind where = b.h0.where();
    for (std::size_t i = 0; i < model.blocks.size(); ++i) {
      around(static_cast<std::int64_t>(i), true);
      model.blocks[i].forward(exec, ctx, tensor_view<const act_t>(x, in, where), tensor_view<act_t>(y, in, where), store);
      around(static_cast<std::int64_t>(i), false);
      store.clear();
      std::swap(x, y);
    }
    model.final_norm.forward(exec, ctx, tensor_view<const act_t>(x, in, where), tensor_view<act_t>(y, in, where), store);
    store.clear();
    memkit::loss::fused_linear_cross_entropy(
        exec, tensor_view<const act_t>(y, shape{tokens, h}, where), std::as_const(model.head_weight().value).view(),
        std::as_const(b.targets).view(), b.loss.view(), tensor_view<act_t>::none(), tensor_view<float>::none(), loss_options(o, model.memory.on_device()),
        *model.memory.workspace);
    total += b.loss_value();
  }
  return total / static_cast<double>(o.validation_batches);
}

// Linear warmup over the first tenth of the steps, then a half cosine down to a tenth of the peak.
memkit::layers::cosine_schedule learning_rate(float peak, std::int64_t steps) {
  return {.peak = peak, .warmup_steps = std::max<std::int64_t>(1, steps / 10), .total_steps = steps, .final_fraction = 0.1f};
}

// The dense model's optimizer tensors: matrices in group 0 (weight decay `decay`), vectors (norms, biases) in
// group 1 (none).
using param_registry = memkit::layers::parameter_registry<act_t>;
param_registry decay_matrices_registry(float decay) {
  return param_registry({{.name = "matrices", .weight_decay = decay}, {.name = "vectors", .weight_decay = 0.0f}},
                        [](const std::string&, const shape& s) { return s.rank == 2 ? 0 : 1; });
}

struct stage_result {
  double first_loss = 0, last_loss = 0;     // mean of the first / last few steps
  double validation_before = 0, validation_after = 0;
  double seconds = 0, tokens_per_second = 0;
  double cpu_seconds = 0;  // process CPU time (all threads): what the run costs when the host is shared
  std::int64_t tokens = 0;
  std::uint64_t measured_peak = 0, predicted_peak = 0;
  categories measured, predicted;
  budget_prediction budget;
  std::int64_t loss_chunk = 0;       // the loss's tokens per chunk
  bool offloaded = false;            // checkpoints in host memory
  std::uint64_t offloaded_peak = 0;  // their host bytes (outside the cap)
};

// Runs `steps` optimizer steps of `accum` micro-batches. `step_optimizer(lr, scale)` applies one AdamW step.
template <memkit::executor E, class Model, class Stack, class StepOptimizer, class ZeroGrad>
void run_stage(const E& exec, int stage, Model& model, Stack& stack, const example::text_dataset& data, step_buffers& b,
               const resources& r, const options& o, std::int64_t steps, float peak_lr, StepOptimizer&& step_optimizer,
               ZeroGrad&& zero_grad, std::vector<example::step_record>& records, stage_result& result) {
  memkit::activation_store store(r.activations);
  memkit::optim::gradient_accumulation accumulation;
  const std::int64_t tokens_per_step = o.batch * o.seq * o.accum;
  std::vector<double> losses;
  const auto start = std::chrono::steady_clock::now();
  const std::clock_t cpu_start = std::clock();
  const memkit::layers::cosine_schedule schedule = learning_rate(peak_lr, steps);
  for (std::int64_t step = 0; step < steps; ++step) {
    zero_grad();
    double step_loss = 0.0;
    for (std::int64_t micro = 0; micro < o.accum; ++micro) {
      const std::uint64_t batch_seed = o.seed + static_cast<std::uint64_t>(stage);
      const std::uint64_t batch_index = static_cast<std::uint64_t>(step * o.accum + micro);
      if (o.pack)
        b.set_packed_batch([&](std::int32_t* ids, std::int32_t* targets, std::int32_t* offsets) {
          data.packed_training_batch(batch_seed, batch_index, o.batch, offsets_per_row(o), ids, targets, offsets);
        }, model.config.vocab);
      else
        b.set_batch([&](std::int32_t* ids, std::int32_t* targets) {
          data.training_batch(batch_seed, batch_index, o.batch, ids, targets);
        }, model.config.vocab);
      // Packed rows: every block keeps attention and the rotary positions inside each document.
      const memkit::forward_context ctx{o.seed, batch_index, true, b.document_offsets()};
      step_loss += train_micro_batch(exec, model, stack, b, store, ctx, o, r.meter);
      accumulation.add();
    }
    step_loss /= static_cast<double>(o.accum);
    const float lr = schedule(step);
    r.meter.set_phase("optimizer step");
    step_optimizer(lr, accumulation.step_scale());
    accumulation.reset();
    if constexpr (E::on_device) exec.synchronize();  // the step's time includes the optimizer's kernels
    losses.push_back(step_loss);
    const auto now = std::chrono::steady_clock::now();
    const double elapsed = std::chrono::duration<double>(now - start).count();
    example::step_record rec{stage, step + 1, step_loss, static_cast<double>(tokens_per_step * (step + 1)) / elapsed,
                           r.tracker.current_bytes(), r.tracker.peak_bytes(), lr};
    records.push_back(rec);
    if (!o.trial && ((step + 1) % o.log_every == 0 || step == 0 || step + 1 == steps)) {
      std::printf("stage %d  step %4lld/%lld  loss %.4f  lr %.2e  %7.0f tokens/s  memory %s (peak %s)  %.0fs\n", stage,
                  static_cast<long long>(step + 1), static_cast<long long>(steps), step_loss, lr, rec.tokens_per_second,
                  memkit::format_bytes(rec.current_bytes).c_str(), memkit::format_bytes(rec.peak_bytes).c_str(), elapsed);
      std::fflush(stdout);
    }
  }
  const auto mean = [](auto first, auto last) {
    double s = 0;
    for (auto it = first; it != last; ++it) s += *it;
    return s / static_cast<double>(last - first);
  };
  const std::size_t k = std::min<std::size_t>(5, losses.size());
  result.first_loss = mean(losses.begin(), losses.begin() + static_cast<std::ptrdiff_t>(k));
  result.last_loss = mean(losses.end() - static_cast<std::ptrdiff_t>(k), losses.end());
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.cpu_seconds = static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC;
  result.tokens = tokens_per_step * steps;
  result.tokens_per_second = static_cast<double>(result.tokens) / result.seconds;
}

// ---- what each stage will allocate -----------------------------------------------------------------------
template <class Model, class Stack>
std::uint64_t activation_peak(const Model& model, const Stack& stack, const options& o, bool embedding_trains) {
  const shape in{o.batch, o.seq, model.config.hidden};
  // The stack's own cost is exact (checkpoint/schedule.hpp), with a packed micro-batch's offsets (training);
  // validation (windows, no offsets) keeps one layer's saved tensors.
  std::uint64_t largest_layer = model.final_norm.saved_bytes(in, {});
  for (const auto& block : model.blocks) largest_layer = std::max<std::uint64_t>(largest_layer, block.saved_bytes(in, {}));
  return step_buffers::activation_bytes(o.batch, o.seq, model.config.hidden, embedding_trains) +
         std::max<std::uint64_t>(stack.cost(in, prediction_context(o)).peak_bytes, largest_layer);
}

// The training step's loss call, as the protocol's arguments.
template <class Model>
memkit::loss::fused_linear_cross_entropy_arguments loss_arguments(const Model& model, const options& o) {
  return {.tokens = o.batch * o.seq, .hidden = model.config.hidden, .vocab = model.config.vocab,
          .hidden_element_bytes = sizeof(act_t), .head_element_bytes = sizeof(memkit::bf16),
          .head_grad = model.head_weight().trains(), .on_device = model.memory.on_device(),
          .options = loss_options(o, model.memory.on_device())};
}

template <class Model>
std::uint64_t workspace_peak(const Model& model, const options& o) {
  const shape in{o.batch, o.seq, model.config.hidden};
  std::uint64_t peak = memkit::loss::workspace_bytes(loss_arguments(model, o));
  for (const auto& block : model.blocks) peak = std::max<std::uint64_t>(peak, block.workspace_bytes(in));
  return peak;
}

// ---- stage 1 ---------------------------------------------------------------------------------------------
// A host copy of a parameter's value (the writer takes host memory; copies it on add).
void add_value(memkit::safetensors::writer& out, const std::string& name, tensor_view<const act_t> value) {
  const std::vector<act_t> values = memkit::layers::copy_out(value);
  out.add(name, tensor_view<const act_t>(values.data(), value.shape(), memkit::memory_kind::host));
}
void add_value(memkit::safetensors::writer& out, memkit::layers::parameter& p) {
  add_value(out, p.name, std::as_const(p.value).view());
}

void save_pretrained(pretrain_model& model, const std::string& path) {
  memkit::safetensors::writer out;
  out.add_metadata("format", "pt");
  for (memkit::layers::parameter* p : model.shared_parameters()) add_value(out, *p);
  for (memkit::layers::dense_linear<act_t>* l : model.linears()) add_value(out, l->weight);
  out.write(path);
}

template <class AdamState, memkit::executor E>
stage_result pretrain(const E& exec, const options& o, memory_meter& meter, std::vector<example::step_record>& records) {
  const resources r = make_resources(meter, o.threads);
  const memkit::layers::trainability mode = o.trained_weights();
  const example::text_dataset data(o.data_dir + "/shakespeare.txt", o.seq);
  meter.reset_peak();

  // Parameters: their sizes first, for the prediction and the optimizer.
  std::vector<shape> shapes{shape{o.model.vocab, o.model.hidden}};
  for (std::int64_t i = 0; i < o.model.layers; ++i) shapes.insert(shapes.end(), {shape{o.model.hidden}, shape{o.model.hidden}});
  shapes.push_back(shape{o.model.hidden});
  shapes.push_back(shape{o.model.vocab, o.model.hidden});
  for (std::int64_t i = 0; i < o.model.layers; ++i)
    for (const llama::projection& p : llama::projections_of(o.model, i)) shapes.push_back(shape{p.out, p.in});
  std::vector<std::int64_t> sizes;
  memory_prediction predicted;
  for (const shape& s : shapes) {
    sizes.push_back(s.numel());
    predicted.peak[memory_category::gradients] += memkit::layers::parameter::grad_bytes(s, mode);
    predicted.peak[memory_category::optimizer_state] += memkit::layers::parameter::master_bytes(s, mode);
  }
  predicted.peak[memory_category::weights] = pretrain_model::shared_weight_bytes(o.model);
  for (std::int64_t i = 0; i < o.model.layers; ++i)
    for (const llama::projection& p : llama::projections_of(o.model, i))
      predicted.peak[memory_category::weights] += memkit::layers::parameter::value_bytes(shape{p.out, p.in});
  memkit::optim::adam_options adam_options;
  adam_options.max_grad_norm = o.max_grad_norm;
  adam_options.host_threads = o.threads;
  adam_options.seed = o.seed;
  predicted.peak[memory_category::optimizer_state] += AdamState::bytes_required(sizes, adam_options);
  predicted.peak[memory_category::other] = step_buffers::other_bytes(o.batch, o.seq, offsets_per_row(o));

  pretrain_model model(o.model, r.model, mode, [&](const llama::projection& p, std::int64_t, int) {
    return memkit::layers::dense_linear<act_t>(p.path + ".weight", p.in, p.out, r.model, mode);
  });
  // Initialization: N(0, 0.02), the residual outputs (o_proj, down_proj) scaled by 1/sqrt(2 layers).
  std::uint64_t stream = 0;
  for (memkit::layers::parameter* p : model.shared_parameters())
    if (p->value.shape().rank == 2) p->init_normal(0.02f, o.seed, ++stream);
  for (auto& block : model.blocks)
    for (auto* l : {&block.q, &block.k, &block.v, &block.o, &block.gate, &block.up, &block.down})
      l->weight.init_normal(l == &block.o || l == &block.down ? 0.02f / std::sqrt(2.0f * float(o.model.layers)) : 0.02f,
                            o.seed, ++stream);

  // The optimizer's tensors, registered by the model itself in the order of `shapes`: matrices decay, the
  // norms' vectors do not.
  param_registry params = decay_matrices_registry(0.1f);
  model.register_parameters(params);
  memkit::require(params.sizes() == sizes, "train_llama: the model's parameters are not the predicted ones");
  AdamState adam(exec, *r.model.optimizer, params.sizes(), adam_options);
  const auto adam_params = params.adam_params();
  const memkit::optim::adam_group adam_base{.beta2 = 0.99f};

  auto stack = make_stack(model, o);
  step_buffers buffers(r, o.batch, o.seq, o.model.hidden, true, offsets_per_row(o));
  predicted.peak[memory_category::activations] = activation_peak(model, stack, o, true);
  predicted.peak[memory_category::workspace] = workspace_peak(model, o);
  predicted.total = predicted.peak.total();

  stage_result result;
  result.validation_before = validation_loss(exec, model, data, buffers, r, o);
  std::printf("\nstage 1: pretraining on %s (%lld bytes), %lld steps of %lld x %lld x %lld tokens\n",
              "examples/data/shakespeare.txt", static_cast<long long>(data.size()), static_cast<long long>(o.pretrain_steps),
              static_cast<long long>(o.accum), static_cast<long long>(o.batch), static_cast<long long>(o.seq));
  if (o.pack)
    std::printf("packed: rows of whole paragraphs (at most %lld a row), attention and positions per paragraph\n",
                static_cast<long long>(pack_documents_per_row));
  std::printf("validation loss before: %.4f\n", result.validation_before);
  run_stage(
      exec, 1, model, stack, data, buffers, r, o, o.pretrain_steps, o.pretrain_lr,
      [&](float lr, float scale) { adam.step(exec, adam_params, params.adam_groups(adam_base, lr), scale); },
      [&] { memkit::layers::zero_grad(exec, params); },
      records, result);
  result.validation_after = validation_loss(exec, model, data, buffers, r, o);
  std::printf("validation loss after:  %.4f   (last step: %s)\n", result.validation_after,
              adam.report(exec).to_string().c_str());
  result.measured = meter.peaks();
  result.predicted = predicted.peak;
  result.measured_peak = meter.tracker.peak_bytes();
  result.predicted_peak = predicted.total;
  result.budget = budget_estimate(o, false, E::on_device);
  print_memory_table("stage 1", predicted, meter, result.budget);
  save_pretrained(model, o.out_dir + "/pretrained.safetensors");
  return result;
}

// ---- stage 2 ---------------------------------------------------------------------------------------------
constexpr memkit::quant::quant_options nf4_options{64, true};

// Reads tensor `name` into `to`, host or device memory (through a host copy).
template <class T>
void read_into(const memkit::safetensors::reader& in, const std::string& name, tensor_view<T> to) {
  if (to.where() == memkit::memory_kind::host) return in.read(name, to);
  std::vector<T> staging(static_cast<std::size_t>(to.size()));
  in.read(name, tensor_view<T>(staging.data(), to.shape(), memkit::memory_kind::host));
  memkit::layers::copy_in(staging.data(), to);
}

// Builds the QLoRA model from a checkpoint: projections quantized to NF4 as they are read (or, with
// `bnb`, read as bitsandbytes 4-bit weights), everything else bf16 and frozen.
template <memkit::executor E>
std::unique_ptr<finetune_model> load_finetune_model(const E& exec, const options& o, const resources& r,
                                                    const std::string& checkpoint, bool bnb) {
  const memkit::safetensors::reader in(checkpoint);
  auto model = std::make_unique<finetune_model>(
      o.model, r.model, memkit::layers::trainability::frozen, [&](const llama::projection& p, std::int64_t i, int k) {
        using base_type = lora_linear_impl::base_type;
        base_type base;
        if (bnb && !E::on_device) {
          base = memkit::quant::load_linear4bit<memkit::quant::NF4>(in, p.path + ".weight", *r.model.weights);
        } else if (bnb) {  // read on the host, then copied to the device
          base = llama::copy_quantized(memkit::quant::load_linear4bit<memkit::quant::NF4>(in, p.path + ".weight",
                                                                                   memkit::default_host_resource()),
                                *r.model.weights);
        } else {
          memkit::buffer<act_t> staging = memkit::workspace_buffer<act_t>(exec, *r.model.workspace, shape{p.out, p.in});
          read_into(in, p.path + ".weight", staging.view());
          base = base_type(*r.model.weights, shape{p.out, p.in}, nf4_options);
          base.quantize_into(exec, std::as_const(staging).view(), p.path.c_str(), *r.model.workspace);
        }
        return lora_linear_impl(p.path, std::move(base), o.lora_rank, o.lora_alpha, r.model, o.seed + 99,
                                static_cast<std::uint64_t>(i * 7 + k));
      });
  for (memkit::layers::parameter* p : model->shared_parameters()) read_into(in, p->name, p->value.view());
  return model;
}

memkit::peft::lora_config adapter_config(const options& o) {
  memkit::peft::lora_config c;
  c.r = o.lora_rank;
  c.lora_alpha = o.lora_alpha;
  c.target_modules = memkit::peft::module_selector::of({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"});
  c.task_type = "CAUSAL_LM";
  return c;
}

void save_qlora(finetune_model& model, const options& o, const std::string& adapter_dir, const std::string& base_path) {
  memkit::peft::adapter_writer adapter(adapter_config(o));
  memkit::safetensors::writer base;
  base.add_metadata("format", "pt");
  for (lora_linear_impl* l : model.linears()) {
    const std::vector<adapter_t> a = memkit::layers::copy_out(tensor_view<const adapter_t>(l->lora_A()));
    const std::vector<adapter_t> b = memkit::layers::copy_out(tensor_view<const adapter_t>(l->lora_B()));
    adapter.add<adapter_t>(l->path, tensor_view<const adapter_t>(a.data(), l->lora_A().shape(), memkit::memory_kind::host),
                           tensor_view<const adapter_t>(b.data(), l->lora_B().shape(), memkit::memory_kind::host));
    if (l->base_weight().where() == memkit::memory_kind::host)
      memkit::quant::save_linear4bit(base, l->path + ".weight", l->base_weight(), {"bfloat16"});
    else
      memkit::quant::save_linear4bit(base, l->path + ".weight",
                                     llama::copy_quantized(l->base_weight(), memkit::default_host_resource()), {"bfloat16"});
  }
  for (memkit::layers::parameter* p : model.shared_parameters()) add_value(base, *p);
  adapter.write(adapter_dir);
  base.write(base_path);
}

void load_adapter(finetune_model& model, const std::string& adapter_dir) {
  const memkit::peft::adapter_file file(adapter_dir);
  std::vector<memkit::peft::lora_tensors<adapter_t>> destinations;
  for (lora_linear_impl* l : model.linears()) destinations.push_back({l->path, l->lora_A(), l->lora_B(), {}});
  file.load(destinations);
}

// Samples `count` bytes after `prompt` (temperature 0.8), re-running the model over the last seq bytes.
template <memkit::executor E>
std::string sample_text(const E& exec, finetune_model& model, const resources& r, const options& o,
                        const std::string& prompt, std::int64_t count) {
  std::vector<std::int32_t> ids = example::byte_tokenizer::encode(prompt);
  const std::int64_t h = model.config.hidden, V = model.config.vocab;
  const std::int64_t window = std::min<std::int64_t>(o.seq, 64);
  memkit::activation_store store(r.activations);
  memkit::buffer<act_t> x(r.activations, shape{1, window, h}), y(r.activations, shape{1, window, h});
  memkit::buffer<std::int32_t> tokens(r.other, shape{window});
  std::vector<float> logits(static_cast<std::size_t>(V));
  const std::vector<act_t> head = memkit::layers::copy_out(std::as_const(model.head_weight().value).view());  // the logits are made on the host
  const memkit::memory_kind where = x.where();
  for (std::int64_t n = 0; n < count; ++n) {
    const std::int64_t len = std::min<std::int64_t>(window, static_cast<std::int64_t>(ids.size()));
    const std::vector<std::int32_t> context(ids.end() - len, ids.end());
    memkit::layers::copy_in(context.data(), tensor_view<std::int32_t>(tokens.data(), shape{len}, where));
    const shape in{1, len, h};
    model.embed.forward(exec, tensor_view<const std::int32_t>(tokens.data(), shape{len}, where), tensor_view<act_t>(x.data(), in, where));
    act_t* a = x.data();
    act_t* b = y.data();
    for (auto& block : model.blocks) {
      block.forward(exec, {o.seed, 0, false}, tensor_view<const act_t>(a, in, where), tensor_view<act_t>(b, in, where), store);
      store.clear();
      std::swap(a, b);
    }
    model.final_norm.forward(exec, {o.seed, 0, false}, tensor_view<const act_t>(a, in, where), tensor_view<act_t>(b, in, where),
                             store);
    store.clear();
    const std::vector<act_t> last_row = memkit::layers::copy_out(tensor_view<const act_t>(b + (len - 1) * h, shape{h}, where));
    const act_t* last = last_row.data();
    float m = -1e30f;
    for (std::int64_t v = 0; v < V; ++v) {
      float z = 0;
      for (std::int64_t j = 0; j < h; ++j) z += float(last[j]) * float(head[static_cast<std::size_t>(v * h + j)]);
      logits[static_cast<std::size_t>(v)] = z / 0.8f;
      m = std::max(m, logits[static_cast<std::size_t>(v)]);
    }
    double sum = 0;
    for (float& z : logits) sum += (z = std::exp(z - m));
    const double u = memkit::unit_float(memkit::random_word(o.seed, 777, static_cast<std::uint64_t>(n))) * sum;
    double acc = 0;
    std::int32_t chosen = static_cast<std::int32_t>(V - 1);
    for (std::int64_t v = 0; v < V; ++v) {
      acc += logits[static_cast<std::size_t>(v)];
      if (u < acc) {
        chosen = static_cast<std::int32_t>(v);
        break;
      }
    }
    ids.push_back(chosen);
  }
  return example::byte_tokenizer::decode(ids);
}

struct finetune_outcome {
  stage_result result;
  double loss_before_save = 0, loss_after_reload = 0;
  std::string sample;
};

// The optimizer's tensors of a LoRA / QLoRA stage: A and B of each adapted projection (the frozen base
// registers nothing), checked against the sizes the memory prediction was made for.
template <class Model>
memkit::layers::parameter_registry<adapter_t> adapter_parameters(Model& model, const std::vector<std::int64_t>& sizes) {
  memkit::layers::parameter_registry<adapter_t> params;
  model.register_parameters(params);
  memkit::require(params.sizes() == sizes, "train_llama: the model's adapters are not the predicted ones");
  return params;
}

template <memkit::executor E>
finetune_outcome finetune(const E& exec, const options& o, memory_meter& meter, std::vector<example::step_record>& records) {
  const resources r = make_resources(meter, o.threads);
  const example::text_dataset data(o.data_dir + "/austen.txt", o.seq);
  meter.reset_peak();
  finetune_outcome outcome;
  stage_result& result = outcome.result;

  memory_prediction predicted;
  std::vector<std::int64_t> sizes;
  std::uint64_t largest_staging = 0;
  for (std::int64_t i = 0; i < o.model.layers; ++i)
    for (const llama::projection& p : llama::projections_of(o.model, i)) {
      predicted.peak[memory_category::weights] +=
          lora_linear_impl::base_type::bytes_required(shape{p.out, p.in}, nf4_options) +
          lora_linear_impl::parameter_bytes(p.in, p.out, o.lora_rank);
      predicted.peak[memory_category::gradients] += lora_linear_impl::gradient_bytes(p.in, p.out, o.lora_rank);
      sizes.push_back(o.lora_rank * p.in);
      sizes.push_back(p.out * o.lora_rank);
      largest_staging = std::max<std::uint64_t>(
          largest_staging, memkit::buffer<act_t>::bytes_required(shape{p.out, p.in}) +
                               memkit::quant::workspace_bytes(memkit::quant::quantize_arguments{
                                   lora_linear_impl::base_type::quant_format, shape{p.out, p.in}, nf4_options}));
    }
  predicted.peak[memory_category::weights] += finetune_model::shared_weight_bytes(o.model);
  memkit::optim::adam_options adam_options;
  adam_options.max_grad_norm = o.max_grad_norm;
  adam_options.host_threads = o.threads;
  adam_options.seed = o.seed;  // stochastic rounding of bf16 adapters
  predicted.peak[memory_category::optimizer_state] = memkit::optim::adam_state<std::int8_t, 256>::bytes_required(sizes, adam_options);
  predicted.peak[memory_category::other] = step_buffers::other_bytes(o.batch, o.seq, offsets_per_row(o));

  std::unique_ptr<finetune_model> model = load_finetune_model(exec, o, r, o.out_dir + "/pretrained.safetensors", false);
  const auto params = adapter_parameters(*model, sizes);
  memkit::optim::adam_state<std::int8_t, 256> adam(exec, *r.model.optimizer, params.sizes(), adam_options);
  const auto adam_params = params.adam_params();
  const memkit::optim::adam_group adam_base{.beta2 = 0.99f, .weight_decay = 0.0f};
  auto stack = make_stack(*model, o);
  step_buffers buffers(r, o.batch, o.seq, o.model.hidden, false, offsets_per_row(o));
  predicted.peak[memory_category::activations] = activation_peak(*model, stack, o, false);
  predicted.peak[memory_category::workspace] = std::max<std::uint64_t>(workspace_peak(*model, o), largest_staging);
  predicted.total = predicted.peak.total();

  result.validation_before = validation_loss(exec, *model, data, buffers, r, o);
  std::printf("\nstage 2: QLoRA on %s (%lld bytes): NF4 base (block 64, double quantization), LoRA r=%lld alpha=%.0f "
              "on all 7 projections, %lld steps\n",
              "examples/data/austen.txt", static_cast<long long>(data.size()), static_cast<long long>(o.lora_rank),
              o.lora_alpha, static_cast<long long>(o.finetune_steps));
  if (o.pack) std::printf("packed: rows of whole paragraphs, attention and positions per paragraph\n");
  std::printf("validation loss before: %.4f\n", result.validation_before);
  run_stage(
      exec, 2, *model, stack, data, buffers, r, o, o.finetune_steps, o.finetune_lr,
      [&](float lr, float scale) { adam.step(exec, adam_params, params.adam_groups(adam_base, lr), scale); },
      [&] { memkit::layers::zero_grad(exec, params); },
      records, result);
  result.validation_after = validation_loss(exec, *model, data, buffers, r, o);
  std::printf("validation loss after:  %.4f   (last step: %s)\n", result.validation_after,
              adam.report(exec).to_string().c_str());
  result.measured = meter.peaks();
  result.predicted = predicted.peak;
  result.measured_peak = meter.tracker.peak_bytes();
  result.predicted_peak = predicted.total;
  result.budget = budget_estimate(o, true, E::on_device);
  print_memory_table("stage 2", predicted, meter, result.budget);

  // Save: the adapter as PEFT writes it, the base as bitsandbytes' 4-bit checkpoint; reload both into a
  // fresh model and compare the validation loss.
  const std::string adapter_dir = o.out_dir + "/adapter", base_path = o.out_dir + "/base-nf4.safetensors";
  outcome.loss_before_save = result.validation_after;
  save_qlora(*model, o, adapter_dir, base_path);
  outcome.sample = sample_text(exec, *model, r, o, "\"", o.sample_bytes);
  model.reset();
  {
    std::unique_ptr<finetune_model> reloaded = load_finetune_model(exec, o, r, base_path, true);
    load_adapter(*reloaded, adapter_dir);
    outcome.loss_after_reload = validation_loss(exec, *reloaded, data, buffers, r, o);
  }
  std::printf("saved %s/ (PEFT) and %s (bitsandbytes NF4); reloaded: validation loss %.6f (before saving %.6f)\n",
              adapter_dir.c_str(), base_path.c_str(), outcome.loss_after_reload, outcome.loss_before_save);
  return outcome;
}

// ---- fine-tuning a Hugging Face checkpoint (--model) or a config with random weights (--init random) -------
// The options with the loss's chunk the stage ran with (under --memory-cap, chosen from the memory left), for
// the reloaded model's validation.
options stage_loss_chunk(const options& o, const stage_result& result) {
  options v = o;
  v.loss_chunk_tokens = result.loss_chunk;
  return v;
}

// The dataset: the token file (checked against the model's vocabulary), or random ids for a speed and
// memory run of a config without data.
example::text_dataset checkpoint_dataset(const options& o) {
  if (o.token_file.empty()) {
    std::vector<std::int32_t> ids(static_cast<std::size_t>(std::max<std::int64_t>(1 << 16, 40 * (o.seq + 1))));
    for (std::size_t i = 0; i < ids.size(); ++i)
      ids[i] = static_cast<std::int32_t>(memkit::random_word(o.seed, 77, i) % static_cast<std::uint64_t>(o.model.vocab));
    return example::text_dataset(std::move(ids), o.seq, "random token ids");
  }
  memkit::models::token_file tokens = memkit::models::read_token_file(o.token_file);
  memkit::require(static_cast<std::int64_t>(tokens.vocab_size) <= o.model.vocab,
                  o.token_file + ": its tokenizer has " + std::to_string(tokens.vocab_size) +
                      " tokens, more than the model's vocab_size " + std::to_string(o.model.vocab));
  return example::text_dataset(std::move(tokens.ids), o.seq, o.token_file);
}

memkit::peft::lora_config checkpoint_adapter_config(const options& o) {
  memkit::peft::lora_config c = adapter_config(o);
  c.base_model_name_or_path = o.model_dir;
  c.target_modules = memkit::peft::module_selector::of(o.targets);
  return c;
}

// Host memory for offloaded checkpoints, outside the cap: pinned on a CUDA device (the copies overlap the
// compute only from pinned memory), the default host resource on the host.
template <memkit::executor E>
memkit::memory_resource& checkpoint_host_memory() {
#if MEMKIT_HAS_CUDA
  if constexpr (E::on_device) {
    static memkit::pinned_host_resource pinned;
    return pinned;
  }
#endif
  return memkit::default_host_resource();
}

// --memory-cap (#30, #31): the loss's chunk from the memory left when it starts: the cap minus what the step
// holds then, predicted from the components' byte functions (weights, gradients, optimizer state and the
// loop's buffers as allocated up front, and what the checkpointed stack keeps after forward). The largest
// chunk, up to --loss-chunk (default: the micro-batch), whose whole call fits what is left; the floor is one
// token, and when even that does not fit the step cannot run under the cap: out_of_memory, saying why.
template <class Model, class Stack>
std::int64_t loss_chunk_under_cap(const Model& model, const Stack& stack, const options& o,
                                  const memory_prediction& predicted, bool embedding_trains) {
  const std::uint64_t cap = static_cast<std::uint64_t>(o.memory_cap_mib) << 20;
  const shape in{o.batch, o.seq, model.config.hidden};
  const std::uint64_t held = predicted.peak[memory_category::weights] + predicted.peak[memory_category::gradients] +
                             predicted.peak[memory_category::optimizer_state] + predicted.peak[memory_category::other] +
                             step_buffers::activation_bytes(o.batch, o.seq, model.config.hidden, embedding_trains) +
                             stack.cost(in, {}).saved_bytes;
  const std::uint64_t left = held < cap ? cap - held : 0;
  const std::int64_t tokens = o.batch * o.seq;
  const std::int64_t most = o.loss_chunk_tokens > 0 ? std::min(o.loss_chunk_tokens, tokens) : tokens;
  memkit::loss::fused_linear_cross_entropy_arguments args = loss_arguments(model, o);
  const std::int64_t chunk = memkit::loss::chunk_tokens_within(args, static_cast<std::size_t>(left), most);
  if (chunk == 0) {
    args.options.chunk_bytes = memkit::loss::chunk_bytes_for(1, args.vocab, args.hidden_element_bytes, args.on_device);
    const std::size_t one = memkit::loss::bytes_required(args);
    throw memkit::out_of_memory(
        "under --memory-cap " + std::to_string(o.memory_cap_mib) + " MiB the step holds " +
            memkit::format_bytes(held) + " when the loss starts, leaving " + memkit::format_bytes(left) +
            "; the loss needs " + memkit::format_bytes(one) + " even with a one-token chunk (" +
            std::to_string(tokens) + " tokens)",
        one);
  }
  return chunk;
}

// What both fine-tunings of a checkpoint share once the model and its optimizer exist: the checkpointed
// stack (its checkpoints where --offload-checkpoints says), the loss's chunk under --memory-cap, the rest of
// the memory prediction (activations, workspace with the loading staging), the loop with the validation loss
// before and after, and the memory table. `buffers` stays the caller's (the reloaded model is validated with
// it).
template <memkit::executor E, class Model, class StepOptimizer, class ZeroGrad>
void train_checkpoint_stage(const E& exec, const options& given, const char* what, Model& model,
                            const example::text_dataset& data, step_buffers& buffers, const resources& r,
                            memory_meter& meter, memory_prediction& predicted, std::uint64_t staging, bool lora,
                            StepOptimizer&& step_optimizer, ZeroGrad&& zero_grad,
                            std::vector<example::step_record>& records, stage_result& result) {
  // Where the blocks' inputs wait: as the budget's plan says (--offload-checkpoints; auto under a cap: on the
  // host when the on-device ones would not fit). Offloaded ones are counted by their own tracker, outside
  // the cap. The offload outlives the stack.
  const budget::training_plan plan = checkpoint_budget_plan(given, lora, E::on_device);
  memkit::tracking_resource offload_memory(checkpoint_host_memory<E>(), "offloaded checkpoints");
  memkit::checkpoint::offload offload(offload_memory.category(memory_category::activations));
  auto stack = make_stack(model, given, plan.offload_checkpoints ? &offload : nullptr);
  options o = given;
  if (given.memory_cap_mib > 0) o.loss_chunk_tokens = loss_chunk_under_cap(model, stack, given, predicted, !lora);
  result.loss_chunk = o.loss_chunk_tokens > 0 ? o.loss_chunk_tokens : o.batch * o.seq;
  result.offloaded = plan.offload_checkpoints;
  if (!given.trial && given.memory_cap_mib > 0)
    std::printf("under --memory-cap %lld MiB: checkpoints %s; the loss's chunk %lld tokens (the memory left at the "
                "loss point; memory_budget chooses %llu)\n",
                static_cast<long long>(given.memory_cap_mib),
                plan.offload_checkpoints ? "in host memory outside the cap" : "on the device",
                static_cast<long long>(result.loss_chunk),
                static_cast<unsigned long long>(budget::estimate_memory(budget_model(given), plan).loss_chunk_tokens));
  predicted.peak[memory_category::activations] = activation_peak(model, stack, o, !lora);
  predicted.peak[memory_category::workspace] = std::max<std::uint64_t>(workspace_peak(model, o), staging);
  predicted.total = predicted.peak.total();
  if (o.trial) {  // one step of a search: the step alone, quietly
    run_stage(exec, 2, model, stack, data, buffers, r, o, o.finetune_steps, o.finetune_lr, step_optimizer, zero_grad,
              records, result);
    result.measured_peak = meter.tracker.peak_bytes();
    result.predicted_peak = predicted.total;
    result.offloaded_peak = offload_memory.peak_bytes();
    return;
  }
  result.validation_before = validation_loss(exec, model, data, buffers, r, o);
  std::printf("\n%s on %s (%lld tokens), %lld steps\nvalidation loss before: %.4f\n", what,
              o.token_file.empty() ? "random token ids" : o.token_file.c_str(), static_cast<long long>(data.size()),
              static_cast<long long>(o.finetune_steps), result.validation_before);
  run_stage(exec, 2, model, stack, data, buffers, r, o, o.finetune_steps, o.finetune_lr, step_optimizer, zero_grad,
            records, result);
  result.validation_after = validation_loss(exec, model, data, buffers, r, o);
  std::printf("validation loss after:  %.4f\n", result.validation_after);
  result.measured = meter.peaks();
  result.predicted = predicted.peak;
  result.measured_peak = meter.tracker.peak_bytes();
  result.predicted_peak = predicted.total;
  result.offloaded_peak = offload_memory.peak_bytes();
  result.budget = budget_estimate(given, lora, E::on_device);
  print_memory_table(what, predicted, meter, result.budget);
  if (plan.offload_checkpoints)
    std::printf("  offloaded checkpoints in host memory (outside the cap): %s measured, %s predicted by memory_budget\n",
                memkit::format_bytes(result.offloaded_peak).c_str(), memkit::format_bytes(result.budget.host_bytes).c_str());
}

// What a LoRA / QLoRA fine-tuning of the checkpoint will allocate, from the components' byte functions, before
// it allocates: weights, gradients, optimizer state and the loop's token buffers (activations and workspace
// follow from the stack), the adapters' sizes for the optimizer, and the largest staging of the build.
struct checkpoint_prediction {
  memory_prediction predicted;
  std::vector<std::int64_t> sizes;
  std::uint64_t staging = 0;
  memkit::optim::adam_options adam_options;
};

template <class Projection>
checkpoint_prediction predict_checkpoint(const options& o) {
  using model_type = llama::causal_lm<act_t, Projection>;
  checkpoint_prediction out;
  memory_prediction& predicted = out.predicted;
  // The host pieces the model's filler holds per tensor (the checkpoint reader's, or the random filler's).
  const auto pieces = [&](std::int64_t elements) -> std::uint64_t {
    return o.model_dir.empty() ? llama::random_weights::staging_bytes<act_t>(elements)
                               : llama::reading_staging_bytes<act_t>(elements);
  };
  for (std::int64_t i = 0; i < o.model.layers; ++i)
    for (const llama::projection& p : llama::projections_of(o.model, i)) {
      const shape w{p.out, p.in};
      if constexpr (Projection::quantized_base) {
        predicted.peak[memory_category::weights] += Projection::base_type::bytes_required(w, nf4_options);
        // The dense staging of one projection, with the filler's pieces and then quantize_into's workspace.
        out.staging = std::max<std::uint64_t>(
            out.staging, memkit::buffer<act_t>::bytes_required(w) +
                             std::max<std::uint64_t>(pieces(w.numel()),
                                                     memkit::quant::workspace_bytes(memkit::quant::quantize_arguments{
                                                         Projection::base_type::quant_format, w, nf4_options})));
      } else {
        predicted.peak[memory_category::weights] += memkit::buffer<act_t>::bytes_required(w);
        out.staging = std::max<std::uint64_t>(out.staging, pieces(w.numel()));
      }
      const std::string name = p.path.substr(p.path.rfind('.') + 1);
      const std::int64_t rank = std::find(o.targets.begin(), o.targets.end(), name) != o.targets.end() ? o.lora_rank : 0;
      predicted.peak[memory_category::weights] += Projection::parameter_bytes(p.in, p.out, rank) +
                                                  (p.bias ? memkit::buffer<act_t>::bytes_required(shape{p.out}) : 0);
      predicted.peak[memory_category::gradients] += Projection::gradient_bytes(p.in, p.out, rank);
      if (rank > 0) {
        out.sizes.push_back(rank * p.in);
        out.sizes.push_back(p.out * rank);
      }
    }
  predicted.peak[memory_category::weights] += model_type::shared_weight_bytes(o.model);
  out.adam_options.max_grad_norm = o.max_grad_norm;
  out.adam_options.host_threads = o.threads;
  out.adam_options.seed = o.seed;
  predicted.peak[memory_category::optimizer_state] =
      memkit::optim::adam_state<std::int8_t, 256>::bytes_required(out.sizes, out.adam_options);
  predicted.peak[memory_category::other] = step_buffers::other_bytes(o.batch, o.seq, offsets_per_row(o));
  return out;
}

// The LoRA / QLoRA model of --model DIR (read) or --init random --config (built with random weights).
template <class Projection, memkit::executor E>
std::unique_ptr<llama::causal_lm<act_t, Projection>> build_checkpoint_model(const E& exec, const options& o, const resources& r) {
  using base_elem = std::conditional_t<Projection::quantized_base, memkit::quant::quantized_tensor<memkit::quant::NF4>, act_t>;
  llama::lora_load_options load;
  load.lora.rank = o.lora_rank;
  load.lora.alpha = o.lora_alpha;
  load.lora.init_seed = o.seed + 99;
  load.quant = nf4_options;
  load.targets = o.targets;
  if (!o.model_dir.empty())
    return llama::load_lora_causal_lm<act_t, base_elem>(exec, llama::hf_checkpoint(o.model_dir, o.seq), r.model, load);
  llama::random_weights fill{o.seed, 0.02f, &llama::host_staging(r.model)};
  return llama::build_lora_causal_lm<act_t, base_elem>(exec, o.model, r.model, load, fill);
}

// QLoRA (Projection = nf4_lora_linear) or LoRA over a bf16 base (dense_lora_linear) of the checkpoint: the
// same loop, memory accounting and checks as stage 2; the adapter is saved in PEFT's format, reloaded into a
// fresh model and checked to give the same validation loss; with --merge the merged dense checkpoint too.
template <class Projection, memkit::executor E>
finetune_outcome finetune_checkpoint(const E& exec, const options& o, memory_meter& meter,
                                     std::vector<example::step_record>& records) {
  using model_type = llama::causal_lm<act_t, Projection>;
  const resources r = make_resources(meter, o.threads);
  const example::text_dataset data = checkpoint_dataset(o);
  meter.reset_peak();
  finetune_outcome outcome;
  stage_result& result = outcome.result;

  // What it will allocate, from the components' byte functions, before it allocates.
  checkpoint_prediction prediction = predict_checkpoint<Projection>(o);
  memory_prediction& predicted = prediction.predicted;
  const std::vector<std::int64_t>& sizes = prediction.sizes;
  const std::uint64_t largest_staging = prediction.staging;
  const memkit::optim::adam_options& adam_options = prediction.adam_options;

  const auto build = [&] { return build_checkpoint_model<Projection>(exec, o, r); };
  const auto load_start = std::chrono::steady_clock::now();
  std::unique_ptr<model_type> model = build();
  if constexpr (E::on_device) exec.synchronize();
  if (!o.trial) std::printf("\n%s %s in %.1f s: %s base, LoRA r=%lld alpha=%.0f on %s; tracked %s (peak %s)\n",
              o.model_dir.empty() ? "built" : "loaded", o.model_dir.empty() ? o.config_file.c_str() : o.model_dir.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count(),
              Projection::quantized_base ? "NF4 (block 64, double quantization)" : "bf16", static_cast<long long>(o.lora_rank),
              o.lora_alpha, o.targets.size() == 7 ? "all 7 projections" : ("the " + std::to_string(o.targets.size()) + " projections of --targets").c_str(), memkit::format_bytes(meter.tracker.current_bytes()).c_str(),
              memkit::format_bytes(meter.tracker.peak_bytes()).c_str());

  const auto params = adapter_parameters(*model, sizes);
  memkit::optim::adam_state<std::int8_t, 256> adam(exec, *r.model.optimizer, params.sizes(), adam_options);
  const auto adam_params = params.adam_params();
  const memkit::optim::adam_group adam_base{.beta2 = 0.99f, .weight_decay = 0.0f};
  step_buffers buffers(r, o.batch, o.seq, o.model.hidden, false, offsets_per_row(o));
  train_checkpoint_stage(
      exec, o, "fine-tuning", *model, data, buffers, r, meter, predicted, largest_staging, true,
      [&](float lr, float scale) { adam.step(exec, adam_params, params.adam_groups(adam_base, lr), scale); },
      [&] { memkit::layers::zero_grad(exec, params); },
      records, result);

  if (o.trial) return outcome;
  // The adapter as PEFT writes it; reloaded into a fresh model, it must give the same validation loss.
  const std::string adapter_dir = o.out_dir + "/adapter";
  outcome.loss_before_save = result.validation_after;
  {
    memkit::peft::adapter_writer adapter(checkpoint_adapter_config(o));
    for (Projection* l : model->linears()) {
      if (!l->adapted()) continue;
      const std::vector<adapter_t> a = memkit::layers::copy_out(tensor_view<const adapter_t>(l->lora_A()));
      const std::vector<adapter_t> b = memkit::layers::copy_out(tensor_view<const adapter_t>(l->lora_B()));
      adapter.add<adapter_t>(l->path, tensor_view<const adapter_t>(a.data(), l->lora_A().shape(), memkit::memory_kind::host),
                             tensor_view<const adapter_t>(b.data(), l->lora_B().shape(), memkit::memory_kind::host));
    }
    adapter.write(adapter_dir);
  }
  if (o.merge) {  // the adapter merged into a bf16 checkpoint (llama::save_merged) for transformers
    llama::save_merged(exec, *model, o.model_dir + "/config.json", o.out_dir + "/merged");
    std::printf("wrote %s/merged/ (the adapter merged into a bf16 checkpoint)\n", o.out_dir.c_str());
  }
  model.reset();
  {
    std::unique_ptr<model_type> reloaded = build();
    llama::load_peft_adapter(*reloaded, adapter_dir);
    outcome.loss_after_reload = validation_loss(exec, *reloaded, data, buffers, r, stage_loss_chunk(o, result));
  }
  std::printf("saved %s/ (PEFT); reloaded onto a fresh model: validation loss %.6f (before saving %.6f)\n",
              adapter_dir.c_str(), outcome.loss_after_reload, outcome.loss_before_save);
  return outcome;
}

// FNV-1a: the trained parameters' checksum (--finetune full, host), printed so that two runs (one process,
// and --zero 3 on MPI ranks) can be compared bit for bit. Over every tensor's values in stage3_units' order.
constexpr std::uint64_t fnv1a_start = 0xcbf29ce484222325ull;
std::uint64_t fnv1a(std::uint64_t h, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}
void print_checksum(std::uint64_t checksum) {
  std::printf("trained parameters: checksum %016llx (FNV-1a over every tensor's bf16 values, stage-3 unit order)\n",
              static_cast<unsigned long long>(checksum));
}

#if defined(MEMKIT_EXAMPLE_MPI)
const memkit::distributed::mpi_communicator& world() {
  static const memkit::distributed::mpi_communicator comm(MPI_COMM_WORLD);
  return comm;
}

// --zero 3 (#32): --finetune full with every tensor sharded over the MPI ranks (stage3_parameters over
// stage3_units: one unit per block, one for the embedding, final norm and head). Every rank builds the whole
// model from the same draws as the one-process run, keeps its slices and frees the rest; from then on its
// tracker holds what stage3_parameters::bytes_required says, and memory_budget's --zero 3 models the same.
// Each block is gathered around its forward and again around its backward (checkpoint::segment recomputes
// through distributed::stage3_layer); the embedding, final norm and head stay gathered through the pass. Every
// rank trains on the same batches, so the mean of the ranks' gradients is each one's: the run must equal one
// rank's bit for bit (the CTest compares the checksum).
template <memkit::executor E>
finetune_outcome finetune_full_stage3(const E& exec, const options& o, memory_meter& meter,
                                      std::vector<example::step_record>& records) {
  static_assert(!E::on_device, "--zero 3 runs on the host");
  const auto& comm = world();
  const resources r = make_resources(meter, o.threads);
  const memkit::layers::trainability mode = o.trained_weights();
  const example::text_dataset data = checkpoint_dataset(o);
  meter.reset_peak();
  finetune_outcome outcome;
  stage_result& result = outcome.result;

  auto model = std::make_unique<pretrain_model>(o.model, r.model, mode, [&](const llama::projection& p, std::int64_t, int) {
    return llama::make_dense_linear<act_t>(p, r.model, mode);
  });
  {  // the one-process run's draws (finetune_full_checkpoint)
    const llama::random_weights fill{o.seed, 0.02f, &llama::host_staging(r.model)};
    std::vector<memkit::layers::parameter*> all = model->shared_parameters();
    for (auto* l : model->linears()) all.push_back(&l->weight);
    for (memkit::layers::parameter* p : all) {
      fill(p->name, p->value.view());
      if (p->has_master()) fill(p->name, p->master.view());
    }
  }
  memkit::optim::adam_options adam_options;
  adam_options.max_grad_norm = o.max_grad_norm;
  adam_options.host_threads = o.threads;
  adam_options.seed = o.seed;
  using runtime_type = memkit::distributed::stage3_parameters<act_t, std::int8_t, 256>;
  auto units = llama::stage3_units(*model);
  std::vector<std::vector<memkit::layers::parameter*>> unit_parameters;
  for (const auto& u : units) unit_parameters.push_back(u.parameters);
  const auto shapes = llama::stage3_unit_shapes<act_t>(o.model, mode);
  const memkit::distributed::stage3_bytes planned = runtime_type::bytes_required(shapes, comm.rank(), comm.size(), adam_options);
  runtime_type runtime(exec, comm, r.model, std::move(units), adam_options, o.seed);
  const std::size_t outer = runtime.unit_count() - 1;
  // The whole model existed on this rank until the runtime took its slices: a loader that reads only a rank's
  // slices would not hold it (not in this example). Measured from here on.
  const std::uint64_t built_peak = meter.tracker.peak_bytes();
  meter.reset_peak();

  memory_prediction predicted;
  predicted.peak[memory_category::weights] =
      planned.weights + llama::rotary<act_t>::table_bytes(o.model.head_dim, o.model.max_positions);
  predicted.peak[memory_category::gradients] = planned.gradients;
  predicted.peak[memory_category::optimizer_state] = planned.optimizer_state;
  predicted.peak[memory_category::other] = step_buffers::other_bytes(o.batch, o.seq, offsets_per_row(o));

  step_buffers buffers(r, o.batch, o.seq, o.model.hidden, true, offsets_per_row(o));
  using block_type = typename decltype(model->blocks)::value_type;
  std::vector<memkit::distributed::stage3_layer<block_type, runtime_type, memkit::distributed::mpi_communicator>> wrapped;
  for (std::size_t i = 0; i < model->blocks.size(); ++i) wrapped.push_back({&model->blocks[i], &runtime, &comm, i});
  auto stack = memkit::checkpoint::segment(
      memkit::checkpoint::layer_sequence(wrapped, model->final_norm),
      {.schedule = o.checkpointing ? memkit::checkpoint::schedule::every_layer() : memkit::checkpoint::schedule::none()});
  predicted.peak[memory_category::activations] = activation_peak(*model, stack, o, true);
  predicted.peak[memory_category::workspace] = std::max<std::uint64_t>(
      workspace_peak(*model, o), runtime_type::gather_workspace_bytes(shapes, comm.size()));
  predicted.total = predicted.peak.total();

  const auto around = [&](std::int64_t i, bool before) {
    if (before) runtime.gather(exec, comm, static_cast<std::size_t>(i), false);
    else runtime.release(exec, comm, static_cast<std::size_t>(i));
  };
  const auto validate = [&] {
    runtime.gather(exec, comm, outer, false);
    const double loss = validation_loss(exec, *model, data, buffers, r, o, around);
    runtime.release(exec, comm, outer);
    return loss;
  };
  result.validation_before = validate();
  std::printf("\nfull fine-tuning under ZeRO stage 3 on %d ranks (rank 0 prints; every rank the same batches) on %s "
              "(%lld tokens), %lld steps\nbuilt whole before sharding: peak %s on this rank; from then on measured\n"
              "validation loss before: %.4f\n",
              comm.size(), o.token_file.empty() ? "random token ids" : o.token_file.c_str(),
              static_cast<long long>(data.size()), static_cast<long long>(o.finetune_steps),
              memkit::format_bytes(built_peak).c_str(), result.validation_before);
  const float mean = 1.0f / static_cast<float>(comm.size());
  run_stage(
      exec, 2, *model, stack, data, buffers, r, o, o.finetune_steps, o.finetune_lr,
      [&](float lr, float scale) {
        runtime.release(exec, comm, outer);  // the embedding's and head's gradients to their owners
        const memkit::optim::adam_group group{.lr = lr, .beta2 = 0.99f, .weight_decay = 0.0f};
        runtime.step(exec, comm, std::span<const memkit::optim::adam_group>(&group, 1), scale * mean);
      },
      [&] { runtime.gather(exec, comm, outer, true); },  // zeroed gradient buffers for the pass
      records, result);
  result.validation_after = validate();
  std::printf("validation loss after:  %.4f\n", result.validation_after);
  result.loss_chunk = o.loss_chunk_tokens > 0 ? o.loss_chunk_tokens : o.batch * o.seq;
  result.measured = meter.peaks();
  result.predicted = predicted.peak;
  result.measured_peak = meter.tracker.peak_bytes();
  result.predicted_peak = predicted.total;
  result.budget = budget_estimate(o, false, E::on_device);
  print_memory_table("full fine-tuning, ZeRO stage 3", predicted, meter, result.budget);

  // Every unit gathered once more: the checksum of the whole trained model, in unit order.
  std::uint64_t checksum = fnv1a_start;
  for (std::size_t u = 0; u < unit_parameters.size(); ++u) {
    runtime.gather(exec, comm, u, false);
    for (const memkit::layers::parameter* p : unit_parameters[u])
      checksum = fnv1a(checksum, p->value.data(), static_cast<std::size_t>(p->size()) * sizeof(act_t));
    runtime.release(exec, comm, u);
  }
  print_checksum(checksum);
  // memory_budget models ZeRO on 2 or more GPUs: on one rank its plan is the unsharded one.
  std::fprintf(stderr, "train_llama: rank %d of %d: tracked peak %s, predicted %s (%+.2f%%), memory_budget %s %s "
               "(%+.2f%%); checksum %016llx\n", comm.rank(), comm.size(), memkit::format_bytes(result.measured_peak).c_str(),
               memkit::format_bytes(result.predicted_peak).c_str(), percent_error(result.predicted_peak, result.measured_peak),
               comm.size() > 1 ? "--zero 3" : "(one GPU: no sharding)", memkit::format_bytes(result.budget.peak).c_str(), percent_error(result.budget.peak, result.measured_peak),
               static_cast<unsigned long long>(checksum));
  outcome.loss_before_save = outcome.loss_after_reload = result.validation_after;  // random weights are not saved
  return outcome;
}
#endif

// --finetune full: every parameter of the checkpoint trains (bf16 values with fp32 master copies, or
// stochastic rounding with --rounding), with stage 1's 8-bit AdamW; saved as out/finetuned/ (config.json +
// model.safetensors) for transformers.
template <memkit::executor E>
finetune_outcome finetune_full_checkpoint(const E& exec, const options& o, memory_meter& meter,
                                          std::vector<example::step_record>& records) {
#if defined(MEMKIT_EXAMPLE_MPI)
  if (o.zero == 3) return finetune_full_stage3(exec, o, meter, records);
#endif
  const resources r = make_resources(meter, o.threads);
  const memkit::layers::trainability mode = o.trained_weights();
  const example::text_dataset data = checkpoint_dataset(o);
  meter.reset_peak();
  finetune_outcome outcome;
  stage_result& result = outcome.result;

  // Every tensor of the checkpoint is a parameter: predicted from its shape before anything is allocated.
  const std::vector<std::pair<std::string, shape>> tensors = llama::checkpoint_tensors<act_t>(o.model);
  std::vector<std::int64_t> sizes;
  memory_prediction predicted;
  std::uint64_t staging = 0;
  for (const auto& [name, s] : tensors) {
    sizes.push_back(s.numel());
    predicted.peak[memory_category::weights] += memkit::layers::parameter::value_bytes(s);
    predicted.peak[memory_category::gradients] += memkit::layers::parameter::grad_bytes(s, mode);
    predicted.peak[memory_category::optimizer_state] += memkit::layers::parameter::master_bytes(s, mode);
    staging = std::max<std::uint64_t>(staging, o.model_dir.empty() ? llama::random_weights::staging_bytes<act_t>(s.numel())
                                                                   : llama::reading_staging_bytes<act_t>(s.numel(), memkit::layers::parameter::master_bytes(s, mode) > 0));
  }
  predicted.peak[memory_category::weights] += llama::rotary<act_t>::table_bytes(o.model.head_dim, o.model.max_positions);
  memkit::optim::adam_options adam_options;
  adam_options.max_grad_norm = o.max_grad_norm;
  adam_options.host_threads = o.threads;
  adam_options.seed = o.seed;
  using adam_type = memkit::optim::adam_state<std::int8_t, 256>;
  predicted.peak[memory_category::optimizer_state] += adam_type::bytes_required(sizes, adam_options);
  predicted.peak[memory_category::other] = step_buffers::other_bytes(o.batch, o.seq, offsets_per_row(o));

  std::unique_ptr<pretrain_model> model;
  if (!o.model_dir.empty()) {
    model = llama::load_causal_lm<act_t>(llama::hf_checkpoint(o.model_dir, o.seq), r.model, mode);
  } else {
    model = std::make_unique<pretrain_model>(o.model, r.model, mode, [&](const llama::projection& p, std::int64_t, int) {
      return llama::make_dense_linear<act_t>(p, r.model, mode);
    });
    // The same draws (the stream is the tensor's name) rounded into the value and kept in the master copy.
    const llama::random_weights fill{o.seed, 0.02f, &llama::host_staging(r.model)};
    std::vector<memkit::layers::parameter*> all = model->shared_parameters();
    for (auto* l : model->linears()) all.push_back(&l->weight);
    for (memkit::layers::parameter* p : all) {
      fill(p->name, p->value.view());
      if (p->has_master()) fill(p->name, p->master.view());
    }
  }
  // The optimizer's tensors, registered by the model in the order of `tensors`: shared parameters, then per
  // projection weight and bias (no weight decay in either group).
  param_registry params = decay_matrices_registry(0.0f);
  model->register_parameters(params);
  memkit::require(params.size() == tensors.size(), "train_llama: the model's parameters are not the checkpoint's tensors");
  for (std::size_t i = 0; i < tensors.size(); ++i)
    memkit::require(params.entries()[i].name == tensors[i].first,
                    "train_llama: parameter " + params.entries()[i].name + " is not the checkpoint's " + tensors[i].first);
  adam_type adam(exec, *r.model.optimizer, params.sizes(), adam_options);
  const auto adam_params = params.adam_params();
  const memkit::optim::adam_group adam_base{.beta2 = 0.99f};
  step_buffers buffers(r, o.batch, o.seq, o.model.hidden, true, offsets_per_row(o));
  train_checkpoint_stage(
      exec, o, "full fine-tuning", *model, data, buffers, r, meter, predicted, staging, false,
      [&](float lr, float scale) { adam.step(exec, adam_params, params.adam_groups(adam_base, lr), scale); },
      [&] { memkit::layers::zero_grad(exec, params); },
      records, result);

  if constexpr (!E::on_device) {  // the values' bytes, in the order --zero 3 prints them
    std::uint64_t checksum = fnv1a_start;
    for (const auto& u : llama::stage3_units(*model))
      for (const memkit::layers::parameter* p : u.parameters)
        checksum = fnv1a(checksum, p->value.data(), static_cast<std::size_t>(p->size()) * sizeof(act_t));
    print_checksum(checksum);
  }
  // Saved as a checkpoint directory; reloaded, it must give the same validation loss.
  outcome.loss_before_save = result.validation_after;
  if (!o.model_dir.empty()) {
    namespace fs = std::filesystem;
    const fs::path dir = fs::path(o.out_dir) / "finetuned";
    fs::create_directories(dir);
    fs::copy_file(fs::path(o.model_dir) / "config.json", dir / "config.json", fs::copy_options::overwrite_existing);
    memkit::safetensors::writer out;
    out.add_metadata("format", "pt");
    for (const auto& p : params.entries()) add_value(out, p.name, p.value);
    out.write((dir / "model.safetensors").string());
    model.reset();
    auto reloaded = llama::load_causal_lm<act_t>(llama::hf_checkpoint(dir.string(), o.seq), r.model, memkit::layers::trainability::frozen);
    outcome.loss_after_reload = validation_loss(exec, *reloaded, data, buffers, r, stage_loss_chunk(o, result));
    std::printf("saved %s/ (config.json + model.safetensors); reloaded: validation loss %.6f (before saving %.6f)\n",
                dir.string().c_str(), outcome.loss_after_reload, outcome.loss_before_save);
  } else {
    outcome.loss_after_reload = outcome.loss_before_save;  // random weights are not worth saving
  }
  return outcome;
}

// The longest sequence in [0, 2^20] that `fits`: doubling from 16 brackets it, then bisection (fits is
// assumed monotone). 0 when 16 does not fit and nothing below it does either.
template <class Fits>
std::int64_t longest_fitting(Fits&& fits) {
  const std::int64_t limit = std::int64_t{1} << 20;
  std::int64_t good = 0, bad = limit + 1;
  for (std::int64_t seq = 16; seq <= limit; seq *= 2) {
    if (!fits(seq)) {
      bad = seq;
      break;
    }
    good = seq;
  }
  while (bad - good > 1) {
    const std::int64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good;
}

// The same answer, bracketed from a guess (memory_budget's prediction) instead of from 16: steps of guess/64
// tokens away from it, doubling, until one length fits and the next does not; then bisection. Every bound is a
// real run, so the answer does not depend on the guess, only the number of runs does (about 8 near a good
// guess instead of about 20: each run at the longest length is what a search costs).
template <class Fits>
std::int64_t longest_fitting_near(Fits&& fits, std::int64_t guess) {
  const std::int64_t limit = std::int64_t{1} << 20;
  if (guess < 16 || guess > limit) return longest_fitting(fits);
  std::int64_t step = std::max<std::int64_t>(1, guess / 64), good = 0, bad = limit + 1;
  if (fits(guess)) {
    good = guess;
    while (good < limit) {
      const std::int64_t next = std::min(good + step, limit);
      if (!fits(next)) {
        bad = next;
        break;
      }
      good = next;
      step *= 2;
    }
  } else {
    bad = guess;
    while (bad > 1) {
      const std::int64_t next = std::max<std::int64_t>(1, bad - step);
      if (fits(next)) {
        good = next;
        break;
      }
      bad = next;
      step *= 2;
    }
  }
  while (bad - good > 1) {
    const std::int64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good;
}

// The search itself over `trial` (with_one_model's): its lines, and with --check its checks.
template <memkit::executor E, class Trial>
int search_lengths(const E&, const options& o, Trial&& trial) {
  const std::uint64_t cap = static_cast<std::uint64_t>(o.memory_cap_mib) << 20;
  int trials = 0;
  std::map<std::int64_t, stage_result> fitted;  // each step that trained, by sequence length
  const auto fits = [&](std::int64_t seq) {
    ++trials;
    try {
      fitted[seq] = trial(seq);
      return true;
    } catch (const memkit::out_of_memory&) {
      return false;
    }
  };
  // memory_budget's answer by the same search over its estimate (the rotary table is sized by the sequence,
  // as the runs size it, so budget::max_sequence's fixed max_positions does not apply).
  const std::int64_t predicted = longest_fitting([&](std::int64_t seq) {
    options p = o;
    p.seq = seq;
    p.model.max_positions = seq;
    const budget::memory_estimate e = budget::estimate_memory(budget_model(p), checkpoint_budget_plan(p, true, E::on_device));
    memkit::require(e.valid(), "train_llama: memory_budget refuses the plan: " + std::string(e.problem));
    return e.peak_bytes(budget::metric::allocated) <= cap;
  });
  const std::int64_t good = longest_fitting_near(fits, predicted);
  const double error = good > 0 ? (double(predicted) - double(good)) / double(good) * 100.0 : 0.0;
  std::printf("longest sequence under %lld MiB (batch %lld, accumulation %lld): %lld tokens trains a step (%d one-step runs); "
              "memory_budget's memkit runtime predicts %lld (%+.2f%%)\n",
              static_cast<long long>(o.memory_cap_mib), static_cast<long long>(o.batch), static_cast<long long>(o.accum),
              static_cast<long long>(good), trials, static_cast<long long>(predicted), error);
  if (good == 0) return o.check ? 1 : 0;
  // The longest step: its speed, its tracked peak and what memory_budget says of it (breakdown at its peak).
  const stage_result& at = fitted.at(good);
  options p = o;
  p.seq = good;
  p.model.max_positions = good;
  const budget::training_plan plan = checkpoint_budget_plan(p, true, E::on_device);
  const budget::memory_estimate e = budget::estimate_memory(budget_model(p), plan);
  const std::uint64_t budget_peak = e.peak_bytes(budget::metric::allocated);
  const double peak_error = percent_error(budget_peak, at.measured_peak);
  std::printf("at %lld tokens: %.0f tokens/s (one step, %.1f s), tracked peak %s (memory_budget %s, %+.2f%%; cap %s); "
              "the loss's chunk %lld tokens (memory_budget %llu); checkpoints %s",
              static_cast<long long>(good), at.tokens_per_second, at.seconds, memkit::format_bytes(at.measured_peak).c_str(),
              memkit::format_bytes(budget_peak).c_str(), peak_error, memkit::format_bytes(cap).c_str(),
              static_cast<long long>(at.loss_chunk), static_cast<unsigned long long>(e.loss_chunk_tokens),
              at.offloaded ? "in host memory" : "on the device");
  if (at.offloaded)
    std::printf(" (%s, memory_budget %s)", memkit::format_bytes(at.offloaded_peak).c_str(),
                memkit::format_bytes(e.host_bytes).c_str());
  std::printf("\nmemory_budget's breakdown at its peak (%s):", std::string(budget::to_string(e.peak_phase)).c_str());
  for (int i = 0; i < budget::category_count; ++i) {
    const auto c = static_cast<budget::category>(i);
    if (e.device[c] != 0 && c != budget::category::overhead)
      std::printf(" %s %s", std::string(budget::to_string(c)).c_str(), memkit::format_bytes(e.device[c]).c_str());
  }
  std::printf("\n");
  if (!o.check) return 0;
  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    std::printf("check: %s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    failures += ok ? 0 : 1;
  };
  expect(std::abs(error) <= 2.0, "memory_budget's longest sequence within 2% of the one found");
  expect(std::abs(peak_error) <= 2.0, "memory_budget's peak at that length within 2% of the tracked one");
  expect(at.measured_peak <= cap, "the tracked peak is under the cap");
  return failures == 0 ? 0 : 1;
}

// --max-seq-search's trials on one model (#31): the model (weights, adapters and their gradients) and the
// optimizer state are built once, under the cap; each trial re-makes only what depends on the length (the
// rotary table, the token buffers, the checkpointed stack and its offload, the loss's chunk) and runs one step
// (forward, loss, backward, optimizer). A trial that hits the cap unwinds with out_of_memory and must leave
// exactly the bytes it found, so the next one starts from the same model: checked with the tracker after every
// trial, trained or not. `search(trial)` runs the search; trial(seq) returns the step's result or throws
// out_of_memory.
template <class Projection, memkit::executor E, class Search>
void with_one_model(const E& exec, const options& o, memory_meter& meter, Search&& search) {
  const resources r = make_resources(meter, o.threads);
  options built = o;
  built.model.max_positions = 1;  // the first trial re-makes the table at its length
  const checkpoint_prediction base = predict_checkpoint<Projection>(built);
  const auto start = std::chrono::steady_clock::now();
  auto model = build_checkpoint_model<Projection>(exec, built, r);
  const auto params = adapter_parameters(*model, base.sizes);
  memkit::optim::adam_state<std::int8_t, 256> adam(exec, *r.model.optimizer, params.sizes(), base.adam_options);
  const auto adam_params = params.adam_params();
  const memkit::optim::adam_group adam_base{.beta2 = 0.99f, .weight_decay = 0.0f};
  if constexpr (E::on_device) exec.synchronize();
  std::printf("built the model and its optimizer once for the search in %.1f s: tracked %s (peak %s)\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
              memkit::format_bytes(meter.tracker.current_bytes()).c_str(),
              memkit::format_bytes(meter.tracker.peak_bytes()).c_str());
  const auto trial = [&](std::int64_t seq) -> stage_result {
    options t = o;
    t.trial = true;
    t.seq = seq;
    t.model.max_positions = seq;
    t.finetune_steps = 1;
    t.log_every = 1 << 30;
    model->set_max_positions(seq);  // part of the model at this length (predict_checkpoint counts it in weights)
    const std::uint64_t held = meter.tracker.current_bytes();
    const auto left_as_found = [&](const char* how) {
      if constexpr (E::on_device) exec.synchronize();
      memkit::require(meter.tracker.current_bytes() == held,
                      std::string("train_llama: a search trial at ") + std::to_string(seq) + " tokens that " + how +
                          " left " + memkit::format_bytes(meter.tracker.current_bytes()) + " allocated, not the " +
                          memkit::format_bytes(held) + " it found");
    };
    stage_result result;
    try {
      checkpoint_prediction prediction = predict_checkpoint<Projection>(t);
      const example::text_dataset data = checkpoint_dataset(t);
      meter.reset_peak();
      std::vector<example::step_record> records;
      step_buffers buffers(r, t.batch, t.seq, t.model.hidden, false, offsets_per_row(t));
      train_checkpoint_stage(
          exec, t, "trial", *model, data, buffers, r, meter, prediction.predicted, 0, true,
          [&](float lr, float scale) { adam.step(exec, adam_params, params.adam_groups(adam_base, lr), scale); },
          [&] { memkit::layers::zero_grad(exec, params); }, records, result);
    } catch (const memkit::out_of_memory&) {
      left_as_found("hit the cap");
      throw;
    }
    left_as_found("trained");
    return result;
  };
  search(trial);
}

// --max-seq-search (#31): the longest sequence whose whole step (forward, loss, backward, optimizer) trains
// within --memory-cap, found by real one-step runs on one model (with_one_model), bracketed from memory_budget's
// memkit runtime answer for the same plan and cap, then bisection, next to that answer. Random token ids; QLoRA
// or LoRA as --finetune says.
template <memkit::executor E>
int max_seq_search(const E& exec, const options& o, memkit::memory_resource& upstream) {
  memory_meter meter(upstream);
  int status = 0;
  const auto search = [&](auto&& trial) { status = search_lengths(exec, o, trial); };
  if (o.qlora) with_one_model<lora_linear_impl>(exec, o, meter, search);
  else with_one_model<llama::dense_lora_linear<act_t>>(exec, o, meter, search);
  return status;
}

template <memkit::executor E>
int run_checkpoint(const E& exec, const options& o, memkit::memory_resource& upstream, const std::string& device_line) {
  const llama::model_config& c = o.model;
  std::int64_t parameters = c.vocab * c.hidden * (c.tie_embeddings ? 1 : 2) + (2 * c.layers + 1) * c.hidden;
  for (std::int64_t i = 0; i < c.layers; ++i)
    for (const llama::projection& p : llama::projections_of(c, i)) parameters += p.in * p.out + (p.bias ? p.out : 0);
  std::printf("memkit train_llama: %s of %s: %lld layers, hidden %lld, %lld heads (%lld kv), head_dim %lld, MLP %lld, "
              "vocab %lld%s, %lld parameters\nmicro-batch %lld x %lld tokens, %lld micro-batches per step; %d host threads; "
              "device: %s\n",
              o.full ? "full fine-tuning" : o.qlora ? "QLoRA" : "LoRA (bf16 base)", o.model_dir.empty() ? (o.config_file + ", random weights").c_str() : o.model_dir.c_str(),
              static_cast<long long>(c.layers), static_cast<long long>(c.hidden), static_cast<long long>(c.heads),
              static_cast<long long>(c.kv_heads), static_cast<long long>(c.head_dim), static_cast<long long>(c.intermediate),
              static_cast<long long>(c.vocab), c.tie_embeddings ? " (tied)" : "", static_cast<long long>(parameters),
              static_cast<long long>(o.batch), static_cast<long long>(o.seq), static_cast<long long>(o.accum), o.threads,
              device_line.c_str());
  if (o.mlp_chunk_tokens > 0)
    std::printf("MLP sequence-tiled: chunks of %lld tokens (recomputed in the backward)\n",
                static_cast<long long>(o.mlp_chunk_tokens));
  if (o.max_seq_search) return max_seq_search(exec, o, upstream);
  memory_meter meter(upstream);
  std::vector<example::step_record> records;
  const finetune_outcome s = o.full    ? finetune_full_checkpoint(exec, o, meter, records)
                              : o.qlora ? finetune_checkpoint<lora_linear_impl>(exec, o, meter, records)
                                        : finetune_checkpoint<llama::dense_lora_linear<act_t>>(exec, o, meter, records);
  const std::string csv = o.out_dir + "/train_llama.csv", svg = o.out_dir + "/train_llama.svg";
  example::write_csv(csv, records);
  example::write_svg(svg, records, "memkit train_llama: loss and tracked memory per optimizer step");
  std::printf("\nsummary: %lld steps x %lld tokens, training loss %.3f -> %.3f, validation %.3f -> %.3f, %.1f s, "
              "%.0f tokens/s (%.0f tokens/CPU-s)\n  peak predicted / measured %s / %s (%+.2f%%), memory_budget %s (%+.2f%%)\n",
              static_cast<long long>(o.finetune_steps), static_cast<long long>(o.batch * o.seq * o.accum), s.result.first_loss,
              s.result.last_loss, s.result.validation_before, s.result.validation_after, s.result.seconds,
              s.result.tokens_per_second, static_cast<double>(s.result.tokens) / s.result.cpu_seconds,
              memkit::format_bytes(s.result.predicted_peak).c_str(), memkit::format_bytes(s.result.measured_peak).c_str(),
              percent_error(s.result.predicted_peak, s.result.measured_peak), memkit::format_bytes(s.result.budget.peak).c_str(),
              percent_error(s.result.budget.peak, s.result.measured_peak));
  if (!o.check) return 0;
  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    std::printf("check: %s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    failures += ok ? 0 : 1;
  };
  auto within = [](std::uint64_t predicted, std::uint64_t measured, double fraction) {
    return std::abs(double(predicted) - double(measured)) <= fraction * double(measured);
  };
  if (!o.token_file.empty()) expect(s.result.last_loss < s.result.first_loss, "the training loss falls");
  // Each category's own peak is predicted from the components' byte functions; their sum bounds the total
  // (the categories peak at different moments: on a tiny model that gap is several percent).
  bool categories_exact = true;
  for (int i = 0; i < memkit::memory_category_count; ++i) {
    const auto c = static_cast<memory_category>(i);
    categories_exact = categories_exact && within(s.result.predicted[c], s.result.measured[c], 0.02);
  }
  expect(categories_exact, "every category's peak predicted within 2%");
  expect(s.result.predicted_peak >= s.result.measured_peak, "the predicted total bounds the measured peak");
  expect(within(s.result.budget.peak, s.result.measured_peak, 0.02), "memory_budget's memkit runtime within 2% of the tracker");
  expect(s.loss_after_reload == s.loss_before_save, "the reloaded PEFT adapter gives the same validation loss");
  if (o.memory_cap_mib > 0) {
    expect(s.result.measured_peak <= (static_cast<std::uint64_t>(o.memory_cap_mib) << 20), "the tracked peak is under the cap");
    // Equal on the host; on a device memory_budget rounds each allocation to its granularity (512 B), which
    // can cost the chunk a token or so.
    const double chunk = static_cast<double>(s.result.loss_chunk), budget_chunk = static_cast<double>(s.result.budget.loss_chunk);
    expect(std::abs(chunk - budget_chunk) <= std::max(1.0, 0.01 * chunk),
           "the loss's chunk under the cap is memory_budget's (within 1%, at least one token)");
  }
  if (s.result.offloaded)
    expect(within(s.result.budget.host_bytes, s.result.offloaded_peak, 0.02),
           "memory_budget's offloaded checkpoint bytes within 2% of the tracked ones");
  return failures == 0 ? 0 : 1;
}

// ---- main ------------------------------------------------------------------------------------------------
// Empty when a CUDA device is usable, else why not (one line).
std::string why_no_cuda_device() {
#if MEMKIT_HAS_CUDA
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess)
    return std::string("no usable CUDA device (") + cudaGetErrorName(status) + ": " + cudaGetErrorString(status) + ")";
  if (devices == 0) return "no usable CUDA device (cudaGetDeviceCount reported 0 devices)";
  return "";
#else
  return "this build has no CUDA (memkit_example_train_llama is the g++ build; the CUDA path is in "
         "memkit_example_train_llama_cuda, built when CMake finds nvcc)";
#endif
}

// Both stages on one executor, every byte through one tracker over `upstream`.
template <memkit::executor E>
int run(const E& exec, const options& o, memkit::memory_resource& upstream, const std::string& device_line) {
  if (o.from_checkpoint()) return run_checkpoint(exec, o, upstream, device_line);
  std::printf("memkit example: a Llama-style decoder, %lld layers, hidden %lld, %lld heads (%lld kv), head_dim %lld, "
              "MLP %lld, byte vocabulary; micro-batch %lld x %lld tokens, %lld micro-batches per step; %d host threads\n",
              static_cast<long long>(o.model.layers), static_cast<long long>(o.model.hidden),
              static_cast<long long>(o.model.heads), static_cast<long long>(o.model.kv_heads),
              static_cast<long long>(o.model.head_dim), static_cast<long long>(o.model.intermediate),
              static_cast<long long>(o.batch), static_cast<long long>(o.seq), static_cast<long long>(o.accum), o.threads);
  std::printf("components: memkit memkit::checkpoint::segment (%s), adam_state<%s> (AdamW, clipping at %.1f), "
              "gradient_accumulation, quantized_tensor<NF4>, quant::matmul, linalg::gemm, peft::adapter_writer, "
              "quant::save_linear4bit, tracking_resource\n",
              o.checkpointing ? "a checkpoint per block" : "no checkpointing",
              o.adam32 ? "float> in stage 1, adam_state<int8, 256" : "int8, 256", o.max_grad_norm);
  std::printf("attention: memkit::attention (FlashAttention-style, causal GQA)\nloss:      "
              "memkit::loss::fused_linear_cross_entropy (chunks of %lld tokens)\nLoRA:      %s\n",
              static_cast<long long>(o.loss_chunk_tokens > 0 ? o.loss_chunk_tokens : o.batch * o.seq),
              lora_linear_impl::description);
  if (o.mlp_chunk_tokens > 0)
    std::printf("MLP:       sequence-tiled, chunks of %lld tokens (recomputed in the backward)\n",
                static_cast<long long>(o.mlp_chunk_tokens));
  std::int64_t parameters = 2 * o.model.vocab * o.model.hidden + (2 * o.model.layers + 1) * o.model.hidden;
  for (std::int64_t i = 0; i < o.model.layers; ++i)
    for (const llama::projection& p : llama::projections_of(o.model, i)) parameters += p.in * p.out;
  std::printf("parameters: %lld\n", static_cast<long long>(parameters));
  std::printf("device: %s\n", device_line.c_str());
  const budget::memory_estimate plan = budget::estimate_memory(example_model, pretrain_plan);
  std::printf("memory_budget (compile-time check against a %s): this recipe at the default size needs %s on a GPU\n",
              std::string(budget::presets::t4.name).c_str(), memkit::format_bytes(plan.peak_device_bytes).c_str());

  memory_meter meter(upstream);
  std::vector<example::step_record> records;
  const stage_result s1 = o.adam32 ? pretrain<memkit::optim::adam_state<float>>(exec, o, meter, records)
                                   : pretrain<memkit::optim::adam_state<std::int8_t, 256>>(exec, o, meter, records);
  const finetune_outcome s2 = finetune(exec, o, meter, records);

  std::printf("\nsample after stage 2 (temperature 0.8):\n----\n%s\n----\n", s2.sample.c_str());

  const std::string csv = o.out_dir + "/train_llama.csv", svg = o.out_dir + "/train_llama.svg";
  example::write_csv(csv, records);
  example::write_svg(svg, records, "memkit train_llama: loss and tracked memory per optimizer step");

  std::printf("\nsummary                      stage 1 (pretrain)   stage 2 (QLoRA)\n");
  std::printf("  steps x tokens             %8lld x %-8lld  %8lld x %-8lld\n", static_cast<long long>(o.pretrain_steps),
              static_cast<long long>(o.batch * o.seq * o.accum), static_cast<long long>(o.finetune_steps),
              static_cast<long long>(o.batch * o.seq * o.accum));
  std::printf("  training loss first->last  %7.3f -> %-7.3f  %7.3f -> %-7.3f\n", s1.first_loss, s1.last_loss, s2.result.first_loss,
              s2.result.last_loss);
  std::printf("  validation loss            %7.3f -> %-7.3f  %7.3f -> %-7.3f\n", s1.validation_before, s1.validation_after,
              s2.result.validation_before, s2.result.validation_after);
  std::printf("  time, tokens/s             %6.1f s %8.0f    %6.1f s %8.0f\n", s1.seconds, s1.tokens_per_second,
              s2.result.seconds, s2.result.tokens_per_second);
  std::printf("  CPU time, tokens/CPU-s     %6.1f s %8.0f    %6.1f s %8.0f\n", s1.cpu_seconds,
              static_cast<double>(s1.tokens) / s1.cpu_seconds, s2.result.cpu_seconds,
              static_cast<double>(s2.result.tokens) / s2.result.cpu_seconds);
  std::printf("  peak predicted / measured  %9s / %-9s  %9s / %-9s\n", memkit::format_bytes(s1.predicted_peak).c_str(),
              memkit::format_bytes(s1.measured_peak).c_str(), memkit::format_bytes(s2.result.predicted_peak).c_str(),
              memkit::format_bytes(s2.result.measured_peak).c_str());
  std::printf("  peak budget / measured     %9s / %-9s  %9s / %-9s  (memory_budget, memkit runtime: %+.2f%%, %+.2f%%)\n",
              memkit::format_bytes(s1.budget.peak).c_str(), memkit::format_bytes(s1.measured_peak).c_str(),
              memkit::format_bytes(s2.result.budget.peak).c_str(), memkit::format_bytes(s2.result.measured_peak).c_str(),
              percent_error(s1.budget.peak, s1.measured_peak), percent_error(s2.result.budget.peak, s2.result.measured_peak));
  std::printf("wrote %s, %s, %s/pretrained.safetensors, %s/adapter/, %s/base-nf4.safetensors\n", csv.c_str(), svg.c_str(),
              o.out_dir.c_str(), o.out_dir.c_str(), o.out_dir.c_str());

  if (!o.check) return 0;
  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    std::printf("check: %s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    failures += ok ? 0 : 1;
  };
  auto within = [](std::uint64_t predicted, std::uint64_t measured, double fraction) {
    return std::abs(double(predicted) - double(measured)) <= fraction * double(measured);
  };
  expect(s1.last_loss < s1.first_loss - 0.3, "stage 1 training loss falls by more than 0.3");
  expect(s1.validation_after < s1.validation_before, "stage 1 validation loss falls");
  expect(s2.result.last_loss < s2.result.first_loss, "stage 2 training loss falls");
  expect(s2.result.validation_after < s2.result.validation_before, "stage 2 validation loss falls");
  // Each category's own peak is predicted from the components' byte functions; their sum bounds the total (the
  // categories peak at different moments: with --mlp-chunk the gap reaches several percent at the default size)
  // and memory_budget predicts the total itself, below.
  const auto categories_within = [&](const stage_result& s) {
    bool ok = true;
    for (int i = 0; i < memkit::memory_category_count; ++i) {
      const auto c = static_cast<memory_category>(i);
      ok = ok && within(s.predicted[c], s.measured[c], 0.02);
    }
    return ok && s.predicted_peak >= s.measured_peak;
  };
  expect(categories_within(s1), "stage 1: every category's peak predicted within 2%, their sum bounds the peak");
  expect(categories_within(s2.result), "stage 2: every category's peak predicted within 2%, their sum bounds the peak");
  expect(within(s1.budget.peak, s1.measured_peak, 0.02), "stage 1 peak: memory_budget's memkit runtime within 2% of the tracker");
  expect(within(s2.result.budget.peak, s2.result.measured_peak, 0.02),
         "stage 2 peak: memory_budget's memkit runtime within 2% of the tracker");
  expect(s2.loss_after_reload == s2.loss_before_save, "the reloaded PEFT adapter and bitsandbytes base give the same loss");
  return failures == 0 ? 0 : 1;
}

int run_main(const options& o);

// Every failure after the command line is one line and exit code 1 (the command line's own errors exit 2).
#if !defined(MEMKIT_EXAMPLE_MPI)
int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    return run_main(o);
  } catch (const memkit::error& e) {
    std::fprintf(stderr, "train_llama: error: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_llama: error: %s\n", e.what());
  }
  return 1;
}
#else
// The MPI build: every rank runs the same command line; rank 0 prints, the others only their one line on
// stderr (and any error). An error on one rank aborts all of them (the others would wait in a collective).
int main(int argc, char** argv) {
  options o = parse(argc, argv);
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  o.ranks = size;
  if (o.zero != 3 && size > 1) {
    if (rank == 0) std::fprintf(stderr, "train_llama: %d MPI ranks without --zero 3: each would train alone\n", size);
    MPI_Finalize();
    return 2;
  }
  if (rank != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) MPI_Abort(MPI_COMM_WORLD, 1);
  int status = 1;
  try {
    status = run_main(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_llama: rank %d: error: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::fflush(stdout);
  MPI_Finalize();
  return status;
}
#endif

int run_main(const options& o) {
#if defined(MEMKIT_EXAMPLE_SMOKE_BUILD)
  std::printf("train_llama: built at -O1 for the test suite's shortened run: its speed figures mean nothing "
              "(./dev.sh example builds it optimized)\n");
#endif
  const std::string no_device = o.device == device_choice::host ? std::string() : why_no_cuda_device();
  if (o.device == device_choice::cuda && !no_device.empty()) {
    std::fprintf(stderr, "train_llama: --device cuda: %s\n", no_device.c_str());
    return 2;
  }
  std::filesystem::create_directories(o.out_dir);
#if MEMKIT_HAS_CUDA
  if (o.device != device_choice::host && no_device.empty()) {
    const memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream(0);
    cudaDeviceProp properties{};
    MEMKIT_CUDA_CHECK(cudaGetDeviceProperties(&properties, exec.device));
    // Stream-ordered device memory for every category (the workspace must be; the rest may as well be).
    memkit::device_async_resource device_memory(exec.stream, exec.device);
    memkit::capped_resource capped(device_memory, static_cast<std::size_t>(o.memory_cap_mib) << 20);
    const int status = run(exec, o, o.memory_cap_mib > 0 ? static_cast<memkit::memory_resource&>(capped) : device_memory,
                           std::string("CUDA device ") + std::to_string(exec.device) + " (" + properties.name + "), " +
                               "legacy default stream; every buffer in device memory");
    memkit::release_cublas_resources();
    return status;
  }
#endif
  const std::string host_line = std::string("host, ") + std::to_string(o.threads) + " threads" +
                                (o.device == device_choice::automatic ? " (--device auto: " + no_device + ")" : "");
  // --memory-cap: the run held to a budget, e.g. a GPU's size on the host (#31); past it, out_of_memory.
  memkit::capped_resource capped(memkit::default_host_resource(), static_cast<std::size_t>(o.memory_cap_mib) << 20);
  return run(memkit::host, o, o.memory_cap_mib > 0 ? static_cast<memkit::memory_resource&>(capped) : memkit::default_host_resource(),
             host_line + (o.memory_cap_mib > 0 ? ", every allocation under a cap of " + std::to_string(o.memory_cap_mib) + " MiB" : ""));
}
