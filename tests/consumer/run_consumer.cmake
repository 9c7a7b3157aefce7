# kvevict's consumer tests (CTest label `consumer`), each a cmake -P run of one MODE:
#   cccl_prefix       copies the CCCL kvevict was built with (headers + CMake package) into
#                     CCCL_PREFIX, laid out as NVIDIA's standalone CCCL release installs it
#   find_package      installs kvevict (component Development) into a prefix; with the CUDA toolkit
#                     hidden, a configure without CCCL must fail naming both ways to provide it,
#                     and the consumer (Release), found through CMAKE_PREFIX_PATH=<kvevict>;
#                     <CCCL_PREFIX>, links kvevict::openmp and runs seq and par
#   add_subdirectory  add_subdirectory(<kvevict source>) with -DCCCL_DIR=<CCCL_PREFIX>/lib/cmake/cccl
#                     and nvcc on PATH: no CUDA probing; without OpenMP the consumer (Debug) runs
#                     seq and a use of par fails to compile with require_openmp's message
#   installed_tools   installs the tools and models (component Tools), moves the prefix, and runs
#                     kvevict-run, kvevict-lookahead and kvevict from it with their default models
# Inputs: MODE WORK_DIR KVEVICT_SOURCE_DIR KVEVICT_BINARY_DIR CXX_COMPILER CCCL_PREFIX
#         CCCL_CONFIG_DIR (the build's cccl-config.cmake directory) CCCL_INCLUDE_DIR (its headers)
cmake_minimum_required(VERSION 3.25)
set(consumer_source "${CMAKE_CURRENT_LIST_DIR}")

