// Host loop helpers shared by the seq and par backends.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/config.hpp>

#include <type_traits>

namespace kvevict::detail {

// The par code differs with and without -fopenmp; the inline namespace gives the two versions
// different mangled names, so mixing translation units built both ways is not an ODR violation.
// Every header whose body differs with -fopenmp opens this same namespace through the macro.
#if defined(_OPENMP)
#define KVEVICT_DETAIL_PAR_NAMESPACE par_openmp
#else
#define KVEVICT_DETAIL_PAR_NAMESPACE par_serial
#endif
inline namespace KVEVICT_DETAIL_PAR_NAMESPACE {

/// Threads a backend runs on (and per-thread scratch is sized for): 1 for seq; for par the
/// requested threads, or the OpenMP default when 0 (par does not compile without OpenMP).
inline int thread_count(seq_t) noexcept { return 1; }
template <class P, std::enable_if_t<std::is_same_v<P, par_t>, int> = 0>  // a template: see require_openmp
int thread_count(P p) noexcept {
  require_openmp<P>();
#if defined(_OPENMP)
  return p.threads > 0 ? p.threads : (omp_get_max_threads() > 0 ? omp_get_max_threads() : 1);
#else
  (void)p;
  return 1;
#endif
}

/// on(ex): the executor's concurrency (at least 1).
template <class E>
int thread_count(executor_t<E> e) noexcept {
  const int c = e.executor->concurrency();
  return c > 0 ? c : 1;
}

/// Calls f(i, worker) for i in [0, n) with a worker id in [0, workers) unique among concurrent
/// calls (the index of per-worker scratch). seq: in order, worker 0. par: OpenMP dynamic schedule
/// on at most `workers` threads. on(ex): through the executor, with its worker ids (which the
/// executor keeps below its concurrency()). Results must not depend on the worker or the order.
template <class F>
void parallel_for_workers(seq_t, index_t n, int, F&& f) {
  for (index_t i = 0; i < n; ++i) f(i, 0);
}
template <class F>
void parallel_for_workers(par_t, index_t n, int workers, F&& f) {
  require_openmp<std::conditional_t<true, par_t, F>>();
#if defined(_OPENMP)
  if (n > 1 && workers > 1) {
#  pragma omp parallel for schedule(dynamic, 1) num_threads(workers)
    for (index_t i = 0; i < n; ++i) f(i, omp_get_thread_num());
    return;
  }
#else
  (void)workers;
#endif
  for (index_t i = 0; i < n; ++i) f(i, 0);
}
template <class E, class F>
void parallel_for_workers(executor_t<E> e, index_t n, int, F&& f) {
  if (n <= 0) return;
  auto body = [&f](index_t b, index_t end, int worker) {
    for (index_t i = b; i < end; ++i) f(i, worker);
  };
  e.executor->parallel_for(n, task_ref(body));
}

/// Calls f(i) for i in [0, n). seq: in order on this thread.
template <class F>
void parallel_for(seq_t, index_t n, F&& f) {
  for (index_t i = 0; i < n; ++i) f(i);
}

/// par: statically scheduled OpenMP loop (deterministic partition; f must not depend on order).
template <class F>
void parallel_for(par_t p, index_t n, F&& f) {
  require_openmp<std::conditional_t<true, par_t, F>>();  // dependent on F, one specialization: one error
#if defined(_OPENMP)
  if (n > 1) {
    const int threads = p.threads > 0 ? p.threads : omp_get_max_threads();
#  pragma omp parallel for schedule(static) num_threads(threads)
    for (index_t i = 0; i < n; ++i) f(i);
    return;
  }
#else
  (void)p;
#endif
  for (index_t i = 0; i < n; ++i) f(i);
}

/// on(ex): the loop through the caller's executor (any partition; f must not depend on order).
/// A loop of one iteration runs on the calling thread, as with par.
template <class E, class F>
void parallel_for(executor_t<E> e, index_t n, F&& f) {
  if (n <= 0) return;
  if (n == 1) return (void)f(index_t{0});
  auto body = [&f](index_t b, index_t end, int) {
    for (index_t i = b; i < end; ++i) f(i);
  };
  e.executor->parallel_for(n, task_ref(body));
}

}  // inline namespace
}  // namespace kvevict::detail
