# Vendoring: copy include/ into another tree and compile against it with the bare compiler, no CMake target.
# -DINCLUDE_DIR=memkit/include -DWORK=dir -DCXX=compiler -DMAIN=source
file(REMOVE_RECURSE ${WORK})
file(COPY ${INCLUDE_DIR}/ DESTINATION ${WORK}/third_party/memkit/include)
execute_process(COMMAND ${CXX} -std=c++20 -Wall -Wextra -Werror -I${WORK}/third_party/memkit/include ${MAIN}
  -o ${WORK}/consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "compiling against the vendored headers failed (${rc})")
endif()
execute_process(COMMAND ${WORK}/consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the vendored consumer exited with ${rc}")
endif()
