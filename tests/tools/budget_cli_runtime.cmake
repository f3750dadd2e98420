# CTest driver for memkit-budget's run description (issue #13): --runtime, --optimizer-impl, --paged,
# --optimizer-in-backward, --logits fused|cut, and the planner's "no effect" rungs and speed factors.
#   cmake -DTOOL=... -DWORK=... -DMODE=runtime|optimizer|loss|plan -P this
cmake_minimum_required(VERSION 3.25)
file(MAKE_DIRECTORY ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/budget_cli_support.cmake)

if(MODE STREQUAL "runtime")
  # Full bf16-mixed training of GPT-2 124M (124,439,808 parameters), 8-bit AdamW: PyTorch keeps bf16
  # gradients (2 bytes each), memkit fp32 ones (4 bytes each, memkit/models/llama's parameters and lora_linear).
  set(common --preset gpt2-124m --optimizer adamw8bit --batch 1 --seq 128 --json)
  run_tool(torch_json ${common})
  run_tool(memkit_json ${common} --runtime memkit --logits fused)
  string(JSON torch_runtime GET "${torch_json}" runtime)
  string(JSON memkit_runtime GET "${memkit_json}" runtime)
  expect("runtime pytorch by default, got ${torch_runtime}" torch_runtime STREQUAL "pytorch")
  expect("runtime memkit, got ${memkit_runtime}" memkit_runtime STREQUAL "memkit")
  string(JSON torch_grads GET "${torch_json}" phases optimizer_step gradients)
  string(JSON memkit_grads GET "${memkit_json}" phases optimizer_step gradients)
  # Every tensor rounded to 512 bytes; the tied 50,257 x 768 embedding and the 1,024 x 768 positions are
  # multiples already, the rest too except the biases and norms: compare against the parameter count.
  math(EXPR torch_floor "2 * 124439808")
  math(EXPR memkit_floor "4 * 124439808")
  expect("bf16 gradients >= ${torch_floor}, < +1%: ${torch_grads}" torch_grads GREATER_EQUAL torch_floor)
  expect("fp32 gradients >= ${memkit_floor}: ${memkit_grads}" memkit_grads GREATER_EQUAL memkit_floor)
  math(EXPR doubled "2 * ${torch_grads}")
  expect("memkit gradients are twice PyTorch's: ${memkit_grads} vs ${torch_grads}" memkit_grads EQUAL doubled)
  # The memkit runtime refuses a loss memkit does not have.
  execute_process(COMMAND ${TOOL} --preset gpt2-124m --runtime memkit --logits fp32 RESULT_VARIABLE result
                  OUTPUT_VARIABLE ignored ERROR_VARIABLE message)
  expect("exit 2 for memkit + fp32 logits, got ${result}" result EQUAL 2)
  expect("the message names memkit's loss: ${message}" message MATCHES "fused_linear_cross_entropy")
  message(STATUS "runtime: gradients ${torch_grads} (pytorch) vs ${memkit_grads} (memkit)")
elseif(MODE STREQUAL "optimizer")
  # torch AdamW on GPT-2 124M, fp32 moments: foreach's step holds exp_avg_sq_sqrt, 4 bytes per parameter.
  set(common --preset gpt2-124m --batch 1 --seq 128 --json)
  run_tool(foreach ${common} --optimizer-impl foreach)
  run_tool(fused ${common} --optimizer-impl fused)
  string(JSON foreach_ws GET "${foreach}" phases optimizer_step workspace)
  string(JSON fused_ws GET "${fused}" phases optimizer_step workspace)
  math(EXPR temporary "${foreach_ws} - ${fused_ws}")
  math(EXPR floor "4 * 124439808")
  expect("foreach's temporary >= 4 bytes per parameter: ${temporary}" temporary GREATER_EQUAL floor)
  math(EXPR ceiling "${floor} + ${floor} / 100")
  expect("foreach's temporary within 1% of it: ${temporary}" temporary LESS ceiling)
  # --paged: the optimizer state is in managed memory; the device peak is unchanged but for the caching
  # allocator's packing, which the state no longer takes part in (its tensors no longer fill, or need, the
  # tails of segments): within 2% either way.
  run_tool(device ${common} --optimizer adamw8bit)
  run_tool(paged ${common} --optimizer adamw8bit --paged)
  string(JSON device_peak GET "${device}" peak_device_bytes)
  string(JSON paged_peak GET "${paged}" peak_device_bytes)
  string(JSON managed GET "${paged}" managed_bytes)
  string(JSON state GET "${paged}" breakdown optimizer_state)
  math(EXPR slack "${device_peak} - ${paged_peak}")
  if(slack LESS 0)
    math(EXPR slack "0 - ${slack}")
  endif()
  math(EXPR two_percent "${device_peak} / 50")
  expect("the same device peak paged or not, but for the allocator's packing: ${paged_peak} vs ${device_peak}"
         slack LESS two_percent)
  expect("managed bytes are the optimizer state: ${managed} vs ${state}" managed EQUAL state)
  run_tool(table --preset gpt2-124m --batch 1 --seq 128 --optimizer adamw8bit --paged)
  expect("the table says what is in managed memory" table MATCHES "in CUDA managed memory")
  # --optimizer-in-backward: no optimizer phase of its own; refused with gradient accumulation.
  run_tool(inbwd ${common} --optimizer-in-backward)
  string(JSON step_grads GET "${inbwd}" phases optimizer_step gradients)
  expect("no gradients left for a step phase: ${step_grads}" step_grads EQUAL 0)
  execute_process(COMMAND ${TOOL} --preset gpt2-124m --optimizer-in-backward --grad-accum 4 RESULT_VARIABLE result
                  OUTPUT_VARIABLE ignored ERROR_VARIABLE message)
  expect("exit 2 for optimizer-in-backward with accumulation, got ${result}" result EQUAL 2)
  message(STATUS "optimizer: foreach temporary ${temporary} bytes, managed ${managed}")
