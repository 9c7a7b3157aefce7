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

#include <kvevict/comm.hpp>
#include <kvevict/config.hpp>
#include <kvevict/status.hpp>

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <optional>

namespace kvevict {

namespace detail {
/// An MPI return code as a status: errc::io_error naming `who` and the call.
inline status mpi_check(const char* who, const char* call, int rc) noexcept {
  if (rc == MPI_SUCCESS) return {};
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return status::error(errc::io_error, "%s: %s failed: %s", who, call, text);
}
}  // namespace detail

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
  static status check(const char* call, int rc) noexcept { return detail::mpi_check("mpi_comm", call, rc); }

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

/// Tensor and pipeline parallelism together (comm.hpp's grid_place_of): the job's `tp x pp` ranks
/// split (MPI_Comm_split, collective over `world`) into this rank's stage (`tp()`, its `tp` head
/// shards) and the ranks holding its heads (`pp()`, one per stage). Owns both (MPI_Comm_free at
/// destruction, which must precede MPI_Finalize). Errors (the same on every rank: they depend only
/// on the arguments and the job's size): tp or pp < 1, tp pp != the ranks of `world`; an MPI error
/// (with MPI_ERRORS_RETURN) as errc::io_error.
class mpi_grid {
 public:
  mpi_grid() = default;
  mpi_grid(const mpi_grid&) = delete;
  mpi_grid& operator=(const mpi_grid&) = delete;
  ~mpi_grid() { release(); }

  status init(MPI_Comm world, int tp, int pp) noexcept {
    release();
    int rank = 0, size = 0;
    MPI_Comm_rank(world, &rank);
    MPI_Comm_size(world, &size);
    if (tp < 1 || pp < 1 || static_cast<long long>(tp) * pp != size)
      return status::error(errc::invalid_argument, "mpi_grid: a %d x %d grid (tp x pp) needs %lld ranks, the job has %d",
                           tp, pp, static_cast<long long>(tp) * (pp > 0 ? pp : 0), size);
    const grid_place at = grid_place_of(tp, pp, rank).value();
    int rc = MPI_Comm_split(world, at.stage, at.shard, &tp_);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_split(world, at.shard, at.stage, &pp_);
    if (rc != MPI_SUCCESS) {
      release();
      return detail::mpi_check("mpi_grid", "MPI_Comm_split", rc);
    }
    tp_comm_.emplace(tp_);
    pp_comm_.emplace(pp_);
    return {};
  }
  /// This rank's stage (rank: its head shard) and the ranks holding its heads (rank: its stage).
  /// Valid after a successful init().
  mpi_comm& tp() noexcept { return *tp_comm_; }
  mpi_comm& pp() noexcept { return *pp_comm_; }

 private:
  void release() noexcept {
    tp_comm_.reset();
    pp_comm_.reset();
    for (MPI_Comm* c : {&tp_, &pp_})
      if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
  }
  MPI_Comm tp_ = MPI_COMM_NULL, pp_ = MPI_COMM_NULL;
  std::optional<mpi_comm> tp_comm_, pp_comm_;
};

}  // namespace kvevict
