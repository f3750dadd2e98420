// What docs/lora.md's block uses: the base weight, one step's tensors and its activation store.
#pragma once
#include <memkit/memkit.hpp>
inline memkit::tensor_view<const float> weight_view, x, dy;
inline memkit::tensor_view<float> y, dx;
extern memkit::activation_store& store;
inline std::uint64_t seed = 1, counter = 0;
inline std::vector<memkit::optim::adam_group> groups{{.lr = 2e-4f}};
