// The allocator model behind memory_budget's allocated / reserved / device figures
// (budget/allocator.hpp). Expected values are worked out by hand from the rules of PyTorch's
// c10/cuda/CUDACachingAllocator.cpp (round_size, get_allocation_size, should_split, best fit, merging
// on free), written next to each case.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <memkit/budget/allocator.hpp>
#include <memkit/budget/fits.hpp>
#include <memkit/budget/planner.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/tracking.hpp>

using namespace memkit::budget;
using memkit::MiB;

TEST_CASE("budget allocator: PyTorch's request rounding and segment sizes") {
  using namespace torch_caching;
  static_assert(round_size(0) == 0);
  static_assert(round_size(1) == 512);
  static_assert(round_size(512) == 512);
  static_assert(round_size(513) == 1024);
  static_assert(round_size(1 * MiB) == 1 * MiB);
  static_assert(round_size(1 * MiB + 1) == 1 * MiB + 512);
  // <= 1 MiB: the small pool's 2 MiB segment; up to 10 MiB: a 20 MiB segment; from 10 MiB: rounded to 2 MiB.
  CHECK(segment_size(512) == 2 * MiB);
  CHECK(segment_size(1 * MiB) == 2 * MiB);
  CHECK(segment_size(1 * MiB + 512) == 20 * MiB);
  CHECK(segment_size(10 * MiB - 512) == 20 * MiB);
  CHECK(segment_size(10 * MiB) == 10 * MiB);
  CHECK(segment_size(10 * MiB + 512) == 12 * MiB);
  // Small pool splits whenever 512 bytes remain; the large pool only when more than 1 MiB remains.
  CHECK(should_split(2 * MiB, 2 * MiB - 512, true));
  CHECK_FALSE(should_split(2 * MiB, 2 * MiB, true));
  CHECK(should_split(12 * MiB, 10 * MiB + 512, false));  // 2 MiB - 512 remain
  CHECK_FALSE(should_split(12 * MiB, 11 * MiB, false));  // exactly 1 MiB remains: not split
}

TEST_CASE("budget allocator: the caching allocator replayed on hand-worked sequences") {
  SUBCASE("small requests share one 2 MiB segment") {
    caching_allocator_model a;
    for (int i = 0; i < 3; ++i) a.allocate(1000);  // 1024 bytes each
    CHECK(a.allocated_bytes() == 3 * 1024);
    CHECK(a.reserved_bytes() == 2 * MiB);
    CHECK(a.segments() == 1);
  }
  SUBCASE("an unsplit block counts whole as allocated") {
    caching_allocator_model a;
    a.allocate(11 * MiB);  // segment 12 MiB; 1 MiB would remain, not > 1 MiB: not split
    CHECK(a.allocated_bytes() == 12 * MiB);
    CHECK(a.reserved_bytes() == 12 * MiB);
    caching_allocator_model b;
    b.allocate(10 * MiB + 1);  // 10 MiB + 512 in a 12 MiB segment: split, 2 MiB - 512 stay free
    CHECK(b.allocated_bytes() == 10 * MiB + 512);
    CHECK(b.reserved_bytes() == 12 * MiB);
  }
  SUBCASE("mid-size requests pack 20 MiB segments; a large one takes a big enough free tail") {
    caching_allocator_model a;
    a.allocate(5 * MiB);   // new 20 MiB segment, 15 MiB free tail
    a.allocate(12 * MiB);  // best fit: the 15 MiB tail (split: 3 MiB > 1 MiB remain)
    CHECK(a.reserved_bytes() == 20 * MiB);
    CHECK(a.allocated_bytes() == 17 * MiB);
    a.allocate(4 * MiB);  // the 3 MiB tail is too small: a second 20 MiB segment
    CHECK(a.reserved_bytes() == 40 * MiB);
    CHECK(a.segments() == 2);
  }
  SUBCASE("fragmentation: free memory that no request fits") {
    caching_allocator_model a;
    const auto x = a.allocate(6 * MiB);  // one 20 MiB segment: 6 | 6 | 6 | 2 free
    a.allocate(6 * MiB);
    const auto z = a.allocate(6 * MiB);
    CHECK(a.reserved_bytes() == 20 * MiB);
    a.free(x);  // free: 6 MiB at the start
    a.free(z);  // merges with the 2 MiB tail: 8 MiB free
    CHECK(a.largest_free_block() == 8 * MiB);
    a.allocate(10 * MiB);  // 14 MiB free in total, but no block of 10 MiB: a new 10 MiB segment
    CHECK(a.allocated_bytes() == 16 * MiB);
    CHECK(a.reserved_bytes() == 30 * MiB);
    CHECK(a.peak_reserved_bytes() == 30 * MiB);
  }
  SUBCASE("best fit takes the smallest free block that holds the request; freed memory stays reserved") {
    caching_allocator_model a;
    const auto p = a.allocate(8 * MiB);  // 20 MiB segment: 8 | 2 | 6 | 4 free
    const auto q = a.allocate(2 * MiB);
    const auto r = a.allocate(6 * MiB);
    a.free(p);
    a.free(r);  // free blocks: 8 MiB, and 6 + 4 merged = 10 MiB
    CHECK(a.largest_free_block() == 10 * MiB);
    a.allocate(7 * MiB);  // best fit is the 8 MiB block (1 MiB left: not split, handed out whole)
    CHECK(a.allocated_bytes() == 2 * MiB + 8 * MiB);
    CHECK(a.largest_free_block() == 10 * MiB);
    a.free(q);
    CHECK(a.reserved_bytes() == 20 * MiB);  // the cache keeps its segment
    CHECK(a.allocated_bytes() == 8 * MiB);
  }
  SUBCASE("the small and the large pool never share segments") {
    caching_allocator_model a;
    const auto big = a.allocate(4 * MiB);  // 20 MiB large segment
    a.free(big);
    a.allocate(4096);  // small request: its own 2 MiB segment, the free 20 MiB is large-pool only
    CHECK(a.reserved_bytes() == 22 * MiB);
  }
}

