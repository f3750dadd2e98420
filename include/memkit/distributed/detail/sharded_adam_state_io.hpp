// memkit/distributed/detail/sharded_adam_state_io.hpp — sharded_adam_state's save() and load(): one rank's
// image out, and the images of every rank of a save (any number of ranks) back in, every field checked before
// the state changes. Included at the end of distributed/sharded_adam_state.hpp.
#pragma once

#include "memkit/distributed/sharded_adam_state.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace distributed {

template <class State, int Block>
template <executor E>
void sharded_adam_state<State, Block>::save(const E& exec, std::ostream& out) const {
  const std::vector<std::byte> image = host_copy(exec);
  std::string body;
  detail::put_string(body, format_name());
  detail::put(body, static_cast<std::uint32_t>(traits::bits));
  detail::put(body, static_cast<std::uint32_t>(Block));
  detail::put(body, traits::map_fingerprint());
  detail::put(body, options().min_quantized_size);
  detail::put(body, static_cast<std::uint32_t>(ranks_));
  detail::put(body, static_cast<std::uint32_t>(rank_));
  detail::put(body, run_id_);
  detail::put(body, static_cast<std::uint64_t>(sizes_.size()));
  for (std::int64_t n : sizes_) detail::put(body, n);
  body.append(reinterpret_cast<const char*>(image.data()), sizeof(optim::adam_control));
  detail::put(body, static_cast<std::uint64_t>(pieces_.size()));
  for (const shard_piece& p : pieces_) {
    detail::put(body, p.tensor);
    detail::put(body, p.begin);
    detail::put(body, p.end);
    for (const segment& s : segments(p, 0, p.count()))
      body.append(reinterpret_cast<const char*>(image.data() + s.offset), s.bytes);
  }
  optim::detail::write_string(out, magic);
  optim::detail::write_pod(out, format_version);
  optim::detail::write_pod(out, static_cast<std::uint64_t>(body.size()));
  out.write(body.data(), static_cast<std::streamsize>(body.size()));
  optim::detail::write_pod(out, optim::detail::image_checksum(body.data(), body.size()));
  require(static_cast<bool>(out), "sharded_adam_state::save: writing the stream failed");
}

