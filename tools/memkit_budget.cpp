// memkit-budget: will this training run fit? Prints the memory of one training step by category,
// the device peak, and optionally the planner's ladder, the largest micro-batch and the longest
// sequence that fit. Reads a Hugging Face config.json or a preset. Bad input: one line, exit 2.
#include <memkit/budget/planner.hpp>
#include <memkit/core/units.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <system_error>
#include <sstream>
#include <string>
#include <vector>

#include "tool_main.hpp"

#include "hf_config.hpp"

namespace {

using namespace memkit::budget;
using memkit::format_bytes;

constexpr const char* usage_text =
    "usage: memkit-budget (--config PATH | --preset NAME) [options]\n"
    "  --method full|lora|qlora        --lora-rank R     --lora-targets q,k,v,o,gate,up,down\n"
    "  --precision fp32|bf16-mixed|bf16|fp16-mixed\n"
    "  --optimizer adamw|adamw-bf16|adamw8bit|adamw4bit|sgd|adafactor|none\n"
    "  --batch B  --seq S  --grad-accum N  --checkpointing none|layer|sqrt|every:K|binomial:SLOTS\n"
    "  --attention eager|flash\n"
    "  --logits fp32|bf16|chunked|fused|cut  --offload none|optimizer|optimizer+params  --gpus N  --zero 0|1|2|3\n"
    "  --no-prefetch   (ZeRO-3: gather each layer's weights when it starts, not during the layer before)\n"
    "  --runtime pytorch|memkit (memkit: memkit's own components, every term from their byte functions)\n"
    "  --optimizer-impl foreach|fused (torch AdamW: foreach allocates a parameter-sized temporary in the step)\n"
    "  --paged          (bitsandbytes paged optimizer: state in CUDA managed memory)\n"
    "  --optimizer-in-backward (torchtune optimizer_in_bwd: each gradient freed as soon as it is stepped)\n"
    "  --logits-chunks N (torchtune's num_output_chunks for --logits chunked, default 8)\n"
    "  --loss-chunk-tokens N (memkit runtime: tokens per chunk of loss::fused_linear_cross_entropy, default 1024)\n"
    "  --mlp-chunk N (memkit runtime, Llama-style blocks: the sequence-tiled MLP, N tokens per chunk)\n"
    "  --memory-cap MIB (memkit runtime: every allocation under a cap: the loss's chunk from the memory left, at\n"
    "                   most --loss-chunk-tokens; checkpoints offloaded when on-device ones would not fit, unless\n"
    "                   --offload-checkpoints; with --max-seq and no --gpu, the longest sequence under the cap)\n"
    "  --gpu NAME  --plan  --max-batch  --max-seq  --json  --svg PATH\n"
    "  --metric allocated|reserved|device  (what fits and --max-* compare with the GPU; default device)\n"
    "  --cuda-context-mib N  --nccl-mib N  --cublas-workspace-mib N  --fragmentation PERCENT\n"
    "                   (the device figure's constants: defaults 512, 1024 (2+ GPUs), 32, 0%)\n"
    "  --kbit-prepared  (PEFT prepare_model_for_kbit_training: fp32 non-quantized weights and activations)\n"
    "  --fused-norms    (norm and softmax kernels that keep no fp32 copies)\n"
    "  --lora-dropout   (lora_dropout > 0: each adapter keeps a dropped copy of its input and a mask)\n"
    "  --fp32-adapters  (PEFT's default autocast_adapter_dtype: fp32 adapters, each keeps an fp32 copy of its input)\n"
    "  --offload-checkpoints (activation checkpoints wait in pinned host memory until backward)\n"
    "  --no-double-quant (QLoRA NF4 with one fp32 absmax per block, as bitsandbytes without double quantization)\n"
    "  --bnb-keeps-input (bitsandbytes < 0.43.2: every 4-bit linear keeps its input for backward)\n"
    "  --lightning-bnb  (Lightning's bitsandbytes plugin, LitGPT's --quantize: the LM head quantized too; weights\n"
    "                   quantized from fp16, so each dequantization makes an fp16 and a bf16 copy)\n"
    "  --measured PATH  (measured runs to compare with: a bench/peers/memory_grid.py grid annotated by\n"
    "                   compare_grid.py --annotate, or tests/data/budget_validation/measurements.json; repeatable;\n"
    "                   default: the source tree's when this build has them; --measured none: no comparison)\n";

struct usage_error : memkit::error {
  using memkit::error::error;
};

enum class method_choice { full, lora, qlora };

// Where --offload puts the optimizer state, and whether the base weights go with it.
struct offload_choice {
  optimizer_placement placement;
  bool parameters;
};

struct options {
  std::string config_path, preset, gpu_name, svg_path;
  method_choice method = method_choice::full;
  bool double_quant = true;
  bool paged = false;
  training_plan plan{};
  bool sequence_given = false;
  bool want_plan = false, want_max_batch = false, want_max_seq = false, want_json = false;
  bool offload_given = false;  // --offload-checkpoints: not chosen by the cap
  bool optimizer_impl_given = false;
  metric fit_metric = metric::device;
  std::vector<std::string> measured_paths;
  bool measured_given = false;
};

std::uint64_t parse_count(const std::string& flag, const std::string& text, bool allow_zero = false) {
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    throw usage_error(flag + " expects an integer, got '" + text + "'");
  }
  if (used != text.size()) throw usage_error(flag + " expects an integer, got '" + text + "'");
  if (value < 0 || (value == 0 && !allow_zero))
    throw usage_error(flag + " must be " + (allow_zero ? "non-negative" : "positive") + ", got " + text);
  return static_cast<std::uint64_t>(value);
}

