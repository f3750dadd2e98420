// ZeRO stage 3 (distributed/stage3.hpp, models/llama/stage3.hpp) on one rank: the decoder trained with its
// blocks gathered and released around each pass equals the whole model trained by adam_state, the tracker
// measures bytes_required exactly, and misuse fails with a message. tests/mpi runs the scenario on 2 and 3 ranks.
#include <doctest/doctest.h>
#include <memkit/distributed/communicator.hpp>
#include <memkit/checkpoint/segment.hpp>
#include <memkit/distributed/consolidate.hpp>
#include <memkit/distributed/stage3.hpp>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "support/stage3_scenario.hpp"
#include "support/thread_communicator.hpp"

using memkit::host;
using memkit::distributed::single_communicator;
namespace llama = memkit::models::llama;

TEST_CASE("stage3: one rank trains the decoder bit-identically to adam_state on the whole model") {
  stage3_test::check_like_one_process(stage3_test::run(single_communicator{}, 3), 3);
}

TEST_CASE("stage3: with two buffers in slot 0, each block's gather prefetches the next: the same bits, the memory predicted") {
  const auto plain = stage3_test::run(single_communicator{}, 2, false);
  const auto out = stage3_test::run(single_communicator{}, 2, true);
  INFO(out.first_problem);
  CHECK(out.loss_mismatches == 0);
  CHECK(out.param_mismatches == 0);
  CHECK(out.peak_weights == out.predicted_weights);
  CHECK(out.peak_gradients == out.predicted_gradients);
  CHECK(out.peak_optimizer == out.predicted_optimizer);
  CHECK(out.gathers == plain.gathers);  // a prefetch replaces a gather, it adds none
  CHECK(plain.prefetches == 0);
  CHECK(out.prefetches == 2 * 2 * (stage3_test::config().layers - 1));  // per step: blocks 1.. in forward, ..L-2 in backward
  // The second buffer: one more largest block's worth of weights.
  const auto shapes = llama::stage3_unit_shapes<float>(stage3_test::config(), memkit::layers::trainability::bf16_master);
  CHECK(out.predicted_weights - plain.predicted_weights ==
        memkit::distributed::stage3_parameters<float>::buffer_bytes(shapes, 1).weights -
            memkit::buffer<float>::bytes_required(memkit::shape{memkit::distributed::stage3_parameters<float>::flat_size(shapes.back(), 1)}));
}

TEST_CASE("stage3: 2 and 3 ranks as threads: dense and QLoRA bit-identical to one process, memory as predicted") {
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    memkit_test::thread_ranks group(ranks);
    std::vector<stage3_test::outcome> dense(static_cast<std::size_t>(ranks));
    std::vector<stage3_test::qlora_outcome> qlora(static_cast<std::size_t>(ranks));
    group.run([&](const memkit_test::thread_ranks::communicator& comm) {
      dense[static_cast<std::size_t>(comm.rank())] = stage3_test::run(comm, 2, comm.size() == 3);  // prefetch on 3
      qlora[static_cast<std::size_t>(comm.rank())] = stage3_test::run_qlora(comm, 2);
    });
    for (const auto& out : dense) stage3_test::check_like_one_process(out, 2);
    for (const auto& out : qlora) stage3_test::check_like_one_process(out, 2);
  }
}

