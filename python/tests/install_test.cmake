# cmake -DBUILD=<build dir> -DDEST=<staging dir> -DPY=<python> -DSITE=<install dir> -P install_test.cmake:
# stages `cmake --install <build> --component Python` under DESTDIR=<staging dir> and imports the
# staged package (not the build tree's) with the interpreter it was built for.
file(REMOVE_RECURSE "${DEST}")
execute_process(COMMAND ${CMAKE_COMMAND} -E env "DESTDIR=${DEST}" ${CMAKE_COMMAND} --install "${BUILD}" --component Python
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install --component Python failed:\n${out}${err}")
endif()
foreach(f _core.cpython presses.py reference.py __init__.py)
  file(GLOB hit "${DEST}${SITE}/kvevict/${f}*")
  if(NOT hit)
    message(FATAL_ERROR "the Python install has no ${DEST}${SITE}/kvevict/${f}*")
  endif()
endforeach()
set(check [=[
import sys, torch, kvevict
from kvevict import presses
assert kvevict.__file__.startswith(sys.argv[1]), kvevict.__file__
k, q = torch.randn(1, 2, 64, 8), torch.randn(1, 4, 64, 8)
keys, values = presses.SnapKV(budget=40, window=8)(k, k, q)
assert keys.shape == (1, 2, 40, 8)
print("installed kvevict works:", kvevict.__file__)
]=])
# run from the staging directory: the build tree's package must not shadow the installed one
execute_process(COMMAND ${CMAKE_COMMAND} -E env "PYTHONPATH=${DEST}${SITE}" ${PY} -c "${check}" "${DEST}"
                WORKING_DIRECTORY "${DEST}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the installed package does not import:\n${out}${err}")
endif()
message(STATUS "${out}")