template <class Value, std::size_t N>
Value parse_choice(const std::string& flag, const std::string& text, const std::pair<const char*, Value> (&choices)[N]) {
  std::string names;
  for (const auto& [name, value] : choices) {
    if (text == name) return value;
    names += names.empty() ? name : std::string("|") + name;
  }
  throw usage_error(flag + " must be one of " + names + ", got '" + text + "'");
}

module_set parse_targets(const std::string& text) {
  static constexpr std::pair<const char*, linear_module> names[] = {
      {"q", linear_module::q},       {"k", linear_module::k},   {"v", linear_module::v},
      {"o", linear_module::o},       {"gate", linear_module::gate}, {"up", linear_module::up},
      {"down", linear_module::down}};
  module_set set = 0;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (item.empty()) continue;
    set = static_cast<module_set>(set | parse_choice<linear_module>("--lora-targets", item, names));
  }
  if (set == 0) throw usage_error("--lora-targets needs at least one of q,k,v,o,gate,up,down");
  return set;
}

options parse_arguments(int argc, char** argv) {
  options o;
  training_plan& p = o.plan;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    } else if (flag == "--config") {
      o.config_path = value();
    } else if (flag == "--preset") {
      o.preset = value();
    } else if (flag == "--method") {
      static constexpr std::pair<const char*, method_choice> choices[] = {
          {"full", method_choice::full}, {"lora", method_choice::lora}, {"qlora", method_choice::qlora}};
      o.method = parse_choice(flag, value(), choices);
    } else if (flag == "--lora-rank") {
      p.lora.rank = parse_count(flag, value());
    } else if (flag == "--lora-targets") {
      p.lora.targets = parse_targets(value());
    } else if (flag == "--bnb-keeps-input") {
      p.quantized_matmul_keeps_input = true;
    } else if (flag == "--lightning-bnb") {
      p.lightning_bnb = true;
    } else if (flag == "--no-double-quant") {
      o.double_quant = false;
    } else if (flag == "--lora-dropout") {
      p.lora.dropout = true;
    } else if (flag == "--fp32-adapters") {
      p.lora.fp32_adapters = true;
    } else if (flag == "--precision") {
      static constexpr std::pair<const char*, precision_mode> choices[] = {
          {"fp32", precision_mode::fp32}, {"bf16-mixed", precision_mode::bf16_mixed},
          {"bf16", precision_mode::bf16}, {"fp16-mixed", precision_mode::fp16_mixed}};
      p.precision = parse_choice(flag, value(), choices);
    } else if (flag == "--optimizer") {
      static constexpr std::pair<const char*, optimizer_kind> choices[] = {
          {"adamw", optimizer_kind::adamw},       {"adamw-bf16", optimizer_kind::adamw_bf16},
          {"adamw8bit", optimizer_kind::adamw_8bit}, {"adamw4bit", optimizer_kind::adamw_4bit},
          {"sgd", optimizer_kind::sgd_momentum},  {"adafactor", optimizer_kind::adafactor},
          {"none", optimizer_kind::none}};
      p.optimizer = parse_choice(flag, value(), choices);
    } else if (flag == "--batch") {
      p.micro_batch = parse_count(flag, value());
    } else if (flag == "--seq") {
      p.sequence = parse_count(flag, value());
      o.sequence_given = true;
    } else if (flag == "--grad-accum") {
      p.grad_accum = parse_count(flag, value());
    } else if (flag == "--checkpointing") {
      // The none|layer, plus sqrt, every:K and binomial:SLOTS.
      const std::string what = value();
      if (what.rfind("every:", 0) == 0) {
        p.checkpoint = checkpointing::every_k_layers;
        p.checkpoint_every = parse_count(flag, what.substr(6));
      } else if (what.rfind("binomial:", 0) == 0) {
        p.checkpoint = checkpointing::binomial;
        p.checkpoint_slots = parse_count(flag, what.substr(9));
      } else {
        static constexpr std::pair<const char*, checkpointing> choices[] = {
            {"none", checkpointing::none}, {"layer", checkpointing::every_layer}, {"sqrt", checkpointing::sqrt}};
        p.checkpoint = parse_choice(flag, what, choices);
      }
    } else if (flag == "--attention") {
      static constexpr std::pair<const char*, attention_impl> choices[] = {
          {"eager", attention_impl::eager}, {"flash", attention_impl::memory_efficient}};
      p.attention = parse_choice(flag, value(), choices);
    } else if (flag == "--logits") {
      static constexpr std::pair<const char*, logits_mode> choices[] = {
          {"fp32", logits_mode::fp32}, {"bf16", logits_mode::half}, {"chunked", logits_mode::chunked},
          {"fused", logits_mode::fused}, {"cut", logits_mode::cut}};
      p.logits = parse_choice(flag, value(), choices);
    } else if (flag == "--runtime") {
      static constexpr std::pair<const char*, runtime_kind> choices[] = {{"pytorch", runtime_kind::pytorch},
                                                                         {"memkit", runtime_kind::memkit}};
      p.runtime = parse_choice(flag, value(), choices);
    } else if (flag == "--optimizer-impl") {
      static constexpr std::pair<const char*, bool> choices[] = {{"foreach", false}, {"fused", true}};
      p.fused_optimizer = parse_choice(flag, value(), choices);
      o.optimizer_impl_given = true;
    } else if (flag == "--paged") {
      o.paged = true;
    } else if (flag == "--optimizer-in-backward") {
      p.optimizer_in_backward = true;
    } else if (flag == "--logits-chunks") {
      p.logits_output_chunks = parse_count(flag, value());
    } else if (flag == "--loss-chunk-tokens") {
      p.logits_chunk_tokens = parse_count(flag, value());
    } else if (flag == "--mlp-chunk") {
      p.mlp_token_chunk = parse_count(flag, value());
    } else if (flag == "--offload") {
      static constexpr std::pair<const char*, offload_choice> choices[] = {
          {"none", {optimizer_placement::device, false}},
          {"optimizer", {optimizer_placement::host, false}},
          {"optimizer+params", {optimizer_placement::host, true}}};
      const offload_choice offload = parse_choice(flag, value(), choices);
      p.placement = offload.placement;
      p.offload_parameters = offload.parameters;
    } else if (flag == "--gpus") {
      p.gpus = parse_count(flag, value());
      if (p.gpus > memkit::budget::max_gpus)
        throw usage_error("--gpus is at most " + std::to_string(memkit::budget::max_gpus) + ", got " + std::to_string(p.gpus));
    } else if (flag == "--zero") {
      const std::uint64_t stage = parse_count(flag, value(), true);
      if (stage > 3) throw usage_error("--zero must be 0, 1, 2 or 3, got " + std::to_string(stage));
      p.zero_stage = static_cast<int>(stage);
    } else if (flag == "--no-prefetch") {
      p.gather_prefetch = false;
    } else if (flag == "--gpu") {
      o.gpu_name = value();
    } else if (flag == "--plan") {
      o.want_plan = true;
    } else if (flag == "--max-batch") {
      o.want_max_batch = true;
    } else if (flag == "--max-seq") {
      o.want_max_seq = true;
    } else if (flag == "--offload-checkpoints") {
      p.offload_checkpoints = true;
      o.offload_given = true;
    } else if (flag == "--memory-cap") {
      const std::uint64_t mib = parse_count(flag, value());
      if (mib > (std::uint64_t{1} << 24)) throw usage_error("--memory-cap is at most 16777216 MiB (16 TiB), got " + std::to_string(mib));
      p.memory_cap = mib * memkit::MiB;
    } else if (flag == "--kbit-prepared") {
      p.kbit_prepared = true;
    } else if (flag == "--cuda-context-mib" || flag == "--nccl-mib" || flag == "--cublas-workspace-mib") {
      const std::uint64_t mib = parse_count(flag, value(), true);
      if (mib > (std::uint64_t{1} << 20)) throw usage_error(flag + " is at most 1048576 (1 TiB), got " + std::to_string(mib));
      std::uint64_t& bytes = flag == "--cuda-context-mib" ? p.overhead.cuda_context_bytes
                             : flag == "--nccl-mib"       ? p.overhead.nccl_bytes
                                                          : p.overhead.workspace_bytes;
      bytes = mib * memkit::MiB;
    } else if (flag == "--fragmentation") {
      const std::uint64_t percent = parse_count(flag, value(), true);
      if (percent > 100) throw usage_error("--fragmentation is a percentage of allocated: 0..100, got " + std::to_string(percent));
      p.overhead.fragmentation_percent = percent;
    } else if (flag == "--fused-norms") {
      p.fp32_norm_and_softmax = false;
    } else if (flag == "--metric") {
      static constexpr std::pair<const char*, metric> choices[] = {
          {"allocated", metric::allocated}, {"reserved", metric::reserved}, {"device", metric::device}};
      o.fit_metric = parse_choice(flag, value(), choices);
    } else if (flag == "--json") {
      o.want_json = true;
    } else if (flag == "--svg") {
      o.svg_path = value();
    } else if (flag == "--measured") {
      const std::string path = value();
      o.measured_given = true;
      if (path == "none") o.measured_paths.clear();
      else o.measured_paths.push_back(path);
    } else {
      throw usage_error("unknown option '" + flag + "' (see --help)");
    }
  }
  if (o.config_path.empty() == o.preset.empty()) throw usage_error("give exactly one of --config PATH or --preset NAME");
  if (o.optimizer_impl_given && p.memkit_runtime())
    throw usage_error("--optimizer-impl chooses between torch AdamW's foreach and fused steps; the memkit runtime's "
                      "adam_state has one step: drop it or use --runtime pytorch");
  if (o.method != method_choice::full) {
    p.training = method::lora;
    if (o.method == method_choice::qlora) p.weights = weight_storage{weight_format::nf4, 64, o.double_quant};
  }
  if (o.paged) {
    if (p.placement == optimizer_placement::host) throw usage_error("--paged and --offload optimizer are exclusive");
    p.placement = optimizer_placement::paged;
  }
  if ((o.want_plan || o.want_max_batch || (o.want_max_seq && p.memory_cap == 0)) && o.gpu_name.empty())
    throw usage_error("--plan, --max-batch and --max-seq need --gpu NAME (--max-seq: or --memory-cap MIB)");
  return o;
}

