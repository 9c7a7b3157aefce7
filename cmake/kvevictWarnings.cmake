# Build settings shared by kvevict's own tests, tools and benchmarks (never imposed on consumers).
# They use the par backend, so they need kvevict::openmp.
if(NOT TARGET kvevict::openmp)
  message(FATAL_ERROR "kvevict's tests, examples, tools and benchmarks use the par backend, which needs "
    "OpenMP, and ${CMAKE_CXX_COMPILER} has none (for clang install libomp-dev). Without them "
    "(-DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_EXAMPLES=OFF -DKVEVICT_BUILD_BENCH=OFF) the library needs no OpenMP.")
endif()

add_library(kvevict_dev INTERFACE)
target_link_libraries(kvevict_dev INTERFACE kvevict::openmp)
target_compile_options(kvevict_dev INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion -Werror>)
if(KVEVICT_SANITIZE)
  target_compile_options(kvevict_dev INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer>)
  target_link_options(kvevict_dev INTERFACE -fsanitize=address,undefined)
endif()
