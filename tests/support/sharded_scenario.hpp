// A training run of distributed::sharded_adam_state against one adam_state, for any communicator: the host
// suite runs it on one rank (single_communicator), tests/mpi on 2 and 3 MPI ranks. Every rank runs the
// unsharded reference itself on the summed gradients and compares bit for bit.
//
// Gradients are multiples of 2^-17 below 2^-7 in magnitude, so the sum over ranks is exact in float in
// any order: the reference does not depend on the order the communicator adds in.
#pragma once

#include <doctest/doctest.h>

#include <memkit/distributed/communicator.hpp>
#include <memkit/distributed/sharded_adam_state.hpp>
#include <memkit/optim/adam_state.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "support/test_values.hpp"

namespace sharded_test {

// Six tensors: quantized and plain, pieces that split a tensor inside, and a 4-bit piece of odd length
// (tensor 2's tail on 2 ranks). Padded to granules: 2+1+4+1+3+1 = 12 granules, so 2 and 3 ranks both
// cut inside tensors.
inline const std::vector<std::int64_t> sizes{5000, 300, 12365, 4096, 9000, 70};
inline const std::vector<int> tensor_groups{0, 1, 0, 1, 0, 1};
inline const std::vector<memkit::optim::adam_group> groups{{.lr = 2e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f},
                                                    {.lr = 5e-3f, .beta1 = 0.8f, .beta2 = 0.99f, .eps = 1e-6f, .weight_decay = 0.0f}};

// Rank `rank`'s gradient of element j of tensor i at step `step`: a multiple of 2^-17 in (-2^-7, 2^-7).
inline float local_gradient(int step, std::size_t tensor, std::int64_t j, int rank) {
  const std::uint64_t h = memkit::detail::mix64((static_cast<std::uint64_t>(step) << 48) ^ (tensor << 40) ^
                                                (static_cast<std::uint64_t>(j) << 8) ^ static_cast<std::uint64_t>(rank));
  return static_cast<float>(static_cast<int>(h % 2001) - 1000) * (1.0f / 131072.0f);
}

struct outcome {
  int steps = 0;
  int param_mismatches = 0;   // elements (all ranks' views) whose bits differ from the reference
  int report_mismatches = 0;  // steps whose applied/step/skipped differ from the reference
  int moment_mismatches = 0;  // moments of this rank's pieces that differ from the reference's
  int skipped = 0;            // steps the reference skipped
  std::string first_problem;
};

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// One run: `steps` steps of stage `stage` (1 or 2) with parameters of type P, optionally with master
// weights (16-bit P), and a NaN gradient injected by the last rank at step `nan_step` (-1: none).
template <class State, int Block, class P, class C>
outcome run(const C& comm, int stage, int steps, bool with_master, int nan_step, memkit::optim::adam_options options = {}) {
  using sharded = memkit::distributed::sharded_adam_state<State, Block>;
  using reference_state = memkit::optim::adam_state<State, Block>;
  const int N = comm.size(), rank = comm.rank();
  options.max_grad_norm = 0.02f;  // the summed gradients' norm is ~0.05-0.15: clipping acts
  options.host_threads = 1;
  sharded state(memkit::host, comm, memkit::default_host_resource(), sizes, options);
  reference_state reference(memkit::host, memkit::default_host_resource(), sizes, options);

  // The same initial parameters on every rank, in the flat layout and per tensor for the reference.
  std::vector<P> flat(static_cast<std::size_t>(state.flat_size()), memkit::from_float<P>(0.0f));
  std::vector<std::vector<P>> ref_params(sizes.size());
  std::vector<std::vector<float>> ref_master(sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto values = memkit_test::convert<P>(memkit_test::standard_normal(sizes[i], 1000 + static_cast<unsigned>(i)));
    for (std::int64_t j = 0; j < sizes[i]; ++j) {
      const P p = memkit::from_float<P>(memkit::to_float(values[static_cast<std::size_t>(j)]) * 0.1f);
      flat[static_cast<std::size_t>(state.flat_offset(i) + j)] = p;
      ref_params[i].push_back(p);
      ref_master[i].push_back(memkit::to_float(p));
    }
  }
  std::vector<float> master;
  if (with_master) {
    master.resize(static_cast<std::size_t>(state.shard_size()));
    state.initialize_master(memkit::host_view(std::as_const(flat)), memkit::host_view(master));
  }

  outcome out;
  const memkit::distributed::sharded_step_options step_options{.tensor_groups = tensor_groups,
                                                        .gradient_scale = 1.0f / static_cast<float>(N)};
  std::vector<float> grads(static_cast<std::size_t>(state.flat_size()));
  std::vector<float> grad_shard(static_cast<std::size_t>(state.shard_size()));
  std::vector<std::vector<float>> ref_grads(sizes.size());
  for (int s = 0; s < steps; ++s) {
    std::fill(grads.begin(), grads.end(), 0.0f);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ref_grads[i].assign(static_cast<std::size_t>(sizes[i]), 0.0f);
      for (std::int64_t j = 0; j < sizes[i]; ++j) {
        grads[static_cast<std::size_t>(state.flat_offset(i) + j)] = local_gradient(s, i, j, rank);
        for (int r = 0; r < N; ++r) ref_grads[i][static_cast<std::size_t>(j)] += local_gradient(s, i, j, r);
      }
    }
    if (s == nan_step) {
      if (rank == N - 1) grads[static_cast<std::size_t>(state.flat_offset(4) + 17)] = std::numeric_limits<float>::quiet_NaN();
      ref_grads[4][17] = std::numeric_limits<float>::quiet_NaN();
    }
    if (stage == 1) {
      state.step_full_gradients(memkit::host, comm, memkit::host_view(flat), memkit::host_view(grads), groups, step_options,
                                with_master ? memkit::host_view(master) : memkit::tensor_view<float>{});
    } else {
      state.reduce_scatter_gradients(memkit::host, comm, memkit::host_view(std::as_const(grads)), memkit::host_view(grad_shard));
      state.step_shard_gradients(memkit::host, comm, memkit::host_view(flat), memkit::host_view(std::as_const(grad_shard)),
                                 groups, step_options, with_master ? memkit::host_view(master) : memkit::tensor_view<float>{});
    }
    std::vector<memkit::optim::adam_param<P, float>> params;
    for (std::size_t i = 0; i < sizes.size(); ++i)
      params.push_back({memkit::host_view(ref_params[i]), memkit::host_view(std::as_const(ref_grads[i])),
                        with_master ? memkit::host_view(ref_master[i]) : memkit::tensor_view<float>{}, tensor_groups[i]});
    reference.step(memkit::host, params, groups, step_options.gradient_scale);

    const auto mine = state.report(memkit::host), theirs = reference.report(memkit::host);
    if (!theirs.applied) ++out.skipped;
    if (mine.applied != theirs.applied || mine.step != theirs.step || mine.skipped_steps != theirs.skipped_steps ||
        mine.first_nonfinite_tensor != theirs.first_nonfinite_tensor || !same_bits(mine.grad_norm, theirs.grad_norm)) {
      ++out.report_mismatches;
      if (out.first_problem.empty())
        out.first_problem = "step " + std::to_string(s) + ": sharded '" + mine.to_string() + "' vs reference '" +
                            theirs.to_string() + "'";
    }
    for (std::size_t i = 0; i < sizes.size(); ++i)
      for (std::int64_t j = 0; j < sizes[i]; ++j)
        if (!same_bits(flat[static_cast<std::size_t>(state.flat_offset(i) + j)], ref_params[i][static_cast<std::size_t>(j)])) {
          if (out.param_mismatches++ == 0 && out.first_problem.empty())
            out.first_problem = "step " + std::to_string(s) + ": tensor " + std::to_string(i) + " element " +
                                std::to_string(j) + " differs from the reference";
        }
    ++out.steps;
  }
  for (const memkit::distributed::shard_piece& p : state.pieces()) {
    std::vector<float> m, v, ref_m, ref_v;
    state.read_moments(memkit::host, static_cast<std::size_t>(p.tensor), m, v);
    reference.read_moments(memkit::host, static_cast<std::size_t>(p.tensor), ref_m, ref_v);
    for (std::int64_t j = 0; j < p.count(); ++j) {
      const auto k = static_cast<std::size_t>(j), r = static_cast<std::size_t>(p.begin + j);
      if (!same_bits(m[k], ref_m[r]) || !same_bits(v[k], ref_v[r])) ++out.moment_mismatches;
    }
  }
  return out;
}

// What a run of `steps` steps must show, on any number of ranks: every step taken, no bit of a parameter, a step
// report or a moment different from the reference, and the NaN step (nan_step >= 0) skipped like the reference's.
inline void check_like_reference(const outcome& out, int steps, int nan_step) {
  INFO(out.first_problem);
  CHECK(out.steps == steps);
  CHECK(out.param_mismatches == 0);
  CHECK(out.report_mismatches == 0);
  CHECK(out.moment_mismatches == 0);
  CHECK(out.skipped == (nan_step >= 0 ? 1 : 0));
}

}  // namespace sharded_test