// A config.json is a few kilobytes; the largest on the Hugging Face hub (long id2label tables) are well under
// a megabyte. Reading stops at this cap, so /dev/zero or a huge file fails at once instead of filling memory.
constexpr std::size_t max_config_bytes = std::size_t{16} << 20;

std::string read_file(const std::string& path) {
  std::error_code ignored;
  // A directory opens as a stream on Linux but reads nothing: say so instead of "invalid JSON".
  if (std::filesystem::is_directory(path, ignored)) throw memkit::error("cannot read '" + path + "': it is a directory");
  std::ifstream file(path, std::ios::binary);
  if (!file) throw memkit::error("cannot read '" + path + "'");
  std::string text;
  char chunk[1 << 16];
  while (file) {
    file.read(chunk, sizeof chunk);
    text.append(chunk, static_cast<std::size_t>(file.gcount()));
    if (text.size() > max_config_bytes)
      throw memkit::error("'" + path + "' is larger than 16 MiB, too large for a config.json");
  }
  if (file.bad()) throw memkit::error("cannot read '" + path + "'");
  return text;
}

// "a, b, c": the names of the presets in `items`, for "unknown ..." errors.
template <class Presets>
std::string preset_names(const Presets& items) {
  std::string names;
  for (const auto& item : items) names += (names.empty() ? "" : ", ") + std::string(item.name);
  return names;
}