TEST_CASE("stage3: gradient clipping by the global norm on 1, 2 and 3 ranks equals one process; a NaN on one rank skips every unit everywhere") {
  // max_grad_norm far below the gradients' norm: every step clips.
  constexpr float clip = 1e-3f;
  const auto one = stage3_test::run(single_communicator{}, 2, false, clip);
  INFO(one.first_problem);
  CHECK(one.param_mismatches == 0);
  CHECK(one.loss_mismatches == 0);
  CHECK(one.grad_norm > 10 * clip);
  CHECK(stage3_test::same_bits(one.grad_norm, one.reference_grad_norm));
  CHECK(one.norm_disagreements == 0);
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    memkit_test::thread_ranks group(ranks);
    std::vector<stage3_test::outcome> out(static_cast<std::size_t>(ranks));
    std::vector<stage3_test::skip_outcome> skip(static_cast<std::size_t>(ranks));
    group.run([&](const memkit_test::thread_ranks::communicator& comm) {
      out[static_cast<std::size_t>(comm.rank())] = stage3_test::run(comm, 2, comm.size() == 3, clip);
      skip[static_cast<std::size_t>(comm.rank())] = stage3_test::run_nonfinite(comm, comm.size() - 1, 0);
    });
    int placed = 0;
    for (std::size_t r = 0; r < out.size(); ++r) {
      CAPTURE(r);
      INFO(out[r].first_problem);
      CHECK(out[r].param_mismatches == 0);
      CHECK(out[r].loss_mismatches == 0);
      CHECK(out[r].changed > 1000);
      CHECK(stage3_test::same_bits(out[r].grad_norm, out[r].reference_grad_norm));
      CHECK(out[r].norm_disagreements == 0);
      CHECK(skip[r].applied_units == 0);
      CHECK(skip[r].skipped_units == stage3_test::config().layers + 1);
      CHECK(skip[r].changed == 0);
      placed += skip[r].nan_placed;
    }
    CHECK(placed == 1);
  }
}

TEST_CASE("stage3: one rank trains QLoRA adapters over gathered NF4 bases bit-identically") {
  stage3_test::check_like_one_process(stage3_test::run_qlora(single_communicator{}, 3), 3);
}

TEST_CASE("stage3: checkpoint::segment over stage3_layer gathers again for the recompute, bit-identical") {
  using runtime_type = memkit::distributed::stage3_parameters<float>;
  using block_type = stage3_test::model_type::block_type;
  using wrapped_type = memkit::distributed::stage3_layer<block_type, runtime_type, single_communicator>;
  const memkit::layers::memory_resources plain{};
  auto reference = stage3_test::make_model(plain);
  auto model = stage3_test::make_model(plain);
  const single_communicator comm;
  runtime_type runtime(host, comm, plain, llama::stage3_units(*model), stage3_test::adam_options(), 1);
  std::vector<wrapped_type> wrapped;
  for (std::size_t i = 0; i < model->blocks.size(); ++i) wrapped.push_back({&model->blocks[i], &runtime, &comm, i});

  const auto c = stage3_test::config();
  const memkit::shape dims{stage3_test::batch, stage3_test::sequence, c.hidden};
  std::vector<float> x(static_cast<std::size_t>(dims.numel())), dy(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = memkit::unit_float(memkit::random_word(5, 1, i)) - 0.5f;
    dy[i] = 0.01f * (memkit::unit_float(memkit::random_word(5, 2, i)) - 0.5f);
  }
  const memkit::checkpoint::segment_options options{.schedule = memkit::checkpoint::schedule::every_layer()};
  const auto run = [&](auto& layers, std::vector<float>& dx) {
    memkit::checkpoint::segment stack(memkit::checkpoint::layer_sequence(layers), options);
    memkit::activation_store store(memkit::default_host_resource());
    std::vector<float> y(x.size());
    dx.assign(x.size(), 0.0f);
    stack.forward(host, {}, memkit::host_view(std::as_const(x).data(), dims), memkit::host_view(y.data(), dims), store);
    stack.backward(host, memkit::host_view(std::as_const(dy).data(), dims), memkit::host_view(dx.data(), dims), store);
  };
  std::vector<float> ref_dx, dx;
  run(reference->blocks, ref_dx);
  run(wrapped, dx);
  CHECK(std::memcmp(dx.data(), ref_dx.data(), dx.size() * sizeof(float)) == 0);
  // Every block: its forward, its recompute in backward, its backward.
  CHECK(runtime.gathers() == 3 * c.layers);
  // One rank: the gradient slice is the unit's whole flat gradients.
  const auto units = llama::stage3_units(*reference);
  int mismatches = 0, nonzero = 0;
  for (std::size_t u = 0; u < model->blocks.size(); ++u) {
    const auto shard = runtime.grad_shard(u);
    for (std::size_t i = 0; i < units[u].parameters.size(); ++i) {
      const auto g = memkit::layers::copy_out(std::as_const(units[u].parameters[i]->grad).view());
      const std::int64_t at = runtime.optimizer(u).flat_offset(i);
      for (std::size_t j = 0; j < g.size(); ++j)
        if (!stage3_test::same_bits(g[j], shard[at + static_cast<std::int64_t>(j)])) ++mismatches;
        else if (g[j] != 0.0f) ++nonzero;
    }
  }
  CHECK(mismatches == 0);
  CHECK(nonzero > 1000);
  CHECK(!runtime.gathered(0));
}