# run(<command>... [EXPECT_FAIL] [ENV <var=value>...] [OUT <var>]): runs a command; it must succeed
# (or fail, with EXPECT_FAIL); OUT receives stdout + stderr.
function(run)
  cmake_parse_arguments(A "EXPECT_FAIL" "OUT" "ENV" ${ARGN})
  set(cmd ${A_UNPARSED_ARGUMENTS})
  if(A_ENV)
    set(cmd ${CMAKE_COMMAND} -E env ${A_ENV} ${cmd})
  endif()
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(A_EXPECT_FAIL AND rc EQUAL 0)
    message(FATAL_ERROR "expected a failure, but it succeeded: ${cmd}\n${out}\n${err}")
  elseif(NOT A_EXPECT_FAIL AND NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${cmd}\n${out}\n${err}")
  endif()
  if(A_OUT)
    set(${A_OUT} "${out}${err}" PARENT_SCOPE)
  endif()
endfunction()

# expect(<text> <regex> <what>): fails the test unless text matches regex.
function(expect text regex what)
  if(NOT text MATCHES "${regex}")
    message(FATAL_ERROR "${what}: expected a match for '${regex}' in:\n${text}")
  endif()
endfunction()

# expect_literal(<text> <substring> <what>): the same for a literal substring (paths).
function(expect_literal text substring what)
  string(FIND "${text}" "${substring}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${what}: expected '${substring}' in:\n${text}")
  endif()
endfunction()

# configure(<build dir> <build type> <args>...) -> configure_ms: configures the consumer, timed.
function(configure dir build_type)
  string(TIMESTAMP t0 "%s%f" UTC)
  run(${CMAKE_COMMAND} -S "${consumer_source}" -B "${dir}" -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
      -DCMAKE_BUILD_TYPE=${build_type} -DCMAKE_EXPORT_COMPILE_COMMANDS=ON ${ARGN})
  string(TIMESTAMP t1 "%s%f" UTC)
  math(EXPR ms "(${t1} - ${t0}) / 1000")
  set(configure_ms ${ms} PARENT_SCOPE)
endfunction()

# The consumer must compile against the CCCL in CCCL_PREFIX, never the toolkit's.
function(expect_cccl_prefix build_dir)
  file(READ "${build_dir}/compile_commands.json" commands)
  expect_literal("${commands}" "${CCCL_PREFIX}/include" "the consumer's compile commands")
  string(FIND "${commands}" "${toolkit_root}/include" at)
  if(toolkit_root AND NOT at EQUAL -1)
    message(FATAL_ERROR "the consumer compiles against the toolkit's headers (${toolkit_root}/include)")
  endif()
endfunction()

# The toolkit kvevict's build found CCCL in (<root>/lib64/cmake/cccl), if it was one.
get_filename_component(toolkit_root "${CCCL_CONFIG_DIR}/../../.." ABSOLUTE)
if(NOT EXISTS "${toolkit_root}/include/cuda_runtime.h" AND NOT EXISTS "${toolkit_root}/bin/nvcc")
  set(toolkit_root "")
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

if(MODE STREQUAL "cccl_prefix")
  file(REMOVE_RECURSE "${CCCL_PREFIX}")
  foreach(dir cuda cub thrust nv)
    if(NOT IS_DIRECTORY "${CCCL_INCLUDE_DIR}/${dir}")
      message(FATAL_ERROR "no ${dir}/ in CCCL's include directory ${CCCL_INCLUDE_DIR}")
    endif()
    file(COPY "${CCCL_INCLUDE_DIR}/${dir}" DESTINATION "${CCCL_PREFIX}/include")
  endforeach()
  foreach(pkg cccl libcudacxx cub thrust)
    file(COPY "${CCCL_CONFIG_DIR}/../${pkg}" DESTINATION "${CCCL_PREFIX}/lib/cmake")
  endforeach()
  message(STATUS "CCCL from ${CCCL_INCLUDE_DIR} copied into ${CCCL_PREFIX}")

elseif(MODE STREQUAL "find_package")
  set(prefix "${WORK_DIR}/prefix")
  run(${CMAKE_COMMAND} --install "${KVEVICT_BINARY_DIR}" --prefix "${prefix}" --component Development)
  foreach(f share/cmake/kvevict/kvevictConfigVersion.cmake share/cmake/kvevict/kvevictOpenMPTargets.cmake
            include/kvevict/kvevict.hpp)
    if(NOT EXISTS "${prefix}/${f}")
      message(FATAL_ERROR "the Development install has no ${f}")
    endif()
  endforeach()
  if(EXISTS "${prefix}/bin")
    message(FATAL_ERROR "the Development component installed bin/ (the tools are component Tools)")
  endif()

  # Hide the toolkit: its CCCL packages are ignored (an initial cache) and no environment variable
  # points at it.
  set(ignore_prefixes)
  set(ignore_dirs)
  foreach(root "${toolkit_root}" /usr/local/cuda "$ENV{CUDA_PATH}" "$ENV{CUDA_HOME}")
    if(root AND IS_DIRECTORY "${root}")
      file(REAL_PATH "${root}" real)
      foreach(r "${root}" "${real}")
        list(APPEND ignore_prefixes "${r}")
        foreach(lib lib64 lib)
          foreach(pkg cccl libcudacxx cub thrust)
            list(APPEND ignore_dirs "${r}/${lib}/cmake/${pkg}")
          endforeach()
        endforeach()
      endforeach()
    endif()
  endforeach()
  list(REMOVE_DUPLICATES ignore_prefixes)
  list(REMOVE_DUPLICATES ignore_dirs)
  file(WRITE "${WORK_DIR}/hide-toolkit.cmake"
    "set(CMAKE_IGNORE_PREFIX_PATH \"${ignore_prefixes}\" CACHE STRING \"\")\n"
    "set(CMAKE_IGNORE_PATH \"${ignore_dirs}\" CACHE STRING \"\")\n")
  set(hidden -C "${WORK_DIR}/hide-toolkit.cmake" -DKVEVICT_VIA=find_package
      ENV --unset=CUDA_PATH --unset=CUDA_HOME --unset=CUDAToolkit_ROOT --unset=CCCL_DIR)

  # Without CCCL: one clear error naming both ways.
  run(${CMAKE_COMMAND} -S "${consumer_source}" -B "${WORK_DIR}/no-cccl" -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
      ${hidden} "CMAKE_PREFIX_PATH=${prefix}" EXPECT_FAIL OUT out)
  expect_literal("${out}" "kvevict needs CCCL's headers" "the configure without CCCL")
  expect_literal("${out}" "-DCCCL_DIR=" "the configure without CCCL")
  expect_literal("${out}" "CMAKE_PREFIX_PATH" "the configure without CCCL")
  expect_literal("${out}" "CUDA Toolkit" "the configure without CCCL")

  # With the standalone CCCL in the prefix path: OpenMP on, par and seq.
  configure("${WORK_DIR}/build" Release -DWITH_OPENMP=ON ${hidden} "CMAKE_PREFIX_PATH=${prefix}:${CCCL_PREFIX}")
  message(STATUS "find_package configure: ${configure_ms} ms")
  expect_cccl_prefix("${WORK_DIR}/build")
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
  run("${WORK_DIR}/build/consumer" ENV OMP_WAIT_POLICY=PASSIVE OUT out)
  expect("${out}" "consumer ok: seq and par .OpenMP." "the OpenMP consumer")

elseif(MODE STREQUAL "add_subdirectory")
  # nvcc on PATH, so a CUDA probe would find it
  set(path "$ENV{PATH}")
  if(toolkit_root AND EXISTS "${toolkit_root}/bin/nvcc")
    set(path "${toolkit_root}/bin:${path}")
  endif()
  # Debug (-O0, CCCL's assertions on): a third of Release's compile time, and the other configuration
  configure("${WORK_DIR}/build" Debug -DKVEVICT_VIA=add_subdirectory "-DKVEVICT_SOURCE_DIR=${KVEVICT_SOURCE_DIR}"
            -DWITH_OPENMP=OFF "-DCCCL_DIR=${CCCL_PREFIX}/lib/cmake/cccl" ENV "PATH=${path}")
  message(STATUS "add_subdirectory configure: ${configure_ms} ms")
  file(READ "${WORK_DIR}/build/CMakeCache.txt" cache)
  if(cache MATCHES "CMAKE_CUDA_COMPILER" OR IS_DIRECTORY "${WORK_DIR}/build/CMakeFiles/CheckCUDA")
    message(FATAL_ERROR "configuring kvevict as a subproject probed for a CUDA compiler")
  endif()
  expect_cccl_prefix("${WORK_DIR}/build")
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
  run("${WORK_DIR}/build/consumer" OUT out)
  expect("${out}" "consumer ok: seq keeps .* .no OpenMP." "the consumer without OpenMP")
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/build" --target par_without_openmp EXPECT_FAIL OUT out)
  expect("${out}" "kvevict::par needs OpenMP, and this translation unit is compiled without it"
         "par without OpenMP")

elseif(MODE STREQUAL "installed_tools")
  set(staged "${WORK_DIR}/staged")
  set(prefix "${WORK_DIR}/moved prefix")
  run(${CMAKE_COMMAND} --install "${KVEVICT_BINARY_DIR}" --prefix "${staged}" --component Tools)
  foreach(f bin/kvevict bin/kvevict-run bin/kvevict-lookahead share/kvevict/models/stories260K.bin
            share/kvevict/models/tok512.bin share/kvevict/models/LICENSE share/kvevict/models/lookahead/stories260K-n16.bin)
    if(NOT EXISTS "${staged}/${f}")
      message(FATAL_ERROR "the Tools install has no ${f}")
    endif()
  endforeach()
  # a moved prefix (with a space in its name) still finds its models
  file(RENAME "${staged}" "${prefix}")
  set(models "${prefix}/share/kvevict/models")
  execute_process(COMMAND "${prefix}/bin/kvevict-run" --help OUTPUT_VARIABLE out)
  expect_literal("${out}" "=${models}/stories260K.bin" "kvevict-run --help")
  expect_literal("${out}" "=${models}/tok512.bin" "kvevict-run --help")
  expect_literal("${out}" "=${models}/lookahead/stories260K-n16.bin" "kvevict-run --help")
  # the default model, tokenizer and LookaheadKV module: run.c's greedy ids
  run("${prefix}/bin/kvevict-run" --ids --steps 12 --recipe lookaheadkv --budget 512 ENV OMP_WAIT_POLICY=PASSIVE OUT out)
  expect("${out}" "^1 403 407 261 378 432 383 286 261 376 298 315 421\n$" "the installed kvevict-run")
  execute_process(COMMAND "${prefix}/bin/kvevict-lookahead" --help OUTPUT_VARIABLE out)
  expect_literal("${out}" "=${models}/stories260K.bin" "kvevict-lookahead --help")
  execute_process(COMMAND "${prefix}/bin/kvevict-lookahead" eval --help OUTPUT_VARIABLE out)
  expect_literal("${out}" "=${models}/lookahead/stories260K-n16.bin" "kvevict-lookahead eval --help")
  run("${prefix}/bin/kvevict-lookahead" info --module "${models}/lookahead/stories260K-n16.bin" OUT out)
  expect("${out}" "lookahead module v1 for dim 64" "installed kvevict-lookahead info")
  run("${prefix}/bin/kvevict" --help OUT out)
  expect("${out}" "--gqa-order" "installed kvevict --help")

else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()
message(STATUS "consumer.${MODE} passed")
