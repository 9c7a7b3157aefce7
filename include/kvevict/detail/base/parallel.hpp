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

}  // inline namespace
}  // namespace kvevict::detail
