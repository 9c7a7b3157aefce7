// runner/workers.hpp: the usual worker of the examples' one thread pool (programs/pool.hpp): a
// single-threaded runner, a full-size cache and a growing scratch buffer.
//
//   std::vector<kvrun::runner_worker> workers(static_cast<std::size_t>(kvrun::thread_count(threads)));
//   for (auto& w : workers) KVEVICT_TRY(w.init(model));
//   KVEVICT_TRY(kvrun::for_each_item(workers, n, [&](kvrun::runner_worker& w, index_t i) {
//     return work(w.run, w.cache, i);   // writes item i's own output slot
//   }));
#pragma once

#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/ops.hpp>
#include <runner/runner.hpp>

#include "pool.hpp"

#include <vector>

namespace kvrun {

using kvevict::program::for_each_item;
using kvevict::program::grown;
using kvevict::program::with_workspace;

struct runner_worker {
  runner run;
  kv_cache cache;
  std::vector<unsigned char> scratch;

  status init(const model& m, runner_options o = {0, 0, 1}) {
    KVEVICT_TRY(run.init(m, o));
    return cache.init(m.cfg());
  }
};

}  // namespace kvrun
