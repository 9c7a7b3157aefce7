# cmake -DRUN=<kvevict-run> -P batch_check.cmake: `kvevict-run --batch` (batch/batch.hpp: one batched
# forward per step, 4 sequences on 3 slots, the last joining when one leaves) against each prompt run
# alone, for a few recipes x drivers: the batch's greedy ids must equal, line by line, the
# single-sequence runs' (which use the default page size, the batch page size 7: paging must not
# change a bit either).
set(_p0 "Lily and Ben went to the park. They saw a big dog. The dog was friendly and wanted to play.")
set(_p1 "Tom had a big red truck")
set(_p2 "The sun was shining and the birds sang in the tall trees by the river where the")
set(_configs "full postfill" "snapkv postfill" "h2o decode" "lava chunked-patched" "adakv layerwise"
             "pyramidkv chunked-naive" "lookaheadkv postfill" "oracle postfill" "tova decode")
foreach(_c IN LISTS _configs)
  separate_arguments(_c)
  list(GET _c 0 _recipe)
  list(GET _c 1 _driver)
  set(_evict "")
  if(NOT _recipe STREQUAL "full")
    set(_evict --recipe ${_recipe} --driver ${_driver} --budget 12 --chunk 8)
  endif()
  execute_process(COMMAND ${RUN} --ids --steps 72 ${_evict} --page-size 7 --batch 4 --batch-slots 3 --prompt "${_p0}"
                          --batch-prompt "${_p1}" "${_p2}"
                  OUTPUT_VARIABLE _batch ERROR_VARIABLE _err RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${_recipe} / ${_driver}: the batch failed: ${_err}")
  endif()
  set(_solo "")
  foreach(_p IN ITEMS "${_p0}" "${_p1}" "${_p2}" "${_p0}")
    execute_process(COMMAND ${RUN} --ids --steps 72 ${_evict} --prompt "${_p}" OUTPUT_VARIABLE _one RESULT_VARIABLE _rc)
    if(NOT _rc EQUAL 0)
      message(FATAL_ERROR "${_recipe} / ${_driver}: a single run failed")
    endif()
    string(APPEND _solo "${_one}")
  endforeach()
  if(NOT _batch STREQUAL _solo)
    message(FATAL_ERROR "${_recipe} / ${_driver}: the batch's tokens differ from the single runs'\nbatch:\n${_batch}\nalone:\n${_solo}")
  endif()
  message(STATUS "${_recipe} / ${_driver}: 4 sequences equal to their single runs")
endforeach()
