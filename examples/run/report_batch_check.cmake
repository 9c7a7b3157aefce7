# cmake -DRUN=<kvevict-run> -DCOMPARE=<compare_json.py> -DWORK=<dir> -P report_batch_check.cmake:
# `kvevict-run --report --batch` (report.hpp, report_options::batch) against the unbatched report on
# the same prompts: every non-timing number of report.json must be equal bit for bit (compare_json.py),
# with post-fill, chunked and decode-time rows, an odd prompt count (a short last batch) and a
# page size that splits the prompts' pages differently.
find_program(_python NAMES python3 python REQUIRED)
set(_args --report --prompts 3 --recipes snapkv,h2o --budgets 32 --threads 1)
function(run_report name)
  file(MAKE_DIRECTORY ${WORK}/report-${name})
  execute_process(COMMAND ${RUN} ${_args} ${ARGN} --out-dir ${WORK}/report-${name}
                  OUTPUT_QUIET ERROR_VARIABLE _err RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "the ${name} report failed: ${_err}")
  endif()
endfunction()
run_report(alone)
run_report(batched --batch 2 --page-size 7)
execute_process(COMMAND ${_python} ${COMPARE} ${WORK}/report-alone/report.json ${WORK}/report-batched/report.json
                OUTPUT_VARIABLE _out ERROR_VARIABLE _out RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "the batched report differs from the unbatched one:\n${_out}")
endif()
message(STATUS "${_out}")
