// memkit/models/llama over packed documents (forward_context::document_offsets): a packed row gives each document
// the hidden states, loss and gradients it gets run alone (rotary positions restart per document, attention stays
// inside it; sliding window, qk-norm and biased families), one document per row is bit-identical to no offsets, the
// targets of packed rows never cross a document, and the block's saved bytes include the offsets it keeps.
#include <memkit/layers/parameters.hpp>
#include <memkit/models/llama/load.hpp>
#include <memkit/models/tokens.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace llama = memkit::models::llama;

namespace {

using memkit::shape;

const std::string models_dir = std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/models/";
constexpr std::int64_t batch = 2, seq = 16;
// Row 0: documents of 5, 1 and 10 tokens; row 1: 9 and 7 tokens.
const std::vector<std::int32_t> offsets{0, 5, 6, 16, /**/ 0, 9, 16, 16};
constexpr std::int64_t offsets_per_row = 4;

memkit::layers::memory_resources host_memory() {
  memkit::layers::memory_resources m;
  m.weights = m.gradients = m.optimizer = m.workspace = &memkit::default_host_resource();
  m.host_threads = 2;
  return m;
}

using model_ptr = std::unique_ptr<llama::causal_lm<float, memkit::layers::dense_linear<float>>>;

model_ptr load(const std::string& family) {
  llama::hf_checkpoint ckpt(models_dir + family, seq);
  return llama::load_causal_lm<float>(ckpt, host_memory(), memkit::layers::trainability::bf16_master);
}

// Ids [batch, seq]: a fixed pattern inside the model's vocabulary.
std::vector<std::int32_t> some_ids(std::int64_t vocab) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(batch * seq));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 37 + 11) % static_cast<std::size_t>(vocab));
  return ids;
}

struct pass_result {
  float loss = 0;
  std::vector<std::vector<float>> grads;  // every trainable gradient, in registration order
};

// One forward_backward with zeroed gradients before it; the gradients read back after.
pass_result train_pass(llama::causal_lm<float, memkit::layers::dense_linear<float>>& model,
                       const std::vector<std::int32_t>& ids, const std::vector<std::int32_t>& targets, std::int64_t rows,
                       std::int64_t length, const std::vector<std::int32_t>& docs) {
  memkit::layers::parameter_registry<float> registry;
  model.register_parameters(registry);
  memkit::layers::zero_grad(memkit::host, registry);
  pass_result r;
  const memkit::tensor_view<const std::int32_t> doc_view =
      docs.empty() ? memkit::tensor_view<const std::int32_t>::none()
                   : memkit::host_view(docs.data(), shape{rows, static_cast<std::int64_t>(docs.size()) / rows});
  model.forward_backward(memkit::host, memkit::host_view(ids.data(), shape{rows, length}),
                         memkit::host_view(targets.data(), shape{rows, length}), memkit::host_view(&r.loss, shape{1}),
                         memkit::default_host_resource(), {}, doc_view);
  for (const auto& e : registry.entries()) r.grads.emplace_back(e.grad.begin(), e.grad.end());
  return r;
}

}  // namespace

TEST_CASE("models packed: next-token targets stop at each document's last token") {
  const std::vector<std::int32_t> ids{10, 11, 12, 13, 14, 15, /**/ 20, 21, 22, 23, 24, 25};
  const std::vector<std::int32_t> docs{0, 2, 3, 6, /**/ 0, 6, 6, 6};
  const std::vector<std::int32_t> targets = memkit::models::packed_next_token_targets(ids, docs, 2, 6);
  CHECK(targets == std::vector<std::int32_t>{11, -100, -100, 14, 15, -100, /**/ 21, 22, 23, 24, 25, -100});
  CHECK_THROWS_WITH_AS(memkit::models::packed_next_token_targets(ids, {0, 4, 3, 6, 0, 6, 6, 6}, 2, 6),
                       doctest::Contains("must not decrease"), memkit::error);
}

