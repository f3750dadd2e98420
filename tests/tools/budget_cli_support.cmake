# Helpers shared by the memkit-budget CTest drivers (budget_cli*.cmake), each run with -DTOOL=... -P.

# Runs the tool with ARGN and stores what it printed on stdout in out_var; fails the test on a non-zero exit.
function(run_tool out_var)
  execute_process(COMMAND ${TOOL} ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "memkit-budget ${ARGN} failed (${result}): ${errors}")
  endif()
  set(${out_var} "${output}" PARENT_SCOPE)
endfunction()

# Fails the test with "expected <condition_text>" unless the condition (if() syntax) holds.
function(expect condition_text)
  if(NOT (${ARGN}))
    message(FATAL_ERROR "expected ${condition_text}")
  endif()
endfunction()
