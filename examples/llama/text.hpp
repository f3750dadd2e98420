// examples/llama/text.hpp — a byte-level tokenizer and random training windows over a text file.
//
// Tokens are the text's bytes (vocabulary 256): nothing to build or ship, and every text round-trips.
// Batches are windows of seq + 1 bytes at positions drawn from (seed, step) with memkit::random_word, so a
// run is reproducible; the last tenth of the text is held out for the validation loss. Or (--pack) rows of
// whole documents: the text's paragraphs (between blank lines, each cut into pieces of at most seq bytes) from
// a random one on, packed in order with memkit::models::pack_documents, with their offsets, so that attention
// and positions stay inside each paragraph and no target crosses one.
#pragma once

#include <memkit/config.hpp>
#include <memkit/core/random.hpp>
#include <memkit/models/tokens.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace example {

struct byte_tokenizer {
  static constexpr std::int64_t vocab = 256;
  static std::vector<std::int32_t> encode(const std::string& text) {
    std::vector<std::int32_t> ids;
    ids.reserve(text.size());
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  static std::string decode(const std::vector<std::int32_t>& ids) {
    std::string text;
    for (std::int32_t id : ids) text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    return text;
  }
};

class text_dataset {
 public:
  text_dataset(const std::string& path, std::int64_t seq) : seq_(seq) {
    std::ifstream in(path, std::ios::binary);
    memkit::require(in.good(), "text_dataset: cannot open '" + path + "'");
    std::ostringstream all;
    all << in.rdbuf();
    tokens_ = byte_tokenizer::encode(all.str());
    memkit::require(static_cast<std::int64_t>(tokens_.size()) > 20 * (seq + 1),
                    "text_dataset: '" + path + "' is too short for sequences of " + std::to_string(seq));
    split_ = static_cast<std::int64_t>(tokens_.size()) * 9 / 10;
    split_documents();
  }

  // Token ids made elsewhere (a token file of tools/tokenize.py, or random ids); `what` names them in errors.
  text_dataset(std::vector<std::int32_t> tokens, std::int64_t seq, const std::string& what)
      : tokens_(std::move(tokens)), seq_(seq) {
    memkit::require(static_cast<std::int64_t>(tokens_.size()) > 20 * (seq + 1),
                    "text_dataset: " + what + " has " + std::to_string(tokens_.size()) +
                        " tokens, too few for sequences of " + std::to_string(seq) + " (at least " +
                        std::to_string(20 * (seq + 1) + 1) + ")");
    split_ = static_cast<std::int64_t>(tokens_.size()) * 9 / 10;
    split_documents();
  }

  std::int64_t size() const noexcept { return static_cast<std::int64_t>(tokens_.size()); }
  std::int64_t seq() const noexcept { return seq_; }

  // Fills ids and targets [batch * seq]: windows of the training part at random positions.
  void training_batch(std::uint64_t seed, std::uint64_t step, std::int64_t batch, std::int32_t* ids,
                      std::int32_t* targets) const {
    const std::uint64_t positions = static_cast<std::uint64_t>(split_ - seq_ - 1);
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::uint64_t start = memkit::random_word(seed, step, static_cast<std::uint64_t>(b)) % positions;
      window(static_cast<std::int64_t>(start), ids + b * seq_, targets + b * seq_);
    }
  }
  // Packed rows (--pack): fills ids, targets [batch * seq] and offsets [batch * offsets_per_row] with the
  // training part's documents from one drawn from (seed, step) on. Returns how many tokens have a target.
  std::int64_t packed_training_batch(std::uint64_t seed, std::uint64_t step, std::int64_t batch,
                                     std::int64_t offsets_per_row, std::int32_t* ids, std::int32_t* targets,
                                     std::int32_t* offsets) const {
    const std::size_t first = static_cast<std::size_t>(memkit::random_word(seed, step, 0) % documents_.size());
    // Enough documents in order (wrapping around) to fill every row.
    std::vector<std::vector<std::int32_t>> docs;
    std::int64_t tokens = 0;
    for (std::size_t k = 0; tokens < batch * seq_ && k < documents_.size(); ++k) {
      const auto [begin, end] = documents_[(first + k) % documents_.size()];
      docs.emplace_back(tokens_.begin() + begin, tokens_.begin() + end);
      tokens += end - begin;
    }
    const memkit::models::packed_rows rows =
        memkit::models::pack_documents(docs, batch, seq_, 0, -100, offsets_per_row);
    std::copy(rows.ids.begin(), rows.ids.end(), ids);
    std::copy(rows.targets.begin(), rows.targets.end(), targets);
    std::copy(rows.offsets.begin(), rows.offsets.end(), offsets);
    return static_cast<std::int64_t>(std::count_if(rows.targets.begin(), rows.targets.end(), [](std::int32_t t) { return t >= 0; }));
  }

  // Validation windows `index`, `index` + 1, ... of the held-out part, evenly spaced.
  void validation_batch(std::int64_t batch, std::int64_t first_window, std::int64_t windows, std::int32_t* ids,
                        std::int32_t* targets) const {
    const std::int64_t span = size() - split_ - seq_ - 1;
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t w = (first_window + b) % windows;
      window(split_ + span * w / windows, ids + b * seq_, targets + b * seq_);
    }
  }

 private:
  void window(std::int64_t start, std::int32_t* ids, std::int32_t* targets) const {
    for (std::int64_t i = 0; i < seq_; ++i) {
      ids[i] = tokens_[static_cast<std::size_t>(start + i)];
      targets[i] = tokens_[static_cast<std::size_t>(start + i + 1)];
    }
  }

  // The training part's documents [begin, end): paragraphs (text between blank lines, "\n\n"), each cut into
  // pieces of at most seq tokens (a longer one would be cut by the packer and its rest never trained on).
  void split_documents() {
    std::int64_t begin = 0;
    const auto add = [&](std::int64_t end) {
      for (std::int64_t at = begin; at < end; at += seq_) documents_.emplace_back(at, std::min(end, at + seq_));
    };
    for (std::int64_t i = 1; i < split_; ++i)
      if (tokens_[static_cast<std::size_t>(i)] == '\n' && tokens_[static_cast<std::size_t>(i - 1)] == '\n') {
        add(i + 1);  // the blank line ends the paragraph
        begin = i + 1;
      }
    add(split_);
    memkit::require(!documents_.empty(), "text_dataset: no documents to pack");
  }

  std::vector<std::int32_t> tokens_;
  std::int64_t seq_ = 0;
  std::int64_t split_ = 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> documents_;
};

}  // namespace example
