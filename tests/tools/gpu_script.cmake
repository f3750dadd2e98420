# `./dev.sh gpu`'s driver (bench/gpu/measure.py) where there is no GPU (CI): both scripts parse, the no-GPU
# path says so in one line and exits 0, and the report writer rebuilds the committed report of the last device
# run (docs/gpu/) from its results.json byte for byte, side-by-side table included.
# Run as: cmake -DPYTHON=... -DSOURCE_DIR=... -DWORK_DIR=... -P gpu_script.cmake
foreach(script bench/gpu/measure.py bench/gpu/peer_wheels.py bench/peers/gpu_peers.py bench/peers/sdpa_device.py
       bench/peers/error_line.py)
  execute_process(COMMAND ${PYTHON} -c "import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])" ${SOURCE_DIR}/${script}
    RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${script} does not compile: ${err}")
  endif()
endforeach()

# A check script of tests/tools/ that prints "<name>: ok" when every check in it passed.
function(run_measure_check name what)
  execute_process(COMMAND ${PYTHON} ${SOURCE_DIR}/tests/tools/${name}.py
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "${name}: ok")
    message(FATAL_ERROR "${what}: exit ${rc}: ${out}${err}")
  endif()
endfunction()

# The longctx step's parser and table (#31) on the lines train_llama --max-seq-search prints.
run_measure_check(measure_longctx_check "the longctx step's parser")

# #29's attention matrix: shapes shared with bench/attention_cuda.cu, FlashAttention's count, the pairing with
# torch's SDPA rows, the table and targets, and how the 32K rows are fitted into the time budget.
run_measure_check(measure_attention_check "the attention matrix")

# #30's carried peers: Liger's loss rows paired and tabulated (runs before them unchanged), the wheels installed.
run_measure_check(measure_peers_check "the carried peers")

# ... and the PyTorch search it runs beside memkit's: memory_grid.py's plan for it (--list needs no torch).
execute_process(COMMAND ${PYTHON} ${SOURCE_DIR}/bench/peers/memory_grid.py --list --models llama-3.1-8b
    --longest qlora:8,24 --no-rows --lora-rank 32
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out STREQUAL "longest llama-3.1-8b qlora r=32 alpha=64 on all seven projections (checkpointing) under 8, 24 GiB\n0 rows, 2 longest searches\n")
  message(FATAL_ERROR "memory_grid.py --longest: exit ${rc}: '${out}${err}'")
endif()

file(REMOVE_RECURSE ${WORK_DIR})
# torch's SDPA against tests/data/attention (bench/peers/sdpa_device.py) without a device: one line, exit 0, and a
# skipped row for measure.py (CUDA_VISIBLE_DEVICES empty, so that a CI machine with a GPU and torch takes it too).
execute_process(COMMAND ${CMAKE_COMMAND} -E env CUDA_VISIBLE_DEVICES= ${PYTHON} ${SOURCE_DIR}/bench/peers/sdpa_device.py
    --out ${WORK_DIR}/sdpa_device.json
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "^sdpa_device: [^\n]*: nothing measured\n$")
  message(FATAL_ERROR "sdpa_device.py without a GPU: exit ${rc}, output '${out}${err}'")
endif()
file(READ ${WORK_DIR}/sdpa_device.json rows)
if(NOT rows MATCHES "\"skipped\"")
  message(FATAL_ERROR "sdpa_device.py without a GPU wrote no skipped row: ${rows}")
endif()
execute_process(COMMAND ${PYTHON} ${SOURCE_DIR}/bench/gpu/measure.py ${WORK_DIR}/none --nvidia-smi ${WORK_DIR}/no-such-nvidia-smi
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "^memkit gpu: no NVIDIA GPU here \\([^\n]*\\): nothing measured\n$")
  message(FATAL_ERROR "no-GPU path: exit ${rc}, output '${out}${err}'")
endif()
if(EXISTS ${WORK_DIR}/none)
  message(FATAL_ERROR "the no-GPU path created its output directory")
endif()

file(GLOB runs LIST_DIRECTORIES true ${SOURCE_DIR}/docs/gpu/*/results.json)
list(LENGTH runs count)
if(count EQUAL 0)
  message(FATAL_ERROR "no committed device run under docs/gpu/*/results.json")
endif()
foreach(results_json ${runs})
  get_filename_component(run_dir ${results_json} DIRECTORY)
  get_filename_component(run ${run_dir} NAME)
  execute_process(COMMAND ${PYTHON} ${SOURCE_DIR}/bench/gpu/measure.py ${WORK_DIR}/${run} --report-from ${results_json}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "--report-from ${results_json}: exit ${rc}: ${out}${err}")
  endif()
  file(READ ${run_dir}/results.md committed)
  file(READ ${WORK_DIR}/${run}/results.md rebuilt)
  if(NOT committed STREQUAL rebuilt)
    message(FATAL_ERROR "${run_dir}/results.md differs from the report rebuilt from its results.json "
      "(diff ${run_dir}/results.md ${WORK_DIR}/${run}/results.md)")
  endif()
  message(STATUS "docs/gpu/${run}: report rebuilt identically")
endforeach()

# docs/cuda.md carries the newest run's side-by-side table as generated (the rows of results.md's
# "## Side by side" section, verbatim).
list(SORT runs)
list(GET runs -1 newest)
get_filename_component(newest_dir ${newest} DIRECTORY)
file(READ ${newest_dir}/results.md newest_md)
string(FIND "${newest_md}" "## Side by side" begin)
if(begin LESS 0)
  message(FATAL_ERROR "${newest_dir}/results.md has no side-by-side section")
endif()
string(SUBSTRING "${newest_md}" ${begin} -1 section)
string(FIND "${section}" "\n## " end)  # the section ends at the next heading
if(end GREATER 0)
  string(SUBSTRING "${section}" 0 ${end} section)
endif()
string(FIND "${section}" "| operation |" table_begin)
string(SUBSTRING "${section}" ${table_begin} -1 table)
string(STRIP "${table}" table)
file(READ ${SOURCE_DIR}/docs/cuda.md cuda_md)
string(FIND "${cuda_md}" "${table}" found)
if(found LESS 0)
  message(FATAL_ERROR "docs/cuda.md does not carry the side-by-side table of ${newest_dir}/results.md verbatim")
endif()
message(STATUS "docs/cuda.md carries the table of ${newest_dir}")

# Where the newest run measured #29's attention matrix, docs/attention.md carries its table verbatim (the rows of
# results.md's "## Attention against torch's SDPA (#29)" section; runs before the matrix have none).
string(FIND "${newest_md}" "## Attention against torch's SDPA (#29)" begin)
if(begin GREATER_EQUAL 0)
  string(SUBSTRING "${newest_md}" ${begin} -1 section)
  string(FIND "${section}" "| pass |" table_begin)
  string(SUBSTRING "${section}" ${table_begin} -1 table)
  string(FIND "${table}" "\n## " end)
  if(end GREATER 0)
    string(SUBSTRING "${table}" 0 ${end} table)
  endif()
  string(STRIP "${table}" table)
  file(READ ${SOURCE_DIR}/docs/attention.md attention_md)
  string(FIND "${attention_md}" "${table}" found)
  if(found LESS 0)
    message(FATAL_ERROR "docs/attention.md does not carry the attention table of ${newest_dir}/results.md verbatim")
  endif()
  message(STATUS "docs/attention.md carries the attention table of ${newest_dir}")
endif()
