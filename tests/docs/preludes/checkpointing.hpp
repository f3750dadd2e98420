// What docs/checkpointing.md's first block uses: a decoder block type that is a memkit layer, an embedding and
// a head written by the model's author, the executor, a tracker and the step's tensors.
#pragma once
#include <memkit/memkit.hpp>
struct decoder_block {  // a layer (core/layer.hpp): y = x, saving nothing
  using value_type = float;
  memkit::shape output_shape(const memkit::shape& in) const { return in; }
  std::size_t saved_bytes(const memkit::shape&, const memkit::forward_context&) const { return 0; }
  void forward(const memkit::host_executor&, const memkit::forward_context&, memkit::tensor_view<const float>,
               memkit::tensor_view<float>, memkit::activation_store&) {}
  void backward(const memkit::host_executor&, memkit::tensor_view<const float>, memkit::tensor_view<float>,
                memkit::activation_store&) {}
};
static_assert(memkit::layer<decoder_block, memkit::host_executor>);
inline std::vector<decoder_block> make_blocks(std::size_t n) { return std::vector<decoder_block>(n); }
inline constexpr std::uint64_t N = 16;
inline const memkit::host_executor exec;
inline const memkit::forward_context ctx{.seed = 1};
inline memkit::tracking_resource tracker(memkit::default_host_resource(), "train");
inline std::vector<std::int32_t> tokens;
inline memkit::tensor_view<float> h0, hN, logits, dhN, dh0;
inline memkit::tensor_view<const float> dlogits;
inline void embed(const std::vector<std::int32_t>&, memkit::tensor_view<float>) {}
inline void embed_backward(const std::vector<std::int32_t>&, memkit::tensor_view<float>) {}
inline decoder_block head;
