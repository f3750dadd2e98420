// Fuzz target: distributed::export_consolidated on one arbitrary rank file (a save made on one rank).
// Invariants: bad input ends in memkit::error and leaves no output file; the export allocates nothing but its
// copy buffer (consolidate_workspace_bytes), whatever sizes the file claims; a file it writes opens, and every
// 4-bit weight in it loads with quant::load_linear4bit (the export never writes what a peer's loader refuses).
#include <memkit/distributed/consolidate.hpp>

#include <cstdio>
#include <string>
#include <unistd.h>

#include "fuzz_file.hpp"

namespace {
// Counts what the export takes; more than the copy buffer at once is a finding.
class counting_resource final : public memkit::memory_resource {
 public:
  explicit counting_resource(std::size_t limit) : limit_(limit) {}
  memkit::memory_kind kind() const noexcept override { return memkit::memory_kind::host; }
  const char* name() const noexcept override { return "fuzz counting_resource"; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    MEMKIT_FUZZ_CHECK(bytes <= limit_ - used_);
    used_ += bytes;
    return memkit::default_host_resource().allocate(bytes, alignment);
  }
  void do_deallocate(void* pointer, std::size_t bytes, std::size_t alignment) noexcept override {
    used_ -= bytes;
    memkit::default_host_resource().deallocate(pointer, bytes, alignment);
  }

 private:
  std::size_t limit_;
  std::size_t used_ = 0;
};

template <memkit::quant::format F>
void load_every(const memkit::safetensors::reader& in, const std::string& suffix) {
  for (const memkit::safetensors::tensor_info& t : in.tensors()) {
    if (t.name.size() <= suffix.size() || t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const std::string key = t.name.substr(0, t.name.size() - suffix.size());
    const auto weight = memkit::quant::load_linear4bit<F>(in, key, memkit::default_host_resource());  // must not throw
    MEMKIT_FUZZ_CHECK(weight.numel() >= 0);
  }
}
}  // namespace

MEMKIT_FUZZ_TARGET(consolidate) {
  const memory_file file(data, size);
  const std::string out = "/tmp/memkit_fuzz_consolidate_" + std::to_string(::getpid()) + ".safetensors";
  memkit::distributed::consolidate_options options;
  options.chunk_bytes = 256;  // many chunks per piece
  counting_resource workspace(memkit::distributed::consolidate_workspace_bytes(options));
  try {
    const memkit::safetensors::reader in(file.path());
    const memkit::safetensors::reader* files[] = {&in};
    memkit::distributed::export_consolidated(files, out, options, workspace);
  } catch (const memkit::error&) {
    MEMKIT_FUZZ_CHECK(!memkit::io::path_exists(out));
    return 0;
  }
  {
    const memkit::safetensors::reader back(out);
    load_every<memkit::quant::format::nf4>(back, ".quant_state.bitsandbytes__nf4");
    load_every<memkit::quant::format::fp4>(back, ".quant_state.bitsandbytes__fp4");
  }
  std::remove(out.c_str());
  return 0;
}
