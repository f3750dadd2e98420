# CTest driver for memkit-budget: runs the tool and checks what it prints, parsing --json back.
#   cmake -DTOOL=... -DDATA=tests/data/budget -DWORK=... -DMODE=json|configs|plan|max_batch|svg|metrics|bad_input|measured -P this
cmake_minimum_required(VERSION 3.25)
file(MAKE_DIRECTORY ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/budget_cli_support.cmake)

if(MODE STREQUAL "json")
  run_tool(json --preset llama-3.1-8b --method lora --lora-rank 16 --batch 2 --seq 1024 --gpu a100-80gb --json)
  string(JSON parameters GET "${json}" parameters)
  string(JSON trainable GET "${json}" trainable_parameters)
  string(JSON peak GET "${json}" peak_device_bytes)
  string(JSON host GET "${json}" host_bytes)
  string(JSON fits GET "${json}" fits)
  expect("8030261248 parameters, got ${parameters}" parameters EQUAL 8030261248)
  expect("41943040 trainable, got ${trainable}" trainable EQUAL 41943040)
  expect("fits on an A100 80GB, got ${fits}" fits STREQUAL "ON")
  expect("no host memory without offload, got ${host}" host EQUAL 0)
  # The breakdown is the device at its peak: its categories add up to the peak.
  string(JSON count LENGTH "${json}" breakdown)
  expect("8 categories, got ${count}" count EQUAL 8)
  set(sum 0)
  math(EXPR last "${count} - 1")
  foreach(i RANGE ${last})
    string(JSON name MEMBER "${json}" breakdown ${i})
    string(JSON bytes GET "${json}" breakdown ${name})
    math(EXPR sum "${sum} + ${bytes}")
  endforeach()
  expect("breakdown sum ${sum} == peak ${peak}" sum EQUAL peak)
  string(JSON weights GET "${json}" breakdown weights)
  expect("bf16 base + adapters, got ${weights}" weights GREATER 16000000000)
  # Without a GPU there is no fits field.
  run_tool(json --preset gpt2-124m --json)
  string(JSON fits ERROR_VARIABLE missing GET "${json}" fits)
  expect("no fits field without --gpu" NOT missing STREQUAL "NOTFOUND")
  # --lora-dropout keeps dropped adapter inputs (more activations); --no-double-quant stores one fp32
  # absmax per 64-weight block instead of an 8-bit code (more weight bytes).
  run_tool(json --preset llama-2-7b --method lora --lora-targets q,v --batch 2 --seq 512 --json)
  string(JSON plain_activations GET "${json}" phases backward activations)
  run_tool(json --preset llama-2-7b --method lora --lora-targets q,v --batch 2 --seq 512 --lora-dropout --json)
  string(JSON dropout_activations GET "${json}" phases backward activations)
  expect("dropout adds activations: ${dropout_activations} > ${plain_activations}"
         dropout_activations GREATER plain_activations)
  # --offload-checkpoints moves the checkpoints of every-layer checkpointing to the host: the forward keeps
  # none on the device, the host holds all 32 (2 x 512 tokens x 4096 x 2 bytes each).
  run_tool(json --preset llama-2-7b --method lora --batch 2 --seq 512 --checkpointing layer --json)
  string(JSON kept_forward GET "${json}" phases forward activations)
  run_tool(json --preset llama-2-7b --method lora --batch 2 --seq 512 --checkpointing layer --offload-checkpoints --json)
  string(JSON offloaded_forward GET "${json}" phases forward activations)
  string(JSON offloaded_host GET "${json}" host_breakdown activations)
  expect("offloaded checkpoints leave the device: ${offloaded_forward} < ${kept_forward}"
         offloaded_forward LESS kept_forward)
  expect("32 checkpoints of 8 MiB on the host, got ${offloaded_host}" offloaded_host EQUAL 268435456)
  run_tool(json --preset llama-2-7b --method qlora --json)
  string(JSON dq_weights GET "${json}" breakdown weights)
  run_tool(json --preset llama-2-7b --method qlora --no-double-quant --json)
  string(JSON plain_weights GET "${json}" breakdown weights)
  expect("no double quantization stores more: ${plain_weights} > ${dq_weights}" plain_weights GREATER dq_weights)
  message(STATUS "json: fields parsed back")