TEST_CASE("stage3: save and load on one rank resumes bit-identically; another model's file is refused") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("memkit_stage3_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string file = (dir / "rank-0.safetensors").string();
  stage3_test::train_and_save(single_communicator{}, 2, file);
  const auto out = stage3_test::load_and_continue(single_communicator{}, {file}, 1, 2);
  INFO(out.first_problem);
  CHECK(out.steps == 2);
  CHECK(out.loss_mismatches == 0);
  CHECK(out.param_mismatches == 0);
  CHECK(out.optimizer_steps == 4);  // the loaded optimizer went on from step 2

  // A model with other sizes (one layer fewer) refuses the file before changing anything.
  const memkit::layers::memory_resources plain{};
  auto c = stage3_test::config();
  c.layers = 2;
  stage3_test::model_type other(c, plain, memkit::layers::trainability::bf16_master, [&](const llama::projection& p, std::int64_t, int) {
    return llama::make_dense_linear<float>(p, plain, memkit::layers::trainability::bf16_master);
  });
  memkit::distributed::stage3_parameters<float> runtime(host, single_communicator{}, plain, llama::stage3_units(other),
                                                        stage3_test::adam_options(), 0x5745);
  const memkit::safetensors::reader reader(file);
  const memkit::safetensors::reader* images[] = {&reader};
  CHECK_THROWS_WITH_AS(runtime.load(host, images), doctest::Contains("holds 4 stage-3 units, this model 3"), memkit::error);
  fs::remove_all(dir);
}

TEST_CASE("stage3: a run saved on 2 and 3 ranks, consolidated, is byte for byte the one-process model's export") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("memkit_stage3_export_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    std::vector<std::string> files;
    for (int r = 0; r < ranks; ++r) files.push_back((dir / ("rank-" + std::to_string(r) + ".safetensors")).string());
    memkit_test::thread_ranks group(ranks);
    group.run([&](const memkit_test::thread_ranks::communicator& comm) {
      stage3_test::train_and_save(comm, 2, files[static_cast<std::size_t>(comm.rank())]);
    });
    CHECK(stage3_test::consolidated_export_problem(files, 2, dir.string()) == "");
    // The comparison sees a difference: against the reference after one step only, the bytes differ.
    CHECK(stage3_test::consolidated_export_problem(files, 1, dir.string()).find("differ first at byte") != std::string::npos);
    // A rank's file missing: refused by name.
    const memkit::safetensors::reader first(files[0]);
    const memkit::safetensors::reader* one[] = {&first};
    CHECK_THROWS_WITH_AS(memkit::distributed::export_consolidated(one, (dir / "short.safetensors").string(),
                                                                  memkit::distributed::consolidate_options{},
                                                                  memkit::default_host_resource()),
                         doctest::Contains("images were given"), memkit::error);
  }
  fs::remove_all(dir);
}

