// Fuzz target: optim::load_bnb_adam_state (the bitsandbytes AdamW8bit / 32-bit optimizer-state import) on an
// arbitrary safetensors file, into an 8-bit state (tensors of 300 and 5 elements, min_quantized_size 256: the
// first 8-bit, the second fp32, as bitsandbytes' min_8bit_size splits them) and into an fp32 state (7, 3).
// Invariants: a refused file leaves the state as it was, byte for byte; an accepted one has a step count
// within 0 .. 2^62, exports to a file that imports into a fresh state with the same moments, and one step
// with finite gradients leaves every parameter free of NaN.
#include <memkit/optim/bnb_adam_state.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "fuzz_file.hpp"

namespace {

template <class S>
std::vector<std::byte> arena_bytes(const S& state) {
  const auto view = state.arena_view();
  return std::vector<std::byte>(view.begin(), view.end());
}

template <class S>
void import_and_step(const std::string& path, const std::vector<std::int64_t>& sizes, memkit::optim::adam_options options) {
  using namespace memkit;
  using namespace memkit::optim;
  S state(host, default_host_resource(), sizes, options);
  const std::vector<std::byte> before = arena_bytes(state);
  optim::bnb_adam_state_info info;
  try {
    info = optim::load_bnb_adam_state(host, state, path);
  } catch (const memkit::error&) {
    MEMKIT_FUZZ_CHECK(arena_bytes(state) == before);  // nothing half-loaded
    return;
  }
  MEMKIT_FUZZ_CHECK(info.step >= 0 && info.step <= adam_max_steps);
  MEMKIT_FUZZ_CHECK(state.report(host).step == info.step);
  MEMKIT_FUZZ_CHECK(info.group_of_tensor.size() == sizes.size() && !info.groups.empty());

  // Export and import again: the same moments, the same step.
  // (save_adam_state writes a temporary file beside the path and renames it, so this is a real file.)
  const std::string exported =
      (std::filesystem::temp_directory_path() / ("memkit_fuzz_bnb_adam_state_" + std::to_string(::getpid()) + ".safetensors"))
          .string();
  optim::save_bnb_adam_state(host, state, exported, info);
  S again(host, default_host_resource(), sizes, options);
  const optim::bnb_adam_state_info info_again = optim::load_bnb_adam_state(host, again, exported);
  std::filesystem::remove(exported);
  MEMKIT_FUZZ_CHECK(info_again.step == info.step && info_again.group_of_tensor == info.group_of_tensor);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<float> m_a, v_a, m_b, v_b;
    state.read_moments(host, t, m_a, v_a);
    again.read_moments(host, t, m_b, v_b);
    MEMKIT_FUZZ_CHECK(m_a == m_b && v_a == v_b);
  }

  std::vector<std::vector<float>> params, grads;
  std::vector<adam_param<float, float>> views;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    params.emplace_back(static_cast<std::size_t>(sizes[i]), 1.0f);
    grads.emplace_back(static_cast<std::size_t>(sizes[i]), 0.25f);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i)
    views.push_back({host_view(params[i]), host_view(grads[i]), {}, info.group_of_tensor[i]});
  state.step(host, views, info.groups);
  const adam_step_report report = state.report(host);
  MEMKIT_FUZZ_CHECK(report.step >= 1 || !report.applied);
  for (const auto& p : params)
    for (float x : p) MEMKIT_FUZZ_CHECK(!std::isnan(x));
}

}  // namespace

MEMKIT_FUZZ_TARGET(bnb_adam_state) {
  using namespace memkit;
  using namespace memkit::optim;
  const memory_file file(data, size);
  import_and_step<adam_state<std::int8_t, 256>>(file.path(), {300, 5}, {.min_quantized_size = 256});
  import_and_step<adam_state<float>>(file.path(), {7, 3}, {});
  return 0;
}
