// What docs/models.md's loading block uses: the namespace alias of the first block, resources, an executor.
#pragma once
#include <memkit/models/llama/load.hpp>
namespace llama = memkit::models::llama;
inline const memkit::host_executor exec;
inline memkit::layers::memory_resources memory;