TEST_CASE("stage3: a QLoRA model's NF4 bases saved on 2 and 3 ranks consolidate to bitsandbytes' file under their module names") {
  namespace fs = std::filesystem;
  using runtime_type = memkit::distributed::stage3_parameters<float>;
  const fs::path dir = fs::temp_directory_path() / ("memkit_stage3_qexport_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const memkit::layers::memory_resources plain{};
  // The unsharded bases, as transformers' bitsandbytes checkpoint holds them, in the units' order.
  auto reference = stage3_test::make_qlora_model(plain);
  memkit::safetensors::writer expected;
  expected.add_metadata("format", "pt");
  for (auto* l : reference->linears()) memkit::quant::save_linear4bit(expected, l->path + ".weight", *l->base);
  expected.write((dir / "expected.safetensors").string());
  const auto slurp = [](const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    std::vector<std::string> files;
    for (int r = 0; r < ranks; ++r) files.push_back((dir / ("rank-" + std::to_string(r) + ".safetensors")).string());
    memkit_test::thread_ranks group(ranks);
    group.run([&](const memkit_test::thread_ranks::communicator& comm) {
      auto model = stage3_test::make_qlora_model(plain);
      runtime_type runtime(host, comm, plain, llama::stage3_units(*model), stage3_test::adam_options(), 1);
      memkit::safetensors::writer out;
      runtime.save(host, out);
      out.write(files[static_cast<std::size_t>(comm.rank())]);
    });
    std::vector<memkit::safetensors::reader> readers;
    for (const std::string& f : files) readers.emplace_back(f);
    std::vector<const memkit::safetensors::reader*> images;
    for (const auto& r : readers) images.push_back(&r);
    const auto report = memkit::distributed::export_consolidated(images, (dir / "model.safetensors").string(),
                                                                 memkit::distributed::consolidate_options{},
                                                                 memkit::default_host_resource());
    CHECK(report.tensors == reference->linears().size());
    const std::string mine = slurp(dir / "model.safetensors"), theirs = slurp(dir / "expected.safetensors");
    CHECK(mine.size() == theirs.size());
    CHECK(mine == theirs);
  }
  fs::remove_all(dir);
}

TEST_CASE("stage3: a QLoRA model's NF4 shards saved and loaded into another model gather back bit for bit") {
  namespace fs = std::filesystem;
  using runtime_type = memkit::distributed::stage3_parameters<float>;
  const memkit::layers::memory_resources plain{};
  auto reference = stage3_test::make_qlora_model(plain);
  auto model = stage3_test::make_qlora_model(plain);
  const fs::path file = fs::temp_directory_path() / ("memkit_stage3_qlora_" + std::to_string(::getpid()) + ".safetensors");
  {
    runtime_type runtime(host, single_communicator{}, plain, llama::stage3_units(*model), stage3_test::adam_options(), 1);
    memkit::safetensors::writer out;
    runtime.save(host, out);
    out.write(file.string());
  }
  // A second model whose bases are different values: after the load, its gathered bases are the first model's.
  auto other = stage3_test::make_qlora_model(plain);
  for (auto* l : other->linears()) {
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(l->base->codes().size()), 0x11);
    memkit::layers::copy_in(codes.data(), l->base->codes());
  }
  runtime_type runtime(host, single_communicator{}, plain, llama::stage3_units(*other), stage3_test::adam_options(), 1);
  const memkit::safetensors::reader reader(file.string());
  const memkit::safetensors::reader* images[] = {&reader};
  runtime.load(host, images);
  int mismatches = 0;
  for (std::size_t u = 0; u + 1 < runtime.unit_count(); ++u) {
    runtime.gather(host, single_communicator{}, u, false);
    for (std::size_t k = 0; k < 7; ++k) {
      const auto& x = *other->linears()[7 * u + k]->base;
      const auto& y = *reference->linears()[7 * u + k]->base;
      if (std::memcmp(x.codes().data(), y.codes().data(), x.codes().bytes()) != 0 ||
          std::memcmp(x.nested_codes().data(), y.nested_codes().data(), x.nested_codes().bytes()) != 0 ||
          std::memcmp(x.nested_group_absmax().data(), y.nested_group_absmax().data(), x.nested_group_absmax().bytes()) != 0 ||
          std::memcmp(x.offset_view().data(), y.offset_view().data(), sizeof(float)) != 0)
        ++mismatches;
    }
    runtime.release(host, single_communicator{}, u);
  }
  CHECK(mismatches == 0);
  fs::remove(file);
}