TEST_CASE("budget allocator: the replay works in a constant expression") {
  constexpr std::uint64_t reserved = [] {
    caching_allocator_model a;
    const auto x = a.allocate(6 * MiB);
    a.allocate(6 * MiB);
    const auto z = a.allocate(6 * MiB);
    a.free(x);
    a.free(z);
    a.allocate(10 * MiB);
    return a.peak_reserved_bytes();
  }();
  static_assert(reserved == 30 * MiB);
}

TEST_CASE("budget allocator: pool_usage is the steady state of a sequential replay") {
  // pool_usage places sizes largest first, smaller ones into the tails they fit; a replay of the same
  // requests, nothing freed, differs by less than one request per segment where the order matters.
  auto replay_and_compare = [](const std::vector<std::uint64_t>& sizes) -> std::int64_t {
    caching_allocator_model replay;
    pool_usage usage;
    std::uint64_t largest = 0;
    for (std::uint64_t b : sizes) {
      replay.allocate(b);
      usage.add(b);
      largest = b > largest ? b : largest;
    }
    CAPTURE(sizes.size());
    const auto difference =
        static_cast<std::int64_t>(replay.reserved_bytes()) - static_cast<std::int64_t>(usage.reserved());
    const auto bound = static_cast<std::int64_t>(replay.segments() * torch_caching::round_size(largest));
    CHECK(difference <= bound);
    CHECK(-difference <= bound);
    CHECK(static_cast<std::uint64_t>(usage.rounded) <= replay.allocated_bytes());
    return difference;
  };
  // Hand-checked: three 1 KiB requests, an 11 MiB one, three 5 MiB ones.
  pool_usage u;
  u.add(1000, 3);
  u.add(11 * MiB);
  u.add(5 * MiB, 3);
  CHECK(u.reserved() == 2 * MiB + 12 * MiB + 20 * MiB);
  CHECK(u.slack() == u.reserved() - (3 * 1024 + 11 * MiB + 15 * MiB));
  CHECK(replay_and_compare({1000, 1000, 1000, 11 * MiB, 5 * MiB, 5 * MiB, 5 * MiB}) == 0);

  // One Llama-2-7B block's bf16 weights as PEFT allocates them (q, k, v, o: 4096x4096; gate, up: 11008x4096;
  // down: 4096x11008; two RMSNorm weights), eight blocks: every size is a multiple of 2 MiB, no slack.
  std::vector<std::uint64_t> llama;
  for (int block = 0; block < 8; ++block) {
    for (int i = 0; i < 4; ++i) llama.push_back(2ull * 4096 * 4096);
    for (int i = 0; i < 3; ++i) llama.push_back(2ull * 11008 * 4096);
    llama.push_back(2 * 4096);
    llama.push_back(2 * 4096);
  }
  CHECK(replay_and_compare(llama) == 0);

  // Mid-size requests that do not divide 20 MiB (8 MiB, 1.5 MiB) next to large ones whose 2 MiB segment
  // rounding leaves a tail the 1.5 MiB ones can use: no longer exact, but within 3 segments.
  pool_usage eight;
  eight.add(8 * MiB, 5);  // two per 20 MiB segment (4 MiB tail): 2.5 segments -> three
  CHECK(eight.reserved() == 60 * MiB);
  CHECK(replay_and_compare({8 * MiB, 8 * MiB, 8 * MiB, 8 * MiB, 8 * MiB}) == 0);
  // A grouped-query layer's 4-bit q, k, v, o (8, 2, 2, 8 MiB): the 2 MiB ones fill the 8 MiB ones' tail.
  pool_usage layer;
  layer.add(8 * MiB, 2);
  layer.add(2 * MiB, 2);
  CHECK(layer.reserved() == 20 * MiB);
  CHECK(replay_and_compare({8 * MiB, 2 * MiB, 2 * MiB, 8 * MiB}) == 0);
  std::vector<std::uint64_t> mixed;
  for (int i = 0; i < 10; ++i) {
    mixed.push_back(8 * MiB);
    mixed.push_back(3 * MiB / 2);
    mixed.push_back(24 * MiB + 4096);
  }
  const std::int64_t extra = replay_and_compare(mixed);
  CHECK(extra < static_cast<std::int64_t>(3 * 20 * MiB));
  CHECK(-extra < static_cast<std::int64_t>(3 * 20 * MiB));
}

