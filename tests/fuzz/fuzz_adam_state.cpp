// Fuzz target: adam_state::load on an arbitrary image, into an fp32 state and into an 8-bit state.
// The image ends with a checksum over the state bytes; random bytes would almost never match it, so the
// harness recomputes it first (a forger can too): what is fuzzed is everything the checksum cannot
// protect, the header fields, the control block and the moments.
// Invariants for every image a state accepts: saving reproduces it byte for byte (the scratch as zeros), and one step with
// finite gradients leaves every parameter free of NaN (a forged step count or loss scale would not).
#include <memkit/optim/adam_state.hpp>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "adam_image.hpp"
#include "fuzz_target.hpp"

namespace {

template <class State>
void load_and_step(const std::uint8_t* data, std::size_t size, const std::vector<std::int64_t>& sizes,
                   memkit::optim::adam_options options) {
  using namespace memkit;
  using namespace memkit::optim;
  State state(host, default_host_resource(), sizes, options);
  std::string image(reinterpret_cast<const char*>(data), size);
  memkit_test::fix_adam_image_checksum(image, state.bytes());
  std::stringstream in(image);
  try {
    state.load(host, in);
  } catch (const memkit::error&) {
    return;
  }
  std::stringstream out;
  state.save(host, out);
  // What was read: the image up to the checksum (trailing bytes after it are not part of it), but for the
  // gradient-norm scratch, which is no state and saved as zeros.
  MEMKIT_FUZZ_CHECK(memkit_test::adam_image_as_saved(image, out.str().size(), state) == out.str());

  std::vector<std::vector<float>> params, grads;
  std::vector<adam_param<float, float>> views;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    params.emplace_back(static_cast<std::size_t>(sizes[i]), 1.0f);
    grads.emplace_back(static_cast<std::size_t>(sizes[i]), 0.25f);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) views.push_back({host_view(params[i]), host_view(grads[i]), {}, 0});
  const std::vector<adam_group> groups{adam_group{}};
  state.step(host, views, groups);
  const adam_step_report report = state.report(host);
  MEMKIT_FUZZ_CHECK(report.step >= 1 || !report.applied);
  MEMKIT_FUZZ_CHECK(std::isfinite(report.loss_scale) && report.loss_scale > 0);
  for (const auto& p : params)
    for (float x : p) MEMKIT_FUZZ_CHECK(!std::isnan(x));
}

}  // namespace

MEMKIT_FUZZ_TARGET(adam_state) {
  using namespace memkit;
  using namespace memkit::optim;
  load_and_step<adam_state<float>>(data, size, {7, 3}, {});
  load_and_step<adam_state<float>>(data, size, {7, 3}, {.loss_scaling = {.enabled = true, .initial_scale = 256.0f}});
  load_and_step<adam_state<std::int8_t, 256>>(data, size, {300, 5}, {.min_quantized_size = 256});
  return 0;
}