elseif(MODE STREQUAL "configs")
  # Each sample config.json gives the preset's exact parameter count.
  foreach(pair llama:1235814400 mistral:7241732096 qwen2:494032768 gemma:2506172416 phi3:3821079552 gpt2:124439808)
    string(REPLACE ":" ";" pair "${pair}")
    list(GET pair 0 name)
    list(GET pair 1 expected)
    run_tool(json --config ${DATA}/${name}.json --json)
    string(JSON parameters GET "${json}" parameters)
    expect("${name}.json: ${expected} parameters, got ${parameters}" parameters EQUAL expected)
  endforeach()
  message(STATUS "configs: six model types read")
elseif(MODE STREQUAL "plan")
  run_tool(json --preset llama-3.1-8b --batch 8 --seq 2048 --gpu h100-80gb --plan --json)
  string(JSON first GET "${json}" plan first_fit)
  string(JSON rungs LENGTH "${json}" plan rungs)
  expect("8 rungs, got ${rungs}" rungs EQUAL 8)
  set(seen_fit OFF)
  foreach(i RANGE 7)
    string(JSON name GET "${json}" plan rungs ${i} name)
    string(JSON fits GET "${json}" plan rungs ${i} fits)
    string(JSON peak GET "${json}" plan rungs ${i} peak_device_bytes)
    if(fits AND NOT seen_fit)
      expect("first_fit '${first}' is the first rung that fits ('${name}')" first STREQUAL name)
      expect("a fitting rung within 81559 MiB (${peak})" peak LESS_EQUAL 85521154048)
      set(seen_fit ON)
    endif()
  endforeach()
  expect("some rung fits" seen_fit)
  run_tool(table --preset llama-3.1-8b --batch 8 --seq 2048 --gpu h100-80gb --plan)
  string(FIND "${table}" "first rung that fits: ${first}" named)
  expect("the table names the first rung" named GREATER -1)
  message(STATUS "plan: first fit ${first}")
elseif(MODE STREQUAL "max_batch")
  set(common --preset llama-3.2-1b --method qlora --seq 2048 --checkpointing layer --gpu t4)
  run_tool(json ${common} --max-batch --max-seq --json)
  string(JSON batch GET "${json}" max_micro_batch)
  string(JSON sequence GET "${json}" max_sequence)
  expect("a positive micro-batch, got ${batch}" batch GREATER 0)
  expect("a positive sequence, got ${sequence}" sequence GREATER 0)
  run_tool(json ${common} --batch ${batch} --json)
  string(JSON fits GET "${json}" fits)
  expect("micro-batch ${batch} fits" fits STREQUAL "ON")
  math(EXPR over "${batch} + 1")
  run_tool(json ${common} --batch ${over} --json)
  string(JSON fits GET "${json}" fits)
  expect("micro-batch ${over} does not fit" fits STREQUAL "OFF")
  message(STATUS "max_batch: ${batch}, max_seq: ${sequence}")
elseif(MODE STREQUAL "svg")
  file(REMOVE ${WORK}/breakdown.svg ${WORK}/plan.svg)
  run_tool(ignored --preset mistral-7b --method qlora --gpu l4 --svg ${WORK}/breakdown.svg)
  run_tool(ignored --preset mistral-7b --gpu l4 --plan --svg ${WORK}/plan.svg)
  foreach(svg breakdown plan)
    expect("${svg}.svg written" EXISTS ${WORK}/${svg}.svg)
    file(READ ${WORK}/${svg}.svg text)
    expect("${svg}.svg is an SVG document" text MATCHES "^<svg .*</svg>\n$")
    expect("${svg}.svg draws the GPU line" text MATCHES "GPU 22.49 GiB")
  endforeach()
  file(READ ${WORK}/plan.svg text)
  foreach(rung "bf16" "activation checkpointing" "8-bit AdamW" "optimizer step in backward" "fused linear cross-entropy"
          "smaller micro-batch" "QLoRA" "CPU offload")
    expect("plan.svg has a bar for ${rung}" text MATCHES "${rung}( \\(no effect\\))?</text>")
  endforeach()
  message(STATUS "svg: written")
