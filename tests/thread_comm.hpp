// The tests' names for kvevict/thread_comm.hpp (ranks as threads of one process, the
// kvevict/comm.hpp contract): kvtest::thread_comm and kvtest::thread_world::run.
#pragma once

#include <kvevict/thread_comm.hpp>

#include <functional>

namespace kvtest {

using thread_comm = kvevict::thread_comm;

struct thread_world {
  /// Runs body(rank's communicator) on `ranks` threads and waits for all of them.
  static void run(int ranks, const std::function<void(thread_comm&)>& body) { kvevict::run_thread_ranks(ranks, body); }
};

}  // namespace kvtest