TEST_CASE("budget allocator: the memkit model is exactly what tracking_resource counts") {
  // The same sequence through a real tracking_resource on the host and through exact_allocator_model.
  const std::uint64_t sizes[] = {1, 511, 513, 4096, 1000003, 3 * MiB + 7, 17};
  memkit::tracking_resource tracker(memkit::default_host_resource(), "metrics");
  exact_allocator_model model;
  std::vector<memkit::buffer<std::byte>> live;
  std::vector<exact_allocator_model::handle> handles;
  for (std::uint64_t b : sizes) {
    live.emplace_back(tracker.category(memkit::memory_category::activations),
                      memkit::shape{static_cast<std::int64_t>(b)});
    handles.push_back(model.allocate(b));
    CHECK(model.allocated_bytes() == tracker.current_bytes());
  }
  // Free every other one, then one more large request.
  for (std::size_t i = 0; i < live.size(); i += 2) {
    live[i] = memkit::buffer<std::byte>{};
    model.free(handles[i]);
    CHECK(model.reserved_bytes() == tracker.current_bytes());
  }
  live.emplace_back(tracker.category(memkit::memory_category::workspace), memkit::shape{5 * 1024 * 1024});
  model.allocate(5 * MiB);
  CHECK(model.reserved_bytes() == tracker.current_bytes());
  CHECK(model.peak_reserved_bytes() == tracker.peak_bytes());
  CHECK(model.peak_allocated_bytes() == model.peak_reserved_bytes());
  // The caching allocator would hold more for the same sequence: the rounding and the cached segments.
  caching_allocator_model torch;
  for (std::uint64_t b : sizes) torch.allocate(b);
  CHECK(torch.reserved_bytes() > model.peak_reserved_bytes());
}

