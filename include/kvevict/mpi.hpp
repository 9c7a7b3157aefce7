// kvevict/mpi.hpp: the communicator contract (kvevict/comm.hpp) over an MPI communicator.
// Optional: only engines that use MPI include it (and link MPI, e.g. CMake's MPI::MPI_CXX);
// nothing else in kvevict includes <mpi.h>. docs/distributed.md.
//
//   kvevict::mpi_comm comm(MPI_COMM_WORLD);      // or the tensor- / pipeline-parallel group
//   adakv_budgets(seq, ws, comm, my_scores, nullptr, B, opt, cu, pos);
//
// Only MPI's C API is used: OpenMPI's deprecated C++ bindings, which <mpi.h> pulls in and which warn
// under -Wcast-function-type when MPI's headers are not system includes (CMake's MPI::MPI_CXX makes
// them system includes), can be left out with -DOMPI_SKIP_MPICXX.
//
// MPI errors: with MPI's default handler (MPI_ERRORS_ARE_FATAL) a failing collective aborts the
// job; with MPI_ERRORS_RETURN on the communicator, it comes back as errc::io_error naming the call.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/status.hpp>

#include <mpi.h>

#include <climits>
#include <cstdint>

namespace kvevict {

class mpi_comm {
 public:
  explicit mpi_comm(MPI_Comm comm) noexcept : comm_(comm) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm native() const noexcept { return comm_; }

  status allreduce_sum(std::int64_t* data, index_t n) noexcept {
    KVEVICT_TRY(count_fits("allreduce_sum", n));
    return check("MPI_Allreduce", MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_INT64_T, MPI_SUM, comm_));
  }
  status allreduce_sum(double* data, index_t n) noexcept {
    KVEVICT_TRY(count_fits("allreduce_sum", n));
    return check("MPI_Allreduce", MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_DOUBLE, MPI_SUM, comm_));
  }
  status exscan_sum(const std::int64_t* in, std::int64_t* out, index_t n) noexcept {
    KVEVICT_TRY(count_fits("exscan_sum", n));
    KVEVICT_TRY(check("MPI_Exscan", MPI_Exscan(in, out, static_cast<int>(n), MPI_INT64_T, MPI_SUM, comm_)));
    if (rank_ == 0)  // MPI leaves rank 0's output undefined
      for (index_t i = 0; i < n; ++i) out[i] = 0;
    return {};
  }
  status allgather(const void* send, std::size_t bytes, void* recv) noexcept {
    if (bytes > static_cast<std::size_t>(INT_MAX))
      return status::error(errc::size_overflow, "mpi_comm::allgather: %zu bytes per rank exceed MPI's int count", bytes);
    const void* src = send == static_cast<const char*>(recv) + bytes * static_cast<std::size_t>(rank_) ? MPI_IN_PLACE : send;
    return check("MPI_Allgather", MPI_Allgather(src, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes),
                                                MPI_BYTE, comm_));
  }

 private:
  static status count_fits(const char* fn, index_t n) noexcept {
    if (n < 0 || n > INT_MAX)
      return status::error(errc::size_overflow, "mpi_comm::%s: %lld elements exceed MPI's int count", fn,
                           static_cast<long long>(n));
    return {};
  }
  static status check(const char* call, int rc) noexcept {
    if (rc == MPI_SUCCESS) return {};
    char text[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    MPI_Error_string(rc, text, &len);
    return status::error(errc::io_error, "mpi_comm: %s failed: %s", call, text);
  }

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace kvevict
