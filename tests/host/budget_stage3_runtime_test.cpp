// memory_budget's ZeRO-3 terms for the memkit runtime (budget/stage3.hpp) against the stage-3 runtime itself:
// the budget describes the stage-3 test model (tests/support/stage3_scenario.hpp) as a model_config and a plan,
// and its per-rank bytes must equal what each rank's tracking_resource measured while that model trained with
// stage3_parameters on 2 and 3 ranks (threads), dense full fine-tuning and NF4 QLoRA. The budget's units come
// from the model's shape (distributed::decoder_stage3_unit_shapes), the runtime's from the model's tensors.
#include <doctest/doctest.h>

#include <memkit/budget/estimate.hpp>
#include <memkit/budget/stage3.hpp>
#include <memkit/distributed/stage3.hpp>

#include <algorithm>
#include <vector>

#include "support/stage3_scenario.hpp"
#include "support/thread_communicator.hpp"

using namespace memkit::budget;

namespace {

// stage3_test::config() and qlora_config() as memory_budget describes a model.
model_config budget_model(const memkit::models::llama::model_config& c) {
  model_config m = llama_style("stage3-test", static_cast<std::uint64_t>(c.hidden), static_cast<std::uint64_t>(c.layers),
                               static_cast<std::uint64_t>(c.heads), static_cast<std::uint64_t>(c.kv_heads),
                               static_cast<std::uint64_t>(c.intermediate), static_cast<std::uint64_t>(c.vocab), c.tie_embeddings,
                               static_cast<std::uint64_t>(c.max_positions), static_cast<std::uint64_t>(c.head_dim));
  m.qkv_bias = c.qkv_bias;
  return m;
}

training_plan budget_plan(int ranks, bool qlora, bool prefetch) {
  training_plan p{.runtime = runtime_kind::memkit,
                  .precision = precision_mode::fp32,  // the scenario's float parameters, no master copy
                  .optimizer = optimizer_kind::adamw,
                  .micro_batch = static_cast<std::uint64_t>(stage3_test::batch),
                  .sequence = static_cast<std::uint64_t>(stage3_test::sequence),
                  .logits = logits_mode::chunked,
                  .host_threads = 1,
                  .gpus = static_cast<std::uint64_t>(ranks),
                  .zero_stage = 3,
                  .overhead = host_overhead,  // 1-byte granularity: exact bytes
                  .gather_prefetch = prefetch};
  if (qlora) {
    const auto o = stage3_test::qlora_options();
    p.training = method::lora;
    p.weights = {weight_format::nf4, static_cast<std::uint64_t>(o.quant.block_size), o.quant.double_quant};
    p.lora.rank = static_cast<std::uint64_t>(o.lora.rank);
  }
  return p;
}

}  // namespace

