// A communicator whose ranks are threads of one process (kvevict/comm.hpp's contract), for tests
// of the sharded calls without mpirun. Collectives combine the ranks' contributions in rank order.
#pragma once

#include <kvevict/comm.hpp>

#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvtest {

class thread_world {
 public:
  explicit thread_world(int ranks) : ranks_(ranks), slots_(static_cast<std::size_t>(ranks)) {}
  int size() const { return ranks_; }

  /// Runs body(rank) on `ranks` threads and waits for all of them.
  static void run(int ranks, const std::function<void(class thread_comm&)>& body);

  void barrier() {
    std::unique_lock<std::mutex> lock(m_);
    const unsigned gen = gen_;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }
  std::vector<unsigned char>& slot(int r) { return slots_[static_cast<std::size_t>(r)]; }

 private:
  int ranks_;
  std::vector<std::vector<unsigned char>> slots_;
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  unsigned gen_ = 0;
};

class thread_comm {
 public:
  thread_comm(thread_world& w, int rank) : w_(&w), rank_(rank) {}
  int rank() const { return rank_; }
  int size() const { return w_->size(); }

  kvevict::status allreduce_sum(std::int64_t* data, kvevict::index_t n) { return reduce(data, n, false); }
  kvevict::status allreduce_sum(double* data, kvevict::index_t n) { return reduce(data, n, false); }
  kvevict::status exscan_sum(const std::int64_t* in, std::int64_t* out, kvevict::index_t n) {
    std::vector<std::int64_t> tmp(in, in + n);
    KVEVICT_TRY(reduce(tmp.data(), n, true));
    std::memcpy(out, tmp.data(), static_cast<std::size_t>(n) * sizeof(std::int64_t));
    return {};
  }
  kvevict::status allgather(const void* send, std::size_t bytes, void* recv) {
    publish(send, bytes);
    for (int r = 0; r < size(); ++r)
      if (bytes > 0) std::memcpy(static_cast<unsigned char*>(recv) + bytes * static_cast<std::size_t>(r), w_->slot(r).data(), bytes);
    w_->barrier();
    return {};
  }

 private:
  void publish(const void* data, std::size_t bytes) {
    auto& s = w_->slot(rank_);
    s.assign(static_cast<const unsigned char*>(data), static_cast<const unsigned char*>(data) + bytes);
    w_->barrier();
  }
  /// data[i] = sum over the ranks (below this one when `exclusive`), in rank order.
  template <class T>
  kvevict::status reduce(T* data, kvevict::index_t n, bool exclusive) {
    const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(T);
    publish(data, bytes);
    std::vector<T> acc(static_cast<std::size_t>(n), T(0)), part(static_cast<std::size_t>(n));
    const int upto = exclusive ? rank_ : size();
    for (int r = 0; r < upto; ++r) {
      if (bytes > 0) std::memcpy(part.data(), w_->slot(r).data(), bytes);
      for (kvevict::index_t i = 0; i < n; ++i) acc[static_cast<std::size_t>(i)] += part[static_cast<std::size_t>(i)];
    }
    w_->barrier();
    if (bytes > 0) std::memcpy(data, acc.data(), bytes);
    return {};
  }

  thread_world* w_;
  int rank_;
};

inline void thread_world::run(int ranks, const std::function<void(thread_comm&)>& body) {
  thread_world w(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&w, &body, r] {
      thread_comm c(w, r);
      body(c);
    });
  for (auto& t : threads) t.join();
}

}  // namespace kvtest
