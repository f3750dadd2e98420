// ZeRO stage 3 training of a small Llama decoder against one process, for any ordered communicator: the host
// suite runs it on one rank (single_communicator), tests/mpi on 2 and 3 MPI ranks.
//
// Each of N ranks trains on its own micro-batch (micro-batch r of step s), its blocks gathered and released
// around each forward and backward by the model's pass hooks, gradients reduced to their owners in rank order.
// Every rank also runs the reference itself: one whole model, micro-batches 0..N-1 one after the other (each
// backward from zeroed gradients), the gradients added in that order, one adam_state step with scale 1/N.
// Parameters (gathered after the last step) and each micro-batch's loss must agree bit for bit, and each
// rank's tracker must hold exactly what stage3_parameters::bytes_required predicts, category by category.
#pragma once

#include <doctest/doctest.h>

#include <memkit/distributed/consolidate.hpp>
#include <memkit/distributed/stage3.hpp>
#include <memkit/memory/tracking.hpp>
#include <memkit/io/safetensors.hpp>
#include <memkit/models/llama/load.hpp>
#include <memkit/models/llama/stage3.hpp>
#include <memkit/optim/adam_state.hpp>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace stage3_test {

namespace llama = memkit::models::llama;
using model_type = llama::causal_lm<float, memkit::layers::dense_linear<float>>;

inline llama::model_config config() {
  // qkv_bias: biases in the units too
  return {.vocab = 64, .hidden = 32, .layers = 3, .heads = 2, .kv_heads = 1, .head_dim = 16, .intermediate = 48,
          .max_positions = 16, .qkv_bias = true};
}
constexpr std::int64_t batch = 2, sequence = 8;

// The same initial values on every rank and in the reference (fp32 values train in place: no master).
inline void initialize(model_type& model) {
  std::uint64_t stream = 0;
  for (auto* p : model.shared_parameters())
    if (p->value.shape().rank == 2) p->init_normal(0.05f, 7, ++stream);
  for (auto* l : model.linears()) {
    l->weight.init_normal(0.05f, 7, ++stream);
    if (l->has_bias()) l->bias.init_normal(0.02f, 7, ++stream);
  }
}
inline std::unique_ptr<model_type> make_model(const memkit::layers::memory_resources& memory) {
  auto model = std::make_unique<model_type>(config(), memory, memkit::layers::trainability::bf16_master,
                                            [&](const llama::projection& p, std::int64_t, int) {
                                              return llama::make_dense_linear<float>(p, memory, memkit::layers::trainability::bf16_master);
                                            });
  initialize(*model);
  return model;
}

// Micro-batch `rank` of step `step`: token ids and their next-token targets.
inline void micro_batch(int step, int rank, std::vector<std::int32_t>& ids, std::vector<std::int32_t>& targets) {
  ids.assign(batch * sequence, 0);
  targets.assign(batch * sequence, 0);
  const auto token = [&](std::int64_t b, std::int64_t s) {
    const std::uint64_t h = memkit::detail::mix64((static_cast<std::uint64_t>(step) << 40) ^ (static_cast<std::uint64_t>(rank) << 24) ^
                                                  (static_cast<std::uint64_t>(b) << 12) ^ static_cast<std::uint64_t>(s));
    return static_cast<std::int32_t>(h % static_cast<std::uint64_t>(config().vocab));
  };
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s < sequence; ++s) {
      ids[static_cast<std::size_t>(b * sequence + s)] = token(b, s);
      targets[static_cast<std::size_t>(b * sequence + s)] = token(b, s + 1);
    }
}

inline const std::vector<memkit::optim::adam_group>& groups() {
  static const std::vector<memkit::optim::adam_group> g{{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.01f}};
  return g;
}
// max_grad_norm 0: no clipping; > 0: clipped by the global norm (one process's, bit for bit).
inline memkit::optim::adam_options adam_options(float max_grad_norm = 0.0f) {
  memkit::optim::adam_options o;
  o.max_grad_norm = max_grad_norm;
  o.host_threads = 1;
  return o;
}