TEST_CASE("budget stage 3, memkit runtime: per-rank bytes equal the trackers of stage-3 runs on 2 and 3 ranks") {
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    const bool prefetch = ranks == 3;  // the scenario prefetches (two buffers in slot 0) on 3 ranks
    memkit_test::thread_ranks group(ranks);
    std::vector<stage3_test::outcome> dense(static_cast<std::size_t>(ranks));
    std::vector<stage3_test::qlora_outcome> qlora(static_cast<std::size_t>(ranks));
    group.run([&](const memkit_test::thread_ranks::communicator& comm) {
      dense[static_cast<std::size_t>(comm.rank())] = stage3_test::run(comm, 1, prefetch);
      qlora[static_cast<std::size_t>(comm.rank())] = stage3_test::run_qlora(comm, 1);
    });
    const model_config dm = budget_model(stage3_test::config()), qm = budget_model(stage3_test::qlora_config());
    const training_plan dp = budget_plan(ranks, false, prefetch), qp = budget_plan(ranks, true, false);
    REQUIRE(plan_problem(dm, dp).empty());
    REQUIRE(plan_problem(qm, qp).empty());
    std::size_t worst_weights = 0, worst_optimizer = 0;
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      const stage3_test::outcome& d = dense[static_cast<std::size_t>(r)];
      INFO(d.first_problem);
      CHECK(d.param_mismatches == 0);
      const memkit::distributed::stage3_bytes b = stage3_runtime_bytes(dm, dp, r);
      CHECK(b.weights == d.peak_weights);
      CHECK(b.gradients == d.peak_gradients);
      CHECK(b.optimizer_state == d.peak_optimizer);
      CHECK(b.master == 0);
      worst_weights = std::max(worst_weights, b.weights);
      worst_optimizer = std::max(worst_optimizer, b.optimizer_state);

      const stage3_test::qlora_outcome& q = qlora[static_cast<std::size_t>(r)];
      INFO(q.first_problem);
      CHECK(q.adapter_mismatches == 0);
      const memkit::distributed::stage3_bytes qb = stage3_runtime_bytes(qm, qp, r);
      CHECK(qb.weights == q.peak_weights);
      CHECK(qb.gradients == 0);
      CHECK(qb.optimizer_state == 0);
      CHECK(stage3_transient_workspace_bytes(qm, qp) == q.peak_workspace);
    }
    // The estimate charges the worst rank's runtime bytes; full training leaves nothing outside the units.
    const memory_estimate e = estimate_memory(dm, dp);
    REQUIRE(e.valid());
    // Besides the units: the rotary table, fp32 cos and sin [max_positions, head_dim / 2] each.
    const std::uint64_t rotary = 4 * 2 * static_cast<std::uint64_t>(stage3_test::config().max_positions * (stage3_test::config().head_dim / 2));
    for (const breakdown& phase : e.phases) {
      CHECK(phase[category::weights] == worst_weights + rotary);
      CHECK(phase[category::optimizer_state] == worst_optimizer);
      CHECK(phase[category::master_weights] == 0);
    }
    // QLoRA: the runtime's NF4 slices and gather buffers, plus the frozen dense tensors and adapters whole.
    const memory_estimate qe = estimate_memory(qm, qp);
    REQUIRE(qe.valid());
    const auto c = stage3_test::qlora_config();
    const std::uint64_t h = static_cast<std::uint64_t>(c.hidden), V = static_cast<std::uint64_t>(c.vocab);
    const std::uint64_t L = static_cast<std::uint64_t>(c.layers), lr = static_cast<std::uint64_t>(stage3_test::qlora_options().lora.rank);
    const std::uint64_t q_out = static_cast<std::uint64_t>(c.heads * c.head_dim), kv_out = static_cast<std::uint64_t>(c.kv_heads * c.head_dim);
    const std::uint64_t f = static_cast<std::uint64_t>(c.intermediate);
    // The frozen embedding, head, 2 norms per block and the final norm, q/k/v biases, in 16-bit (what the
    // budget assumes for a quantized model's other tensors); fp32 adapters A [r, in] and B [out, r].
    const std::uint64_t frozen = 2 * (2 * V * h + (2 * L + 1) * h + L * (q_out + 2 * kv_out));
    const std::uint64_t adapters =
        4 * L * lr * ((h + q_out) + 2 * (h + kv_out) + (q_out + h) + 2 * (h + f) + (f + h));
    const std::size_t qworst = stage3_runtime_bytes(qm, qp).weights;
    const std::uint64_t qrotary = 4 * 2 * static_cast<std::uint64_t>(c.max_positions * (c.head_dim / 2));
    CHECK(qe.phases[0][category::weights] == qworst + frozen + adapters + qrotary);
  }
}

TEST_CASE("budget stage 3, memkit runtime: what the runtime cannot run is refused with the reason") {
  const model_config m = budget_model(stage3_test::config());
  training_plan p = budget_plan(2, false, true);
  p.grad_accum = 2;
  CHECK(plan_problem(m, p).find("grad_accum 1") != std::string_view::npos);
  p = budget_plan(2, true, true);
  p.weights = {weight_format::bf16};
  CHECK(plan_problem(m, p).find("NF4 bases") != std::string_view::npos);
  p = budget_plan(2, false, true);
  p.optimizer = optimizer_kind::none;
  CHECK(plan_problem(m, p).find("adamw flavour") != std::string_view::npos);
  model_config moe = m;
  moe.fused_qkv = true;
  CHECK(plan_problem(moe, budget_plan(2, false, true)).find("Llama-family decoder") != std::string_view::npos);
}
