// programs/pool.hpp: the examples' one thread pool: one worker per OpenMP thread (a runner and
// its cache, an evaluator, a backprop scratch...), items handed out one at a time; and a worker's
// growing scratch for the library's two-phase calls (with_workspace). Not part of the library.
//
//   std::vector<kvrun::runner_worker> workers(static_cast<std::size_t>(kvrun::thread_count(threads)));
//   for (auto& w : workers) KVEVICT_TRY(w.init(model));       // runner/workers.hpp's worker
//   KVEVICT_TRY(kvevict::program::for_each_item(workers, n, [&](kvrun::runner_worker& w, index_t i) {
//     return work(w.run, w.cache, i);   // writes item i's own output slot
//   }));
//
// Which worker runs an item depends on the schedule, so an item's result must depend on the item
// alone (single-threaded workers, per-item outputs): then it does not depend on the thread count.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/status.hpp>
#include <kvevict/workspace.hpp>

#include <algorithm>
#include <cstddef>
#include <vector>

#if defined(_OPENMP)
#  include <omp.h>
#endif

namespace kvevict::program {

/// Runs work(workers[t], i) for every i in [0, n) on workers.size() threads, thread t using
/// workers[t], items scheduled dynamically one at a time. After each item, done(finished, t) is
/// called (one call at a time; `finished` counts the items done so far). A thread whose item
/// failed runs no more items; the first error in thread order is returned.
template <class Worker, class Work, class Done>
status for_each_item(std::vector<Worker>& workers, index_t n, Work&& work, Done&& done) {
  const int nt = static_cast<int>(workers.size());
  if (nt < 1) return status::error(errc::invalid_argument, "for_each_item: no workers");
  std::vector<status> errors(workers.size());
  index_t finished = 0;
#if defined(_OPENMP)
#  pragma omp parallel num_threads(nt)
#endif
  {
#if defined(_OPENMP)
    const int t = omp_get_thread_num();
#else
    const int t = 0;
#endif
    status& err = errors[static_cast<std::size_t>(t)];
#if defined(_OPENMP)
#  pragma omp for schedule(dynamic, 1)
#endif
    for (index_t i = 0; i < n; ++i) {
      if (!err.ok()) continue;
      err = work(workers[static_cast<std::size_t>(t)], i);
#if defined(_OPENMP)
#  pragma omp critical(kvevict_program_for_each_item_done)
#endif
      done(++finished, t);
    }
  }
  for (const status& e : errors)
    if (!e.ok()) return e;
  return {};
}

template <class Worker, class Work>
status for_each_item(std::vector<Worker>& workers, index_t n, Work&& work) {
  return for_each_item(workers, n, work, [](index_t, int) {});
}

/// `buf` grown to at least `bytes` (and 1): it only grows, so a worker stops allocating once it
/// has seen its largest shapes.
inline unsigned char* grown(std::vector<unsigned char>& buf, std::size_t bytes) {
  if (buf.size() < std::max<std::size_t>(bytes, 1)) buf.resize(std::max<std::size_t>(bytes, 1));
  return buf.data();
}

/// Calls f(ws) twice, the CUB way: a size query, then the work with `buf` grown to the size.
template <class F>
status with_workspace(std::vector<unsigned char>& buf, F&& f) {
  kvevict::workspace q;
  KVEVICT_TRY(f(q));
  kvevict::workspace ws{grown(buf, q.bytes), buf.size()};
  return f(ws);
}

}  // namespace kvevict::program
