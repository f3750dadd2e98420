// What docs/models.md's packing block uses: the models prelude, a model, a resource for saved tensors, documents.
#pragma once
#include "models.hpp"
#include <memkit/models/tokens.hpp>
extern llama::causal_lm<float, memkit::layers::dense_linear<float>>& model;
inline memkit::memory_resource& saved = memkit::default_host_resource();
inline std::vector<std::vector<std::int32_t>> documents;  // token ids, one vector per document