namespace {
// A few plans across the estimator's paths: full and LoRA, 16-bit and NF4, checkpointing, ZeRO, offload.
std::vector<training_plan> sample_plans() {
  std::vector<training_plan> plans;
  plans.push_back(training_plan{.micro_batch = 2, .sequence = 1024});
  plans.push_back(training_plan{.precision = precision_mode::bf16, .optimizer = optimizer_kind::adamw_8bit,
                                .micro_batch = 4, .sequence = 512, .checkpoint = checkpointing::every_layer});
  plans.push_back(training_plan{.training = method::lora, .weights = {weight_format::nf4, 64, true},
                                .micro_batch = 1, .sequence = 2048, .grad_accum = 4,
                                .checkpoint = checkpointing::every_layer, .logits = logits_mode::chunked});
  plans.push_back(training_plan{.training = method::lora, .lora = {32, linear_module::q | linear_module::v, true},
                                .micro_batch = 2, .sequence = 512, .logits = logits_mode::half});
  plans.push_back(training_plan{.micro_batch = 1, .sequence = 4096, .gpus = 8, .zero_stage = 3});
  plans.push_back(training_plan{.placement = optimizer_placement::host, .offload_parameters = true,
                                .micro_batch = 1, .sequence = 1024, .gpus = 2, .zero_stage = 2});
  plans.push_back(training_plan{.training = method::lora, .weights = {weight_format::nf4, 64, true},
                                .optimizer = optimizer_kind::adamw_8bit, .placement = optimizer_placement::paged,
                                .micro_batch = 2, .sequence = 1024});
  plans.push_back(training_plan{.runtime = runtime_kind::memkit, .optimizer = optimizer_kind::adamw_8bit,
                                .micro_batch = 2, .sequence = 1024, .logits = logits_mode::chunked});
  plans.push_back(training_plan{.runtime = runtime_kind::memkit, .training = method::lora,
                                .weights = {weight_format::nf4, 64, true}, .micro_batch = 1, .sequence = 2048,
                                .checkpoint = checkpointing::every_layer, .logits = logits_mode::fused});
  return plans;
}
}  // namespace

TEST_CASE("budget metrics: allocated <= reserved, device - reserved is what no allocator holds, every phase") {
  for (const model_config& m : {presets::llama_3_1_8b, presets::qwen2_5_0_5b, presets::gpt2_124m, presets::gemma_2b}) {
    for (const training_plan& plan : sample_plans()) {
      CAPTURE(m.name);
      CAPTURE(plan.micro_batch);
      CAPTURE(plan.gpus);
      const memory_estimate e = estimate_memory(m, plan);
      if (!e.valid()) {  // GPT-2's learned positions stop at 1024 tokens
        CHECK(m.is_gpt2());
        continue;
      }
      // The CUDA context, NCCL over several GPUs, a paged optimizer's managed memory, and with the memkit runtime
      // cuBLAS's own workspace (PyTorch hands cuBLAS one from its caching allocator).
      const bool memkit_runtime = plan.runtime == runtime_kind::memkit;
      const std::uint64_t outside = plan.overhead.cuda_context_bytes + (plan.gpus > 1 ? plan.overhead.nccl_bytes : 0) +
                                    e.managed_bytes + (memkit_runtime ? plan.overhead.workspace_bytes : 0);
      if (plan.placement == optimizer_placement::paged) CHECK(e.managed_bytes > 0);
      memory_figures most{};
      for (int i = 0; i < step_phase_count; ++i) {
        const memory_figures& f = e.figures[i];
        const breakdown& b = e.phases[i];
        const std::uint64_t tensors = b.total() - b[category::overhead];
        const std::uint64_t counted = tensors - e.managed_bytes;  // what the allocator's counters see
        CHECK(f.allocated >= counted);  // the tensors, plus unsplit tails
        CHECK(f.allocated - counted < 64 * MiB * m.layers);  // a tail is under 1 MiB per large block
        CHECK(f.reserved >= f.allocated);
        if (memkit_runtime) CHECK(f.reserved == f.allocated);  // memkit's resources cache nothing
        if (memkit_runtime) CHECK(f.allocated == counted);
        CHECK(f.device - f.reserved == outside);
        CHECK(b.total() == f.device);
        if (i > 0 && !memkit_runtime) CHECK(f.reserved >= e.figures[i - 1].reserved);  // the cache only grows
        most.allocated = std::max(most.allocated, f.allocated);
        most.reserved = std::max(most.reserved, f.reserved);
        most.device = std::max(most.device, f.device);
      }
      CHECK(e.peak.allocated == most.allocated);
      CHECK(e.peak.reserved == most.reserved);
      CHECK(e.peak.device == most.device);
      CHECK(e.peak_device_bytes == e.peak.device);
      CHECK(e.device.total() == e.peak_device_bytes);
      CHECK(e.figures[static_cast<int>(e.peak_phase)].device == e.peak.device);
    }
  }
}

