# memkit-consolidate end to end: the rank files of a 3-rank save (tests/tools/make_shard_files.cpp) become the
# unsharded export byte for byte; a missing rank file and bad options are refused with exit 2 and no output.
# Run with -DTOOL=memkit-consolidate -DMAKE=make_shard_files -DWORK=dir -P.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
execute_process(COMMAND ${MAKE} ${WORK} 3 RESULT_VARIABLE result ERROR_VARIABLE errors)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "make_shard_files failed (${result}): ${errors}")
endif()
execute_process(COMMAND ${TOOL} --out ${WORK}/model.safetensors --chunk-mib 1 ${WORK}/rank2.safetensors
                        ${WORK}/rank0.safetensors ${WORK}/rank1.safetensors
                RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
if(NOT result EQUAL 0 OR NOT output MATCHES "4 tensors from 3 rank files")
  message(FATAL_ERROR "memkit-consolidate failed (${result}): ${output}${errors}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${WORK}/model.safetensors ${WORK}/expected.safetensors
                RESULT_VARIABLE different)
if(different)
  message(FATAL_ERROR "the consolidated file differs from the unsharded export")
endif()
function(expect_refused what needle)
  execute_process(COMMAND ${TOOL} ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
  string(FIND "${errors}" "${needle}" at)
  if(NOT result EQUAL 2 OR at EQUAL -1 OR EXISTS ${WORK}/refused.safetensors)
    message(FATAL_ERROR "${what}: expected exit 2 and '${needle}', got ${result}: ${output}${errors}")
  endif()
endfunction()
expect_refused("a missing rank" "was saved by 3 ranks, but 2 images were given"
               --out ${WORK}/refused.safetensors ${WORK}/rank0.safetensors ${WORK}/rank1.safetensors)
expect_refused("no rank files" "at least one rank file" --out ${WORK}/refused.safetensors)
expect_refused("a bad dtype" "--dtype must be" --dtype int4 --out ${WORK}/refused.safetensors ${WORK}/rank0.safetensors)
expect_refused("a bad chunk" "--chunk-mib must be 1 to 4096" --chunk-mib 0 --out ${WORK}/refused.safetensors ${WORK}/rank0.safetensors)
message(STATUS "consolidate_cli: 3 rank files -> the unsharded export byte for byte; bad input refused")