struct outcome {
  int steps = 0;
  int param_mismatches = 0;  // elements of the gathered parameters that differ from the reference's
  int loss_mismatches = 0;   // this rank's micro-batch losses that differ from the reference's
  int changed = 0;           // elements that moved from their initial values (the test trains something)
  int optimizer_steps = 0;   // after a load and more steps: the step count the optimizer reached
  std::int64_t gathers = 0;  // the runtime's gathers (prefetches included)
  std::int64_t prefetches = 0;
  std::size_t predicted_weights = 0, predicted_gradients = 0, predicted_optimizer = 0;
  std::size_t peak_weights = 0, peak_gradients = 0, peak_optimizer = 0, current_total = 0;
  double grad_norm = 0.0, reference_grad_norm = 0.0;  // the last step's global norm: every unit's, the reference's
  int norm_disagreements = 0;                          // units whose last decision differs from unit 0's
  std::string first_problem;
};

template <class P>
bool same_bits(const P& a, const P& b) {
  return std::memcmp(&a, &b, sizeof(P)) == 0;
}

inline memkit::tensor_view<const std::int32_t> tokens_view(const std::vector<std::int32_t>& v) {
  return memkit::host_view(v.data(), memkit::shape{batch, sequence});
}

// The reference: one process, one whole model and one adam_state; step(s, N) runs micro-batches 0..N-1 of
// step s one after the other (each backward from zeroed gradients), adds their gradients in that order and
// steps with scale 1/N. Returns the micro-batches' losses.
struct reference_run {
  std::unique_ptr<model_type> model = make_model(memkit::layers::memory_resources{});
  std::vector<memkit::layers::basic_parameter<float>*> params;
  std::unique_ptr<memkit::optim::adam_state<float>> state;

  explicit reference_run(float max_grad_norm = 0.0f) {
    for (auto& u : llama::stage3_units(*model)) params.insert(params.end(), u.parameters.begin(), u.parameters.end());
    std::vector<std::int64_t> sizes;
    for (auto* p : params) sizes.push_back(p->size());
    state = std::make_unique<memkit::optim::adam_state<float>>(memkit::host, memkit::default_host_resource(), sizes,
                                                                adam_options(max_grad_norm));
  }
  std::vector<float> step(int s, int N) {
    std::vector<std::int32_t> ids, targets;
    std::vector<float> losses;
    float loss = 0.0f;
    std::vector<std::vector<float>> sum(params.size());
    for (int r = 0; r < N; ++r) {
      for (auto* p : params) p->zero_grad();
      micro_batch(s, r, ids, targets);
      model->forward_backward(memkit::host, tokens_view(ids), tokens_view(targets), memkit::host_view(&loss, memkit::shape{1}),
                              memkit::default_host_resource());
      losses.push_back(loss);
      for (std::size_t i = 0; i < params.size(); ++i) {
        const std::vector<float> g = memkit::layers::copy_out(std::as_const(params[i]->grad).view());
        if (r == 0) sum[i] = g;
        else
          for (std::size_t j = 0; j < g.size(); ++j) sum[i][j] += g[j];
      }
    }
    std::vector<memkit::optim::adam_param<float, float>> list;
    for (std::size_t i = 0; i < params.size(); ++i)
      list.push_back({params[i]->value.view(), memkit::host_view(std::as_const(sum[i]).data(), params[i]->value.shape()),
                      memkit::tensor_view<float>(), 0});
    state->step(memkit::host, list, groups(), 1.0f / static_cast<float>(N));
    return losses;
  }
};