// A speed factor with two decimals, for the JSON.
std::string fixed(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", value);
  return text;
}

std::string breakdown_json(const breakdown& b) {
  std::string out = "{";
  for (int c = 0; c < category_count; ++c) {
    out += (c ? ", \"" : "\"") + std::string(to_string(static_cast<category>(c))) + "\": " + std::to_string(b.bytes[c]);
  }
  return out + "}";
}

// {"allocated": A, "reserved": R, "device": D}
std::string figures_json(const memory_figures& f) {
  return "{\"allocated\": " + std::to_string(f.allocated) + ", \"reserved\": " + std::to_string(f.reserved) +
         ", \"device\": " + std::to_string(f.device) + "}";
}

std::string describe(const training_plan& p) {
  std::string text = p.memkit_runtime() ? "memkit runtime: " : "";
  text += p.lora_training() ? "LoRA r=" + std::to_string(p.lora.rank) + " on " +
                                             std::string(to_string(p.weights.format)) + " base"
                                       : std::string("full");
  if (p.lora_training() && p.lora.fp32_adapters) text += " (fp32 adapters)";
  text += ", " + std::string(to_string(p.precision)) + ", " + std::string(to_string(p.optimizer));
  if (!p.memkit_runtime() && (p.optimizer == optimizer_kind::adamw || p.optimizer == optimizer_kind::adamw_bf16))
    text += p.fused_optimizer ? " (fused)" : " (foreach)";
  if (p.placement == optimizer_placement::paged) text += " (paged)";
  if (p.optimizer_in_backward) text += " (step in backward)";
  if (p.placement == optimizer_placement::host) text += p.offload_parameters ? " (offload optimizer+params)" : " (offload optimizer)";
  text += ", micro-batch " + std::to_string(p.micro_batch) + " x " + std::to_string(p.sequence) + ", grad-accum " +
          std::to_string(p.grad_accum);
  text += p.checkpoint == checkpointing::none ? ", no checkpointing" : ", checkpointing";
  if (p.checkpoint != checkpointing::none && p.offload_checkpoints) text += " (checkpoints offloaded)";
  text += p.attention == attention_impl::eager ? ", eager attention" : ", flash attention";
  text += ", " + std::string(to_string(p.logits)) + " logits";
  if (p.gpus > 1) text += ", " + std::to_string(p.gpus) + " GPUs ZeRO-" + std::to_string(p.zero_stage);
  if (p.gpus > 1 && p.zero_stage == 3 && !p.gather_prefetch) text += " (no prefetch)";
  return text;
}

// --- SVG: stacked horizontal bars, one per estimate, with the GPU's memory as a vertical line. ---
constexpr const char* category_colors[category_count] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2",
                                                         "#59a14f", "#edc948", "#b07aa1", "#9c755f"};

struct svg_bar {
  std::string label;
  breakdown bytes;
  memory_figures figures;  // the bar is the device figure; allocated and reserved are marked on it
};