TEST_CASE("models packed: pack_documents fills rows in order, cuts long documents, pads the tails") {
  const std::vector<std::vector<std::int32_t>> docs{{1, 2, 3}, {4}, {5, 6, 7, 8, 9, 10, 11, 12}, {}, {13, 14}, {15, 16, 17}};
  const memkit::models::packed_rows p = memkit::models::pack_documents(docs, 2, 6, 0);
  // Row 0: [1 2 3][4] + 2 padding; row 1: [5..10] (cut to 6); {} counts; {13 14} fits no row left: stop.
  CHECK(p.ids == std::vector<std::int32_t>{1, 2, 3, 4, 0, 0, /**/ 5, 6, 7, 8, 9, 10});
  CHECK(p.offsets_per_row == 4);
  CHECK(p.offsets == std::vector<std::int32_t>{0, 3, 4, 6, /**/ 0, 6, 6, 6});
  CHECK(p.targets == std::vector<std::int32_t>{2, 3, -100, -100, -100, -100, /**/ 6, 7, 8, 9, 10, -100});
  CHECK(p.documents == 4);
  // A fixed layout of 3 offsets a row: at most two documents, padding included, so {4} starts row 1.
  const memkit::models::packed_rows fixed = memkit::models::pack_documents(docs, 3, 6, 0, -100, 3);
  CHECK(fixed.ids == std::vector<std::int32_t>{1, 2, 3, 0, 0, 0, /**/ 4, 0, 0, 0, 0, 0, /**/ 5, 6, 7, 8, 9, 10});
  CHECK(fixed.offsets == std::vector<std::int32_t>{0, 3, 6, /**/ 0, 1, 6, /**/ 0, 6, 6});
  CHECK(fixed.targets == std::vector<std::int32_t>{2, 3, -100, -100, -100, -100, /**/ -100, -100, -100, -100, -100, -100,
                                                   /**/ 6, 7, 8, 9, 10, -100});
  CHECK(fixed.documents == 4);
  // Every row's offsets are valid for attention and the targets never cross a document.
  memkit::attention::check_document_offsets(memkit::host_view(fixed.offsets.data(), shape{3, 3}), 3, 6);
  CHECK_THROWS_WITH_AS(memkit::models::pack_documents(docs, 1, 6, 0, -100, 1), doctest::Contains("offsets_per_row"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(memkit::models::pack_documents(docs, 0, 6), doctest::Contains("rows and row_length"), memkit::error);
}

TEST_CASE("models packed: a packed row gives each document its own hidden states, loss and gradients") {
  for (const char* family : {"llama_llama3_bias", "mistral_window", "qwen3_qknorm"}) {
    CAPTURE(family);
    model_ptr model = load(family);
    const std::int64_t H = model->config.hidden;
    const std::vector<std::int32_t> ids = some_ids(model->config.vocab);
    const std::vector<std::int32_t> targets = memkit::models::packed_next_token_targets(ids, offsets, batch, seq);

    // Hidden states: the packed rows against each document alone.
    std::vector<float> packed_hidden(static_cast<std::size_t>(batch * seq * H));
    model->forward_hidden(memkit::host, memkit::host_view(ids.data(), shape{batch, seq}),
                          memkit::host_view(packed_hidden.data(), shape{batch, seq, H}), memkit::default_host_resource(),
                          memkit::host_view(offsets.data(), shape{batch, offsets_per_row}));
    double hidden_error = 0, hidden_largest = 0;
    // The packed pass's gradients against the documents' passes weighted by their share of the counted tokens
    // (the loss is the mean over counted tokens, of a row and of a document).
    const pass_result packed = train_pass(*model, ids, targets, batch, seq, offsets);
    std::vector<std::vector<float>> combined;
    for (const auto& g : packed.grads) combined.emplace_back(g.size(), 0.0f);
    double combined_loss = 0;
    std::int64_t counted = 0;
    for (std::int32_t t : targets) counted += t != -100;
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t d = 0; d + 1 < offsets_per_row; ++d) {
        const std::int64_t begin = offsets[static_cast<std::size_t>(b * offsets_per_row + d)];
        const std::int64_t length = offsets[static_cast<std::size_t>(b * offsets_per_row + d + 1)] - begin;
        if (length == 0) continue;
        const auto first = ids.begin() + b * seq + begin;
        const std::vector<std::int32_t> doc_ids(first, first + length);
        std::vector<float> hidden(static_cast<std::size_t>(length * H));
        model->forward_hidden(memkit::host, memkit::host_view(doc_ids.data(), shape{1, length}),
                              memkit::host_view(hidden.data(), shape{1, length, H}), memkit::default_host_resource());
        for (std::int64_t e = 0; e < length * H; ++e) {
          const double alone = hidden[static_cast<std::size_t>(e)];
          hidden_error = std::max(hidden_error,
                                  std::abs(packed_hidden[static_cast<std::size_t>((b * seq + begin) * H + e)] - alone));
          hidden_largest = std::max(hidden_largest, std::abs(alone));
        }
        const std::vector<std::int32_t> doc_targets = memkit::models::packed_next_token_targets(
            doc_ids, {0, static_cast<std::int32_t>(length)}, 1, length);
        std::int64_t doc_counted = 0;
        for (std::int32_t t : doc_targets) doc_counted += t != -100;
        if (doc_counted == 0) continue;  // a 1-token document adds nothing to the loss
        const pass_result alone = train_pass(*model, doc_ids, doc_targets, 1, length, {});
        const double share = static_cast<double>(doc_counted) / static_cast<double>(counted);
        combined_loss += share * alone.loss;
        for (std::size_t p = 0; p < combined.size(); ++p)
          for (std::size_t i = 0; i < combined[p].size(); ++i)
            combined[p][i] += static_cast<float>(share * alone.grads[p][i]);
      }
    // fp32: the same math in another summation order (the linears' and the loss's sums over tokens, the head's
    // gradient over chunks), so the errors are fp32 rounding relative to each tensor's scale.
    std::printf("models packed %s: hidden %.3g (of %.3g), loss %.8g vs %.8g\n", family, hidden_error, hidden_largest,
                static_cast<double>(packed.loss), combined_loss);
    CHECK(hidden_error <= 1e-5 * hidden_largest);
    CHECK(std::abs(packed.loss - combined_loss) <= 1e-5 * std::abs(combined_loss));
    double worst = 0;
    for (std::size_t p = 0; p < combined.size(); ++p) {
      double error = 0, largest = 1e-30;
      for (std::size_t i = 0; i < combined[p].size(); ++i) {
        error = std::max(error, std::abs(double(packed.grads[p][i]) - double(combined[p][i])));
        largest = std::max(largest, std::abs(double(combined[p][i])));
      }
      CAPTURE(p);
      CHECK(error <= 1e-4 * largest);
      worst = std::max(worst, error / largest);
    }
    std::printf("models packed %s: worst gradient error %.3g of its tensor's largest value\n", family, worst);
  }
}

TEST_CASE("models packed: without the offsets the packed row is one sequence (the test can fail)") {
  model_ptr model = load("llama_llama3_bias");
  const std::vector<std::int32_t> ids = some_ids(model->config.vocab);
  const std::int64_t H = model->config.hidden;
  std::vector<float> with(static_cast<std::size_t>(batch * seq * H)), without(with.size());
  model->forward_hidden(memkit::host, memkit::host_view(ids.data(), shape{batch, seq}),
                        memkit::host_view(with.data(), shape{batch, seq, H}), memkit::default_host_resource(),
                        memkit::host_view(offsets.data(), shape{batch, offsets_per_row}));
  model->forward_hidden(memkit::host, memkit::host_view(ids.data(), shape{batch, seq}),
                        memkit::host_view(without.data(), shape{batch, seq, H}), memkit::default_host_resource());
  // Row 0's first document is its prefix, so identical; its second document (from 5) is not.
  CHECK(std::memcmp(with.data(), without.data(), static_cast<std::size_t>(5 * H) * sizeof(float)) == 0);
  double difference = 0;
  for (std::int64_t e = 5 * H; e < 16 * H; ++e)
    difference = std::max<double>(difference, std::abs(with[static_cast<std::size_t>(e)] - without[static_cast<std::size_t>(e)]));
  CHECK(difference > 1e-3);
}

TEST_CASE("models packed: one document per row is bit-identical to no offsets; the block saves the offsets it keeps") {
  model_ptr model = load("mistral_window");
  const std::vector<std::int32_t> ids = some_ids(model->config.vocab);
  const std::vector<std::int32_t> whole{0, seq, 0, seq};
  const std::vector<std::int32_t> targets = memkit::models::packed_next_token_targets(ids, whole, batch, seq);
  const pass_result plain = train_pass(*model, ids, targets, batch, seq, {});
  const pass_result one = train_pass(*model, ids, targets, batch, seq, whole);
  CHECK(std::memcmp(&plain.loss, &one.loss, sizeof(float)) == 0);
  for (std::size_t p = 0; p < plain.grads.size(); ++p)
    CHECK(std::memcmp(plain.grads[p].data(), one.grads[p].data(), plain.grads[p].size() * sizeof(float)) == 0);

  // A block's saved bytes with offsets: what its forward leaves in the store, the offsets' copy included.
  auto& block = model->blocks[0];
  const shape in{batch, seq, model->config.hidden};
  std::vector<float> x(static_cast<std::size_t>(in.numel()), 0.25f), y(x.size());
  for (const bool packed : {false, true}) {
    memkit::forward_context ctx{};
    if (packed) ctx.document_offsets = memkit::host_view(offsets.data(), shape{batch, offsets_per_row});
    memkit::activation_store store(memkit::default_host_resource());
    block.forward(memkit::host, ctx, memkit::host_view(std::as_const(x).data(), in), memkit::host_view(y.data(), in), store);
    CHECK(store.bytes() == block.saved_bytes(in, ctx));
    std::vector<float> dx(x.size());
    block.backward(memkit::host, memkit::host_view(std::as_const(y).data(), in), memkit::host_view(dx.data(), in), store);
    CHECK(store.empty());
  }
  const memkit::forward_context with_offsets{0, 0, true, memkit::host_view(offsets.data(), shape{batch, offsets_per_row})};
  CHECK(block.saved_bytes(in, with_offsets) ==
        block.saved_bytes(in, {}) + memkit::activation_store::bytes_required<std::int32_t>(shape{batch, offsets_per_row}));
}
