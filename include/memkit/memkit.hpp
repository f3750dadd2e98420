// memkit/memkit.hpp — the umbrella header: everything memkit offers, in one include.
#pragma once

#include "memkit/budget/activations.hpp"
#include "memkit/budget/component_bytes.hpp"
#include "memkit/budget/estimate.hpp"
#include "memkit/budget/fits.hpp"
#include "memkit/budget/model.hpp"
#include "memkit/budget/plan.hpp"
#include "memkit/budget/planner.hpp"
#include "memkit/budget/presets.hpp"
#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/core/units.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/memory/tracking.hpp"
