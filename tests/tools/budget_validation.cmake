# CTest driver: memkit-budget-validation --check must fail on a stale table and on an unexplained miss, and a
# row whose configuration disagrees with its flags is refused.
#   cmake -DTOOL=memkit-budget-validation -DBUDGET=memkit-budget -DROOT=<source dir> -DWORK=<dir> -P this
cmake_minimum_required(VERSION 3.25)
file(MAKE_DIRECTORY ${WORK})
file(READ ${ROOT}/docs/memory_budget.md doc)

function(expect_check_fails name text needle)
  file(WRITE ${WORK}/${name}.md "${text}")
  execute_process(COMMAND ${TOOL} --budget ${BUDGET} --root ${ROOT} --check ${WORK}/${name}.md
                  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
  if(NOT result EQUAL 1)
    message(FATAL_ERROR "${name}: --check returned ${result}, expected 1: ${output}${errors}")
  endif()
  string(FIND "${errors}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${name}: expected '${needle}' in: ${errors}")
  endif()
endfunction()

# One measured figure changed in the generated table: the table is no longer what the data give.
string(FIND "${doc}" "| 19.77 GB |" at)
if(at EQUAL -1)
  message(FATAL_ERROR "the table has no '| 19.77 GB |' cell to alter")
endif()
string(REPLACE "| 19.77 GB |" "| 19.78 GB |" stale "${doc}")
expect_check_fails(stale "${stale}" "not current")

# A miss over 15% whose id is no longer named outside the table.
string(REPLACE "`hf-bert-large-vanilla`" "`the vanilla run`" unexplained "${doc}")
expect_check_fails(unexplained "${unexplained}" "hf-bert-large-vanilla misses by")

# A row whose stated configuration disagrees with its memkit-budget flags is refused (exit 2, named).
file(READ ${ROOT}/tests/data/budget_validation/measurements.json data)
string(JSON first GET "${data}" rows 0)
string(JSON first SET "${first}" micro_batch 3)
string(JSON mismatched SET "{\"rows\": []}" rows 0 "${first}")
file(WRITE ${WORK}/mismatched.json "${mismatched}")
execute_process(COMMAND ${TOOL} --budget ${BUDGET} --root ${ROOT} --data ${WORK}/mismatched.json
                RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE errors)
if(NOT result EQUAL 2)
  message(FATAL_ERROR "mismatched row: exit ${result}, expected 2: ${output}${errors}")
endif()
string(FIND "${errors}" "micro_batch is 3 but --batch" at)
if(at EQUAL -1)
  message(FATAL_ERROR "mismatched row: expected 'micro_batch is 3 but --batch' in: ${errors}")
endif()