TEST_CASE("budget metrics: the reserved slack of a hand-countable plan") {
  // GPT-2 124M, full fp32 training with SGD and momentum, no context or workspace. Its parameter tensors in
  // fp32: wte 50257x768 (147.2 MiB -> a 148 MiB segment, 0.77 MiB tail: unsplit, so allocated), wpe
  // 1024x768 (3 MiB), per block c_attn 768x2304 (6.75 MiB), c_fc and c_proj 768x3072 (9 MiB), attn c_proj
  // 768x768 (2.25 MiB): all 1..10 MiB, in 20 MiB segments; biases and LayerNorm weights small. allocated
  // is counted by hand; reserved is checked against a replay of the same tensors (weights, then momentum,
  // then gradients, each in the model's order), which is how PyTorch's allocator would place them.
  constexpr overhead_settings none{.cuda_context_bytes = 0, .nccl_bytes = 0, .workspace_bytes = 0,
                                   .allocation_granularity = 512, .fragmentation_percent = 0};
  const training_plan plan{.precision = precision_mode::fp32, .optimizer = optimizer_kind::sgd_momentum,
                           .micro_batch = 1, .sequence = 1, .overhead = none};
  const memory_estimate e = estimate_memory(presets::gpt2_124m, plan);
  const memory_figures& step = e.figures[static_cast<int>(step_phase::optimizer_step)];
  std::uint64_t small = 0, packed = 0, large = 0, large_segments = 0;
  std::vector<std::uint64_t> order;
  auto add = [&](std::uint64_t elements, std::uint64_t count) {
    const std::uint64_t bytes = torch_caching::round_size(4 * elements);
    for (std::uint64_t i = 0; i < count; ++i) order.push_back(4 * elements);
    if (bytes <= MiB) {
      small += bytes * count;
    } else if (bytes < 10 * MiB) {
      packed += bytes * count;
    } else {
      large += bytes * count;
      large_segments += (bytes + 2 * MiB - 1) / (2 * MiB) * (2 * MiB) * count;
    }
  };
  add(50257 * 768, 1);
  add(1024 * 768, 1);
  for (int layer = 0; layer < 12; ++layer) {
    add(768, 2);         // ln_1 weight and bias
    add(768 * 2304, 1);  // attn.c_attn
    add(2304, 1);
    add(768 * 768, 1);   // attn.c_proj
    add(768, 3);         // its bias, ln_2 weight and bias
    add(768 * 3072, 1);  // mlp.c_fc
    add(3072, 1);
    add(3072 * 768, 1);  // mlp.c_proj
    add(768, 1);
  }
  add(768, 2);  // ln_f
  const std::uint64_t copies = 3;
  const std::uint64_t tails = copies * (large_segments - large);
  CHECK(step.allocated == copies * (small + packed + large) + tails);
  caching_allocator_model replay;
  for (std::uint64_t copy = 0; copy < copies; ++copy)
    for (std::uint64_t bytes : order) replay.allocate(bytes);
  CHECK(replay.allocated_bytes() == step.allocated);
  // The end of backward: GPT-2's tied embedding gets embedding_dense_backward's [V, h] gradient on top of the
  // LM head's and autograd sums the two into a third; both freed, their segments stay cached.
  const auto embedding_grad = replay.allocate(4 * 50257 * 768);
  const auto sum = replay.allocate(4 * 50257 * 768);
  replay.free(embedding_grad);
  replay.free(sum);
  CAPTURE(step.reserved);
  CAPTURE(replay.reserved_bytes());
  // The cache keeps the backward's segments; at one token its activations are a few KiB and fit the
  // slack of the same segments, so what the step holds is exactly the replay's.
  CHECK(e.figures[static_cast<int>(step_phase::backward)].reserved <= step.reserved);
  CHECK(step.reserved == replay.reserved_bytes());
}

