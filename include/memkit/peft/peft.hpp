// memkit/peft/peft.hpp — LoRA adapters in PEFT's files, read and written exactly as PEFT does
// (docs/peft_interop.md): everything below.
//   config.hpp          adapter_config.json: lora_config, module_selector, parse / read / to_json / write_lora_config
//   module_pattern.hpp  the regex subset of target_modules / rank_pattern / alpha_pattern, without backtracking
//   adapter_file.hpp    adapter_file (open and check a directory, load() modules), lora_module, lora_tensors
//   writer.hpp          adapter_writer (add modules or layers, write a directory PEFT loads)
//   layers.hpp          lora::lora_linear layers by module path: config_for, layer_options, layer_at,
//                       load_layers, save_layers
#pragma once

#include "memkit/peft/adapter_file.hpp"
#include "memkit/peft/config.hpp"
#include "memkit/peft/layers.hpp"
#include "memkit/peft/module_pattern.hpp"
#include "memkit/peft/writer.hpp"