// Elements of the stage-3 model (every unit gathered in turn) whose bits differ from the reference's.
template <class C, class Runtime>
int count_mismatches(const C& comm, Runtime& runtime, model_type& model, const reference_run& reference, std::string& first) {
  const auto units = llama::stage3_units(model);
  std::size_t flat_index = 0;
  int mismatches = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    runtime.gather(memkit::host, comm, u, false);
    for (auto* p : units[u].parameters) {
      const std::vector<float> mine = memkit::layers::copy_out(std::as_const(p->value).view());
      const std::vector<float> theirs = memkit::layers::copy_out(std::as_const(reference.params[flat_index]->value).view());
      for (std::size_t j = 0; j < mine.size(); ++j)
        if (!same_bits(mine[j], theirs[j]) && mismatches++ == 0 && first.empty())
          first = "'" + p->name + "' element " + std::to_string(j) + ": " + std::to_string(mine[j]) + ", the reference's " +
                  std::to_string(theirs[j]);
      ++flat_index;
    }
    runtime.release(memkit::host, comm, u);
  }
  return mismatches;
}

// The forward and backward of this rank's micro-batch of step s under stage 3 (gradients reduced to their
// owners); returns its loss.
template <class C, class Runtime>
float stage3_pass(const C& comm, Runtime& runtime, model_type& model, int s, bool prefetch = false) {
  std::vector<std::int32_t> ids, targets;
  float loss = 0.0f;
  micro_batch(s, comm.rank(), ids, targets);
  llama::stage3_pass_hooks hooks{memkit::host, comm, runtime, prefetch ? &memkit::host : nullptr};
  model.forward_backward(memkit::host, tokens_view(ids), tokens_view(targets), memkit::host_view(&loss, memkit::shape{1}),
                         memkit::default_host_resource(), {}, hooks);
  return loss;
}
// One stage-3 step of this rank's micro-batch; returns its loss.
template <class C, class Runtime>
float stage3_step(const C& comm, Runtime& runtime, model_type& model, int s, bool prefetch = false) {
  const float loss = stage3_pass(comm, runtime, model, s, prefetch);
  runtime.step(memkit::host, comm, groups(), 1.0f / static_cast<float>(comm.size()));
  return loss;
}

// A non-finite gradient on one rank: one good step, then a pass whose reduced gradient slice of unit `unit` on
// rank `bad_rank` gets a NaN in its first real element (what a corrupt micro-batch leaves its owner), and a step.
struct skip_outcome {
  int applied_units = 0;    // units whose last step applied (0 expected: every unit skips)
  int skipped_units = 0;    // units that count one skipped step
  int changed = 0;          // parameter-slice elements the skipped step changed (0 expected)
  int nan_placed = 0;       // 1 on the rank that wrote the NaN
};
template <class C>
skip_outcome run_nonfinite(const C& comm, int bad_rank, std::size_t unit) {
  using runtime_type = memkit::distributed::stage3_parameters<float>;
  skip_outcome out;
  const memkit::layers::memory_resources plain{};
  auto model = make_model(plain);
  runtime_type runtime(memkit::host, comm, plain, llama::stage3_units(*model), adam_options(1.0f), 0x5746);
  stage3_step(comm, runtime, *model, 0);
  stage3_pass(comm, runtime, *model, 1);
  if (comm.rank() == bad_rank) {
    const auto& state = runtime.optimizer(unit);
    if (!state.pieces().empty()) {
      const auto& piece = state.pieces().front();
      const auto slice = runtime.grad_shard(unit);
      const_cast<float*>(slice.data())[piece.flat + piece.begin - state.shard_begin()] = std::numeric_limits<float>::quiet_NaN();
      out.nan_placed = 1;
    }
  }
  std::vector<std::vector<float>> before;
  for (std::size_t u = 0; u < runtime.unit_count(); ++u) before.push_back(memkit::layers::copy_out(runtime.param_shard(u)));
  runtime.step(memkit::host, comm, groups(), 1.0f / static_cast<float>(comm.size()));
  for (std::size_t u = 0; u < runtime.unit_count(); ++u) {
    const auto c = runtime.optimizer(u).control(memkit::host);
    out.applied_units += c.applied;
    out.skipped_units += c.skipped_steps == 1 ? 1 : 0;
    const std::vector<float> now = memkit::layers::copy_out(runtime.param_shard(u));
    for (std::size_t j = 0; j < now.size(); ++j) out.changed += same_bits(now[j], before[u][j]) ? 0 : 1;
  }
  return out;
}