TEST_CASE("budget metrics: fits and the searches compare the figure asked for") {
  const model_config& m = presets::llama_3_2_1b;
  const training_plan plan{.micro_batch = 4, .sequence = 2048, .checkpoint = checkpointing::every_layer};
  const memory_estimate e = estimate_memory(m, plan);
  REQUIRE(e.peak.allocated < e.peak.reserved);
  REQUIRE(e.peak.reserved < e.peak.device);
  // A GPU between the allocated and the device figure: fits by allocated, not by device (the default).
  const gpu_spec between{"between", (e.peak.reserved + e.peak.device) / 2};
  CHECK_FALSE(check_fit(m, plan, between).fits);
  CHECK_FALSE(fits(m, plan, between));
  CHECK(check_fit(m, plan, between, metric::allocated).fits);
  CHECK(check_fit(m, plan, between, metric::reserved).fits);
  CHECK(check_fit(m, plan, between).shortfall_bytes() == e.peak.device - between.memory_bytes);
  CHECK(max_micro_batch(m, plan, between, 1u << 20, metric::allocated) >=
        max_micro_batch(m, plan, between, 1u << 20, metric::device));
  CHECK(max_micro_batch(m, plan, between, 1u << 20, metric::allocated) >= 4);
  CHECK(max_micro_batch(m, plan, between) < 4);
  CHECK(max_sequence(m, plan, between, metric::allocated) >= 2048);
  CHECK(max_sequence(m, plan, between) < 2048);
  // Still constant expressions.
  constexpr memory_estimate c = estimate_memory(presets::smollm2_135m, training_plan{.micro_batch = 1, .sequence = 256});
  static_assert(c.peak.allocated <= c.peak.reserved && c.peak.reserved <= c.peak.device);
  static_assert(c.peak.device - c.peak.reserved == training_plan{}.overhead.cuda_context_bytes);
  static_assert(fits(presets::smollm2_135m, training_plan{.micro_batch = 1, .sequence = 256}, presets::t4));
}

TEST_CASE("budget metrics: the estimator's reserved figure next to a replay of the same tensors") {
  // TinyLlama 1.1B, full bf16-mixed training with fused AdamW, no context or workspace: in the optimizer
  // step every parameter has its bf16 weight and gradient, an fp32 master copy, two fp32 moments and a
  // 4-byte step counter. Replayed here tensor by tensor (shapes from the published config, written out by
  // hand) through PyTorch's allocator rules, in the order a training script creates them.
  constexpr overhead_settings none{.cuda_context_bytes = 0, .nccl_bytes = 0, .workspace_bytes = 0,
                                   .allocation_granularity = 512, .fragmentation_percent = 0};
  const training_plan plan{.fused_optimizer = true, .micro_batch = 1, .sequence = 256, .overhead = none};
  const memory_estimate e = estimate_memory(presets::tinyllama_1_1b, plan);
  REQUIRE(e.valid());
  const memory_figures& step = e.figures[static_cast<int>(step_phase::optimizer_step)];

  std::vector<std::uint64_t> elements = {32000ull * 2048};  // embed_tokens
  for (int layer = 0; layer < 22; ++layer) {
    for (std::uint64_t n : {2048ull * 2048, 256ull * 2048, 256ull * 2048, 2048ull * 2048, 5632ull * 2048,
                            5632ull * 2048, 2048ull * 5632, 2048ull, 2048ull})
      elements.push_back(n);
  }
  elements.push_back(2048);                // final norm
  elements.push_back(32000ull * 2048);     // lm_head (untied)
  caching_allocator_model replay;
  for (std::uint64_t n : elements) replay.allocate(2 * n);  // bf16 weights (model.to(bfloat16))
  for (std::uint64_t n : elements) replay.allocate(4 * n);  // fp32 master copies
  for (std::uint64_t n : elements) {                        // AdamW state, created at the first step
    replay.allocate(4 * n);
    replay.allocate(4 * n);
    replay.allocate(4);
  }
  for (std::uint64_t n : elements) replay.allocate(2 * n);  // bf16 gradients, in backward
  CAPTURE(step.allocated);
  CAPTURE(step.reserved);
  CAPTURE(replay.allocated_bytes());
  CAPTURE(replay.reserved_bytes());
  // The same tensors: allocated to within the step counters' share of the profile; reserved within 1% (the
  // replay loses some 2 MiB small-pool segments where the norms break up pairs of 1 MiB k/v weights).
  const double allocated_gap = static_cast<double>(step.allocated) - static_cast<double>(replay.allocated_bytes());
  const double reserved_gap = static_cast<double>(step.reserved) - static_cast<double>(replay.reserved_bytes());
  CHECK(std::abs(allocated_gap) < 1.0 * MiB);
  CHECK(std::abs(reserved_gap) < 0.01 * static_cast<double>(replay.reserved_bytes()));
  CHECK(step.reserved > step.allocated);  // 1 MiB k/v weights and gradients fill 2 MiB small-pool segments
}
