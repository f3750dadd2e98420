// Fuzz target: sharded_adam_state::load on arbitrary rank images, into an fp32 state and an 8-bit state of
// one rank. The input is one image, or several back to back (the ranks of one save, re-sharded into one).
// Each image's checksum is recomputed first (a forger can too): what is fuzzed is what the checksum cannot
// protect, the header, the layout, the run identity, the control block and the moments.
// Invariants: a refused load leaves the state as it was, byte for byte; an accepted one saves to an
// image that loads into a fresh state with the same bytes, keeps the step count within 0 .. 2^62, and one
// step with finite gradients leaves every parameter free of NaN.
#include <memkit/distributed/sharded_adam_state.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_target.hpp"
#include "sharded_image.hpp"

namespace {

template <class S>
std::vector<std::byte> arena_bytes(const S& state) {
  const auto view = state.arena_view();
  return std::vector<std::byte>(view.begin(), view.end());
}

template <class S>
void load_and_step(const std::uint8_t* data, std::size_t size, const std::vector<std::int64_t>& sizes,
                   memkit::optim::adam_options options) {
  using namespace memkit;
  using namespace memkit::optim;
  using distributed::single_communicator;
  S state(host, single_communicator{}, default_host_resource(), sizes, options);
  // Split into images (each with its checksum fixed); what does not parse as one stays a last image as is.
  std::string bytes(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> images;
  std::size_t at = 0;
  while (at < bytes.size() && images.size() < 8) {
    const std::size_t end = memkit_test::sharded_image_end<S>(bytes, at, true);
    if (end == 0) break;
    images.push_back(bytes.substr(at, end - at));
    at = end;
  }
  if (at < bytes.size() || images.empty()) images.push_back(bytes.substr(at));
  std::vector<std::unique_ptr<std::stringstream>> streams;
  std::vector<std::istream*> pointers;
  for (const std::string& image : images) {
    streams.push_back(std::make_unique<std::stringstream>(image));
    pointers.push_back(streams.back().get());
  }
  const std::vector<std::byte> before = arena_bytes(state);
  try {
    state.load(host, std::span<std::istream* const>(pointers));
  } catch (const memkit::error&) {
    MEMKIT_FUZZ_CHECK(arena_bytes(state) == before);  // nothing half-loaded
    return;
  }
  const adam_control loaded = state.control(host);
  MEMKIT_FUZZ_CHECK(loaded.step >= 0 && loaded.step <= adam_max_steps);
  std::stringstream saved;
  state.save(host, saved);
  S again(host, single_communicator{}, default_host_resource(), sizes, options);
  again.load(host, saved);
  MEMKIT_FUZZ_CHECK(arena_bytes(again) == arena_bytes(state));
  MEMKIT_FUZZ_CHECK(again.run_id() == state.run_id());

  std::vector<float> params(static_cast<std::size_t>(state.flat_size()), 1.0f), grads(params.size(), 0.25f);
  const std::vector<adam_group> groups{adam_group{}};
  state.step_full_gradients(host, single_communicator{}, host_view(params), host_view(grads), groups);
  const adam_control after = state.control(host);
  MEMKIT_FUZZ_CHECK(after.step >= 1 || !after.applied);
  MEMKIT_FUZZ_CHECK(std::isfinite(after.loss_scale) && after.loss_scale > 0);
  for (float x : params) MEMKIT_FUZZ_CHECK(!std::isnan(x));
}

}  // namespace

MEMKIT_FUZZ_TARGET(sharded_adam_state) {
  using namespace memkit;
  using distributed::sharded_adam_state;
  load_and_step<sharded_adam_state<float>>(data, size, {7, 3}, {});
  load_and_step<sharded_adam_state<float>>(data, size, {7, 3},
                                           {.loss_scaling = {.enabled = true, .initial_scale = 256.0f}});
  load_and_step<sharded_adam_state<std::int8_t, 256>>(data, size, {300, 5}, {.min_quantized_size = 256});
  return 0;
}