elseif(MODE STREQUAL "metrics")
  # allocated <= reserved <= device, named in the JSON per phase and at the peak; device - reserved is the
  # CUDA context (512 MiB), plus NCCL's buffers (1 GiB) over several GPUs.
  foreach(gpus 1 2)
    run_tool(json --preset llama-3.2-1b --method qlora --seq 2048 --checkpointing layer --gpus ${gpus} --zero 1 --json)
    string(JSON metric GET "${json}" metric)
    expect("the default metric is device, got ${metric}" metric STREQUAL "device")
    string(JSON peak_device GET "${json}" peak_device_bytes)
    string(JSON peak_d GET "${json}" peak device)
    expect("peak.device ${peak_d} == peak_device_bytes ${peak_device}" peak_d EQUAL peak_device)
    foreach(phase forward backward optimizer_step)
      string(JSON a_bytes GET "${json}" figures ${phase} allocated)
      string(JSON r_bytes GET "${json}" figures ${phase} reserved)
      string(JSON d_bytes GET "${json}" figures ${phase} device)
      expect("${phase}: 0 < allocated ${a_bytes} <= reserved ${r_bytes}" a_bytes GREATER 0 AND a_bytes LESS_EQUAL r_bytes)
      math(EXPR outside "${d_bytes} - ${r_bytes}")
      if(gpus EQUAL 1)
        expect("${phase}: device - reserved = 512 MiB, got ${outside}" outside EQUAL 536870912)
      else()
        expect("${phase}: device - reserved = 512 MiB + 1 GiB, got ${outside}" outside EQUAL 1610612736)
      endif()
    endforeach()
  endforeach()
  # The table names the three figures per phase and at the peak, and which one the fit line compared.
  run_tool(table --preset llama-3.2-1b --method qlora --seq 2048 --checkpointing layer --gpu t4)
  foreach(row allocated reserved device)
    expect("a '${row}' row in the table" table MATCHES "\n${row} +[0-9.]+ [KMG]iB +[0-9.]+ [KMG]iB +[0-9.]+ [KMG]iB\n")
  endforeach()
  expect("the peak's three figures" table MATCHES "peak allocated: [0-9.]+ GiB   reserved: [0-9.]+ GiB   device: [0-9.]+ GiB")
  expect("the fit line names the device figure" table MATCHES "gpu t4: 15.00 GiB available: fits \\(device [0-9.]+ GiB\\)")
  # --metric picks the figure for fits and the searches: without the context the allocated figure
  # leaves room for a longer sequence.
  set(common --preset llama-3.2-1b --method qlora --checkpointing layer --gpu t4 --max-seq --json)
  run_tool(json ${common})
  string(JSON by_device GET "${json}" max_sequence)
  run_tool(json ${common} --metric allocated)
  string(JSON by_allocated GET "${json}" max_sequence)
  string(JSON metric GET "${json}" metric)
  expect("--metric allocated is echoed, got ${metric}" metric STREQUAL "allocated")
  expect("allocated fits a longer sequence: ${by_allocated} > ${by_device}" by_allocated GREATER by_device)
  run_tool(json --preset llama-3.2-1b --method qlora --checkpointing layer --gpu t4 --seq ${by_allocated} --metric allocated --json)
  string(JSON fits GET "${json}" fits)
  expect("the longest sequence by allocated fits by allocated" fits STREQUAL "ON")
  run_tool(json --preset llama-3.2-1b --method qlora --checkpointing layer --gpu t4 --seq ${by_allocated} --json)
  string(JSON fits GET "${json}" fits)
  expect("and not by device" fits STREQUAL "OFF")
  # The constants are the user's to set: device - reserved is exactly the context (and NCCL) given, and a
  # fragmentation allowance is a share of allocated on top of reserved.
  run_tool(json --preset llama-3.2-1b --method qlora --seq 2048 --cuda-context-mib 300 --nccl-mib 700 --gpus 2 --json)
  string(JSON r_bytes GET "${json}" figures backward reserved)
  string(JSON d_bytes GET "${json}" figures backward device)
  math(EXPR outside "${d_bytes} - ${r_bytes}")
  expect("device - reserved = 300 + 700 MiB, got ${outside}" outside EQUAL 1048576000)
  run_tool(json --preset llama-3.2-1b --method qlora --seq 2048 --json)
  string(JSON plain_reserved GET "${json}" peak reserved)
  string(JSON plain_allocated GET "${json}" peak allocated)
  run_tool(json --preset llama-3.2-1b --method qlora --seq 2048 --fragmentation 10 --json)
  string(JSON fragmented GET "${json}" peak reserved)
  math(EXPR added "${fragmented} - ${plain_reserved}")
  math(EXPR tenth "${plain_allocated} / 10")
  math(EXPR low "${tenth} - 4194304")
  math(EXPR high "${tenth} + 4194304")
  expect("10% fragmentation adds a tenth of allocated to reserved: ${added} vs ${tenth}" added GREATER low AND added LESS high)
  run_tool(json --preset llama-3.2-1b --method qlora --seq 2048 --cublas-workspace-mib 8 --json)
  string(JSON small_ws GET "${json}" breakdown workspace)
  run_tool(json --preset llama-3.2-1b --method qlora --seq 2048 --json)
  string(JSON default_ws GET "${json}" breakdown workspace)
  math(EXPR ws_change "${default_ws} - ${small_ws}")
  expect("--cublas-workspace-mib 8 takes 24 MiB off the workspace, got ${ws_change}" ws_change EQUAL 25165824)
  message(STATUS "metrics: sequence ${by_device} by device, ${by_allocated} by allocated")
