// Compile-time fit checks, built three ways by tests/compile_fail/check_budget_fits.cmake:
//   -DMEMKIT_CASE_FITS         must compile (a 7B QLoRA run on a 16 GB T4);
//   -DMEMKIT_CASE_DOES_NOT_FIT must fail, and the error must quote the MiB needed, the MiB available
//                              and the largest category;
//   -DMEMKIT_CASE_INVALID      must fail, naming an invalid model or plan;
// and with -DMEMKIT_PRINT_EXPECTED as a program that prints what the DOES_NOT_FIT error must say.
#include <memkit/budget/fits.hpp>

#include <cstdio>

using namespace memkit::budget;

constexpr training_plan qlora{.training = method::lora, .weights = {weight_format::nf4}, .micro_batch = 1,
                              .sequence = 512, .checkpoint = checkpointing::every_layer};
// Full bf16 training of Llama-3.1-8B at 4 x 4096 tokens without checkpointing.
constexpr training_plan too_big{.micro_batch = 4, .sequence = 4096};

#if defined(MEMKIT_PRINT_EXPECTED)
int main() {
  const fit_report r = check_fit(presets::llama_3_1_8b, too_big, presets::h100_80gb);
  const std::uint64_t needed_mib = (r.estimate.peak_device_bytes + memkit::MiB - 1) / memkit::MiB;
  std::printf("%llu;%llu;%.*s\n", static_cast<unsigned long long>(needed_mib),
              static_cast<unsigned long long>(r.available_bytes / memkit::MiB),
              static_cast<int>(to_string(r.estimate.device.largest()).size()),
              to_string(r.estimate.device.largest()).data());
  return r.fits ? 1 : 0;
}
#elif defined(MEMKIT_CASE_FITS)
static_assert(memkit::fits(presets::llama_2_7b, qlora, presets::t4));
#elif defined(MEMKIT_CASE_DOES_NOT_FIT)
static_assert(memkit::fits(presets::llama_3_1_8b, too_big, presets::h100_80gb));
#elif defined(MEMKIT_CASE_INVALID)
constexpr training_plan no_tokens{.micro_batch = 0};
static_assert(memkit::fits(presets::llama_3_1_8b, no_tokens, presets::h100_80gb));
#else
#error "define one of the MEMKIT_CASE_* macros"
#endif
