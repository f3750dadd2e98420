// bench/support/adam_bench.hpp — what the host and CUDA AdamW benchmarks share: the inputs, the state
// flavours, and the bytes one step moves, so that their bytes/s and roofline fractions are comparable.
//
// Bytes per parameter per step (fp32 params and grads): the norm pass reads the gradient (4); the
// update reads the gradient (4), reads and writes the parameter (8) and reads and writes both moments:
// fp32 16, bf16 8, 8-bit 4 + 16/block (two fp32 absmax read and written per block), 4-bit 2 + 16/block.
#pragma once

#include <benchmark/benchmark.h>
#include <memkit/core/float16.hpp>
#include <memkit/optim/adam_state.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace memkit_bench {

// Parameters ~ N(0, 0.1^2), then gradients ~ N(0, 0.01^2), drawn from one seeded generator.
struct adam_inputs {
  std::vector<float> params, grads;
};

inline adam_inputs make_adam_inputs(std::int64_t count) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto size = static_cast<std::size_t>(count);
  adam_inputs inputs{std::vector<float>(size), std::vector<float>(size)};
  for (float& x : inputs.params) x = 0.1f * normal(rng);
  for (float& x : inputs.grads) x = 0.01f * normal(rng);
  return inputs;
}

template <class AdamState>
double adam_moment_bytes_per_parameter() {
  using traits = memkit::optim::adam_state_traits<typename AdamState::state_type>;
  if constexpr (!traits::quantized) return 2.0 * 2.0 * sizeof(typename traits::moment_type);
  else return 2.0 * 2.0 * traits::bits / 8.0 + 2.0 * 2.0 * sizeof(float) / AdamState::block_size;
}

template <class AdamState>
double adam_step_bytes_per_parameter() {
  return 4.0 + 4.0 + 8.0 + adam_moment_bytes_per_parameter<AdamState>();
}

// The counters both AdamW benchmarks report besides bytes/s and the roofline fraction.
template <class AdamState>
void report_adam_state_counters(benchmark::State& state, double bytes_per_step, std::int64_t parameters,
                                const AdamState& adam) {
  state.counters["bytes_per_param"] = bytes_per_step / static_cast<double>(parameters);
  state.counters["state_bytes"] = static_cast<double>(adam.bytes());
}

// The state flavours both benchmarks compare (their names appear in the benchmark names).
namespace adam_flavours {
using fp32_state = memkit::optim::adam_state<float>;
using bf16_state = memkit::optim::adam_state<memkit::bf16>;
using int8_256_state = memkit::optim::adam_state<std::int8_t, 256>;
using int8_2048_state = memkit::optim::adam_state<std::int8_t, 2048>;
using int4_state = memkit::optim::adam_state<memkit::optim::four_bit, 128>;
}  // namespace adam_flavours

}  // namespace memkit_bench
