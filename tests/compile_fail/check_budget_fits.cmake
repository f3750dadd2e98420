# Runs the compile-time fit checks of budget_fits.cpp with the C++ compiler CXX.
#   cmake -DCXX=... -DINCLUDE_DIR=... -DSOURCE=.../budget_fits.cpp -DWORK=... -DCASE=FITS|DOES_NOT_FIT|INVALID -P this
cmake_minimum_required(VERSION 3.25)
file(MAKE_DIRECTORY ${WORK})
set(flags -std=c++20 -Wall -Wextra -I${INCLUDE_DIR})
set(ENV{LC_ALL} C)  # ASCII quotes in the compiler's messages

if(CASE STREQUAL "FITS")
  execute_process(COMMAND ${CXX} ${flags} -DMEMKIT_CASE_FITS -fsyntax-only ${SOURCE}
    RESULT_VARIABLE result ERROR_VARIABLE errors OUTPUT_VARIABLE output)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "the fitting case did not compile:\n${errors}")
  endif()
  message(STATUS "fits: compiled")
  return()
endif()

if(CASE STREQUAL "INVALID")
  execute_process(COMMAND ${CXX} ${flags} -DMEMKIT_CASE_INVALID -fsyntax-only ${SOURCE}
    RESULT_VARIABLE result ERROR_VARIABLE errors OUTPUT_VARIABLE output)
  if(result EQUAL 0)
    message(FATAL_ERROR "the invalid plan compiled")
  endif()
  if(NOT errors MATCHES "model_or_plan_is_invalid")
    message(FATAL_ERROR "the error does not name the invalid plan:\n${errors}")
  endif()
  message(STATUS "invalid: rejected")
  return()
endif()

# DOES_NOT_FIT: learn the expected numbers from the same configuration at run time ...
execute_process(COMMAND ${CXX} ${flags} -DMEMKIT_PRINT_EXPECTED ${SOURCE} -o ${WORK}/print_expected
  RESULT_VARIABLE result ERROR_VARIABLE errors)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "could not build the expectation printer:\n${errors}")
endif()
execute_process(COMMAND ${WORK}/print_expected RESULT_VARIABLE result OUTPUT_VARIABLE expected
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "the too-big configuration fits at run time: ${expected}")
endif()
list(GET expected 0 needed_mib)
list(GET expected 1 available_mib)
list(GET expected 2 largest)

# ... then the static_assert must fail and quote them.
execute_process(COMMAND ${CXX} ${flags} -DMEMKIT_CASE_DOES_NOT_FIT -fsyntax-only ${SOURCE}
  RESULT_VARIABLE result ERROR_VARIABLE errors OUTPUT_VARIABLE output)
if(result EQUAL 0)
  message(FATAL_ERROR "static_assert(memkit::fits(...)) compiled for a run that does not fit")
endif()
if(NOT CXX_ID STREQUAL "GNU")
  # Clang quotes the call with its arguments: training_step_does_not_fit(NEEDED_BYTES, AVAILABLE_BYTES, ...).
  if(NOT errors MATCHES "training_step_does_not_fit\\([0-9]+, [0-9]+")
    message(FATAL_ERROR "the error does not show the numbers:\n${errors}")
  endif()
  message(STATUS "does not fit: rejected with the numbers")
  return()
endif()
set(pattern "value '${needed_mib}' is outside the bounds of array [^\n]*device_mib_with_largest_category<[a-z0-9_:]*category::${largest}> \\[${available_mib}\\]")
if(NOT errors MATCHES "${pattern}")
  message(FATAL_ERROR "the error does not show ${needed_mib} MiB needed, ${available_mib} MiB available, "
                      "largest category ${largest}:\n${errors}")
endif()
message(STATUS "does not fit: the error shows ${needed_mib} MiB needed, ${available_mib} MiB available, largest ${largest}")