template <class State, int Block>
template <executor E>
void sharded_adam_state<State, Block>::load(const E& exec, std::span<std::istream* const> images) {
  const std::string op = "sharded_adam_state::load";
  require(!images.empty(), op + ": no images");
  std::vector<std::byte> staging(core_.bytes(), std::byte{0});
  std::vector<char> seen;
  optim::adam_control first_control{};
  std::uint64_t first_run = 0;
  for (std::size_t k = 0; k < images.size(); ++k) {
    require(images[k] != nullptr, op + ": image " + std::to_string(k) + " is null");
    const std::string where = op + ": image " + std::to_string(k);
    detail::body_stream in{*images[k], read_framing(*images[k], where), where};
    try {
      require(in.string() == format_name(), where + ": holds another flavour of state, this is '" + format_name() + "'");
      require(in.template pod<std::uint32_t>() == static_cast<std::uint32_t>(traits::bits), where + ": moment bits differ");
      require(in.template pod<std::uint32_t>() == static_cast<std::uint32_t>(Block), where + ": block size differs");
      require(in.template pod<std::uint64_t>() == traits::map_fingerprint(), where + ": quantization maps differ");
      require(in.template pod<std::int64_t>() == options().min_quantized_size, where + ": min_quantized_size differs");
      const auto saved_ranks = static_cast<int>(in.template pod<std::uint32_t>());
      const auto saved_rank = static_cast<int>(in.template pod<std::uint32_t>());
      require(saved_ranks >= 1 && saved_rank >= 0 && saved_rank < saved_ranks,
              where + ": rank " + std::to_string(saved_rank) + " of " + std::to_string(saved_ranks) + " is invalid");
      require(static_cast<std::size_t>(saved_ranks) == images.size(),
              where + ": saved by " + std::to_string(saved_ranks) + " ranks, but " + std::to_string(images.size()) +
                  " images were given (pass every rank's image)");
      if (seen.empty()) seen.assign(images.size(), 0);
      require(!seen[static_cast<std::size_t>(saved_rank)], where + ": rank " + std::to_string(saved_rank) + " appears twice");
      seen[static_cast<std::size_t>(saved_rank)] = 1;
      const auto run = in.template pod<std::uint64_t>();
      require(run != 0, where + ": run id 0 (an image names the run it belongs to; this one names none)");
      if (k == 0) first_run = run;
      require(run == first_run, where + ": from run " + std::to_string(run) + ", image 0 from run " +
                                    std::to_string(first_run) + " (images of different runs)");
      require(!run_id_bound_ || run == run_id_,
              where + ": from run " + std::to_string(run) + ", this state belongs to run " + std::to_string(run_id_) +
                  " (a state takes another run's images only while fresh: not given a run id, never stepped or loaded)");
      require(in.template pod<std::uint64_t>() == sizes_.size(), where + ": tensor count differs");
      for (std::size_t i = 0; i < sizes_.size(); ++i)
        require(in.template pod<std::int64_t>() == sizes_[i], where + ": tensor " + std::to_string(i) + "'s size differs");
      const auto control = in.template pod<optim::adam_control>();
      // The fields adam_state::load checks, with the same function (a forged image can carry a valid checksum).
      optim::validate_control(control, where + ": the control block has ", core_.total_chunks(), options().loss_scaling);
      if (k == 0) first_control = control;
      require(std::memcmp(&control, &first_control, sizeof control) == 0, where + ": holds a different step than image 0 (images from different saves)");
      // The pieces must be exactly those the layout gives that rank.
      std::vector<shard_piece> expected;
      plan(sizes_, saved_rank, saved_ranks, options().min_quantized_size,
           [&](const shard_piece& p) { expected.push_back(p); });
      require(in.template pod<std::uint64_t>() == expected.size(), where + ": piece count does not match its layout");
      for (const shard_piece& old : expected) {
        require(in.template pod<std::int64_t>() == old.tensor && in.template pod<std::int64_t>() == old.begin &&
                    in.template pod<std::int64_t>() == old.end,
                where + ": a piece does not match its layout");
        // The piece streams through in pieces of at most 1 MiB; only what falls in this rank's pieces is kept.
        const auto old_segments = segments(old, 0, old.count());
        struct part {
          std::size_t segment, at, bytes, to;  // bytes [at, at + bytes) of the segment go to staging + to
        };
        std::vector<part> parts;
        for (const shard_piece& mine : pieces_) {
          if (mine.tensor != old.tensor) continue;
          const std::int64_t begin = std::max(mine.begin, old.begin), end = std::min(mine.end, old.end);
          if (begin >= end) continue;
          const auto from = segments(old, begin - old.begin, end - begin);
          const auto to = segments(mine, begin - mine.begin, end - begin);
          for (std::size_t s = 0; s < from.size(); ++s)
            parts.push_back({s, from[s].offset - old_segments[s].offset, to[s].bytes, to[s].offset});
        }
        for (std::size_t s = 0; s < old_segments.size(); ++s)
          in.stream_through(old_segments[s].bytes, [&](std::size_t at, const char* data, std::size_t n) {
            for (const part& q : parts) {
              if (q.segment != s) continue;
              const std::size_t lo = std::max(at, q.at), hi = std::min(at + n, q.at + q.bytes);
              if (lo < hi) std::memcpy(staging.data() + q.to + (lo - q.at), data + (lo - at), hi - lo);
            }
          });
      }
      require(in.at == in.length, where + ": trailing bytes after the last piece");
    } catch (const error&) {
      // An accident (a flipped byte, a cut file) is reported as such, as it was when the checksum came first.
      in.drain_and_verify();
      throw;
    }
    in.verify();
  }
  std::memcpy(staging.data(), &first_control, sizeof first_control);
  validate_pieces(op, staging.data());
  require_accessible(exec, arena_view(), "sharded_adam_state::load", "optimizer state");
  core_.copy_in(exec, staging.data(), staging.size());  // every image checked: now replace
  run_id_ = first_run;
  run_id_bound_ = true;
}

}  // namespace distributed
MEMKIT_NAMESPACE_END
