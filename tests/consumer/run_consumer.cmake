# Builds and runs a consumer project against kvevict, the way a user would.
#   MODE=find_package      install kvevict into a prefix, then find_package(kvevict CONFIG) from it
#   MODE=add_subdirectory  add_subdirectory(<kvevict source>) from the consumer's CMakeLists
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()

set(extra)
if(MODE STREQUAL "find_package")
  set(prefix "${WORK_DIR}/prefix")
  run(${CMAKE_COMMAND} --install "${KVEVICT_BINARY_DIR}" --prefix "${prefix}")
  if(NOT EXISTS "${prefix}/share/cmake/kvevict/kvevictConfigVersion.cmake")
    message(FATAL_ERROR "install did not produce kvevictConfigVersion.cmake")
  endif()
  set(extra "-DCMAKE_PREFIX_PATH=${prefix}")
else()
  set(extra "-DKVEVICT_SOURCE_DIR=${KVEVICT_SOURCE_DIR}")
endif()

run(${CMAKE_COMMAND} -S "${CMAKE_CURRENT_LIST_DIR}/${MODE}" -B "${WORK_DIR}/build"
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release ${extra})
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run("${WORK_DIR}/build/consumer")
message(STATUS "consumer (${MODE}) built and ran")
