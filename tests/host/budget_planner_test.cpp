#include <doctest/doctest.h>

#include <memkit/budget/planner.hpp>

using namespace memkit::budget;

TEST_CASE("budget: largest micro-batch and longest sequence are the edge of fitting") {
  const model_config& m = presets::llama_3_2_1b;
  const gpu_spec& gpu = presets::a100_40gb;
  training_plan plan{.training = method::lora, .sequence = 2048, .checkpoint = checkpointing::every_layer};
  const std::uint64_t batch = max_micro_batch(m, plan, gpu);
  REQUIRE(batch > 0);
  plan.micro_batch = batch;
  CHECK(check_fit(m, plan, gpu).fits);
  plan.micro_batch = batch + 1;
  CHECK_FALSE(check_fit(m, plan, gpu).fits);

  plan.micro_batch = 8;
  const std::uint64_t sequence = max_sequence(m, plan, gpu);
  REQUIRE(sequence > 0);
  REQUIRE(sequence < m.max_positions);
  plan.sequence = sequence;
  CHECK(check_fit(m, plan, gpu).fits);
  plan.sequence = sequence + 1;
  CHECK_FALSE(check_fit(m, plan, gpu).fits);

  // Nothing fits: 0. Everything fits: the model's context.
  CHECK(max_micro_batch(presets::llama_2_70b, training_plan{}, presets::t4) == 0);
  CHECK(max_sequence(presets::gpt2_124m, training_plan{.micro_batch = 1}, presets::b200) == 1024);
  static_assert(max_micro_batch(presets::smollm2_135m, training_plan{.sequence = 512}, presets::t4) > 1);
}

TEST_CASE("budget: the ladder returns the first rung that fits, with every rung's breakdown") {
  // Llama-3.1-8B, micro-batch 8 x 2048 on one 80 GB GPU: full bf16 training does not fit (~16 B/param
  // of model states alone is 120 GiB); with 8-bit AdamW (10 B/param: 74.8 GiB), the fused loss (no
  // 16,384 x 128,256 logits) and checkpointing (32 checkpoints of 256 MiB) it just does.
  const training_plan workload{.micro_batch = 8, .sequence = 2048};
  const ladder l = plan_ladder(presets::llama_3_1_8b, presets::h100_80gb, workload);
  REQUIRE(l.first_fit >= 0);
  CHECK(l.rungs[l.first_fit].kind == rung_kind::checkpointing);
  CHECK(l.rungs[static_cast<int>(rung_kind::qlora)].fits);
  for (int i = 0; i < l.first_fit; ++i) CHECK_FALSE(l.rungs[i].fits);
  for (const ladder_rung& r : l.rungs) {
    CHECK(r.estimate.valid());
    CHECK(r.estimate.device.total() == r.estimate.peak_device_bytes);
  }
  // Each rung of the full-training part needs no more memory than the one before.
  for (int i = 1; i < 5; ++i) CHECK(l.rungs[i].estimate.peak_device_bytes <= l.rungs[i - 1].estimate.peak_device_bytes);
  // The smaller micro-batch keeps the effective batch.
  const training_plan& smaller = l.rungs[static_cast<int>(rung_kind::smaller_micro_batch)].plan;
  CHECK(smaller.micro_batch * smaller.grad_accum >= 8);
  CHECK(l.rungs[static_cast<int>(rung_kind::cpu_offload)].estimate.host_bytes > 0);

  // A small model fits at the first rung.
  const ladder small = plan_ladder(presets::smollm2_135m, presets::a100_80gb, training_plan{.micro_batch = 4, .sequence = 1024});
  CHECK(small.first_fit == 0);
  // Checkpointing is what makes a 1B model with long sequences fit on 24 GB.
  const ladder mid = plan_ladder(presets::llama_3_2_1b, presets::rtx_4090, training_plan{.micro_batch = 4, .sequence = 4096});
  REQUIRE(mid.first_fit >= 1);
  CHECK(mid.rungs[mid.first_fit - 1].fits == false);
}