TEST_CASE("stage3: ordered_reduce_scatter on one rank is a copy; sizes are checked") {
  std::vector<float> send{1.5f, -0.0f, 3.0f}, recv(3), staging(3);
  memkit::distributed::ordered_reduce_scatter(host, single_communicator{}, memkit::host_view(std::as_const(send)),
                                              memkit::host_view(recv), memkit::host_view(staging));
  CHECK(std::signbit(recv[1]));  // -0 stays -0: the first rank's value starts the sum, not 0.0
  CHECK(recv[2] == 3.0f);
  std::vector<float> short_staging(2);
  CHECK_THROWS_WITH_AS(memkit::distributed::ordered_reduce_scatter(host, single_communicator{}, memkit::host_view(std::as_const(send)),
                                                                   memkit::host_view(recv), memkit::host_view(short_staging)),
                       doctest::Contains("staging 2"), memkit::error);
}

TEST_CASE("stage3: misuse is a clear error") {
  using runtime_type = memkit::distributed::stage3_parameters<float>;
  const memkit::layers::memory_resources plain{};
  auto model = stage3_test::make_model(plain);
  runtime_type runtime(host, single_communicator{}, plain, llama::stage3_units(*model), stage3_test::adam_options(), 1);
  CHECK_THROWS_WITH_AS(runtime_type(host, single_communicator{}, plain, llama::stage3_units(*model), stage3_test::adam_options(), 1),
                       doctest::Contains("holds no values"), memkit::error);

  // A block run without its gather.
  std::vector<std::int32_t> ids, targets;
  stage3_test::micro_batch(0, 0, ids, targets);
  const memkit::shape dims{stage3_test::batch, stage3_test::sequence};
  float loss = 0;
  runtime.gather(host, single_communicator{}, runtime.unit_count() - 1, true);  // embedding and head only
  CHECK_THROWS_WITH_AS(model->forward_backward(host, memkit::host_view(std::as_const(ids).data(), dims),
                                               memkit::host_view(std::as_const(targets).data(), dims),
                                               memkit::host_view(&loss, memkit::shape{1}), memkit::default_host_resource()),
                       doctest::Contains("model.layers.0.input_layernorm.weight': its weight is not in memory"), memkit::error);
  runtime.release(host, single_communicator{}, runtime.unit_count() - 1);

  // One block at a time in slot 0; a unit gathered twice; a release without a gather; a step while gathered.
  runtime.gather(host, single_communicator{}, 0, false);
  CHECK_THROWS_WITH_AS(runtime.gather(host, single_communicator{}, 1, false), doctest::Contains("slot 0 holds unit 0"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(runtime.gather(host, single_communicator{}, 0, false), doctest::Contains("already gathered"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(runtime.step(host, single_communicator{}, stage3_test::groups()), doctest::Contains("still gathered"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(runtime.prefetch(host, single_communicator{}, 1), doctest::Contains("(1 buffer in the slot)"),
                       memkit::error);
  runtime.release(host, single_communicator{}, 0);
  CHECK_THROWS_WITH_AS(runtime.release(host, single_communicator{}, 0), doctest::Contains("not gathered"), memkit::error);
  runtime.prefetch(host, single_communicator{}, 1);
  CHECK(runtime.prefetched(1));
  CHECK_THROWS_WITH_AS(runtime.step(host, single_communicator{}, stage3_test::groups()), doctest::Contains("prefetched"),
                       memkit::error);
  runtime.gather(host, single_communicator{}, 1, false);
  runtime.release(host, single_communicator{}, 1);
  CHECK_THROWS_WITH_AS(runtime.step(host, single_communicator{}, stage3_test::groups()),
                       doctest::Contains("unit 0's gradients were not reduced since the last step"), memkit::error);
  CHECK_THROWS_WITH_AS(runtime.gather(host, single_communicator{}, 99, false), doctest::Contains("no unit 99"), memkit::error);

  // A communicator of another rank count than the shards'.
  struct two_ranks : single_communicator {
    static constexpr int size() noexcept { return 2; }
  };
  CHECK_THROWS_WITH_AS(runtime.gather(host, two_ranks{}, 0, false), doctest::Contains("the shards are rank 0 of 1"), memkit::error);
}