// Text for an SVG text node: the five XML special characters as entities (names and paths come from the
// command line and from config files).
std::string xml_escaped(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

void write_svg(const std::string& path, const std::string& title, const std::vector<svg_bar>& bars,
               std::uint64_t available_bytes) {
  std::uint64_t scale = available_bytes;
  for (const auto& bar : bars) scale = bar.bytes.total() > scale ? bar.bytes.total() : scale;
  if (scale == 0) scale = 1;
  const double left = 220, width = 640, bar_height = 28, gap = 26, top = 50;
  const double height = top + static_cast<double>(bars.size()) * (bar_height + gap) + 85;
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << left + width + 130 << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  svg << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg << "<text x=\"10\" y=\"24\" font-size=\"15\">" << xml_escaped(title) << "</text>\n";
  double y = top;
  for (const auto& [label, b, figures] : bars) {
    svg << "<text x=\"10\" y=\"" << y + bar_height * 0.65 << "\">" << xml_escaped(label) << "</text>\n";
    double x = left;
    for (int c = 0; c < category_count; ++c) {
      if (b.bytes[c] == 0) continue;
      const double w = width * static_cast<double>(b.bytes[c]) / static_cast<double>(scale);
      svg << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << bar_height << "\" fill=\""
          << category_colors[c] << "\"><title>" << to_string(static_cast<category>(c)) << ": "
          << format_bytes(b.bytes[c]) << "</title></rect>\n";
      x += w;
    }
    svg << "<text x=\"" << x + 4 << "\" y=\"" << y + bar_height * 0.65 << "\">" << format_bytes(b.total()) << "</text>\n";
    // Allocated and reserved as ticks on the bar (its end is the device figure), named underneath.
    for (const std::uint64_t mark : {figures.allocated, figures.reserved}) {
      const double mx = left + width * static_cast<double>(mark) / static_cast<double>(scale);
      svg << "<line x1=\"" << mx << "\" y1=\"" << y - 3 << "\" x2=\"" << mx << "\" y2=\"" << y + bar_height + 3
          << "\" stroke=\"black\" stroke-width=\"1.5\"/>\n";
    }
    svg << "<text x=\"" << left << "\" y=\"" << y + bar_height + 14 << "\" font-size=\"10\">allocated "
        << format_bytes(figures.allocated) << " | reserved " << format_bytes(figures.reserved) << " | device "
        << format_bytes(figures.device) << "</text>\n";
    y += bar_height + gap;
  }
  if (available_bytes != 0) {
    const double x = left + width * static_cast<double>(available_bytes) / static_cast<double>(scale);
    svg << "<line x1=\"" << x << "\" y1=\"" << top - 8 << "\" x2=\"" << x << "\" y2=\"" << y << "\" stroke=\"black\" "
        << "stroke-width=\"2\" stroke-dasharray=\"6,3\"/>\n";
    svg << "<text x=\"" << x + 4 << "\" y=\"" << top - 12 << "\">GPU " << format_bytes(available_bytes) << "</text>\n";
  }
  double legend_x = 10;
  for (int c = 0; c < category_count; ++c) {
    svg << "<rect x=\"" << legend_x << "\" y=\"" << y + 10 << "\" width=\"12\" height=\"12\" fill=\"" << category_colors[c]
        << "\"/><text x=\"" << legend_x + 16 << "\" y=\"" << y + 20 << "\">" << to_string(static_cast<category>(c))
        << "</text>\n";
    legend_x += 110;
  }
  svg << "<text x=\"10\" y=\"" << y + 42 << "\" font-size=\"10\">each bar is the device figure (nvidia-smi); "
      << "the ticks on it mark allocated (live tensors) and reserved (the caching allocator's segments)</text>\n";
  svg << "</svg>\n";
  std::ofstream file(path);
  if (!file) throw memkit::error("cannot write '" + path + "'");
  file << svg.str();
  if (!file) throw memkit::error("cannot write '" + path + "'");
}

void print_table(const memory_estimate& e) {
  std::printf("%-16s %14s %14s %14s %14s\n", "category", "forward", "backward", "optimizer", "host");
  for (int c = 0; c < category_count; ++c) {
    const auto cat = static_cast<category>(c);
    std::printf("%-16s %14s %14s %14s %14s\n", std::string(to_string(cat)).c_str(), format_bytes(e.phases[0][cat]).c_str(),
                format_bytes(e.phases[1][cat]).c_str(), format_bytes(e.phases[2][cat]).c_str(),
                format_bytes(e.host[cat]).c_str());
  }
  std::printf("%-16s %14s %14s %14s %14s\n", "total", format_bytes(e.phases[0].total()).c_str(),
              format_bytes(e.phases[1].total()).c_str(), format_bytes(e.phases[2].total()).c_str(),
              format_bytes(e.host.total()).c_str());
  // The three figures (docs/memory_budget.md, "Which memory"); total above is the device figure.
  for (int m = 0; m < metric_count; ++m) {
    const auto which = static_cast<metric>(m);
    std::printf("%-16s %14s %14s %14s\n", std::string(to_string(which)).c_str(), format_bytes(e.figures[0][which]).c_str(),
                format_bytes(e.figures[1][which]).c_str(), format_bytes(e.figures[2][which]).c_str());
  }
  std::printf("peak device: %s (%llu bytes, %s phase; largest: %s)   host: %s\n", format_bytes(e.peak_device_bytes).c_str(),
              static_cast<unsigned long long>(e.peak_device_bytes), std::string(to_string(e.peak_phase)).c_str(),
              std::string(to_string(e.device.largest())).c_str(), format_bytes(e.host_bytes).c_str());
  std::printf("peak allocated: %s   reserved: %s   device: %s\n", format_bytes(e.peak.allocated).c_str(),
              format_bytes(e.peak.reserved).c_str(), format_bytes(e.peak.device).c_str());
  if (e.managed_bytes != 0)
    std::printf("of which in CUDA managed memory (paged optimizer state; not in torch's allocator counters): %s\n",
                format_bytes(e.managed_bytes).c_str());
}

// The model the options name (a preset, or a config.json read into `name`, which the model's name refers to).
model_config load_model(options& o, std::string& name) {
  model_config model;
  if (!o.preset.empty()) {
    const model_config* preset = find_model_preset(o.preset);
    if (preset == nullptr)
      throw usage_error("unknown preset '" + o.preset + "' (known: " + preset_names(presets::all_models) + ")");
    model = *preset;
  } else {
    name = o.config_path;
    model = memkit_tools::model_from_hf_config(memkit::json::parse(read_file(o.config_path), "config.json"), name);
  }
  if (!o.sequence_given && model.is_gpt2() && model.max_positions < o.plan.sequence) o.plan.sequence = model.max_positions;
  return model;
}

// --- The measured run nearest to the question (#33) ---
// A row of a measured grid (bench/peers/memory_grid.py, annotated with memkit_flags by compare_grid.py
// --annotate) or of the published set (tests/data/budget_validation/measurements.json): the memkit-budget
// arguments that describe the run and what was measured.
struct measured_run {
  std::string id, file, device;
  std::vector<std::string> args;
  double measured[3] = {0, 0, 0};  // bytes by metric (allocated, reserved, device); 0: not measured
};

// A relative path in a data file names a file of the source tree: the first ancestor of the data file's folder
// under which it exists.
std::string resolve_relative(const std::string& data_file, const std::string& path) {
  namespace fs = std::filesystem;
  if (fs::path(path).is_absolute()) return path;
  std::error_code ignored;
  for (fs::path dir = fs::absolute(data_file, ignored).parent_path(); !dir.empty(); dir = dir.parent_path()) {
    if (fs::exists(dir / path, ignored)) return (dir / path).string();
    if (dir == dir.root_path()) break;
  }
  return path;
}

std::vector<measured_run> read_measured(const std::string& path) {
  const memkit::json::value data = memkit::json::parse(read_file(path), path);
  std::vector<measured_run> runs;
  const bool grid = data.find("script") != nullptr;  // memory_grid.py's output names its script
  const std::string device = grid ? data.at("device").as_string() : "";
  for (const memkit::json::value& row : data.at("rows").as_array()) {
    const memkit::json::value* flags = row.find("memkit_flags");
    if (flags == nullptr) continue;  // a grid row not annotated (or out of memory): nothing to compare
    measured_run r;
    r.id = row.at("id").as_string();
    r.file = path;
    if (grid) {
      r.device = device;
      r.args = {"--config", resolve_relative(path, row.at("config").as_string())};
      const char* names[3] = {"allocated", "reserved", "device"};
      for (int m = 0; m < 3; ++m)
        if (const memkit::json::value* v = row.find(names[m])) r.measured[m] = v->as_double();
    } else {
      r.device = row.at("gpu").as_string();
      const memkit::json::value& model = row.at("memkit_model");
      if (const memkit::json::value* config = model.find("config"))
        r.args = {"--config", resolve_relative(path, config->as_string())};
      else
        r.args = {"--preset", model.at("preset").as_string()};
      const std::string unit = row.at("unit").as_string();
      const double scale = unit == "GB" ? 1e9 : unit == "GiB" ? 1073741824.0 : unit == "MiB" ? 1048576.0 : 0;
      const std::string metric_name = row.at("metric").as_string();
      const int m = metric_name == "allocated" ? 0 : metric_name == "reserved" ? 1 : metric_name == "device" ? 2 : -1;
      if (scale == 0 || m < 0) throw memkit::error(path + ": " + r.id + ": unknown unit or metric");
      r.measured[m] = row.at("measured").as_double() * scale;
    }
    for (const memkit::json::value& f : flags->as_array()) r.args.push_back(f.as_string());
    runs.push_back(std::move(r));
  }
  return runs;
}

std::string method_class(const training_plan& p) {
  return !p.lora_training() ? "full" : p.weights.quantized() ? "qlora" : "lora";
}

struct nearest_result {
  measured_run run;
  int metric_index = 0;
  double predicted = 0, distance = 0;
};

// "Nearest": among the runs of the same method (full, LoRA, QLoRA) and runtime, the smallest
// |ln(parameters / asked parameters)| + |ln(tokens per step / asked tokens per step)| + 1 if checkpointing differs
// (tokens per step: micro-batch x sequence); the first in file order on a tie. Its error is memkit-budget's
// estimate of that run against the figure measured: the metric asked for (--metric) when the run measured it,
// else the one it measured.
std::optional<nearest_result> nearest_measured(const std::vector<std::string>& files, const memory_estimate& asked,
                                               const training_plan& plan, metric wanted) {
  std::optional<nearest_result> best;
  for (const std::string& file : files) {
    for (measured_run& run : read_measured(file)) {
      std::vector<std::string> argv_text = {"memkit-budget"};
      argv_text.insert(argv_text.end(), run.args.begin(), run.args.end());
      std::vector<char*> argv;
      for (std::string& a : argv_text) argv.push_back(a.data());
      options ro;
      model_config m;
      try {
        ro = parse_arguments(static_cast<int>(argv.size()), argv.data());
        std::string name;
        m = load_model(ro, name);
      } catch (const memkit::error& failure) {
        throw memkit::error("measured run " + run.id + " in " + file + ": " + failure.what());
      }
      const training_plan& rp = ro.plan;
      if (method_class(rp) != method_class(plan) || rp.runtime != plan.runtime) continue;
      const memory_estimate e = estimate_memory(m, rp);
      if (!e.valid()) continue;
      const double distance =
          std::abs(std::log(static_cast<double>(e.parameters) / static_cast<double>(asked.parameters))) +
          std::abs(std::log(static_cast<double>(rp.tokens()) / static_cast<double>(plan.tokens()))) +
          ((rp.checkpoint == checkpointing::none) != (plan.checkpoint == checkpointing::none) ? 1.0 : 0.0);
      if (best && distance >= best->distance) continue;
      nearest_result r;
      r.metric_index = static_cast<int>(wanted);
      if (run.measured[r.metric_index] == 0)
        for (int i = 0; i < 3; ++i)
          if (run.measured[i] != 0) r.metric_index = i;
      r.predicted = static_cast<double>(e.peak_bytes(static_cast<metric>(r.metric_index)));
      r.distance = distance;
      r.run = std::move(run);
      best = std::move(r);
    }
  }
  return best;
}

// The data files compared by default: the source tree's, when this build was configured with them and they exist.
std::vector<std::string> default_measured_files() {
  std::vector<std::string> files;
#ifdef MEMKIT_BUDGET_MEASURED_FILES
  std::string list = MEMKIT_BUDGET_MEASURED_FILES;
  std::error_code ignored;
  for (std::size_t start = 0; start <= list.size();) {
    const std::size_t end = std::min(list.find('|', start), list.size());
    const std::string file = list.substr(start, end - start);
    if (!file.empty() && std::filesystem::is_regular_file(file, ignored)) files.push_back(file);
    start = end + 1;
  }
#endif
  return files;
}

int run(int argc, char** argv) {
  options o = parse_arguments(argc, argv);
  std::string model_name;
  const model_config model = load_model(o, model_name);
  training_plan& plan = o.plan;

  std::optional<gpu_spec> gpu;
  if (!o.gpu_name.empty()) {
    const gpu_spec* found = find_gpu_preset(o.gpu_name);
    if (found == nullptr) throw usage_error("unknown GPU '" + o.gpu_name + "' (known: " + preset_names(presets::all_gpus) + ")");
    gpu = *found;
  }

  // Under a cap the checkpoints go where train_llama --offload-checkpoints auto puts them (docs/long_context.md).
  const auto placed = [&](training_plan p) {
    return p.memory_cap != 0 && !o.offload_given ? with_checkpoints_placed_for_cap(model, p) : p;
  };
  plan = placed(plan);
  const memory_estimate e = estimate_memory(model, plan);
  if (!e.valid()) throw usage_error(std::string(e.problem));
  const metric which = o.fit_metric;
  const std::uint64_t needed = e.peak_bytes(which);
  const bool fits = gpu && needed <= gpu->memory_bytes;
  std::uint64_t max_batch = 0, max_seq = 0;
  if (o.want_max_batch) max_batch = max_micro_batch(model, plan, *gpu, 1u << 20, which);
  if (o.want_max_seq && gpu) max_seq = max_sequence(model, plan, *gpu, which);
  if (o.want_max_seq && !gpu) {  // under --memory-cap: the allocated peak against the cap, placement per length
    const std::uint64_t limit = model.max_positions != 0 ? model.max_positions : (1u << 22);
    const auto fits_cap = [&](std::uint64_t sequence) {
      training_plan p = plan;
      p.sequence = sequence;
      p.offload_checkpoints = o.offload_given;
      const memory_estimate f = estimate_memory(model, placed(p));
      return f.valid() && f.peak_bytes(metric::allocated) <= p.memory_cap;
    };
    std::uint64_t good = 0, bad = limit + 1;
    if (fits_cap(limit)) good = limit;
    while (bad - good > 1) {
      const std::uint64_t mid = good + (bad - good) / 2;
      (fits_cap(mid) ? good : bad) = mid;
    }
    max_seq = good;
  }
  std::optional<ladder> steps;
  if (o.want_plan) steps = plan_ladder(model, *gpu, plan);
  const std::optional<nearest_result> nearest =
      nearest_measured(o.measured_given ? o.measured_paths : default_measured_files(), e, plan, which);
  const char* metric_names[3] = {"allocated", "reserved", "device"};

  // The SVG first: a path that cannot be written is an error before anything is printed.
  if (!o.svg_path.empty()) {
    std::vector<svg_bar> bars;
    std::string title = "memkit-budget: " + std::string(model.name);
    if (steps) {
      for (const ladder_rung& r : steps->rungs)
        bars.push_back({std::string(to_string(r.kind)) + (r.effective ? "" : " (no effect)"), r.estimate.device,
                        r.estimate.figures[static_cast<int>(r.estimate.peak_phase)]});
      title += " on " + std::string(gpu->name);
    } else {
      bars.push_back({"peak (" + std::string(to_string(e.peak_phase)) + ")", e.device,
                      e.figures[static_cast<int>(e.peak_phase)]});
      for (int i = 0; i < step_phase_count; ++i)
        bars.push_back({std::string(to_string(static_cast<step_phase>(i))), e.phases[i], e.figures[i]});
    }
    write_svg(o.svg_path, title, bars, gpu ? gpu->memory_bytes : 0);
  }

  if (o.want_json) {
    std::string out = "{\"model\": " + memkit::json::quote(model.name);
    out += ", \"parameters\": " + std::to_string(e.parameters);
    out += ", \"trainable_parameters\": " + std::to_string(e.trainable_parameters);
    out += ", \"peak_device_bytes\": " + std::to_string(e.peak_device_bytes);
    out += ", \"peak\": " + figures_json(e.peak);
    out += ", \"metric\": \"" + std::string(to_string(which)) + "\"";
    out += ", \"peak_phase\": \"" + std::string(to_string(e.peak_phase)) + "\"";
    out += ", \"host_bytes\": " + std::to_string(e.host_bytes);
    out += ", \"runtime\": \"" + std::string(to_string(plan.runtime)) + "\"";
    out += ", \"managed_bytes\": " + std::to_string(e.managed_bytes);
    out += ", \"breakdown\": " + breakdown_json(e.device);
    out += ", \"host_breakdown\": " + breakdown_json(e.host);
    out += ", \"phases\": {";
    for (int i = 0; i < step_phase_count; ++i)
      out += (i ? ", \"" : "\"") + std::string(to_string(static_cast<step_phase>(i))) + "\": " + breakdown_json(e.phases[i]);
    out += "}, \"figures\": {";
    for (int i = 0; i < step_phase_count; ++i)
      out += (i ? ", \"" : "\"") + std::string(to_string(static_cast<step_phase>(i))) + "\": " + figures_json(e.figures[i]);
    out += "}";
    if (gpu) {
      out += ", \"gpu\": \"" + std::string(gpu->name) + "\", \"available_bytes\": " + std::to_string(gpu->memory_bytes);
      out += std::string(", \"fits\": ") + (fits ? "true" : "false");
    }
    if (o.want_max_batch) out += ", \"max_micro_batch\": " + std::to_string(max_batch);
    if (o.want_max_seq) out += ", \"max_sequence\": " + std::to_string(max_seq);
    if (nearest) {
      const double measured = nearest->run.measured[nearest->metric_index];
      out += ", \"nearest_measured\": {\"id\": " + memkit::json::quote(nearest->run.id);
      out += ", \"file\": " + memkit::json::quote(nearest->run.file);
      out += ", \"device\": " + memkit::json::quote(nearest->run.device);
      out += ", \"metric\": \"" + std::string(metric_names[nearest->metric_index]) + "\"";
      out += ", \"measured_bytes\": " + std::to_string(static_cast<std::uint64_t>(measured));
      out += ", \"predicted_bytes\": " + std::to_string(static_cast<std::uint64_t>(nearest->predicted));
      char error[32];
      std::snprintf(error, sizeof error, "%.4f", nearest->predicted / measured - 1.0);
      out += ", \"error\": " + std::string(error);
      out += ", \"distance\": " + fixed(nearest->distance) + "}";
    }
    if (steps) {
      out += ", \"plan\": {\"first_fit\": ";
      out += steps->first_fit < 0 ? "null" : "\"" + std::string(to_string(steps->rungs[steps->first_fit].kind)) + "\"";
      out += ", \"rungs\": [";
      for (int i = 0; i < rung_count; ++i) {
        const ladder_rung& r = steps->rungs[i];
        out += (i ? ", " : "") + std::string("{\"name\": \"") + std::string(to_string(r.kind)) + "\"";
        out += std::string(", \"fits\": ") + (r.fits ? "true" : "false");
        out += std::string(", \"effective\": ") + (r.effective ? "true" : "false");
        if (!r.effective) out += ", \"reason\": " + memkit::json::quote(r.reason);
        out += ", \"speed_factor\": " + fixed(r.speed_factor) + ", \"total_speed_factor\": " + fixed(r.total_speed_factor);
        out += ", \"host_traffic_bytes\": " + std::to_string(r.host_traffic_bytes);
        out += ", \"micro_batch\": " + std::to_string(r.plan.micro_batch) + ", \"grad_accum\": " + std::to_string(r.plan.grad_accum);
        out += ", \"peak_device_bytes\": " + std::to_string(r.estimate.peak_device_bytes);
        out += ", \"peak\": " + figures_json(r.estimate.peak);
        out += ", \"host_bytes\": " + std::to_string(r.estimate.host_bytes);
        out += ", \"breakdown\": " + breakdown_json(r.estimate.device) + "}";
      }
      out += "]}";
    }
    std::printf("%s}\n", out.c_str());
  } else {
    std::printf("model: %s (%llu parameters, %llu trainable)\n", std::string(model.name).c_str(),
                static_cast<unsigned long long>(e.parameters), static_cast<unsigned long long>(e.trainable_parameters));
    std::printf("plan:  %s\n\n", describe(plan).c_str());
    print_table(e);
    if (gpu) {
      std::printf("gpu %s: %s available: %s (%s %s)\n", std::string(gpu->name).c_str(), format_bytes(gpu->memory_bytes).c_str(),
                  fits ? "fits" : ("does not fit, short by " + format_bytes(needed - gpu->memory_bytes)).c_str(),
                  std::string(to_string(which)).c_str(), format_bytes(needed).c_str());
    }
    if (o.want_max_batch) std::printf("largest micro-batch that fits: %llu\n", static_cast<unsigned long long>(max_batch));
    if (plan.memory_cap != 0)
      std::printf("under a cap of %s: the loss's chunk %llu tokens (what is left when it starts: %s), checkpoints %s\n",
                  format_bytes(plan.memory_cap).c_str(), static_cast<unsigned long long>(e.loss_chunk_tokens),
                  format_bytes(plan.memory_cap > e.loss_held_bytes ? plan.memory_cap - e.loss_held_bytes : 0).c_str(),
                  plan.offload_checkpoints ? "offloaded" : "on the device");
    if (o.want_max_seq) std::printf("longest sequence that fits%s: %llu\n", gpu ? "" : " under the cap",
                                    static_cast<unsigned long long>(max_seq));
    if (nearest) {
      const double measured = nearest->run.measured[nearest->metric_index];
      std::printf("nearest measured run: %s (%s, %s; distance %.2f): %s measured %s, memkit-budget %s (%+.1f%%)\n",
                  nearest->run.id.c_str(), std::filesystem::path(nearest->run.file).filename().string().c_str(),
                  nearest->run.device.c_str(), nearest->distance, metric_names[nearest->metric_index],
                  format_bytes(static_cast<std::uint64_t>(measured)).c_str(),
                  format_bytes(static_cast<std::uint64_t>(nearest->predicted)).c_str(),
                  100.0 * (nearest->predicted / measured - 1.0));
    }
    if (steps) {
      std::printf("\nladder on %s:\n", std::string(gpu->name).c_str());
      for (int i = 0; i < rung_count; ++i) {
        const ladder_rung& r = steps->rungs[i];
        if (!r.effective) {
          std::printf("  %d %-30s no effect: %s\n", i + 1, std::string(to_string(r.kind)).c_str(),
                      std::string(r.reason).c_str());
          continue;
        }
        std::printf("  %d %-30s %12s  %-5s x%.2f (total x%.2f)  %s\n", i + 1, std::string(to_string(r.kind)).c_str(),
                    format_bytes(r.estimate.peak_device_bytes).c_str(), r.fits ? "fits" : "no", r.speed_factor,
                    r.total_speed_factor, describe(r.plan).c_str());
        if (r.host_traffic_bytes != 0)
          std::printf("    host <-> device traffic per step: %s\n", format_bytes(r.host_traffic_bytes).c_str());
      }
      if (steps->first_fit >= 0)
        std::printf("first rung that fits: %s\n", std::string(to_string(steps->rungs[steps->first_fit].kind)).c_str());
      else
        std::printf("no rung fits\n");
    }
  }

  return 0;
}

}  // namespace

int main(int argc, char** argv) { return memkit_tools::main_reporting_errors("memkit-budget", run, argc, argv); }
