# Runs REF and RUN (each a command, "@@"-separated, each given --out-dir <its own directory>) and
# requires compare_json.py (PYTHON, COMPARE) to find every number of RUN's report.json but the
# times equal to REF's: the sharded quality report against one process's (examples/run/CMakeLists.txt).
string(REPLACE "@@" ";" ref "${REF}")
string(REPLACE "@@" ";" run "${RUN}")
file(REMOVE_RECURSE "${DIR}")
file(MAKE_DIRECTORY "${DIR}/one" "${DIR}/sharded")
execute_process(COMMAND ${ref} --out-dir "${DIR}/one" RESULT_VARIABLE rc1 OUTPUT_QUIET ERROR_VARIABLE err1)
if(NOT rc1 EQUAL 0)
  message(FATAL_ERROR "the one-process report failed (status ${rc1}): ${err1}")
endif()
execute_process(COMMAND ${run} --out-dir "${DIR}/sharded" RESULT_VARIABLE rc2 OUTPUT_QUIET ERROR_VARIABLE err2)
if(NOT rc2 EQUAL 0)
  message(FATAL_ERROR "the sharded report failed (status ${rc2}): ${err2}")
endif()
execute_process(COMMAND "${PYTHON}" "${COMPARE}" "${DIR}/one/report.json" "${DIR}/sharded/report.json"
                RESULT_VARIABLE rc3 OUTPUT_VARIABLE out3 ERROR_VARIABLE err3)
if(NOT rc3 EQUAL 0 OR NOT out3 MATCHES " 0 differ" OR out3 MATCHES "not computed by the new run: [1-9]")
  message(FATAL_ERROR "the sharded report differs from one process's (status ${rc3}):\n${out3}${err3}")
endif()
# the sharded run measures its times (the slowest rank's): some prefill and eviction time is not 0
file(READ "${DIR}/sharded/report.json" json)
if(NOT json MATCHES "\"prefill_ms\": [0-9]*\\.?[0-9]*[1-9]" OR NOT json MATCHES "\"evict_ms\": [0-9]*\\.?[0-9]*[1-9]")
  message(FATAL_ERROR "the sharded report.json has no measured prefill_ms / evict_ms")
endif()
message(STATUS "${out3}")
