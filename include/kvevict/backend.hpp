// kvevict/backend.hpp: the execution backends every stage is overloaded on.
//
//   kvevict::seq   plain loops on the calling thread (the reference for determinism)
//   kvevict::par   OpenMP on the host; needs OpenMP (CMake: link kvevict::openmp): using it in a
//                  translation unit compiled without OpenMP is a compile error, not a silent seq
//   kvevict::cuda  kernels on a CUDA stream (overloads live in <kvevict/cuda/*.cuh>)
//
// Every backend returns bit-identical kept sets and compacted caches for the same inputs.
#pragma once

#if defined(_OPENMP)
#  include <omp.h>
#endif

struct CUstream_st;  // the type cudaStream_t points to; declared so no CUDA header is needed here

namespace kvevict {

struct seq_t {
  explicit constexpr seq_t() = default;
};
struct par_t {
  /// Number of OpenMP threads; 0 means the OpenMP default (OMP_NUM_THREADS or the core count).
  int threads = 0;
};
struct cuda_t {
  /// Stream the work is enqueued on; nullptr is the legacy default stream.
  CUstream_st* stream = nullptr;
};

inline constexpr seq_t seq{};
inline constexpr par_t par{};
inline constexpr cuda_t cuda{};

/// True when this translation unit was compiled with OpenMP, i.e. `par` really runs in parallel.
constexpr bool par_is_parallel() noexcept {
#if defined(_OPENMP)
  return true;
#else
  return false;
#endif
}

namespace detail {

/// par_is_parallel() as a dependent constant: a static_assert on it fires only when instantiated.
template <class Backend>
inline constexpr bool openmp_for = par_is_parallel();

/// Instantiated, as require_openmp<par_t>, by every par code path (in detail/base/parallel.hpp):
/// par without OpenMP would quietly run on one thread, so it does not compile instead.
template <class Backend>
constexpr void require_openmp() noexcept {
  static_assert(openmp_for<Backend>,
                "kvevict::par needs OpenMP, and this translation unit is compiled without it: link "
                "kvevict::openmp in CMake (or compile with -fopenmp), or use kvevict::seq (one thread)");
}

}  // namespace detail

}  // namespace kvevict
