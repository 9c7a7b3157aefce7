# Locates CCCL (libcu++ for cuda::std::mdspan, CUB, Thrust: headers only), the only dependency of
# kvevict::kvevict. Used by the build and by the installed kvevictConfig.cmake. Two ways, tried in
# this order (find_package's own order):
#   1. a standalone CCCL: CCCL_DIR=<dir holding cccl-config.cmake>, or its install prefix in
#      CMAKE_PREFIX_PATH (NVIDIA's header-only CCCL, also packaged for conda and pip); no toolkit needed
#   2. the CUDA Toolkit's copy, <toolkit>/lib64/cmake/cccl (CUDA_PATH, CUDA_HOME, CUDAToolkit_ROOT,
#      /usr/local/cuda)
if(NOT TARGET CCCL::libcudacxx)
  set(_kvevict_cccl_hints)
  foreach(_root IN ITEMS "$ENV{CUDA_PATH}" "$ENV{CUDA_HOME}" "${CUDAToolkit_ROOT}" "/usr/local/cuda")
    if(_root)
      list(APPEND _kvevict_cccl_hints "${_root}/lib64/cmake" "${_root}/lib/cmake")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _kvevict_cccl_hints)
  find_package(CCCL CONFIG QUIET COMPONENTS libcudacxx CUB HINTS ${_kvevict_cccl_hints})
  if(NOT CCCL_FOUND OR NOT TARGET CCCL::libcudacxx OR NOT TARGET CCCL::CUB)
    message(FATAL_ERROR
      "kvevict needs CCCL's headers (libcu++ for cuda::std::mdspan, CUB, Thrust) and found none. "
      "Two ways to provide them:\n"
      "  1. a standalone CCCL, no CUDA toolkit needed (NVIDIA's header-only CCCL from "
      "github.com/NVIDIA/cccl, also packaged for conda and pip): pass "
      "-DCCCL_DIR=<dir containing cccl-config.cmake>, or add its install prefix to CMAKE_PREFIX_PATH;\n"
      "  2. the CUDA Toolkit 12.x or 13.x, which ships CCCL under <toolkit>/lib64/cmake/cccl; searched "
      "in ${_kvevict_cccl_hints}; set CUDA_PATH or CUDAToolkit_ROOT for another location.")
  endif()
  unset(_kvevict_cccl_hints)
endif()
# CCCL's targets are aliases of non-imported targets, which an export set cannot name; kvevict
# links this imported target instead, recreated here by the installed package config.
if(NOT TARGET kvevict_cccl)
  add_library(kvevict_cccl INTERFACE IMPORTED GLOBAL)
  target_link_libraries(kvevict_cccl INTERFACE CCCL::libcudacxx CCCL::CUB)
endif()
