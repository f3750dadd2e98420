// memkit-consolidate: one checkpoint a peer reads (safetensors; NF4/FP4 weights in bitsandbytes' 4-bit layout)
// from the per-rank shard files of a sharded model, streamed through one copy buffer
// (distributed::export_consolidated, docs/sharding.md). Bad input: one line, exit 2.
#include <memkit/distributed/consolidate.hpp>
#include <memkit/core/units.hpp>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "tool_main.hpp"

namespace {

constexpr const char* usage_text =
    "usage: memkit-consolidate --out PATH [--dtype bfloat16|float16|float32] [--chunk-mib N] RANK_FILE...\n"
    "  RANK_FILE   every rank's shard file of one save (any order)\n"
    "  --dtype     the 4-bit weights' quant_state dtype (the dtype they were quantized from; default bfloat16)\n"
    "  --chunk-mib the copy buffer, the export's only sizeable allocation (default 4)\n";

int run(int argc, char** argv) {
  std::string out;
  std::vector<std::string> files;
  memkit::distributed::consolidate_options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> std::string {
      memkit::require(i + 1 < argc, arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      std::fputs(usage_text, stdout);
      return 0;
    } else if (arg == "--out") {
      out = value();
    } else if (arg == "--dtype") {
      options.original_dtype = value();
      memkit::require(options.original_dtype == "bfloat16" || options.original_dtype == "float16" ||
                          options.original_dtype == "float32",
                      "--dtype must be bfloat16, float16 or float32, got '" + options.original_dtype + "'");
    } else if (arg == "--chunk-mib") {
      const std::string text = value();
      std::size_t end = 0;
      unsigned long long mib = 0;
      try {
        mib = std::stoull(text, &end);
      } catch (const std::exception&) {
        end = 0;
      }
      memkit::require(end == text.size() && mib >= 1 && mib <= 4096, "--chunk-mib must be 1 to 4096, got '" + text + "'");
      options.chunk_bytes = mib * memkit::MiB;
    } else if (arg.rfind("--", 0) == 0) {
      throw memkit::error("unknown option " + arg);
    } else {
      files.push_back(arg);
    }
  }
  memkit::require(!out.empty() && !files.empty(), "--out and at least one rank file are needed (see --help)");
  std::vector<std::unique_ptr<memkit::safetensors::reader>> readers;
  std::vector<const memkit::safetensors::reader*> images;
  for (const std::string& f : files) {
    readers.push_back(std::make_unique<memkit::safetensors::reader>(f));
    images.push_back(readers.back().get());
  }
  const memkit::distributed::consolidate_report report =
      memkit::distributed::export_consolidated(images, out, options, memkit::default_host_resource());
  std::printf("wrote %s: %zu tensors from %d rank files, %s of data through a %s buffer\n", out.c_str(), report.tensors,
              report.ranks, memkit::format_bytes(report.data_bytes).c_str(),
              memkit::format_bytes(memkit::distributed::consolidate_workspace_bytes(options)).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return memkit_tools::main_reporting_errors("memkit-consolidate", run, argc, argv); }
