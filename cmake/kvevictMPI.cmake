# MPI for the sharded-eviction tests and benchmark (docs/distributed.md): optional, found quietly.
# Sets KVEVICT_MPIEXEC_FLAGS: the flags every mpirun command of ours passes. With Open MPI (what
# scripts/setup installs) that is --oversubscribe, so 4 ranks start on 2 cores; the environment of
# those tests (KVEVICT_MPI_TEST_ENV) lets Open MPI run as root, as CI does.
find_package(MPI QUIET COMPONENTS CXX)
set(KVEVICT_MPIEXEC_FLAGS ${MPIEXEC_PREFLAGS})
set(KVEVICT_MPI_TEST_ENV "OMP_WAIT_POLICY=PASSIVE")
if(MPI_CXX_FOUND)
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE _kvevict_mpiexec_version
                  ERROR_QUIET RESULT_VARIABLE _kvevict_mpiexec_rc)
  if(_kvevict_mpiexec_rc EQUAL 0 AND _kvevict_mpiexec_version MATCHES "Open MPI|OpenRTE")
    list(APPEND KVEVICT_MPIEXEC_FLAGS --oversubscribe)
    list(APPEND KVEVICT_MPI_TEST_ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
  endif()
endif()
