// kvevict/backend.hpp: the execution backends every stage is overloaded on.
//
//   kvevict::seq   plain loops on the calling thread (the reference for determinism)
//   kvevict::par   OpenMP on the host; needs OpenMP (CMake: link kvevict::openmp): using it in a
//                  translation unit compiled without OpenMP is a compile error, not a silent seq
//   kvevict::cuda  kernels on a CUDA stream (overloads live in <kvevict/cuda/*.cuh>)
//   kvevict::on(ex) the host stages' loops on the caller's executor `ex` (an engine's own thread
//                  pool): kvevict starts no thread of its own; see `executor` below and docs/backends.md
//
// Every backend returns bit-identical kept sets and compacted caches for the same inputs.
#pragma once

#include <kvevict/config.hpp>

#include <type_traits>
#include <utility>

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

/// One parallel loop of a host stage as the caller's executor sees it: a non-owning reference to
/// the loop body (two pointers, no allocation). `task(begin, end, worker)` runs iterations
/// [begin, end) on the calling thread; `worker` names the scratch slot: an integer in
/// [0, ex.concurrency()) that no two concurrently running calls share.
class task_ref {
 public:
  template <class F, std::enable_if_t<!std::is_same_v<std::decay_t<F>, task_ref>, int> = 0>
  explicit task_ref(F& f) noexcept
      : body_(static_cast<void*>(&f)),
        run_([](void* b, index_t begin, index_t end, int worker) { (*static_cast<F*>(b))(begin, end, worker); }) {}
  void operator()(index_t begin, index_t end, int worker) const { run_(body_, begin, end, worker); }

 private:
  void* body_;
  void (*run_)(void*, index_t, index_t, int);
};

/// The executor concept kvevict::on(ex) needs (the engine's thread pool, or anything that can run
/// a loop; `ex` is taken by reference and must outlive the call):
///
///   int ex.concurrency() const        workers that may run tasks at once (>= 1; sizes the
///                                     per-worker scratch of workspace queries: query with the same ex)
///   void ex.parallel_for(index_t n, kvevict::task_ref task)
///                                     calls task(begin, end, worker) for disjoint ranges that
///                                     cover [0, n) exactly once, in any order and partition, each
///                                     with a worker id in [0, concurrency()) not used by another
///                                     call running at the same time; returns when all have returned
///
/// Running every range on the calling thread with worker 0 is a valid executor. Results never
/// depend on the partition or the order: on(ex) is bit-identical to seq and par. kvevict never
/// throws through task; the executor must not either (stages are noexcept-friendly).
template <class Executor>
struct executor_t {
  Executor* executor = nullptr;
};

/// The backend that runs on `ex` (see the concept above).
template <class Executor>
constexpr executor_t<Executor> on(Executor& ex) noexcept {
  return executor_t<Executor>{&ex};
}

template <class B>
struct is_executor_backend : std::false_type {};
template <class E>
struct is_executor_backend<executor_t<E>> : std::true_type {};
/// True for kvevict::on(ex)'s backend type.
template <class B>
inline constexpr bool is_executor_backend_v = is_executor_backend<B>::value;
/// True for the host backends: seq, par and on(ex).
template <class B>
inline constexpr bool is_host_backend_v =
    std::is_same_v<B, seq_t> || std::is_same_v<B, par_t> || is_executor_backend_v<B>;

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
