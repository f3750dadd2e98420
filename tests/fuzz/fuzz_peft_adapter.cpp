// Fuzz target: peft::adapter_file (adapter_config.json + adapter_model.safetensors) on arbitrary input.
// Input: a little-endian u32 n, then n bytes of adapter_config.json, then the safetensors file.
// Invariants: a bad config or file ends in memkit::error, in bounded time (its regexes go through
// module_pattern: no backtracking) and memory; an accepted adapter loads every module into buffers of the
// shapes it reports, with finite values, and its config written back parses to the same selection.
#include <memkit/peft/peft.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_file.hpp"

MEMKIT_FUZZ_TARGET(peft_adapter) {
  if (size < 4) return 0;
  std::uint32_t config_length = 0;
  std::memcpy(&config_length, data, 4);
  if (config_length > size - 4) return 0;
  const memory_file config(data + 4, config_length);
  const memory_file weights(data + 4 + config_length, size - 4 - config_length);
  try {
    const memkit::peft::adapter_file adapter(config.path(), weights.path());
    std::int64_t values = 0;
    for (const memkit::peft::lora_module& m : adapter.modules()) {
      MEMKIT_FUZZ_CHECK(m.rank >= 0 && m.out_features > 0);
      MEMKIT_FUZZ_CHECK(adapter.find(m.path) == &m);
      // The file holds every value it claims: the shapes are bounded by its size.
      values += m.rank * (m.in_features + m.out_features) + (m.has_bias ? m.out_features : 0);
      MEMKIT_FUZZ_CHECK(values <= static_cast<std::int64_t>(size));
    }
    std::vector<std::vector<float>> storage;
    std::vector<memkit::peft::lora_tensors<float>> views;
    storage.reserve(3 * adapter.modules().size());
    for (const memkit::peft::lora_module& m : adapter.modules()) {
      memkit::peft::lora_tensors<float> v{m.path, {}, {}, {}};
      if (m.rank > 0) {
        storage.emplace_back(static_cast<std::size_t>(m.rank * m.in_features));
        v.A = memkit::host_view(storage.back().data(), memkit::shape{m.rank, m.in_features});
        storage.emplace_back(static_cast<std::size_t>(m.out_features * m.rank));
        v.B = memkit::host_view(storage.back().data(), memkit::shape{m.out_features, m.rank});
      }
      if (m.has_bias) {
        storage.emplace_back(static_cast<std::size_t>(m.out_features));
        v.bias = memkit::host_view(storage.back().data(), memkit::shape{m.out_features});
      }
      views.push_back(v);
    }
    adapter.load<float>(views);
    for (const std::vector<float>& s : storage)
      for (float x : s) MEMKIT_FUZZ_CHECK(std::isfinite(x));
    // The config written back reads as the same selection of the file's modules.
    const memkit::peft::lora_config again =
        memkit::peft::parse_lora_config(memkit::peft::to_json(adapter.config()), "fuzz: written back");
    for (const memkit::peft::lora_module& m : adapter.modules())
      if (m.rank > 0) MEMKIT_FUZZ_CHECK(again.targets(m.path) && again.rank_for(m.path) == m.rank);
  } catch (const memkit::error&) {
  }
  return 0;
}
