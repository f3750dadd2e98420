// Fuzz target: quant::load_linear4bit (NF4 and FP4, weight key "w") on an arbitrary safetensors file.
// Invariants: the loader never allocates more than the file could describe (its allocations stay within a
// small multiple of the file size, so a forged quant_state shape cannot ask for 512 GiB); a loaded weight
// dequantizes without touching memory outside its buffers; saving it and loading the result gives the
// same codes and scales.
#include <memkit/quant/bnb_checkpoint.hpp>

#include <cstdint>
#include <vector>

#include "fuzz_file.hpp"

namespace {
// A host resource that treats any allocation beyond `limit` bytes in total as a finding.
class bounded_resource final : public memkit::memory_resource {
 public:
  explicit bounded_resource(std::size_t limit) : limit_(limit) {}
  memkit::memory_kind kind() const noexcept override { return memkit::memory_kind::host; }
  const char* name() const noexcept override { return "fuzz bounded_resource"; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    MEMKIT_FUZZ_CHECK(bytes <= limit_ - used_);  // an allocation the file's size cannot justify
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
void load_and_check(const std::string& path, std::size_t file_size) {
  using namespace memkit;
  // Codes take half a byte per element and every 32 elements at least one more byte of scales; the
  // stored tensor holds them all, so 2 x the file size (plus the fixed nested table) bounds any honest load.
  bounded_resource resource(2 * file_size + 4096);
  quant::quantized_tensor<F> weight;
  try {
    const safetensors::reader in(path);
    weight = quant::load_linear4bit<F>(in, "w", resource);
  } catch (const memkit::error&) {
    return;
  }
  MEMKIT_FUZZ_CHECK(weight.numel() >= 0);
  MEMKIT_FUZZ_CHECK(weight.bytes() == quant::quantized_tensor<F>::bytes_required(weight.logical_shape(), weight.options()));
  std::vector<float> values(static_cast<std::size_t>(weight.numel()));
  weight.dequantize(host, host_view(values));

  safetensors::writer out;
  quant::save_linear4bit(out, "w", weight);
  memory_file saved(reinterpret_cast<const std::uint8_t*>(""), 0);
  out.write(saved.path());
  const safetensors::reader again(saved.path());
  bounded_resource resource_again(2 * file_size + 4096);
  const quant::quantized_tensor<F> reloaded = quant::load_linear4bit<F>(again, "w", resource_again);
  MEMKIT_FUZZ_CHECK(reloaded.logical_shape() == weight.logical_shape());
  std::vector<float> values_again(values.size());
  reloaded.dequantize(host, host_view(values_again));
  for (std::size_t i = 0; i < values.size(); ++i)
    MEMKIT_FUZZ_CHECK(values[i] == values_again[i] || (values[i] != values[i] && values_again[i] != values_again[i]));
}
}  // namespace

MEMKIT_FUZZ_TARGET(bnb_linear4bit) {
  const memory_file file(data, size);
  load_and_check<memkit::quant::format::nf4>(file.path(), size);
  load_and_check<memkit::quant::format::fp4>(file.path(), size);
  return 0;
}