// Re-sharding: `steps` steps on the ranks of `comm`, then each rank's file at path(rank).
template <class C>
void train_and_save(const C& comm, int steps, const std::string& path) {
  auto model = make_model(memkit::layers::memory_resources{});
  memkit::distributed::stage3_parameters<float> runtime(memkit::host, comm, memkit::layers::memory_resources{},
                                                        llama::stage3_units(*model), adam_options(), 0x5745);
  for (int s = 0; s < steps; ++s) stage3_step(comm, runtime, *model, s);
  memkit::safetensors::writer out;
  runtime.save(memkit::host, out);
  out.write(path);
}
// The rank files of a stage-3 save (`ranks` ranks, `steps` steps), consolidated into `dir`/model.safetensors,
// against the one-process reference's trainable tensors written whole under their names, in the units' order,
// with transformers' {"format": "pt"} into `dir`/expected.safetensors. Returns the first difference, or "".
inline std::string consolidated_export_problem(const std::vector<std::string>& files, int steps, const std::string& dir) {
  reference_run reference;
  for (int s = 0; s < steps; ++s) reference.step(s, static_cast<int>(files.size()));
  memkit::safetensors::writer expected;
  expected.add_metadata("format", "pt");
  for (auto* p : reference.params) expected.add(p->name, std::as_const(p->value).view());
  expected.write(dir + "/expected.safetensors");
  std::vector<memkit::safetensors::reader> readers;
  for (std::size_t r = files.size(); r-- > 0;) readers.emplace_back(files[r]);  // any order
  std::vector<const memkit::safetensors::reader*> images;
  for (const auto& reader : readers) images.push_back(&reader);
  const auto report = memkit::distributed::export_consolidated(images, dir + "/model.safetensors", memkit::distributed::consolidate_options{},
                                                               memkit::default_host_resource());
  if (report.tensors != reference.params.size())
    return std::to_string(report.tensors) + " tensors exported, the model has " + std::to_string(reference.params.size());
  const auto slurp = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  const std::string mine = slurp(dir + "/model.safetensors"), theirs = slurp(dir + "/expected.safetensors");
  if (mine.size() != theirs.size()) return "sizes " + std::to_string(mine.size()) + " and " + std::to_string(theirs.size());
  for (std::size_t i = 0; i < mine.size(); ++i)
    if (mine[i] != theirs[i]) return "the files differ first at byte " + std::to_string(i);
  return {};
}

// ... and on the ranks of `comm` (any count): load the files of all `old_ranks` ranks, go on `steps` steps,
// and compare with the reference trained `steps` steps on old_ranks micro-batches and `steps` on comm.size().
template <class C>
outcome load_and_continue(const C& comm, const std::vector<std::string>& files, int old_ranks, int steps) {
  outcome out;
  reference_run reference;
  for (int s = 0; s < steps; ++s) reference.step(s, old_ranks);
  auto model = make_model(memkit::layers::memory_resources{});
  memkit::distributed::stage3_parameters<float> runtime(memkit::host, comm, memkit::layers::memory_resources{},
                                                        llama::stage3_units(*model), adam_options(), 0x5745);
  std::vector<memkit::safetensors::reader> readers;
  for (auto it = files.rbegin(); it != files.rend(); ++it) readers.emplace_back(*it);  // any order
  std::vector<const memkit::safetensors::reader*> images;
  for (const auto& r : readers) images.push_back(&r);
  runtime.load(memkit::host, images);
  for (int s = steps; s < 2 * steps; ++s) {
    const float theirs = reference.step(s, comm.size())[static_cast<std::size_t>(comm.rank())];
    const float mine = stage3_step(comm, runtime, *model, s);
    if (!same_bits(mine, theirs)) ++out.loss_mismatches;
    ++out.steps;
  }
  out.param_mismatches = count_mismatches(comm, runtime, *model, reference, out.first_problem);
  out.optimizer_steps = static_cast<int>(runtime.optimizer(0).control(memkit::host).step);
  return out;
}

