// memkit/memkit.hpp — the umbrella header: everything memkit offers, in one include.
#pragma once

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/core/units.hpp"
#include "memkit/io/json.hpp"
#include "memkit/io/safetensors.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/memory/tracking.hpp"
#include "memkit/quant/blockwise.hpp"
#include "memkit/quant/codebooks.hpp"
#include "memkit/quant/double_quant.hpp"
#include "memkit/quant/quantized_tensor.hpp"
#include "memkit/quant/bnb_checkpoint.hpp"
#include "memkit/quant/matmul.hpp"
