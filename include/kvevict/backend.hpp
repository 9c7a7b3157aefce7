// kvevict/backend.hpp: the execution backends every stage is overloaded on.
//
//   kvevict::seq   plain loops on the calling thread (the reference for determinism)
//   kvevict::par   OpenMP on the host; without -fopenmp it runs the seq code path
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

}  // namespace kvevict