// prefetch: two buffers in slot 0, and each block's gather starts the next one's (on the host: done at once).
template <class C>
outcome run(const C& comm, int steps, bool prefetch = false, float max_grad_norm = 0.0f) {
  using runtime_type = memkit::distributed::stage3_parameters<float>;
  const int N = comm.size(), rank = comm.rank();
  outcome out;
  reference_run reference(max_grad_norm);

  // Stage 3 on this rank; its tracker sees what the runtime allocates (the whole model it starts from is not).
  auto model = make_model(memkit::layers::memory_resources{});
  std::vector<std::vector<float>> initial;
  for (auto& u : llama::stage3_units(*model))
    for (auto* p : u.parameters) initial.push_back(memkit::layers::copy_out(std::as_const(p->value).view()));
  memkit::tracking_resource tracker(memkit::default_host_resource());
  memkit::layers::memory_resources tracked;
  tracked.weights = &tracker.category(memkit::memory_category::weights);
  tracked.gradients = &tracker.category(memkit::memory_category::gradients);
  tracked.optimizer = &tracker.category(memkit::memory_category::optimizer_state);
  const auto shapes = llama::stage3_unit_shapes<float>(config(), memkit::layers::trainability::bf16_master);
  const std::vector<int> buffers = prefetch ? std::vector<int>{2} : std::vector<int>{};
  const memkit::distributed::stage3_bytes predicted =
      runtime_type::bytes_required(shapes, rank, N, adam_options(max_grad_norm), buffers);
  runtime_type runtime(memkit::host, comm, tracked, llama::stage3_units(*model), adam_options(max_grad_norm), 0x5743, buffers);

  for (int s = 0; s < steps; ++s) {
    const float theirs = reference.step(s, N)[static_cast<std::size_t>(rank)];
    const float mine = stage3_step(comm, runtime, *model, s, prefetch);
    if (!same_bits(mine, theirs)) {
      ++out.loss_mismatches;
      if (out.first_problem.empty())
        out.first_problem = "step " + std::to_string(s) + ": loss " + std::to_string(mine) + ", the reference's " + std::to_string(theirs);
    }
    ++out.steps;
  }
  out.param_mismatches = count_mismatches(comm, runtime, *model, reference, out.first_problem);
  const auto units = llama::stage3_units(*model);
  std::size_t flat_index = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {  // the test trains something: elements moved
    runtime.gather(memkit::host, comm, u, false);
    for (auto* p : units[u].parameters) {
      const std::vector<float> now = memkit::layers::copy_out(std::as_const(p->value).view());
      for (std::size_t j = 0; j < now.size(); ++j) out.changed += same_bits(now[j], initial[flat_index][j]) ? 0 : 1;
      ++flat_index;
    }
    runtime.release(memkit::host, comm, u);
  }
  out.predicted_weights = predicted.weights;
  out.predicted_gradients = predicted.gradients;
  out.predicted_optimizer = predicted.optimizer_state;
  out.peak_weights = tracker.stats(memkit::memory_category::weights).peak_bytes;
  out.peak_gradients = tracker.stats(memkit::memory_category::gradients).peak_bytes;
  out.peak_optimizer = tracker.stats(memkit::memory_category::optimizer_state).peak_bytes;
  out.current_total = tracker.current_bytes();
  out.gathers = runtime.gathers();
  out.prefetches = runtime.prefetches();
  out.grad_norm = runtime.optimizer(0).control(memkit::host).grad_norm;
  out.reference_grad_norm = reference.state->control(memkit::host).grad_norm;
  for (std::size_t u = 0; u < runtime.unit_count(); ++u) {
    const auto c = runtime.optimizer(u).control(memkit::host);
    if (!same_bits(c.grad_norm, out.grad_norm) || !same_bits(c.grad_multiplier, runtime.optimizer(0).control(memkit::host).grad_multiplier) ||
        c.applied != runtime.optimizer(0).control(memkit::host).applied)
      ++out.norm_disagreements;
  }
  return out;
}

