# CTest driver for memkit-budget on hostile input (issue #15): whatever it is given, it answers in one line with
# exit code 2, fast, and writes or prints nothing it should not.
#   cmake -DTOOL=... -DWORK=... -DMODE=config_cap|field_caps|svg -P this
cmake_minimum_required(VERSION 3.25)
file(MAKE_DIRECTORY ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/budget_cli_support.cmake)

# Runs the tool (10 s at most) and expects exit code 2, one line on stderr matching `pattern`, nothing on stdout.
function(expect_refused what pattern)
  execute_process(COMMAND ${TOOL} ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors
                  TIMEOUT 10)
  expect("exit code 2 for ${what}, got '${result}'" result STREQUAL "2")
  expect("one line on stderr for ${what}: ${errors}" errors MATCHES "^memkit-budget: error: [^\n]+\n$")
  expect("'${pattern}' in the message for ${what}: ${errors}" errors MATCHES "${pattern}")
  string(LENGTH "${output}" printed)
  expect("nothing on stdout for ${what}: ${output}" printed EQUAL 0)
endfunction()

# A small Llama's config.json with the given members set ("key" "json value" pairs).
function(write_config path)
  set(json "{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"intermediate_size\": 128, \"vocab_size\": 1000}")
  while(ARGN)
    list(POP_FRONT ARGN key value)
    string(JSON json SET "${json}" ${key} "${value}")
  endwhile()
  file(WRITE ${path} "${json}")
endfunction()

if(MODE STREQUAL "config_cap")
  # Read with a size cap: an endless stream fails at once instead of filling memory.
  if(EXISTS /dev/zero)
    expect_refused("/dev/zero" "larger than 16 MiB" --config /dev/zero)
  endif()
  # A file just over the cap (valid JSON after 17 MiB of spaces) is refused for its size, not parsed.
  string(REPEAT " " 1048576 mebibyte)
  file(WRITE ${WORK}/huge.json "")
  foreach(i RANGE 16)
    file(APPEND ${WORK}/huge.json "${mebibyte}")
  endforeach()
  file(APPEND ${WORK}/huge.json "{}")
  expect_refused("a 17 MiB config" "larger than 16 MiB" --config ${WORK}/huge.json)
  file(REMOVE ${WORK}/huge.json)
  message(STATUS "config_cap: endless and oversized configs refused")
elseif(MODE STREQUAL "field_caps")
  # Each dimension beyond a physically meaningful size is refused with the field named, before any estimate
  # (unchecked, these wrapped 64-bit products into small "fitting" peaks).
  set(cases
    "hidden_size|4294967296" "num_hidden_layers|1000000" "num_attention_heads|1099511627776"
    "num_key_value_heads|1099511627776" "intermediate_size|18446744073709551616" "vocab_size|1e18"
    "head_dim|1e30" "max_position_embeddings|1e12")
  foreach(case IN LISTS cases)
    string(REPLACE "|" ";" case "${case}")
    list(GET case 0 field)
    list(GET case 1 value)
    write_config(${WORK}/field.json ${field} ${value})
    expect_refused("${field} = ${value}" "field '${field}' is [^ ]+, more than the largest meaningful"
                   --config ${WORK}/field.json)
  endforeach()
  # Every field within its cap, but together past any real model: refused by the parameter total.
  write_config(${WORK}/field.json hidden_size 1048576 num_hidden_layers 16384 num_attention_heads 16384 head_dim 1048576)
  expect_refused("a product past 64 bits" "parameters, more than the largest meaningful 1e15" --config ${WORK}/field.json)
  # A plan past any real run (2^62 x 1024 tokens) is refused, not wrapped into 0 B of activations that "fit".
  expect_refused("--batch 2^62" "past any real run" --preset gpt2-124m --batch 4611686018427387904 --seq 1024)
  expect_refused("--lora-rank 2^50" "past any real run" --preset llama-3.1-8b --method lora --lora-rank 1125899906842624)
  # Real large models stay well inside the caps (Llama-3.1-405B's dimensions).
  file(WRITE ${WORK}/large.json "{\"model_type\": \"llama\", \"hidden_size\": 16384, \"num_hidden_layers\": 126, "
       "\"num_attention_heads\": 128, \"num_key_value_heads\": 8, \"intermediate_size\": 53248, "
       "\"vocab_size\": 128256, \"max_position_embeddings\": 131072, \"tie_word_embeddings\": false}")
  execute_process(COMMAND ${TOOL} --config ${WORK}/large.json --json RESULT_VARIABLE result OUTPUT_VARIABLE json
                  ERROR_VARIABLE errors TIMEOUT 10)
  expect("Llama-3.1-405B dimensions accepted (${result}): ${errors}" result EQUAL 0)
  string(JSON parameters GET "${json}" parameters)
  expect("405,853,388,800 parameters, got ${parameters}" parameters EQUAL 405853388800)
  message(STATUS "field_caps: every oversized field refused by name")
elseif(MODE STREQUAL "svg")
  # Text from the command line (the config's path names the model) is XML-escaped in the SVG.
  set(odd_name "a<b>&c\"d'e")
  file(MAKE_DIRECTORY "${WORK}/${odd_name}")
  write_config("${WORK}/${odd_name}/config.json")
  file(REMOVE ${WORK}/odd.svg)
  run_tool(ignored --config "${WORK}/${odd_name}/config.json" --svg ${WORK}/odd.svg)
  file(READ ${WORK}/odd.svg svg)
  string(FIND "${svg}" "a&lt;b&gt;&amp;c&quot;d&apos;e/config.json" escaped)
  expect("the path XML-escaped in the SVG title: ${svg}" NOT escaped EQUAL -1)
  string(FIND "${svg}" "${odd_name}" raw)
  expect("no unescaped path in the SVG" raw EQUAL -1)
  # An SVG that cannot be written is an error before anything is printed (no table, then a failure).
  expect_refused("an unwritable --svg path" "cannot write" --preset gpt2-124m --svg ${WORK}/no/such/dir/out.svg)
  expect_refused("an unwritable --svg path with --json" "cannot write" --preset gpt2-124m --json
                 --svg ${WORK}/no/such/dir/out.svg)
  message(STATUS "svg: text escaped, write errors before any output")
elseif(MODE STREQUAL "runtime_misuse")
  # #35: what the memkit runtime does not have is refused, not silently modelled as PyTorch would run it.
  # memkit's stage 3 shards trainable tensors or NF4 bases; a frozen bf16 base would stay whole on every rank.
  expect_refused("ZeRO-3 LoRA over a bf16 base with the memkit runtime" "NF4 bases"
                 --preset llama-3.1-8b --runtime memkit --logits fused --zero 3 --gpus 8 --method lora)
  expect_refused("--optimizer-impl with the memkit runtime" "--optimizer-impl chooses between torch AdamW"
                 --preset llama-3.1-8b --runtime memkit --logits fused --optimizer-impl foreach)
  # A GPU count past any real run (2^62 made a 70B model fit one H100 through ZeRO-3's 1/N shares).
  expect_refused("--gpus 2^62" "--gpus is at most 65536" --preset llama-3.1-70b --gpus 4611686018427387904 --zero 3)
  expect_refused("--gpus 65537" "--gpus is at most 65536" --preset llama-3.1-8b --gpus 65537)
  message(STATUS "runtime_misuse: ZeRO-3 over a bf16 LoRA base and --optimizer-impl refused with the memkit runtime; --gpus capped")
else()
  message(FATAL_ERROR "unknown MODE ${MODE}")
endif()
