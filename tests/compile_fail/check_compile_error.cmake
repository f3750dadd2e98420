# Compiles SOURCE with -DMEMKIT_CASE_${CASE}. With EXPECT empty it must compile; otherwise it must fail
# with an error matching the regular expression EXPECT.
#   cmake -DCXX=... -DINCLUDE_DIR=... -DSOURCE=... -DCASE=... [-DEXPECT=regex] -P this
cmake_minimum_required(VERSION 3.25)
set(ENV{LC_ALL} C)  # ASCII quotes in the compiler's messages
execute_process(COMMAND ${CXX} -std=c++20 -Wall -Wextra -I${INCLUDE_DIR} -DMEMKIT_CASE_${CASE} -fsyntax-only ${SOURCE}
  RESULT_VARIABLE result ERROR_VARIABLE errors OUTPUT_VARIABLE output)
if(NOT EXPECT)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "${CASE} did not compile:\n${errors}")
  endif()
  message(STATUS "${CASE}: compiled")
  return()
endif()
if(result EQUAL 0)
  message(FATAL_ERROR "${CASE} compiled, but must be rejected")
endif()
if(NOT errors MATCHES "${EXPECT}")
  message(FATAL_ERROR "${CASE} was rejected without saying '${EXPECT}':\n${errors}")
endif()
message(STATUS "${CASE}: rejected with '${EXPECT}'")
