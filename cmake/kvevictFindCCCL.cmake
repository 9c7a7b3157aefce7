# Locates CCCL (Thrust, CUB, libcu++) from the CUDA Toolkit, the only dependency of kvevict::kvevict.
# Used by the build and by the installed kvevictConfig.cmake.
if(NOT TARGET CCCL::libcudacxx)
  set(_kvevict_cccl_hints)
  foreach(_root IN ITEMS "$ENV{CUDA_PATH}" "$ENV{CUDA_HOME}" "${CUDAToolkit_ROOT}" "/usr/local/cuda")
    if(_root)
      list(APPEND _kvevict_cccl_hints "${_root}/lib64/cmake" "${_root}/lib/cmake")
    endif()
  endforeach()
  find_package(CCCL CONFIG QUIET COMPONENTS libcudacxx CUB HINTS ${_kvevict_cccl_hints})
  if(NOT CCCL_FOUND OR NOT TARGET CCCL::libcudacxx OR NOT TARGET CCCL::CUB)
    message(FATAL_ERROR
      "kvevict needs CCCL (libcu++ for cuda::std::mdspan, CUB and Thrust), which ships with the CUDA "
      "Toolkit under <cuda>/lib64/cmake/cccl/cccl-config.cmake. It was not found in: "
      "${_kvevict_cccl_hints}. Install the CUDA Toolkit (12.x or 13.x) or pass "
      "-DCCCL_DIR=<dir containing cccl-config.cmake>.")
  endif()
  unset(_kvevict_cccl_hints)
endif()
# CCCL's targets are aliases of non-imported targets, which an export set cannot name; kvevict
# links this imported target instead, recreated here by the installed package config.
if(NOT TARGET kvevict_cccl)
  add_library(kvevict_cccl INTERFACE IMPORTED GLOBAL)
  target_link_libraries(kvevict_cccl INTERFACE CCCL::libcudacxx CCCL::CUB)
endif()