// ---- QLoRA: frozen NF4 bases sharded and gathered per block, replicated LoRA adapters ----

using qlora_model = llama::causal_lm<float, llama::nf4_lora_linear<float>>;

inline llama::model_config qlora_config() {
  llama::model_config c = config();
  c.hidden = 64;
  c.heads = 4;
  c.kv_heads = 2;
  c.intermediate = 192;  // gate/up/down: 12288 elements, split across ranks (a unit is 32 * 256 elements)
  c.qkv_bias = true;
  return c;
}
inline llama::lora_load_options qlora_options() {
  llama::lora_load_options o;
  o.lora.rank = 4;
  o.lora.alpha = 8.0;
  o.lora.init_seed = 11;
  o.quant = memkit::quant::quant_options{32, true};  // double quantization, as QLoRA
  return o;
}
// The same whole model on every rank and in the reference: weights from a hash of their names.
inline std::unique_ptr<qlora_model> make_qlora_model(const memkit::layers::memory_resources& memory) {
  const auto fill = [](const std::string& name, memkit::tensor_view<float> to) {
    std::uint64_t stream = 1469598103934665603ull;  // FNV-1a of the name
    for (char ch : name) stream = (stream ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
    const bool norm = name.find("norm") != std::string::npos;
    std::vector<float> values(static_cast<std::size_t>(to.size()));
    for (std::size_t j = 0; j < values.size(); ++j)
      values[j] = norm ? 1.0f : 0.2f * (memkit::unit_float(memkit::random_word(3, stream, j)) - 0.5f);
    memkit::layers::copy_in(values.data(), to);
  };
  return llama::build_lora_causal_lm<float, memkit::quant::quantized_tensor<memkit::quant::NF4>>(memkit::host, qlora_config(), memory,
                                                                                                   qlora_options(), fill);
}

struct qlora_outcome {
  int steps = 0;
  int adapter_mismatches = 0;  // adapter elements that differ from the reference's
  int loss_mismatches = 0;
  int base_mismatches = 0;     // gathered NF4 bases (codes, nested codes, group scales, offset) unlike the reference's
  int changed = 0;             // adapter elements that moved
  std::size_t predicted_weights = 0, predicted_workspace = 0, peak_weights = 0, peak_workspace = 0, peak_gradients = 0,
              peak_optimizer = 0;
  std::string first_problem;
};

template <class C>
qlora_outcome run_qlora(const C& comm, int steps) {
  using runtime_type = memkit::distributed::stage3_parameters<float>;
  const int N = comm.size(), rank = comm.rank();
  qlora_outcome out;
  const memkit::layers::memory_resources plain{};

  struct adapter {
    memkit::tensor_view<float> value;
    memkit::tensor_view<float> grad;
  };
  const auto adapters_of = [](qlora_model& m) {
    std::vector<adapter> list;
    for (auto* l : m.linears())
      if (l->adapted()) {
        list.push_back({l->lora_A(), l->grad_A()});
        list.push_back({l->lora_B(), l->grad_B()});
      }
    return list;
  };
  auto reference = make_qlora_model(plain);
  const std::vector<adapter> ref_adapters = adapters_of(*reference);
  std::vector<std::int64_t> sizes;
  for (const adapter& a : ref_adapters) sizes.push_back(a.value.size());
  memkit::optim::adam_state<float> reference_state(memkit::host, memkit::default_host_resource(), sizes, adam_options());

  auto model = make_qlora_model(plain);
  const std::vector<adapter> adapters = adapters_of(*model);
  std::vector<std::vector<float>> initial;
  for (const adapter& a : adapters) initial.push_back(memkit::layers::copy_out(memkit::tensor_view<const float>(a.value)));
  memkit::optim::adam_state<float> state(memkit::host, memkit::default_host_resource(), sizes, adam_options());  // replicated

  memkit::tracking_resource tracker(memkit::default_host_resource());
  memkit::layers::memory_resources tracked;
  tracked.weights = &tracker.category(memkit::memory_category::weights);
  tracked.gradients = &tracker.category(memkit::memory_category::gradients);
  tracked.optimizer = &tracker.category(memkit::memory_category::optimizer_state);
  tracked.workspace = &tracker.category(memkit::memory_category::workspace);
  const memkit::quant::quant_options nf4 = qlora_options().quant;
  const auto shapes = llama::stage3_unit_shapes<float>(qlora_config(), memkit::layers::trainability::frozen, &nf4);
  out.predicted_weights = runtime_type::bytes_required(shapes, rank, N, adam_options()).total();
  out.predicted_workspace = std::max(runtime_type::gather_workspace_bytes(shapes, N), llama::adapter_all_reduce_workspace_bytes(*model, N));
  runtime_type runtime(memkit::host, comm, tracked, llama::stage3_units(*model), adam_options(), 0x5744);

  std::vector<std::int32_t> ids, targets;
  float loss = 0.0f;
  const auto view_of = [](std::vector<std::int32_t>& v) {
    return memkit::host_view(static_cast<const std::int32_t*>(v.data()), memkit::shape{batch, sequence});
  };
  const auto same_loss = [&](int s, float mine, float theirs) {
    if (same_bits(mine, theirs)) return;
    if (out.loss_mismatches++ == 0 && out.first_problem.empty())
      out.first_problem = "step " + std::to_string(s) + ": loss " + std::to_string(mine) + ", the reference's " + std::to_string(theirs);
  };
  for (int s = 0; s < steps; ++s) {
    std::vector<std::vector<float>> sum(ref_adapters.size());
    float my_reference_loss = 0.0f;
    for (int r = 0; r < N; ++r) {
      for (auto* l : reference->linears()) l->zero_grad();
      micro_batch(s, r, ids, targets);
      reference->forward_backward(memkit::host, view_of(ids), view_of(targets), memkit::host_view(&loss, memkit::shape{1}),
                                  memkit::default_host_resource());
      if (r == rank) my_reference_loss = loss;
      for (std::size_t i = 0; i < ref_adapters.size(); ++i) {
        const std::vector<float> g = memkit::layers::copy_out(memkit::tensor_view<const float>(ref_adapters[i].grad));
        if (r == 0) sum[i] = g;
        else
          for (std::size_t j = 0; j < g.size(); ++j) sum[i][j] += g[j];
      }
    }
    std::vector<memkit::optim::adam_param<float, float>> params;
    for (std::size_t i = 0; i < ref_adapters.size(); ++i)
      params.push_back({ref_adapters[i].value, memkit::host_view(std::as_const(sum[i]).data(), ref_adapters[i].value.shape()),
                        memkit::tensor_view<float>(), 0});
    reference_state.step(memkit::host, params, groups(), 1.0f / static_cast<float>(N));

    for (auto* l : model->linears()) l->zero_grad();
    micro_batch(s, rank, ids, targets);
    llama::stage3_pass_hooks hooks{memkit::host, comm, runtime};
    model->forward_backward(memkit::host, view_of(ids), view_of(targets), memkit::host_view(&loss, memkit::shape{1}),
                            memkit::default_host_resource(), {}, hooks);
    same_loss(s, loss, my_reference_loss);
    llama::all_reduce_adapter_gradients(memkit::host, comm, *model, *tracked.workspace);
    std::vector<memkit::optim::adam_param<float, float>> mine;
    for (const adapter& a : adapters) mine.push_back({a.value, memkit::tensor_view<const float>(a.grad), memkit::tensor_view<float>(), 0});
    state.step(memkit::host, mine, groups(), 1.0f / static_cast<float>(N));
    runtime.step(memkit::host, comm, groups());  // no dense parameters: checks that every unit is released
    ++out.steps;
  }
  for (std::size_t i = 0; i < adapters.size(); ++i) {
    const auto mine = memkit::layers::copy_out(memkit::tensor_view<const float>(adapters[i].value));
    const auto theirs = memkit::layers::copy_out(memkit::tensor_view<const float>(ref_adapters[i].value));
    for (std::size_t j = 0; j < mine.size(); ++j) {
      if (!same_bits(mine[j], theirs[j]) && out.adapter_mismatches++ == 0 && out.first_problem.empty())
        out.first_problem = "adapter tensor " + std::to_string(i) + " element " + std::to_string(j) + " differs";
      if (!same_bits(mine[j], initial[i][j])) ++out.changed;
    }
  }
  // The gathered bases equal the reference's, bit for bit.
  const auto same_view = [](auto a, auto b) {
    return a.bytes() == b.bytes() && (a.bytes() == 0 || std::memcmp(a.data(), b.data(), a.bytes()) == 0);
  };
  for (std::size_t u = 0; u + 1 < runtime.unit_count(); ++u) {
    runtime.gather(memkit::host, comm, u, false);
    auto& b = model->blocks[u];
    auto& rb = reference->blocks[u];
    const llama::nf4_lora_linear<float>* mine[] = {&b.q, &b.k, &b.v, &b.o, &b.gate, &b.up, &b.down};
    const llama::nf4_lora_linear<float>* theirs[] = {&rb.q, &rb.k, &rb.v, &rb.o, &rb.gate, &rb.up, &rb.down};
    for (int k = 0; k < 7; ++k) {
      const auto& x = *mine[k]->base;
      const auto& y = *theirs[k]->base;
      if (!same_view(x.codes(), y.codes()) || !same_view(x.nested_codes(), y.nested_codes()) ||
          !same_view(x.nested_group_absmax(), y.nested_group_absmax()) || !same_view(x.offset_view(), y.offset_view()))
        ++out.base_mismatches;
    }
    runtime.release(memkit::host, comm, u);
  }
  out.peak_weights = tracker.stats(memkit::memory_category::weights).peak_bytes;
  out.peak_workspace = tracker.stats(memkit::memory_category::workspace).peak_bytes;
  out.peak_gradients = tracker.stats(memkit::memory_category::gradients).peak_bytes;
  out.peak_optimizer = tracker.stats(memkit::memory_category::optimizer_state).peak_bytes;
  return out;
}

// What every stage-3 run must show against the one-process reference, for the host and MPI suites alike (doctest
// assertions: call them on the test's thread, after the ranks have finished).
inline void check_like_one_process(const outcome& out, int steps) {
  INFO(out.first_problem);
  CHECK(out.steps == steps);
  CHECK(out.loss_mismatches == 0);
  CHECK(out.param_mismatches == 0);
  CHECK(out.changed > 1000);
  CHECK(out.peak_weights == out.predicted_weights);
  CHECK(out.peak_gradients == out.predicted_gradients);
  CHECK(out.peak_optimizer == out.predicted_optimizer);
  CHECK(out.current_total == out.predicted_weights + out.predicted_gradients + out.predicted_optimizer);
}
inline void check_like_one_process(const qlora_outcome& out, int steps) {
  INFO(out.first_problem);
  CHECK(out.steps == steps);
  CHECK(out.loss_mismatches == 0);
  CHECK(out.adapter_mismatches == 0);
  CHECK(out.base_mismatches == 0);
  CHECK(out.changed > 1000);
  CHECK(out.peak_weights == out.predicted_weights);
  CHECK(out.peak_workspace == out.predicted_workspace);
  CHECK(out.peak_gradients == 0);  // the bases are frozen; the adapters' tensors are not stage 3's
  CHECK(out.peak_optimizer == 0);
}

}  // namespace stage3_test
