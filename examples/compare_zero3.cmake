# #32: the example's --zero 3 run on two MPI ranks against the plain example (one process, no MPI) on the same
# command line. The two-rank run must pass --check on every rank (the loss falls, each category's peak predicted
# within 2%, memory_budget's --zero 3 within 2%); both must print the same checksum of the trained parameters and
# the same validation loss: bit for bit, since every rank trains on the same batches (the mean of two ranks'
# equal gradients is each one's exactly).
# cmake -DMPIEXEC=... -DMPIEXEC_FLAGS=a;b -DNP_FLAG=-np -DCOMMAND=mpi-build -DREFERENCE=plain-build -DARGS=a;b
#       -DOUT=dir -P compare_zero3.cmake
function(run_checked what result)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("---- ${what}, exit ${code}\n${out}${err}")
  if(NOT code EQUAL 0)
    message(FATAL_ERROR "${what} exited with ${code}")
  endif()
  set(${result} "${out}" PARENT_SCOPE)
endfunction()

run_checked("--zero 3 on 2 ranks" two ${MPIEXEC} ${NP_FLAG} 2 ${MPIEXEC_FLAGS} ${COMMAND} ${ARGS} --zero 3 --check --out ${OUT}/np2)
run_checked("one process" one ${REFERENCE} ${ARGS} --out ${OUT}/one)
foreach(pattern "trained parameters: checksum [0-9a-f]+" "validation loss after: +[0-9.]+")
  string(REGEX MATCH "${pattern}" a "${two}")
  string(REGEX MATCH "${pattern}" b "${one}")
  if(a STREQUAL "" OR NOT a STREQUAL b)
    message(FATAL_ERROR "two ranks printed '${a}', one process '${b}'")
  endif()
  message("equal on 2 ranks and in one process: ${a}")
endforeach()
string(REGEX MATCHALL "check: FAIL[^\n]*" failed "${two}")
if(failed OR NOT two MATCHES "check: ok   memory_budget" OR NOT two MATCHES "check: ok   the training loss falls")
  message(FATAL_ERROR "the two-rank run's checks: ${failed}")
endif()
