# kvevict's install rules (included last by the top-level CMakeLists.txt, so every target exists).
#   component Development: the headers and the CMake package (kvevict::kvevict, kvevict::openmp)
#   component Tools:       kvevict, kvevict-run, kvevict-lookahead and the model files they default
#                          to, under the GNU directories (bin/, share/kvevict/models/)
# `cmake --install <build>` installs both; `--component Development` only the library.
include(CMakePackageConfigHelpers)
set(_kvevict_cfgdir ${CMAKE_INSTALL_DATADIR}/cmake/kvevict)

install(TARGETS kvevict_lib EXPORT kvevictTargets COMPONENT Development)
install(DIRECTORY include/kvevict DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT Development)
install(EXPORT kvevictTargets NAMESPACE kvevict:: DESTINATION ${_kvevict_cfgdir} COMPONENT Development)
if(TARGET kvevict_openmp)
  # its own file: the package config loads it only when the consumer's compiler has OpenMP
  install(TARGETS kvevict_openmp EXPORT kvevictOpenMPTargets COMPONENT Development)
  install(EXPORT kvevictOpenMPTargets NAMESPACE kvevict:: DESTINATION ${_kvevict_cfgdir} COMPONENT Development)
endif()
configure_package_config_file(cmake/kvevictConfig.cmake.in
  ${PROJECT_BINARY_DIR}/kvevictConfig.cmake INSTALL_DESTINATION ${_kvevict_cfgdir})
# header-only: the version file must not reject consumers of another pointer size
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kvevictConfigVersion.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/kvevictConfig.cmake ${PROJECT_BINARY_DIR}/kvevictConfigVersion.cmake
  cmake/kvevictFindCCCL.cmake DESTINATION ${_kvevict_cfgdir} COMPONENT Development)

if(KVEVICT_BUILD_EXAMPLES)
  set(_kvevict_tools kvevict kvevict-run kvevict-lookahead)
  set(_kvevict_models_dir ${CMAKE_INSTALL_DATADIR}/kvevict/models)
  install(TARGETS ${_kvevict_tools} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT Tools)
  install(DIRECTORY models/ DESTINATION ${_kvevict_models_dir} COMPONENT Tools)
  # The tools find the installed models relative to their own directory (so a moved prefix works);
  # programs/shipped_models.hpp falls back to the source tree's models/ for binaries in the build tree.
  file(RELATIVE_PATH _kvevict_models_from_bindir ${CMAKE_INSTALL_FULL_BINDIR}
       ${CMAKE_INSTALL_FULL_DATADIR}/kvevict/models)
  foreach(_tool kvevict-run kvevict-lookahead)
    target_compile_definitions(${_tool} PRIVATE KVEVICT_MODELS_FROM_BINDIR="${_kvevict_models_from_bindir}")
  endforeach()
endif()