elseif(MODE STREQUAL "bad_input")
  set(cases
    "--config;${DATA}/bad_model_type.json"
    "--config;${DATA}/bad_missing_field.json"
    "--config;${DATA}/bad_negative.json"
    "--config;${DATA}/bad_syntax.json"
    "--config;${DATA}/does_not_exist.json"
    "--config;${DATA}"
    "--preset;gpt2-124m;--gpu;v100"
    "--preset;no-such-model"
    "--preset;gpt2-124m;--batch;-2"
    "--preset;gpt2-124m;--seq;0"
    "--preset;gpt2-124m;--seq;4096"
    "--preset;gpt2-124m;--method;dora"
    "--preset;gpt2-124m;--offload;disk"
    "--preset;gpt2-124m;--zero;5"
    "--preset;gpt2-124m;--checkpointing;every:0"
    "--preset;gpt2-124m;--gpus;-1"
    "--preset;gpt2-124m;--max-batch"
    "--preset;gpt2-124m;--metric;peak"
    "--preset;gpt2-124m;--fragmentation;150"
    "--preset;gpt2-124m;--cuda-context-mib;-5"
    "--preset;gpt2-124m;--nccl-mib;99999999999"
    "--preset;gpt2-124m;--frobnicate")
  foreach(case IN LISTS cases)
    execute_process(COMMAND ${TOOL} ${case} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
    expect("exit code 2 for '${case}', got ${result}" result EQUAL 2)
    expect("one line on stderr for '${case}': ${errors}" errors MATCHES "^memkit-budget: error: [^\n]+\n$")
  endforeach()
  # An unknown name lists the presets there are.
  execute_process(COMMAND ${TOOL} --preset no-such-model ERROR_VARIABLE errors)
  expect("the model presets listed: ${errors}" errors MATCHES "unknown preset 'no-such-model' \\(known: llama-2-7b, [^\n]*, gpt2-1.5b\\)\n")
  execute_process(COMMAND ${TOOL} --preset gpt2-124m --gpu v100 ERROR_VARIABLE errors)
  expect("the GPU presets listed: ${errors}" errors MATCHES "unknown GPU 'v100' \\(known: t4, l4, [^\n]*, b200\\)\n")
  message(STATUS "bad_input: all rejected with exit code 2")
elseif(MODE STREQUAL "measured")
  # #33: the measured run nearest to the question, and memkit-budget's error on it. Asked exactly a measured
  # row's configuration, the nearest is that row (distance 0) and its prediction is the question's own figure.
  set(grid ${DATA}/../budget_measured/h200-2026-11-28.json)
  set(row_flags --preset llama-3.1-8b --method lora --lora-rank 16 --lora-targets q,k,v,o,gate,up,down --optimizer adamw
      --fp32-adapters --optimizer-impl fused --precision bf16 --attention flash --logits fp32 --seq 2048)
  run_tool(json ${row_flags} --measured ${grid} --json)
  string(JSON id GET "${json}" nearest_measured id)
  string(JSON distance GET "${json}" nearest_measured distance)
  string(JSON metric GET "${json}" nearest_measured metric)
  string(JSON predicted GET "${json}" nearest_measured predicted_bytes)
  string(JSON measured GET "${json}" nearest_measured measured_bytes)
  string(JSON device_peak GET "${json}" peak device)
  expect("the measured row itself, got ${id}" id STREQUAL "llama-3.1-8b/lora/fused/2048/none")
  expect("distance 0, got ${distance}" distance MATCHES "^0(\\.0*)?$")
  expect("the metric asked (device), got ${metric}" metric STREQUAL "device")
  expect("its prediction is the question's: ${predicted} == ${device_peak}" predicted EQUAL device_peak)
  expect("the row's measured device bytes, got ${measured}" measured EQUAL 40933064704)
  # --metric picks the figure compared; the table prints the line.
  run_tool(out ${row_flags} --measured ${grid} --metric allocated)
  expect("the nearest-run line: ${out}" out MATCHES
         "nearest measured run: llama-3.1-8b/lora/fused/2048/none \\(h200-2026-11-28.json, NVIDIA H200. distance 0.00\\): allocated measured 36.51 GiB")
  # A longer sequence of a smaller model: still LoRA, without checkpointing, the nearest by parameters and tokens.
  run_tool(json --preset llama-3.2-1b --method lora --seq 1024 --measured ${grid} --json)
  string(JSON id GET "${json}" nearest_measured id)
  expect("llama-3.2-1b LoRA at 512 or 2048 tokens without checkpointing, got ${id}" id MATCHES "^llama-3.2-1b/lora/fused/(512|2048)/none$")
  # No QLoRA run in that grid: no line. --measured none: no comparison at all.
  run_tool(json --preset llama-3.1-8b --method qlora --measured ${grid} --json)
  string(JSON id ERROR_VARIABLE missing GET "${json}" nearest_measured)
  expect("no nearest run for QLoRA in a grid without QLoRA rows" NOT missing STREQUAL "NOTFOUND")
  run_tool(json ${row_flags} --measured none --json)
  string(JSON id ERROR_VARIABLE missing GET "${json}" nearest_measured)
  expect("no comparison with --measured none" NOT missing STREQUAL "NOTFOUND")
  execute_process(COMMAND ${TOOL} --preset gpt2-124m --measured ${DATA}/does_not_exist.json RESULT_VARIABLE result
                  ERROR_VARIABLE errors)
  expect("exit code 2 for a missing measured file, got ${result}" result EQUAL 2)
  # A run whose flags do not parse: exit 2, naming the run and the file.
  file(WRITE ${WORK}/bad_measured.json [=[{"rows": [{"id": "bad-run", "gpu": "x", "memkit_model": {"preset": "gpt2-124m"},
    "memkit_flags": ["--batch", "0"], "unit": "GB", "metric": "allocated", "measured": 1.0}]}]=])
  execute_process(COMMAND ${TOOL} --preset gpt2-124m --measured ${WORK}/bad_measured.json RESULT_VARIABLE result
                  ERROR_VARIABLE errors)
  expect("exit code 2 for a bad measured run, got ${result}" result EQUAL 2)
  expect("the bad run named: ${errors}" errors MATCHES "^memkit-budget: error: measured run bad-run in [^\n]*bad_measured.json: ")
  message(STATUS "measured: the nearest run and its error")
else()
  message(FATAL_ERROR "unknown MODE ${MODE}")
endif()
