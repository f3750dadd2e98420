# Runs COMMAND with ARGS (a ;-list) and fails unless it exits with EXPECT_EXIT and its output contains
# EXPECT_MESSAGE. cmake -DCOMMAND=... -DARGS=... -DEXPECT_EXIT=... -DEXPECT_MESSAGE=... -P expect_exit.cmake
execute_process(COMMAND ${COMMAND} ${ARGS} RESULT_VARIABLE exit_code OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT exit_code STREQUAL "${EXPECT_EXIT}")
  message(FATAL_ERROR "expected exit code ${EXPECT_EXIT}, got ${exit_code}")
endif()
string(FIND "${out}${err}" "${EXPECT_MESSAGE}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "expected the output to contain: ${EXPECT_MESSAGE}")
endif()
message("exit code ${exit_code} and the expected message: ok")