elseif(MODE STREQUAL "loss")
  # Llama 3.1 8B LoRA, 2 x 1024: fused and cut never hold the 2048 x 128,256 logits.
  set(common --preset llama-3.1-8b --method lora --batch 2 --seq 1024 --json)
  foreach(kind fp32 bf16 chunked fused cut)
    run_tool(json ${common} --logits ${kind})
    string(JSON peak_${kind} GET "${json}" peak_device_bytes)
  endforeach()
  expect("fp32 > bf16 > chunked > fused: ${peak_fp32} ${peak_bf16} ${peak_chunked} ${peak_fused}"
         peak_fp32 GREATER peak_bf16 AND peak_bf16 GREATER peak_chunked AND peak_chunked GREATER peak_fused)
  expect("cut below chunked: ${peak_cut}" peak_cut LESS peak_chunked)
  # torchtune's chunk count: 16 chunks halve the one bf16 chunk gradient of backward (2 x 64 x 128,256 x 2 bytes
  # instead of 2 x 128 x 128,256 x 2: 32,833,536 bytes less).
  run_tool(json8 ${common} --logits chunked)
  string(JSON logits8 GET "${json8}" phases backward logits)
  run_tool(json16 ${common} --logits chunked --logits-chunks 16)
  string(JSON logits16 GET "${json16}" phases backward logits)
  math(EXPR saved "${logits8} - ${logits16}")
  expect("16 chunks hold 32,833,536 bytes less in backward: ${saved}" saved EQUAL 32833536)
  message(STATUS "loss: fp32 ${peak_fp32}, bf16 ${peak_bf16}, chunked ${peak_chunked}, fused ${peak_fused}, cut ${peak_cut}")
elseif(MODE STREQUAL "plan")
  # Llama 3.1 8B at 4 micro-batches of 1 x 128 on an H100: the step in backward cannot run with accumulation,
  # the logits are not part of the peak and the micro-batch is already 1: those rungs have no effect and
  # are not applied; the others carry their speed factor.
  set(common --preset llama-3.1-8b --batch 1 --seq 128 --grad-accum 4 --gpu h100-80gb --plan)
  run_tool(json ${common} --json)
  string(JSON name GET "${json}" plan rungs 2 name)
  string(JSON effective GET "${json}" plan rungs 2 effective)
  string(JSON reason GET "${json}" plan rungs 2 reason)
  expect("rung 3 is the step in backward, got ${name}" name STREQUAL "+ optimizer step in backward")
  expect("the step in backward has no effect here" effective STREQUAL "OFF")
  expect("the reason names accumulation: ${reason}" reason MATCHES "accumulation")
  string(JSON effective GET "${json}" plan rungs 3 effective)
  string(JSON reason GET "${json}" plan rungs 3 reason)
  expect("the fused loss has no effect here: ${reason}" effective STREQUAL "OFF")
  string(JSON reason GET "${json}" plan rungs 5 reason)
  expect("micro-batch rung: ${reason}" reason STREQUAL "the micro-batch is already 1")
  string(JSON factor GET "${json}" plan rungs 4 speed_factor)
  expect("checkpointing costs a third: ${factor}" factor MATCHES "^1\\.33")
  string(JSON factor GET "${json}" plan rungs 6 speed_factor)
  string(JSON total GET "${json}" plan rungs 6 total_speed_factor)
  expect("QLoRA adds dequantization to recompute: ${factor}, total ${total}" factor MATCHES "^1\\.3(0*1?)?$" AND total MATCHES "^1\\.73")
  run_tool(table ${common})
  expect("the table shows no effect" table MATCHES "\\+ optimizer step in backward +no effect: ")
  expect("the table shows speed factors" table MATCHES "x1.30 \\(total x1.73\\)")
  message(STATUS "plan: ${reason}")
endif()
