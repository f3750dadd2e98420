// Fuzz target: a Hugging Face config.json as memkit-budget reads it (tools/hf_config.hpp), then the
// budget for it. Invariants for every config the reader accepts: each estimate is either refused with a
// reason or self-consistent (the device breakdown sums to the peak), and more work never needs less
// memory: doubling the micro-batch or the sequence never lowers the peak (wrapped 64-bit arithmetic would).
#include <memkit/budget/estimate.hpp>
#include <memkit/budget/fits.hpp>
#include <memkit/budget/planner.hpp>
#include <memkit/budget/presets.hpp>
#include <memkit/io/json.hpp>

#include <string>
#include <string_view>

#include "fuzz_target.hpp"
#include "hf_config.hpp"

namespace {
using namespace memkit::budget;

void check_plan(const model_config& model, training_plan plan) {
  const memory_estimate base = estimate_memory(model, plan);
  if (!base.valid()) return;
  MEMKIT_FUZZ_CHECK(base.device.total() == base.peak_device_bytes);
  training_plan bigger_batch = plan;
  bigger_batch.micro_batch *= 2;
  const memory_estimate batch2 = estimate_memory(model, bigger_batch);
  if (batch2.valid()) MEMKIT_FUZZ_CHECK(batch2.peak_device_bytes >= base.peak_device_bytes);
  training_plan longer = plan;
  longer.sequence *= 2;
  const memory_estimate seq2 = estimate_memory(model, longer);
  if (seq2.valid()) MEMKIT_FUZZ_CHECK(seq2.peak_device_bytes >= base.peak_device_bytes);
  (void)max_micro_batch(model, plan, presets::h100_80gb);
}
}  // namespace

MEMKIT_FUZZ_TARGET(hf_config) {
  const std::string name = "fuzz";
  model_config model;
  try {
    model = memkit_tools::model_from_hf_config(
        memkit::json::parse(std::string_view(reinterpret_cast<const char*>(data), size), "config.json"), name);
  } catch (const memkit::error&) {
    return 0;
  }
  training_plan full{};
  full.sequence = model.is_gpt2() && model.max_positions < 512 ? model.max_positions : 512;
  check_plan(model, full);
  training_plan qlora = full;
  qlora.training = method::lora;
  qlora.weights = {weight_format::nf4};
  qlora.checkpoint = checkpointing::every_layer;
  check_plan(model, qlora);
  return 0;
}
